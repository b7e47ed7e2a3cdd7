"""VQA on the shapes world: deterministic items, answers that follow from the scene, disjoint splits, and the
exact-match verifier accepting the answer format the prompt asks for."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import rewards
from mmrl.data.shapes import COLOURS, SHAPES, render
from mmrl.data.shapes_vqa import VQA_KINDS, format_prompt, is_heldout_scene, make_vqa_items
from rewards.shapes import detect_objects, relation_offset


@pytest.fixture(scope="module")
def items():
    return make_vqa_items(350, seed=0, size=32, split="train")


def _expected(question: str, scene) -> str:
    """The answer recomputed from the question text and the scene, independently of the generator."""
    objs = scene.objects
    words = question.rstrip("?").split()
    if question.startswith("how many shapes"):
        return str(len(objs))
    if question.startswith("how many"):
        word = words[2]
        if word in COLOURS:
            return str(sum(o.colour == word for o in objs))
        return str(sum(o.shape == word[:-1] for o in objs))
    if question.startswith("what colour is the"):
        (match,) = [o for o in objs if o.shape == words[-1]]
        return match.colour
    if question.startswith("what shape is the"):
        (match,) = [o for o in objs if o.colour == words[-2]]
        return match.shape
    if question.startswith("is there a"):
        return "yes" if any((o.colour, o.shape) == (words[-2], words[-1]) for o in objs) else "no"
    # is the {c} {s} {relation} the {c} {s}
    (a,) = [o for o in objs if (o.colour, o.shape) == (words[2], words[3])]
    (b,) = [o for o in objs if (o.colour, o.shape) == (words[-2], words[-1])]
    relation = " ".join(words[4:-3])
    dx, dy = relation_offset(a.box, b.box)
    value = {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]
    assert value >= 0.75 or value <= 0.25, "relation questions are only asked when clear"
    return "yes" if value > 0.5 else "no"


def test_answers_follow_from_the_scene(items):
    for item in items:
        assert item.answer == _expected(item.question, item.scene), item.question
        assert item.answer.isdigit() or item.answer in (*COLOURS, *SHAPES, "yes", "no")


def test_items_are_deterministic_and_balanced(items):
    again = make_vqa_items(350, seed=0, size=32, split="train")
    assert [(i.question, i.answer, i.scene) for i in items] == [
        (i.question, i.answer, i.scene) for i in again
    ]
    assert all(
        np.array_equal(np.asarray(a.image), np.asarray(b.image))
        for a, b in zip(items[:20], again[:20], strict=True)
    )
    assert [i.question for i in make_vqa_items(20, seed=1)] != [i.question for i in items[:20]]
    kinds = Counter(i.kind for i in items)
    assert set(kinds) == set(VQA_KINDS) and max(kinds.values()) - min(kinds.values()) <= 1
    yes_no = Counter(i.answer for i in items if i.kind in ("exists", "relation"))
    assert yes_no["yes"] == yes_no["no"]
    zero = sum(i.answer == "0" for i in items if i.kind in ("count_shape", "count_colour"))
    assert zero < 0.4 * (kinds["count_shape"] + kinds["count_colour"])


def test_images_show_the_scene(items):
    detected = detect_objects([i.image for i in items[:100]])
    for item, objects in zip(items[:100], detected, strict=True):
        assert item.image.size == (32, 32)
        assert np.array_equal(np.asarray(item.image), np.asarray(render(item.scene)))
        assert sorted((o.colour, o.shape) for o in objects) == sorted(
            (o.colour, o.shape) for o in item.scene.objects
        )


def test_splits_are_disjoint_by_scene_content(items):
    heldout = make_vqa_items(150, seed=0, size=32, split="heldout")
    assert all(is_heldout_scene(i.scene) for i in heldout)
    assert not any(is_heldout_scene(i.scene) for i in items)

    def content(item):
        return tuple(sorted((o.colour, o.shape) for o in item.scene.objects))

    assert not {content(i) for i in items} & {content(i) for i in heldout}
    with pytest.raises(ValueError, match="split"):
        make_vqa_items(1, seed=0, split="test")
    with pytest.raises(ValueError, match="unknown VQA kind"):
        make_vqa_items(1, seed=0, kinds=("colour_of", "size_of"))


def test_exact_match_scores_the_requested_answer_format(items):
    prompt = format_prompt(items[0].question)
    assert prompt.startswith(items[0].question) and "<answer>" in prompt and "digits" in prompt
    assert items[0].prompt == prompt
    verifier = rewards.build("exact_match")
    truths = [i.answer for i in items]
    right = [f"Looking at the image... <answer>{i.answer}</answer>" for i in items]
    assert verifier(completions=right, ground_truths=truths).tolist() == [1.0] * len(items)
    assert verifier(
        completions=[f"<answer> {i.answer.upper()} </answer>" for i in items], ground_truths=truths
    ).all()
    wrong = [f"<answer>{'1' if i.answer == '0' else '0'}</answer>" for i in items]
    assert not verifier(completions=wrong, ground_truths=truths).any()
