"""VLM RLVR rollouts from a :class:`~pipelines.pool.pool.RolloutPool` of VLM workers (``pool.enabled: true``).

The trainer keeps deciding which prompts get rollouts and how many (its selection, and in group mode the
allocator, on its statistics store: :meth:`VLMRLVRTrainer.choose_prompts`); the pool's
:class:`~pipelines.pool.vlm_worker.VLMRolloutWorker`\\ s generate them. Per training step ``k`` (the pool's weight
version when step ``k`` is consumed is ``k``, counted from the step the pool started at):

1. publish the policy's weights (``make_update``: LoRA-only with a frozen base) as version ``k``; the pool
   started from the trainer's weights as version 0;
2. make sure step ``k``'s requests are queued: prompts and counts from the trainer, one request per worker (or
   ``pool.prompts_per_request`` prompts each), seeds hashed from the run seed, rank, step and request index,
   the ground truth in each prompt's metadata;
3. wait for step ``k``'s results (with ``pool.overprovision``: only until the step's target of samples is
   complete; the requests still queued or generating are carried into step ``k + 1`` by the pool and delivered
   first there, never discarded);
4. the trainer verifies, updates its statistics and computes advantages as on in-loop samples, then
   :meth:`PooledVLMRollouts.submit_ahead` queues the requests of the steps up to ``k + max_staleness``
   (chosen with the statistics of step ``k``), which the workers generate while step ``k`` trains;
5. the update re-scores every sample under the current weights (the trainer's "old" log-probs: the proximal
   policy of decoupled PPO, AReaL arXiv 2505.24298) and weights the tokens of samples with lag > 0 by the
   truncated importance weight ``min(pi_current / pi_behaviour, pool.tis_cap)`` against the worker's behaviour
   log-probs, per token or per sequence as ``trainer.tis_mode`` says (the trainer's TIS path). Lag-0 samples
   get the trainer's engine TIS (``trainer.tis``; ``auto`` is on for vLLM, off for the transformers backend,
   where their ratio is ~1).

Backends (``generation.backend``): with ``hf`` a worker generates with a transformers model on ``pool.device``;
with ``vllm`` each worker owns a vLLM engine (:meth:`VLMRolloutWorker.from_vllm`, CUDA GPU) and a CPU copy of the
model that takes the weight updates and pushes them, LoRA merged, into the engine. The behaviour log-probs are then
the engine's, and ``trainer.tis: auto`` weights lag-0 samples as the in-loop vLLM path does. The trainer builds no
engine of its own then (it evaluates with transformers on its model). Every member's engine takes
``generation.vllm_gpu_memory_utilization`` of its GPU: with several members on one GPU lower it so that they all
fit beside the training, or give each member its own GPU as a Ray actor (``pool.executor: ray``, ``pool.ray: {num_gpus: 1}``). Ray also gives each engine its own process; vLLM
does not promise several engines in one process (vllm-project/vllm#1676), which is what in-process members are.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from mmrl.core.losses import truncated_is_weights
from mmrl.device import DTYPES
from mmrl.seeding import request_seed
from pipelines.pool.protocol import RolloutRequest, WeightUpdate
from pipelines.pool.vlm_worker import VLMRolloutWorker
from pipelines.pool.weights import make_update
from pipelines.vlm import vllm_backend
from pipelines.vlm.backend import GenerationSample, SamplingParams

if TYPE_CHECKING:
    from mmrl.data.vqa import VQAExample
    from mmrl.vlm.trainer import VLMRLVRTrainer

__all__ = ["PoolStepInfo", "PooledVLMRollouts", "PooledVLMWorker"]

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


@dataclass
class PoolStepInfo:
    """What the last consumed step looked like (tests and debugging).

    Attributes:
        sample_lags: ``[N]`` weight versions each sample lags behind the trainer, in the order of the pairs.
        request_ids: the delivered requests, in delivery order (carried ones first).
        carried_ids: the requests left unfinished and carried into the next step.
    """

    sample_lags: torch.Tensor
    request_ids: list[str]
    carried_ids: list[str]


class PooledVLMRollouts:
    """Drives a :class:`RolloutPool` for a :class:`~mmrl.vlm.trainer.VLMRLVRTrainer`; see the module docstring.

    Built at the end of the trainer's ``setup()`` (after a resume), so version 0 is the weights held then.

    Raises:
        ValueError: ``pool.overprovision`` asks for more prompts per step than the train set has, or bad
            ``pool.ray`` options.
    """

    def __init__(self, trainer: VLMRLVRTrainer) -> None:
        self.trainer = trainer
        cfg = trainer.cfg
        p = self.settings = cfg.pool
        t = cfg.trainer
        self.start_step = trainer.step
        self.last_step = t.steps - 1 - self.start_step  # the pool step of the last training step
        self.submitted = 0  # next pool step whose requests are to be made
        self.pending: dict[str, RolloutRequest] = {}  # submitted, not delivered yet
        self.step_of: dict[str, int] = {}  # pool step each pending request is delivered at
        self.lags = torch.zeros(0, dtype=torch.long)  # [N] per sample of the step being trained
        self.last: PoolStepInfo | None = None
        self.target_samples = cfg.rollouts_per_step
        self.in_flight = math.ceil(
            cfg.allocation.prompts_per_step * (1 + p.overprovision)
        )  # prompts per step, carried + new
        if self.in_flight > len(trainer.train_set):
            raise ValueError(
                f"pool.overprovision={p.overprovision} keeps {self.in_flight} prompts per step in flight, more than "
                f"the {len(trainer.train_set)} train examples; lower it or allocation.prompts_per_step"
            )
        g = cfg.generation
        params = SamplingParams(
            temperature=g.temperature,
            top_p=g.top_p if g.temperature > 0 else 1.0,
            max_new_tokens=g.max_new_tokens,
        )
        # the LoRA (even untrained: the worker then runs the trainer's module structure) or resumed weights
        initial = (
            make_update(trainer.model, version=0) if cfg.model.lora is not None or trainer.step > 0 else None
        )
        if g.backend == "vllm":
            if (
                p.executor == "inprocess"
            ):  # fail here, naming the extra, not later in a member's thread (a Ray
                vllm_backend.import_vllm()  # driver may lack the GPU and vLLM its actors have)
            # the engine arguments of the trainer's own engine (VLMRLVRTrainer._make_backend); a member never
            # sleeps (it generates while the trainer trains), so sleep mode is off
            engine = dict(
                max_model_len=g.max_model_len or 4096,
                max_prompt_length=g.max_prompt_length,
                gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                max_images_per_prompt=g.vllm_max_images_per_prompt,
                quantization="fp8" if g.vllm_fp8 else None,
                dtype=cfg.model.dtype,
                seed=cfg.run.seed,
                enable_sleep_mode=False,
            )
        else:
            engine = dict(
                device=p.device if p.device is not None else str(trainer.device),
                max_model_len=g.max_model_len,
                max_prompt_length=g.max_prompt_length,
                batch_size=g.batch_size,
            )
        factory = functools.partial(
            PooledVLMWorker.build,
            cfg.model.path,
            params,
            initial,
            g.backend,
            torch_dtype=DTYPES[cfg.model.dtype],
            **engine,
        )
        self.pool = p.build_pool(factory)

    # ------------------------------------------------------------------ requests
    def make_requests(self, pool_step: int) -> list[RolloutRequest]:
        """The new requests of ``pool_step``: enough prompts to keep ``in_flight`` prompts in the step (those
        carried into it count), none already carried into it."""
        t = self.trainer
        p = self.settings
        step = self.start_step + pool_step
        carried = [r for rid, r in self.pending.items() if self.step_of[rid] == pool_step]
        exclude = frozenset(pid for r in carried for pid in r.prompt_ids)
        wanted = self.in_flight - sum(len(r.prompts) for r in carried)
        chosen, counts = t.choose_prompts(wanted, exclude) if wanted > 0 else ([], [])
        n = len(chosen)
        if n == 0:  # what was carried in already fills the step
            return []
        if p.prompts_per_request is not None:
            chunks = [
                list(range(i, min(i + p.prompts_per_request, n))) for i in range(0, n, p.prompts_per_request)
            ]
        else:
            chunks = [rows.tolist() for rows in torch.arange(n).tensor_split(min(p.num_workers, n))]
        requests = []
        for i, rows in enumerate(chunks):
            # by count, as the in-loop path generates (one generate per count, counts ascending)
            rows = sorted(rows, key=lambda r: counts[r])
            examples = [t.by_id[chosen[r]] for r in rows]
            requests.append(
                RolloutRequest(
                    request_id=f"step{step}-{i}",
                    prompt_ids=[ex.prompt_id for ex in examples],
                    prompts=[t._prompt(ex) for ex in examples],
                    counts=[counts[r] for r in rows],
                    seed=request_seed(t.cfg.run.seed, 0, step, i),
                    metadata=[{"ground_truth": ex.answer} for ex in examples],
                )
            )
        return requests

    def _submit_through(self, pool_step: int) -> None:
        while self.submitted <= min(pool_step, self.last_step):
            requests = self.make_requests(self.submitted)
            self.pool.submit(requests, step=self.submitted)
            for r in requests:
                self.pending[r.request_id] = r
                self.step_of[r.request_id] = self.submitted
            self.submitted += 1

    def submit_ahead(self) -> None:
        """Queue the requests of the steps up to ``k + max_staleness`` (called once step ``k`` is scored)."""
        self._submit_through(self.trainer.step - self.start_step + self.settings.max_staleness)

    # ------------------------------------------------------------------ one step
    def collect(self) -> list[tuple[VQAExample, GenerationSample]]:
        """Steps 1-3 of the module docstring: the ``(example, sample)`` pairs of the trainer's current step."""
        t = self.trainer
        k = t.step - self.start_step
        start = time.perf_counter()
        if self.pool.version < k:
            self.pool.broadcast(make_update(t.model, version=k))
        self._submit_through(k)
        partial = self.target_samples if self.settings.overprovision > 0 else None
        batch = self.pool.collect(k, min_samples=partial)
        t.metrics.add("time/wait_s", time.perf_counter() - start)  # time the trainer waited for samples
        t.metrics.add("time/generate_s", sum(r.seconds for r in batch.results))
        pairs: list[tuple[VQAExample, GenerationSample]] = []
        skipped = 0
        for result in batch.results:
            request = self.pending.pop(result.request_id)
            del self.step_of[result.request_id]
            for s in result.output.samples:
                pairs.append((t.by_id[request.prompt_ids[s.prompt_index]], s))
            for s in result.output.skipped:
                logger.warning("skipped prompt %s: %s", s.prompt_id, s.reason)
            skipped += len(result.output.skipped)
        t.metrics.add("gen/skipped", float(skipped))
        carried = [rid for rid, step in self.step_of.items() if step == k]
        for rid in carried:  # the pool delivers them first at the next step
            self.step_of[rid] = k + 1
        self.lags = batch.sample_lags()
        t.metrics.add("pool/lag_mean", self.lags.float().mean(), count=self.lags.numel())
        t.metrics.add("pool/lag_max", float(self.lags.max()))
        t.metrics.add("pool/samples", float(batch.num_samples))
        t.metrics.add("pool/carried", float(sum(self.pending[rid].num_samples for rid in carried)))
        self.last = PoolStepInfo(self.lags, [r.request_id for r in batch.results], carried)
        return pairs

    def tis_weights(
        self, old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor | None:
        """``[B, T]`` truncated importance weights of minibatch ``rows`` (indices into the step's pairs): the
        trainer's TIS (``trainer.tis_mode``) with cap ``pool.tis_cap`` on samples with lag > 0; the trainer's
        engine TIS (``trainer.tis``) or 1 on lag-0 samples. ``None`` when no token is weighted."""
        t = self.trainer
        c = t.cfg.trainer
        engine = None
        if t.uses_tis:
            engine = truncated_is_weights(old_logp, behaviour_logp, cap=c.tis_cap, mode=c.tis_mode, mask=mask)
        stale = (self.lags[rows.cpu()] > 0).to(old_logp.device)
        if not bool(stale.any()):
            return engine
        cap = self.settings.tis_cap
        weights = truncated_is_weights(old_logp, behaviour_logp, cap=cap, mode=c.tis_mode, mask=mask)
        tokens = mask.bool() & stale[:, None]
        t.metrics.add(
            "tis/clipped_frac", ((weights >= cap) & tokens).sum() / tokens.sum(), count=int(tokens.sum())
        )
        lag0 = engine if engine is not None else mask.to(weights.dtype)
        return torch.where(stale[:, None], weights, lag0)

    def close(self) -> None:
        self.pool.close()
