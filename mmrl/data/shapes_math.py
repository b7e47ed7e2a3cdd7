"""Shapes-math: CLEVR-Math-style arithmetic over a rendered shapes scene, answered after a short reasoning trace.

Each item is a scene (``mmrl.data.shapes.random_scene``, 1-4 objects), a question that applies one or two
operations to the scene's objects (remove all objects of a colour or shape, add ``k`` new objects, compare two
counts), its integer answer, and a reference reasoning trace that names every count the answer needs::

    Remove all red shapes. Then add two squares. How many shapes are there?
    <think>shapes 4. red 2. 4-2=2. 2+2=4</think><answer>4</answer>

A trace is a sequence of steps separated by ``". "``: a perception step ``"{label} {n}"`` (``shapes`` = every
object, a colour = the objects of that colour, a plural shape = the objects of that shape) and an arithmetic
step ``"{a}{+|-}{b}={c}"``. :func:`read_trace` parses a completion's trace back into steps, so the perception
sub-steps of a model's reasoning can be scored on their own (:func:`perception_accuracy`).

Templates (:data:`TEMPLATES`; ``heldout`` ones never appear in training, to measure generalisation to new
compositions of the same operations):

========================  ======================================================================  ========
template                  question                                                                held out
========================  ======================================================================  ========
``remove_colour``         Remove all {c} shapes. How many shapes are left?                         no
``remove_shape``          Remove all {s}s. How many shapes are left?                               no
``add_shape``             Add {k} {c} {s}s. How many {s}s are there?                               no
``add_colour``            Add {k} {c} {s}s. How many {c} shapes are there?                         no
``compare_shapes``        How many more {s1}s than {s2}s are there?                                no
``remove_colour_add``     Remove all {c} shapes. Then add {k} {s}s. How many shapes are there?     no
``remove_colour_shape``   Remove all {c} shapes. Then remove all {s}s. How many shapes are left?   no
``compare_colours``       How many more {c1} shapes than {c2} shapes are there?                   yes
``remove_shape_add``      Remove all {s1}s. Then add {k} {s2}s. How many shapes are there?         yes
========================  ======================================================================  ========

``k`` is a number word (one to three). A comparison names the larger count first (answers are never negative);
``remove_colour_shape`` is asked only when no object has both the colour and the shape, so its second removal
counts objects the first left in place.

Splits: by scene (as :func:`mmrl.data.shapes_vqa.is_heldout_scene`: no held-out scene shares its set of objects
with a training scene) and by template: ``train`` = training scenes x training templates, ``heldout`` =
held-out scenes x training templates, ``heldout_templates`` = held-out scenes x held-out templates. Every split
is balanced by template (item ``i`` uses template ``i mod T``) and deterministic under its arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
from PIL import Image

from mmrl.data.shapes import COLOURS, HELDOUT_FRACTION, SHAPES, Scene, SceneObject, random_scene, render
from mmrl.data.shapes_vqa import is_heldout_scene

__all__ = [
    "COUNT_TEMPLATES",
    "SPLITS",
    "TEMPLATES",
    "TRACE_STYLES",
    "MathItem",
    "Step",
    "Template",
    "answer_from_counts",
    "describe_scene",
    "format_completion",
    "format_prompt",
    "format_trace",
    "make_count_items",
    "make_math_items",
    "perception_accuracy",
    "read_trace",
    "slip_operation",
    "split_templates",
    "stated_counts",
    "template_names",
    "trace_operations",
]

MathSplit = Literal["train", "heldout", "heldout_templates"]
TraceStyle = Literal["steps", "describe", "enumerate", "tally"]
#: How a reference completion writes its trace (:meth:`MathItem.completion_in`).
TRACE_STYLES: tuple[str, ...] = get_args(TraceStyle)
SPLITS: tuple[str, ...] = ("train", "heldout", "heldout_templates")

#: ``k`` of an "add" operation, written as a word in the question
ADD_WORDS = {1: "one", 2: "two", 3: "three"}

_INSTRUCTION = "Think in <think></think>, then give the number in <answer></answer>."


def format_prompt(question: str) -> str:
    """The text prompt: the question, then how to answer (a reasoning trace, then the number in answer tags)."""
    return f"{question} {_INSTRUCTION}"


@dataclass(frozen=True)
class Step:
    """One reasoning step: a count (``label`` = ``shapes``, a colour or a plural shape; ``value`` = the count) or
    an arithmetic step (``label`` = ``"a-b"`` / ``"a+b"``, ``value`` = the result)."""

    label: str
    value: int

    @property
    def is_count(self) -> bool:
        return not any(op in self.label for op in "+-")

    @property
    def operator(self) -> str:
        """``"+"`` or ``"-"`` for an arithmetic step, ``""`` for a count."""
        return "+" if "+" in self.label else "-" if "-" in self.label else ""

    @property
    def operands(self) -> tuple[int, int]:
        """``(a, b)`` of an arithmetic step ``"a-b"`` / ``"a+b"``."""
        left, right = self.label.split(self.operator)
        return int(left), int(right)

    def __str__(self) -> str:
        return f"{self.label}={self.value}" if not self.is_count else f"{self.label} {self.value}"


def format_trace(steps: Sequence[Step]) -> str:
    """``"shapes 4. red 2. 4-2=2"``: the steps joined by ``". "``."""
    return ". ".join(str(step) for step in steps)


def format_completion(steps: Sequence[Step], answer: int | str) -> str:
    """The reference completion ``<think>{trace}</think><answer>{answer}</answer>``."""
    return f"<think>{format_trace(steps)}</think><answer>{answer}</answer>"


def answer_from_counts(steps: Sequence[Step], counts: Sequence[int]) -> int:
    """The answer a trace with the procedure of ``steps`` (a reference trace) reaches when its count steps state
    ``counts`` (one per count step, in order) instead of the true counts: each arithmetic step takes the previous
    step's result (or, for the first, the earliest count) and the next count not used yet, or the number of the
    question (``add k``) when every count is used. ``counts`` = the true counts gives the reference answer.

    Raises:
        ValueError: ``counts`` does not have one value per count step, or ``steps`` has no arithmetic step.
    """
    wanted = sum(step.is_count for step in steps)
    if len(counts) != wanted:
        raise ValueError(f"{len(counts)} counts for a trace with {wanted} count steps")
    stated = iter(counts)
    unused: list[int] = []
    result: int | None = None
    for step in steps:
        if step.is_count:
            unused.append(next(stated))
            continue
        left = result if result is not None else unused.pop(0)
        right = unused.pop(0) if unused else step.operands[1]
        result = left + right if step.operator == "+" else left - right
    if result is None:
        raise ValueError("a trace without an arithmetic step has no answer to recompute")
    return result


def describe_scene(scene: Scene) -> str:
    """``"red triangle, green circle"``: the scene's objects from left to right (by their centre's x)."""
    return ", ".join(f"{o.colour} {o.shape}" for o in _left_to_right(scene))


_COUNT_STEP = re.compile(r"([a-z]+) (\d+)")
_ARITHMETIC_STEP = re.compile(r"(\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)")


def read_trace(completion: str) -> list[Step]:
    """The steps of a completion's ``<think>`` span (or of the whole text when it has none); steps that do
    not parse are skipped, so any text is accepted."""
    span = re.findall(r"<think>(.*?)(?:</think>|$)", completion, flags=re.DOTALL)
    text = span[0] if span else completion
    steps = []
    for part in text.split("."):
        part = part.strip()
        if match := _ARITHMETIC_STEP.fullmatch(part):
            steps.append(Step(f"{match[1]}{match[2]}{match[3]}", int(match[4])))
        elif match := _COUNT_STEP.fullmatch(part):
            steps.append(Step(match[1], int(match[2])))
    return steps


def trace_operations(steps: Sequence[Step]) -> str:
    """The operators of the arithmetic steps in order, ``"-+"`` for ``shapes 4. red 2. 4-2=2. 2+2=4``: the
    procedure of a trace, whatever its counts."""
    return "".join(step.operator for step in steps)


def stated_counts(completion: str) -> dict[str, int]:
    """``{label: value}`` of the count steps of a completion's trace, the first one of each label."""
    said: dict[str, int] = {}
    for step in read_trace(completion):
        if step.is_count:
            said.setdefault(step.label, step.value)
    return said


