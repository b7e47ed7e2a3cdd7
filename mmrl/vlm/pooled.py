"""VLM RLVR rollouts from a :class:`~pipelines.pool.pool.RolloutPool` of VLM workers (``pool.enabled: true``):
:class:`PooledVLMSource`, a :class:`~mmrl.rollouts.RolloutSource`.

The trainer keeps deciding which prompts get rollouts and how many (its planner: selection, and in group mode
the allocator, on its statistics store); the pool's :class:`~pipelines.pool.vlm_worker.VLMRolloutWorker`\\ s
generate them. The source never sees the trainer. Per training step ``k`` (the pool's weight version when step
``k`` is consumed is ``k``, counted from the step the pool started at):

1. publish the policy's weights (``weights(k)``: LoRA-only with a frozen base) as version ``k``; the pool
   started from the trainer's weights as version 0;
2. make sure step ``k``'s requests are queued (:meth:`RolloutPool.submit_through`): the planner's prompts and
   counts, one request per worker (or ``pool.prompts_per_request`` prompts each), seeds hashed from the run
   seed, rank, step and request index, the ground truth in each prompt's metadata;
3. wait for step ``k``'s results (with ``pool.overprovision``: only until the step's target of samples is
   complete; the requests still queued or generating are carried into step ``k + 1`` by the pool and delivered
   first there, never discarded);
4. the trainer verifies, updates its statistics and computes advantages as on in-loop samples, then
   :meth:`PooledVLMSource.prefetch` queues the requests of the steps up to ``k + max_staleness``
   (:meth:`RolloutPool.submit_ahead`, chosen with the statistics of step ``k``, knowing what step ``k``
   carried), which the workers generate while step ``k`` trains;
5. the update (the trainer) re-scores every sample under the current weights (its "old" log-probs: the
   proximal policy of decoupled PPO, AReaL arXiv 2505.24298) and weights the loss terms of samples with
   lag > 0 by the truncated importance weight ``min(pi_current / pi_behaviour, pool.tis_cap)`` against the
   worker's behaviour log-probs, per token or per sequence as ``trainer.tis_mode`` says
   (:func:`mmrl.core.losses.stale_sample_weights`). Lag-0 samples get the trainer's engine TIS
   (``trainer.tis``; ``auto`` is on for vLLM or ``generation.top_p < 1``, off for the transformers backend at
   ``top_p = 1``, where their ratio is ~1).

Backends (``generation.backend``): with ``hf`` a worker generates with a transformers model on ``pool.device``;
with ``vllm`` each worker owns a vLLM engine (:meth:`VLMRolloutWorker.from_vllm`, CUDA GPU) and a CPU copy of the
model that takes the weight updates and pushes them, LoRA merged, into the engine. The behaviour log-probs are then
the engine's, and ``trainer.tis: auto`` weights lag-0 samples as the in-loop vLLM path does. The trainer builds no
engine of its own then (it evaluates with transformers on its model). Every member's engine takes
``generation.vllm_gpu_memory_utilization`` of its GPU: with several members on one GPU lower it so that they all
fit beside the training, or give each member its own GPU as a Ray actor (``pool.executor: ray``,
``pool.ray: {num_gpus: 1}``). Ray also gives each engine its own process; vLLM does not promise several
engines in one process (vllm-project/vllm#1676), which is what in-process members are.

``max_staleness = 0`` is synchronous on-policy training with the in-loop path's prompts and statistics; only the
sampling seed differs (hashed per request instead of drawn from the trainer's generator). ``1`` generates step
``k + 1`` (with version ``k`` weights) while step ``k`` trains.

APRIL (arXiv 2509.18521) with ``pool.overprovision = f``: every step has ``ceil(P (1 + f))`` prompts in flight,
``P = allocation.prompts_per_step``: the prompts carried from the previous step plus new ones (never the same prompt
twice in a step); the step trains once the samples of ``P`` prompts are complete (``collect(min_samples=...)``),
on every finished sample. A carried request is delivered at the next step, exactly once.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from mmrl.device import DTYPES
from mmrl.rollouts import Planner, SourceBatch
from mmrl.run import MetricAccumulator
from mmrl.seeding import request_seed
from mmrl.vlm.config import GenerationConfig, VLMModelConfig, VLMPoolSettings
from mmrl.vlm.rollouts import VLMPairs
from pipelines.pool.protocol import RolloutRequest, WeightUpdate
from pipelines.pool.vlm_worker import VLMRolloutWorker
from pipelines.vlm import vllm_backend
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.families import get_vlm_family

__all__ = ["PooledVLMSource", "PooledVLMWorker", "pooled_worker_factory"]

logger = logging.getLogger(__name__)


class PooledVLMWorker(VLMRolloutWorker):
    """:class:`VLMRolloutWorker` (transformers or vLLM backend) started from the trainer's weights as version 0."""

    @classmethod
    def build(
        cls,
        path: str,
        params: SamplingParams,
        initial: WeightUpdate | None = None,
        backend: Literal["hf", "vllm"] = "hf",
        **kwargs: Any,
    ) -> PooledVLMWorker:
        """``from_pretrained(path, params, **kwargs)`` (``backend="hf"``) or ``from_vllm(path, params,
        **kwargs)`` (``"vllm"``), then ``initial`` (the trainer's LoRA, or its resumed weights) applied as
        version 0, which also pushes it into a vLLM engine: the pool's version 0 is whatever the trainer held
        when the pool started.

        Raises:
            ValueError: an unknown ``backend``.
        """
        factories = {"hf": cls.from_pretrained, "vllm": cls.from_vllm}
        if backend not in factories:
            raise ValueError(f"backend must be one of {sorted(factories)}, got {backend!r}")
        worker = factories[backend](path, params, **kwargs)
        if initial is not None:
            worker.load_weights(initial)
        return worker


