"""Shapes-math: answers recomputed from the question text and the scene, splits by scene and by template,
balance, determinism, trace parsing, the lenient numeric check, and the generated source in load_vqa."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import rewards
from mmrl.data.shapes import Scene, SceneObject, render
from mmrl.data.shapes_math import (
    ADD_WORDS,
    SPLITS,
    TEMPLATES,
    TRACE_STYLES,
    MathItem,
    Step,
    answer_from_counts,
    format_completion,
    format_trace,
    make_count_items,
    make_math_items,
    perception_accuracy,
    read_trace,
    slip_operation,
    template_names,
    trace_operations,
)
from mmrl.data.shapes_vqa import is_heldout_scene
from mmrl.data.vqa import load_vqa

WORD_VALUES = {word: k for k, word in ADD_WORDS.items()}


_COLOURS = {"red", "green", "blue", "yellow", "purple", "orange"}
_SHAPES = {"circle", "square", "triangle"}


def _matches(obj: tuple[str | None, str], noun: str) -> bool:
    """Whether a (colour, shape) object is one a noun phrase names: "shapes", "red shapes", "circles", "blue
    squares"."""
    words = noun.split()
    colour = next((w for w in words if w in _COLOURS), None)
    shape = words[-1].removesuffix("s")
    shape = shape if shape in _SHAPES else None
    return (colour is None or obj[0] == colour) and (shape is None or obj[1] == shape)


def _expected(question: str, scene) -> int:
    """The answer of a question, computed by applying its sentences to a list of (colour, shape) objects,
    without the generator's code."""
    objects = [(o.colour, o.shape) for o in scene.objects]
    sentences = [s.strip() for s in question.rstrip("?").split(".") if s.strip()]
    *operations, query = sentences

    for operation in operations:
        operation = operation.removeprefix("Then ").lower()
        if operation.startswith("remove all "):
            noun = operation.removeprefix("remove all ")
            objects = [o for o in objects if not _matches(o, noun)]
        else:
            match = re.fullmatch(r"add (\w+) (.+)", operation)
            count, noun = WORD_VALUES[match[1]], match[2].split()
            colour = noun[0] if noun[0] in _COLOURS else None
            objects += [(colour, noun[-1].removesuffix("s"))] * count
    if query.startswith("How many more"):
        first, second = re.fullmatch(r"How many more (.+) than (.+) are there", query).groups()
        return sum(_matches(o, first) for o in objects) - sum(_matches(o, second) for o in objects)
    noun = re.fullmatch(r"How many (.+) are (?:there|left)", query)[1]
    return sum(_matches(o, noun) for o in objects)


@pytest.fixture(scope="module")
def splits():
    return {split: make_math_items(180, seed=3, size=64, split=split) for split in SPLITS}


def test_answers_follow_from_the_scene(splits):
    for items in splits.values():
        for item in items:
            assert _expected(item.question, item.scene) == item.answer, item.question
            assert item.answer >= 0


def test_reference_trace_is_consistent(splits):
    """Every count step states the true count; every arithmetic step is right; the last result is the answer."""
    for items in splits.values():
        for item in items:
            for step in item.steps:
                if step.is_count:
                    noun = step.label if step.label.endswith("s") else f"{step.label} shapes"
                    expected = sum(_matches((o.colour, o.shape), noun) for o in item.scene.objects)
                    assert step.value == expected, (item.question, step)
                else:
                    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", step.label).groups()
                    assert step.value == (int(a) + int(b) if op == "+" else int(a) - int(b))
            assert item.steps[-1].value == item.answer
            assert read_trace(item.completion) == list(item.steps)
            assert (
                perception_accuracy(item.completion, item.steps) == (sum(s.is_count for s in item.steps),) * 2
            )


