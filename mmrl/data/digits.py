"""The digits world: signs showing a two-digit number, their prompts, and a renderer.

The embedded text-rendering task (Flow-GRPO's OCR task in miniature): the shapes text-to-image model learns to
draw ``'a sign with the number "47"'`` as dark digits on a light 32x32 sign, and the ``ocr`` reward (PP-OCR)
reads them back. The quoted span of the prompt is the text the reward looks for (``rewards.ocr.quoted_text``).

Grammar: ``a sign with the number "{nn}"`` for the 100 numbers ``00`` .. ``99``.

Split by number: ``nn`` is held out when ``int(sha256(nn)[:16], 16) / 2**64 < fraction`` (20 numbers at the
default 0.2), so a held-out number was never rendered in pretraining or RL; its digits were, in other numbers.

Renders vary the background grey, the ink, the font size and the position (each from the render's seed) and
stay legible: PP-OCR reads every clean render exactly (``tests/test_digits.py``).
"""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.data.shapes import stable_unit_hash

__all__ = [
    "NUMBERS",
    "all_prompts",
    "heldout_prompts",
    "is_heldout",
    "number_of",
    "prompt_for",
    "render",
    "render_prompt",
    "sample_prompts",
    "train_prompts",
]

Split = Literal["train", "heldout", "all"]

#: default held-out fraction of the numbers
HELDOUT_FRACTION = 0.2
#: every number of the world, as the two characters the sign shows
NUMBERS: tuple[str, ...] = tuple(f"{n:02d}" for n in range(100))
#: font size range in pixels at a 32 px canvas (scaled with the canvas): digits 2/3 of the sign high
FONT_RANGE = (20, 24)
#: background grey level range (a light sign) and ink grey level range (dark digits)
BACKGROUND_RANGE = (190, 245)
INK_RANGE = (0, 50)
#: largest shift of the text centre from the canvas centre, as a fraction of the canvas side
JITTER = 0.06

_PROMPT = re.compile(r'a sign with the number "(\d\d)"')


def prompt_for(number: str) -> str:
    """``'a sign with the number "47"'`` for ``"47"``.

    Raises:
        ValueError: ``number`` is not one of :data:`NUMBERS`.
    """
    if number not in NUMBERS:
        raise ValueError(f"the digits world has the numbers 00..99 as two characters, got {number!r}")
    return f'a sign with the number "{number}"'


def number_of(prompt: str) -> str:
    """The number a prompt asks for (``'a sign with the number "47"'`` -> ``"47"``).

    Raises:
        ValueError: the prompt is outside the grammar.
    """
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"{prompt!r} is not a digits prompt ('a sign with the number \"NN\"', NN in 00..99)")
    return match.group(1)


def is_heldout(number: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether ``number`` (e.g. ``"47"``) belongs to the held-out split: its stable hash is below ``fraction``.

    Raises:
        ValueError: ``fraction`` outside [0, 1], or an unknown number.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    if number not in NUMBERS:
        raise ValueError(f"unknown number {number!r}: the digits world has 00..99")
    return stable_unit_hash(number) < fraction


def _split_prompts(split: Split, fraction: float) -> list[str]:
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    numbers = [n for n in NUMBERS if split == "all" or is_heldout(n, fraction) == (split == "heldout")]
    return [prompt_for(n) for n in numbers]


def all_prompts() -> list[str]:
    """The 100 prompts, numbers in increasing order."""
    return _split_prompts("all", HELDOUT_FRACTION)


def train_prompts(fraction: float = HELDOUT_FRACTION) -> list[str]:
    """The prompts of the training numbers, in increasing order."""
    return _split_prompts("train", fraction)


def heldout_prompts(fraction: float = HELDOUT_FRACTION) -> list[str]:
    """The prompts of the held-out numbers, in increasing order; disjoint from :func:`train_prompts`."""
    return _split_prompts("heldout", fraction)


def sample_prompts(
    n: int, seed: int, split: Split = "train", fraction: float = HELDOUT_FRACTION
) -> list[str]:
    """``n`` prompts of a split, deterministic under ``seed``: the split shuffled, reshuffled each time it runs
    out (so ``n`` larger than the split repeats every prompt as evenly as possible).

    Raises:
        ValueError: ``n < 0`` or an unknown split.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    prompts = _split_prompts(split, fraction)
    rng = np.random.default_rng([seed, 0xD161])
    out: list[str] = []
    while len(out) < n:
        out += [prompts[i] for i in rng.permutation(len(prompts))]
    return out[:n]


def render(number: str, seed: int, size: int = 32) -> Image.Image:
    """A ``size`` x ``size`` RGB sign showing ``number``: dark digits (grey level in :data:`INK_RANGE`, a small
    tint per channel) in Pillow's bundled font (size in :data:`FONT_RANGE`, scaled by ``size / 32``), centred up
    to :data:`JITTER` of the side, on a light grey background (:data:`BACKGROUND_RANGE`).

    Raises:
        ValueError: an unknown number.
    """
    if number not in NUMBERS:
        raise ValueError(f"unknown number {number!r}: the digits world has 00..99")
    rng = np.random.default_rng([seed, 0xD161])
    background = int(rng.integers(*BACKGROUND_RANGE, endpoint=True))
    ink_level = int(rng.integers(*INK_RANGE, endpoint=True))
    ink = tuple(int(np.clip(ink_level + rng.integers(-8, 9), 0, 255)) for _ in range(3))
    font_px = round(int(rng.integers(*FONT_RANGE, endpoint=True)) * size / 32)
    dx, dy = (rng.uniform(-JITTER, JITTER, size=2) * size).tolist()
    image = Image.new("RGB", (size, size), (background,) * 3)
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_px)
    left, top, right, bottom = draw.textbbox((0, 0), number, font=font)
    x = (size - (right - left)) / 2 - left + dx
    y = (size - (bottom - top)) / 2 - top + dy
    draw.text((x, y), number, fill=ink, font=font)
    return image


def render_prompt(prompt: str, seed: int, size: int = 32) -> Image.Image:
    """``render(number_of(prompt), seed, size)``."""
    return render(number_of(prompt), seed, size)
