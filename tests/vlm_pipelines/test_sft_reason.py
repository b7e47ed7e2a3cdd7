"""The reasoning SFT's scoring: pass@k, the committed checkpoint's card and report, a tiny run end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

from mmrl.config import ConfigError, load_config
from mmrl.data.shapes_math import MathItem, Step, make_math_items, trace_operations
from mmrl.vlm.sft_reason import (
    ReasonBatcher,
    ReasonSFTConfig,
    ReasonSFTTrainer,
    count_balancing_weights,
    main,
    pass_at_k,
    render_card,
    with_teacher_slips,
)

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
CHECKPOINT = CHECKPOINTS / "shapes_vlm_reason"
#: the base of the reasoning demo: the same SFT with half of the teacher's traces slipped
SLIPS_CHECKPOINT = CHECKPOINTS / "shapes_vlm_reason_slips"


@pytest.mark.parametrize(("n", "c", "k"), [(8, 0, 1), (8, 3, 1), (8, 3, 8), (8, 1, 4), (5, 5, 2)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("checkpoint", [CHECKPOINT, SLIPS_CHECKPOINT], ids=lambda path: path.name)
def test_committed_card_states_its_report(checkpoint):
    report = json.loads((checkpoint / "sft_report.json").read_text())
    card = (checkpoint / "card.md").read_text()
    assert card == render_card(report)
    heldout = report["heldout"]["heldout"]
    assert f"{heldout['lenient']:.1%}" in card and report["command"] in card
    # the base reasons a little: headroom between greedy and pass@8, format learned
    assert 0.3 < heldout["lenient"] < 0.8 and heldout["pass@8"] > heldout["lenient"] + 0.2
    assert heldout["format"] > 0.9


def test_slips_base_takes_the_wrong_procedure_often_and_says_how_it_was_made():
    """The demo's base writes the question's operators in well under the traces where the clean base does, at the
    same training otherwise; its card names the slips."""
    slipped = json.loads((SLIPS_CHECKPOINT / "sft_report.json").read_text())
    assert slipped["config"]["data"]["teacher_slips"] == 0.5
    clean = json.loads((CHECKPOINT / "sft_report.json").read_text())
    assert (
        slipped["heldout"]["heldout"]["operations"] < 0.75 < 0.9 < clean["heldout"]["heldout"]["operations"]
    )
    assert (
        "50% of the training traces were drawn with a teacher's slip"
        in (SLIPS_CHECKPOINT / "card.md").read_text()
    )
    assert "teacher's slip" not in (CHECKPOINT / "card.md").read_text()


def test_teacher_slips_replace_that_share_of_the_training_traces():
    """``data.teacher_slips``: each training item is slipped with that probability (one of its arithmetic steps,
    drawn uniformly), deterministically; a slip that would go negative leaves the item right; 0 changes nothing.
    The trainer's pool, so the tokenizer corpus and the batches, holds the slipped traces."""
    items = make_math_items(600, seed=0)
    assert with_teacher_slips(items, 0.0, seed=0) == items
    half = with_teacher_slips(items, 0.5, seed=0)
    assert half == with_teacher_slips(items, 0.5, seed=0) and half != with_teacher_slips(items, 0.5, seed=1)
    changed = [
        trace_operations(a.steps) != trace_operations(b.steps) for a, b in zip(items, half, strict=True)
    ]
    everything = with_teacher_slips(items, 1.0, seed=0)
    possible = [
        trace_operations(a.steps) != trace_operations(b.steps) for a, b in zip(items, everything, strict=True)
    ]
    assert 0.4 < sum(changed) / sum(possible) < 0.6 and 0.6 < sum(possible) / len(items) < 0.95
    for clean, slipped in zip(items, half, strict=True):
        assert [s for s in slipped.steps if s.is_count] == [s for s in clean.steps if s.is_count]
    cfg = load_config(ReasonSFTConfig, overrides=["data.train_items=40", "data.teacher_slips=1.0"])
    trainer = ReasonSFTTrainer(cfg, None)
    trainer.build_data()
    assert trainer.train_items == with_teacher_slips(make_math_items(40, seed=0), 1.0, seed=0)
    assert trainer.train_items[0].completion == "<think>shapes 3. blue 1. 3+1=4</think><answer>4</answer>"
    assert trainer.train_items[0].completion in trainer.corpus()
    with pytest.raises(ConfigError, match=r"data\.teacher_slips"):
        load_config(ReasonSFTConfig, overrides=["data.teacher_slips=1.5"])


