"""The shapes-world verifier: parse an image into coloured shapes and score it against a GenEval-style prompt.

The shapes world (``mmrl.data.shapes``) draws circles, squares and triangles in six colours on a light neutral
background. This module holds its vocabulary and prompt grammar (so that it depends on nothing in ``mmrl``) and
the verifier :class:`ShapesReward`, registered as ``"shapes"``.

Method (vectorised over the batch with numpy / scipy.ndimage; no learned parts):

1. chroma ``C = max(R,G,B) - min(R,G,B)`` per pixel. The background is neutral (low chroma), so a pixel is
   foreground when ``C > max(min_chroma, median border chroma + bg_margin)``. Each foreground pixel takes the
   palette colour of nearest hue: unlike RGB distance, hue does not change when a colour is blended with a
   grey background (anti-aliased edges, blur), and it tolerates colours a little off the palette.
2. 8-connected components of the foreground; parts smaller than ``min_area_frac * H * W`` are speckles and
   dropped. A component takes its majority colour (absorbing edge pixels whose hue drifted); one holding two
   colours in substantial amounts is two touching objects and is split by colour.
3. Shape from the moments of the soft coverage ``a`` in [0, 1] of each object (pixel colour projected on the
   segment background -> object colour, exact for a blend; summed over the component and a 1-px skirt):
   ``t``, the third-order cumulants (zero for a centrally symmetric shape; a triangle's are large) and ``q``,
   the 4-fold part of the fourth-order cumulants (zero for a disc; a square's are large), both divided by the
   matching power of the area. Cumulants of a convolution add, and a Gaussian has none above order 2, so both
   features are unchanged by a Gaussian blur (and nearly so by the small box filters of pixels and
   resampling); both are also invariant to rotation and scale. Blur, resampling and other renderers' drawings
   (turned squares, equilateral triangles) therefore give the same features, where thresholded features
   (fill ratio, corner count) drift by a pixel, which is 10% of a 32x32 object. Elongated (two merged
   objects) or ragged blobs are ``"unknown"``.
4. Scoring against the parsed prompt (:func:`score_objects`), GenEval (arXiv 2310.11513) criteria with the
   prompt read as a description of the *whole* scene:

   * ``object``: every shape the prompt names is present;
   * ``count``: each named shape occurs exactly as often as the prompt says, and nothing else is there;
   * ``colour``: each (colour, shape) the prompt names occurs as often as it says (1 for counting prompts,
     which name no colour);
   * ``position``: for relation prompts exactly one object matches each side and GenEval's relation rule
     (:func:`relation_offset`) holds between their boxes (1 for prompts without a relation).

   The score is their product, so it is strictly 0 or 1.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from scipy import ndimage

from rewards.base import Reward, RewardOutput
from rewards.images import ImageBatch, images_to_uint8
from rewards.registry import register

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS: tuple[str, ...] = ("one", "two", "three", "four")

#: The renderer's RGB colours: saturated, and at least 23 degrees of hue apart, so that a slightly
#: different drawing of "orange" (CSS orange is hue 39) is still nearer orange than yellow.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 215, 20),
    "purple": (150, 50, 190),
    "orange": (250, 140, 20),
}

#: GenEval's position threshold: box offsets are reduced by this fraction of the two boxes' dimensions.
POSITION_THRESHOLD = 0.1

PromptKind = Literal["single", "count", "pair", "relation"]


@dataclass(frozen=True)
class ObjectSpec:
    """One object a prompt asks for; ``colour`` is ``None`` in counting prompts."""

    shape: str
    colour: str | None = None


@dataclass(frozen=True)
class PromptSpec:
    """A parsed shapes prompt.

    Attributes:
        kind: which template the prompt follows.
        objects: the objects the scene must hold, one entry per object (a counting prompt for three circles
            has three equal entries).
        relation: for ``kind == "relation"``, the relation of ``objects[0]`` to ``objects[1]``.
    """

    kind: PromptKind
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    def to_prompt(self) -> str:
        """The prompt text this spec was parsed from (the grammar is unambiguous, so this is exact)."""
        a = self.objects[0]
        if self.kind == "single":
            return f"a photo of a {a.colour} {a.shape}"
        if self.kind == "count":
            n = len(self.objects)
            return f"a photo of one {a.shape}" if n == 1 else f"a photo of {COUNT_WORDS[n - 1]} {a.shape}s"
        b = self.objects[1]
        link = "and" if self.kind == "pair" else self.relation
        return f"a photo of a {a.colour} {a.shape} {link} a {b.colour} {b.shape}"


_COLOUR_RE = "|".join(COLOURS)
_SHAPE_RE = "|".join(SHAPES)
_OBJ = rf"a (?P<c{{i}}>{_COLOUR_RE}) (?P<s{{i}}>{_SHAPE_RE})"
_TEMPLATES: tuple[tuple[PromptKind, re.Pattern[str]], ...] = (
    ("single", re.compile(rf"a photo of {_OBJ.format(i=1)}")),
    ("count", re.compile(rf"a photo of one (?P<s1>{_SHAPE_RE})")),
    ("count", re.compile(rf"a photo of (?P<n>two|three|four) (?P<s1>{_SHAPE_RE})s")),
    ("pair", re.compile(rf"a photo of {_OBJ.format(i=1)} and {_OBJ.format(i=2)}")),
    (
        "relation",
        re.compile(rf"a photo of {_OBJ.format(i=1)} (?P<rel>{'|'.join(RELATIONS)}) {_OBJ.format(i=2)}"),
    ),
)
_GRAMMAR_HELP = (
    "expected one of: 'a photo of a {colour} {shape}', 'a photo of one {shape}', "
    "'a photo of {two|three|four} {shape}s', 'a photo of a {colour} {shape} and a {colour} {shape}', "
    "'a photo of a {colour} {shape} {left of|right of|above|below} a {colour} {shape}' "
    f"with colour in {list(COLOURS)} and shape in {list(SHAPES)}"
)


#: longest prompt :func:`parse_prompt` reads (the grammar's longest has 55; room for runs of spaces)
MAX_PROMPT_CHARS = 200


def parse_prompt(prompt: str) -> PromptSpec:
    """Parse a shapes-world prompt into the objects (and relation) it asks for.

    Case and runs of whitespace are normalised; anything else outside the grammar is rejected.

    Raises:
        ValueError: the prompt follows none of the templates, or names the same coloured shape twice in a
            two-object prompt (which would be a counting prompt in disguise).
    """
    if len(prompt) > MAX_PROMPT_CHARS:  # refused before any text work: a prompt file may hold a megabyte line
        raise ValueError(
            f"cannot parse shapes prompt {_quote(prompt)}: longer than any prompt of the grammar (at most "
            f"{MAX_PROMPT_CHARS} characters read)"
        )
    text = " ".join(str(prompt).lower().split())
    for kind, pattern in _TEMPLATES:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        if kind == "count":
            n = COUNT_WORDS.index(m.groupdict().get("n") or "one") + 1
            return PromptSpec("count", (ObjectSpec(m["s1"]),) * n)
        first = ObjectSpec(m["s1"], m["c1"])
        if kind == "single":
            return PromptSpec("single", (first,))
        second = ObjectSpec(m["s2"], m["c2"])
        if first == second:
            raise ValueError(
                f"cannot parse shapes prompt {_quote(prompt)}: it names the {first.colour} {first.shape} twice; "
                "two-object prompts need two different objects"
            )
        return PromptSpec(kind, (first, second), m.groupdict().get("rel"))
    raise ValueError(f"cannot parse shapes prompt {_quote(prompt)}: {_GRAMMAR_HELP}")


def _quote(prompt: str, limit: int = 80) -> str:
    """``repr`` of a prompt, cut to ``limit`` characters (error messages quote user input)."""
    text = str(prompt)
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class DetectedObject:
    """An object found in an image (or placed in a scene): shape, colour, box ``(x0, y0, x1, y1)`` in pixel
    units (``x`` to the right, ``y`` down, pixel ``(i, j)`` covering ``[j, j+1) x [i, i+1)``) and soft area in
    pixels (0 for a placed object)."""

    shape: str
    colour: str
    box: tuple[float, float, float, float]
    area: float = 0.0


def relation_offset(box_a: Sequence[float], box_b: Sequence[float]) -> tuple[float, float]:
    """GenEval's normalised offset of box A from box B.

    ``o = centre_a - centre_b``; ``o' = max(|o| - t (dim_a + dim_b), 0) * sign(o)`` with ``t = 0.1``
    (per axis); returns ``o' / ||o||`` (``(0, 0)`` when the centres coincide). GenEval (arXiv 2310.11513,
    ``evaluate_images.py``) says A is left of B when ``dx < -0.5``, right of when ``dx > 0.5``, above when
    ``dy < -0.5`` and below when ``dy > 0.5``.
    """
    a = np.asarray(box_a, dtype=np.float64)
    b = np.asarray(box_b, dtype=np.float64)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2
    dims = (a[2:] - a[:2]) + (b[2:] - b[:2])
    norm = float(np.hypot(*offset))
    if norm == 0.0:
        return 0.0, 0.0
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * dims, 0.0) * np.sign(offset)
    return float(revised[0] / norm), float(revised[1] / norm)


def relation_holds(
    relation: str, box_a: Sequence[float], box_b: Sequence[float], threshold: float = 0.5
) -> bool:
    """Whether ``A {relation} B`` by GenEval's rule (see :func:`relation_offset`)."""
    dx, dy = relation_offset(box_a, box_b)
    value = {"left of": -dx, "right of": dx, "above": -dy, "below": dy}[relation]
    return value > threshold


