"""CPU threading: the run's thread cap is applied in setup, the OpenMP wait default yields to the user's."""

import os
import subprocess
import sys

import pytest
import torch

from mmrl.bandit.trainer import BanditRecipeConfig, BanditTrainer
from mmrl.config import load_config
from pipelines.pool.executors import RayOptions
from pipelines.threads import CPU_WAIT_ENV, set_cpu_threads


def test_run_threads_is_applied_in_setup():
    before = torch.get_num_threads()
    try:
        cfg = load_config(BanditRecipeConfig, None, ["run.threads=1", "run.progress=false"])
        BanditTrainer(cfg, None).setup()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert set_cpu_threads(None) == before  # null leaves torch's setting alone
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_cpu_threads(0)


def _policy_seen_by_a_fresh_process(env: dict[str, str]) -> str:
    code = "import mmrl, os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_wait_policy_defaults_to_a_short_spin_and_yields_to_the_users_choice():
    assert CPU_WAIT_ENV == {"GOMP_SPINCOUNT": "2000"}
    assert _policy_seen_by_a_fresh_process({}) == "None 2000"
    assert _policy_seen_by_a_fresh_process({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE None"
    assert _policy_seen_by_a_fresh_process({"GOMP_SPINCOUNT": "1000"}) == "None 1000"


def test_ray_actors_inherit_the_wait_policy_unless_their_env_sets_it(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert RayOptions().actor_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    own = RayOptions(runtime_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}, "pip": ["a"]})
    assert own.actor_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}, "pip": ["a"]}
