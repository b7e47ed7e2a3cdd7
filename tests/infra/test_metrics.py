"""The per-step metric accumulator: weighted means, maxima, values dropped inside ``discarded``, and the
reduction over two gloo ranks (each holding metrics the other lacks)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmrl.run import MetricAccumulator


def test_means_are_weighted_by_count_and_maxima_kept_and_nan_skipped():
    metrics = MetricAccumulator()
    metrics.add("reward/mean", 0.5, count=8)
    metrics.add("reward/mean", 1.0, count=2)  # (0.5 * 8 + 1.0 * 2) / 10
    metrics.add("reward/mean", math.nan, count=100)
    metrics.add_max("pool/lag_max", 2)
    metrics.add_max("pool/lag_max", torch.tensor(1.0))
    with metrics.discarded():  # a padding minibatch's values
        metrics.add("reward/mean", 100.0)
        metrics.add_max("pool/lag_max", 9)
        metrics.add("only/inside", 1.0)
    assert metrics.reduce() == pytest.approx({"reward/mean": 0.6, "pool/lag_max": 2.0})
    assert metrics.reduce() == {}  # cleared


def _rank(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    metrics = MetricAccumulator()
    metrics.add("reward/mean", [0.0, 1.0][rank], count=[3, 1][rank])
    metrics.add_max("pool/lag_max", [4, 1][rank])
    if rank == 1:  # a metric only one rank has
        metrics.add("train/skipped_no_signal", 1.0)
        metrics.add_max("only/one_max", 7)
    torch.save(metrics.reduce(), f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_two_ranks_reduce_the_union_of_their_metrics(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "metrics")
    mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    reduced = [torch.load(f"{out}.{rank}") for rank in range(2)]
    assert (
        reduced[0]
        == reduced[1]
        == pytest.approx(
            {"reward/mean": 0.25, "pool/lag_max": 4.0, "train/skipped_no_signal": 1.0, "only/one_max": 7.0}
        )
    )
