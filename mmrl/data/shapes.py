"""The shapes world: scenes of coloured circles, squares and triangles, their prompts, and a renderer.

Everything here is deterministic under a seed and runs on a CPU in microseconds per image, so it is the
embedded data of the flow-matching and VLM front ends (see "The shapes world" in DESIGN.md, docs/shapes.md).

Grammar (the finite set :func:`all_prompts`, 1,560 prompts), lower case, number words:

* ``a photo of a {colour} {shape}``
* ``a photo of one {shape}`` and ``a photo of {two|three|four} {shape}s``
* ``a photo of a {colour} {shape} and a {colour} {shape}``
* ``a photo of a {colour} {shape} {left of|right of|above|below} a {colour} {shape}``

where the two objects of a two-object prompt differ. The vocabulary and the parser live in
:mod:`rewards.shapes` (the verifier must not import ``mmrl``) and are re-exported here.

Split: a prompt is held out when ``int(sha256(canonical(prompt))[:16], 16) / 2**64 < fraction``, where the
canonical form makes prompts that describe the same scene ("a red circle and a blue square" / "a blue square
and a red circle"; "A left of B" / "B right of A") fall on the same side, so no evaluation scene is trained on
under another wording.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from rewards.shapes import (
    COLOURS,
    COUNT_WORDS,
    PALETTE,
    POSITION_THRESHOLD,
    RELATIONS,
    SHAPES,
    DetectedObject,
    ObjectSpec,
    PromptKind,
    PromptSpec,
    parse_prompt,
)

__all__ = [
    "COLOURS",
    "COUNT_WORDS",
    "KINDS",
    "PALETTE",
    "PERTURBATIONS",
    "RELATIONS",
    "SHAPES",
    "Scene",
    "SceneObject",
    "all_prompts",
    "canonical_prompt",
    "heldout_prompts",
    "is_heldout",
    "near_miss_prompts",
    "parse_prompt",
    "perturb",
    "prompt_kind",
    "random_scene",
    "render",
    "render_prompt",
    "sample_prompts",
    "scene_for_prompt",
    "stable_unit_hash",
    "train_prompts",
    "write_prompt_file",
]

Split = Literal["train", "heldout", "all"]
KINDS: tuple[PromptKind, ...] = ("single", "count", "pair", "relation")

#: default held-out fraction of the prompt split
HELDOUT_FRACTION = 0.2
#: object size (side of the bounding box) as a fraction of the canvas side
SIZE_RANGE = (0.25, 0.36)
#: background grey level range (light, so every palette colour stands out) and per-channel tint
BACKGROUND_RANGE = (175, 245)
BACKGROUND_TINT = 6
#: a relation is drawn with GenEval's normalised offset (rewards.shapes.relation_offset) at least this far
#: along the relation's axis and at most OFF_AXIS_MAX across it; the verifier's threshold is 0.5 on both
RELATION_MIN = 0.75
OFF_AXIS_MAX = 0.3
#: supersampling factor of the anti-aliased renderer
SUPERSAMPLE = 4


@dataclass(frozen=True)
class SceneObject:
    """One object of a scene: its box is ``[x - size/2, x + size/2] x [y - size/2, y + size/2]`` in pixels
    (``x`` right, ``y`` down, the canvas is ``[0, S] x [0, S]``); a triangle points up and fills that box's
    base and height."""

    shape: str
    colour: str
    x: float
    y: float
    size: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)

    def as_detected(self) -> DetectedObject:
        """The object as the verifier would report it (to score a scene's ground truth)."""
        return DetectedObject(self.shape, self.colour, self.box)


@dataclass(frozen=True)
class Scene:
    """A square canvas of side ``size`` pixels with a background colour and non-overlapping objects."""

    size: int
    background: tuple[int, int, int]
    objects: tuple[SceneObject, ...]


# ------------------------------------------------------------------------------------------------ prompts


def _obj(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def all_prompts() -> list[str]:
    """Every prompt of the grammar (1,560), in a fixed order: single, count, pair, relation."""
    objects = [(c, s) for s in SHAPES for c in COLOURS]
    out = [f"a photo of {_obj(c, s)}" for c, s in objects]
    for s in SHAPES:
        out.append(f"a photo of one {s}")
        out += [f"a photo of {w} {s}s" for w in COUNT_WORDS[1:]]
    pairs = [(a, b) for a in objects for b in objects if a != b]
    out += [f"a photo of {_obj(*a)} and {_obj(*b)}" for a, b in pairs]
    out += [f"a photo of {_obj(*a)} {r} {_obj(*b)}" for a, b in pairs for r in RELATIONS]
    return out


def prompt_kind(prompt: str) -> PromptKind:
    """``"single"``, ``"count"``, ``"pair"`` or ``"relation"`` (raises ``ValueError`` outside the grammar)."""
    return parse_prompt(prompt).kind


def canonical_prompt(prompt: str) -> str:
    """One wording per scene: pair objects in a fixed order, relations as ``left of`` / ``above``.

    ``"a photo of a blue square and a red circle"`` -> ``"a photo of a red circle and a blue square"`` (order of
    :data:`SHAPES` then :data:`COLOURS`); ``"A right of B"`` -> ``"B left of A"``; ``"A below B"`` -> ``"B above A"``.
    """
    spec = parse_prompt(prompt)
    if spec.kind in ("pair", "relation"):
        a, b = spec.objects
        rel = spec.relation
        if rel in ("right of", "below"):
            a, b, rel = b, a, {"right of": "left of", "below": "above"}[rel]
        elif rel is None and _order(b) < _order(a):
            a, b = b, a
        spec = PromptSpec(spec.kind, (a, b), rel)
    return spec.to_prompt()


def _order(o: ObjectSpec) -> tuple[int, int]:
    return SHAPES.index(o.shape), COLOURS.index(o.colour or COLOURS[0])


def stable_unit_hash(text: str) -> float:
    """Stable uniform number in [0, 1) from text (sha256; Python's ``hash`` is salted per process)."""
    return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:16], 16) / 2.0**64


