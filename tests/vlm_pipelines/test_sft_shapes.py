"""The VQA SFT recipe end to end in a few steps, its config errors, and the committed tiny-VLM checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLForConditionalGeneration

from mmrl.config import ConfigError, load_config
from mmrl.data.shapes import COLOURS, SHAPES, Scene, SceneObject, random_scene
from mmrl.data.shapes_vqa import make_vqa_items
from mmrl.vlm.sft import caption, centre_labels, flat_settings, pretrain_vision, token_labels
from mmrl.vlm.sft_shapes import (
    COUNT_WORDS,
    SFTBatcher,
    SFTShapesConfig,
    blind_baselines,
    evaluate_checkpoint,
    main,
    max_objects,
    score_vqa,
)

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_vlm"
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "shapes_vlm.yaml"


def test_recipe_runs_and_publishes_a_loadable_model_with_card(tmp_path):
    out = tmp_path / "ckpt"
    cfg = load_config(
        SFTShapesConfig,
        CONFIG,
        [
            f"out={out}",
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "run.save_every=1",
            "run.keep_last=5",
            "trainer.steps=2",
            "data.train_items=24",
            "data.eval_items=14",
            "data.curve_items=7",
            "data.curriculum=0.5",
            "data.number_words=0.5",
            "trainer.batch_size=4",
            "trainer.warmup_steps=1",
            "model.hidden_size=32",
            "model.num_layers=1",
            "model.intermediate_size=64",
            "trainer.eval_every=1",
            "trainer.vision_pretrain_steps=2",
        ],
    )
    metrics = main(cfg)
    report = json.loads((out / "sft_report.json").read_text())
    assert report["steps"] == 2 and metrics["eval/accuracy"] == report["heldout_accuracy"]["overall"]
    assert [point["step"] for point in report["curve"]] == [1, 2]
    assert all(0.0 <= point["overall"] <= 1.0 for point in report["curve"])
    assert 0.0 <= report["vision_pretraining"]["shape"] <= 1.0
    assert set(report["heldout_accuracy"]) >= {"overall", "count_total", "relation"}
    card = (out / "card.md").read_text()
    assert "seed: 0" in card and "| overall |" in card
    assert "vision pretraining first: 2 steps" in card and "## Learning curve" in card
    assert "| model, number words accepted |" in card and "50% of the training items" in card
    strict, read = report["heldout_accuracy"], report["heldout_accuracy_number_words"]
    assert all(read[kind] >= strict[kind] for kind in strict)  # accepting words can only add matches
    # re-scoring the published folder (`python -m mmrl.vlm.sft_shapes --eval-only`) gives the card's numbers
    assert evaluate_checkpoint(str(out), flat_settings(report["config"])) == report["heldout_accuracy"]
    # the published config repeats the run
    assert load_config(SFTShapesConfig, out / "config.yaml") == cfg
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())  # published by rename
    # the published folder and every run checkpoint load with the real classes
    for folder in (out, tmp_path / "sft_shapes_vlm" / "checkpoints" / "step_00000001" / "model"):
        AutoProcessor.from_pretrained(folder)
        assert isinstance(
            Qwen2_5_VLForConditionalGeneration.from_pretrained(folder), Qwen2_5_VLForConditionalGeneration
        )


def test_config_errors_name_the_key():
    with pytest.raises(
        ConfigError, match=r"unknown key 'trainer\.lr_shedule'\. Did you mean 'lr_schedule'\?"
    ):
        load_config(SFTShapesConfig, CONFIG, ["trainer.lr_shedule=cosine"])
    with pytest.raises(ConfigError, match=r"data\.number_words: Input should be less than or equal to 1"):
        load_config(SFTShapesConfig, CONFIG, ["data.number_words=1.5"])


def test_token_labels_name_the_object_covering_each_cell():
    # 64 px, 4x4 cells of 16 px: a red square on cell (row 1, col 1) exactly; a blue circle with box
    # [56, 72] x [32, 48] covers half of cell (row 2, col 3), 8 x 16 px, and no other cell
    square = SceneObject("square", "red", x=24.0, y=24.0, size=16.0)
    circle = SceneObject("circle", "blue", x=64.0, y=40.0, size=16.0)
    colours, shapes = token_labels(Scene(64, (200, 200, 200), (square, circle)), grid=4)
    expected_colours = [len(COLOURS)] * 16
    expected_shapes = [len(SHAPES)] * 16
    expected_colours[5], expected_shapes[5] = COLOURS.index("red"), SHAPES.index("square")
    expected_colours[11], expected_shapes[11] = COLOURS.index("blue"), SHAPES.index("circle")
    assert colours.tolist() == expected_colours and shapes.tolist() == expected_shapes


def test_centre_labels_mark_one_token_per_object():
    # the same two objects: the square's centre (24, 24) lies in cell (row 1, col 1); the circle's (64, 40) on
    # the canvas edge falls in the last column, row 2; a 20 px triangle centred at (8, 60) covers cells of rows 2
    # and 3 but marks only (row 3, col 0)
    square = SceneObject("square", "red", x=24.0, y=24.0, size=16.0)
    circle = SceneObject("circle", "blue", x=64.0, y=40.0, size=16.0)
    triangle = SceneObject("triangle", "green", x=8.0, y=60.0, size=20.0)
    colours, shapes = centre_labels(Scene(64, (200, 200, 200), (square, circle, triangle)), grid=4)
    expected = {5: ("red", "square"), 11: ("blue", "circle"), 12: ("green", "triangle")}
    for token in range(16):
        colour, shape = expected.get(token, (None, None))
        assert colours[token] == (COLOURS.index(colour) if colour else len(COLOURS))
        assert shapes[token] == (SHAPES.index(shape) if shape else len(SHAPES))
    # every object of a random scene marks its own token: the count of a colour is a sum over tokens
    for seed in range(200):
        scene = random_scene(seed, 64)
        colours, _ = centre_labels(scene, grid=4)
        for colour in COLOURS:
            assert int((colours == COLOURS.index(colour)).sum()) == sum(
                o.colour == colour for o in scene.objects
            )


def test_vision_pretraining_with_centre_labels_trains_a_second_head():
    torch.manual_seed(0)
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    model = AutoModelForImageTextToText.from_pretrained(CHECKPOINT)
    items = make_vqa_items(16, seed=0, size=64)
    before = [p.detach().clone() for p in model.model.visual.parameters()]
    kwargs = dict(image_size=64, steps=2, lr=1e-3, batch_size=4, generator=torch.Generator().manual_seed(0))
    cover = pretrain_vision(model, processor, items, items[:4], **kwargs)
    assert set(cover) == {"colour", "shape", "loss"}
    both = pretrain_vision(model, processor, items, items[:4], labels="cover_and_centre", **kwargs)
    assert set(both) == {"colour", "shape", "loss", "centre", "centre_objects"}
    assert all(0.0 <= both[key] <= 1.0 for key in ("colour", "shape", "centre", "centre_objects"))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.model.visual.parameters(), strict=True))


def test_batcher_writes_the_drawn_share_of_count_answers_as_words():
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    items = make_vqa_items(700, seed=0, size=64)
    counts = [i for i, item in enumerate(items) if item.kind.startswith("count")]
    assert SFTBatcher(processor, items).answers == [item.answer for item in items]
    words = SFTBatcher(processor, items, number_words=1.0).answers
    assert all(words[i] == COUNT_WORDS[int(items[i].answer)] for i in counts)
    assert all(words[i] == items[i].answer for i in range(len(items)) if i not in counts)
    mixed = SFTBatcher(processor, items, number_words=0.75, seed=3)
    share = sum(mixed.answers[i] != items[i].answer for i in counts) / len(counts)
    assert 0.68 < share < 0.82 and mixed.answers == SFTBatcher(processor, items, 0.75, seed=3).answers
    batch = mixed.batch(counts[:4], as_caption=False)
    answer_ids = batch["labels"][batch["labels"] != -100].tolist()
    text = processor.tokenizer.decode(answer_ids)
    assert all(f"<answer>{mixed.answers[i]}</answer>" in text for i in counts[:4])


def test_curriculum_grows_scenes_from_one_object_to_four():
    assert [max_objects(p, 0.6) for p in (0.0, 0.19, 0.2, 0.39, 0.4, 0.59, 0.6, 1.0)] == [
        1,
        1,
        2,
        2,
        3,
        3,
        4,
        4,
    ]
    assert max_objects(0.0, 0.0) == 4  # off: every scene from the start


def test_blind_baselines_and_caption():
    train_items = make_vqa_items(70, seed=0, size=32)
    heldout = make_vqa_items(14, seed=1, size=32, split="heldout")
    baselines = blind_baselines(train_items, heldout)
    assert 0.0 <= baselines["majority"]["overall"] <= baselines["majority_per_kind"]["overall"] <= 1.0
    item = train_items[0]
    words = caption(item).split(", ")
    assert len(words) == len(item.scene.objects)
    assert words == [f"{o.colour} {o.shape}" for o in sorted(item.scene.objects, key=lambda o: o.x)]


def test_committed_checkpoint_loads_generates_and_beats_blind_baseline():
    report = json.loads((CHECKPOINT / "sft_report.json").read_text())
    processor = AutoProcessor.from_pretrained(CHECKPOINT)
    model = AutoModelForImageTextToText.from_pretrained(CHECKPOINT).eval()
    size = report["config"]["image_size"]
    items = make_vqa_items(70, seed=report["config"]["seed"] + 1, size=size, split="heldout")
    accuracy = score_vqa(model, processor, items)
    # the card's first 70 held-out items, re-scored from the saved files
    assert accuracy["overall"] > report["baselines"]["majority"]["overall"]
    assert sum(p.numel() for p in model.parameters()) == report["parameters"]
    assert sum(f.stat().st_size for f in CHECKPOINT.iterdir()) <= 12 * 2**20