def test_splits_by_scene_and_template(splits):
    heldout_templates = set(template_names(heldout=True))
    assert heldout_templates == {"compare_colours", "remove_shape_add"}
    assert {i.template for i in splits["train"]} == set(template_names(heldout=False))
    assert {i.template for i in splits["heldout"]} == set(template_names(heldout=False))
    assert {i.template for i in splits["heldout_templates"]} == heldout_templates
    assert not any(is_heldout_scene(i.scene) for i in splits["train"])
    assert all(is_heldout_scene(i.scene) for i in splits["heldout"] + splits["heldout_templates"])
    train_scenes = {tuple(sorted((o.colour, o.shape) for o in i.scene.objects)) for i in splits["train"]}
    for item in splits["heldout"] + splits["heldout_templates"]:
        assert tuple(sorted((o.colour, o.shape) for o in item.scene.objects)) not in train_scenes


def test_balanced_by_template_and_deterministic(splits):
    for split, items in splits.items():
        counts = Counter(i.template for i in items)
        assert max(counts.values()) - min(counts.values()) <= 1, (split, counts)
    again = make_math_items(180, seed=3, size=64, split="train")
    assert [(i.question, i.answer) for i in again] == [(i.question, i.answer) for i in splits["train"]]
    assert again[5].image.tobytes() == splits["train"][5].image.tobytes()
    other = make_math_items(180, seed=4, size=64, split="train")
    assert [i.question for i in other] != [i.question for i in splits["train"]]


def test_templates_cover_the_operations():
    names = {t.name for t in TEMPLATES}
    assert {
        "remove_colour",
        "add_shape",
        "compare_shapes",
        "remove_colour_add",
        "remove_colour_shape",
    } <= names
    items = make_math_items(90, seed=0, split="train")
    chained = [i for i in items if i.question.count(".") == 2]
    assert chained and all(len([s for s in i.steps if not s.is_count]) == 2 for i in chained)


def test_a_template_subset_draws_only_those_templates_balanced(splits):
    """``templates=`` keeps the split's other rules (scenes, balance, answers) and draws only the named templates,
    in TEMPLATES order whatever order they are named in; naming all of them repeats the default draws."""
    one_op = ["compare_shapes", "remove_colour", "add_shape"]
    items = make_math_items(90, seed=3, size=64, split="train", templates=one_op)
    assert [i.template for i in items[:3]] == ["remove_colour", "add_shape", "compare_shapes"]
    assert Counter(i.template for i in items) == {"remove_colour": 30, "add_shape": 30, "compare_shapes": 30}
    for item in items:
        assert _expected(item.question, item.scene) == item.answer, item.question
        assert not is_heldout_scene(item.scene)
    every = make_math_items(180, seed=3, size=64, split="train", templates=template_names(heldout=False))
    assert [(i.question, i.answer) for i in every] == [(i.question, i.answer) for i in splits["train"]]
    assert {
        i.template for i in make_math_items(8, 0, split="heldout_templates", templates=["compare_colours"])
    } == {"compare_colours"}
    with pytest.raises(ValueError, match=r"\['compare_colours'\] not among them"):
        make_math_items(3, 0, split="train", templates=["remove_colour", "compare_colours"])
    with pytest.raises(ValueError, match="non-empty subset"):
        make_math_items(3, 0, split="train", templates=[])


def test_count_items_ask_one_count_about_the_split_scenes():
    """One-step count questions: the answer recomputed from the question and the scene, a trace of the one count,
    the three kinds in turn, training scenes only for ``train``, deterministic and not make_math_items' draws."""
    items = make_count_items(120, seed=3, split="train")
    assert [i.template for i in items[:3]] == ["count_all", "count_colour", "count_shape"]
    assert Counter(i.template for i in items) == {"count_all": 40, "count_colour": 40, "count_shape": 40}
    for item in items:
        assert _expected(item.question, item.scene) == item.answer, item.question
        assert len(item.steps) == 1 and item.steps[0].is_count and item.steps[0].value == item.answer
        assert item.completion == f"<think>{item.steps[0]}</think><answer>{item.answer}</answer>"
        assert not is_heldout_scene(item.scene)
    assert (
        Counter(i.answer for i in items if i.template == "count_colour")[0] > 0
    )  # absent colours are asked too
    assert all(is_heldout_scene(i.scene) for i in make_count_items(30, seed=3, split="heldout"))
    again = make_count_items(120, seed=3, split="train")
    assert [(i.question, i.answer) for i in again] == [(i.question, i.answer) for i in items]
    math_scenes = [i.scene for i in make_math_items(120, seed=3, split="train")]
    assert [i.scene for i in items] != math_scenes
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_count_items(-1, 0)