def is_heldout(prompt: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether ``prompt`` belongs to the held-out (evaluation) split.

    ``int(sha256(canonical_prompt(prompt))[:16], 16) / 2**64 < fraction``.

    Raises:
        ValueError: ``fraction`` outside [0, 1], or the prompt is outside the grammar.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    return stable_unit_hash(canonical_prompt(prompt)) < fraction


def _split_prompts(split: Split, fraction: float) -> list[str]:
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    prompts = all_prompts()
    if split == "all":
        return prompts
    return [p for p in prompts if is_heldout(p, fraction) == (split == "heldout")]


def train_prompts(fraction: float = HELDOUT_FRACTION) -> list[str]:
    """The training prompts, in :func:`all_prompts` order."""
    return _split_prompts("train", fraction)


def heldout_prompts(fraction: float = HELDOUT_FRACTION) -> list[str]:
    """The held-out prompts, in :func:`all_prompts` order; disjoint from :func:`train_prompts`."""
    return _split_prompts("heldout", fraction)


def sample_prompts(
    n: int,
    seed: int,
    split: Split = "train",
    *,
    balanced: bool = True,
    fraction: float = HELDOUT_FRACTION,
) -> list[str]:
    """``n`` prompts of a split, deterministic under ``seed``.

    Prompts are drawn without replacement from a shuffled pool, reshuffled when it runs out (so ``n`` larger
    than the pool repeats each prompt as evenly as possible). With ``balanced`` (the default) the four
    templates take turns (single, count, pair, relation, single, ...), each from its own pool, as GenEval
    balances its tasks; otherwise prompts are drawn from the whole split, where relation prompts are 78%.

    Raises:
        ValueError: ``n < 0``, an unknown split, or a split with no prompts of a template.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    prompts = _split_prompts(split, fraction)
    rng = np.random.default_rng([seed, 0x5A3E])
    if balanced:
        pools = [[p for p in prompts if prompt_kind(p) == k] for k in KINDS]
        for kind, pool in zip(KINDS, pools, strict=True):
            if not pool:
                raise ValueError(f"split {split!r} with fraction {fraction} has no {kind!r} prompts")
    else:
        pools = [prompts]
    queues: list[list[str]] = [[] for _ in pools]
    out = []
    for i in range(n):
        j = i % len(pools)
        if not queues[j]:
            queues[j] = [pools[j][k] for k in rng.permutation(len(pools[j]))]
        out.append(queues[j].pop())
    return out


def write_prompt_file(path: str | Path, prompts: Iterable[str]) -> Path:
    """Write prompts one per line (the format of ``mmrl eval --prompts FILE``); every prompt is validated first.
    :func:`mmrl.data.prompts.load_prompts` reads the file back and ``check_prompts`` names a bad line of it.

    Raises:
        ValueError: a prompt is outside the grammar (named); nothing is written then.
    """
    lines = [" ".join(p.split()) for p in prompts]
    for p in lines:
        parse_prompt(p)
    path = Path(path)
    path.write_text("".join(f"{p}\n" for p in lines), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ scenes


def _gap(size: int) -> float:
    """Smallest clear space between two objects' boxes: enough that a blur of radius 1 does not merge them."""
    return max(3.0, 0.1 * size)


def _margin(size: int) -> float:
    """Smallest clear space between an object and the canvas edge."""
    return max(1.0, 0.04 * size)


def _normalised_offsets(xy: np.ndarray, sides: np.ndarray) -> np.ndarray:
    """GenEval's normalised offset (:func:`rewards.shapes.relation_offset`) of object 0 from object 1 for a
    batch of candidate layouts: ``xy [T, n, 2]`` centres, ``sides [T, n]`` -> ``[T, 2]`` (dx, dy)."""
    offset = xy[:, 0] - xy[:, 1]  # [T, 2]
    dims = (sides[:, 0] + sides[:, 1])[:, None]  # both boxes are squares: the same extent along x and y
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0.0) * np.sign(offset)
    return revised / np.maximum(np.linalg.norm(offset, axis=1, keepdims=True), 1e-9)


