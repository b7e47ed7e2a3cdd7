"""Flat flow-GRPO rollouts from a :class:`~pipelines.pool.pool.RolloutPool` (``pool.enabled: true``):
:class:`PooledFlowSource`, a :class:`~mmrl.rollouts.RolloutSource`.

The trainer keeps deciding which prompts get rollouts and how many (its planner: selection and allocation on
its statistics store, and the step's SDE window); the pool's workers generate them. The source never sees the
trainer. Per training step ``k`` (the pool's weight version when step ``k`` is consumed is ``k``, counted from
the step the pool started at):

1. publish the trainer's sampling weights (``weights(k)``: LoRA-only with a frozen base) as version ``k``; the
   pool started from the trainer's weights as version 0;
2. make sure step ``k``'s requests are queued (:meth:`RolloutPool.submit_through`): the planner's prompts and
   counts, the step's SDE window, one request per worker, seeds derived from the run seed, rank, step and
   request index;
3. wait for step ``k``'s results, merged into one :class:`Rollout`; they hold samples of versions
   ``k - max_staleness .. k``;
4. the trainer scores, updates its statistics store and computes advantages as on in-process flat rollouts,
   then :meth:`PooledFlowSource.prefetch` queues the steps up to ``k + max_staleness``
   (:meth:`RolloutPool.submit_ahead`, chosen with the statistics of step ``k``), generated while step ``k``
   trains;
5. GRPO (the trainer): transitions of samples with lag > 0 were drawn by an older policy. Their log-probs are
   re-scored under the current weights (the proximal "old" policy of the clipped ratio, decoupled PPO as in
   AReaL, arXiv 2505.24298 eq. 5) and each transition's loss term is weighted by the truncated importance
   weight ``w = min(pi_current / pi_behaviour, C)`` (:func:`mmrl.core.losses.stale_sample_weights`); lag-0
   transitions keep their behaviour log-probs and ``w = 1`` exactly. The likelihood-free objectives (nft, rwr,
   awm) train on the final samples under the current weights and are not re-weighted.

``max_staleness = 0`` is synchronous on-policy training with the same draws as the in-process path except the
rollout noise (seeded per request instead of from the trainer's generator). ``1`` generates step ``k + 1``
(with version ``k`` weights) while step ``k`` trains. Asynchronous runs do not resume bit-exactly: the requests
in flight at a checkpoint are made again from the resumed state.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from mmrl.device import DTYPES
from mmrl.flow.batch import FlowSamples
from mmrl.flow.config import FlowModelConfig
from mmrl.rollouts import Planner, SourceBatch
from mmrl.run import MetricAccumulator
from mmrl.sections import PoolSettings
from mmrl.seeding import request_seed
from pipelines.flow.adapters import Conditioning
from pipelines.flow.rollout import Rollout, SamplingConfig, rollout
from pipelines.pool.flow_worker import FlowRolloutWorker
from pipelines.pool.protocol import FULL_PRECISION, RolloutRequest, WeightUpdate

__all__ = [
    "FlowStepRequest",
    "PooledFlowSource",
    "PooledFlowWorker",
    "concat_rollouts",
    "pooled_worker_factory",
]


@dataclass(frozen=True)
class FlowStepRequest(RolloutRequest):
    """A flow rollout request that also carries its training step's SDE window (the window moves per step).

    Attributes:
        sde_window: ``(start, stop)`` SDE steps of the step's sampling, or ``None`` (every step is SDE).
    """

    sde_window: tuple[int, int] | None = None


class PooledFlowWorker(FlowRolloutWorker):
    """:class:`FlowRolloutWorker` sampling each request with its step's SDE window, built from the trainer's
    starting weights (version 0)."""

    @classmethod
    def build(
        cls,
        family: str,
        path: str,
        sampling: SamplingConfig,
        initial: WeightUpdate | None = None,
        **kwargs: Any,
    ) -> PooledFlowWorker:
        """``from_pretrained(family, path, sampling, **kwargs)``, then ``initial`` (the trainer's LoRA or resumed
        weights) applied as version 0: the pool's version 0 is whatever the trainer held when the pool started."""
        worker = cls.from_pretrained(family, path, sampling, **kwargs)
        if initial is not None:
            worker.load_weights(initial)
        return worker

    def generate(self, request: RolloutRequest) -> Rollout:
        if request.precision != FULL_PRECISION:
            raise ValueError(
                f"request {request.request_id!r}: the pooled trainer samples at full precision only"
            )
        sampling = replace(self.sampling, sde_window=getattr(request, "sde_window", self.sampling.sde_window))
        return rollout(
            self.adapter,
            request.prompts,
            request.counts,
            sampling,
            torch.Generator().manual_seed(request.seed),
        )


def concat_rollouts(rollouts: list[Rollout], device: torch.device | str) -> Rollout:
    """One :class:`Rollout` from the rollouts of one step's requests (same schedule and SDE steps), groups
    renumbered in order, conditioning moved to ``device`` (where the trainer re-scores).

    Raises:
        ValueError: the rollouts were sampled with different schedules or SDE windows.
    """
    first = rollouts[0]
    for ro in rollouts[1:]:
        if not (torch.equal(ro.sigmas, first.sigmas) and torch.equal(ro.sde_steps, first.sde_steps)):
            raise ValueError("a step's rollouts must share the sigma schedule and the SDE window")
    offsets, groups = [], 0
    for ro in rollouts:
        offsets.append(groups)
        groups += int(ro.group_index.max()) + 1  # every group has >= 1 sample

    def cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {k: torch.cat([p[k].to(device) for p in parts]) for k in parts[0]}

    uncond = None if first.cond.uncond is None else cat([ro.cond.uncond for ro in rollouts])
    cond = Conditioning(cat([ro.cond.cond for ro in rollouts]), uncond)
    return Rollout(
        prompts=[p for ro in rollouts for p in ro.prompts],
        group_index=torch.cat([ro.group_index + off for ro, off in zip(rollouts, offsets, strict=True)]),
        latents=torch.cat([ro.latents for ro in rollouts]),
        log_probs=torch.cat([ro.log_probs for ro in rollouts]),
        sigmas=first.sigmas,
        sde_steps=first.sde_steps,
        images=torch.cat([ro.images for ro in rollouts]),
        nfe=sum(ro.nfe for ro in rollouts),
        cond=cond,
        config=first.config,
    )


