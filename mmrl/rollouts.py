"""Rollout sources: what produces a training step's samples, behind one small interface.

A trainer decides which prompts get rollouts and how many (its selection and allocation on its statistics
store) and hands that decision to its source as a :class:`StepRequest` through a planner callback; the source
generates (in the training process, or through a :class:`~pipelines.pool.pool.RolloutPool` of workers) and
returns a :class:`SourceBatch`: the samples, tagged with the weight version they were generated with.

    source = PooledFlowSource(..., plan=trainer_plan, weights=snapshot, metrics=metrics)
    batch = source.collect(step)        # SourceBatch: batch.output, batch.sample_lags [N]
    ...score, update the statistics store, advantages, importance weights (the trainer's job)...
    source.prefetch(step)               # queue later steps' requests with the statistics of this step
    ...update...
    source.close()

Staleness. A sample generated with the weights of step ``v`` and trained at step ``k`` lags ``k - v`` versions.
Sources that generate in the loop return lag 0 everywhere; pooled sources return lags up to
``pool.max_staleness`` (``+ 1`` for a request carried over by partial rollouts, at most once), which only the
pool enforces (:meth:`RolloutPool.submit_through` / :meth:`RolloutPool.submit_ahead`). The trainer corrects
stale samples with one convention in both front ends: each sample's policy-gradient loss term is multiplied by
the truncated importance weight ``min(pi_current / pi_behaviour, C)``
(:func:`mmrl.core.losses.stale_sample_weights`), the KL term is not.

A source never receives the trainer: it gets a planner, a weight snapshot function and a metric sink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch

__all__ = ["Planner", "RolloutSource", "SourceBatch", "StepRequest"]

OutputT = TypeVar("OutputT")
OutputT_co = TypeVar("OutputT_co", covariant=True)


@dataclass(frozen=True)
class StepRequest:
    """The rollouts a trainer asks for at one training step.

    Attributes:
        step: the training step whose update consumes the samples.
        prompt_ids: ``[P]`` ids of the chosen prompts (the statistics store's keys).
        prompts: ``[P]`` what the generator reads: a text (flow) or a ``VLMPrompt`` (VLM).
        counts: ``[P]`` samples to draw for each prompt.
        sampling: the step's sampling settings (flow: a ``SamplingConfig`` with the step's SDE window), or
            ``None``: the source's own.
        metadata: ``[P]`` per-prompt data the workers pass through (the VLM ground truth), or ``None``.
    """

    step: int
    prompt_ids: list[str]
    prompts: list[Any]
    counts: list[int]
    sampling: Any = None
    metadata: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not len(self.prompt_ids) == len(self.prompts) == len(self.counts):
            raise ValueError(
                f"step {self.step}: prompt_ids, prompts and counts must have one entry per prompt, got "
                f"{len(self.prompt_ids)}, {len(self.prompts)}, {len(self.counts)}"
            )
        if self.metadata is not None and len(self.metadata) != len(self.prompts):
            raise ValueError(
                f"step {self.step}: metadata has {len(self.metadata)} entries for {len(self.prompts)} prompts"
            )


#: ``plan(step, num_prompts, exclude) -> StepRequest``: the trainer's choice of ``num_prompts`` prompts (none in
#: ``exclude``) and their counts for training step ``step``, made with its statistics of the moment of the call.
Planner = Callable[[int, int, frozenset[str]], StepRequest]


@dataclass
class SourceBatch(Generic[OutputT]):
    """One step's samples as a source hands them to the trainer.

    Attributes:
        output: the samples in the front end's format (flow: a ``Rollout``; VLM: ``(prompt_id, sample)`` pairs).
        version: the trainer's weight version when the samples are consumed (its training step).
        sample_lags: ``[N]`` versions each sample lags behind ``version`` (0: generated with the current weights),
            in the order of ``output``'s samples.
        info: what the source wants tests and logs to see of the step (request ids, seeds, carried requests).
    """

    output: OutputT
    version: int
    sample_lags: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)


class RolloutSource(Protocol[OutputT_co]):
    """Produces a training step's samples; see the module docstring."""

    def collect(self, step: int) -> SourceBatch[OutputT_co]:
        """The samples of training step ``step`` (requested through the planner if not requested before)."""
        ...

    def prefetch(self, step: int) -> None:
        """Called once step ``step``'s rewards are folded into the statistics: a source that generates ahead
        queues the requests of later steps now (a source that generates in the loop does nothing)."""
        ...

    def close(self) -> None:
        """Release workers and threads."""
        ...
