"""Flow-matching GRPO for text-to-image and text-to-video models (``recipe: flow_grpo``).

Lifecycle: ``FlowGRPOTrainer(cfg, run)`` -> ``setup()`` -> ``train()`` -> ``cleanup()``; ``main(cfg)`` does all four.
One training step:

1. pick prompts and split the image budget over them (core: selection + allocation from the statistics store);
2. roll out groups with SDE log-probs (pipelines/flow/rollout.py), SDE steps in a window when configured;
3. score the images (rewards/), fold the rewards into the statistics store;
4. advantages per prompt group (GRPO / Dr.GRPO / RLOO / global std; GDPO for several rewards), clipped;
5. update the weights with the objective ``trainer.objective`` names (mmrl/flow/objectives/, one file each):
   GRPO's clipped ratio on the re-scored SDE transitions + KL on the SDE means (Flow-GRPO, arXiv 2505.05470
   eq. 8-10), or a velocity regression on the final images: DiffusionNFT (arXiv 2509.16117), AWM (arXiv
   2509.25050), RWR; the regression path (:meth:`FlowGRPOTrainer.regress`) adds the reference KL and the guidance
   distillation to any of them.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import rewards as reward_registry
from mmrl.checkpoint import load_checkpoint, load_trainable
from mmrl.core import advantages as adv_lib
from mmrl.core import allocation as alloc_lib
from mmrl.core import losses as loss_lib
from mmrl.core.estimators import Advantages, RewardBatch, get_estimator
from mmrl.core.groups import effective_ratio, make_groups
from mmrl.core.stats import PromptStats
from mmrl.data.prompts import check_prompts, load_prompts
from mmrl.device import DTYPES
from mmrl.distributed import (
    all_reduce_sum,
    broadcast_params,
    full_state_dict,
    load_optimizer_state,
    optimizer_state,
    shard_model,
)
from mmrl.ema import EMA
from mmrl.flow.batch import FlowSamples, StepBatch
from mmrl.flow.config import FlowGRPOConfig, FlowLora
from mmrl.flow.objectives import get_objective
from mmrl.flow.pooled import PooledFlowSource, pooled_worker_factory
from mmrl.flow.rollouts import LoopFlowSource
from mmrl.images import make_grid, tensor_to_pil
from mmrl.loop import run_recipe
from mmrl.optim import make_optimizer
from mmrl.rollouts import StepRequest
from mmrl.run import Run, write_summary_json
from mmrl.schedule import learning_rate
from mmrl.seeding import EVAL_SEED
from mmrl.trainer_base import TrainerBase
from pipelines.flow.adapters import Conditioning, FlowAdapter, load_adapter
from pipelines.flow.branch import TreeRollout, prune_transitions
from pipelines.flow.explore import ExploreConfig, spearman_within
from pipelines.flow.rollout import Rollout, SamplingConfig, TransitionBatch, rescore, rollout, rollout_sigmas
from pipelines.pool.protocol import WeightUpdate
from pipelines.pool.weights import make_update
from rewards.base import checked_score

__all__ = ["FlowGRPOTrainer", "evaluate", "main"]

logger = logging.getLogger(__name__)


def sample_records(
    prompts: list[str],
    raw: torch.Tensor,
    components: dict[str, torch.Tensor],
    specs: list[Any],
    weights: torch.Tensor,
) -> list[dict[str, Any]]:
    """One record per sample for the run's sample files: its prompt, the weighted ``reward``, each reward by its
    key and each component (``{key}/{component}``)."""
    total = (raw @ weights).tolist()
    records = []
    for i, prompt in enumerate(prompts):
        record: dict[str, Any] = {"prompt": prompt, "reward": total[i]}
        record.update({spec.key: float(raw[i, k]) for k, spec in enumerate(specs)})
        record.update({name.removeprefix("reward/"): float(v[i]) for name, v in components.items()})
        records.append(record)
    return records


class FlowGRPOTrainer(TrainerBase):
    """Flow-matching RL over any flow adapter (a registered model family) with any registered objective (GRPO,
    DiffusionNFT, AWM, RWR), with the core's selection, allocation and advantages."""

    show = ("reward/mean", "eval/reward_mean")

    def __init__(self, cfg: FlowGRPOConfig, run: Run | None = None) -> None:
        super().__init__(cfg, run)
        self.nfe_total = 0
        self.objective = get_objective(cfg.trainer.objective)

    # ------------------------------------------------------------------ setup
    def setup(self, for_training: bool = True) -> None:
        """The lifecycle's setup: seeds and device, the model (trainable part, frozen copies), the rewards and
        held-out prompts; for training also the training prompts, the optimizer, statistics, EMA and explorer
        (resumed from the latest checkpoint) and the rollout source."""
        # one process per GPU under `accelerate launch` (mmrl/distributed.py)
        self.setup_runtime(self.cfg.model.device)
        if for_training:  # before minutes of loading: do the weights and training state fit at all?
            from mmrl.flow.memory import estimate_memory

            self.check_memory(estimate_memory)
        self._setup_model(for_training)
        self._setup_rewards_and_eval_prompts()
        if not for_training:
            return
        self._setup_train_prompts()
        self._setup_training_state()

    def _setup_model(self, for_training: bool) -> None:
        """The family's adapter loaded as users load it, every pipeline module frozen but the transformer's
        trainable part (LoRA or full), sharded under FSDP; the frozen copies the objective needs."""
        cfg = self.cfg
        self.adapter: FlowAdapter = self.load_model()
        compute = cfg.model.compute_dtype()
        self.adapter.autocast_dtype = DTYPES[compute] if compute else None
        transformer = self.adapter.transformer
        transformer.requires_grad_(False)
        # every module of the pipeline starts frozen (text encoders, VAE, a second expert): only what the
        # trainer makes trainable below takes gradients, which the optimizer then steps and zeroes
        for module in self.adapter.pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False)
        self.reference: torch.nn.Module | None = None
        # set below for training; an evaluation-only setup scores the loaded weights themselves
        self.ema: EMA | None = None
        # trainer.guidance_distill.refresh_every: the teacher, a copy refreshed from the evaluated weights
        self.distill_teacher: torch.nn.Module | None = None
        # the frozen copies of the start weights, in model.dtype (before the trained weights become master weights)
        copies = start_copies(cfg) if for_training else ()
        if "reference" in copies:
            self.reference = copy.deepcopy(transformer).eval()
        if "distill_teacher" in copies:
            # the start weights until the first refresh (refresh_teacher)
            self.distill_teacher = copy.deepcopy(transformer).eval()
        make_trainable(transformer, cfg.model.lora, DTYPES[cfg.model.master_weight_dtype])
        if cfg.model.lora is not None and cfg.model.init_lora:
            self.adapter.load_lora(Path(cfg.model.init_lora))
        if cfg.model.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        if self.dist.fsdp:
            self._check_fsdp()
            if self.reference is not None:
                shard_model(self.reference, self.dist.reshard_after_forward)
            # master weights wider than the model's dtype are gathered in the model's dtype
            model_dtype, master = DTYPES[cfg.model.dtype], DTYPES[cfg.model.master_weight_dtype]
            gathered = model_dtype if torch.finfo(model_dtype).bits < torch.finfo(master).bits else None
            shard_model(transformer, self.dist.reshard_after_forward, param_dtype=gathered)
        self.trainable = [p for p in transformer.parameters() if p.requires_grad]
        if not self.dist.fsdp:  # (sharded weights come from the same checkpoint on every rank)
            broadcast_params(self.trainable, self.world_size)  # a LoRA's random init differs per rank's seed

    def _setup_rewards_and_eval_prompts(self) -> None:
        """Training and evaluation rewards, the held-out prompts and every ``extra_eval`` set, each prompt
        checked against the rewards that score it before anything is generated."""
        cfg = self.cfg
        self.rewards, self.reward_weights = _build_rewards(cfg.rewards)
        self.eval_specs = cfg.eval_rewards if cfg.eval_rewards is not None else cfg.rewards
        self.eval_rewards, self.eval_weights = (
            _build_rewards(cfg.eval_rewards)
            if cfg.eval_rewards is not None
            else (self.rewards, self.reward_weights)
        )
        self.eval_pool = load_prompts(cfg.eval_prompts)
        check_prompts(cfg.eval_prompts, self.eval_pool, self.eval_rewards)
        # further held-out sets: name -> (prompts, specs, rewards, weights)
        self.extra_eval: dict[str, tuple[list[str], list[Any], list[Any], torch.Tensor]] = {}
        for name, extra in cfg.extra_eval.items():
            extra_rewards, weights = _build_rewards(extra.rewards)
            extra_prompts = load_prompts(extra.prompts)[: extra.num_prompts]
            check_prompts(extra.prompts, extra_prompts, extra_rewards)
            self.extra_eval[name] = (extra_prompts, list(extra.rewards), extra_rewards, weights)

    def _setup_train_prompts(self) -> None:
        """The training prompts, checked against the rewards, and the distillation teacher's unconditional input."""
        cfg = self.cfg
        self.train_pool = load_prompts(cfg.train_prompts)
        check_prompts(cfg.train_prompts, self.train_pool, self.rewards)
        overlap = set(self.train_pool) & set(self.eval_pool)
        if overlap:
            logger.warning(
                "%d prompts are both train and eval prompts, e.g. %r", len(overlap), next(iter(overlap))
            )
        if cfg.allocation.prompts_per_step > len(self.train_pool):
            raise ValueError(
                f"allocation.prompts_per_step ({cfg.allocation.prompts_per_step}) exceeds the "
                f"{len(self.train_pool)} train prompts of {cfg.train_prompts}"
            )
        # the distillation teacher's unconditional input: the negative prompt, encoded once
        self.distill_uncond: Conditioning | None = None
        distill = cfg.trainer.guidance_distill
        if distill.weight > 0:
            if not self.adapter.uses_cfg(distill.guidance_scale):
                raise ValueError(
                    f"trainer.guidance_distill needs a teacher with an unconditional branch at guidance_scale "
                    f"{distill.guidance_scale}; family {cfg.model.family!r} has none there (guidance-distilled, "
                    "or a scale of 1)"
                )
            self.distill_uncond = self.adapter.encode([cfg.sampling.negative_prompt])

    def _setup_training_state(self) -> None:
        """Optimizer, quantized explorer, per-prompt statistics, EMA and old policy, resumed from the latest
        checkpoint; then the rollout source (a pool starts from the weights held after the resume)."""
        cfg = self.cfg
        transformer = self.adapter.transformer
        self.optimizer = self._make_optimizer()
        self.explorer = None
        if cfg.explore.enabled:
            from pipelines.quant import quantize_copy, weight_bytes

            self.explorer = quantize_copy(
                transformer, cfg.explore.scheme, compute_dtype=DTYPES[cfg.model.dtype]
            )
            full, small = weight_bytes(transformer), weight_bytes(self.explorer.module)
            logger.info(
                "explorer (%s): %.2f MB of weights vs %.2f MB (%.2fx smaller)",
                cfg.explore.scheme,
                small / 1e6,
                full / 1e6,
                full / max(small, 1),
            )
            self.explore_memory = {
                "explore/weight_mb_policy": full / 1e6,
                "explore/weight_mb_explorer": small / 1e6,
            }
        self.stats = PromptStats(rho=cfg.allocation.rho, prior_strength=cfg.allocation.prior_strength)
        self.ema = EMA(transformer, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
        decay = cfg.trainer.old_policy_decay
        self.old_policy = EMA(transformer, decay) if decay else None
        self.resume()
        if cfg.pool.enabled:
            self.rollout_source = self._make_pooled_source()
        else:
            self.rollout_source = LoopFlowSource(
                self.adapter,
                plan=self.plan,
                prompts_per_step=cfg.allocation.prompts_per_step,
                generator=self.generator,
                sampling_weights=self.sampling_weights,
                metrics=self.metrics,
                tree=cfg.tree if cfg.sampling.rollout == "branch" else None,
                explorer=self.explorer,
                explore_config=self._explore_config(),
                preview_reward=self.preview_reward,
            )

    def load_model(self) -> FlowAdapter:
        """The family's adapter around the pipeline ``model.path`` names, loaded in ``model.dtype`` on the
        device (``from_pretrained``, as users load it). A subclass may build it otherwise (benchmarks/real_size.py:
        the published architecture with random weights)."""
        model = self.cfg.model
        return load_adapter(
            model.family, model.path, torch_dtype=DTYPES[model.dtype], device=self.device, **model.options
        )

    def preview_reward(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """``[B]`` weighted training reward of the explorer's previews."""
        return self.combine(self.score(images, prompts)[0])

    def _explore_config(self) -> ExploreConfig:
        e = self.cfg.explore
        return ExploreConfig(
            candidates=e.candidates,
            preview_steps=e.preview_steps,
            keep_best=e.keep_best,
            keep_worst=e.keep_worst,
            selection=e.selection,
            extra_random=e.extra_random,
        )

    def _make_pooled_source(self) -> PooledFlowSource:
        """The pool source, its members started from the weights held now (version 0)."""
        cfg = self.cfg
        # the members' base sampling: every request sets its step's SDE window. Restore the generator so that
        # building it does not consume the random-window draw the first step makes
        state = self.generator.get_state()
        sampling = replace(self.sampling_config(), sde_window=None)
        self.generator.set_state(state)
        # the LoRA (even untrained: the worker then runs the trainer's module structure) or resumed weights
        initial = (
            make_update(self.adapter.transformer, version=0)
            if cfg.model.lora is not None or self.step > 0
            else None
        )
        device = cfg.pool.device if cfg.pool.device is not None else str(self.device)
        return PooledFlowSource(
            cfg.pool,
            pooled_worker_factory(cfg.model, sampling, initial, device),
            plan=self.plan,
            prompts_per_step=cfg.allocation.prompts_per_step,
            first_step=self.step,
            num_steps=cfg.trainer.steps - self.step,
            seed=cfg.run.seed,
            rank=self.rank,
            weights=self.weight_update,
            metrics=self.metrics,
            device=self.device,
        )

    def weight_update(self, version: int) -> WeightUpdate:
        """The sampling weights as the pool's weight ``version`` (LoRA-only with a frozen base)."""
        with self.sampling_weights():
            return make_update(self.adapter.transformer, version=version)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        t = self.cfg.trainer
        if not self.trainable:
            raise ValueError(
                "no trainable parameters: check model.lora.target_modules against the transformer"
            )
        return make_optimizer(self.trainable, t.optimizer, lr=t.lr, weight_decay=t.weight_decay)

    # ------------------------------------------------------------------ policies
    @contextmanager
    def reference_policy(self) -> Iterator[None]:
        """Run the adapter as the reference policy: the LoRA switched off, or the frozen start copy."""
        transformer = self.adapter.transformer
        if self.cfg.model.lora is not None:
            transformer.disable_adapters()
            try:
                yield
            finally:
                transformer.enable_adapters()
        else:
            if self.reference is None:
                raise RuntimeError(
                    "no reference policy: full fine-tuning keeps one only when trainer.beta > 0 or "
                    "trainer.guidance_distill.weight > 0 with a frozen teacher (refresh_every null)"
                )
            with self.adapter.swapped_denoiser(self.reference):
                yield

    def teacher_policy(self) -> AbstractContextManager[None]:
        """Run the adapter as the guidance distillation's teacher: the refreshed copy under
        ``trainer.guidance_distill.refresh_every``, else the reference policy (the start weights)."""
        if self.distill_teacher is not None:
            return self.adapter.swapped_denoiser(self.distill_teacher)
        return self.reference_policy()

    @torch.no_grad()
    def refresh_teacher(self) -> bool:
        """Under ``trainer.guidance_distill.refresh_every = N``, at every step ``n > 0`` with ``n % N == 0``
        copy the evaluated weights (:meth:`evaluation_weights`: the EMA, or the trained weights) into the
        teacher; returns whether it did."""
        every = self.cfg.trainer.guidance_distill.refresh_every
        if self.distill_teacher is None or every is None or self.step == 0 or self.step % every:
            return False
        with self.evaluation_weights():
            for teacher, param in zip(
                self.distill_teacher.parameters(), self.adapter.transformer.parameters(), strict=True
            ):
                teacher.copy_(param)
        return True

    # ------------------------------------------------------------------ rewards
    def score(
        self, images: torch.Tensor, prompts: list[str], evaluation: bool = False
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``([B, K] raw rewards, components for logging)`` of the training rewards (or, with ``evaluation``,
        of the evaluation rewards); a reward that raises or returns a non-finite score stops the run with its
        name (:class:`rewards.base.RewardCheckError`)."""
        specs, rewards = (
            (self.eval_specs, self.eval_rewards) if evaluation else (self.cfg.rewards, self.rewards)
        )
        return self.score_with(specs, rewards, images, prompts)

    def score_with(
        self, specs: list[Any], rewards: list[Any], images: torch.Tensor, prompts: list[str]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """:meth:`score` with the given reward specs and built rewards (an ``extra_eval`` set's)."""
        pil = tensor_to_pil(images) if images.ndim == 4 else None
        columns, components = [], {}
        for spec, reward in zip(specs, rewards, strict=True):
            batch = (
                {"images": pil, "prompts": prompts}
                if pil is not None
                else {"videos": images, "prompts": prompts}
            )
            out = checked_score(reward, spec.key, len(prompts), **batch)
            columns.append(out.scores.detach().float().cpu())
            for name, value in out.components.items():
                components[f"reward/{spec.key}/{name}"] = value.detach().float().cpu()
        return torch.stack(columns, dim=1), components

    def combine(self, raw: torch.Tensor) -> torch.Tensor:
        """Weighted sum of the rewards ``[B]`` (what is logged and stored as the prompt's reward)."""
        return raw @ self.reward_weights

    def advantages(self, raw: torch.Tensor, group_index: torch.Tensor, prompts: list[str]) -> Advantages:
        """Step 4: the configured estimator's advantages of a scored batch, clipped; folds the rewards into the
        statistics store first (an estimator that needs the store's baseline gets it from before the update).
        GDPO replaces the estimator when ``trainer.multi_reward=gdpo`` and there are several rewards. Under data
        parallelism the estimator's batch statistics (``global_std``'s std, ``gdpo``'s whitening, ``single``'s
        scale) are taken over every rank's rewards, as Flow-GRPO takes them over the gathered batch: a collective
        every rank enters."""
        t = self.cfg.trainer
        estimator = get_estimator(self.cfg.estimator_name)
        total = self.combine(raw)
        baseline = self.stats.value(prompts).float() if estimator.needs_baseline else None
        self.stats.update_distributed(prompts, total, step=self.step)
        sum_over_ranks = all_reduce_sum if self.dist.active else None
        batch = RewardBatch(
            total, group_index, raw, self.reward_weights, baseline, sum_over_ranks=sum_over_ranks
        )
        result = estimator.fn(batch, **t.advantage_options)
        return Advantages(adv_lib.clip_advantages(result.adv, t.adv_clip_max), result.keep)

    # ------------------------------------------------------------------ one step
    def sde_window(self, step: int) -> tuple[int, int] | None:
        """SDE steps ``(start, stop)`` of training step ``step``'s rollouts (``None``: every step is SDE)."""
        s = self.cfg.sampling
        if self.objective.trains_on == "final_samples" and s.rollout == "flat":
            # the likelihood-free objectives regress on the final images, so these must be clean ODE samples:
            # SDE noise left in them by a late window is learned back and compounds step after step
            return (0, 0)
        if s.sde_window is None:
            return None
        first, end = s.window_bounds()
        span = end - first - s.sde_window
        if s.window_schedule == "fixed":
            start = first
        elif s.window_schedule == "sliding":
            start = first + step % (span + 1)
        else:
            start = first + int(torch.randint(0, span + 1, (1,), generator=self.generator))
        return start, start + s.sde_window

    def sampling_config(self, step: int | None = None) -> SamplingConfig:
        """The rollout settings of training step ``step`` (default: the current one)."""
        return self.cfg.sampling.rollout_settings(self.sde_window(self.step if step is None else step))

    def _log_rewards(
        self,
        total: torch.Tensor,
        raw: torch.Tensor,
        components: dict[str, torch.Tensor],
        group_index: torch.Tensor,
    ) -> None:
        groups = make_groups(group_index)
        self.metrics.add("reward/mean", total.mean(), count=total.numel())
        for k, spec in enumerate(self.cfg.rewards):
            self.metrics.add(f"reward/{spec.key}/mean", raw[:, k].mean(), count=total.numel())
        for name, value in components.items():
            self.metrics.add(name, value.mean(), count=total.numel())
        self.metrics.add("train/effective_ratio", effective_ratio(total, group_index))
        constant = groups.amax(total) == groups.amin(total)  # [G]: exact, where a std may keep rounding noise
        self.metrics.add("train/zero_std_frac", float(constant.double().mean()))

    def plan(self, step: int, num_prompts: int, exclude: frozenset[str] = frozenset()) -> StepRequest:
        """Step 1 for the rollout source: ``num_prompts`` prompts (none in ``exclude``), their counts from the
        allocator, and step ``step``'s sampling settings (its SDE window). Trees and the explorer decide their
        own sizes: one per prompt then."""
        a = self.cfg.allocation
        candidates = [p for p in self.train_pool if p not in exclude] if exclude else self.train_pool
        prompts = self.select_prompts(candidates, num_prompts)
        if self.cfg.allocates_groups:
            counts = alloc_lib.allocate(
                self.stats, prompts, a.rollouts_per_step, method=a.method, n_min=a.n_min, n_max=a.n_max
            ).tolist()
        else:
            counts = [1] * len(prompts)
        return StepRequest(step, prompts, prompts, counts, self.sampling_config(step))

    def collect(self) -> StepBatch:
        """Steps 1-4: the source's samples of this step, scored, with advantages and the transitions to train."""
        source = self.rollout_source.collect(self.step)
        samples = source.output
        if samples.explored is not None:
            self.metrics.add_dict(self.explore_memory)
            self.nfe_total += samples.explored.nfe
        if isinstance(samples.rollout, TreeRollout):
            batch = self._score_trees(samples)
        else:
            batch = self._score_groups(samples)
        self.rollout_source.prefetch(self.step)  # later steps' requests, chosen with this step's statistics
        batch = replace(batch, sample_lags=source.sample_lags)
        if self.cfg.pool.enabled and self.objective.trains_on == "transitions":
            # pooled samples may be stale: their loss terms get importance weights (1 at lag 0)
            lags = source.sample_lags[batch.transitions.sample_index]
            transitions, weights = self._stale_weights(batch.transitions, lags)
            batch = replace(batch, transitions=transitions, weights=weights)
        self.metrics.add("nfe/rollout", float(batch.nfe))
        self.nfe_total += batch.nfe
        return batch

    def _score_groups(self, samples: FlowSamples) -> StepBatch:
        """Steps 3-4 on flat groups."""
        ro = samples.rollout
        raw, components = self.score(ro.images, ro.prompts)
        total, adv, trans = self.score_flat(ro, raw, components)
        if samples.explored is not None:
            explored = samples.explored
            rho = spearman_within(explored.chosen_preview_rewards, total, explored.chosen.shape[1])
            self.metrics.add("explore/spearman", rho)
        return StepBatch(
            trans,
            adv[trans.sample_index],
            ro.images,
            ro.prompts,
            ro.latents[:, -1],
            ro.cond,
            adv,
            ro.nfe,
            raw,
            components,
        )

    def score_flat(
        self, ro: Rollout, raw: torch.Tensor, components: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, TransitionBatch]:
        """Advantages of a flat rollout scored ``raw [B, R]`` (with its ``components``), updating the
        statistics store and the logs: ``(total reward [B], advantages [B], the transitions to train)``."""
        total = self.combine(raw)
        result = self.advantages(raw, ro.group_index, ro.prompts)
        adv = result.adv
        self._log_rewards(total, raw, components, ro.group_index)
        counts = torch.bincount(ro.group_index)
        self.metrics.add("rollouts/per_prompt_min", counts.min().float())
        self.metrics.add("rollouts/per_prompt_max", counts.max().float())
        trans = ro.transitions(self._train_steps(ro.sde_steps, ro.latents.shape[0]))
        if result.keep is not None:  # samples the estimator leaves out of the loss (MC-GRPO's pivot)
            trans = trans.select(torch.nonzero(result.keep[trans.sample_index]).flatten())
        return total, adv, trans

    @torch.no_grad()
    def transition_log_probs(
        self, trans: TransitionBatch, guidance_scale: float | None = None
    ) -> torch.Tensor:
        """``[N]`` float32 log-probs (on the CPU) of the transitions' actions under the weights in place, in
        minibatches, at ``guidance_scale`` (None: the scale they were sampled with)."""
        self.adapter.transformer.eval()
        log_probs = torch.cat(
            [
                rescore(self.adapter, trans.select(idx), guidance_scale)[0].float().cpu()
                for idx in torch.arange(len(trans)).split(self.cfg.trainer.minibatch_size)
            ]
        )
        scale = trans.guidance_scale if guidance_scale is None else guidance_scale
        self.nfe_total += len(trans) * self.adapter.nfe_per_sample(scale)
        return log_probs

    @torch.no_grad()
    def _stale_weights(
        self, trans: TransitionBatch, lags: torch.Tensor
    ) -> tuple[TransitionBatch, torch.Tensor]:
        """Re-score the transitions of stale samples (``lags [N] > 0``) under the current weights: returns the
        batch with those log-probs as the ratio's old log-probs (the proximal policy of decoupled PPO, AReaL
        arXiv 2505.24298 eq. 5), and ``[N]`` truncated importance weights of the loss terms (1 at lag 0)."""
        stale = torch.nonzero(lags > 0).flatten()
        current = trans.log_probs.clone()  # behaviour log-probs: the current policy's at lag 0
        if stale.numel():
            current[stale] = self.transition_log_probs(trans.select(stale))
        cap = self.cfg.pool.tis_cap
        weights = loss_lib.stale_sample_weights(current, trans.log_probs, lags, cap)
        ratio = torch.exp(current - trans.log_probs)
        self.metrics.add("tis/weight_mean", weights.mean(), count=len(trans))
        self.metrics.add("tis/clipped_frac", ((ratio > cap) & (lags > 0)).float().mean(), count=len(trans))
        return replace(trans, log_probs=current), weights

    def _score_trees(self, samples: FlowSamples) -> StepBatch:
        """Steps 3-4 on trees (one per prompt, per kept seed when exploring): node advantages by depth
        (BranchGRPO), pruned."""
        t = self.cfg.tree
        tr, explored = samples.rollout, samples.explored
        raw, components = self.score(tr.images, tr.leaf_prompts)
        total = self.combine(raw)
        if explored is not None:
            per_tree = (
                torch.zeros(len(samples.prompts)).index_add_(0, tr.leaf_tree, total)
                / tr.tree.leaves_per_tree()
            )
            rho = spearman_within(explored.chosen_preview_rewards, per_tree, explored.chosen.shape[1])
            self.metrics.add("explore/spearman", rho)
        # per-leaf advantages (for the NFT objective, which trains on final images); updates the store
        leaf_adv = self.advantages(raw, tr.leaf_tree, tr.leaf_prompts).adv
        self._log_rewards(total, raw, components, tr.leaf_tree)
        edge_logprob = None
        if t.fusion == "path_prob":
            # the log-prob of the draw that created each node = its first transition
            first = torch.full((tr.parent.numel(),), tr.transitions.log_probs.numel(), dtype=torch.long)
            first = first.scatter_reduce(
                0, tr.transitions.sample_index, torch.arange(len(tr.transitions)), reduce="amin"
            )
            edge_logprob = torch.where(
                first < len(tr.transitions),
                tr.transitions.log_probs[first.clamp(max=len(tr.transitions) - 1)],
                torch.zeros(()),
            )
        node_adv, _ = adv_lib.tree_depthwise(
            tr.node_rewards(total), tr.parent, fusion=t.fusion, edge_logprob=edge_logprob
        )
        node_adv = adv_lib.clip_advantages(node_adv, self.cfg.trainer.adv_clip_max)
        keep = prune_transitions(tr, node_adv, depths=t.train_depths, width=t.width)
        steps = self._train_steps(samples.sampling.sde_steps())
        keep = keep[torch.isin(tr.transitions.step_index[keep], steps)]
        trans = tr.transitions.select(keep)
        self.metrics.add("tree/nodes", float(tr.parent.numel()))
        self.metrics.add("tree/trained_transitions", float(len(trans)))
        return StepBatch(
            trans,
            node_adv[trans.sample_index],
            tr.images,
            tr.leaf_prompts,
            tr.final_latents,
            tr.cond.select(tr.leaf_tree),
            leaf_adv,
            tr.nfe,
            raw,
            components,
        )

    def _train_steps(self, sde_steps: torch.Tensor, num_samples: int | None = None) -> torch.Tensor:
        """SDE steps whose transitions are trained this step (timestep subsampling): ``int(fraction * n)`` of the
        ``n`` SDE steps (without the last with ``trainer.timestep_skip_last``), at least one, drawn at random or
        the first ones, ``[K]``; with ``timestep_selection: per_sample`` a draw for each of ``num_samples``
        samples, ``[num_samples, K]``."""
        t = self.cfg.trainer
        sde = torch.nonzero(sde_steps).flatten()
        if t.timestep_skip_last and sde.numel() > 1:
            sde = sde[:-1]
        keep = max(1, int(t.timestep_fraction * sde.numel()))
        if t.timestep_selection == "first":
            return sde[:keep]
        if t.timestep_selection == "per_sample":
            if num_samples is None:
                raise ValueError("timestep_selection=per_sample needs the number of samples")
            draws = torch.rand((num_samples, sde.numel()), generator=self.generator).argsort(dim=1)[:, :keep]
            return sde[draws.sort(dim=1).values]  # [num_samples, K]
        order = torch.randperm(sde.numel(), generator=self.generator)[:keep]
        return sde[order.sort().values]

    def _check_fsdp(self) -> None:
        """FSDP shards the transformer, so every forward is a collective: only settings under which every rank
        makes the same forwards, and nothing needs whole weights mid-step, are accepted."""
        cfg, refused = self.cfg, []
        if cfg.model.lora is not None:
            refused.append(
                "LoRA (model.lora): the trainable state is small and sharding the frozen base only adds "
                "all-gathers; launch with configs/accelerate/ddp.yaml"
            )
        if cfg.explore.enabled:
            refused.append("explore.enabled: the quantized explorer copies whole weights")
        if len(self.adapter.trained_parts()) > 1:
            refused.append(
                "several trained denoisers (model.options.trained_expert: both): each is called outside the "
                "sharded root; train one expert per run, or both with LoRA under DDP"
            )
        if cfg.pool.enabled:
            refused.append("pool.enabled: pool workers receive whole weights")
        if cfg.trainer.guidance_distill.refresh_every is not None:
            refused.append(
                "trainer.guidance_distill.refresh_every: the teacher is refreshed from whole weights"
            )
        if cfg.sampling.rollout != "flat":
            refused.append("sampling.rollout=branch: pruned trees train a per-rank number of transitions")
        if not self.objective.same_count_per_rank:
            refused.append(f"trainer.objective={self.objective.name}: a per-rank number of samples")
        if cfg.trainer.drop_zero_advantage and self.objective.trains_on == "transitions":
            refused.append("trainer.drop_zero_advantage: a per-rank number of transitions")
        if refused:
            raise ValueError(
                "FSDP launch (configs/accelerate/fsdp.yaml) of the flow trainer does not support: "
                + "; ".join(refused)
            )

    # ------------------------------------------------------------------ the update path of the objectives
    # (mmrl/flow/objectives/: each objective's update calls these, so minibatching, gradient accumulation, the
    # reference KL, the guidance distillation and the optimizer steps are the same for every objective)
    def minibatches(self, n: int) -> Iterator[tuple[torch.Tensor, float]]:
        """Shuffled minibatches of ``n`` items, each with its loss scale ``its items / the items accumulated
        into its optimizer step``, so that the callers' minibatch means add up to the mean over the step's items
        (a short last minibatch weighs its items like the others); the optimizer steps themselves are taken here,
        once the caller has run the backward of the step's last minibatch (``gradient_accumulation`` minibatches
        per step; 0: the minibatches in ``updates_per_step`` consecutive parts of ``ceil(turns / updates)``, one
        step after each).

        Under data parallelism every rank takes the largest rank's number of turns; a rank without items for
        a turn yields nothing for it but still takes the turn's optimizer step, so that the gradient
        averaging of each step pairs up across ranks (a rank with no items at all: :meth:`idle_update`)."""
        t = self.cfg.trainer
        batches = list(torch.randperm(n, generator=self.generator).split(t.minibatch_size)) if n else []
        turns = self.dist.max_over_ranks(len(batches))
        accum = t.gradient_accumulation or -(-turns // t.updates_per_step)
        for i in range(turns):
            if i < len(batches):
                group_start = i - i % accum
                group_items = sum(len(batch) for batch in batches[group_start : group_start + accum])
                yield batches[i], len(batches[i]) / group_items
            elif self.dist.fsdp:
                raise RuntimeError(
                    "FSDP ranks hold different numbers of minibatches; their forwards would not pair up"
                )
            if (i + 1) % accum == 0 or i + 1 == turns:
                self.step_optimizer()

    def idle_update(self, passes: int = 1) -> None:
        """This rank has nothing to train on: take part in the other ranks' optimizer steps (none alone) for
        each of the ``passes`` passes they make over their items (``trainer.ppo_epochs`` for GRPO)."""
        for _ in range(passes):
            for _ in self.minibatches(0):
                pass

    def step_optimizer(self) -> None:
        """One optimizer step on the accumulated gradients at this training step's learning rate (clipped to
        ``trainer.max_grad_norm``)."""
        t = self.cfg.trainer
        # a function of the training step, so a resumed run continues a cosine exactly
        lr = learning_rate(self.step, t.lr, t.steps, schedule=t.lr_schedule)
        self.optimizer_step(self.optimizer, self.trainable, t.max_grad_norm, lr=lr)

    def regression_points(
        self,
        x0: torch.Tensor,
        groups: torch.Tensor,
        num_timesteps: int | None = None,
        draw_steps: Callable[[int], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward-process points for the likelihood-free objectives: ``T`` noise levels per image, drawn from the
        sigmas the sampler visits. (Uniform sigmas put most of the loss where the model was never trained or used:
        near sigma = 0 the target ``eps - x0`` is unpredictable noise, and its gradients wrecked the shapes model in
        a few dozen steps.)

        ``T`` is ``num_timesteps`` (default ``trainer.nft_timesteps``); ``draw_steps(n_owners) -> [T, n_owners]``
        picks the sampler steps of the draws (default: uniform over the steps, each of the ``T`` independently, so an
        image can get a step twice where DiffusionNFT's reference code draws ``T`` distinct steps; AWM stratifies
        them).

        Returns ``(rows [B*T] image index, sigma [B*T], x_t, v* = eps - x0)``.
        """
        schedule = rollout_sigmas(self.adapter, self.cfg.sampling.rollout_settings(None)).float().cpu()
        schedule = schedule[schedule > 0]
        trained_steps = torch.nonzero(self.adapter.trains_at(schedule)).flatten()
        t = self.cfg.trainer
        timesteps = num_timesteps or t.nft_timesteps
        rows = torch.arange(x0.shape[0]).repeat(timesteps)
        # a draw per (group, timestep) when the group shares them, else per (image, timestep)
        owner = groups if t.shared_regression_noise else torch.arange(x0.shape[0])
        n_owners = int(owner.max()) + 1
        draw = owner.repeat(timesteps) + n_owners * torch.arange(timesteps).repeat_interleave(x0.shape[0])
        n_draws = n_owners * timesteps
        if draw_steps is None:
            pick = torch.randint(trained_steps.numel(), (n_draws,), generator=self.generator)
            steps = trained_steps[pick]
        else:
            steps = draw_steps(n_owners).flatten()  # [T, n_owners] -> timestep-major, as `draw` indexes
        sigma = schedule[steps][draw]
        eps = torch.randn((n_draws, *x0.shape[1:]), generator=self.generator)[draw]
        sig = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x_t, target = (1 - sig) * x0[rows] + sig * eps, eps - x0[rows]
        # drawn steps of an expert that is not trained (Wan2.2) carry no gradient: left out
        keep = self.adapter.trains_at(sigma)
        return rows[keep], sigma[keep], x_t[keep], target[keep]

    def old_policy_decay(self, step: int) -> float:
        """Decay of the old policy's soft update after training step ``step``: ``trainer.old_policy_decay``, or
        DiffusionNFT's ramp ``min(rate * max(0, step - flat_steps), old_policy_decay)``."""
        t = self.cfg.trainer
        if t.old_policy_decay is None:
            raise ValueError("trainer.old_policy_decay is null: the rollouts use the current weights")
        if t.old_policy_decay_rate is None:
            return t.old_policy_decay
        return min(t.old_policy_decay_rate * max(0, step - t.old_policy_decay_flat_steps), t.old_policy_decay)

    def sampling_weights(self) -> AbstractContextManager[None]:
        """The sampling ("old") policy's weights, swapped in for the block.

        With ``trainer.old_policy_decay`` the rollouts, and DiffusionNFT's ``v_old``, come from an EMA of the
        trained weights (DiffusionNFT's soft update of the old policy). NFT's loss pulls the trained weights toward
        ``v_old`` by ``beta^2 ||v - v_old||^2``; with ``v_old`` the current weights that pull is zero at every
        step, and the noise of small batches drifted the shapes model off within 100 steps. Without the option the
        block runs on the current weights (fully on-policy).
        """
        return self.old_policy.swapped() if self.old_policy is not None else nullcontext()

    @torch.no_grad()
    def sampling_velocities(self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The sampling ("old") policy's velocities ``[N, ...]`` (on the CPU) at the regression points ``x_t [N,
        ...]``, ``sigma [N]``, with the regression's guidance, in minibatches; counted in the NFE."""
        guidance = self.regression_guidance(cond)
        with self.sampling_weights():
            self.adapter.transformer.eval()
            velocities = torch.cat(
                [
                    self.adapter.velocity(
                        x_t[idx].to(self.device), sigma[idx].to(self.device), cond.select(idx), guidance
                    ).cpu()
                    for idx in torch.arange(x_t.shape[0]).split(self.cfg.trainer.minibatch_size)
                ]
            )
        self.nfe_total += self.adapter.nfe_per_sample(guidance) * x_t.shape[0]
        return velocities

    def trains_as_sampled(self, guidance_scale: float) -> bool:
        """Whether samples drawn at ``guidance_scale`` are trained with the velocity they were sampled with:
        under ``trainer.train_cfg``, or when that velocity is one forward (no CFG pass: a scale of 1, or an
        embedded guidance input as guidance-distilled FLUX's); else with the CFG-free velocity."""
        return self.cfg.trainer.train_cfg or not self.adapter.uses_cfg(guidance_scale)

    def regression_guidance(self, cond: Conditioning) -> float:
        """Guidance of the regressed velocity. With ``train_cfg`` it is the guided velocity the images were sampled
        with: regressing the conditional velocity alone on CFG samples teaches it the guidance, which sampling
        then applies again (w * w), and the shapes model collapsed to 0% within 50 steps that way. A family
        whose guidance is an input of one forward (guidance-distilled FLUX) regresses at the sampled scale
        either way."""
        w = self.cfg.sampling.guidance_scale
        guided = self.adapter.uses_cfg(w)  # a CFG pass needs the negative prompt's conditioning
        return w if self.trains_as_sampled(w) and (not guided or cond.uncond is not None) else 1.0

    def regress(
        self,
        x_t: torch.Tensor,
        sigma: torch.Tensor,
        cond: Conditioning,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Minibatched velocity regression ``loss_fn(v [b, ...], idx [b]) -> [b]``, plus ``beta`` times the squared
        distance to the reference velocity at the same points (the KL of the Gaussian policies these velocities
        define, up to a per-sigma constant, as GRPO's KL on the SDE means), plus the guidance distillation term
        (``trainer.guidance_distill``); the optimizer steps as :meth:`minibatches` takes them."""
        t = self.cfg.trainer
        guidance = self.regression_guidance(cond)
        nfe_each = self.adapter.nfe_per_sample(guidance)  # (2 when the regressed velocity is a CFG pass)
        distill_weight = t.guidance_distill.weight_at(self.step, t.steps)
        for idx, scale in self.minibatches(x_t.shape[0]):
            x_mb, sigma_mb, cond_mb = x_t[idx].to(self.device), sigma[idx].to(self.device), cond.select(idx)
            if t.beta > 0:
                self.adapter.transformer.eval()
                with torch.no_grad(), self.reference_policy():
                    v_ref = self.adapter.velocity(x_mb, sigma_mb, cond_mb, guidance)
                self.nfe_total += nfe_each * len(idx)
            if distill_weight > 0:
                v_teacher = self.teacher_velocity(x_mb, sigma_mb, cond_mb)
            self.adapter.transformer.train()
            v = self.adapter.velocity(x_mb, sigma_mb, cond_mb, guidance)
            loss = loss_fn(v, idx).mean()
            if t.beta > 0:
                kl = ((v - v_ref) ** 2).flatten(1).mean(1).mean()
                loss = loss + t.beta * kl
                self.metrics.add("policy/kl", kl, count=len(idx))
            if distill_weight > 0:
                gap = loss_lib.guidance_distillation_loss(v, v_teacher).mean()
                loss = loss + distill_weight * gap
                self.metrics.add("policy/guidance_gap", gap, count=len(idx))
                self.metrics.add("policy/guidance_weight", distill_weight, count=len(idx))
            (loss * scale).backward()
            self.metrics.add("loss", loss, count=len(idx))
        self.nfe_total += nfe_each * x_t.shape[0]

    @torch.no_grad()
    def teacher_velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The teacher's (:meth:`teacher_policy`) guided velocity ``[b, ...]`` at the points ``x [b, ...]``, at
        ``trainer.guidance_distill.guidance_scale`` on the negative prompt, guided as the family's pipeline guides
        (:meth:`FlowAdapter.guide`: Qwen-Image rescales to the conditional velocity's norm)."""
        assert self.distill_uncond is not None  # set in setup when the distillation is on
        uncond = self.distill_uncond.select([0] * x.shape[0]).cond
        scale = self.cfg.trainer.guidance_distill.guidance_scale
        self.adapter.transformer.eval()
        with self.teacher_policy():
            guided = self.adapter.velocity(x, sigma, Conditioning(cond.cond, uncond), scale)
        self.nfe_total += self.adapter.nfe_per_sample(scale) * x.shape[0]
        return guided

    def train_step(self) -> dict[str, float]:
        if self.refresh_teacher():
            self.metrics.add("policy/teacher_refreshed", 1.0)
        batch = self.collect()
        start = time.perf_counter()
        self.objective.update(self, batch)
        if self.ema is not None and (self.step + 1) % self.cfg.trainer.ema_every == 0:
            # once per training step, however many optimizer steps it took; warmed up over training steps, so
            # the first evaluations average trained weights, not the start
            self.ema.update(num_updates=self.step)
        if self.old_policy is not None:
            self.old_policy.update(decay=self.old_policy_decay(self.step))
        self.metrics.add("time/train_s", time.perf_counter() - start)
        if self.run is not None and (self.step + 1) % self.cfg.trainer.sample_every == 0:
            images, prompts = batch.images[:16], batch.prompts[:16]
            components = {name: scores[:16] for name, scores in batch.reward_components.items()}
            records = sample_records(
                prompts, batch.rewards[:16], components, self.cfg.rewards, self.reward_weights
            )
            for record, adv in zip(records, batch.sample_adv[:16].tolist(), strict=True):
                record["advantage"] = adv
            self.run.save_samples(self.step + 1, "train", records, images)
        metrics = self.metrics.reduce()
        metrics["nfe/total"] = float(self.nfe_total)
        return metrics

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def generate(self, prompts: list[str], images_per_prompt: int = 1) -> Rollout:
        """Deterministic (ODE) samples from a fixed noise: the evaluation protocol."""
        # one noise per image (the fixed evaluation noise), whatever the rollouts share
        s = self.cfg.sampling
        config = s.rollout_settings((0, 0), num_steps=s.eval_num_steps, shared_noise=False)
        self.adapter.transformer.eval()
        return rollout(
            self.adapter,
            prompts,
            images_per_prompt,
            config,
            generator=torch.Generator().manual_seed(EVAL_SEED),
        )

    def evaluation_weights(self) -> AbstractContextManager[None]:
        """The weights evaluated and exported, swapped in for the block: the EMA of the trained weights under
        ``trainer.ema_decay``, else the trained weights themselves."""
        return self.ema.swapped() if self.ema is not None else nullcontext()

    def evaluate(self, live: bool = False) -> dict[str, float]:
        """Held-out scores of the evaluation weights (:meth:`evaluation_weights`); ``live``: of the trained
        weights themselves even under ``trainer.ema_decay`` (what the EMA changes; no samples are saved then)."""
        t = self.cfg.trainer
        prompts = self.eval_pool[: t.eval_prompts]
        with nullcontext() if live else self.evaluation_weights():
            ro = self.generate(prompts, t.eval_images_per_prompt)
        raw, components = self.score(ro.images, ro.prompts, evaluation=True)
        means = reward_means(raw, self.eval_weights, self.eval_specs, components)
        out = {f"eval/{key}": value for key, value in means.items()}
        if self.run is not None and not live:
            n = min(64, len(ro.prompts))
            records = sample_records(
                ro.prompts[:n],
                raw[:n],
                {k: v[:n] for k, v in components.items()},
                self.eval_specs,
                self.eval_weights,
            )
            self.run.save_samples(self.step, "eval", records, ro.images[:n])
        with nullcontext() if live else self.evaluation_weights():
            extra = self.evaluate_extra_sets(t.eval_images_per_prompt)
        for name, means in extra.items():
            out.update({f"eval/{name}/{key}": value for key, value in means.items()})
        return out

    def evaluate_extra_sets(self, images_per_prompt: int) -> dict[str, dict[str, float]]:
        """Scores of the weights in place on each extra held-out set (``extra_eval``): per set the weighted
        ``reward_mean``, each reward's ``<key>/mean`` and each component's mean."""
        out = {}
        for name, (prompts, specs, rewards, weights) in self.extra_eval.items():
            ro = self.generate(prompts, images_per_prompt)
            raw, components = self.score_with(specs, rewards, ro.images, ro.prompts)
            out[name] = reward_means(raw, weights, specs, components)
        return out

    # ------------------------------------------------------------------ state
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trained parameters as whole CPU tensors (gathered from the ranks' shards under FSDP)."""
        return full_state_dict(self.adapter.transformer)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.base_state(),
            "nfe_total": self.nfe_total,
            "trainable": self.trainable_state(),
            "optimizer": optimizer_state(self.adapter.transformer, self.optimizer),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "old_policy": self.old_policy.state_dict() if self.old_policy is not None else None,
            "distill_teacher": (
                full_state_dict(self.distill_teacher, trainable_only=False)
                if self.distill_teacher is not None
                else None
            ),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        load_trainable(self.adapter.transformer, state["trainable"])
        self.load_base_state(state)
        self.nfe_total = int(state["nfe_total"])
        load_optimizer_state(self.adapter.transformer, self.optimizer, state["optimizer"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.load_state_dict(state["ema"])
        if self.old_policy is not None and state.get("old_policy") is not None:
            self.old_policy.load_state_dict(state["old_policy"])
        if self.distill_teacher is not None and state.get("distill_teacher") is not None:
            load_trainable(self.distill_teacher, state["distill_teacher"])

    def save_lora(self, directory: Path) -> None:
        """The LoRA in diffusers/PEFT format: ``pipe.load_lora_weights(directory)`` loads it on the base model
        (the adapter's :meth:`~pipelines.flow.adapters.FlowAdapter.save_lora` says how for its family)."""
        self.adapter.save_lora(directory)

    def save_transformer(self, directory: Path, trainable: dict[str, torch.Tensor]) -> None:
        """The fully fine-tuned denoiser in diffusers format, one folder per trained pipeline component
        (``directory/transformer``; Wan2.2 also ``transformer_2``) with ``config.json`` and
        ``diffusion_pytorch_model.safetensors``: ``SD3Transformer2DModel.from_pretrained(folder)`` (or the
        family's class) loads it, and ``pipe.transformer = ...`` puts it into the base pipeline. ``trainable`` are
        the whole trained tensors (gathered from the shards under FSDP); buffers come from the model itself."""
        from safetensors.torch import save_file

        names = {id(module): name for name, module in self.adapter.transformer.named_modules()}
        for component, model in self.adapter.trained_parts().items():
            prefix = names[id(model)] + "." if names[id(model)] else ""
            own = {name.removeprefix(prefix): t for name, t in trainable.items() if name.startswith(prefix)}
            weights = {name: t.detach().cpu() for name, t in model.state_dict().items() if name not in own}
            weights.update(own)
            folder = directory / component
            folder.mkdir()
            save_file(
                {name: t.contiguous() for name, t in weights.items()},
                folder / "diffusion_pytorch_model.safetensors",
            )
            model.save_config(folder)
            # FSDP2 swapped in a subclass named FSDP<Class>: record the class diffusers knows
            if self.dist.fsdp:
                config_file = folder / "config.json"
                config = json.loads(config_file.read_text())
                config["_class_name"] = config["_class_name"].removeprefix("FSDP")
                config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def save_checkpoint(self) -> None:
        """Rank 0 writes; under data parallelism every rank first gathers the state with it (its RNG states, and
        its shards under FSDP: collectives)."""
        if not self.checkpoint_wanted():
            return
        state = self.state_dict()

        def extra(directory: Path) -> None:  # what diffusers loads, beside the trainer's state.pt
            # the evaluated weights (the EMA under trainer.ema_decay); state.pt keeps the live ones to resume
            if self.cfg.model.lora is not None:
                with self.evaluation_weights():
                    self.save_lora(directory / "adapter")
            else:
                self.save_transformer(directory, exported_weights(state))

        self.write_checkpoint(state, extra)


def make_trainable(transformer: torch.nn.Module, lora: FlowLora | None, master_dtype: torch.dtype) -> None:
    """Make the frozen denoiser ``transformer`` trainable as the recipe says, its trained parameters in
    ``master_dtype`` (``model.master_weight_dtype``) or wider: a LoRA adapter (peft, through diffusers' ``add_adapter``;
    the base weights stay frozen in their dtype) or, with ``lora`` None, every weight (buffers keep theirs)."""
    if lora is None:
        transformer.requires_grad_(True)
    else:
        from peft import LoraConfig

        transformer.add_adapter(
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                init_lora_weights="gaussian",
            )
        )
    # master weights: in bfloat16 an AdamW step below 2^-9 of a weight rounds away, so by default the trained
    # parameters are float32 on a bfloat16 model (Flow-Factory's master weights; peft's get_peft_model keeps LoRA
    # factors so, as Flow-GRPO's LoRA and the VLM trainer's); the forward casts its inputs to the transformer's
    # dtype, and model.compute_dtype() computes in model.dtype under autocast. Only ever widened: the modules
    # diffusers keeps in float32 in a bfloat16 model (Wan's norms and embedders) stay float32 in pure bfloat16.
    master_bits = torch.finfo(master_dtype).bits
    for param in transformer.parameters():
        if param.requires_grad and torch.finfo(param.dtype).bits < master_bits:
            param.data = param.data.to(master_dtype)


def start_copies(cfg: FlowGRPOConfig) -> tuple[str, ...]:
    """The frozen copies of the start weights that full fine-tuning keeps while it trains: ``reference`` for the
    KL (``trainer.beta > 0``) and the frozen guidance-distillation teacher, ``distill_teacher`` for a teacher
    refreshed every ``trainer.guidance_distill.refresh_every`` steps. A LoRA run keeps none: its reference and
    teacher are the transformer with the adapter switched off."""
    if cfg.model.lora is not None:
        return ()
    distill = cfg.trainer.guidance_distill
    frozen_teacher = distill.weight > 0 and distill.refresh_every is None
    copies = ("reference",) if cfg.trainer.beta > 0 or frozen_teacher else ()
    return copies + (("distill_teacher",) if distill.refresh_every is not None else ())


def _build_rewards(specs: Sequence[Any]) -> tuple[list[Any], torch.Tensor]:
    """The rewards of ``specs`` (``RewardSpec``s) built from the registry, and their ``[R]`` weights."""
    rewards = [reward_registry.build(spec.name, **spec.options) for spec in specs]
    return rewards, torch.tensor([spec.weight for spec in specs], dtype=torch.float32)


def reward_means(
    raw: torch.Tensor, weights: torch.Tensor, specs: Sequence[Any], components: dict[str, torch.Tensor]
) -> dict[str, float]:
    """An evaluation's means: ``reward_mean`` (of ``raw [N, R] @ weights [R]``), each reward's ``<key>/mean`` and
    each component's (``reward/<name>``, logged as ``<name>``)."""
    means = {"reward_mean": float((raw @ weights).mean())}
    means.update({f"{spec.key}/mean": float(raw[:, k].mean()) for k, spec in enumerate(specs)})
    means.update({name.removeprefix("reward/"): float(value.mean()) for name, value in components.items()})
    return means


def exported_weights(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The weights a checkpoint's ``state`` (:meth:`FlowGRPOTrainer.state_dict`) was evaluated with: its EMA
    (``trainer.ema_decay``) when it holds one, else its trained weights."""
    return state["ema"] if state.get("ema") is not None else state["trainable"]


def main(cfg: FlowGRPOConfig) -> dict[str, float]:
    """Train end to end; returns the final metrics."""
    return run_recipe(cfg, FlowGRPOTrainer)


def evaluate(
    cfg: FlowGRPOConfig,
    prompts_file: str | None,
    out_dir: Path,
    checkpoint: Path | None,
    images_per_prompt: int,
) -> dict[str, float]:
    """Score the base model, or a checkpoint's weights (its LoRA, or its fully fine-tuned transformer; its EMA when
    the run kept one) on it, on a prompt file; write scores and a grid.

    Writes ``out_dir/scores.jsonl`` (prompt, image index, every reward and component), ``out_dir/summary.json``
    (the means of each) and ``out_dir/grid.png``.

    Raises:
        FileNotFoundError: ``model.lora`` is set and ``checkpoint`` has no ``adapter/`` folder.
    """
    if checkpoint is not None and cfg.model.lora is not None and not (checkpoint / "adapter").is_dir():
        # before the model loads: the LoRA is read from that folder after it
        raise FileNotFoundError(
            f"{checkpoint} has no LoRA folder ({checkpoint / 'adapter'}, holding "
            "pytorch_lora_weights.safetensors) though model.lora is set: a LoRA run's checkpoint holds "
            "one; a full fine-tune's is evaluated with model.lora=null"
        )
    if prompts_file is not None:
        cfg = cfg.model_copy(update={"eval_prompts": prompts_file})
    trainer = FlowGRPOTrainer(cfg, run=None)
    trainer.setup(for_training=False)
    if checkpoint is not None:
        if cfg.model.lora is None:
            load_trainable(
                trainer.adapter.transformer,
                exported_weights(load_checkpoint(checkpoint, require=("trainable",))),
            )
        else:
            trainer.adapter.load_lora(checkpoint / "adapter")
    prompts = trainer.eval_pool
    ro = trainer.generate(prompts, images_per_prompt)
    raw, components = trainer.score(ro.images, ro.prompts, evaluation=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = sample_records(ro.prompts, raw, components, trainer.eval_specs, trainer.eval_weights)
    with open(out_dir / "scores.jsonl", "w") as f:
        for i, record in enumerate(records):
            f.write(json.dumps({"image": i, **record}) + "\n")
    summary = {
        "checkpoint": str(checkpoint) if checkpoint else None,
        "prompts": len(prompts),
        "images": len(ro.prompts),
    }
    # reward_mean, <reward>_mean, and each reward's components (the shapes verifier's object / count / colour /
    # position) as <component>_mean, as in scores.jsonl; each extra set's the same under its name
    sets = {"": reward_means(raw, trainer.eval_weights, trainer.eval_specs, components)}
    sets.update({f"{name}/": means for name, means in trainer.evaluate_extra_sets(images_per_prompt).items()})
    for prefix, means in sets.items():
        summary.update(
            {
                prefix + (key if key == "reward_mean" else key.removesuffix("/mean") + "_mean"): value
                for key, value in means.items()
            }
        )
    write_summary_json(out_dir / "summary.json", summary)
    make_grid(ro.images[:256]).save(out_dir / "grid.png")
    return summary
