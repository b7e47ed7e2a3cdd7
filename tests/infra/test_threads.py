"""CPU threading: the run's thread cap is applied in setup, the OpenMP wait policy follows the machine's state at
start and yields to the user's, and the adaptive short spin follows other processes' CPU use with hysteresis."""

import os
import subprocess
import sys
import time
from itertools import count

import pytest
import torch

import pipelines.threads as threads_module
from mmrl.bandit.trainer import BanditRecipeConfig, BanditTrainer
from mmrl.config import load_config
from pipelines.pool.executors import RayOptions
from pipelines.threads import (
    SHARED_WAIT_ENV,
    AdaptiveSpin,
    CpuSample,
    ShortSpin,
    adapt_cpu_threads,
    default_wait_policy,
    machine_busy_ticks,
    next_contended,
    others_busy_cores,
    others_running,
    own_ticks,
    set_cpu_threads,
    threads_spin,
)

# /proc/stat of a 2-core machine, as the kernel writes it (user nice system idle iowait irq softirq steal guest ..)
PROC_STAT = """cpu  2500 150 230 1000 40 0 10 8 0 0
cpu0 1200 100 100 500 20 0 5 4 0 0
cpu1 1300 50 130 500 20 0 5 4 0 0
intr 123456 0 0
ctxt 987654
procs_running 4
procs_blocked 0
"""
# /proc/self/stat with a command name that holds a space and a parenthesis; utime 700, stime 55
SELF_STAT = "4242 (python (x) y) R 1 4242 4242 0 -1 4194304 100 0 0 0 700 55 0 0 20 0 3 0 100 1000 50"


@pytest.fixture
def spinning_wait_policy(monkeypatch):
    # the test process may have started on a busy machine, which made its waiting threads sleep
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    set_cpu_threads(None)  # no adaptive thread count left behind for later tests


def test_run_threads_is_applied_in_setup(restore_threads):
    cfg = load_config(BanditRecipeConfig, None, ["run.threads=1", "run.progress=false"])
    BanditTrainer(cfg, None).setup()
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    assert set_cpu_threads(None) == 2  # null leaves torch's setting alone
    with pytest.raises(ValueError, match="threads must be >= 1"):
        set_cpu_threads(0)
    with pytest.raises(ValueError, match="threads policy must be 'adaptive' or 'fixed', got 'auto'"):
        set_cpu_threads(2, "auto")


# ------------------------------------------------------------------------------------------- /proc readings
def test_others_running_subtracts_this_process_running_threads():
    # 4 runnable tasks on the machine, two of them this process's (one main thread, one spinning OpenMP thread)
    assert others_running(PROC_STAT, ["R", "R", "S", "S"]) == 2
    assert others_running(PROC_STAT, ["R"] * 5) == 0  # read a moment apart: never negative
    with pytest.raises(ValueError, match="no procs_running line"):
        others_running("cpu 1 2 3\n", ["R"])


def test_busy_ticks_count_the_usable_cpus_without_idle_and_iowait():
    cpu0 = 1200 + 100 + 100 + 0 + 5 + 4
    cpu1 = 1300 + 50 + 130 + 0 + 5 + 4
    assert machine_busy_ticks(PROC_STAT, {0, 1}) == cpu0 + cpu1 == 2898
    assert machine_busy_ticks(PROC_STAT, {1}) == cpu1  # a process pinned to cpu1 sees cpu1's load only
    assert own_ticks(SELF_STAT) == 700 + 55


def test_others_busy_cores_is_the_machine_busy_time_less_this_process():
    before = CpuSample(machine_busy=10_000, own=2_000, seconds=50.0)
    # 0.5 s at 100 ticks/s: the machine was busy for 80 ticks, 30 of them this process's -> 50 ticks = 1 core
    after = CpuSample(machine_busy=10_080, own=2_030, seconds=50.5)
    assert others_busy_cores(before, after, 100) == pytest.approx(1.0)
    # this process alone kept both cores busy (spinning threads count as its own)
    assert others_busy_cores(before, CpuSample(10_100, 2_100, 50.5), 100) == 0.0
    assert others_busy_cores(before, CpuSample(10_100, 2_101, 50.5), 100) == 0.0  # never below 0