def score_objects(spec: PromptSpec, objects: Sequence[DetectedObject]) -> dict[str, float]:
    """Score a set of objects against a parsed prompt: the four criteria, each 0.0 or 1.0.

    The prompt describes the whole scene (an object it does not name fails ``count``). See the module
    docstring for the criteria; criteria a prompt does not constrain score 1.0.
    """
    want_shapes = Counter(o.shape for o in spec.objects)
    have_shapes = Counter(o.shape for o in objects)
    ok_object = all(have_shapes[s] > 0 for s in want_shapes)
    ok_count = len(objects) == len(spec.objects) and all(have_shapes[s] == n for s, n in want_shapes.items())
    ok_colour = True
    ok_position = True
    if spec.kind != "count":
        have_pairs = Counter((o.shape, o.colour) for o in objects)
        want_pairs = Counter((o.shape, o.colour) for o in spec.objects)
        ok_colour = all(have_pairs[k] == n for k, n in want_pairs.items())
    if spec.kind == "relation":
        a_spec, b_spec = spec.objects
        found_a = [o for o in objects if (o.shape, o.colour) == (a_spec.shape, a_spec.colour)]
        found_b = [o for o in objects if (o.shape, o.colour) == (b_spec.shape, b_spec.colour)]
        # the relation is only defined between exactly one A and one B
        ok_position = (
            len(found_a) == 1
            and len(found_b) == 1
            and relation_holds(spec.relation or "", found_a[0].box, found_b[0].box)
        )
    return {
        "object": float(ok_object),
        "count": float(ok_count),
        "colour": float(ok_colour),
        "position": float(ok_position),
    }


