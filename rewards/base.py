"""The one reward interface every scorer in ``rewards/`` implements.

A reward scores a batch and returns a float tensor of shape ``[B]``. Rewards that are built from several
criteria (a GenEval-style verifier, a format + answer verifier) also report named components, which the
trainer logs and which the core's decoupled multi-reward advantages (GDPO) can use one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RewardOutput:
    """What a reward returns for a batch of ``B`` samples.

    Attributes:
        scores: ``[B]`` float32 tensor, the reward the policy is trained on.
        components: named ``[B]`` float32 tensors (criteria, sub-scores); may be empty.
        reasons: per-sample text saying why a sample scored what it did (``None`` where there is nothing to
            say); verifiers use it for malformed completions instead of raising.
    """

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    reasons: list[str | None] | None = None

    def __post_init__(self) -> None:
        if self.scores.ndim != 1:
            raise ValueError(f"RewardOutput.scores must be 1-D [B], got shape {tuple(self.scores.shape)}")
        for name, value in self.components.items():
            if value.shape != self.scores.shape:
                raise ValueError(
                    f"component {name!r} has shape {tuple(value.shape)}, expected {tuple(self.scores.shape)}"
                )


class Reward:
    """Base class: subclasses implement :meth:`score`; calling the reward returns only the scores.

    ``score`` takes keyword arguments so that one signature serves every modality:
    image rewards read ``images`` (list of PIL images, or a ``[B, 3, H, W]`` float tensor in [0, 1]) and
    ``prompts``; video rewards read ``videos`` (``[B, T, 3, H, W]`` in [0, 1], or a list of frame lists);
    text verifiers read ``completions`` and ``ground_truths``. ``metadata`` is a per-sample list of dicts.
    """

    #: registry name, set by :func:`rewards.registry.register`
    name: str = ""

    def score(self, **batch: Any) -> RewardOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement score(**batch)")

    def __call__(self, *args: Any, **batch: Any) -> torch.Tensor:
        return self.score(*args, **batch).scores
