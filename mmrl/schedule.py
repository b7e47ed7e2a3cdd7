"""The learning-rate schedule every recipe uses: linear warm-up, then constant or cosine decay.

A function of the step, not of a scheduler object's state, so a resumed run continues it exactly.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["LRSchedule", "learning_rate"]

LRSchedule = Literal["constant", "cosine"]


def learning_rate(
    step: int,
    peak: float,
    total: int,
    warmup_steps: int = 0,
    schedule: LRSchedule = "constant",
    final_fraction: float = 0.0,
) -> float:
    """The learning rate of optimizer step ``step`` (0-based: ``step`` steps are done).

    ``peak * (step + 1) / warmup_steps`` while ``step < warmup_steps``; after it, ``peak`` (constant) or
    ``peak * (f + (1 - f) * 0.5 * (1 + cos(pi * min(step, total) / total)))`` (cosine from ``peak`` down to
    ``f * peak`` at ``step = total``, ``f = final_fraction``).
    """
    if step < warmup_steps:
        return peak * ((step + 1) / warmup_steps)
    if schedule == "constant":
        return peak
    if schedule != "cosine":
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; use 'constant' or 'cosine'")
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    return peak * (final_fraction + (1.0 - final_fraction) * cosine)
