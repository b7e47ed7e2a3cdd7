"""Throughput of the core's hot functions on this machine (median of repeats, after a warm-up).

    python -m benchmarks.core [--repeats 7]

Targets (issue "Foundation"): group_normalized on 1,000,000 rewards in 65,536 groups < 100 ms; knapsack over
100,000 prompts with budget 800,000 and n_max 64 < 200 ms.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mmrl.core import advantages, allocation, losses


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator caches, lazy kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description="core throughput")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(1_000_000, generator=g)
    groups = torch.randint(0, 65_536, (1_000_000,), generator=g)
    p = torch.rand(100_000, generator=g)
    logp = torch.randn(4096, 256, generator=g)
    old = logp + 0.01 * torch.randn(4096, 256, generator=g)
    adv = torch.randn(4096, 1, generator=g)
    mask = torch.ones(4096, 256)
    cases: dict[str, tuple[Callable[[], object], float | None]] = {
        "group_normalized 1M rewards / 65,536 groups": (
            lambda: advantages.group_normalized(rewards, groups),
            100.0,
        ),
        "knapsack 100k prompts, budget 800k, n_max 64": (
            lambda: allocation.knapsack(p, 800_000, n_min=1, n_max=64),
            200.0,
        ),
        "sqrt_rule 100k prompts, budget 800k, n_max 64": (
            lambda: allocation.sqrt_rule(p, 800_000, 1, 64),
            None,
        ),
        "rloo 1M rewards / 65,536 groups": (lambda: advantages.rloo(rewards, groups), None),
        "clipped_surrogate + aggregate 1M tokens": (
            lambda: losses.aggregate(losses.clipped_surrogate(logp, old, adv, 0.2, 0.28), mask),
            None,
        ),
    }
    results = {}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    for name, (fn, target) in cases.items():
        ms = median_ms(fn, args.repeats)
        results[name] = ms
        verdict = (
            "" if target is None else f"  (target < {target:.0f} ms: {'met' if ms < target else 'MISSED'})"
        )
        print(f"{name:50s} {ms:8.1f} ms{verdict}")
    return results


if __name__ == "__main__":
    main()