def test_card_states_the_schedule_the_count_share_and_only_the_scores_it_has():
    """A cosine run with count questions and no temperature-1 samples: the card says so, and every table row has
    its header's columns (no pass@k column without samples)."""
    report = json.loads((CHECKPOINT / "sft_report.json").read_text())
    report["config"] = {
        **report["config"],
        "lr_schedule": "cosine",
        "count_fraction": 0.9,
        "samples": 0,
        "templates": ["remove_colour", "add_shape"],
    }
    for split in report["heldout"].values():
        for key in ("pass@1", "pass@8"):
            split.pop(key, None)
    for point in report["curve"]:
        point["heldout"].pop("pass@8", None)
    card = render_card(report)
    assert "(cosine decay to 0 at the last step after 50" in card and "(constant after" not in card
    assert "90% of a task batch's items are one-step count questions" in card
    assert "pass@" not in card and "greedy scores only" in card
    assert "the training templates remove_colour, add_shape only: the others are never shown in SFT" in card
    for table in card.split("\n\n"):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) <= 1, table
    committed = render_card(json.loads((CHECKPOINT / "sft_report.json").read_text()))
    assert "(constant after 50" in committed and "count questions" not in committed and "pass@8" in committed
    assert "(training scenes, training templates)" in committed
    assert "- vision pretraining first:" in committed and "- vision pretraining first:" in card
    # a run without the vision pretraining (vision_pretrain_steps: 0) has no accuracies to state
    report["config"]["vision_pretrain_steps"] = 0
    report["vision_pretraining"] = None
    without = render_card(report)
    assert "vision pretraining" not in without and "\n- then " in without


def test_sft_templates_must_be_training_templates():
    """``data.templates``: a subset of the seven training templates; a held-out template or an empty list is refused
    by the config, naming the key."""
    cfg = load_config(ReasonSFTConfig, overrides=["data.templates=[add_shape,remove_colour]"])
    assert cfg.data.templates == ["add_shape", "remove_colour"]
    for bad in ("[remove_colour,compare_colours]", "[]"):
        with pytest.raises(ConfigError, match=r"data\.templates"):
            load_config(ReasonSFTConfig, overrides=[f"data.templates={bad}"])


def _tiny_run(tmp_path: Path, *overrides: str) -> Path:
    """A 4-step run of a 1-layer model on 40 items; returns its published folder."""
    out = tmp_path / "m"
    tiny = [
        f"out={out}",
        f"run.output_dir={tmp_path}",
        "run.progress=false",
        "run.name=sft_reason",
        "trainer.steps=4",
        "data.train_items=40",
        "trainer.vision_pretrain_steps=1",
        "trainer.batch_size=4",
        "model.hidden_size=32",
        "model.num_layers=1",
        "model.intermediate_size=64",
        "model.vision_hidden_size=32",
        "data.max_new_tokens=8",
        "run.threads=1",
    ]
    main(load_config(ReasonSFTConfig, overrides=[*tiny, *overrides]))
    return out


#: a tiny run scored at the end only, greedy, on 3 questions per set
_NO_CURVE = ("data.eval_items=3", "data.curve_items=3", "data.samples=0", "trainer.eval_every=0")