def pooled_worker_factory(
    model: VLMModelConfig,
    generation: GenerationConfig,
    settings: VLMPoolSettings,
    initial: WeightUpdate | None,
    device: str,
    seed: int,
) -> Callable[[], PooledVLMWorker]:
    """The picklable factory of one pool member for the ``model:`` / ``generation:`` sections; ``initial`` is
    the trainer's weights as version 0, ``device`` the trainer's (used when ``pool.device`` is null). The member's
    backend gets the family ``model.family`` names (null: it detects the family from the checkpoint's
    ``model_type``, as the trainer does).

    Raises:
        ImportError: ``generation.backend=vllm`` with in-process members and vLLM not installed.
    """
    family = get_vlm_family(model.family) if model.family else None
    params = generation.sampling(generation.temperature, generation.top_p)
    if generation.backend == "vllm":
        if settings.executor == "inprocess":
            # fail here, naming the extra, not later in a member's thread (a Ray driver may lack the GPU and
            # vLLM its actors have)
            vllm_backend.import_vllm()
        # the engine arguments of the trainer's own engine (VLMRLVRTrainer._make_backend); a member never
        # sleeps (it generates while the trainer trains), so sleep mode is off
        engine: dict[str, Any] = dict(
            **generation.vllm_engine_options(),
            dtype=model.dtype,
            seed=seed,
            enable_sleep_mode=False,
            family=family,
        )
    else:
        engine = dict(
            device=settings.device if settings.device is not None else device,
            **generation.hf_backend_options(),
            family=family,
        )
    return functools.partial(
        PooledVLMWorker.build,
        model.path,
        params,
        initial,
        generation.backend,
        torch_dtype=DTYPES[model.dtype],
        **engine,
    )