def perception_accuracy(completion: str, reference: Sequence[Step]) -> tuple[int, int]:
    """``(correct, total)`` over the count steps of ``reference``: a count is correct when the completion's
    trace has a count step with the same label and value (the first one of that label, :func:`stated_counts`)."""
    said = stated_counts(completion)
    counts = [step for step in reference if step.is_count]
    return sum(said.get(step.label) == step.value for step in counts), len(counts)


@dataclass(frozen=True)
class MathItem:
    """One question about one rendered scene, with its answer and reference reasoning steps."""

    image: Image.Image
    question: str
    answer: int
    steps: tuple[Step, ...]
    template: str
    scene: Scene

    @property
    def prompt(self) -> str:
        """:func:`format_prompt` of the question."""
        return format_prompt(self.question)

    @property
    def completion(self) -> str:
        """The reference completion (:func:`format_completion`)."""
        return format_completion(self.steps, self.answer)

    def completion_in(self, style: TraceStyle) -> str:
        """The reference completion in a trace style (:data:`TRACE_STYLES`), here for a scene of a red circle, a
        blue square and a red triangle and the question "Remove all red shapes. How many shapes are left?":

        * ``steps``: :attr:`completion`, ``<think>shapes 3. red 2. 3-2=1</think><answer>1</answer>``;
        * ``describe``: the scene's objects left to right first (:func:`describe_scene`),
          ``<think>red circle, blue square, red triangle. shapes 3. red 2. 3-2=1</think>...``;
        * ``enumerate``: each count step after the objects it counts, numbered left to right (``none`` when there
          are none), ``<think>red circle 1, blue square 2, red triangle 3. shapes 3. red circle 1, red triangle
          2. red 2. 3-2=1</think>...``;
        * ``tally``: before each count step, every object left to right, those it counts followed by a running
          tally, ``<think>red circle 1, blue square 2, red triangle 3. shapes 3. red circle 1, blue square, red
          triangle 2. red 2. 3-2=1</think>...``: each token to write depends on the object at hand, the question's
          attribute and the last number written, never on a count over the whole scene.

        The added parts are not steps (:func:`read_trace` skips them), so the scored trace is the same in every
        style.
        """
        if style == "steps":
            return self.completion
        if style == "describe":
            parts = [describe_scene(self.scene), format_trace(self.steps)]
        elif style in _COUNT_WALKS:
            walk = _COUNT_WALKS[style]
            parts = []
            for step in self.steps:
                if step.is_count:
                    parts.append(walk(self.scene, step.label))
                parts.append(str(step))
        else:
            raise ValueError(f"unknown trace style {style!r}; use one of {list(TRACE_STYLES)}")
        return f"<think>{'. '.join(parts)}</think><answer>{self.answer}</answer>"


