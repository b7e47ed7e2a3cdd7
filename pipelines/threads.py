"""CPU threading of torch, set the same way in trainers, rollout workers and reward servers.

Two settings decide how a torch process behaves on a CPU it shares with other busy processes:

* the number of intra-op threads (``torch.set_num_threads``), which a run may cap;
* what an OpenMP thread does while it waits for its peers at the end of a parallel region. libgomp (the OpenMP
  runtime of the torch wheels on Linux) spins for a while before it sleeps. On a machine with idle cores that
  saves a wake-up; on a shared CPU a peer thread that the kernel descheduled makes the others spin through their
  whole time slice. Measured on a 2-core machine beside another 2-thread torch process (``benchmarks/shared_cpu.py``,
  BENCHMARKS.md): with libgomp's default (300,000 spins) a flow demo step took 4.3x its quiet time and a VLM
  step 17.5x; sleeping at once (``OMP_WAIT_POLICY=PASSIVE``) kept them at 1.5x and 1.2x but cost 25-31% on a
  quiet machine (a wake-up per parallel region); 2,000 spins, the default here, kept the quiet speed (flow 1.03x,
  VLM 1.17x of libgomp's) and the loaded steps at 2.4x and 1.8x.

The wait policy is read once, when the OpenMP runtime loads (``import torch``), so it is an environment variable
set before that: :data:`CPU_WAIT_ENV` holds the default mmrl uses, applied by :func:`default_wait_policy` from
``mmrl`` and ``pipelines`` imports (an explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the environment
always wins) and passed to Ray actors, which start new processes.
"""

from __future__ import annotations

import os

__all__ = ["CPU_WAIT_ENV", "default_wait_policy", "set_cpu_threads"]

#: libgomp environment that makes waiting threads spin briefly, then sleep (see the module docstring); on a machine
#: you know to be shared, ``OMP_WAIT_POLICY=PASSIVE`` in the environment trades about a quarter of the quiet speed
#: for the smallest slowdown
CPU_WAIT_ENV: dict[str, str] = {"GOMP_SPINCOUNT": "2000"}


def default_wait_policy() -> dict[str, str]:
    """Set :data:`CPU_WAIT_ENV` in ``os.environ`` unless the user chose a policy; returns what is in force.

    Has an effect only before the OpenMP runtime is loaded (before the first ``import torch`` of the process).
    """
    if not any(key in os.environ for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        os.environ.update(CPU_WAIT_ENV)
    return {key: os.environ[key] for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if key in os.environ}


def set_cpu_threads(threads: int | None) -> int:
    """Cap torch's intra-op CPU threads at ``threads`` (``None``: leave torch's default, one per core).

    Returns:
        The number of threads in force.

    Raises:
        ValueError: ``threads < 1``.
    """
    import torch

    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1 or null, got {threads}")
        torch.set_num_threads(threads)
    return torch.get_num_threads()
