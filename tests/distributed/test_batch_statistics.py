"""Batch-level advantage statistics under data parallelism, on two CPU processes (gloo): ``global_std``'s std,
GDPO's whitening and the single-rollout scaling are taken over every rank's rewards, as Flow-GRPO takes them over
the gathered batch, so two ranks get the advantages one process gets on the two halves together."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmrl.core.estimators import RewardBatch, estimate
from tests.distributed.batch_stats_worker import BASELINE, GROUPS, RAW, WEIGHTS

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def test_batch_statistics_span_every_rank(tmp_path):
    prefix = tmp_path / "stats"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(Path(__file__).with_name("batch_stats_worker.py")), str(prefix), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in (0, 1)]

    # one process holding both halves (rank 1's prompts are groups 2 and 3)
    raw = torch.cat(RAW)
    whole = RewardBatch(raw @ WEIGHTS, torch.cat([GROUPS, GROUPS + 2]), raw, WEIGHTS, torch.cat(BASELINE))
    expected = {
        "global_std": estimate("global_std", whole).adv,
        "gdpo": estimate("gdpo", whole).adv,
        "single": estimate("single", whole).adv,
        "single_centred": estimate("single", whole, center=True).adv,
        "trainer_global_std": estimate("global_std", RewardBatch(raw[:, 0], whole.group_ids)).adv,
    }
    for name, adv in expected.items():
        both = torch.tensor(ranks[0][name] + ranks[1][name])
        torch.testing.assert_close(both, adv, rtol=1e-6, atol=1e-6, msg=name)
    # by hand: rank 0's first prompt 0.20, 0.21 is centred to -+0.005 and divided by the std of all 8 first
    # rewards, 0.350526 (divided by rank 0's own std, 0.011180, it was -+0.447)
    torch.testing.assert_close(
        expected["trainer_global_std"][:2],
        torch.tensor([-0.005, 0.005]) / (0.350526 + 1e-6),
        rtol=1e-5,
        atol=0,
    )