def _logged(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "sft_reason" / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_checkpoints_snapshots_and_publishes_model_and_card(tmp_path):
    out = _tiny_run(
        tmp_path,
        "run.save_every=2",
        "data.eval_items=7",
        "data.curve_items=7",
        "data.samples=2",
        "trainer.eval_every=2",
    )
    report = json.loads((out / "sft_report.json").read_text())
    assert (out / "model.safetensors").is_file() and (out / "card.md").read_text() == render_card(report)
    snapshots = tmp_path / "sft_reason" / "checkpoints"
    assert sorted(p.name for p in snapshots.iterdir() if p.is_dir()) == ["step_00000002", "step_00000004"]
    assert (snapshots / "step_00000002" / "model" / "model.safetensors").is_file()
    assert [p["step"] for p in report["curve"]] == [2, 4]
    for scores in report["heldout"].values():
        assert 0.0 <= scores["lenient"] <= 1.0 and 0.0 <= scores["pass@2"] <= 1.0
        assert scores["pass@1"] <= scores["pass@2"]


def test_caption_stage_enumerated_traces_and_centre_labels_in_a_tiny_run(tmp_path):
    """``trainer.caption_pretrain_steps`` makes the first steps captioning batches whatever the draw,
    ``data.trace`` sets the completions the tokenizer and the batches see, ``trainer.vision_labels`` adds the
    centre head to vision pretraining (its accuracy in the report)."""
    out = _tiny_run(
        tmp_path,
        "run.log_every=1",
        "trainer.caption_pretrain_steps=3",
        "trainer.caption_fraction=0",
        "trainer.vision_labels=cover_and_centre",
        "data.trace=enumerate",
        "data.balance_counts=true",
        *_NO_CURVE,
    )
    logged = _logged(tmp_path)
    assert not any("train/count_items" in row for row in logged)  # count_fraction 0: shapes-math items only
    captions = {row["step"]: row["train/caption_batch"] for row in logged if "train/caption_batch" in row}
    assert captions == {1: 1.0, 2: 1.0, 3: 1.0, 4: 0.0}
    report = json.loads((out / "sft_report.json").read_text())
    assert {"centre", "centre_objects"} <= report["vision_pretraining"].keys()
    items = make_math_items(2, seed=0)
    batcher = ReasonBatcher(AutoProcessor.from_pretrained(out), items, report["config"]["data"]["trace"])
    assert batcher.task_texts(1) == (items[1].prompt, items[1].completion_in("enumerate"))


def test_count_items_mixed_into_the_task_batches(tmp_path):
    """``trainer.count_fraction`` replaces that share of a task batch's items by one-step count questions, drawn
    after the shapes-math pool (indices past it are count items); 0 keeps the batches shapes-math only."""
    _tiny_run(
        tmp_path,
        "run.log_every=1",
        "trainer.count_fraction=0.5",
        "trainer.caption_fraction=0",
        "trainer.batch_size=16",
        *_NO_CURVE,
    )
    shares = [row["train/count_items"] for row in _logged(tmp_path) if "train/count_items" in row]
    assert len(shares) == 4 and 0.2 < sum(shares) / len(shares) < 0.8
    with pytest.raises(ValueError, match="count_fraction"):
        load_config(ReasonSFTConfig, overrides=["trainer.count_fraction=1.0"])


def test_count_balancing_weights_by_hand():
    """Colour/shape counts 1, 1, 2, 0 (the total is not one): shares 1/2, 1/4, 1/4; an item weighs the mean of
    1/share over its counts, so items holding the rare counts are drawn twice as often."""

    def item(*steps: Step) -> MathItem:
        return MathItem(None, "q", 0, steps, "t", None)  # type: ignore[arg-type]

    items = [
        item(Step("shapes", 3), Step("red", 1), Step("3-1", 2)),
        item(Step("red", 1), Step("1+1", 2)),
        item(Step("circles", 2), Step("squares", 0), Step("2-0", 2)),
    ]
    assert count_balancing_weights(items).tolist() == [2.0, 2.0, 4.0]
    # on the training pool the drawn counts come out far more even than the natural mix (mostly 1)
    pool = make_math_items(2000, seed=0)
    weights = count_balancing_weights(pool)
    shares = torch.zeros(4)
    for each, weight in zip(pool, weights.tolist(), strict=True):
        for step in each.steps:
            if step.is_count and step.label != "shapes":
                shares[min(step.value, 3)] += weight
    shares /= shares.sum()
    assert shares.max() < 0.36 and shares.min() > 0.15
