"""The reasoning SFT's scoring: pass@k, the committed checkpoint's card and report, a tiny run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.vlm.sft_reason import ReasonSFTConfig, main, pass_at_k, render_card

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm_reason"


@pytest.mark.parametrize(("n", "c", "k"), [(8, 0, 1), (8, 3, 1), (8, 3, 8), (8, 1, 4), (5, 5, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_committed_card_states_its_report():
    report = json.loads((CHECKPOINT / "sft_report.json").read_text())
    card = (CHECKPOINT / "card.md").read_text()
    assert card == render_card(report)
    heldout = report["heldout"]["heldout"]
    assert f"{heldout['lenient']:.1%}" in card and report["command"] in card
    # the base reasons a little: headroom between greedy and pass@8, format learned
    assert 0.3 < heldout["lenient"] < 0.8 and heldout["pass@8"] > heldout["lenient"] + 0.2
    assert heldout["format"] > 0.9


def test_tiny_run_checkpoints_snapshots_and_publishes_model_and_card(tmp_path):
    out = tmp_path / "m"
    cfg = load_config(
        ReasonSFTConfig,
        overrides=[
            f"out={out}",
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "run.save_every=2",
            "run.name=sft_reason",
            "trainer.steps=4",
            "data.train_items=40",
            "data.eval_items=7",
            "data.curve_items=7",
            "data.samples=2",
            "trainer.vision_pretrain_steps=1",
            "trainer.eval_every=2",
            "trainer.batch_size=4",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.intermediate_size=64",
            "model.vision_hidden_size=32",
            "data.max_new_tokens=8",
            "run.threads=1",
        ],
    )
    main(cfg)
    report = json.loads((out / "sft_report.json").read_text())
    assert (out / "model.safetensors").is_file() and (out / "card.md").read_text() == render_card(report)
    snapshots = tmp_path / "sft_reason" / "checkpoints"
    assert sorted(p.name for p in snapshots.iterdir() if p.is_dir()) == ["step_00000002", "step_00000004"]
    assert (snapshots / "step_00000002" / "model" / "model.safetensors").is_file()
    assert [p["step"] for p in report["curve"]] == [2, 4]
    for scores in report["heldout"].values():
        assert 0.0 <= scores["lenient"] <= 1.0 and 0.0 <= scores["pass@2"] <= 1.0
        assert scores["pass@1"] <= scores["pass@2"]
