"""What every recipe's trainer does the same way, written once: seeding, distributed setup, the optimizer step,
metrics, state, save, resume and cleanup.

A recipe's trainer subclasses :class:`TrainerBase` and keeps its own model building, rollouts and update; the
lifecycle stays the one every trainer shows (torchtune's recipes): ``__init__`` -> ``setup()`` -> ``train()`` ->
``save_checkpoint()`` / ``cleanup()``, run by :func:`mmrl.loop.run_recipe`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch

from mmrl.checkpoint import load_checkpoint, save_checkpoint
from mmrl.config import Config
from mmrl.core import allocation as alloc_lib
from mmrl.core.allocation import PromptPasses
from mmrl.core.stats import PromptStats
from mmrl.device import resolve_device
from mmrl.distributed import all_reduce_grads, full_tensor, init_distributed
from mmrl.loop import train_loop
from mmrl.memory import GIB, MemoryEstimate, check_fits
from mmrl.rollouts import RolloutSource
from mmrl.run import MetricAccumulator, Run, resume_checkpoint
from mmrl.seeding import get_rng_state, request_seed, seed_everything, set_rng_state
from pipelines.threads import set_cpu_threads, stop_adapting

__all__ = ["TrainerBase"]

logger = logging.getLogger(__name__)


class TrainerBase:
    """The shared half of a trainer.

    Subclasses set :attr:`show` (progress-bar metrics), build ``self.stats`` (a :class:`PromptStats`; supervised
    recipes have none) in their ``setup``, implement ``train_step()``, ``evaluate()``, ``state_dict()`` / ``load_state()`` (starting from
    :meth:`base_state` / :meth:`load_base_state`) and ``save_checkpoint()`` (through :meth:`write_checkpoint`).

    Attributes:
        cfg: the recipe's config; ``cfg.run`` is the run section, ``cfg.trainer.steps`` / ``eval_every`` the loop.
        run: the run directory (``None`` on ranks other than 0, and for evaluation-only use).
        step: training steps done.
        metrics: the per-step metric accumulator (reduced once per step).
        rollout_source: where the trainer's rollouts come from (a :class:`~mmrl.rollouts.RolloutSource`: in the
            loop or from a pool), closed by :meth:`cleanup`.
    """

    show: tuple[str, ...] = ("reward/mean",)
    stats: PromptStats | None = None

    def __init__(self, cfg: Config, run: Run | None = None) -> None:
        self.cfg = cfg
        self.run = run
        self.step = 0
        self.metrics = MetricAccumulator()
        self.rollout_source: RolloutSource | None = None
        self.prompt_passes = PromptPasses()

    # ------------------------------------------------------------------ setup
    def setup_runtime(self, device: str = "cpu") -> None:
        """Process group (one process per GPU under ``accelerate launch``), seeds (``run.seed + rank``), CPU
        threads (``run.threads``, ``run.threads_policy``) and the device (under data parallelism each rank's own
        GPU)."""
        self.dist = init_distributed()
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.generator = seed_everything(self.cfg.run.seed + self.rank)
        set_cpu_threads(self.cfg.run.threads, self.cfg.run.threads_policy)
        self.device = resolve_device(device)
        if self.dist.active and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())

    def check_memory(self, estimate: Callable[[Any], MemoryEstimate]) -> None:
        """On a GPU, before any weight is loaded: stop when the recipe's weights and training state alone
        (``estimate(cfg)``, what ``mmrl memory`` prints) exceed the GPU's free memory; log the figure otherwise.
        An estimate that cannot be made (a model whose configs cannot be read, offline) only logs why."""
        if self.device.type != "cuda":
            return
        try:
            memory = estimate(self.cfg)
        except Exception as err:  # an estimate is advice: whatever stops it must not stop the run
            logger.warning("no memory estimate before loading the model (%s: %s)", type(err).__name__, err)
            return
        free, total = torch.cuda.mem_get_info(self.device)
        peak = check_fits(memory, free, total, self.world_size if self.dist.fsdp else 1)
        logger.info(
            "weights and training state: %.1f GiB per GPU before activations (%.1f GiB free)",
            peak / GIB,
            free / GIB,
        )

    def resume(self, map_location: str | torch.device = "cpu") -> None:
        """Load the run's latest checkpoint when ``run.resume`` is set (every rank of a data-parallel launch finds
        rank 0's), and set aside metric lines logged after it."""
        ckpt = resume_checkpoint(self.cfg.run) if self.checkpoint_wanted() else None
        if ckpt is None:
            return
        state = load_checkpoint(ckpt, map_location=map_location)
        try:
            self.load_state(state)
        except KeyError as err:  # (a state dict's own size mismatch names its tensors; this names nothing)
            raise ValueError(f"{ckpt} has no {err}: the checkpoint of another recipe or model") from err
        if self.run is not None:
            self.run.truncate_metrics(self.step)
        logger.info("resumed from %s at step %d", ckpt, self.step)

    # ------------------------------------------------------------------ prompts
    def select_prompts(self, pool: Sequence[Hashable], k: int) -> list[Hashable]:
        """``k`` distinct prompts of ``pool`` by ``allocation.selection`` (:func:`mmrl.core.allocation.sample_prompts`
        on the statistics store, this rank's generator, and the pass walked by ``shuffled``)."""
        return alloc_lib.sample_prompts(
            self.stats,
            pool,
            k,
            method=self.cfg.allocation.selection,
            generator=self.generator,
            passes=self.prompt_passes,
        )

    # ------------------------------------------------------------------ update
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        max_grad_norm: float,
        lr: float | None = None,
    ) -> None:
        """Average the gradients over data-parallel ranks (FSDP reduces its shards itself), clip them to
        ``max_grad_norm`` (logged as ``train/grad_norm``), set ``lr`` when given (a schedule), step, zero."""
        if not self.dist.fsdp:
            all_reduce_grads(list(params), self.dist.world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        self.metrics.add("train/grad_norm", full_tensor(grad_norm))  # (a DTensor under FSDP)
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ loop
    def train(self) -> dict[str, float]:
        """:func:`mmrl.loop.train_loop` from the current step to ``trainer.steps`` (``eval_every`` 0: evaluate at
        the end only)."""
        return train_loop(
            self,
            self.cfg.trainer.steps,
            self.cfg.trainer.eval_every or self.cfg.trainer.steps,
            self.cfg.run,
            self.run,
            show=self.show,
            main_process=self.dist.is_main,
        )

    # ------------------------------------------------------------------ state
    def base_state(self) -> dict[str, Any]:
        """What every checkpoint holds: the step, the statistics store, the RNG states and the prompt passes
        (every rank's)."""
        rng = get_rng_state({"train": self.generator})
        passes = self.prompt_passes.state_dict()
        return {
            "step": self.step,
            "stats": self.stats.state_dict() if self.stats is not None else None,
            "rng": rng,
            "rng_per_rank": self.dist.gather(rng) if self.dist.active else None,
            "prompt_passes": passes,
            "prompt_passes_per_rank": self.dist.gather(passes) if self.dist.active else None,
        }

    def load_base_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`base_state` saved (this rank's RNG states)."""
        self.step = int(state["step"])
        if self.stats is not None:
            self.stats.load_state_dict(state["stats"])
        per_rank = state.get("rng_per_rank")
        set_rng_state(self.dist.own(per_rank, state["rng"]), {"train": self.generator})
        if self.dist.world_size > 1 and (per_rank is None or len(per_rank) != self.dist.world_size):
            # saved by another number of ranks: every rank holds rank 0's streams now, and would draw the same
            # prompts and noise as every other; each continues from its own seed of (run seed, rank, step)
            saved_by = 1 if per_rank is None else len(per_rank)
            seed = request_seed(self.cfg.run.seed, self.dist.rank, self.step, -1)
            self.generator.manual_seed(seed)
            seed_everything(seed)
            logger.warning(
                "resumed on %d ranks from a checkpoint of %d: each rank's random streams are reseeded from "
                "(run.seed, rank, step), so the run continues as a new draw, not bit for bit",
                self.dist.world_size,
                saved_by,
            )
        if "prompt_passes" in state:  # checkpoints written before the shuffled selection have none
            passes = self.dist.own(state.get("prompt_passes_per_rank"), state["prompt_passes"])
            self.prompt_passes.load_state_dict(passes)

    def checkpoint_wanted(self) -> bool:
        """Whether this process takes part in saving: rank 0 writes, and under data parallelism every rank computes
        the state with it (gathering RNG states, and shards under FSDP: collectives)."""
        return self.run is not None or self.dist.active

    def write_checkpoint(self, state: dict[str, Any], extra: Callable[[Path], None] | None = None) -> None:
        """Rank 0 writes ``state`` atomically (keeping ``run.keep_last``); ``extra(directory)`` writes the model
        files beside ``state.pt``. Other ranks return."""
        if self.run is None:
            return
        save_checkpoint(
            self.run.checkpoint_dir, self.step, state, extra=extra, keep_last=self.cfg.run.keep_last
        )

    def cleanup(self) -> None:
        """Close the rollout source and the run directory; release the adaptive OpenMP spin."""
        stop_adapting()
        if self.rollout_source is not None:
            self.rollout_source.close()
        if self.run is not None:
            self.run.close()
