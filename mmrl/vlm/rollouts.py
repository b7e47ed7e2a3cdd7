"""VLM samples generated in the training process: :class:`LoopVLMSource`, a :class:`~mmrl.rollouts.RolloutSource`.

Per training step it asks the trainer's planner for the step's prompts and counts, then generates once per
distinct count (counts ascending), each call with a seed drawn from the trainer's generator, on the trainer's
generation backend (transformers on the policy, or the trainer's vLLM engine). Every sample is on-policy: lag 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mmrl.rollouts import Planner, SourceBatch
from pipelines.vlm.backend import GenerationSample

__all__ = ["LoopVLMSource", "VLMPairs"]

#: a VLM source's output: ``(prompt_id, sample)`` per generated sample
VLMPairs = list[tuple[str, GenerationSample]]


class LoopVLMSource:
    """VLM samples generated in the loop; see the module docstring.

    Args:
        plan: the trainer's planner.
        generate: ``generate(prompt_ids, n) -> pairs``: ``n`` samples of each prompt on the trainer's backend.
        prompts_per_step: prompts the planner is asked for per step.
    """

    def __init__(self, plan: Planner, generate: Callable[[list[str], int], VLMPairs], prompts_per_step: int):
        self.plan = plan
        self.generate = generate
        self.prompts_per_step = prompts_per_step

    def collect(self, step: int) -> SourceBatch[VLMPairs]:
        """The samples of training step ``step``, all of lag 0."""
        request = self.plan(step, self.prompts_per_step, frozenset())
        pairs: VLMPairs = []
        for n in sorted(set(request.counts)):
            ids = [pid for pid, count in zip(request.prompt_ids, request.counts, strict=True) if count == n]
            pairs.extend(self.generate(ids, n))
        # a prompt too long for the length settings is skipped by the backend: no sample of it comes back
        answered = {pid for pid, _ in pairs}
        skipped = sum(pid not in answered for pid in request.prompt_ids)
        return SourceBatch(pairs, step, torch.zeros(len(pairs), dtype=torch.long), {"skipped": skipped})

    def prefetch(self, step: int) -> None:
        """Nothing to queue: every step is generated when it is collected."""

    def close(self) -> None:
        """Nothing to release."""
