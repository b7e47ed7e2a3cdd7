"""CPU threading of torch, set the same way in trainers, rollout workers and reward servers.

Two settings decide how a torch process behaves on a CPU it shares with other busy processes:

* the number of intra-op threads (``torch.set_num_threads``), which a run may cap;
* what an OpenMP thread does while it waits for its peers at the end of a parallel region. libgomp (the OpenMP
  runtime of the torch wheels on Linux) spins 300,000 times before it sleeps. On a machine with idle cores that
  saves a wake-up; on a shared CPU a peer thread that the kernel descheduled makes the others spin through their
  whole time slice. The policy (``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is read once, when the runtime loads.

Measured on a 2-core machine beside another 2-thread torch process (``benchmarks/shared_cpu.py``, BENCHMARKS.md):
with libgomp's spin a flow demo step took 3.8x its quiet time and a VLM step 23-39x; sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) kept them at 1.9x and 1.3x but cost 14-28% on the quiet machine (a wake-up per
parallel region); no single setting does both. So mmrl decides from what the machine is doing, twice:

1. **At process start** (:func:`default_wait_policy`, run by ``import mmrl`` / ``import pipelines`` before torch
   loads): when other processes keep cores busy (:func:`machine_is_shared`: the median number of runnable tasks
   of other processes over about 40 ms reaches half the cores), waiting threads sleep at once
   (``OMP_WAIT_POLICY=PASSIVE``) for the whole process; on an idle machine libgomp's own spin stays. An explicit
   ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment always wins; Ray actors inherit what is in force.
2. **Between steps**, where waits spin (:class:`AdaptiveSpin`, ``run.threads_policy: adaptive``): the CPU time
   other processes took during the last step (``/proc/stat`` less this process's share) says whether they now use
   the cores this process's threads need; while they do, :class:`ShortSpin` makes every wait spin only briefly
   (libgomp's documented short spin for processes with more OpenMP threads than CPUs, brought about by a parked,
   sleeping OpenMP pool), and full spinning returns once the cores are free. The thread count never changes.
   The margins of :func:`next_contended` keep it from flapping. Measured with a competitor that starts during
   a run: noticed after one step; from then on flow 2.2x, VLM 1.6x the quiet step time.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = [
    "SHARED_WAIT_ENV",
    "AdaptiveSpin",
    "CpuSample",
    "ShortSpin",
    "ThreadsPolicy",
    "adapt_cpu_threads",
    "default_wait_policy",
    "machine_is_shared",
    "next_contended",
    "others_busy_cores",
    "others_running",
    "read_cpu_sample",
    "set_cpu_threads",
    "stop_adapting",
    "threads_spin",
]

logger = logging.getLogger(__name__)

ThreadsPolicy = Literal["adaptive", "fixed"]

#: the libgomp environment a process gets when it starts on a shared machine: waiting threads sleep at once
SHARED_WAIT_ENV: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}
_WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_PROC = Path("/proc")


def _usable_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------- reading /proc
def others_running(proc_stat: str, own_task_states: list[str]) -> int:
    """Runnable tasks of other processes at one moment: ``procs_running`` of ``/proc/stat`` (every runnable task
    of the machine, this process's included) minus this process's tasks in state ``R``.

    Args:
        proc_stat: the text of ``/proc/stat``.
        own_task_states: the state letter of each of this process's threads (``/proc/self/task/*/stat``).

    Raises:
        ValueError: ``proc_stat`` has no ``procs_running`` line.
    """
    for line in proc_stat.splitlines():
        if line.startswith("procs_running "):
            return max(0, int(line.split()[1]) - sum(state == "R" for state in own_task_states))
    raise ValueError("/proc/stat has no procs_running line")


def _fields_from_state(stat_line: str) -> list[str]:
    """The fields of a ``/proc/.../stat`` line from field 3 (the state) on: the command name (field 2) may hold
    spaces and parentheses, so they follow the last ``)``."""
    return stat_line[stat_line.rindex(")") + 2 :].split()


def _own_task_states(proc: Path = _PROC) -> list[str]:
    states = []
    for task in (proc / "self" / "task").iterdir():
        try:
            states.append(_fields_from_state((task / "stat").read_text())[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended between listing and reading
            continue
    return states


def machine_is_shared(samples: int = 10, interval_s: float = 0.004, proc: Path = _PROC) -> bool:
    """Whether other processes keep at least half of this process's cores busy (at least one core): the median of
    :func:`others_running` over ``samples`` readings ``interval_s`` apart (about 40 ms), so that one short
    command of another process does not decide a whole run. ``False`` where ``/proc`` cannot be read."""
    readings = []
    try:
        for index in range(samples):
            if index:
                time.sleep(interval_s)
            readings.append(others_running((proc / "stat").read_text(), _own_task_states(proc)))
    except (OSError, ValueError):
        return False
    return statistics.median(readings) >= max(1, len(_usable_cpus()) // 2)


@dataclass(frozen=True)
class CpuSample:
    """CPU time counters read at one moment, in clock ticks (``os.sysconf("SC_CLK_TCK")`` per second).

    Attributes:
        machine_busy: ticks the CPUs this process may run on spent busy (user, nice, system, irq, softirq, steal),
            summed over those CPUs since boot.
        own: ticks this process ran (user + system, all its threads).
        seconds: a monotonic clock, seconds.
    """

    machine_busy: int
    own: int
    seconds: float


def machine_busy_ticks(proc_stat: str, cpus: set[int]) -> int:
    """Busy ticks of the CPUs ``cpus`` in the text of ``/proc/stat``: user + nice + system + irq + softirq + steal
    of each ``cpuN`` line (idle and iowait are not busy; guest time is already inside user)."""
    total = 0
    for line in proc_stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def own_ticks(self_stat: str) -> int:
    """utime + stime of ``/proc/self/stat`` (fields 14 and 15), in ticks."""
    fields = _fields_from_state(self_stat)
    return int(fields[11]) + int(fields[12])


def read_cpu_sample(proc: Path = _PROC) -> CpuSample:
    """A :class:`CpuSample` of now, from ``/proc/stat`` and ``/proc/self/stat``."""
    return CpuSample(
        machine_busy=machine_busy_ticks((proc / "stat").read_text(), _usable_cpus()),
        own=own_ticks((proc / "self" / "stat").read_text()),
        seconds=time.monotonic(),
    )


def others_busy_cores(before: CpuSample, after: CpuSample, ticks_per_second: float) -> float:
    """Cores other processes kept busy between two samples, on average:

        others = ((busy_after - busy_before) - (own_after - own_before)) / ticks_per_second / (t_after - t_before)

    (never below 0: the two counters are read a moment apart). Spinning threads of this process count as its own.
    """
    ticks = (after.machine_busy - before.machine_busy) - (after.own - before.own)
    return max(0.0, ticks / ticks_per_second / (after.seconds - before.seconds))


# ------------------------------------------------------------------------------------------------- decision
def next_contended(
    contended: bool,
    others: float,
    cores: int,
    threads: int,
    enter_margin: float = 0.5,
    leave_margin: float = 0.25,
) -> bool:
    """Whether the next step counts as contended, from the cores other processes kept busy during the last one.

    With ``spare = cores - threads`` (the cores this process's threads leave to others):

    * enter when ``others > spare + enter_margin``;
    * leave when ``others <= spare + leave_margin``;
    * in between, stay as it was (on 2 cores with 2 threads: contended from 0.5 cores of others' work up, free
      again at 0.25 or less), so a load near one edge does not flip it every step.

    Raises:
        ValueError: the margins do not satisfy ``0 <= leave_margin < enter_margin``.
    """
    if not 0 <= leave_margin < enter_margin:
        raise ValueError(f"need 0 <= leave_margin < enter_margin, got {leave_margin} and {enter_margin}")
    spare = cores - threads
    if others > spare + enter_margin:
        return True
    if others <= spare + leave_margin:
        return False
    return contended


class ShortSpin:
    """libgomp's short spin, switched on and off in a running process.

    libgomp makes a waiting thread spin ``GOMP_SPINCOUNT`` times (300,000 by default) before it sleeps, but only
    100 times (1,000 under ``OMP_WAIT_POLICY=ACTIVE``, never more than ``GOMP_SPINCOUNT``) while the process has
    more OpenMP threads than CPUs (the libgomp manual on ``GOMP_SPINCOUNT``; it checks at every wait). While
    engaged, a parked thread holds an OpenMP pool of its own, ``cores - threads + 2`` threads that sleep: the
    process then has more OpenMP threads than CPUs and every wait spins briefly, almost ``PASSIVE``. Released, the
    parked thread ends, its pool with it, and waits spin fully again. Other OpenMP runtimes (LLVM's or Intel's,
    which other torch builds use) do not count threads this way; there it changes nothing.

    Args:
        threads: the intra-op threads of the process.
        cores: the CPUs the process may use.
    """

    def __init__(self, threads: int, cores: int) -> None:
        self.threads = threads
        self.pool_size = max(2, cores - threads + 2)
        self.parked: threading.Thread | None = None
        self.stop = threading.Event()

    @property
    def engaged(self) -> bool:
        return self.parked is not None

    def engage(self) -> None:
        """Park the pool-holding thread (returns once its pool exists); nothing if engaged."""
        if self.parked is not None:
            return
        ready, self.stop = threading.Event(), threading.Event()
        self.parked = threading.Thread(
            target=self._hold, args=(ready, self.stop), name="short-spin", daemon=True
        )
        self.parked.start()
        ready.wait()

    def release(self) -> None:
        """End the parked thread and its pool; nothing if released."""
        if self.parked is None:
            return
        self.stop.set()
        self.parked.join()
        self.parked = None

    def _hold(self, ready: threading.Event, stop: threading.Event) -> None:
        import torch

        torch.set_num_threads(self.pool_size)
        # one parallel region of pool_size threads (torch splits an elementwise op in 32,768-element chunks):
        # libgomp keeps them in this thread's pool, asleep, until the thread ends
        torch.ones(self.pool_size * 65536).mul_(2)
        torch.set_num_threads(self.threads)  # torch's count for threads started later stays the process's
        ready.set()
        stop.wait()


class AdaptiveSpin:
    """Shortens the OpenMP spin (:class:`ShortSpin`) while other processes keep this process's cores busy.

    :meth:`apply` is called before every step (by the training loop and by rollout workers): when at least
    ``min_window_s`` passed since the last reading it measures the cores others used (:func:`others_busy_cores`),
    decides with :func:`next_contended` and engages or releases the short spin. The thread count never changes,
    so the numbers a step computes do not either.

    Args:
        threads: the process's intra-op threads (``run.threads``, else torch's default).
        cores: the cores this process may use (default: its CPU affinity).
        read: returns a :class:`CpuSample` (default: :func:`read_cpu_sample`; tests pass readings made by hand).
        ticks_per_second: the unit of the tick counters (default: ``SC_CLK_TCK``).
        min_window_s: shortest window worth a decision (ticks are 10 ms; shorter steps share a window).
    """

    def __init__(
        self,
        threads: int,
        cores: int | None = None,
        read: Callable[[], CpuSample] | None = None,
        ticks_per_second: float | None = None,
        min_window_s: float = 0.2,
    ) -> None:
        self.threads = threads
        self.cores = cores or len(_usable_cpus())
        self.read = read or read_cpu_sample
        self.ticks_per_second = ticks_per_second or os.sysconf("SC_CLK_TCK")
        self.min_window_s = min_window_s
        self.contended = False
        self.others = 0.0  # cores others used in the last window
        self.short_spin = ShortSpin(threads, self.cores)
        self.last = self.read()
        self.lock = threading.Lock()

    def probe(self) -> bool:
        """Read the counters (when the window is long enough); returns whether the next step is contended."""
        with self.lock:
            now = self.read()
            if now.seconds - self.last.seconds >= self.min_window_s:
                self.others = others_busy_cores(self.last, now, self.ticks_per_second)
                self.contended = next_contended(self.contended, self.others, self.cores, self.threads)
                self.last = now
            return self.contended

    def apply(self) -> bool:
        """:meth:`probe`, then engage or release the short spin to match; returns whether it is engaged."""
        contended = self.probe()
        with self.lock:
            if contended:
                self.short_spin.engage()
            else:
                self.short_spin.release()
        return contended

    def close(self) -> None:
        """Release the short spin."""
        with self.lock:
            self.short_spin.release()


_adaptive: AdaptiveSpin | None = None


def adapt_cpu_threads() -> bool | None:
    """Before a step: whether waiting OpenMP threads spin briefly for it (other processes keep the cores busy),
    or ``None`` when the process's waits are fixed (``set_cpu_threads`` with ``policy="fixed"``, or never
    called)."""
    return _adaptive.apply() if _adaptive is not None else None


def stop_adapting() -> None:
    """Release the process's adaptive short spin, if any (a trainer's cleanup); waits spin as they started."""
    global _adaptive
    if _adaptive is not None:
        _adaptive.close()
        _adaptive = None


# -------------------------------------------------------------------------------------------- process setup
def default_wait_policy(shared: Callable[[], bool] = machine_is_shared) -> dict[str, str]:
    """Choose the OpenMP wait policy of this process unless the user did; returns what is in force.

    On a machine that ``shared()`` finds busy, :data:`SHARED_WAIT_ENV` goes into ``os.environ``; on an idle one
    nothing does (libgomp's own spin). Has an effect only before the OpenMP runtime is loaded (before the first
    ``import torch`` of the process); later calls of a process that already chose return the same.
    """
    if not any(key in os.environ for key in _WAIT_KEYS) and shared():
        os.environ.update(SHARED_WAIT_ENV)
    return {key: os.environ[key] for key in _WAIT_KEYS if key in os.environ}


def threads_spin(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether waiting OpenMP threads spin under the wait policy in ``env`` (not ``PASSIVE``, spin count not 0)."""
    return (
        env.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE" and env.get("GOMP_SPINCOUNT", "1").strip() != "0"
    )