def slip_operation(item: MathItem, which: int) -> MathItem | None:
    """``item`` as a careless teacher writes it: arithmetic step ``which`` (0 = the first) takes the other
    operator, and every later result and the answer follow from it, ``shapes 4. red 2. 4+2=6`` ->
    ``<answer>6</answer>`` for "Remove all red shapes. How many shapes are left?". The counts stay right, so the
    slip is one of procedure, fixable from the question's words. ``None`` when the slipped trace would reach a
    negative number (``1-3``: no teacher writes it) or ``which`` is not an arithmetic step of the trace.
    """
    if not 0 <= which < len(trace_operations(item.steps)):
        return None
    steps: list[Step] = []
    result: int | None = None
    arithmetic = -1
    for step in item.steps:
        if step.is_count:
            steps.append(step)
            continue
        arithmetic += 1
        left, right = step.operands
        if result is not None:
            left = result
        op = step.operator if arithmetic != which else "-" if step.operator == "+" else "+"
        result = left + right if op == "+" else left - right
        if result < 0:
            return None
        steps.append(Step(f"{left}{op}{right}", result))
    return MathItem(item.image, item.question, result, tuple(steps), item.template, item.scene)


def _left_to_right(scene: Scene) -> list[SceneObject]:
    return sorted(scene.objects, key=lambda o: o.x)


