"""benchmarks/real_size.py on the CPU: a tiny local pipeline stands in for a published one, so the code path a GPU
session runs at real size (random weights built from configs, the recipe's own trainer, its smoke settings) is
checked here."""

import json

import pytest

from benchmarks.real_size import main
from pipelines.flow.tiny import TINY_LOAD_KWARGS, TINY_SIZES, build_tiny_pipeline


@pytest.mark.parametrize(
    ("recipe", "family"),
    [("configs/flow/sd35_medium_pickscore.yaml", "sd3"), ("configs/flow/wan22_t2v_a14b_video.yaml", "wan22")],
)
def test_two_steps_of_a_recipe_on_random_weights(recipe, family, tmp_path):
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
    sizes = TINY_SIZES[family]
    options = (
        {**TINY_LOAD_KWARGS[family], "trained_expert": "high"}
        if family == "wan22"
        else TINY_LOAD_KWARGS[family]
    )
    overrides = [
        f"model.path={tmp_path / 'model'}",
        f"model.options={json.dumps(options)}",
        *(f"sampling.{key}={value}" for key, value in sizes.items()),
    ]
    out = tmp_path / "rows.json"
    rows = main(
        ["--device", "cpu", "--recipes", recipe, "--steps", "2", "--out", str(out), "--set", *overrides]
    )
    (row,) = rows
    assert row["recipe"] == recipe.split("/")[-1].removesuffix(".yaml")
    assert len(row["step_s"]) == 2 and all(seconds > 0 for seconds in row["step_s"])
    assert row["estimate_resident_gib"] > 0
    assert json.loads(out.read_text()) == rows


def test_a_published_size_is_no_cpu_check():
    (row,) = main(["--device", "cpu", "--recipes", "configs/flow/qwen_image_ocr.yaml"])
    assert row["skipped"].startswith("a 60.1 GiB model is no CPU check")
    assert "step_s" not in row