def _place(
    rng: np.random.Generator,
    items: list[tuple[str, str]],
    size: int,
    relation: str | None = None,
    candidates: int = 64,
    rounds: int = 64,
) -> tuple[SceneObject, ...]:
    """Random non-overlapping placement of ``(shape, colour)`` items inside the canvas.

    Rejection sampling, vectorised: each round draws ``candidates`` layouts (sizes uniform in
    :data:`SIZE_RANGE`, centres uniform where the object fits) and keeps the first valid one. Boxes must be
    :func:`_gap` apart along x or y; for a relation the layout must pass :data:`RELATION_MIN` /
    :data:`OFF_AXIS_MAX`. Sizes shrink by 10% every 16 failed rounds, so a crowded scene always fits.
    """
    lo, hi = SIZE_RANGE
    margin, gap = _margin(size), _gap(size)
    n = len(items)
    scale = 1.0
    for round_ in range(rounds):
        if round_ and round_ % 16 == 0:
            scale *= 0.9
        sides = rng.uniform(lo, hi, (candidates, n)) * size * scale  # [T, n]
        room = size - 2 * margin - sides  # [T, n] range of centres that keeps the object inside
        xy = margin + sides[..., None] / 2 + rng.uniform(0.0, 1.0, (candidates, n, 2)) * room[..., None]
        ok = np.ones(candidates, dtype=bool)
        for i in range(n):
            for j in range(i + 1, n):
                reach = (sides[:, i] + sides[:, j]) / 2 + gap  # [T]
                apart = np.abs(xy[:, i] - xy[:, j]) >= reach[:, None]  # [T, 2] separated along x / y
                ok &= apart.any(1)
        if relation is not None:
            dx, dy = _normalised_offsets(xy, sides).T
            along, across = {
                "left of": (-dx, dy),
                "right of": (dx, dy),
                "above": (-dy, dx),
                "below": (dy, dx),
            }[relation]
            ok &= (along >= RELATION_MIN) & (np.abs(across) <= OFF_AXIS_MAX)
        if ok.any():
            t = int(ok.argmax())
            return tuple(
                SceneObject(shape, colour, float(xy[t, i, 0]), float(xy[t, i, 1]), float(sides[t, i]))
                for i, (shape, colour) in enumerate(items)
            )
    raise RuntimeError(f"could not place {items} on a {size}x{size} canvas")  # unreachable for <= 4 objects


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    grey = rng.integers(BACKGROUND_RANGE[0], BACKGROUND_RANGE[1] + 1)
    tint = rng.integers(-BACKGROUND_TINT, BACKGROUND_TINT + 1, 3)
    r, g, b = (int(v) for v in np.clip(grey + tint, 0, 255))
    return r, g, b


