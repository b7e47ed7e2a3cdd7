"""Visual question answering on the shapes world: questions with exact, unambiguous answers.

Each item is a rendered scene (``mmrl.data.shapes.random_scene``), a question about it, and the answer, which
is a digit string for counts (``"0"``..``"4"``) and one lower-case word otherwise (a colour, a shape, ``yes`` /
``no``). The model is asked to answer inside ``<answer>...</answer>`` (:func:`format_prompt`), and completions
are scored by the exact-match verifier ``rewards.build("exact_match")``.

Question kinds (:data:`VQA_KINDS`, asked in turn so every batch is balanced):

==================  =====================================================  ================================
kind                question                                               asked when
==================  =====================================================  ================================
``count_shape``     how many {shape}s are there?                           always (an absent shape 1 in 4)
``count_colour``    how many {colour} objects are there?                   always (an absent colour 1 in 4)
``count_total``     how many shapes are there in total?                    always
``colour_of``       what colour is the {shape}?                            exactly one object has the shape
``shape_of``        what shape is the {colour} object?                     exactly one object has the colour
``exists``          is there a {colour} {shape}?                           always; yes and no equally often
``relation``        is the {colour} {shape} {relation} the {colour} {shape}?  both objects unique, relation
                                                                           clear; yes and no equally often
==================  =====================================================  ================================

Split: by scene content. A scene is held out when the sha256 of its sorted list of ``"{colour} {shape}"``
falls below ``fraction`` (as in :func:`mmrl.data.shapes.is_heldout`), so no held-out scene shares its set of
objects with a training scene; the question templates are shared by both splits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image

from mmrl.data.shapes import (
    COLOURS,
    HELDOUT_FRACTION,
    RELATION_MIN,
    RELATIONS,
    SHAPES,
    Scene,
    SceneObject,
    random_scene,
    render,
    stable_unit_hash,
)
from rewards.shapes import relation_offset

__all__ = ["VQA_KINDS", "VQAItem", "answer_question", "format_prompt", "is_heldout_scene", "make_vqa_items"]

VQA_KINDS: tuple[str, ...] = (
    "count_shape",
    "count_colour",
    "count_total",
    "colour_of",
    "shape_of",
    "exists",
    "relation",
)

#: a relation question is asked only when GenEval's normalised offset along the relation's axis is at least
#: RELATION_MIN (answer yes) or at most CLEARLY_NOT (answer no); in between the answer would be arguable
CLEARLY_NOT = 0.25

_INSTRUCTION = (
    "Answer with a number in digits if the question asks how many, otherwise with one lower-case word. "
    "Put the answer inside <answer></answer>, for example <answer>2</answer> or <answer>yes</answer>."
)


def format_prompt(question: str) -> str:
    """The text prompt for a VLM: the question, then how to answer (digits for counts, one lower-case word
    otherwise, inside ``<answer></answer>``)."""
    return f"{question} {_INSTRUCTION}"


@dataclass(frozen=True)
class VQAItem:
    """One question about one rendered scene; ``answer`` is what the exact-match verifier expects."""

    image: Image.Image
    question: str
    answer: str
    kind: str
    scene: Scene

    @property
    def prompt(self) -> str:
        """:func:`format_prompt` of the question."""
        return format_prompt(self.question)


def is_heldout_scene(scene: Scene, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether a scene belongs to the held-out VQA split: ``sha256`` of its sorted objects ``< fraction``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    content = ",".join(sorted(f"{o.colour} {o.shape}" for o in scene.objects))
    return stable_unit_hash(f"vqa-scene:{content}") < fraction


def _relation_value(relation: str, a: SceneObject, b: SceneObject) -> float:
    """How far ``a {relation} b`` holds on GenEval's normalised offset (> 0.5 holds for the verifier)."""
    dx, dy = relation_offset(a.box, b.box)
    return {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]


def _pick(rng: np.random.Generator, present: list[str], vocab: tuple[str, ...]) -> str:
    """A word of ``vocab``: one present in the scene 3 times in 4 (absent once in 4, when any is), so that
    count answers are not mostly 0."""
    absent = [v for v in vocab if v not in present]
    pool = absent if absent and rng.random() < 0.25 else sorted(set(present))
    return pool[rng.integers(len(pool))]


