"""``python -m benchmarks.flow_objectives`` at a tiny size: output structure, numbers' ranges, the time cap, and
the seed-mean summary on hand-built curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import flow_objectives
from mmrl.flow.trainer import FlowGRPOTrainer
from rewards.shapes import DetectedObject, parse_prompt

ROOT = Path(__file__).resolve().parents[2]
# 4 prompts x 4 images per step, 8 held-out prompts per evaluation
TINY = ["allocation.prompts_per_step=4", "allocation.rollouts_per_step=16", "trainer.minibatch_size=16"]


def _point(step: int, strict: float, train_s: float) -> dict[str, float]:
    return {"step": step, "nfe": 100.0 * step, "train_s": train_s, "strict": strict} | {
        c: strict for c in flow_objectives.CRITERIA
    }


def test_every_recipe_loads_and_unknown_names_are_refused(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in flow_objectives.RECIPES:
        cfg = flow_objectives.recipe_config(name, 3, 1, 50, [])
        assert cfg.run.seed == 3 and cfg.trainer.eval_prompts == 50
    assert flow_objectives.recipe_config("awm", 0, 1, 8, []).trainer.objective == "awm"
    assert flow_objectives.recipe_config("nft_branch_short", 0, 1, 8, []).trainer.steps == 150
    with pytest.raises(ValueError, match=r"unknown recipe 'ppo'.*'nft'"):
        flow_objectives.recipe_config("ppo", 0, 1, 8, [])


def test_the_main_job_recipe_is_the_lighter_pull_measured_from_the_width_192_base(monkeypatch):
    # BENCHMARKS.md's weight-0.3 figures ran awm_distill_w03 with these overrides; main_job must be that config
    monkeypatch.chdir(ROOT)
    main_job = flow_objectives.recipe_config("main_job", 0, 1, 200, ["run.name=run"])
    measured = flow_objectives.recipe_config(
        "awm_distill_w03",
        0,
        1,
        200,
        [
            "run.name=run",
            "trainer.steps=300",
            "model.path=checkpoints/shapes_flow_w192",
            "trainer.guidance_distill.guidance_scale=1.5",
        ],
    )
    assert main_job == measured
    assert main_job.trainer.guidance_distill.weight == 0.3 and main_job.model.path.endswith(
        "shapes_flow_w192"
    )


def _failures(right: float) -> dict[str, float]:
    return {name: {"right": right, "shape": 1.0 - right}.get(name, 0.0) for name in flow_objectives.FAILURES}


def test_summary_means_over_seeds_and_first_crossing():
    runs = {
        0: {"curve": [_point(0, 0.35, 0.0), _point(10, 0.50, 10.0), _point(20, 0.60, 20.0)]},
        1: {
            "curve": [
                _point(0, 0.35, 0.0),
                _point(10, 0.54, 12.0),
                _point(20, 0.52, 24.0),
                _point(25, 0.7, 30.0),
            ]
        },
    }
    for seed, count_score in ((0, 0.2), (1, 0.4)):
        runs[seed]["by_kind"] = {
            "all": {"prompts": 8, "mean": 0.5, "pass@4": 0.75, "failures": _failures(0.5)},
            "count": {
                "prompts": 2,
                "mean": count_score,
                "pass@4": 2 * count_score,
                "failures": _failures(count_score),
            },
        }
    summary = flow_objectives.summarize(runs, target=0.515)
    assert [p["step"] for p in summary["mean_curve"]] == [0, 10, 20]  # steps every seed evaluated
    assert summary["mean_curve"][1]["strict"] == pytest.approx((0.50 + 0.54) / 2)
    assert summary["mean_curve"][2]["train_s"] == pytest.approx(22.0)
    # 0.515 is first reached by the seed mean at step 10 (0.52), whichever seed is above it
    assert summary["reaches_target"]["step"] == 10
    final = summary["final"]["strict"]  # each seed's last evaluation: 0.60 (step 20) and 0.70 (step 25)
    assert (final["mean"], final["min"], final["max"]) == pytest.approx((0.65, 0.60, 0.70))
    count = summary["final_by_kind"]["count"]
    assert (count["prompts"], count["mean"], count["pass@4"]) == (2, pytest.approx(0.3), pytest.approx(0.6))
    # the Markdown's per-kind table shows pass@K beside the mean
    kind_table = flow_objectives.kind_table({"recipe": summary["final_by_kind"]})
    assert "pass@4 count (2)" in kind_table and "| 0.500 | 0.300 | 0.750 | 0.600 |" in kind_table
    assert count["failures"]["right"] == pytest.approx(0.3) and count["failures"]["shape"] == pytest.approx(
        0.7
    )
    assert flow_objectives.summarize(runs, target=0.9)["reaches_target"] is None


def test_tiny_benchmark_writes_json_and_table(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the recipes name the committed checkpoint relative to the repository
    out = tmp_path / "bench"
    argv = [
        "--recipes",
        "nft",
        "awm_tuned",
        "nft_distill",
        "--seeds",
        "0",
        "--steps",
        "2",
        "--eval-every",
        "1",
    ]
    argv += ["--eval-prompts", "8", "--threads", "2", "--out", str(out), *TINY]
    flow_objectives.main(argv)
    results = json.loads((out / "flow_objectives.json").read_text())
    assert set(results["runs"]) == {"nft", "awm_tuned", "nft_distill"}
    assert results["machine"]["threads"] == 2 and len(results["machine"]["load_average"]) == 3
    for name, runs in results["runs"].items():
        run = runs["0"]
        assert run["steps"] == 2 and run["stopped_by"] == "steps"
        curve = run["curve"]
        assert [p["step"] for p in curve] == [0, 1, 2]
        # the same base, the same evaluation prompts and noise: every recipe starts from the same scores
        assert curve[0] == results["runs"]["nft"]["0"]["curve"][0]
        assert curve[0]["nfe"] == 0 and curve[0]["train_s"] == 0
        # 16 rollouts x 10 steps + 16 images x 2 regression points x (policy + old policy) per step, and with
        # guidance distillation the teacher's unconditional and conditional forwards at each of the 32 points
        per_step = 224 + (64 if name == "nft_distill" else 0)
        assert [p["nfe"] for p in curve[1:]] == [per_step, 2 * per_step], name
        # every step's training metrics: the rollouts' partial credit and the update's gradient norm
        assert [entry["step"] for entry in run["train"]] == [1, 2]
        for entry in run["train"]:
            assert 0.0 <= entry["reward/mean"] <= 1.0 and entry["train/grad_norm"] >= 0.0
            assert ("policy/guidance_gap" in entry) == (name == "nft_distill")
        assert 0 < curve[1]["train_s"] < curve[2]["train_s"] == pytest.approx(run["train_s"])
        for point in curve:
            for key in ("strict", *flow_objectives.CRITERIA):
                # 8 prompts, one image each: every score is a multiple of 1/8 in [0, 1]
                assert 0.0 <= point[key] <= 1.0 and (point[key] * 8) == pytest.approx(round(point[key] * 8))
            # strict needs every criterion, so it never exceeds the weakest one
            assert point["strict"] <= min(point[c] for c in flow_objectives.CRITERIA) + 1e-9
        summary = results["summaries"][name]
        assert summary["final"]["strict"]["mean"] == curve[-1]["strict"]
        # the per-kind breakdown of the final weights, from the evaluation's sampler and noise, adds up to it
        kinds = run["by_kind"]
        assert kinds["all"]["mean"] == pytest.approx(curve[-1]["strict"])
        assert sum(kinds[k]["prompts"] for k in ("single", "count", "pair", "relation")) == 8
        weighted = sum(
            kinds[k]["mean"] * kinds[k]["prompts"] for k in ("single", "count", "pair", "relation")
        )
        assert weighted / 8 == pytest.approx(kinds["all"]["mean"])
    table = (out / "flow_objectives.md").read_text()
    assert (
        "| nft | 2 | 448 |" in table
        and "| awm_tuned | 2 | 448 |" in table
        and "| nft_distill | 2 | 576 |" in table
    )
    assert "| nft | " in table.split("per prompt kind")[1]
    assert table.count("| step | NFE | train s | strict | object | count | colour | position |") == 3
    # the overrides every recipe ran with, which its description does not name (here --steps 2's schedule)
    assert results["overrides"][-1] == "trainer.steps=2"
    assert f"Every recipe with `{' '.join(results['overrides'])}` applied" in table


def test_minutes_cap_stops_the_run_and_evaluates_there(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = flow_objectives.recipe_config("nft", 0, 2, 8, [*TINY, "trainer.steps=5"])
    run = flow_objectives.train_run(cfg, minutes=1e-6, eval_every=10, final_samples=2)
    assert run["stopped_by"] == "minutes" and run["steps"] == 1
    assert [p["step"] for p in run["curve"]] == [0, 1]
    # the final weights scored from 2 samples of each of the 8 prompts: pass@2 bounds the mean
    for kind, row in run["by_kind"].items():
        assert 0.0 <= row["mean"] <= row["pass@2"] <= 1.0, kind
        assert row["mean"] * 2 * row["prompts"] == pytest.approx(round(row["mean"] * 2 * row["prompts"]))


def test_ceiling_pass_at_k_bounds_the_mean_and_k1_is_the_evaluation(monkeypatch):
    monkeypatch.chdir(ROOT)
    base = flow_objectives.ceiling(flow_objectives.FLAT, [1.0], 1, 8, 2)["cfg 1"]["all"]
    trainer = FlowGRPOTrainer(flow_objectives.recipe_config("nft", 0, 2, 8, []), run=None)
    trainer.setup()
    assert base["mean"] == pytest.approx(trainer.evaluate()["eval/reward_mean"])
    rows = flow_objectives.ceiling(flow_objectives.FLAT, [1.0, 3.0], 3, 8, 2)
    for table in rows.values():
        for kind, row in table.items():
            # K = 3 samples of each prompt: mean is a multiple of 1 / (3 * prompts), pass@3 of 1 / prompts
            assert row["mean"] <= row["pass@3"] <= 1.0, kind
            assert row["mean"] * 3 * row["prompts"] == pytest.approx(round(row["mean"] * 3 * row["prompts"]))
    # K = 1 is the trainer's evaluation itself, and pass@1 equals the mean
    assert base["mean"] == base["pass@1"]
    for table in rows.values():
        for kind, row in table.items():
            # every sample falls in one failure class, and "right" is exactly the strict score's share
            assert sum(row["failures"].values()) == pytest.approx(1.0), kind
            assert row["failures"]["right"] == pytest.approx(row["mean"]), kind


def test_ceiling_applies_the_overrides_to_the_base(monkeypatch, tmp_path):
    # an override of the base's folder reaches the model's loading: another base is scored, not the committed one
    monkeypatch.chdir(ROOT)
    missing = tmp_path / "no_base"
    with pytest.raises(OSError, match="no_base"):
        flow_objectives.ceiling(flow_objectives.FLAT, [1.0], 1, 8, 1, [f"model.path={missing}"])


def test_failure_names_why_a_sample_scores_zero():
    def obj(shape, colour, x):  # a 6-px object at column x, row 10
        return DetectedObject(shape, colour, (x, 10.0, x + 6.0, 16.0), 30.0)

    pair = parse_prompt("a photo of a red circle and a blue square")
    assert flow_objectives.failure(pair, [obj("circle", "red", 2), obj("square", "blue", 20)]) == "right"
    # the shapes swapped between the two colours: as many objects, the named colours, a shape wrong
    assert flow_objectives.failure(pair, [obj("square", "red", 2), obj("circle", "blue", 20)]) == "shape"
    assert flow_objectives.failure(pair, [obj("circle", "red", 2), obj("square", "green", 20)]) == "colour"
    assert flow_objectives.failure(pair, [obj("circle", "red", 2)]) == "missing"
    extra = [obj("circle", "red", 2), obj("square", "blue", 12), obj("square", "blue", 22)]
    assert flow_objectives.failure(pair, extra) == "extra"
    # an unread blob is named first, whatever else is wrong
    assert flow_objectives.failure(pair, [obj("unknown", "red", 2), obj("square", "blue", 20)]) == "unread"
    relation = parse_prompt("a photo of a red circle left of a blue square")
    assert flow_objectives.failure(relation, [obj("circle", "red", 2), obj("square", "blue", 20)]) == "right"
    assert flow_objectives.failure(relation, [obj("circle", "red", 20), obj("square", "blue", 2)]) == "place"
    count = parse_prompt("a photo of three triangles")
    triangles = [obj("triangle", colour, x) for colour, x in (("red", 2), ("blue", 12), ("green", 22))]
    assert flow_objectives.failure(count, triangles) == "right"
    assert flow_objectives.failure(count, [*triangles[:2], obj("circle", "green", 22)]) == "shape"


def test_ema_recipe_scores_the_ema_and_records_the_live_weights_beside_it(monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = flow_objectives.recipe_config("awm_distill_ema", 0, 2, 8, [*TINY, "trainer.steps=2"])
    assert cfg.trainer.ema_decay == flow_objectives.EMA_DECAY
    run = flow_objectives.train_run(cfg, minutes=None, eval_every=1)
    assert [p["step"] for p in run["curve"]] == [0, 1, 2]
    start = run["curve"][0]  # before any update the EMA is the start weights
    assert (start["live_strict"], start["live_count"]) == (start["strict"], start["count"])
    for point in run["curve"]:
        assert 0.0 <= point["live_strict"] <= point["live_count"] + 1e-9
    # the final per-kind scores are the EMA's, as the evaluation's
    assert run["by_kind"]["all"]["mean"] == pytest.approx(run["curve"][-1]["strict"])