class PooledVLMSource:
    """A :class:`~mmrl.rollouts.RolloutSource` of VLM samples from a :class:`RolloutPool`; see the module
    docstring. Its output is the step's ``(prompt_id, sample)`` pairs, carried requests first.

    Args:
        settings: the ``pool:`` section.
        worker: factory of one pool member (:func:`pooled_worker_factory`).
        plan: the trainer's planner (prompt choice, counts, prompts and ground truths).
        prompts_per_step: ``P``, prompts whose samples complete a step.
        samples_per_step: the step's target of samples (with ``pool.overprovision``, the step trains once
            that many are complete).
        num_prompts: prompts the planner can choose from (``ceil(P (1 + overprovision))`` must fit).
        first_step: the training step the pool starts at (its weight version 0).
        num_steps: training steps the source serves (no request is made beyond the last).
        seed, rank: the run seed and the rank (request seeds are derived from them, the step and the request).
        weights: ``weights(version)``: the policy's weights as a :class:`WeightUpdate` of ``version``.
        metrics: the trainer's metric sink.

    Raises:
        ValueError: ``pool.overprovision`` asks for more prompts per step than there are, or bad ``pool.ray``
            options.
    """

    def __init__(
        self,
        settings: VLMPoolSettings,
        worker: Callable[[], PooledVLMWorker],
        *,
        plan: Planner,
        prompts_per_step: int,
        samples_per_step: int,
        num_prompts: int,
        first_step: int,
        num_steps: int,
        seed: int,
        rank: int,
        weights: Callable[[int], WeightUpdate],
        metrics: MetricAccumulator,
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.first_step = first_step
        self.last_step = num_steps - 1  # the pool step of the last training step
        self.seed, self.rank = seed, rank
        self.weights = weights
        self.metrics = metrics
        self.pending: dict[str, RolloutRequest] = {}  # submitted, not delivered yet
        self.step_of: dict[str, int] = {}  # pool step each pending request is delivered at
        self.last: SourceBatch[VLMPairs] | None = None
        self.target_samples = samples_per_step
        # prompts per step, carried + new
        self.in_flight = math.ceil(prompts_per_step * (1 + settings.overprovision))
        if self.in_flight > num_prompts:
            raise ValueError(
                f"pool.overprovision={settings.overprovision} keeps {self.in_flight} prompts per step in flight, "
                f"more than the {num_prompts} train examples; lower it or allocation.prompts_per_step"
            )
        self.pool = settings.build_pool(worker)

    def _requests(self, pool_step: int) -> list[RolloutRequest]:
        """The new requests of ``pool_step``: enough prompts to keep ``in_flight`` prompts in the step (those
        carried into it count), none already carried into it."""
        settings = self.settings
        step = self.first_step + pool_step
        carried = [r for rid, r in self.pending.items() if self.step_of[rid] == pool_step]
        wanted = self.in_flight - sum(len(r.prompts) for r in carried)
        if wanted <= 0:  # what was carried in already fills the step
            return []
        plan = self.plan(step, wanted, frozenset(pid for r in carried for pid in r.prompt_ids))
        n = len(plan.prompt_ids)
        if n == 0:
            return []
        if settings.prompts_per_request is not None:
            size = settings.prompts_per_request
            chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        else:
            chunks = [rows.tolist() for rows in torch.arange(n).tensor_split(min(settings.num_workers, n))]
        requests = []
        for index, rows in enumerate(chunks):
            # by count, as the in-loop path generates (one generate per count, counts ascending)
            rows = sorted(rows, key=lambda r: plan.counts[r])
            request = RolloutRequest(
                request_id=f"step{step}-{index}",
                prompt_ids=[plan.prompt_ids[r] for r in rows],
                prompts=[plan.prompts[r] for r in rows],
                counts=[plan.counts[r] for r in rows],
                seed=request_seed(self.seed, self.rank, step, index),
                metadata=None if plan.metadata is None else [plan.metadata[r] for r in rows],
            )
            self.pending[request.request_id] = request
            self.step_of[request.request_id] = pool_step
            requests.append(request)
        return requests

    def collect(self, step: int) -> SourceBatch[VLMPairs]:
        """Steps 1-3 of the module docstring: the ``(prompt_id, sample)`` pairs of training step ``step``."""
        pool_step = step - self.first_step
        start = time.perf_counter()
        if self.pool.version < pool_step:
            self.pool.broadcast(self.weights(pool_step))
        self.pool.submit_through(pool_step, self._requests, self.last_step)
        partial = self.target_samples if self.settings.overprovision > 0 else None
        batch = self.pool.collect(pool_step, min_samples=partial)
        self.metrics.add("time/wait_s", time.perf_counter() - start)  # time the trainer waited for samples
        self.metrics.add("time/generate_s", sum(r.seconds for r in batch.results))
        pairs: VLMPairs = []
        skipped = 0
        for result in batch.results:
            request = self.pending.pop(result.request_id)
            del self.step_of[result.request_id]
            pairs.extend((request.prompt_ids[s.prompt_index], s) for s in result.output.samples)
            for s in result.output.skipped:
                logger.warning("skipped prompt %s: %s", s.prompt_id, s.reason)
            skipped += len(result.output.skipped)
        carried = [rid for rid, at in self.step_of.items() if at == pool_step]
        for rid in carried:  # the pool delivers them first at the next step
            self.step_of[rid] = pool_step + 1
        lags = batch.sample_lags()
        # no lag when every prompt was skipped (the trainer then stops, naming the length settings)
        if lags.numel() > 0:
            self.metrics.add("pool/lag_mean", lags.float().mean(), count=lags.numel())
            self.metrics.add_max("pool/lag_max", float(lags.max()))
        self.metrics.add("pool/samples", float(batch.num_samples))
        self.metrics.add("pool/carried", float(sum(self.pending[rid].num_samples for rid in carried)))
        info = {
            "request_ids": [r.request_id for r in batch.results],
            "carried_ids": carried,
            "skipped": skipped,
        }
        self.last = SourceBatch(pairs, step, lags, info)
        return self.last

    def prefetch(self, step: int) -> None:
        """Queue the requests of the steps up to ``step + max_staleness`` (the pool's window), chosen with the
        statistics of step ``step``."""
        self.pool.submit_ahead(step - self.first_step, self._requests, self.last_step)

    def close(self) -> None:
        self.pool.close()
