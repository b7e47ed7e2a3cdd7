"""Flat flow-GRPO rollouts from a :class:`~pipelines.pool.pool.RolloutPool` (``pool.enabled: true``).

The trainer keeps deciding which prompts get rollouts and how many (its selection and allocation on its
statistics store); the pool's workers generate them. Per training step ``k`` (the pool's weight version when
step ``k`` is consumed is ``k``, counted from the step the pool started at):

1. publish the weights of the optimizer steps so far (``make_update``: LoRA-only with a frozen base) as version
   ``k``; the pool started from the trainer's weights as version 0;
2. queue the requests of steps up to ``k + max_staleness``: prompts and counts from the allocator, the step's SDE
   window, one request per worker, seeds derived from the run seed, rank, step and request index;
3. wait for step ``k``'s results; they hold samples of versions ``k - max_staleness .. k``;
4. score, update the statistics store and compute advantages as the in-process flat rollout does;
5. GRPO: transitions of samples with lag > 0 were drawn by an older policy. Their log-probs are re-scored under
   the current weights (the proximal "old" policy of the clipped ratio, decoupled PPO as in AReaL,
   arXiv 2505.24298 eq. 5) and each transition's surrogate is weighted by the truncated importance weight
   ``w = min(pi_current / pi_behaviour, C)`` (:func:`mmrl.core.losses.truncated_is_weights`); lag-0
   transitions keep their behaviour log-probs and ``w = 1`` exactly. The likelihood-free objectives (nft, rwr)
   train on the final samples under the current weights and are not re-weighted.

``max_staleness = 0`` is synchronous on-policy training with the same draws as the in-process path except the
rollout noise (seeded per request instead of from the trainer's generator). ``1`` generates step ``k + 1``
(with version ``k`` weights) while step ``k`` trains. Asynchronous runs do not resume bit-exactly: the requests
in flight at a checkpoint are made again from the resumed state.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from mmrl.core import allocation as alloc_lib
from mmrl.core.losses import truncated_is_weights
from mmrl.device import DTYPES
from mmrl.flow.batch import StepBatch
from mmrl.seeding import request_seed
from pipelines.flow.adapters import Conditioning
from pipelines.flow.rollout import Rollout, SamplingConfig, TransitionBatch, rescore, rollout
from pipelines.pool.flow_worker import FlowRolloutWorker
from pipelines.pool.protocol import FULL_PRECISION, RolloutRequest, WeightUpdate
from pipelines.pool.weights import make_update

if TYPE_CHECKING:
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = [
    "FlowStepRequest",
    "PoolStepInfo",
    "PooledFlowWorker",
    "PooledRollouts",
    "concat_rollouts",
    "importance_weights",
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


def importance_weights(
    current_logp: torch.Tensor, behaviour_logp: torch.Tensor, lags: torch.Tensor, cap: float
) -> torch.Tensor:
    """``[N]`` truncated importance weights: ``min(exp(current - behaviour), cap)`` where ``lags > 0``, exactly 1
    where ``lags == 0`` (those samples come from the current weights; re-scoring them would only add the
    rounding noise of a different batch composition)."""
    weights = truncated_is_weights(current_logp, behaviour_logp, cap)
    return torch.where(lags > 0, weights, torch.ones_like(weights))


@dataclass
class PoolStepInfo:
    """What the last consumed step looked like (tests and debugging).

    Attributes:
        sample_lags: ``[B]`` weight versions each sample lags behind the trainer.
        transition_lags: ``[N]`` the lag of each trained transition's sample.
        weights: ``[N]`` importance weight of each trained transition (1 without GRPO or at lag 0).
        request_seeds: the step's request seeds, in request order.
    """

    sample_lags: torch.Tensor
    transition_lags: torch.Tensor
    weights: torch.Tensor
    request_seeds: list[int]


class PooledRollouts:
    """Drives a :class:`RolloutPool` for a :class:`~mmrl.flow.trainer.FlowGRPOTrainer`; see the module docstring.

    Built at the end of the trainer's ``setup()`` (after a resume), so version 0 is the weights held then.
    """

    def __init__(self, trainer: FlowGRPOTrainer) -> None:
        self.trainer = trainer
        cfg = trainer.cfg
        p = cfg.pool
        self.settings = p
        self.start_step = trainer.step
        self.last_step = cfg.trainer.steps - 1 - self.start_step  # the pool step of the last training step
        self.submitted = 0  # next pool step whose requests are to be made
        self.seeds: dict[int, list[int]] = {}
        self.last: PoolStepInfo | None = None
        # the workers' base sampling: every request overrides the SDE window. Restore the generator so that
        # building it does not consume the random-window draw the first step makes
        state = trainer.generator.get_state()
        sampling = replace(trainer.sampling_config(), sde_window=None)
        trainer.generator.set_state(state)
        transformer = trainer.adapter.transformer
        # the LoRA (even untrained: the worker then runs the trainer's module structure) or resumed weights
        initial = (
            make_update(transformer, version=0) if cfg.model.lora is not None or trainer.step > 0 else None
        )
        device = p.device if p.device is not None else str(trainer.device)
        factory = functools.partial(
            PooledFlowWorker.build,
            cfg.model.family,
            cfg.model.path,
            sampling,
            initial,
            device=device,
            torch_dtype=DTYPES[cfg.model.dtype],
            autocast_dtype=DTYPES[cfg.model.autocast] if cfg.model.autocast else None,
            **cfg.model.options,
        )
        self.pool = p.build_pool(factory)

    # ------------------------------------------------------------------ requests
    def make_requests(self, pool_step: int) -> list[FlowStepRequest]:
        """The requests of pool step ``pool_step``: the allocator's prompts and counts, one request per worker."""
        t = self.trainer
        a = t.cfg.allocation
        step = self.start_step + pool_step
        prompts = alloc_lib.sample_prompts(
            t.stats, t.train_pool, a.prompts_per_step, method=a.selection, generator=t.generator
        )
        counts = alloc_lib.allocate(
            t.stats, prompts, a.rollouts_per_step, method=a.method, n_min=a.n_min, n_max=a.n_max
        ).tolist()
        window = self.trainer.sde_window(step)
        chunks = torch.arange(len(prompts)).tensor_split(min(self.settings.num_workers, len(prompts)))
        requests = []
        for i, rows in enumerate(chunks):
            rows = rows.tolist()
            seed = request_seed(t.cfg.run.seed, t.rank, step, i)
            requests.append(
                FlowStepRequest(
                    request_id=f"step{step}-{i}",
                    prompt_ids=[prompts[r] for r in rows],
                    prompts=[prompts[r] for r in rows],
                    counts=[counts[r] for r in rows],
                    seed=seed,
                    sde_window=window,
                )
            )
        self.seeds[pool_step] = [r.seed for r in requests]
        return requests

    # ------------------------------------------------------------------ one step
    def collect(self) -> StepBatch:
        """Steps 1-5 of the module docstring for the trainer's current step."""
        t = self.trainer
        k = t.step - self.start_step
        start = time.perf_counter()
        if self.pool.version < k:
            # published here rather than after the update, so the trainer needs no hook in its objectives;
            # nothing changes the weights between the end of train_step and the next collect
            with t.sampling_weights():
                update = make_update(t.adapter.transformer, version=k)
            self.pool.broadcast(update)
        while self.submitted <= max(k, min(k + self.settings.max_staleness, self.last_step)):
            self.pool.submit(self.make_requests(self.submitted), step=self.submitted)
            self.submitted += 1
        batch = self.pool.collect(k)
        t.metrics.add("time/rollout_s", time.perf_counter() - start)  # time the trainer waited for samples
        t.metrics.add("time/generate_s", sum(r.seconds for r in batch.results))
        ro = concat_rollouts([r.output for r in batch.results], t.device)
        sample_lags = batch.sample_lags()  # [B], results and samples in order, as in ro
        t.metrics.add("pool/lag_mean", sample_lags.float().mean(), count=sample_lags.numel())
        t.metrics.add("pool/lag_max", float(sample_lags.max()))

        _, adv, trans = t.score_flat(ro)  # the in-process flat rollout's steps 3-4
        adv_t = adv[trans.sample_index]
        lags_t = sample_lags[trans.sample_index]
        weights = torch.ones(len(trans))
        if t.cfg.trainer.objective == "grpo":
            trans, weights = self._correct(trans, lags_t)
            # w * L(r, A) = L(r, w * A) for w >= 0 (the clipped surrogate is positively homogeneous in A), so
            # weighting each transition's surrogate is folding w into its advantage; the KL term is not weighted
            adv_t = adv_t * weights
        self.last = PoolStepInfo(sample_lags, lags_t, weights, self.seeds.pop(k))
        t.metrics.add("nfe/rollout", float(ro.nfe))
        t.nfe_total += ro.nfe
        return StepBatch(trans, adv_t, ro.images, ro.prompts, ro.latents[:, -1], ro.cond, adv, ro.nfe)

    @torch.no_grad()
    def _correct(self, trans: TransitionBatch, lags: torch.Tensor) -> tuple[TransitionBatch, torch.Tensor]:
        """Re-score the transitions of stale samples under the current weights; returns the batch with those
        log-probs as the ratio's old log-probs, and ``[N]`` TIS weights (1 at lag 0)."""
        t = self.trainer
        stale = torch.nonzero(lags > 0).flatten()
        current = trans.log_probs.clone()  # behaviour log-probs: the current policy's at lag 0
        if stale.numel():
            t.adapter.transformer.eval()
            current[stale] = torch.cat(
                [
                    rescore(t.adapter, trans.select(idx))[0].float().cpu()
                    for idx in stale.split(t.cfg.trainer.minibatch_size)
                ]
            )
            t.nfe_total += stale.numel() * t.adapter.nfe_per_sample(trans.guidance_scale)
        weights = importance_weights(current, trans.log_probs, lags, self.settings.tis_cap)
        ratio = torch.exp(current - trans.log_probs)
        t.metrics.add("tis/weight_mean", weights.mean(), count=len(trans))
        t.metrics.add(
            "tis/clipped_frac",
            ((ratio > self.settings.tis_cap) & (lags > 0)).float().mean(),
            count=len(trans),
        )
        return replace(trans, log_probs=current), weights

    def close(self) -> None:
        self.pool.close()