def answer_question(
    kind: str, scene: Scene, rng: np.random.Generator, want_yes: bool | None = None
) -> tuple[str, str] | None:
    """Draw a question of ``kind`` about ``scene`` and its answer, or ``None`` if the scene cannot answer one
    unambiguously (``colour_of`` when no shape occurs exactly once, ...).

    Args:
        want_yes: for the yes/no kinds, the answer to aim for (``None``: a fair coin); ``None`` is returned
            when the scene has no question with that answer.

    Raises:
        ValueError: an unknown kind (the message lists :data:`VQA_KINDS`).
    """
    objs = scene.objects
    if want_yes is None:
        want_yes = bool(rng.random() < 0.5)
    if kind == "count_shape":
        shape = _pick(rng, [o.shape for o in objs], SHAPES)
        return f"how many {shape}s are there?", str(sum(o.shape == shape for o in objs))
    if kind == "count_colour":
        colour = _pick(rng, [o.colour for o in objs], COLOURS)
        return f"how many {colour} objects are there?", str(sum(o.colour == colour for o in objs))
    if kind == "count_total":
        return "how many shapes are there in total?", str(len(objs))
    if kind == "colour_of":
        unique = [o for o in objs if sum(p.shape == o.shape for p in objs) == 1]
        if not unique:
            return None
        o = unique[rng.integers(len(unique))]
        return f"what colour is the {o.shape}?", o.colour
    if kind == "shape_of":
        unique = [o for o in objs if sum(p.colour == o.colour for p in objs) == 1]
        if not unique:
            return None
        o = unique[rng.integers(len(unique))]
        return f"what shape is the {o.colour} object?", o.shape
    if kind == "exists":
        present = {(o.colour, o.shape) for o in objs}
        pool = (
            sorted(present)
            if want_yes
            else [(c, s) for c in COLOURS for s in SHAPES if (c, s) not in present]
        )
        colour, shape = pool[rng.integers(len(pool))]
        return f"is there a {colour} {shape}?", "yes" if want_yes else "no"
    if kind == "relation":
        # both objects must be the only ones of their colour and shape, so "the {colour} {shape}" is defined
        unique = [o for o in objs if sum((p.colour, p.shape) == (o.colour, o.shape) for p in objs) == 1]
        options = [
            (a, b, r)
            for a in unique
            for b in unique
            if a is not b
            for r in RELATIONS
            if (
                _relation_value(r, a, b) >= RELATION_MIN
                if want_yes
                else _relation_value(r, a, b) <= CLEARLY_NOT
            )
        ]
        if not options:
            return None
        a, b, relation = options[rng.integers(len(options))]
        question = f"is the {a.colour} {a.shape} {relation} the {b.colour} {b.shape}?"
        return question, "yes" if want_yes else "no"
    raise ValueError(f"unknown VQA kind {kind!r}; available: {list(VQA_KINDS)}")


def make_vqa_items(
    n: int,
    seed: int,
    size: int = 32,
    split: Literal["train", "heldout"] = "train",
    *,
    kinds: tuple[str, ...] = VQA_KINDS,
    fraction: float = HELDOUT_FRACTION,
) -> list[VQAItem]:
    """``n`` VQA items of a split, deterministic under ``(n, seed, size, split, kinds, fraction)``.

    Item ``i`` asks a question of kind ``kinds[i % len(kinds)]`` about a fresh random scene of the split
    (scenes of the other split, or that cannot answer the kind unambiguously, are skipped); yes/no kinds
    alternate their answer, so yes and no are equally frequent.

    Raises:
        ValueError: ``n < 0``, an unknown split or kind, or ``fraction`` outside (0, 1).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1) so both splits have scenes, got {fraction}")
    for kind in kinds:
        if kind not in VQA_KINDS:
            raise ValueError(f"unknown VQA kind {kind!r}; available: {list(VQA_KINDS)}")
    rng = np.random.default_rng([seed, 0x7A, size])
    items = []
    while len(items) < n:
        kind = kinds[len(items) % len(kinds)]
        scene = random_scene(int(rng.integers(2**62)), size)
        if is_heldout_scene(scene, fraction) != (split == "heldout"):
            continue
        # the i-th question of a kind aims for "yes" when i is even
        qa = answer_question(kind, scene, rng, want_yes=(len(items) // len(kinds)) % 2 == 0)
        if qa is None:
            continue
        items.append(VQAItem(render(scene), qa[0], qa[1], kind, scene))
    return items
