"""End to end: the flow demo recipe, shortened, raises the held-out strict shapes score of the committed base."""

from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import main
from mmrl.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_demo_recipe_raises_heldout_strict_score(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the demo config names the committed checkpoint relative to the repository
    cfg = load_config(
        FlowGRPOConfig,
        ROOT / "configs/demo/flow_shapes.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.name=demo",
            "run.progress=false",
            "run.tensorboard=false",
            # the demo's first 50 steps, at its starting learning rate
            "trainer.steps=50",
            "trainer.lr_schedule=constant",
            "trainer.eval_every=50",
            "trainer.sample_every=50",
            "run.save_every=50",
        ],
    )
    final = main(cfg)
    base = read_metrics(tmp_path / "demo")[0]
    assert base["step"] == 0
    # the committed base, CFG-free, on the 200 held-out prompts with the fixed evaluation noise (card.md)
    assert base["eval/reward_mean"] == pytest.approx(0.35, abs=0.03)
    assert final["eval/reward_mean"] >= base["eval/reward_mean"] + 0.03
