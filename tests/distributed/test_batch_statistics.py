"""Batch-level advantage statistics under data parallelism, on two CPU processes (gloo): ``global_std``'s std,
GDPO's whitening and the single-rollout scaling are taken over every rank's rewards, as Flow-GRPO takes them over
the gathered batch, so two ranks get the advantages one process gets on the two halves together."""

import json
from pathlib import Path

import torch

from mmrl.core.estimators import RewardBatch, estimate
from tests.distributed.batch_stats_worker import BASELINE, GROUPS, RAW, WEIGHTS
from tests.distributed.two_ranks import needs_gloo, run_two_ranks

pytestmark = needs_gloo


def test_batch_statistics_span_every_rank(tmp_path):
    prefix = tmp_path / "stats"
    args = [str(prefix), str(tmp_path)]
    run_two_ranks("batch_stats_worker.py", *args)
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