def pooled_worker_factory(
    model: FlowModelConfig, sampling: SamplingConfig, initial: WeightUpdate | None, device: str
) -> Callable[[], PooledFlowWorker]:
    """The picklable factory of one pool member for the ``model:`` section: ``sampling`` is the members' base
    sampling (each request sets its step's SDE window), ``initial`` the trainer's weights as version 0."""
    return functools.partial(
        PooledFlowWorker.build,
        model.family,
        model.path,
        sampling,
        initial,
        device=device,
        torch_dtype=DTYPES[model.dtype],
        autocast_dtype=DTYPES[model.compute_dtype()] if model.compute_dtype() else None,
        **model.options,
    )


class PooledFlowSource:
    """A :class:`~mmrl.rollouts.RolloutSource` of flat flow rollouts from a :class:`RolloutPool`; see the module
    docstring. Its output is one flat :class:`Rollout` per step (the step's requests merged, on ``device``).

    Args:
        settings: the ``pool:`` section.
        worker: factory of one pool member (:func:`pooled_worker_factory`).
        plan: the trainer's planner (its prompt choice, counts and the step's sampling settings).
        prompts_per_step: prompts the planner is asked for per step.
        first_step: the training step the pool starts at (its weight version 0).
        num_steps: training steps the source serves (no request is made beyond the last).
        seed, rank: the run seed and the rank (request seeds are derived from them, the step and the request).
        weights: ``weights(version)``: the trainer's sampling weights as a :class:`WeightUpdate` of ``version``.
        metrics: the trainer's metric sink.
        device: where the merged rollout goes (the trainer's device, where it re-scores).
    """

    def __init__(
        self,
        settings: PoolSettings,
        worker: Callable[[], PooledFlowWorker],
        *,
        plan: Planner,
        prompts_per_step: int,
        first_step: int,
        num_steps: int,
        seed: int,
        rank: int,
        weights: Callable[[int], WeightUpdate],
        metrics: MetricAccumulator,
        device: torch.device | str,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.prompts_per_step = prompts_per_step
        self.first_step = first_step
        self.last_step = num_steps - 1  # the pool step of the last training step
        self.seed, self.rank = seed, rank
        self.weights = weights
        self.metrics = metrics
        self.device = device
        self.seeds: dict[int, list[int]] = {}
        self.last: SourceBatch[FlowSamples] | None = None
        self.pool = settings.build_pool(worker)

    def _requests(self, pool_step: int) -> list[FlowStepRequest]:
        """The requests of pool step ``pool_step``: the planner's prompts and counts, one request per worker."""
        step = self.first_step + pool_step
        plan = self.plan(step, self.prompts_per_step, frozenset())
        window = plan.sampling.sde_window if plan.sampling is not None else None
        n = len(plan.prompts)
        chunks = torch.arange(n).tensor_split(min(self.settings.num_workers, n))
        requests = []
        for index, rows in enumerate(chunks):
            rows = rows.tolist()
            requests.append(
                FlowStepRequest(
                    request_id=f"step{step}-{index}",
                    prompt_ids=[plan.prompt_ids[r] for r in rows],
                    prompts=[plan.prompts[r] for r in rows],
                    counts=[plan.counts[r] for r in rows],
                    seed=request_seed(self.seed, self.rank, step, index),
                    sde_window=window,
                )
            )
        self.seeds[pool_step] = [r.seed for r in requests]
        return requests

    def collect(self, step: int) -> SourceBatch[FlowSamples]:
        """Steps 1-3 of the module docstring for training step ``step``."""
        pool_step = step - self.first_step
        start = time.perf_counter()
        if self.pool.version < pool_step:
            # published here rather than after the update, so the trainer needs no hook in its objectives;
            # nothing changes the weights between the end of a step and the next collect
            self.pool.broadcast(self.weights(pool_step))
        self.pool.submit_through(pool_step, self._requests, self.last_step)
        batch = self.pool.collect(pool_step)
        self.metrics.add("time/rollout_s", time.perf_counter() - start)  # time the trainer waited for samples
        self.metrics.add("time/generate_s", sum(r.seconds for r in batch.results))
        ro = concat_rollouts([r.output for r in batch.results], self.device)
        lags = batch.sample_lags()  # [B], results and samples in order, as in ro
        self.metrics.add("pool/lag_mean", lags.float().mean(), count=lags.numel())
        self.metrics.add_max("pool/lag_max", float(lags.max()))
        first = torch.ones(len(ro.group_index), dtype=torch.bool)
        first[1:] = ro.group_index[1:] != ro.group_index[:-1]
        prompts = [ro.prompts[i] for i in torch.nonzero(first).flatten().tolist()]
        info = {"request_seeds": self.seeds.pop(pool_step)}
        self.last = SourceBatch(FlowSamples(ro, prompts), step, lags, info)
        return self.last

    def prefetch(self, step: int) -> None:
        """Queue the requests of the steps up to ``step + max_staleness`` (the pool's window)."""
        self.pool.submit_ahead(step - self.first_step, self._requests, self.last_step)

    def close(self) -> None:
        self.pool.close()
