"""RLVR for vision-language models (``recipe: vlm_rlvr``): single-rollout entropy-shaped, or group GRPO family.

Lifecycle: ``VLMRLVRTrainer(cfg, run)`` -> ``setup()`` -> ``train()`` -> ``cleanup()``; ``main(cfg)`` does all four.
One training step:

1. pick prompts: ``single`` mode selects them from the statistics store (uniform / Thompson / priority) and
   rolls out once each; ``group`` mode gives each prompt a group (sizes from the core's allocator);
2. generate with behaviour log-probs (transformers or vLLM), verify the answers (rewards/);
3. advantages: ``single`` (MSSR / SPO): ``A = r - V(x)`` with ``V`` the store's value (expected reward) *before*
   this batch, scaled by the batch std; ``group``: GRPO / Dr.GRPO / RLOO / MC-GRPO (pivot excluded), optional DAPO
   dynamic sampling; with ``trainer.process_credit`` plus per-token advantages from a reward's scores of each
   stated step (``mmrl/vlm/process_credit.py``); then entropy shaping per token ``A_t + min(alpha H_t, |A_t| /
   kappa)``;
4. clipped surrogate (clip-higher, dual clip), k3 KL to the reference (adapter disabled), truncated importance
   weights when the rollout engine is not the trainer or samples a top-p nucleus, aggregated per ``loss_agg``
   over each of the step's ``trainer.updates_per_step`` parts (each minibatch weighted by its share), one
   optimizer step per part.

With ``pool.enabled`` steps 1-2 take the trainer's prompts through a rollout pool (``mmrl/vlm/pooled.py``):
synchronous or asynchronous, with APRIL partial rollouts, stale samples weighted by truncated importance sampling.

Data-parallel (``mmrl/distributed.py``): each rank rolls out its own prompts. With ``configs/accelerate/ddp.yaml``
every rank holds the whole model and the gradients are averaged; with ``configs/accelerate/fsdp.yaml`` (full
fine-tuning, ``model.lora=null``) the model is FSDP2-sharded, every forward is a collective, and the trainer keeps
every rank's sequence of forwards equal: generation with ``synced_gpus``, only settings with the same number of
generated samples per rank (:meth:`VLMRLVRTrainer._check_fsdp`), as many LM-head chunks on every rank, and as many
update minibatches (padding ones, whose loss counts 0, for a rank that kept fewer samples).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

import rewards as reward_registry
from mmrl.checkpoint import load_checkpoint, load_trainable
from mmrl.core import advantages as adv_lib
from mmrl.core import allocation as alloc_lib
from mmrl.core import losses as loss_lib
from mmrl.core.estimators import RewardBatch, get_estimator
from mmrl.core.groups import effective_ratio, groups_in_band, varied_groups
from mmrl.core.stats import PromptStats
from mmrl.data.vqa import VQAExample, check_answers, load_vqa
from mmrl.device import DTYPES
from mmrl.distributed import (
    all_reduce_sum,
    broadcast_params,
    full_state_dict,
    load_optimizer_state,
    optimizer_state,
    shard_model,
)
from mmrl.loop import run_recipe
from mmrl.optim import make_optimizer
from mmrl.rollouts import StepRequest
from mmrl.run import write_summary_json
from mmrl.schedule import learning_rate
from mmrl.seeding import EVAL_SEED
from mmrl.trainer_base import TrainerBase
from mmrl.vlm.config import VLMModelConfig, VLMRLVRConfig, VLMTrainerConfig
from mmrl.vlm.pooled import PooledVLMSource, pooled_worker_factory
from mmrl.vlm.process_credit import process_advantages
from mmrl.vlm.rollouts import LoopVLMSource, VLMPairs
from pipelines.pool.protocol import WeightUpdate
from pipelines.pool.weights import make_update
from pipelines.vlm.backend import GenerationBackend, GenerationSample
from pipelines.vlm.families import VLMFamily
from pipelines.vlm.inputs import VLMPrompt
from pipelines.vlm.logprobs import TokenStats, backbone_and_head, build_scoring_batch, completion_token_stats
from rewards.base import RewardOutput, checked_score

__all__ = ["VLMRLVRTrainer", "evaluate", "load_examples", "main"]

logger = logging.getLogger(__name__)


class VLMRLVRTrainer(TrainerBase):
    """Single-rollout or group RLVR for a transformers VLM, with the core's baseline, selection and losses."""

    show = ("reward/mean", "eval/reward_mean")

    @functools.cached_property
    def family(self) -> VLMFamily:
        """The model family's conventions (prompt layout, vision tokens and tower): ``model.family``, or the family
        serving the checkpoint's ``model_type`` (read from its config, so prompts can be built before setup)."""
        return self.cfg.model.resolve_family()

    # ------------------------------------------------------------------ setup
    def setup(self, for_training: bool = True) -> None:
        """The lifecycle's setup: the model (and its reference), the rollout engine, the verifiers, the
        held-out sets; for training also the training set, the optimizer, the per-prompt statistics (resumed
        from the latest checkpoint) and the rollout source."""
        model_cfg = self.cfg.model
        # one process per GPU under `accelerate launch` (mmrl/distributed.py): each rank rolls out its own prompts
        self.setup_runtime(model_cfg.device)
        if for_training:  # before minutes of loading: do the weights and training state fit at all?
            from mmrl.vlm.memory import estimate_memory

            self.check_memory(estimate_memory)
        if self.dist.fsdp:
            self._check_fsdp()
        self._setup_model(for_training)
        self.backend = self._make_backend()
        verifiers = self._setup_rewards()
        self._setup_eval_data(verifiers)
        if not for_training:
            return
        self._setup_train_data(verifiers)
        self._setup_training_state()

    def _setup_model(self, for_training: bool) -> None:
        """The policy loaded as users load it, made trainable (LoRA or full), sharded under FSDP; the frozen
        reference of a full fine-tune with a KL term."""
        cfg = self.cfg
        model_cfg = cfg.model
        self.processor, model = self.load_model()
        self.reference = None
        if model_cfg.lora is None and cfg.trainer.beta > 0 and for_training:
            # the start weights in model.dtype (before the trained ones become master weights), whole (unsharded)
            self.reference = copy.deepcopy(model).requires_grad_(False).eval()
        model = make_trainable(model, model_cfg, self.family)
        if model_cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        compute = model_cfg.compute_dtype()
        self.compute_dtype = DTYPES[compute] if compute else None
        if self.dist.fsdp:
            if self.reference is not None:
                shard_model(
                    self.reference,
                    self.dist.reshard_after_forward,
                    extra=_fsdp_units(self.reference, self.family),
                )
            # generate() runs the units itself: wrapped, its call is the root's forward (the policy's first call);
            # master weights wider than model.dtype are gathered in model.dtype
            shard_model(
                model,
                self.dist.reshard_after_forward,
                extra=_fsdp_units(model, self.family),
                methods=("generate",),
                param_dtype=self.compute_dtype,
            )
        self.model = model
        self.trainable = [p for p in model.parameters() if p.requires_grad]  # DTensor shards under FSDP
        if not self.dist.fsdp:  # (sharded weights come from the same checkpoint on every rank)
            broadcast_params(
                self.trainable, self.dist.world_size
            )  # a LoRA's random init differs per rank's seed

    def _setup_rewards(self) -> list[tuple[str, Any]]:
        """The training and evaluation verifiers; returns ``(key, reward)`` of each, to check the data's answers."""
        cfg = self.cfg
        self.rewards = [reward_registry.build(spec.name, **spec.options) for spec in cfg.rewards]
        self.reward_weights = torch.tensor([spec.weight for spec in cfg.rewards], dtype=torch.float32)
        self.eval_rewards = [reward_registry.build(spec.name, **spec.options) for spec in cfg.eval_rewards]
        credited = cfg.trainer.process_credit.reward
        for spec, reward in zip(cfg.rewards, self.rewards, strict=True):
            if spec.key == credited and not reward.scores_steps:
                raise ValueError(
                    f"trainer.process_credit.reward={credited!r}: reward {spec.name!r} scores whole completions, "
                    "not their steps (use a reward with step scores, e.g. reasoning_steps)"
                )
        return [
            (spec.key, reward)
            for spec, reward in zip(
                [*cfg.rewards, *cfg.eval_rewards], [*self.rewards, *self.eval_rewards], strict=True
            )
        ]

    def _setup_eval_data(self, verifiers: list[tuple[str, Any]]) -> None:
        """The held-out set and every ``data.extra_eval`` set, each answer checked by the verifiers."""
        cfg = self.cfg
        data = cfg.data
        self.eval_set = load_examples(cfg, "eval")
        check_answers(self.eval_set, verifiers, data.eval)
        self.extra_eval_sets = {
            name: load_examples(cfg, "eval", source) for name, source in data.extra_eval.items()
        }
        for name, examples in self.extra_eval_sets.items():
            check_answers(examples, verifiers, data.extra_eval[name])

    def _setup_train_data(self, verifiers: list[tuple[str, Any]]) -> None:
        """The training set, its answers checked, with unique prompt ids, enough questions per step, and the
        question kinds that grouping by kind needs."""
        cfg = self.cfg
        data = cfg.data
        self.train_set = load_examples(cfg, "train")
        check_answers(self.train_set, verifiers, data.train)
        self.by_id = {ex.prompt_id: ex for ex in self.train_set}
        if len(self.by_id) != len(self.train_set):
            raise ValueError(
                f"{data.train}: prompt ids are not unique; set data.id_column to a unique column"
            )
        if self.dist.fsdp and len({bool(ex.images) for ex in self.train_set}) > 1:
            # a batch with images runs the vision tower's sharded blocks (collectives), one without does not
            raise ValueError(
                f"FSDP launch (configs/accelerate/fsdp.yaml): some questions of {data.train} have images and some "
                "do not, so one rank's batch could run the sharded vision tower while another's does not; use "
                "data where every question has an image (or none does), or launch with configs/accelerate/ddp.yaml"
            )
        if cfg.allocation.prompts_per_step > len(self.train_set):
            raise ValueError(
                f"allocation.prompts_per_step ({cfg.allocation.prompts_per_step}) exceeds the {len(self.train_set)} "
                "train examples"
            )
        by_kind = [
            key
            for key, value in (
                ("allocation.prior_groups", cfg.allocation.prior_groups),
                ("trainer.process_credit.single_groups", cfg.trainer.process_credit.single_groups),
            )
            if value == "kind"
        ]
        if by_kind and not any(ex.kind for ex in self.train_set):
            raise ValueError(
                f"{', '.join(by_kind)}: kind groups questions by their kind, and the questions of {data.train} "
                "have none (the generated shapes worlds give each its template); set it back to its default"
            )

    def _setup_training_state(self) -> None:
        """Optimizer, per-prompt statistics (resumed from the latest checkpoint) and the rollout source; a pool
        starts from the weights held after the resume."""
        cfg = self.cfg
        if not self.trainable:
            raise ValueError("no trainable parameters: check model.lora.target_modules")
        self.optimizer = make_optimizer(
            self.trainable, cfg.trainer.optimizer, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay
        )
        kinds = (
            {ex.prompt_id: ex.kind for ex in self.train_set}
            if cfg.allocation.prior_groups == "kind"
            else None
        )
        self.stats = PromptStats(
            rho=cfg.allocation.rho, prior_strength=cfg.allocation.prior_strength, prior_groups=kinds
        )
        self.resume()
        if cfg.pool.enabled:
            self.rollout_source = self._make_pooled_source()
        else:
            self.rollout_source = LoopVLMSource(
                self.plan, self._generate_ids, cfg.allocation.prompts_per_step
            )

    def load_model(self) -> tuple[Any, torch.nn.Module]:
        """``(processor, model)`` of ``model.path``, loaded as users load it (``from_pretrained``) in ``model.dtype``
        on the device, NF4 through bitsandbytes with ``model.load_in_4bit``. A subclass may build them otherwise
        (benchmarks/real_size.py: the published architecture with random weights)."""
        from pipelines.vlm.hf_backend import load_vlm

        model_cfg = self.cfg.model
        kwargs: dict[str, Any] = {"dtype": DTYPES[model_cfg.dtype]}
        if model_cfg.load_in_4bit:
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPES[model_cfg.dtype]
            )
        processor, model = load_vlm(model_cfg.path, **kwargs)
        if not model_cfg.load_in_4bit:
            model.to(self.device)
        return processor, model

    def _make_pooled_source(self) -> PooledVLMSource:
        """The pool source, its members started from the weights held now (version 0)."""
        cfg = self.cfg
        # the LoRA (even untrained: the worker then runs the trainer's module structure) or resumed weights
        initial = make_update(self.model, version=0) if cfg.model.lora is not None or self.step > 0 else None
        worker = pooled_worker_factory(
            cfg.model, cfg.generation, cfg.pool, initial, str(self.device), cfg.run.seed
        )
        return PooledVLMSource(
            cfg.pool,
            worker,
            plan=self.plan,
            prompts_per_step=cfg.allocation.prompts_per_step,
            samples_per_step=cfg.rollouts_per_step,
            num_prompts=len(self.train_set),
            first_step=self.step,
            num_steps=cfg.trainer.steps - self.step,
            seed=cfg.run.seed,
            rank=self.rank,
            weights=self.weight_update,
            metrics=self.metrics,
        )

    def weight_update(self, version: int) -> WeightUpdate:
        """The policy's weights as the pool's weight ``version`` (LoRA-only with a frozen base)."""
        return make_update(self.model, version=version)

    def _make_backend(self) -> GenerationBackend:
        g = self.cfg.generation
        # with a pool the members generate the rollouts; the trainer's backend only evaluates, and an engine of
        # its own would hold generation.vllm_gpu_memory_utilization of the training GPU for that
        if g.backend == "vllm" and not self.cfg.pool.enabled:
            from pipelines.vlm.vllm_backend import VLLMBackend

            return VLLMBackend(
                self.cfg.model.path,
                self.processor,
                **g.vllm_engine_options(),
                dtype=self.cfg.model.dtype,
                seed=self.cfg.run.seed,
                family=self.family,
            )
        from pipelines.vlm.hf_backend import HFBackend

        # a sharded model's every forward is a collective: ranks step generate() together until all are done
        return HFBackend(
            self.model,
            self.processor,
            **g.hf_backend_options(),
            synced_gpus=self.dist.fsdp,
            family=self.family,
            autocast_dtype=self.compute_dtype,
        )

    def _check_fsdp(self) -> None:
        """FSDP shards the model, so every forward is a collective: only settings under which every rank makes
        the same sequence of generation forwards (and nothing needs whole weights mid-step) are accepted. (The
        update pads each rank's minibatches to the most any rank has: :meth:`_padding_minibatches`.)"""
        cfg, refused = self.cfg, []
        t, g = cfg.trainer, cfg.generation
        if cfg.model.lora is not None:
            refused.append(
                "LoRA (model.lora): the trainable state is small and sharding the frozen base only adds "
                "all-gathers; launch with configs/accelerate/ddp.yaml (or set model.lora=null)"
            )
        if cfg.model.load_in_4bit:
            refused.append("model.load_in_4bit: bitsandbytes' 4-bit weights are not sharded by FSDP")
        if cfg.pool.enabled:
            refused.append("pool.enabled: pool workers receive whole weights")
        if g.backend == "vllm":
            refused.append(
                "generation.backend=vllm: the engine loads whole weights; use generation.backend=hf"
            )
        if g.max_prompt_length is not None or g.max_model_len is not None:
            refused.append(
                "generation.max_prompt_length / generation.max_model_len: a prompt that does not fit is "
                "skipped, leaving its rank fewer samples"
            )
        if t.mode == "group" and cfg.allocation.method != "uniform":
            refused.append(
                f"allocation.method={cfg.allocation.method}: per-rank group sizes, so a per-rank number of "
                "generate calls"
            )
        if refused:
            raise ValueError(
                "FSDP launch (configs/accelerate/fsdp.yaml) of the VLM trainer does not support: "
                + "; ".join(refused)
            )

    @property
    def uses_tis(self) -> bool:
        """Whether lag-0 samples get the engine TIS weight ``min(pi_old / pi_behaviour, trainer.tis_cap)``:
        ``trainer.tis: on``, or ``auto`` when the behaviour log-probs differ from the trainer's by design: another
        engine (vLLM: its kernels, FP8) or ``generation.top_p < 1`` (sampled from the truncated nucleus,
        :mod:`pipelines.vlm.backend`)."""
        generation = self.cfg.generation
        mode = self.cfg.trainer.tis
        return mode == "on" or (mode == "auto" and (generation.backend != "hf" or generation.top_p < 1))

    # ------------------------------------------------------------------ helpers
    def _prompt(self, ex: VQAExample) -> VLMPrompt:
        return self.family.prompt(
            ex.question, ex.images, system=self.cfg.data.system_prompt, prompt_id=ex.prompt_id
        )

    def generate(
        self, examples: list[VQAExample], n: int, temperature: float, top_p: float, seed: int | None = None
    ) -> list[tuple[VQAExample, GenerationSample]]:
        """``n`` samples of each question; ``seed`` None: one drawn from the training generator (rollouts)."""
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        params = self.cfg.generation.sampling(temperature, top_p, n=n, seed=seed)
        result = self.backend.generate([self._prompt(ex) for ex in examples], params)
        for skipped in result.skipped:
            logger.warning("skipped prompt %s: %s", skipped.prompt_id, skipped.reason)
        return [(examples[s.prompt_index], s) for s in result.samples]

    def verify(self, pairs: list[tuple[VQAExample, GenerationSample]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([N] weighted reward, [N, K] per verifier)``; a verifier that raises or returns a non-finite score
        stops the run with its name (:class:`rewards.base.RewardCheckError`)."""
        total, raw, _ = self.score_samples(pairs)
        return total, raw

    def score_samples(
        self, pairs: list[tuple[VQAExample, GenerationSample]]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, RewardOutput]]:
        """:meth:`verify`, and each verifier's whole output by its key (the step scores process credit reads)."""
        outputs = self._score_with(self.cfg.rewards, self.rewards, pairs)
        raw = torch.stack([out.scores.detach().float().cpu() for out in outputs.values()], dim=1)
        return raw @ self.reward_weights, raw, outputs

    def _score_with(
        self, specs: list[Any], rewards: list[Any], pairs: list[tuple[VQAExample, GenerationSample]]
    ) -> dict[str, RewardOutput]:
        """Each reward's checked output (:func:`rewards.base.checked_score`) on ``pairs``, by its spec's key."""
        batch = self._reward_batch(pairs)
        return {
            spec.key: checked_score(reward, spec.key, len(pairs), **batch)
            for spec, reward in zip(specs, rewards, strict=True)
        }

    @staticmethod
    def _reward_batch(pairs: list[tuple[VQAExample, GenerationSample]]) -> dict[str, list[str]]:
        """What a verifier reads of each sample: its completion, the ground truth and the reference solution."""
        return {
            "completions": [s.text for _, s in pairs],
            "ground_truths": [ex.answer for ex, _ in pairs],
            "references": [ex.reference for ex, _ in pairs],
        }

    def token_stats(
        self,
        pairs: list[tuple[VQAExample, GenerationSample]],
        temperature: float,
        model: torch.nn.Module | None = None,
    ) -> TokenStats:
        """Token log-probs and entropies of ``pairs`` under ``model`` (default: the policy)."""
        batch = build_scoring_batch(
            self.processor,
            [s.prompt_token_ids for _, s in pairs],
            [s.completion_token_ids for _, s in pairs],
            [ex.images for ex, _ in pairs],
            family=self.family,
        )
        suppressed = getattr(self.backend, "suppressed_token_ids", ())
        chunk_size = self.cfg.trainer.logprob_chunk_size
        min_chunks = 0
        if (
            self.dist.fsdp
        ):  # each call of the sharded LM head is a collective: the longest rank's number of chunks
            min_chunks = self.dist.max_over_ranks(math.ceil(batch.completion_ids.shape[1] / chunk_size))
        with self.compute_context():
            return completion_token_stats(
                model or self.model,
                batch,
                temperature=temperature,
                chunk_size=chunk_size,
                suppressed_token_ids=suppressed,
                min_chunks=min_chunks,
                share_prompts=not self.dist.fsdp,
                family=self.family,
            )

    def compute_context(self) -> AbstractContextManager[Any]:
        """Where the policy and its reference compute: under ``torch.autocast`` in ``model.dtype`` when the
        trained parameters are wider master weights (``model.compute_dtype()``), else in the weights' dtypes."""
        if self.compute_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def reference_context(self) -> AbstractContextManager[Any]:
        """Where the policy's forward is the reference's: the adapter disabled (LoRA), else nothing (a full
        fine-tune scores with the separate ``self.reference``)."""
        if self.cfg.model.lora is not None:
            return self.model.disable_adapter()
        return nullcontext()

    # ------------------------------------------------------------------ one step
    def choose_prompts(self, k: int, exclude: frozenset[str] = frozenset()) -> tuple[list[str], list[int]]:
        """Step 1: ``k`` prompt ids (not in ``exclude``) and the rollouts of each (single: 1; group: the allocator's
        split of ``k`` prompts' share of the step budget)."""
        a = self.cfg.allocation
        ids = [ex.prompt_id for ex in self.train_set if ex.prompt_id not in exclude]
        chosen = self.select_prompts(ids, k)
        if self.cfg.trainer.mode == "single":
            return chosen, [1] * len(chosen)
        budget = self.cfg.rollouts_per_step * len(chosen) // a.prompts_per_step
        counts = alloc_lib.allocate(self.stats, chosen, budget, method=a.method, n_min=a.n_min, n_max=a.n_max)
        return chosen, counts.tolist()

    def plan(self, step: int, num_prompts: int, exclude: frozenset[str] = frozenset()) -> StepRequest:
        """Step 1 for a rollout source: :meth:`choose_prompts`, with each prompt's chat input and ground truth."""
        chosen, counts = self.choose_prompts(num_prompts, exclude)
        examples = [self.by_id[pid] for pid in chosen]
        return StepRequest(
            step,
            chosen,
            [self._prompt(ex) for ex in examples],
            counts,
            metadata=[{"ground_truth": ex.answer} for ex in examples],
        )

    def _generate_ids(self, prompt_ids: list[str], n: int) -> VLMPairs:
        """``n`` training samples of each prompt of ``prompt_ids`` (the loop source's generation)."""
        examples = [self.by_id[pid] for pid in prompt_ids]
        g = self.cfg.generation
        return [(ex.prompt_id, s) for ex, s in self.generate(examples, n, g.temperature, g.top_p)]

    def collect(self) -> StepSamples:
        """Steps 1-3: the step's samples, their advantages and rewards, and which of them enter the loss
        (:class:`StepSamples`).

        With DAPO's dynamic sampling and ``trainer.dynamic_sampling_rounds`` R > 1, the step generates up to R
        rounds of ``allocation.prompts_per_step`` prompts until that many groups whose rewards vary are kept
        (verl's ``max_num_gen_batches``); the groups kept beyond it are dropped, in generation order.

        Raises:
            ValueError: every prompt of the step was skipped as too long (:meth:`_no_samples_error`).
        """
        settings = self.cfg.trainer
        refill = settings.mode == "group" and settings.dynamic_sampling
        target = self.cfg.allocation.prompts_per_step
        rounds: list[_Round] = []
        kept_groups = 0
        max_rounds = settings.dynamic_sampling_rounds if refill else 1
        for _ in range(max_rounds):
            rounds.append(self._collect_round())
            kept_groups += rounds[-1].group_ids[rounds[-1].keep].unique().numel()
            # every rank takes as many rounds (each updates the statistics store, a collective under DDP)
            if max_rounds == 1 or not self.dist.max_over_ranks(int(kept_groups < target)):
                break
        # a vLLM engine hands its memory to the update until sync_weights wakes it (transformers: nothing to free)
        self.backend.sleep()
        pairs = [pair for part in rounds for pair in part.pairs]
        width = max((part.adv.shape[1] for part in rounds if part.adv.ndim == 2), default=0)
        adv = torch.cat([_token_width(part.adv, width) if width else part.adv for part in rounds])
        keep = torch.cat([part.keep for part in rounds])
        lags = torch.cat([part.lags for part in rounds])
        total = torch.cat([part.total for part in rounds])
        raw = torch.cat([part.raw for part in rounds])
        self.metrics.add("gen/skipped", float(sum(part.skipped for part in rounds)))
        if refill:
            group_ids, offset = [], 0  # each round's groups after the last round's
            for part in rounds:
                group_ids.append(part.group_ids + offset)
                offset += int(part.group_ids.max()) + 1
            all_groups = torch.cat(group_ids)
            surplus = all_groups[keep].unique()[target:]  # (group indices grow in generation order)
            keep &= ~torch.isin(all_groups, surplus)
            self.metrics.add("dynamic_sampling/rounds", float(len(rounds)))
            self.metrics.add("dynamic_sampling/kept_groups", float(min(kept_groups, target)))
        self.rollout_source.prefetch(self.step)  # later steps' requests, chosen with this step's statistics
        return StepSamples(pairs, adv, keep, lags, total, raw)

    def _collect_round(self) -> _Round:
        """One generation round of :meth:`collect`, the statistics store updated with its rewards."""
        settings = self.cfg.trainer
        source = self.rollout_source.collect(self.step)
        if not source.output:
            raise self._no_samples_error(source.info["skipped"])
        pairs = [(self.by_id[pid], sample) for pid, sample in source.output]
        total, raw, outputs = self.score_samples(pairs)
        pids = [ex.prompt_id for ex, _ in pairs]
        group_ids = torch.tensor(_group_index(pids))
        estimator = get_estimator(self.cfg.estimator_name)
        baseline = self.stats.value(pids).float() if estimator.needs_baseline else None  # V(x) before
        self.stats.update_distributed(pids, total, step=self.step)
        # under data parallelism the batch statistics (global_std's std, gdpo's whitening, single's scale) are
        # those of every rank's rewards: a collective, next to the store's
        sum_over_ranks = all_reduce_sum if self.dist.active else None
        batch = RewardBatch(
            total, group_ids, raw, self.reward_weights, baseline, sum_over_ranks=sum_over_ranks
        )
        result = estimator.fn(batch, **settings.advantage_options)
        adv, keep = result.adv, result.keep_mask()
        if baseline is not None:
            self.metrics.add("baseline/mean", baseline.mean())
        if settings.mode == "group":
            self.metrics.add("train/effective_ratio", effective_ratio(total, group_ids))
            if settings.dynamic_sampling:
                keep &= self._dynamic_sampling_groups(total, raw, group_ids, estimator.multi_reward)
        self.metrics.add("reward/mean", total.mean(), count=len(pairs))
        for k, spec in enumerate(self.cfg.rewards):
            self.metrics.add(f"reward/{spec.key}/mean", raw[:, k].mean(), count=len(pairs))
        lengths = torch.tensor([len(s.completion_token_ids) for _, s in pairs], dtype=torch.float32)
        self.metrics.add("gen/length_mean", lengths.mean())
        self.metrics.add(
            "gen/truncated_frac", sum(s.finish_reason == "length" for _, s in pairs) / len(pairs)
        )
        self.metrics.add("adv/mean", adv.mean())
        self.metrics.add("adv/std", adv.std(correction=0))
        if settings.process_credit.reward is not None:
            adv = self._add_process_credit(pairs, adv, outputs[settings.process_credit.reward], group_ids)
        return _Round(pairs, adv, keep, source.sample_lags, group_ids, total, raw, source.info["skipped"])

    def _dynamic_sampling_groups(
        self, total: torch.Tensor, raw: torch.Tensor, group_ids: torch.Tensor, multi_reward: bool
    ) -> torch.Tensor:
        """``[N]`` bool: the samples of the groups DAPO's dynamic sampling keeps, whole. The scores are the reward
        ``trainer.dynamic_sampling_key`` names, else the weighted sum ``total [N]`` (GDPO, without a band: every
        reward of ``raw [N, K]``, since it learns from a group where any one of them varies, even if their sum
        does not); kept are the groups whose scores vary (DAPO), or whose mean lies inside
        ``trainer.dynamic_sampling_band`` (EasyR1's online filtering)."""
        settings = self.cfg.trainer
        band = settings.dynamic_sampling_band
        if settings.dynamic_sampling_key is not None:
            keys = [spec.key for spec in self.cfg.rewards]
            scores = raw[:, keys.index(settings.dynamic_sampling_key)]
        else:
            scores = raw if multi_reward and band is None else total
        if band is None:
            return varied_groups(scores, group_ids)
        return groups_in_band(scores, group_ids, *band)

    def _no_samples_error(self, skipped: int) -> ValueError:
        """The error of a step without a sample (nothing to verify, baseline or train on): all its ``skipped``
        prompts (each source counts them in its batch's ``info``, the pooled one carried requests included) were
        too long for the length settings it names. A step that keeps some prompts trains on them (each skip is
        logged, and the step's count is ``gen/skipped``); a step that keeps none stops the run rather than train
        nothing silently."""
        generation = self.cfg.generation
        limits = ", ".join(
            f"generation.{key} ({'null' if value is None else value})"
            for key, value in (
                ("max_prompt_length", generation.max_prompt_length),
                ("max_model_len", generation.max_model_len),
            )
        )
        return ValueError(
            f"{limits}: all {skipped} prompts of step {self.step} are too long for them (each one's length is in "
            "the warnings above); raise them or filter the data"
        )

    def _add_process_credit(
        self,
        pairs: list[tuple[VQAExample, GenerationSample]],
        adv: torch.Tensor,
        scored: RewardOutput,
        group_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``[N, T]`` token advantages: the sequence advantages ``adv [N]`` on every token plus
        ``process_credit.weight`` times the step advantages of :func:`mmrl.vlm.process_credit.process_advantages`
        (``T``: the longest completion)."""
        credit = self.cfg.trainer.process_credit
        width = max(len(s.completion_token_ids) for _, s in pairs)
        steps, metrics = process_advantages(
            getattr(self.processor, "tokenizer", self.processor),
            [(s.completion_token_ids, s.text) for _, s in pairs],
            scored.steps or [[] for _ in pairs],
            self._step_groups(pairs, group_ids),
            num_tokens=width,
            credit=credit.credit,
            normalize=credit.normalize,
        )
        self.metrics.add_dict(metrics)
        return adv[:, None] + credit.weight * steps

    def _step_groups(
        self, pairs: list[tuple[VQAExample, GenerationSample]], group_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """``[N]`` the groups whose steps process credit normalises together: the prompt groups (group mode), the
        question kinds (single, ``single_groups: kind``), or ``None``: the whole batch."""
        if self.cfg.trainer.mode == "group":
            return group_ids
        if self.cfg.trainer.process_credit.single_groups == "kind":
            return torch.tensor(_group_index([example.kind for example, _ in pairs]))
        return None

    def loss_weights(
        self, old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, lags: torch.Tensor
    ) -> torch.Tensor | None:
        """``[B, T]`` weights of the per-token loss terms, or ``None`` when no token is weighted: on samples with
        ``lags [B] > 0`` the truncated importance weight against their behaviour log-probs with cap
        ``pool.tis_cap`` (:func:`mmrl.core.losses.stale_sample_weights`), on lag-0 samples the engine TIS
        (``trainer.tis``: the rollout engine is not the trainer) or 1; per token or per sequence as
        ``trainer.tis_mode`` says."""
        t = self.cfg.trainer
        engine = None
        if self.uses_tis:
            engine = loss_lib.truncated_is_weights(
                old_logp, behaviour_logp, cap=t.tis_cap, mode=t.tis_mode, mask=mask
            )
        if not bool((lags > 0).any()):
            return engine
        cap = self.cfg.pool.tis_cap
        weights = loss_lib.stale_sample_weights(
            old_logp, behaviour_logp, lags, cap, mode=t.tis_mode, mask=mask, fresh=engine
        )
        tokens = mask.bool() & (lags > 0).to(mask.device)[:, None]
        self.metrics.add(
            "tis/clipped_frac", ((weights >= cap) & tokens).sum() / tokens.sum(), count=int(tokens.sum())
        )
        return weights

    def update(
        self,
        pairs: list[tuple[VQAExample, GenerationSample]],
        adv: torch.Tensor,
        keep: torch.Tensor,
        lags: torch.Tensor | None = None,
    ) -> None:
        """The step's updates on its samples: ``adv`` per sequence ``[N]`` or per token ``[N, T]`` (cut or padded
        to each minibatch's longest completion); ``lags [N]`` (default 0) are their weight lags.

        The kept rows are split into ``trainer.updates_per_step`` parts, each trained for ``trainer.ppo_epochs``
        with its own optimizer step. A part's loss is ``L = sum_k w_k L_k`` over its minibatches, ``L_k`` the
        minibatch's ``loss_agg`` aggregate and ``w_k`` its share of the part over every rank
        (:func:`_minibatch_shares`), so that the ranks' averaged gradient is that of the aggregate over all their
        part's rows, whatever ``trainer.minibatch_size`` cuts them into and however many rows each rank kept."""
        if lags is None:
            lags = torch.zeros(len(pairs), dtype=torch.long)
        settings = self.cfg.trainer
        temperature = self.cfg.generation.temperature
        rows = torch.nonzero(keep).flatten()
        # the kept rows in trainer.updates_per_step parts, each cut into minibatches and followed by its own
        # optimizer step (tensor_split: every rank makes as many optimizer steps; an empty part has no minibatch)
        parts = [
            [chunk for chunk in part.split(settings.minibatch_size) if chunk.numel()]
            for part in torch.tensor_split(rows, settings.updates_per_step)
        ]
        if rows.numel() == 0:
            self.metrics.add("train/skipped_no_signal", 1.0)
        if self.dist.max_over_ranks(rows.numel()) == 0:
            # no rank has a sample to learn from: no optimizer step (on zero gradients it would still move the
            # weights, by Adam's momentum and the weight decay); a rank with none while others have some takes
            # part in their steps
            self.backend.sync_weights(self.model)  # (the weights are unchanged; a sleeping engine wakes)
            return
        paddings = self._padding_minibatches(parts)
        lengths = torch.tensor([len(sample.completion_token_ids) for _, sample in pairs])
        counts = [[_normalizer_count(lengths[idx], settings.loss_agg) for idx in part] for part in parts]
        # part p of every rank ends in the same averaged optimizer step: its normaliser counts all ranks' rows, one
        # collective per step (a rank's own count would weigh its rows by how many others it kept)
        totals = self.dist.sum_over_ranks([sum(part_counts) for part_counts in counts])
        # Old-policy statistics (log-probs for the ratio, entropies for the shaping) are those of the first epoch's
        # gradient forward, detached: no optimizer step comes before it, so its weights are the old policy's
        # (TRL does the same at num_iterations=1). One forward per minibatch and epoch; the parts after the first
        # are trained after an update, so theirs come first, from a forward without gradients. With dropout on
        # (LoRA dropout > 0) the old statistics are a train-mode draw, as TRL's.
        self.model.train()
        old_stats: list[list[TokenStats | None]] = [[None] * len(part) for part in parts]
        padding_rows = rows[:1] if rows.numel() else torch.zeros(1, dtype=torch.long)  # any sample will do
        with torch.no_grad():
            for part, olds, padding in zip(parts[1:], old_stats[1:], paddings[1:], strict=True):
                olds[:] = [self.token_stats([pairs[i] for i in idx.tolist()], temperature) for idx in part]
                for _ in range(padding):
                    self.token_stats([pairs[i] for i in padding_rows.tolist()], temperature)
        for _ in range(settings.ppo_epochs):
            for part, olds, padding, part_counts, total in zip(
                parts, old_stats, paddings, counts, totals, strict=True
            ):
                shares = _minibatch_shares(part_counts, total, self.dist.world_size)
                for chunk, (idx, share) in enumerate(zip(part, shares, strict=True)):
                    olds[chunk] = self._train_minibatch(pairs, idx, adv, lags, olds[chunk], share)
                with self.metrics.discarded():
                    for _ in range(padding):
                        self._train_minibatch(pairs, padding_rows, adv, lags, None, share=0.0)
                # a function of the training step, so a resumed run continues a cosine exactly
                lr = learning_rate(self.step, settings.lr, settings.steps, schedule=settings.lr_schedule)
                self.optimizer_step(self.optimizer, self.trainable, settings.max_grad_norm, lr=lr)
        self.backend.sync_weights(self.model)

    def _padding_minibatches(self, parts: list[list[torch.Tensor]]) -> list[int]:
        """Per part of the update, the minibatches this rank adds so that it makes as many forwards as the rank
        with the most: under FSDP every forward's all-gathers (and every backward's reduce-scatters) are
        collectives that pair up across ranks, and the ranks' kept rows differ when dynamic sampling drops
        groups. A padding minibatch's loss is multiplied by 0 and its metrics are dropped. Without FSDP
        (gradients averaged once, at the optimizer step): none."""
        if not self.dist.fsdp:
            return [0] * len(parts)
        paddings = [self.dist.max_over_ranks(len(part)) - len(part) for part in parts]
        self.metrics.add("train/padding_minibatches", float(sum(paddings)))
        return paddings

    def _train_minibatch(
        self,
        pairs: list[tuple[VQAExample, GenerationSample]],
        idx: torch.Tensor,
        adv: torch.Tensor,
        lags: torch.Tensor,
        old: TokenStats | None,
        share: float,
    ) -> TokenStats:
        """Forward and backward of the rows ``idx`` of ``pairs``, their loss weighted by ``share`` (its part of
        the update's loss, :func:`_minibatch_shares`); ``old`` their old-policy statistics, None: this forward's.
        Returns the old statistics."""
        settings = self.cfg.trainer
        temperature = self.cfg.generation.temperature
        minibatch = [pairs[i] for i in idx.tolist()]
        new = self.token_stats(minibatch, temperature)
        old = new.detach() if old is None else old
        mask = old.mask
        advantages = _token_width(adv[idx], mask.shape[1]).to(mask.device).float()
        shaping = settings.entropy_shaping
        if shaping.enabled:
            bonus_entropy = old.entropy if shaping.kind == "full" else old.sampled_entropy
            token_adv = adv_lib.entropy_shaped(advantages, bonus_entropy, shaping.alpha, shaping.kappa)
        else:
            token_adv = (
                advantages.unsqueeze(1).expand_as(old.logprobs) if advantages.ndim == 1 else advantages
            )
        ratio_logp = ratio_logprobs(settings, new.logprobs, old.logprobs, mask)
        per_token = policy_loss(settings, ratio_logp, old.logprobs, token_adv)
        behaviour_rows = [sample.logprobs for _, sample in minibatch]
        behaviour = _pad_logprobs(behaviour_rows, mask.shape[1]).to(mask.device)
        self.metrics.add("tis/logprob_mismatch", _masked_mean((old.logprobs - behaviour).abs(), mask))
        weights = self.loss_weights(old.logprobs, behaviour, mask, lags[idx])
        if weights is not None:
            per_token = per_token * weights
            self.metrics.add("tis/weight_mean", _masked_mean(weights, mask))
        if settings.beta > 0:
            with torch.no_grad(), self.reference_context():
                ref = self.token_stats(minibatch, temperature, model=self.reference)
            kl = loss_lib.kl_estimate(new.logprobs, ref.logprobs, kind="k3", clamp=settings.kl_clamp)
            per_token = per_token + settings.beta * kl
            self.metrics.add("policy/kl", _masked_mean(kl.detach(), mask))
        loss = loss_lib.aggregate(
            per_token, mask, mode=settings.loss_agg, max_len=self.cfg.generation.max_new_tokens
        )
        (loss * share).backward()
        # weighted by its share, the logged loss is the update's aggregate over every rank (per epoch and part)
        self.metrics.add("loss", loss, count=share)
        # the policy's entropy whatever the shaping reads (the full one is computed in every forward); what
        # sampled shaping reads, the sampled token's -p log p, is a different number (~0.01 where H is ~6)
        self.metrics.add("entropy/mean", _masked_mean(old.entropy, mask))
        if shaping.enabled and shaping.kind == "sampled":
            self.metrics.add("entropy/sampled_term_mean", _masked_mean(old.sampled_entropy, mask))
        self.metrics.add(
            "policy/ratio_mean", _masked_mean(torch.exp(new.logprobs.detach() - old.logprobs), mask)
        )
        self.metrics.add_dict(clip_metrics(settings, ratio_logp.detach(), old.logprobs, token_adv, mask))
        return old

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        batch = self.collect()
        self.metrics.add("time/rollout_s", time.perf_counter() - start)
        start = time.perf_counter()
        self.update(batch.pairs, batch.adv, batch.keep, batch.lags)
        self.metrics.add("time/train_s", time.perf_counter() - start)
        if self.run is not None and (self.step + 1) % self.cfg.trainer.sample_every == 0:
            shown, adv = batch.pairs[:8], batch.adv
            if adv.ndim == 2:  # token advantages: each sample's mean over its completion's tokens
                shown_adv = [
                    float(adv[i, : len(s.completion_token_ids)].mean()) for i, (_, s) in enumerate(shown)
                ]
            else:
                shown_adv = adv[:8].tolist()
            self._save_samples(self.step + 1, "train", shown, batch.total[:8], batch.raw[:8], shown_adv)
        return self.metrics.reduce()

    def _save_samples(
        self,
        step: int,
        tag: str,
        pairs: list[tuple[VQAExample, GenerationSample]],
        total: torch.Tensor,
        raw: torch.Tensor,
        adv: list[float] | None = None,
    ) -> None:
        """The run's sample file for ``pairs``: question, answer, completion, verdict (``correct``: the full weighted
        reward, ``wrong``: none, else ``partial``), reward and each verifier's score (and advantage), with the grid
        of the question images when every question has one."""
        full_marks = float(self.reward_weights.clamp(min=0).sum())
        records = []
        for i, (ex, sample) in enumerate(pairs):
            reward = float(total[i])
            verdict = "correct" if reward >= full_marks - 1e-6 else "wrong" if reward <= 0 else "partial"
            record: dict[str, Any] = {
                "question": ex.question,
                "answer": ex.answer,
                "completion": sample.text,
                "verdict": verdict,
                "reward": reward,
            }
            record.update({spec.key: float(raw[i, k]) for k, spec in enumerate(self.cfg.rewards)})
            if adv is not None:
                record["advantage"] = adv[i]
            records.append(record)
        images = [ex.images[0] for ex, _ in pairs] if pairs and all(ex.images for ex, _ in pairs) else None
        self.run.save_samples(step, tag, records, images)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, examples: list[VQAExample] | None = None) -> dict[str, float]:
        """One answer per held-out question (greedy, or sampled at ``generation.eval_temperature``), scored by the
        training rewards (``eval/reward_mean``: their weighted sum, also per question kind; ``eval/KEY``: each
        reward alone, e.g. ``eval/exact_match``, the accuracy) and by each ``eval_rewards`` verifier (overall and
        per kind), then the same for every ``data.extra_eval`` set (``eval/NAME/...``) when ``examples`` is not
        given. A vLLM engine sleeps after the last set."""
        out = self._evaluate_set(self.eval_set if examples is None else examples, "eval")
        if examples is None:
            for name, extra in self.extra_eval_sets.items():
                out.update(self._evaluate_set(extra, f"eval/{name}"))
        self.backend.sleep()  # (once, not per set: each wake-up reloads the engine's weights)
        return out

    def _evaluate_set(self, examples: list[VQAExample], prefix: str) -> dict[str, float]:
        g = self.cfg.generation
        # the same seed at every evaluation: sampled answers are comparable across steps, and evaluating (how
        # often, on how many sets) leaves the training generator, hence the training prompts, as they were
        pairs = self.generate(examples, 1, g.eval_temperature, g.eval_top_p, seed=EVAL_SEED)
        total, raw = self.verify(pairs)
        extra = {
            key: out.scores.detach().float().cpu()
            for key, out in self._score_with(self.cfg.eval_rewards, self.eval_rewards, pairs).items()
        }
        out = {
            f"{prefix}/reward_mean": float(total.mean()),
            f"{prefix}/skipped": float(len(examples) - len(pairs)),
        }
        for k, spec in enumerate(self.cfg.rewards):
            out[f"{prefix}/{spec.key}"] = float(raw[:, k].mean())
        out.update({f"{prefix}/{key}": float(scores.mean()) for key, scores in extra.items()})
        kinds = sorted({ex.kind for ex, _ in pairs if ex.kind})
        for kind in kinds:
            sel = torch.tensor([ex.kind == kind for ex, _ in pairs])
            out[f"{prefix}/reward_mean_{kind}"] = float(total[sel].mean())
            out.update({f"{prefix}/{key}_{kind}": float(scores[sel].mean()) for key, scores in extra.items()})
        if prefix == "eval":
            self._last_eval = pairs, total
            if self.run is not None:
                self._save_samples(self.step, "eval", pairs[:32], total[:32], raw[:32])
        return out

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **self.base_state(),
            "trainable": full_state_dict(self.model),  # whole tensors, gathered from the shards under FSDP
            "optimizer": optimizer_state(self.model, self.optimizer),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        load_trainable(self.model, state["trainable"])
        self.load_base_state(state)
        load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.backend.sync_weights(self.model)

    def save_checkpoint(self) -> None:
        """Rank 0 writes; under data parallelism every rank first gathers the state with it (its RNG states, and
        its shards of the weights and optimizer state under FSDP: collectives)."""
        if not self.checkpoint_wanted():
            return
        state = self.state_dict()
        lora = self.cfg.model.lora is not None
        # a full fine-tune under FSDP: every rank gathers the frozen shards too (collectives)
        weights = full_state_dict(self.model, trainable_only=False) if not lora and self.dist.fsdp else None

        def extra(directory: Path) -> None:
            """What transformers loads, beside the trainer's state.pt: ``adapter/`` (peft) or ``model/``
            (``AutoModelForImageTextToText.from_pretrained``), each with the processor."""
            target = directory / ("adapter" if lora else "model")
            self.model.save_pretrained(target, **({"state_dict": weights} if weights is not None else {}))
            self.processor.save_pretrained(target)
            if (
                weights is not None
            ):  # FSDP2 swapped in a subclass named FSDP<Class>: record the class transformers knows
                config_file = target / "config.json"
                config = json.loads(config_file.read_text())
                config["architectures"] = [
                    name.removeprefix("FSDP") for name in config.get("architectures") or []
                ]
                config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

        self.write_checkpoint(state, extra)


def load_examples(
    cfg: VLMRLVRConfig, which: Literal["train", "eval"], source: str | None = None
) -> list[VQAExample]:
    """The run's train or held-out questions, as the trainer loads them: ``data.train`` (then each
    ``data.train_mix`` source) with seed ``run.seed``, ``data.eval`` (or another held-out ``source``) with seed
    ``run.seed + 1`` (so generated shapes questions differ between the two)."""
    d = cfg.data

    def load(source: str, limit: int | None, seed: int) -> list[VQAExample]:
        return load_vqa(
            source,
            limit=limit,
            seed=seed,
            question_column=d.question_column,
            answer_column=d.answer_column,
            image_column=d.image_column,
            id_column=d.id_column,
            reference_column=d.reference_column,
            image_root=d.image_root,
            question_template=d.question_template,
            image_size=d.image_size,
            min_pixels=d.min_pixels,
            max_pixels=d.max_pixels,
            split=d.split,
        )

    if which == "eval":
        return load(source or d.eval, d.eval_limit, cfg.run.seed + 1)
    examples = load(d.train, d.train_limit, cfg.run.seed)
    seen = {example.prompt_id for example in examples}
    for mixed, limit in d.train_mix.items():
        added = load(mixed, limit, cfg.run.seed)
        ids = {example.prompt_id for example in added}
        if ids & seen:
            raise ValueError(f"data.train_mix[{mixed!r}] repeats prompt ids of the sources before it")
        seen |= ids
        examples += added
    return examples


def _fsdp_units(model: torch.nn.Module, family: VLMFamily) -> list[torch.nn.Module | list[torch.nn.Module]]:
    """The FSDP units besides the blocks: the modules called directly, not from within the model's ``forward``, so
    that their parameters are gathered when called. Scoring calls the backbone and the LM head
    (``backbone_and_head``); ``generate`` encodes the images before its first forward with the backbone's
    ``get_image_features``, which calls the vision tower. An LM head tied to the input embeddings shares their
    weight, so the two form one grouped unit. Inner modules come first."""
    backbone, head = backbone_and_head(model)
    vision = family.vision_tower(backbone)
    units: list[torch.nn.Module | list[torch.nn.Module]] = [vision] if vision is not None else []
    embed = model.get_input_embeddings()
    if embed is not None and head.weight is embed.weight:
        return [*units, [embed, head], backbone]
    return [*units, backbone, head]


class StepSamples(NamedTuple):
    """A VLM training step's samples (:meth:`VLMRLVRTrainer.collect`).

    Attributes:
        pairs: ``N`` (question, sample) pairs.
        adv: advantages, per sequence ``[N]`` or per token ``[N, T]`` (process credit).
        keep: ``[N]`` bool, the samples that enter the loss.
        lags: ``[N]`` weight versions each sample lags behind the policy.
        total: ``[N]`` weighted reward, as trained on.
        raw: ``[N, K]`` each verifier's score.
    """

    pairs: list[tuple[VQAExample, GenerationSample]]
    adv: torch.Tensor
    keep: torch.Tensor
    lags: torch.Tensor
    total: torch.Tensor
    raw: torch.Tensor


class _Round(NamedTuple):
    """One generation round of a VLM step: its samples, advantages (``[N]`` or ``[N, T]``), loss mask ``[N]``,
    weight lags ``[N]``, group index ``[N]`` (``0..`` in order of the prompts' first sample), weighted and
    per-verifier rewards (``[N]``, ``[N, K]``), and the number of its prompts skipped as too long."""

    pairs: list[tuple[VQAExample, GenerationSample]]
    adv: torch.Tensor
    keep: torch.Tensor
    lags: torch.Tensor
    group_ids: torch.Tensor
    total: torch.Tensor
    raw: torch.Tensor
    skipped: int


def _group_index(prompt_ids: list[str]) -> list[int]:
    """Contiguous group index per sample from its prompt id (samples of a prompt share a group)."""
    seen: dict[str, int] = {}
    return [seen.setdefault(p, len(seen)) for p in prompt_ids]


def _token_width(adv: torch.Tensor, width: int) -> torch.Tensor:
    """Sequence advantages ``[B]`` as they are; token advantages ``[B, T']`` cut or zero-padded to ``[B, width]``
    (the minibatch's longest completion)."""
    if adv.ndim == 1:
        return adv
    if adv.shape[1] >= width:
        return adv[:, :width]
    return torch.nn.functional.pad(adv, (0, width - adv.shape[1]))


def _normalizer_count(lengths: torch.Tensor, loss_agg: str) -> float:
    """What :func:`mmrl.core.losses.aggregate` divides a minibatch's summed loss by under ``loss_agg``, up to a
    constant, from its rows' completion ``lengths``: its tokens (``token_mean``), its rows with a token
    (``seq_mean_token_mean``: ``aggregate`` leaves empty rows out of its mean) or its rows
    (``seq_mean_token_sum_norm``, times ``max_len``)."""
    if loss_agg == "token_mean":
        return float(lengths.sum())
    if loss_agg == "seq_mean_token_mean":
        return float((lengths > 0).sum())
    return float(lengths.numel())


def _minibatch_shares(counts: list[float], total: float, world_size: int) -> list[float]:
    """Each minibatch's weight ``w_k = world_size * n_k / N`` in a part's loss ``L = sum_k w_k L_k`` (``L_k``: its
    :func:`mmrl.core.losses.aggregate`; ``counts``: its :func:`_normalizer_count` ``n_k``; ``total``: ``N``, the
    part's count summed over the ranks), such that the ranks' averaged gradient
    (:func:`mmrl.distributed.all_reduce_grads`, FSDP's reduce-scatter: sum / ``world_size``) is the gradient of
    the aggregate over every rank's rows, as TRL's ``dapo`` (``num_items_in_batch`` gathered across processes)
    and verl's token-mean (``global_batch_tokens * dp_size``) normalise:

    - ``token_mean``: every token of the launch's part weighs the same;
    - ``seq_mean_token_mean``: every sequence with a token weighs the same;
    - ``seq_mean_token_sum_norm``: the normaliser ``B * max_len`` counts every rank's rows ``B``.

    One process: ``w_k = n_k / N``, the minibatches' shares of the part. A rank that kept no rows adds nothing to
    ``N`` and so leaves the others' gradient as one process would compute it.
    """
    return [world_size * count / total if total else 0.0 for count in counts]


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values [B, T]`` over the completion tokens ``mask`` selects (padding never counts)."""
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def ratio_logprobs(
    settings: VLMTrainerConfig, logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` log-probs whose ratio to ``old_logp`` the loss reads at ``trainer.importance_sampling_level``:
    ``logp`` itself (token), or GSPO-token's (sequence: :func:`mmrl.core.losses.gspo_token_logp`, each token's
    value the completion's length-normalised ratio, its gradient the token's); ``mask`` 1 on completion tokens."""
    if settings.importance_sampling_level == "sequence":
        return loss_lib.gspo_token_logp(logp, old_logp, mask)
    return logp


def policy_loss(
    settings: VLMTrainerConfig, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` per-token policy loss of ``trainer.policy_loss`` (PPO's clipped surrogate or CISPO) on the
    ratios ``exp(logp - old_logp)`` (``logp`` from :func:`ratio_logprobs`); ``adv`` ``[B, T]``."""
    if settings.policy_loss == "cispo":
        return loss_lib.cispo_surrogate(logp, old_logp, adv, settings.cispo_weight_max)
    return loss_lib.clipped_surrogate(
        logp, old_logp, adv, settings.epsilon_low, settings.epsilon_high, settings.dual_clip
    )


def clip_metrics(
    settings: VLMTrainerConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Shares of completion tokens (``mask``) whose ratio ``exp(logp - old_logp)`` (``logp`` from
    :func:`ratio_logprobs`) the loss clips: ``clip/low_frac`` and ``clip/high_frac``
    (:func:`mmrl.core.losses.clip_fractions`), or under CISPO ``clip/cispo_capped_frac``, the tokens whose
    weight is capped, whatever their advantage's sign."""
    if settings.policy_loss == "cispo":
        capped = (torch.exp(logp - old_logp) > settings.cispo_weight_max).to(logp.dtype)
        return {"clip/cispo_capped_frac": _masked_mean(capped, mask)}
    return loss_lib.clip_fractions(
        logp, old_logp, adv, settings.epsilon_low, settings.epsilon_high, mask=mask
    )


def _pad_logprobs(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r[:width].float()
    return out


def make_trainable(model: torch.nn.Module, model_cfg: VLMModelConfig, family: VLMFamily) -> torch.nn.Module:
    """The policy to train from the loaded ``model``: a peft LoRA model around it (``model.lora``; the base
    frozen), or ``model`` itself with every weight trainable but the vision tower's (unless
    ``model.train_vision``); the trained parameters in ``model.master_weight_dtype`` or wider."""
    model.requires_grad_(False)
    if model_cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = model_cfg.lora
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=family.lora_target_pattern(lora.target_modules, model_cfg.train_vision),
            ),
            autocast_adapter_dtype=False,  # the factors' dtype is master_weight_dtype's, set below
        )
    else:
        model.requires_grad_(True)
        if not model_cfg.train_vision:
            for name, param in model.named_parameters():
                if family.is_vision_parameter(name):
                    param.requires_grad_(False)
    # master weights (verl's and EasyR1's float32 actor, peft's float32 LoRA factors): in bfloat16 an AdamW step
    # below 2^-9 of a weight rounds away; the model then computes in model.dtype under autocast
    # (model.compute_dtype()). Only ever widened, as the flow trainer's (mmrl.flow.trainer.make_trainable).
    master = DTYPES[model_cfg.master_weight_dtype]
    for param in model.parameters():
        if param.requires_grad and torch.finfo(param.dtype).bits < torch.finfo(master).bits:
            param.data = param.data.to(master)
    return model


def main(cfg: VLMRLVRConfig) -> dict[str, float]:
    """Train end to end; returns the final metrics."""
    return run_recipe(cfg, VLMRLVRTrainer)


def evaluate(
    cfg: VLMRLVRConfig,
    prompts_file: str | None,
    out_dir: Path,
    checkpoint: Path | None,
    images_per_prompt: int,
) -> dict[str, float]:
    """Accuracy of the base model, or a checkpoint's adapter, on a question file (json/jsonl/parquet).

    Each question is answered once (as ``trainer.eval_every`` scores: greedily unless
    ``generation.eval_temperature``), so ``images_per_prompt`` (the flow recipes' samples per prompt, ``mmrl eval
    --images-per-prompt``) must be 1.

    Raises:
        ValueError: ``images_per_prompt`` is not 1.
    """
    if images_per_prompt != 1:
        raise ValueError(
            f"--images-per-prompt {images_per_prompt}: a vlm_rlvr run is evaluated with one greedy answer per "
            "question (N greedy answers would be the same answer); leave the flag out"
        )
    if prompts_file is not None:
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval": prompts_file})})
    trainer = VLMRLVRTrainer(cfg, run=None)
    trainer.setup(for_training=False)
    if checkpoint is not None:
        load_trainable(trainer.model, load_checkpoint(checkpoint, require=("trainable",))["trainable"])
        trainer.backend.sync_weights(trainer.model)  # a vLLM engine was built with the base weights
    summary = trainer.evaluate()
    pairs, total = trainer._last_eval
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "answers.jsonl", "w") as f:
        for (ex, s), r in zip(pairs, total.tolist(), strict=True):
            f.write(
                json.dumps(
                    {
                        "id": ex.prompt_id,
                        "question": ex.question,
                        "answer": ex.answer,
                        "completion": s.text,
                        "reward": r,
                    }
                )
                + "\n"
            )
    summary = {"checkpoint": str(checkpoint) if checkpoint else None, "questions": len(pairs), **summary}
    write_summary_json(out_dir / "summary.json", summary)
    return summary