# --------------------------------------------------------------------------------------------- decisions
def test_next_contended_enters_when_others_take_a_core_this_process_uses():
    # 2 cores, 2 threads: no spare core, so half a core of others' work is contention
    assert next_contended(False, others=1.0, cores=2, threads=2)  # a 2-thread competitor took one core
    assert next_contended(False, others=0.55, cores=2, threads=2)
    assert not next_contended(False, others=0.45, cores=2, threads=2)  # inside the margin
    # 16 cores, 2 threads: others may use 14 before they reach this process's cores
    assert not next_contended(False, others=14.4, cores=16, threads=2)
    assert next_contended(False, others=14.6, cores=16, threads=2)


def test_next_contended_leaves_only_once_the_cores_are_free_again():
    assert next_contended(True, others=4 / 3, cores=2, threads=2)  # the competitor stays
    assert next_contended(True, others=0.3, cores=2, threads=2)  # 0.3 cores: hold
    assert not next_contended(True, others=0.25, cores=2, threads=2)
    assert not next_contended(True, others=0.0, cores=2, threads=2)


def test_next_contended_holds_its_state_between_the_margins():
    for others in (0.26, 0.35, 0.5):
        assert next_contended(True, others, cores=2, threads=2)
        assert not next_contended(False, others, cores=2, threads=2)
    with pytest.raises(ValueError, match="leave_margin < enter_margin"):
        next_contended(False, 1.0, 2, 2, enter_margin=0.25, leave_margin=0.5)


def _scripted_reader(others_per_window: list[float], window_s: float = 0.5, cores: int = 2):
    """A :class:`CpuSample` reader for windows in which others kept ``others_per_window[i]`` cores busy (this
    process the rest), at 100 ticks per second."""
    busy, own, seconds = 0, 0, 100.0
    samples = [CpuSample(busy, own, seconds)]
    for others in others_per_window:
        own += round((cores - others) * window_s * 100)
        busy += round(cores * window_s * 100)
        seconds += window_s
        samples.append(CpuSample(busy, own, seconds))
    return iter(samples).__next__


def test_adaptive_spin_follows_a_competitor_that_comes_and_goes():
    # quiet, a competitor arrives (1 core beside full spin, 4/3 beside short waits), stays, leaves; a short burst
    others = [0.05, 1.0, 4 / 3, 4 / 3, 0.4, 0.1, 0.6, 0.3, 0.0]
    adaptive = AdaptiveSpin(2, cores=2, read=_scripted_reader(others), ticks_per_second=100)
    assert [adaptive.probe() for _ in others] == [False, True, True, True, True, False, True, True, False]
    assert adaptive.others == pytest.approx(0.0)


def test_adaptive_spin_waits_for_a_long_enough_window():
    clock = count()
    # readings 0.1 s apart: only every second one closes a 0.2 s window
    samples = (CpuSample(20 * i, 10 * i, 0.1 * i) for i in clock)
    adaptive = AdaptiveSpin(2, cores=2, read=samples.__next__, ticks_per_second=100)
    assert not adaptive.probe()  # 0.1 s: no decision, others unknown
    assert adaptive.others == 0.0
    assert adaptive.probe()  # 0.2 s in which others took 1 core (40 busy ticks, 20 of them this process's)
    assert adaptive.others == pytest.approx(1.0)


def _os_threads() -> int:
    time.sleep(0.1)  # a released pool's threads end asynchronously
    return len(os.listdir("/proc/self/task"))


def test_short_spin_holds_an_openmp_pool_while_engaged(restore_threads):
    torch.set_num_threads(2)
    torch.ones(1 << 20).mul_(2)  # this thread's own team exists before counting
    short_spin = ShortSpin(threads=2, cores=2)
    before = _os_threads()
    for _ in range(2):
        short_spin.engage()
        short_spin.engage()  # engaged once, however often asked
        # the parked thread and its pool's second thread: 3 OpenMP threads on 2 CPUs
        assert short_spin.engaged and _os_threads() == before + 2
        assert torch.get_num_threads() == 2  # the steps' thread count is untouched
        short_spin.release()
        assert not short_spin.engaged and _os_threads() == before
    assert ShortSpin(threads=2, cores=16).pool_size == 16  # 2 + 16 - 1 OpenMP threads > 16 CPUs