def test_answer_from_counts_recomposes_the_reference_procedure(splits):
    """The true counts give every item's answer; other counts go through the same operations: a removal takes the
    stated count, an added ``k`` stays the question's."""
    for items in splits.values():
        for item in items:
            assert answer_from_counts(item.steps, [s.value for s in item.steps if s.is_count]) == item.answer
    remove_then_add = (Step("shapes", 4), Step("red", 2), Step("4-2", 2), Step("2+2", 4))
    assert answer_from_counts(remove_then_add, [4, 1]) == 5  # 4 - 1 + 2
    twice = (Step("shapes", 4), Step("red", 1), Step("4-1", 3), Step("circles", 2), Step("3-2", 1))
    assert answer_from_counts(twice, [3, 1, 1]) == 1  # 3 - 1 - 1
    add = (Step("blue", 0), Step("0+3", 3))
    assert answer_from_counts(add, [1]) == 4
    with pytest.raises(ValueError, match="2 counts for a trace with 1 count steps"):
        answer_from_counts(add, [1, 2])


def test_slip_operation_flips_one_operator_and_the_answer_follows(splits):
    """A teacher's slip: the chosen arithmetic step takes the other operator, later steps start from its result,
    the answer is the last result; the counts are the reference's. Hand values, then every item of the splits."""

    def item(*steps: Step) -> MathItem:
        return MathItem(None, "q", steps[-1].value, steps, "t", None)  # type: ignore[arg-type]

    remove = item(Step("shapes", 4), Step("red", 2), Step("4-2", 2))
    slipped = slip_operation(remove, 0)
    assert slipped.steps == (Step("shapes", 4), Step("red", 2), Step("4+2", 6)) and slipped.answer == 6
    assert slipped.completion == "<think>shapes 4. red 2. 4+2=6</think><answer>6</answer>"
    chain = item(Step("shapes", 4), Step("red", 1), Step("4-1", 3), Step("squares", 1), Step("3-1", 2))
    assert slip_operation(chain, 0).steps[2:] == (Step("4+1", 5), Step("squares", 1), Step("5-1", 4))
    assert slip_operation(chain, 1).steps[2:] == (Step("4-1", 3), Step("squares", 1), Step("3+1", 4))
    assert trace_operations(chain.steps) == "--" and trace_operations(slip_operation(chain, 1).steps) == "-+"
    # a slip no teacher writes (below zero), or a step the trace does not have
    assert slip_operation(item(Step("red", 1), Step("1+3", 4)), 0) is None
    assert slip_operation(remove, 1) is None and slip_operation(remove, -1) is None
    for items in splits.values():
        for each in items:
            for which in range(len(trace_operations(each.steps))):
                wrong = slip_operation(each, which)
                if wrong is None:
                    continue
                assert [s for s in wrong.steps if s.is_count] == [s for s in each.steps if s.is_count]
                assert wrong.answer == wrong.steps[-1].value >= 0
                flipped = [
                    a != b
                    for a, b in zip(trace_operations(wrong.steps), trace_operations(each.steps), strict=True)
                ]
                assert flipped.count(True) == 1 and flipped.index(True) == which
                assert (wrong.question, wrong.template) == (each.question, each.template)
                assert wrong.scene is each.scene


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown shapes_math split 'test'"):
        make_math_items(3, 0, split="test")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be >= 0"):
        make_math_items(-1, 0)


def test_read_trace_accepts_any_text():
    assert read_trace("") == []
    assert read_trace("<think>shapes 4. red two. 4 - 2 = 2. blah</think><answer>2</answer>") == [
        Step("shapes", 4),
        Step("4-2", 2),
    ]
    # an unclosed trace is read up to the end
    assert read_trace("<think>shapes 3. blue 1") == [Step("shapes", 3), Step("blue", 1)]
    reference = (Step("shapes", 4), Step("red", 2), Step("4-2", 2))
    assert perception_accuracy("<think>shapes 4. red 1. 4-1=3</think>", reference) == (1, 2)
    assert format_completion(reference, 2) == "<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>"