def _numbered_walk(scene: Scene, label: str) -> str:
    """``"red circle 1, red triangle 2"``: the objects under ``label`` (a count step's label, :func:`_labels`) left
    to right, numbered; ``"none"`` when there are none."""
    counted = [obj for obj in _left_to_right(scene) if label in _labels(obj)]
    return ", ".join(f"{obj.colour} {obj.shape} {i}" for i, obj in enumerate(counted, 1)) or "none"


def _tally_walk(scene: Scene, label: str) -> str:
    """``"red circle 1, blue square, red triangle 2"``: every object left to right, those under ``label`` (a
    count step's label, :func:`_labels`) followed by the running count."""
    counted, words = 0, []
    for obj in _left_to_right(scene):
        if label in _labels(obj):
            counted += 1
            words.append(f"{obj.colour} {obj.shape} {counted}")
        else:
            words.append(f"{obj.colour} {obj.shape}")
    return ", ".join(words)


def _labels(obj: SceneObject) -> tuple[str, str, str]:
    """The count labels an object falls under: every object, its colour, its plural shape."""
    return ("shapes", obj.colour, f"{obj.shape}s")


#: What the ``enumerate`` and ``tally`` trace styles write before each count step.
_COUNT_WALKS: dict[str, Callable[[Scene, str], str]] = {"enumerate": _numbered_walk, "tally": _tally_walk}


# ------------------------------------------------------------------------------------------- templates

Question = tuple[str, tuple[Step, ...], int]


def _count(scene: Scene, colour: str | None = None, shape: str | None = None) -> int:
    return sum(
        (colour is None or o.colour == colour) and (shape is None or o.shape == shape) for o in scene.objects
    )


def _pick(rng: np.random.Generator, present: list[str], vocab: tuple[str, ...]) -> str:
    """A word of ``vocab``: one of ``present`` 3 times in 4 (absent once in 4, when any is; always when none is
    present), so that counts are not mostly 0."""
    absent = [v for v in vocab if v not in present]
    present = sorted({v for v in present if v in vocab})
    pool = absent if absent and (not present or rng.random() < 0.25) else present
    return pool[rng.integers(len(pool))]


def _add_phrase(k: int, colour: str | None, shape: str) -> str:
    noun = shape if k == 1 else f"{shape}s"
    return f"{ADD_WORDS[k]} {colour + ' ' if colour else ''}{noun}"


def _counted(scene: Scene, attribute: Literal["colour", "shape"], word: str) -> tuple[int, str, str]:
    """``(count, step label, noun phrase)`` of the objects with colour or shape ``word``: ``(2, "red", "red
    shapes")``, ``(1, "circles", "circles")``."""
    if attribute == "colour":
        return _count(scene, colour=word), word, f"{word} shapes"
    return _count(scene, shape=word), f"{word}s", f"{word}s"


def _remove(scene: Scene, rng: np.random.Generator, attribute: Literal["colour", "shape"]) -> Question:
    total = len(scene.objects)
    vocab = COLOURS if attribute == "colour" else SHAPES
    word = _pick(rng, [getattr(o, attribute) for o in scene.objects], vocab)
    removed, label, phrase = _counted(scene, attribute, word)
    left = total - removed
    steps = (Step("shapes", total), Step(label, removed), Step(f"{total}-{removed}", left))
    return f"Remove all {phrase}. How many shapes are left?", steps, left


def _add(scene: Scene, rng: np.random.Generator, asked: Literal["colour", "shape"]) -> Question:
    k = int(rng.integers(1, 4))
    colour = _pick(rng, [o.colour for o in scene.objects], COLOURS)
    shape = _pick(rng, [o.shape for o in scene.objects], SHAPES)
    if asked == "shape":
        before, label, target = _count(scene, shape=shape), f"{shape}s", f"{shape}s"
    else:
        before, label, target = _count(scene, colour=colour), colour, f"{colour} shapes"
    steps = (Step(label, before), Step(f"{before}+{k}", before + k))
    return f"Add {_add_phrase(k, colour, shape)}. How many {target} are there?", steps, before + k