# ------------------------------------------------------------------------------------------------ image parsing

# 8-connectivity in (H, W), none along the batch axis: one ndimage.label call labels the whole batch
_STRUCTURE = np.zeros((3, 3, 3), dtype=bool)
_STRUCTURE[1] = True


def _chroma(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., 3]`` float RGB -> (max of the channels, chroma = max - min)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    # elementwise on channel views: much faster than reducing over a last axis of length 3
    mx = np.maximum(np.maximum(r, g), b)
    return mx, mx - np.minimum(np.minimum(r, g), b)


def _hue(rgb: np.ndarray) -> np.ndarray:
    """``[..., 3]`` float RGB -> hue in degrees [0, 360) (0 for greys)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    mx, chroma = _chroma(rgb)
    c = np.where(chroma > 0, chroma, 1.0)
    hue = np.where(mx == r, ((g - b) / c) % 6.0, np.where(mx == g, (b - r) / c + 2.0, (r - g) / c + 4.0))
    return hue * 60.0


_PALETTE_HUES = _hue(np.array([PALETTE[c] for c in COLOURS], dtype=np.float32))


@dataclass(frozen=True)
class ParseConfig:
    """Thresholds of the image parser (measured; see docs/shapes.md).

    Attributes:
        min_chroma: smallest chroma (``max - min`` of RGB, 0..255) of a foreground pixel. Neutral backgrounds
            with noise of sigma 10 stay below ~45; the palette colours are 130..230.
        bg_margin: a pixel must also exceed the median chroma of the image border by this much, so a lightly
            tinted background is not foreground.
        min_area_frac: components smaller than this fraction of the image are speckles (8.2 px at 32x32).
        split_frac: a component whose second colour covers this fraction of it (and at least the speckle area)
            is two touching objects and is split by colour.
        skirt: pixels around a component (blurred edges) that count towards its moments.
        triangle_skew: third-order moment magnitude ``t`` above which an object is a triangle (ideal triangles
            ~0.065, centrally symmetric shapes 0).
        square_kurt: fourth-order 4-fold moment ``q`` above which an object is a square (ideal square 1/60,
            disc 0).
        max_ecc: second-moment eccentricity above which a blob is elongated, ``"unknown"`` (two merged discs
            ~0.67; the shapes drawn here <= 0.35).
        min_compact: ``A / (2 pi (mu20 + mu02))`` below which a blob is ragged or hollow, ``"unknown"`` (disc 1,
            square 0.95, triangle ~0.8).
    """

    min_chroma: float = 55.0
    bg_margin: float = 35.0
    min_area_frac: float = 0.008
    split_frac: float = 0.25
    skirt: int = 1
    triangle_skew: float = 0.025
    square_kurt: float = 0.0085
    max_ecc: float = 0.5
    min_compact: float = 0.55


@dataclass(frozen=True)
class ShapeFeatures:
    """Moment features of the parts of a batch, each ``[P]``. Mass ``A`` is the soft area (sum of coverage).

    ``t = sqrt(|E z^3|^2 + |E z^2 conj(z)|^2) / A^1.5`` (z = x + iy about the centroid): the third cumulants,
    zero for a centrally symmetric shape. ``q = |k40 - 6 k22 + k04 + 4i (k31 - k13)| / A^2``: the part of the
    fourth cumulants that turns with 4 theta, zero for a disc. Both are unchanged by a Gaussian blur (its
    cumulants above order 2 are zero) and by rotation and scale. ``ecc`` and ``compact`` come from the second
    moments.
    """

    area: np.ndarray
    t: np.ndarray
    q: np.ndarray
    ecc: np.ndarray
    compact: np.ndarray


def classify_shapes(f: ShapeFeatures, cfg: ParseConfig) -> np.ndarray:
    """Shape names ``[P]`` from moment features: triangle by skew, then square by 4-fold kurtosis, else circle;
    elongated or ragged blobs are ``"unknown"``."""
    shape = np.where(f.t > cfg.triangle_skew, "triangle", np.where(f.q > cfg.square_kurt, "square", "circle"))
    return np.where((f.ecc > cfg.max_ecc) | (f.compact < cfg.min_compact), "unknown", shape)


def _moments(
    rgb: np.ndarray, bg: np.ndarray, parts: np.ndarray, n_parts: int, cfg: ParseConfig
) -> ShapeFeatures:
    """Soft-coverage moment features of every labelled part.

    Args:
        rgb: ``[B, H, W, 3]`` float image.
        bg: ``[B, 3]`` background colour per image.
        parts: ``[B, H, W]`` int labels, 0 background, ``1..n_parts`` the (thresholded) parts.
    """
    # 1. each part's colour: the mean of its interior pixels (edges are blended with the background)
    interior = (ndimage.grey_erosion(parts, footprint=_STRUCTURE) == parts) & (
        ndimage.grey_dilation(parts, footprint=_STRUCTURE) == parts
    )
    sums = np.zeros((2, n_parts + 1, 3))
    counts = np.zeros((2, n_parts + 1))
    for j, mask in enumerate((interior & (parts > 0), parts > 0)):
        lab = parts[mask]
        counts[j] = np.bincount(lab, minlength=n_parts + 1)
        for ch in range(3):
            sums[j, :, ch] = np.bincount(lab, weights=rgb[..., ch][mask], minlength=n_parts + 1)
    use_all = counts[0] == 0  # tiny parts have no interior
    colour = (
        np.where(use_all[:, None], sums[1], sums[0])
        / np.maximum(np.where(use_all, counts[1], counts[0]), 1)[:, None]
    )

    # 2. grow each part into the background by `skirt` px, so blurred edges keep their mass
    region = parts
    for _ in range(cfg.skirt):
        region = np.where(region > 0, region, ndimage.grey_dilation(region, footprint=_STRUCTURE))
    idx = np.flatnonzero(region)
    k = region.ravel()[idx]  # [N] 1-based part of each pixel
    b, y, x = np.unravel_index(idx, parts.shape)
    b_part = np.zeros(n_parts + 1, dtype=np.int64)
    b_part[k] = b
    # 3. coverage of a pixel = where it lies between background and object colour (exact for a blend)
    d = colour - bg[b_part]  # [P+1, 3]
    pix = rgb[b, y, x] - bg[b]  # [N, 3]
    w = np.clip((pix * d[k]).sum(1) / np.maximum((d[k] ** 2).sum(1), 1e-6), 0.0, 1.0)

    # 4. moments about the weighted centroid (pixel centres at +0.5)
    def total(v: np.ndarray) -> np.ndarray:
        return np.bincount(k, weights=v, minlength=n_parts + 1)[1:]

    area = np.maximum(total(w), 1e-6)
    xc = x + 0.5 - (total(w * (x + 0.5)) / area)[k - 1]
    yc = y + 0.5 - (total(w * (y + 0.5)) / area)[k - 1]

    # powers by repeated products (faster than float `**`); wx[p] = w * xc^p
    wx = [w]
    for _ in range(4):
        wx.append(wx[-1] * xc)
    ys = [np.ones_like(yc), yc, yc * yc, yc * yc * yc, (yc * yc) ** 2]

    def mu(p: int, q: int) -> np.ndarray:
        return total(wx[p] * ys[q]) / area

    m20, m02, m11 = mu(2, 0), mu(0, 2), mu(1, 1)
    m30, m21, m12, m03 = mu(3, 0), mu(2, 1), mu(1, 2), mu(0, 3)
    c30 = np.hypot(m30 - 3 * m12, 3 * m21 - m03)  # |E z^3|
    c21 = np.hypot(m30 + m12, m21 + m03)  # |E z^2 conj(z)|
    t = np.hypot(c30, c21) / area**1.5
    k40 = mu(4, 0) - 3 * m20**2
    k04 = mu(0, 4) - 3 * m02**2
    k22 = mu(2, 2) - m20 * m02 - 2 * m11**2
    k31 = mu(3, 1) - 3 * m20 * m11
    k13 = mu(1, 3) - 3 * m02 * m11
    q = np.hypot(k40 - 6 * k22 + k04, 4 * (k31 - k13)) / area**2
    spread = np.maximum(m20 + m02, 1e-6)
    ecc = np.hypot(m20 - m02, 2 * m11) / spread
    compact = area / (2 * np.pi * spread)
    return ShapeFeatures(area, t, q, ecc, compact)


def parse_images(arrays: np.ndarray, cfg: ParseConfig | None = None) -> list[list[DetectedObject]]:
    """Find the objects in a batch of same-sized images.

    Args:
        arrays: ``[B, H, W, 3]`` RGB, uint8 or float in 0..255.
        cfg: parser thresholds; defaults to :class:`ParseConfig`.

    Returns:
        per image, the detected objects sorted top to bottom then left to right; ``box`` is the box of the
        object's foreground pixels, ``area`` its soft area in pixels. Unrecognised blobs have shape
        ``"unknown"``.
    """
    cfg = cfg or ParseConfig()
    B, H, W, _ = arrays.shape
    rgb = arrays.astype(np.float32)
    _, chroma = _chroma(rgb)  # [B, H, W]

    # 1. foreground: clearly more colourful than the (neutral) background seen on the border
    border = np.concatenate([rgb[:, 0], rgb[:, -1], rgb[:, :, 0], rgb[:, :, -1]], axis=1)  # [B, 2H+2W, 3]
    bg = np.median(border, axis=1)  # [B, 3]
    threshold = np.maximum(cfg.min_chroma, np.median(_chroma(border)[1], axis=1) + cfg.bg_margin)  # [B]
    fg = chroma > threshold[:, None, None]

    # 2. connected components over the whole batch at once, then colour per component
    labels, n = ndimage.label(fg, structure=_STRUCTURE)
    out: list[list[DetectedObject]] = [[] for _ in range(B)]
    if n == 0:
        return out
    flat = labels.ravel()
    pix = np.flatnonzero(flat)
    comp = flat[pix] - 1  # [N] component of each foreground pixel
    hue = _hue(rgb.reshape(-1, 3)[pix])  # [N] only foreground pixels need a colour
    col = np.abs((hue[:, None] - _PALETTE_HUES + 180.0) % 360.0 - 180.0).argmin(1)  # [N] nearest palette hue
    K = len(COLOURS)
    votes = np.bincount(comp * K + col, minlength=n * K).reshape(n, K)  # [n, K] pixels per colour
    min_area = max(3.0, cfg.min_area_frac * H * W)
    second = np.sort(votes, axis=1)[:, -2]
    mixed = second >= np.maximum(min_area, cfg.split_frac * votes.sum(1))  # [n] two touching objects
    # mixed components are split by colour; the others take their majority colour, absorbing edge pixels
    # whose hue drifted (blur, JPEG chroma subsampling)
    key = comp * K + np.where(mixed[comp], col, votes.argmax(1)[comp])
    ids, part = np.unique(key, return_inverse=True)
    keep = np.bincount(part) >= min_area  # speckles are dropped
    new_id = np.cumsum(keep) * keep  # 1..P for kept parts, 0 for speckles
    n_parts = int(keep.sum())
    if n_parts == 0:
        return out
    parts = np.zeros(B * H * W, dtype=np.int64)
    parts[pix] = new_id[part]
    parts = parts.reshape(B, H, W)
    part_colour = ids[keep] % K

    # 3. shape from blur-invariant moments of the soft coverage
    features = _moments(rgb, bg, parts, n_parts, cfg)
    shapes = classify_shapes(features, cfg)
    for p, sl in enumerate(ndimage.find_objects(parts)):
        if sl is None:
            continue
        out[sl[0].start].append(
            DetectedObject(
                str(shapes[p]),
                COLOURS[part_colour[p]],
                (float(sl[2].start), float(sl[1].start), float(sl[2].stop), float(sl[1].stop)),
                float(features.area[p]),
            )
        )
    for objs in out:
        objs.sort(key=lambda o: (o.box[1], o.box[0]))
    return out


def detect_objects(images: ImageBatch, cfg: ParseConfig | None = None) -> list[list[DetectedObject]]:
    """:func:`parse_images` for any image batch the rewards accept (PIL images of any sizes, or tensors)."""
    arrays = images_to_uint8(images)
    out: list[list[DetectedObject]] = [[] for _ in arrays]
    # images of one size are parsed as one batch
    by_size: dict[tuple[int, ...], list[int]] = {}
    for i, a in enumerate(arrays):
        by_size.setdefault(a.shape, []).append(i)
    for idx in by_size.values():
        for i, objs in zip(idx, parse_images(np.stack([arrays[i] for i in idx]), cfg), strict=True):
            out[i] = objs
    return out


def describe(objects: Sequence[DetectedObject]) -> str:
    """Short text of the detected objects, e.g. ``"red circle, blue square"`` (``"nothing"`` if empty)."""
    return ", ".join(f"{o.colour} {o.shape}" for o in objects) or "nothing"


@register("shapes")
class ShapesReward(Reward):
    """Strict GenEval-style verifier of the shapes world: 1 when the image shows exactly the prompt's scene.

    ``reward(images=images, prompts=prompts)`` returns the ``[B]`` float tensor of scores in {0, 1};
    ``reward.score(images=..., prompts=...)`` also returns the components ``object``, ``count``, ``colour``,
    ``position`` (each in {0, 1}; 1 where a prompt does not constrain the criterion) and, for failed samples, a
    reason listing what was found.

    Args:
        config: parser thresholds (:class:`ParseConfig`); the defaults are the measured ones in docs/shapes.md.
        partial: score the share of the constrained criteria that hold instead of the strict product (for
            training; the components and reasons are the same in both modes).
        criterion_weights: with ``partial``, weights of the criteria in that share (unnamed ones weigh 1):
            ``score = sum_k w_k c_k m_k / sum_k w_k m_k`` over the criteria ``k`` the prompt constrains
            (``m_k = 1``). Weighting a hard criterion up (``{"count": 3}``) makes it carry more of a group's
            reward spread.

    Raises:
        ValueError: ``criterion_weights`` names an unknown criterion, has a weight <= 0, or is given without
            ``partial``.
    """

    CRITERIA = ("object", "count", "colour", "position")

    def __init__(
        self,
        config: ParseConfig | None = None,
        partial: bool = False,
        criterion_weights: dict[str, float] | None = None,
    ) -> None:
        self.config = config or ParseConfig()
        self.partial = partial
        weights = dict(criterion_weights or {})
        unknown = sorted(set(weights) - set(self.CRITERIA))
        if unknown:
            raise ValueError(f"criterion_weights: unknown criteria {unknown}; known: {list(self.CRITERIA)}")
        bad = {k: w for k, w in weights.items() if not w > 0}
        if bad:
            raise ValueError(f"criterion_weights must be > 0, got {bad}")
        if weights and not partial:
            raise ValueError("criterion_weights weigh the partial credit: set partial=True")
        self.criterion_weights = np.array([weights.get(k, 1.0) for k in self.CRITERIA], dtype=np.float32)

    def check_prompt(self, prompt: str) -> None:
        """Parse ``prompt``: the verifier scores only prompts of the shapes grammar (:func:`parse_prompt`)."""
        parse_prompt(prompt)

    def score(  # type: ignore[override]
        self, *, images: ImageBatch, prompts: Sequence[str], **_: Any
    ) -> RewardOutput:
        """Score a batch.

        Args:
            images: ``B`` PIL images (any sizes) or a ``[B, 3, H, W]`` float tensor in [0, 1].
            prompts: ``B`` shapes-world prompts.

        Raises:
            ValueError: a length mismatch, or a prompt outside the grammar (named).
        """
        if isinstance(prompts, str):
            raise ValueError("prompts must be a list of strings, got one string")
        if len(images) != len(prompts):
            raise ValueError(f"got {len(images)} images but {len(prompts)} prompts")
        specs = [parse_prompt(p) for p in prompts]  # validate prompts before any image work
        detected = detect_objects(images, self.config)
        names = self.CRITERIA
        table = np.zeros((len(specs), len(names)), dtype=np.float32)
        constrained = np.ones_like(table)
        reasons: list[str | None] = []
        for i, (spec, objs) in enumerate(zip(specs, detected, strict=True)):
            crit = score_objects(spec, objs)
            table[i] = [crit[k] for k in names]
            constrained[i] = [1.0, 1.0, float(spec.kind != "count"), float(spec.kind == "relation")]
            failed = [k for k in names if crit[k] == 0.0]
            reasons.append(f"failed {', '.join(failed)}; found {describe(objs)}" if failed else None)
        components = {k: torch.from_numpy(table[:, j].copy()) for j, k in enumerate(names)}
        strict = table.prod(1)
        if self.partial:
            weighted = constrained * self.criterion_weights  # [B, 4]
            scores = torch.from_numpy((table * weighted).sum(1) / weighted.sum(1))
            components["strict"] = torch.from_numpy(strict)
        else:
            scores = torch.from_numpy(strict)
        return RewardOutput(scores=scores, components=components, reasons=reasons)