def _check_size(size: int) -> None:
    if not isinstance(size, int | np.integer) or size < 24:
        raise ValueError(
            f"size must be an integer >= 24 pixels (four objects must fit with clear gaps), got {size!r}"
        )


def scene_for_prompt(prompt: str, seed: int, size: int = 32) -> Scene:
    """A random scene that satisfies ``prompt`` exactly, deterministic under ``(prompt, seed, size)``.

    Single-object prompts get that object alone; counting prompts that many objects of the shape in random
    colours; pair prompts the two objects anywhere; relation prompts the two objects with the relation clearly
    holding (see :data:`RELATION_MIN`). Objects never overlap (a clear gap between boxes) and stay inside the
    canvas.

    Raises:
        ValueError: the prompt is outside the grammar, or ``size < 24``.
    """
    _check_size(size)
    spec = parse_prompt(prompt)
    # the prompt's own hash joins the seed so that one seed gives different layouts for different prompts
    rng = np.random.default_rng([seed, int(stable_unit_hash(spec.to_prompt()) * 2**32), size])
    background = _background(rng)
    items = [(o.shape, o.colour or COLOURS[rng.integers(len(COLOURS))]) for o in spec.objects]
    return Scene(size, background, _place(rng, items, size, spec.relation))


def random_scene(seed: int, size: int = 32, n_objects: int | None = None) -> Scene:
    """A random scene of 1..4 objects (``n_objects`` if given) with random shapes and colours (repeats allowed).

    Raises:
        ValueError: ``n_objects`` outside 1..4, or ``size < 24``.
    """
    _check_size(size)
    rng = np.random.default_rng([seed, 0x0B1E, size])
    if n_objects is None:
        n_objects = int(rng.integers(1, 5))
    if not 1 <= n_objects <= 4:
        raise ValueError(f"n_objects must be in 1..4, got {n_objects}")
    items = [
        (SHAPES[rng.integers(len(SHAPES))], COLOURS[rng.integers(len(COLOURS))]) for _ in range(n_objects)
    ]
    background = _background(rng)
    return Scene(size, background, _place(rng, items, size))


# ------------------------------------------------------------------------------------------------ rendering


def render(
    scene: Scene, antialias: bool = True, palette: dict[str, tuple[int, int, int]] | None = None
) -> Image.Image:
    """Draw a scene as an RGB PIL image of ``scene.size`` x ``scene.size``.

    With ``antialias`` (default) the scene is drawn at :data:`SUPERSAMPLE` times the size and box-filtered
    down, so edges are anti-aliased and sub-pixel positions show; without, PIL draws hard pixel edges.
    ``palette`` overrides the RGB of colour names (default :data:`PALETTE`), e.g. to test the verifier on
    colours that are slightly off.
    """
    palette = palette or PALETTE
    ss = SUPERSAMPLE if antialias else 1
    canvas = Image.new("RGB", (scene.size * ss, scene.size * ss), scene.background)
    draw = ImageDraw.Draw(canvas)
    for o in scene.objects:
        # pixel j covers [j, j+1); PIL boxes are inclusive of their last pixel
        x0, y0, x1, y1 = (v * ss for v in o.box)
        fill = palette[o.colour]
        if o.shape == "circle":
            draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=fill)
        elif o.shape == "square":
            draw.rectangle((round(x0), round(y0), round(x1) - 1, round(y1) - 1), fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1 - 1), (x1 - 1, y1 - 1)], fill=fill)
    if ss > 1:
        canvas = canvas.resize((scene.size, scene.size), Image.Resampling.BOX)
    return canvas


