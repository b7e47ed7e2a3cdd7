"""What a flow rollout source hands to the trainer (:class:`FlowSamples`) and what one rollout step hands to the
update (:class:`StepBatch`), whatever produced it (in the loop, a tree, the explorer, a rollout pool)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelines.flow.adapters import Conditioning
from pipelines.flow.branch import TreeRollout
from pipelines.flow.explore import ExploreResult
from pipelines.flow.rollout import Rollout, SamplingConfig, TransitionBatch

__all__ = ["FlowSamples", "StepBatch", "prompt_ids"]


def prompt_ids(prompts: list[str]) -> torch.Tensor:
    """``[B]`` group id of each sample: the index of its prompt's first occurrence."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(p, len(ids)) for p in prompts])


@dataclass
class StepBatch:
    """What one rollout step hands to the update, whatever the rollout mode.

    Attributes:
        transitions: the SDE transitions to train on (after timestep subsampling / pruning).
        adv: ``[N]`` advantage of each transition (its sample's, or its tree node's).
        images, prompts: the final samples and their prompts.
        final_latents: ``[B, ...]`` clean latents (the regression objectives, nft, awm and rwr, train on these).
        cond: conditioning of the ``B`` final samples.
        sample_adv: ``[B]`` per-sample advantages.
        nfe: transformer evaluations the rollout spent.
        rewards: ``[B, R]`` each reward's score of each final sample, as trained on.
        reward_components: each reward component's ``[B]`` scores (e.g. ``reward/shapes/count``).
        sample_lags: ``[B]`` weight versions each final sample lags behind the trainer (``None``: all 0).
        weights: ``[N]`` importance weight of each transition's loss term (``None``: all 1), see
            :func:`mmrl.core.losses.stale_sample_weights`.
    """

    transitions: TransitionBatch
    adv: torch.Tensor
    images: torch.Tensor
    prompts: list[str]
    final_latents: torch.Tensor
    cond: Conditioning
    sample_adv: torch.Tensor
    nfe: int
    rewards: torch.Tensor
    reward_components: dict[str, torch.Tensor]
    sample_lags: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    @property
    def groups(self) -> torch.Tensor:
        """``[B]`` group id of each final sample (the images of one prompt form a group)."""
        return prompt_ids(self.prompts)


@dataclass
class FlowSamples:
    """One step's flow samples.

    Attributes:
        rollout: the flat groups (:class:`Rollout`) or the trees (:class:`TreeRollout`).
        prompts: the prompt of each group or tree, in order.
        sampling: the settings the samples were drawn with (the step's SDE window); ``None`` when they vary
            per request (a pool).
        explored: the explorer's choice of seeds, when exploring.
    """

    rollout: Rollout | TreeRollout
    prompts: list[str]
    sampling: SamplingConfig | None = None
    explored: ExploreResult | None = None