def _compare(scene: Scene, rng: np.random.Generator, attribute: Literal["colour", "shape"]) -> Question:
    vocab = COLOURS if attribute == "colour" else SHAPES
    present = sorted({getattr(o, attribute) for o in scene.objects})
    first = present[rng.integers(len(present))]
    second = _pick(rng, present, tuple(v for v in vocab if v != first))

    def count(value: str) -> int:
        return _count(scene, **{attribute: value})

    # the larger count first, so "how many more" is never negative
    if count(second) > count(first):
        first, second = second, first
    a, b = count(first), count(second)
    if attribute == "colour":
        labels, question = (first, second), f"How many more {first} shapes than {second} shapes are there?"
    else:
        labels, question = (f"{first}s", f"{second}s"), f"How many more {first}s than {second}s are there?"
    steps = (Step(labels[0], a), Step(labels[1], b), Step(f"{a}-{b}", a - b))
    return question, steps, a - b


def _remove_then_add(
    scene: Scene, rng: np.random.Generator, attribute: Literal["colour", "shape"]
) -> Question:
    question, steps, left = _remove(scene, rng, attribute)
    k = int(rng.integers(1, 4))
    removed_shape = steps[1].label[:-1] if attribute == "shape" else None
    shape = SHAPES[rng.integers(len(SHAPES))]
    while shape == removed_shape:  # "Remove all circles. Then add two circles." reads as a trick question
        shape = SHAPES[rng.integers(len(SHAPES))]
    first = question.split(". ")[0]
    chained = f"{first}. Then add {_add_phrase(k, None, shape)}. How many shapes are there?"
    return chained, (*steps, Step(f"{left}+{k}", left + k)), left + k


def _remove_colour_shape(scene: Scene, rng: np.random.Generator) -> Question | None:
    question, steps, left = _remove(scene, rng, "colour")
    colour = steps[1].label
    shape = _pick(rng, [o.shape for o in scene.objects if o.colour != colour], SHAPES)
    if _count(scene, colour=colour, shape=shape):
        return None  # an object of both would be removed twice: the second count would not be the trace's
    removed = _count(scene, shape=shape)
    first = question.split(". ")[0]
    chained = f"{first}. Then remove all {shape}s. How many shapes are left?"
    steps = (*steps, Step(f"{shape}s", removed), Step(f"{left}-{removed}", left - removed))
    return chained, steps, left - removed


@dataclass(frozen=True)
class Template:
    """A question template: ``ask(scene, rng)`` draws a question, its reference steps and answer, or returns
    ``None`` when the scene cannot be asked it unambiguously."""

    name: str
    heldout: bool
    ask: Callable[[Scene, np.random.Generator], Question | None]


TEMPLATES: tuple[Template, ...] = (
    Template("remove_colour", False, lambda scene, rng: _remove(scene, rng, "colour")),
    Template("remove_shape", False, lambda scene, rng: _remove(scene, rng, "shape")),
    Template("add_shape", False, lambda scene, rng: _add(scene, rng, "shape")),
    Template("add_colour", False, lambda scene, rng: _add(scene, rng, "colour")),
    Template("compare_shapes", False, lambda scene, rng: _compare(scene, rng, "shape")),
    Template("remove_colour_add", False, lambda scene, rng: _remove_then_add(scene, rng, "colour")),
    Template("remove_colour_shape", False, _remove_colour_shape),
    Template("compare_colours", True, lambda scene, rng: _compare(scene, rng, "colour")),
    Template("remove_shape_add", True, lambda scene, rng: _remove_then_add(scene, rng, "shape")),
)


def _count_one(
    scene: Scene, rng: np.random.Generator, attribute: Literal["all", "colour", "shape"]
) -> Question:
    if attribute == "all":
        total = len(scene.objects)
        return "How many shapes are there?", (Step("shapes", total),), total
    # any colour or shape, present or not: a question about a colour of the scene would let a model that names
    # a colour it sees, whatever was asked, be right most of the time
    vocab = COLOURS if attribute == "colour" else SHAPES
    value, label, phrase = _counted(scene, attribute, vocab[rng.integers(len(vocab))])
    return f"How many {phrase} are there?", (Step(label, value),), value