def test_lenient_and_strict_checks():
    lenient = rewards.build("numeric", number_words=True, require_answer_tag=True)
    strict = rewards.build("exact_match", require_answer_tag=True)
    completions = [
        "<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>",
        "<think>x</think><answer> two. </answer>",
        "<think>x</think><answer>There are 2 shapes left.</answer>",
        "<think>shapes 4. red 2. 4-2=2",  # never closes its tags: 0 with a reason, no exception
        "<answer>3</answer>",
    ]
    out = lenient.score(completions=completions, ground_truths=["2"] * 5)
    assert out.scores.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert "no <answer>" in out.reasons[3]
    assert strict(completions=completions, ground_truths=["2"] * 5).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert rewards.build("format")(completions=completions[3:4]).tolist() == [0.0]


def test_load_vqa_resolves_shapes_math():
    examples = load_vqa("shapes_math:heldout_templates", limit=4, seed=2, image_size=64)
    items = make_math_items(4, seed=2, size=64, split="heldout_templates")
    assert [e.answer for e in examples] == [str(i.answer) for i in items]
    assert [e.kind for e in examples] == [i.template for i in items]
    assert examples[0].question == items[0].prompt and "<think>" in examples[0].question
    # each question carries its reference trace, which the reasoning_steps reward scores a trace against
    assert [e.reference for e in examples] == [format_trace(i.steps) for i in items]
    assert len({e.prompt_id for e in load_vqa("shapes_math:train", limit=50)}) == 50
    with pytest.raises(ValueError, match=r"unknown shapes_math split 'test'.*shapes_math:heldout_templates"):
        load_vqa("shapes_math:test")


def test_trace_styles_add_the_scene_without_changing_the_scored_steps():
    red_circle = SceneObject("circle", "red", x=10.0, y=20.0, size=12.0)
    blue_square = SceneObject("square", "blue", x=30.0, y=20.0, size=12.0)
    red_triangle = SceneObject("triangle", "red", x=50.0, y=20.0, size=12.0)
    scene = Scene(64, (200, 200, 200), (red_triangle, red_circle, blue_square))  # listed right to left
    steps = (Step("shapes", 3), Step("red", 2), Step("3-2", 1))
    item = MathItem(
        render(scene), "Remove all red shapes. How many shapes are left?", 1, steps, "remove_colour", scene
    )
    assert (
        item.completion_in("steps")
        == item.completion
        == "<think>shapes 3. red 2. 3-2=1</think><answer>1</answer>"
    )
    assert item.completion_in("describe") == (
        "<think>red circle, blue square, red triangle. shapes 3. red 2. 3-2=1</think><answer>1</answer>"
    )
    assert item.completion_in("enumerate") == (
        "<think>red circle 1, blue square 2, red triangle 3. shapes 3. red circle 1, red triangle 2. red 2. "
        "3-2=1</think><answer>1</answer>"
    )
    assert item.completion_in("tally") == (
        "<think>red circle 1, blue square 2, red triangle 3. shapes 3. red circle 1, blue square, red triangle 2. "
        "red 2. 3-2=1</think><answer>1</answer>"
    )
    absent = MathItem(
        item.image,
        "Add one green circle. How many green shapes are there?",
        1,
        (Step("green", 0), Step("0+1", 1)),
        "add_colour",
        scene,
    )
    assert absent.completion_in("enumerate") == "<think>none. green 0. 0+1=1</think><answer>1</answer>"
    assert absent.completion_in("tally") == (
        "<think>red circle, blue square, red triangle. green 0. 0+1=1</think><answer>1</answer>"
    )
    with pytest.raises(ValueError, match="unknown trace style 'prose'"):
        item.completion_in("prose")  # type: ignore[arg-type]
    for split in SPLITS:
        for each in make_math_items(60, seed=5, size=64, split=split):
            for style in TRACE_STYLES:
                assert read_trace(each.completion_in(style)) == list(each.steps)
