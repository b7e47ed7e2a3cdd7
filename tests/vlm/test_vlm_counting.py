"""The counting diagnostics of ``python -m benchmarks.vlm_counting``: the probe by hand, the trace tally on the
committed reasoning checkpoint, the readers that write 1 by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import vlm_counting
from mmrl.data.shapes import COLOURS
from mmrl.data.shapes_math import MathItem, Step

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


def test_no_probe_scores_the_traces_only(capsys):
    """``--probe-train 0``: the trace tally without the probe; a negative size is refused by name."""
    results = vlm_counting.main([str(CHECKPOINT), "--questions", "12", "--probe-train", "0"])
    assert "probe" not in results[str(CHECKPOINT)] and results[str(CHECKPOINT)]["trace"]
    assert "probe of the mean image token" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        vlm_counting.main(["--probe-train", "-1"])
    assert "--probe-train must be >= 0" in capsys.readouterr().err


def test_readers_that_write_1_by_hand():
    """Two questions: a removal of a colour counted 2 (writing 1 for it is wrong) and one of a shape counted 1
    (writing 1 is right for both readers), so the readers score 1/2 and 1/2; a compare of shapes 2 and 1 is wrong
    only for the reader that writes 1 for shapes too."""

    def item(steps, answer):
        return MathItem(None, "q", answer, steps, "t", None)  # type: ignore[arg-type]

    colour = item((Step("shapes", 3), Step("red", 2), Step("3-2", 1)), 1)
    shape = item((Step("shapes", 3), Step("circles", 1), Step("3-1", 2)), 2)
    compare = item((Step("squares", 2), Step("circles", 1), Step("2-1", 1)), 1)
    assert vlm_counting.prior_readers([colour, shape]) == {
        "colour counts 1": 0.5,
        "colour and shape counts 1": 0.5,
    }
    assert vlm_counting.prior_readers([compare]) == {"colour counts 1": 1.0, "colour and shape counts 1": 0.0}
