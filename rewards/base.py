"""The one reward interface every scorer in ``rewards/`` implements.

A reward scores a batch and returns a float tensor of shape ``[B]``. Rewards that are built from several
criteria (a GenEval-style verifier, a format + answer verifier) also report named components, which the
trainer logs and which the core's decoupled multi-reward advantages (GDPO) can use one by one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class StepScore:
    """The score of one step a completion states: characters ``start:end`` of the completion text (as the reward
    read it) and the step's reward, for process credit (token advantages per step)."""

    start: int
    end: int
    score: float


@dataclass
class RewardOutput:
    """What a reward returns for a batch of ``B`` samples.

    Attributes:
        scores: ``[B]`` float32 tensor, the reward the policy is trained on.
        components: named ``[B]`` float32 tensors (criteria, sub-scores); may be empty.
        reasons: per-sample text saying why a sample scored what it did (``None`` where there is nothing to
            say); verifiers use it for malformed completions instead of raising.
        steps: per sample, the score of each step its completion states (rewards with ``scores_steps``; an
            empty list for a completion without steps); ``None`` from rewards that score whole samples only.
    """

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)
    reasons: list[str | None] | None = None
    steps: list[list[StepScore]] | None = None

    def __post_init__(self) -> None:
        if self.scores.ndim != 1:
            raise ValueError(f"RewardOutput.scores must be 1-D [B], got shape {tuple(self.scores.shape)}")
        for name, value in self.components.items():
            if value.shape != self.scores.shape:
                raise ValueError(
                    f"component {name!r} has shape {tuple(value.shape)}, expected {tuple(self.scores.shape)}"
                )
        if self.steps is not None and len(self.steps) != self.scores.shape[0]:
            raise ValueError(
                f"RewardOutput.steps has {len(self.steps)} entries for {self.scores.shape[0]} scores"
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
    #: the reward also scores each step of a completion (``RewardOutput.steps``), for process credit
    scores_steps: bool = False
    #: a sample's score depends on the other samples of the batch (win rates within a group): the reward
    #: server then scores each request alone instead of merging concurrent requests into one batch
    batch_dependent: bool = False

    def score(self, **batch: Any) -> RewardOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement score(**batch)")

    def check_prompt(self, prompt: str) -> None:
        """Refuse a prompt this reward cannot score, before anything is generated for it (a verifier with a
        grammar parses it here). The default accepts every prompt.

        Raises:
            ValueError: the prompt is refused (the message says why).
        """

    def __call__(self, **batch: Any) -> torch.Tensor:
        return self.score(**batch).scores


class RewardCheckError(ValueError):
    """A reward raised, or returned scores a trainer cannot use; the message names the reward and the sample.
    (Not :class:`pipelines.pool.protocol.RewardError`, which is a pool's reward worker failing after every retry.)"""


def checked_score(reward: Reward, label: str, size: int, **batch: Any) -> RewardOutput:
    """``reward.score(**batch)``, refused unless it returns ``size`` finite scores.

    Trainers call this before anything of the step is written, so a broken reward stops the run with one
    message instead of NaN advantages (``(r - mean) / std`` turns one NaN into a whole group of them).

    Args:
        reward: the reward to call.
        label: the name to report (the reward's config key).
        size: the number of samples in ``batch``.
        **batch: the reward's keyword inputs (``prompts`` is quoted in the message when present).

    Raises:
        RewardCheckError: the reward raised (its error chained), returned a shape other than ``[size]``, or a NaN or
            infinite score (the first one named with its sample index and prompt).
    """
    try:
        out = reward.score(**batch)
    except Exception as err:
        raise RewardCheckError(
            f"reward {label!r} failed on a batch of {size} samples: {type(err).__name__}: {err}"
        ) from err
    scores = out.scores.detach().float().cpu()
    if scores.shape != (size,):
        raise RewardCheckError(
            f"reward {label!r} returned scores of shape {tuple(scores.shape)} for {size} samples"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        prompts = batch.get("prompts")
        where = f" (prompt {str(prompts[i])[:200]!r})" if prompts is not None else ""
        raise RewardCheckError(
            f"reward {label!r} returned {len(bad)} non-finite score(s) of {size}; the first is "
            f"{scores[i].item()} at sample {i}{where}"
        )
    for i, steps in enumerate(out.steps or []):
        for step in steps:
            if not (math.isfinite(step.score) and 0 <= step.start <= step.end):
                raise RewardCheckError(
                    f"reward {label!r} returned a step score {step} at sample {i}: scores must be finite and "
                    "spans 0 <= start <= end"
                )
    return out