#: One-step perception questions (a trace of a single count step, ``<think>red 2</think><answer>2</answer>``):
#: not a split's templates, an SFT auxiliary task (:func:`make_count_items`) that teaches the count steps every
#: template's trace is made of, the attribute read from the question included.
COUNT_TEMPLATES: tuple[Template, ...] = (
    Template("count_all", False, lambda scene, rng: _count_one(scene, rng, "all")),
    Template("count_colour", False, lambda scene, rng: _count_one(scene, rng, "colour")),
    Template("count_shape", False, lambda scene, rng: _count_one(scene, rng, "shape")),
)


def template_names(heldout: bool) -> list[str]:
    """Names of the held-out (``True``) or training (``False``) templates, in :data:`TEMPLATES` order."""
    return [t.name for t in TEMPLATES if t.heldout == heldout]


def make_math_items(
    n: int,
    seed: int,
    size: int = 64,
    split: MathSplit = "train",
    *,
    fraction: float = HELDOUT_FRACTION,
    templates: Sequence[str] | None = None,
) -> list[MathItem]:
    """``n`` shapes-math items of a split, deterministic under ``(n, seed, size, split, fraction, templates)``.

    Item ``i`` asks template ``templates[i % T]`` of the split (training templates for ``train`` and ``heldout``,
    held-out templates for ``heldout_templates``; ``templates`` names a subset of them, in :data:`TEMPLATES`
    order whatever order it is given in) about a fresh random scene of the split's scenes (training scenes for
    ``train``, held-out scenes otherwise); scenes of the other split, or that cannot be asked the template, are
    skipped. With every template of the split named the draws are those of ``templates=None``.

    Raises:
        ValueError: ``n < 0``, an unknown split, ``fraction`` outside (0, 1), or ``templates`` empty or naming a
            template that is not the split's.
    """
    _check_draw(n, split, fraction)
    rng = np.random.default_rng([seed, 0x3A7, size, SPLITS.index(split)])
    return _draw_items(split_templates(split, templates), n, rng, size, split != "train", fraction)


def split_templates(split: MathSplit, names: Sequence[str] | None = None) -> list[Template]:
    """The templates a split draws from (:data:`TEMPLATES` order): the held-out ones for ``heldout_templates``,
    the training ones otherwise, or the subset of them that ``names`` names.

    Raises:
        ValueError: ``names`` empty or naming a template that is not the split's.
    """
    templates = [t for t in TEMPLATES if t.heldout == (split == "heldout_templates")]
    if names is None:
        return templates
    allowed = [t.name for t in templates]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise ValueError(
            f"templates of shapes_math split {split!r} must be a non-empty subset of {allowed}"
            + (f" ({unknown} not among them)" if unknown else "")
        )
    return [t for t in templates if t.name in names]


def make_count_items(
    n: int, seed: int, size: int = 64, split: MathSplit = "train", *, fraction: float = HELDOUT_FRACTION
) -> list[MathItem]:
    """``n`` one-step count items (:data:`COUNT_TEMPLATES`, item ``i`` asks ``COUNT_TEMPLATES[i % 3]``) about
    fresh scenes of the split's scenes, deterministic under the arguments and independent of
    :func:`make_math_items`'s draws.

    Raises:
        ValueError: as :func:`make_math_items`.
    """
    _check_draw(n, split, fraction)
    rng = np.random.default_rng([seed, 0xC0, size, SPLITS.index(split)])
    return _draw_items(COUNT_TEMPLATES, n, rng, size, split != "train", fraction)


def _check_draw(n: int, split: str, fraction: float) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split not in SPLITS:
        raise ValueError(f"unknown shapes_math split {split!r}; use one of {list(SPLITS)}")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1) so both splits have scenes, got {fraction}")


def _draw_items(
    templates: Sequence[Template],
    n: int,
    rng: np.random.Generator,
    size: int,
    heldout_scenes: bool,
    fraction: float,
) -> list[MathItem]:
    items: list[MathItem] = []
    while len(items) < n:
        template = templates[len(items) % len(templates)]
        scene = random_scene(int(rng.integers(2**62)), size)
        if is_heldout_scene(scene, fraction) != heldout_scenes:
            continue
        asked = template.ask(scene, rng)
        if asked is None:
            continue
        question, steps, answer = asked
        items.append(MathItem(render(scene), question, answer, steps, template.name, scene))
    return items