def set_cpu_threads(threads: int | None, policy: ThreadsPolicy = "fixed") -> int:
    """Cap torch's intra-op CPU threads at ``threads`` (``None``: leave torch's default, one per core).

    ``policy="adaptive"`` also makes :func:`adapt_cpu_threads` shorten the OpenMP spin while other processes
    keep the cores busy and restore it once they stop (:class:`AdaptiveSpin`); it is left off where waiting
    threads do not spin anyway (``OMP_WAIT_POLICY=PASSIVE``) and where one thread is configured (no team, no
    wait). ``"fixed"`` keeps the wait policy the process started with. Either way the thread count stays.
    A previous adaptive setting of the process is released.

    Returns:
        The number of threads in force.

    Raises:
        ValueError: ``threads < 1`` or an unknown ``policy``.
    """
    import torch

    global _adaptive
    if policy not in ("adaptive", "fixed"):
        raise ValueError(f"threads policy must be 'adaptive' or 'fixed', got {policy!r}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(threads)
    configured = torch.get_num_threads()
    stop_adapting()
    if policy == "adaptive" and configured > 1 and threads_spin():
        try:
            _adaptive = AdaptiveSpin(configured)
        except OSError as err:  # no /proc (not Linux): the spin stays as the process started
            logger.warning("adaptive OpenMP waits need /proc/stat (%s); the spin stays as it is", err)
    return configured
