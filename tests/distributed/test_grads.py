"""``all_reduce_grads`` on two CPU processes (gloo): gradients averaged over the ranks, a rank without one counting
zero, and a parameter no rank has a gradient for left without one, as in a single process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def test_gradients_average_over_ranks_and_one_no_rank_has_stays_none(tmp_path):
    prefix = tmp_path / "grads"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(Path(__file__).with_name("grads_worker.py")), str(prefix)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        grads = json.loads(Path(f"{prefix}.rank{rank}.json").read_text())
        # (1 + 2) / 2; (0 + 4) / 2 (rank 0 had none: a zero); none on either rank: no gradient, so AdamW skips it
        assert grads == {"both": [1.5, 1.5], "one": [2.0, 2.0, 2.0], "neither": None}
