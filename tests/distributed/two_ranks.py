"""Running a worker script on two CPU processes (gloo) under ``torch.distributed.run``, for the tests of one
collective at a time (the whole-trainer launches are ``test_data_parallel.launch``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

#: the module mark of every test that launches ranks
needs_gloo = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


def run_two_ranks(worker: str, *args: str, timeout: float = 300) -> None:
    """Run ``tests/distributed/WORKER`` with ``args`` on two ranks from the repository root, one thread each.

    Raises:
        AssertionError: a rank failed, with the end of its standard error.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(Path(__file__).with_name(worker)), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
