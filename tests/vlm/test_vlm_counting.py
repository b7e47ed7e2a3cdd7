"""The counting diagnostics of ``python -m benchmarks.vlm_counting``: the probe by hand, the trace tally on the
committed reasoning checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks import vlm_counting
from mmrl.data.shapes import COLOURS

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm_reason"


def test_probe_reads_counts_that_are_linear_in_the_features_and_not_noise():
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 4, (400, len(COLOURS)), generator=generator).float()
    mixing = torch.randn(len(COLOURS), 16, generator=generator)
    features = counts @ mixing  # every count a linear function of the features
    train, test = (features[:300], counts[:300]), (features[300:], counts[300:])
    assert vlm_counting.probe_accuracy(train, test, ridge=1e-4).tolist() == [1.0] * len(COLOURS)
    noise = torch.randn(400, 16, generator=generator)
    blind = vlm_counting.probe_accuracy((noise[:300], counts[:300]), (noise[300:], counts[300:]), ridge=1e-4)
    assert blind.max() < 0.5


def test_trace_tally_of_the_committed_checkpoint():
    results = vlm_counting.main(
        [str(CHECKPOINT), "--questions", "36", "--probe-train", "200", "--probe-test", "100"]
    )
    result = results[str(CHECKPOINT)]
    rows = result["trace"]
    assert set(rows) == set(vlm_counting.BUCKETS) and sum(row["steps"] for row in rows.values()) > 0
    for row in rows.values():
        assert 0.0 <= row["right"] <= 1.0 and 0.0 <= row["says_1"] <= 1.0
    assert rows[1]["right"] == rows[1]["says_1"]  # at a true count of 1, right means "says 1"
    assert len(result["probe"]) == len(COLOURS) and all(0.0 <= a <= 1.0 for a in result["probe"])