def render_prompt(prompt: str, seed: int, size: int = 32, antialias: bool = True) -> Image.Image:
    """``render(scene_for_prompt(prompt, seed, size))``."""
    return render(scene_for_prompt(prompt, seed, size), antialias=antialias)


#: the perturbations of :func:`perturb`, each a drawing of the scene that the verifier must still accept
PERTURBATIONS: tuple[str, ...] = ("blur", "noise", "jpeg", "rescale", "background", "palette")


def perturb(scene: Scene, kind: str, seed: int) -> Image.Image:
    """Render ``scene`` and degrade the drawing one way, as a weak generator or another renderer might.

    * ``blur``: gaussian blur of radius 0.5..1 px;
    * ``noise``: gaussian pixel noise of sigma 5..10 (of 255);
    * ``jpeg``: JPEG at quality 75 (PIL's default 4:2:0 chroma subsampling);
    * ``rescale``: drawn at the scene size, resized bicubically to 3/4 of it (64 -> 48);
    * ``background``: another background: dark grey (40..110) or a light tinted colour (chroma up to 30);
    * ``palette``: every RGB channel of every colour moved by up to +-25.

    Raises:
        ValueError: an unknown ``kind`` (the message lists :data:`PERTURBATIONS`).
    """
    if kind not in PERTURBATIONS:
        raise ValueError(f"unknown perturbation {kind!r}; available: {list(PERTURBATIONS)}")
    rng = np.random.default_rng([seed, PERTURBATIONS.index(kind)])
    if kind == "background":
        if rng.random() < 0.5:
            grey = int(rng.integers(40, 111))
            background = (grey, grey, grey)
        else:
            r, g, b = (int(v) for v in rng.integers(200, 241) - rng.integers(0, 31, 3))
            background = (r, g, b)
        return render(dataclasses.replace(scene, background=background))
    if kind == "palette":
        off = {}
        for colour, rgb in PALETTE.items():
            r, g, b = (int(v) for v in np.clip(np.add(rgb, rng.integers(-25, 26, 3)), 0, 255))
            off[colour] = (r, g, b)
        return render(scene, palette=off)
    image = render(scene)
    if kind == "blur":
        return image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.5, 1.0))))
    if kind == "noise":
        sigma = rng.uniform(5.0, 10.0)
        noisy = np.asarray(image, dtype=np.float32) + rng.normal(0.0, sigma, (scene.size, scene.size, 3))
        return Image.fromarray(np.clip(noisy.round(), 0, 255).astype(np.uint8))
    if kind == "jpeg":
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=75)
        return Image.open(buffer).convert("RGB")
    side = scene.size * 3 // 4  # "rescale"
    return image.resize((side, side), Image.Resampling.BICUBIC)


def near_miss_prompts(prompt: str) -> list[str]:
    """Prompts one edit away from ``prompt``: another colour or shape for one object, another count, another
    relation. Hard negatives: a scene of :func:`scene_for_prompt` for ``prompt`` satisfies none of them (each
    edit changes the objects asked for, or asks for a relation the scene clearly lacks; rewordings of the same
    scene, ``B right of A`` for ``A left of B``, are not edits).

    Raises:
        ValueError: the prompt is outside the grammar.
    """
    spec = parse_prompt(prompt)
    out: list[PromptSpec] = []
    if spec.kind == "count":
        n, shape = len(spec.objects), spec.objects[0].shape
        out += [PromptSpec("count", (ObjectSpec(shape),) * m) for m in range(1, 5) if m != n]
        out += [PromptSpec("count", (ObjectSpec(s),) * n) for s in SHAPES if s != shape]
    else:
        for i, o in enumerate(spec.objects):
            edits = [ObjectSpec(o.shape, c) for c in COLOURS if c != o.colour]
            edits += [ObjectSpec(s, o.colour) for s in SHAPES if s != o.shape]
            for e in edits:
                objects = list(spec.objects)
                objects[i] = e
                if len(set(objects)) == len(objects):  # two-object prompts need two different objects
                    out.append(PromptSpec(spec.kind, tuple(objects), spec.relation))
        if spec.kind == "relation":
            out += [PromptSpec("relation", spec.objects, r) for r in RELATIONS if r != spec.relation]
    return [o.to_prompt() for o in out]
