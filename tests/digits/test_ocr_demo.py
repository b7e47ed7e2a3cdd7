"""End to end: the OCR demo recipe on the committed digits checkpoint, with the real PP-OCR model as the reward
and the shapes skill of the same model scored beside it (``extra_eval``). The CI-sized run checks the pipeline and
the base scores; the full seed-0 run (``-m slow``, about 5-11 minutes) checks that the held-out OCR score rises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import main
from mmrl.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rapidocr_onnxruntime") is None,
    reason="rapidocr-onnxruntime is an optional extra (mmrl[ocr]), not installed here",
)

# the committed checkpoint, CFG-free, with the trainer's fixed evaluation noise: OCR score on the 15 held-out
# numbers x 4, strict shapes verifier on 200 balanced held-out shapes prompts (BENCHMARKS.md)
BASE_OCR = 0.100
BASE_SHAPES = 0.240


def run_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int) -> tuple[dict, dict]:
    monkeypatch.chdir(ROOT)  # the demo config names the committed checkpoint relative to the repository
    cfg = load_config(
        FlowGRPOConfig,
        ROOT / "configs/demo/flow_digits_ocr.yaml",
        [
            f"run.output_dir={tmp_path}",
            "run.name=demo",
            "run.progress=false",
            "run.tensorboard=false",
            f"trainer.steps={steps}",
            f"trainer.eval_every={steps}",
            f"trainer.sample_every={steps}",
            f"run.save_every={steps}",
        ],
    )
    final = main(cfg)
    base = read_metrics(tmp_path / "demo")[0]
    assert base["step"] == 0
    assert base["eval/ocr/mean"] == pytest.approx(BASE_OCR, abs=0.01)
    assert base["eval/shapes/shapes/mean"] == pytest.approx(BASE_SHAPES, abs=0.01)
    return base, final


def test_demo_runs_with_the_real_ocr_reward_and_both_evaluations(tmp_path, monkeypatch):
    _, final = run_demo(tmp_path, monkeypatch, steps=2)
    assert 0.0 <= final["reward/mean"] <= 1.0
    assert "eval/shapes/shapes/object" in final and "eval/ocr/exact" in final
    assert (tmp_path / "demo/checkpoints/step_00000002/transformer/config.json").is_file()


@pytest.mark.slow
def test_demo_raises_heldout_ocr_score_and_keeps_shapes(tmp_path, monkeypatch, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a run of several minutes: python -m pytest -m slow tests/digits")
    base, final = run_demo(tmp_path, monkeypatch, steps=120)
    # seed 0 measured 0.100 -> 0.225 and shapes 0.240 -> 0.260 at 120 steps (BENCHMARKS.md)
    assert final["eval/ocr/mean"] >= base["eval/ocr/mean"] + 0.08
    assert final["eval/shapes/shapes/mean"] >= base["eval/shapes/shapes/mean"] - 0.05
