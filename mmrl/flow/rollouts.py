"""Flow rollouts generated in the training process: :class:`LoopFlowSource`, a :class:`~mmrl.rollouts.RolloutSource`.

Per training step it asks the trainer's planner for the step's prompts, counts and sampling settings (with the
step's SDE window), then, with the sampling ("old") policy's weights swapped in:

- ``explore``: previews ``K`` seeds per prompt with the quantized explorer and keeps some (Sol-RL,
  ``pipelines/flow/explore.py``); the kept seeds' noises start the rollouts below and decide the group sizes;
- ``flat``: one group of ``counts[p]`` SDE rollouts per prompt (``pipelines/flow/rollout.py``);
- ``tree``: one tree per prompt (per kept seed when exploring) that branches at ``tree.split_steps``
  (BranchGRPO, ``pipelines/flow/branch.py``).

Everything is drawn from the trainer's generator in the order the planner, explorer and rollout ask for it, so a
run is reproducible from its seed and resumes exactly. Every sample is on-policy: lag 0. Scoring, advantages and
the transitions to train stay with the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from mmrl.flow.batch import FlowSamples
from mmrl.flow.config import TreeSettings
from mmrl.rollouts import Planner, SourceBatch
from mmrl.run import MetricAccumulator
from pipelines.flow.adapters import FlowAdapter
from pipelines.flow.branch import TreeConfig, tree_rollout
from pipelines.flow.explore import ExploreConfig, ExploreResult, explore
from pipelines.flow.rollout import SamplingConfig, rollout

if TYPE_CHECKING:
    from pipelines.quant import QuantizedCopy

__all__ = ["LoopFlowSource"]


class LoopFlowSource:
    """Flat, tree or explorer-seeded flow rollouts in the training process; see the module docstring.

    Args:
        adapter: the policy's flow adapter.
        plan: the trainer's planner (prompts, counts, the step's sampling settings).
        prompts_per_step: prompts the planner is asked for per step.
        generator: the trainer's generator (noise, previews, tree branches).
        sampling_weights: a context that swaps in the sampling policy's weights (the trainer's old policy).
        metrics: the trainer's metric sink.
        tree: the ``tree:`` section to grow trees (``sampling.rollout=branch``); ``None``: flat groups.
        explorer: the quantized copy (:func:`pipelines.quant.quantize_copy`) to preview seeds with;
            ``None``: no exploration.
        explore_config: the explorer's settings (with ``explorer``).
        preview_reward: ``preview_reward(images, prompts) -> [B]`` the trainer's reward of previews (with
            ``explorer``).

    Raises:
        ValueError: ``explorer`` without ``explore_config`` and ``preview_reward``.
    """

    def __init__(
        self,
        adapter: FlowAdapter,
        *,
        plan: Planner,
        prompts_per_step: int,
        generator: torch.Generator,
        sampling_weights: Callable[[], AbstractContextManager[None]],
        metrics: MetricAccumulator,
        tree: TreeSettings | None = None,
        explorer: QuantizedCopy | None = None,
        explore_config: ExploreConfig | None = None,
        preview_reward: Callable[[torch.Tensor, list[str]], torch.Tensor] | None = None,
    ) -> None:
        if explorer is not None and (explore_config is None or preview_reward is None):
            raise ValueError("an explorer needs explore_config and preview_reward")
        self.adapter = adapter
        self.plan = plan
        self.prompts_per_step = prompts_per_step
        self.generator = generator
        self.sampling_weights = sampling_weights
        self.metrics = metrics
        self.tree = tree
        self.explorer = explorer
        self.explore_config = explore_config
        self.preview_reward = preview_reward

    def collect(self, step: int) -> SourceBatch[FlowSamples]:
        """The samples of training step ``step``, all of lag 0."""
        request = self.plan(step, self.prompts_per_step, frozenset())
        prompts, sampling = list(request.prompts), request.sampling
        self.adapter.transformer.eval()
        start = time.perf_counter()
        with self.sampling_weights():
            explored = self._explore(prompts, sampling) if self.explorer is not None else None
            noise = None if explored is None else explored.noise
            if explored is not None:
                kept = explored.chosen.shape[1]
                counts = [kept] * len(prompts)
                if self.tree is not None:
                    prompts = [p for p in prompts for _ in range(kept)]  # a tree per kept seed
            else:
                counts = list(request.counts)
            if self.tree is not None:
                out = tree_rollout(
                    self.adapter, prompts, sampling, self._tree_config(sampling), self.generator, noise
                )
                samples = len(out.leaf_prompts)
            else:
                out = rollout(self.adapter, prompts, counts, sampling, generator=self.generator, noise=noise)
                samples = len(out.prompts)
        self.metrics.add("time/rollout_s", time.perf_counter() - start)
        return SourceBatch(
            FlowSamples(out, prompts, sampling, explored), step, torch.zeros(samples, dtype=torch.long)
        )

    def _tree_config(self, sampling: SamplingConfig) -> TreeConfig:
        """The trees' split steps, counted from the start of the step's SDE window."""
        tree = self.tree
        offset = sampling.sde_window[0] if sampling.sde_window is not None else 0
        factors = tuple(tree.branch_factor) if isinstance(tree.branch_factor, list) else tree.branch_factor
        return TreeConfig(split_steps=tuple(offset + s for s in tree.split_steps), branch_factor=factors)

    def _explore(self, prompts: list[str], sampling: SamplingConfig) -> ExploreResult:
        """Preview candidates with the quantized copy (synced with the sampling weights: the old-policy EMA under
        ``trainer.old_policy_decay``, else the current ones) and pick seeds."""
        self.explorer.sync(self.adapter.transformer)
        result = explore(
            self.adapter,
            self.explorer.module,
            prompts,
            sampling,
            self.explore_config,
            self.preview_reward,
            generator=self.generator,
        )
        self.metrics.add("nfe/preview", float(result.nfe))
        self.metrics.add("explore/preview_reward_mean", result.preview_rewards.mean())
        return result

    def prefetch(self, step: int) -> None:
        """Nothing to queue: every step is generated when it is collected."""

    def close(self) -> None:
        """Nothing to release."""