def test_the_training_loop_shortens_the_spin_between_steps(
    monkeypatch, spinning_wait_policy, restore_threads
):
    # others' load per step: quiet, a competitor for three steps, quiet again
    others = [0.0, 0.0, 1.0, 4 / 3, 4 / 3, 0.1, 0.0, 0.0]
    monkeypatch.setattr(threads_module, "read_cpu_sample", _scripted_reader(others))
    cfg = load_config(
        BanditRecipeConfig,
        None,
        [
            "run.threads=2",
            "run.progress=false",
            f"trainer.steps={len(others) - 1}",
            f"trainer.eval_every={len(others)}",
        ],
    )
    assert cfg.run.threads_policy == "adaptive"
    trainer = BanditTrainer(cfg, None)
    trainer.setup()
    torch.ones(1 << 20).mul_(2)  # the main thread's team exists before counting
    quiet_threads = _os_threads()
    used = []
    step = trainer.train_step

    def recorded_step():
        used.append((threads_module._adaptive.short_spin.engaged, _os_threads() - quiet_threads))
        return step()

    trainer.train_step = recorded_step
    trainer.train()
    # each step follows the window of the step before; engaged: two more OpenMP threads in the process
    short = [(False, 0), (True, 2)]
    assert used == [short[0], short[0], short[1], short[1], short[1], short[0], short[0]]
    assert torch.get_num_threads() == 2


def test_fixed_policy_and_sleeping_waits_leave_the_spin_alone(
    monkeypatch, spinning_wait_policy, restore_threads
):
    monkeypatch.setattr(threads_module, "read_cpu_sample", _scripted_reader([1.5, 1.5]))
    set_cpu_threads(2, "fixed")
    assert adapt_cpu_threads() is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    set_cpu_threads(2, "adaptive")  # waits sleep at once already
    assert adapt_cpu_threads() is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    set_cpu_threads(1, "adaptive")  # one thread: no team, no wait
    assert adapt_cpu_threads() is None and torch.get_num_threads() == 1


def test_threads_spin_under_each_wait_policy():
    assert threads_spin({})
    assert threads_spin({"GOMP_SPINCOUNT": "2000"})
    assert threads_spin({"OMP_WAIT_POLICY": "ACTIVE"})
    assert not threads_spin({"OMP_WAIT_POLICY": "passive"})
    assert not threads_spin({"GOMP_SPINCOUNT": "0"})


# ----------------------------------------------------------------------------------------- wait policy
def test_wait_policy_sleeps_on_a_shared_machine_and_spins_on_an_idle_one(monkeypatch, spinning_wait_policy):
    assert default_wait_policy(shared=lambda: False) == {}  # libgomp's own spin
    assert "OMP_WAIT_POLICY" not in os.environ
    assert default_wait_policy(shared=lambda: True) == SHARED_WAIT_ENV == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert default_wait_policy(shared=lambda: False) == SHARED_WAIT_ENV  # a process chooses once


def test_wait_policy_yields_to_the_users_choice(monkeypatch, spinning_wait_policy):
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert default_wait_policy(shared=lambda: True) == {"GOMP_SPINCOUNT": "1000"}


def _policy_seen_by_a_fresh_process(env: dict[str, str]) -> str:
    code = "import mmrl, os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_importing_mmrl_keeps_the_users_wait_policy():
    assert _policy_seen_by_a_fresh_process({"OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE None"
    assert _policy_seen_by_a_fresh_process({"GOMP_SPINCOUNT": "1000"}) == "None 1000"
    assert _policy_seen_by_a_fresh_process({}) in ("PASSIVE None", "None None")  # by the machine's state


def test_ray_actors_inherit_the_wait_policy_unless_their_env_sets_it(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert RayOptions().actor_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
    own = RayOptions(runtime_env={"env_vars": {"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}, "pip": ["a"]})
    assert own.actor_runtime_env() == {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}, "pip": ["a"]}
