"""Config sections every recipe shares: rewards, LoRA, prompt selection and rollout allocation, rollout pools, and
the optimisation settings of the supervised (pretraining, SFT) recipes.

A recipe subclasses a section only to change its defaults (the VLM's LoRA targets other module names than the
flow transformer's); the fields, their checks and their meaning are written here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import model_validator

from mmrl.config import Config, Field
from mmrl.schedule import LRSchedule, learning_rate

__all__ = [
    "AllocationConfig",
    "LoraSettings",
    "PoolSettings",
    "RewardSpec",
    "SupervisedRecipeConfig",
    "SupervisedSettings",
    "check_reward_keys",
]


class RewardSpec(Config):
    name: str = Field(description="Registered reward name (rewards.list_rewards()).")
    weight: float = Field(1.0, description="Weight in the sum (or in GDPO's weighted sum).")
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword options of rewards.build.")
    label: str | None = Field(
        None,
        description="Name of its metrics (reward/LABEL/mean, eval/LABEL...); null: the reward's name. Needed "
        "when one reward appears twice with other options.",
    )

    @property
    def key(self) -> str:
        return self.label or self.name


def check_reward_keys(specs: list[RewardSpec], where: str) -> None:
    """Each reward of a list logs under its own key: a repeated name without labels would overwrite metrics."""
    keys = [spec.key for spec in specs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"{where}: several rewards log as {repeated}; give each a distinct `label`")


class LoraSettings(Config):
    """LoRA through peft; the recipe's subclass sets the default ``target_modules`` of its model kind."""

    rank: int = Field(8, ge=1, description="LoRA rank r (Flow-GRPO: 32 for SD3.5-M).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        description="Module names that get adapters (attention projections of the diffusers transformers).",
    )


class AllocationConfig(Config):
    """Which prompts get rollouts each step and how many each (mmrl/core/allocation.py), from one statistics
    store. The same section in every recipe; a recipe's subclass only changes defaults."""

    selection: Literal["uniform", "shuffled", "thompson", "priority"] = Field(
        "uniform",
        description="How prompts are picked each step: uniform (a fresh random draw each step, so prompts repeat "
        "across steps), shuffled (passes over the pool without replacement, a shuffled data loader's order as in "
        "TRL and verl), thompson (MoPPS), priority (SPO).",
    )
    method: Literal["uniform", "knapsack", "sqrt"] = Field(
        "uniform", description="How the rollout budget is split over the picked prompts."
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts picked per step.")
    rollouts_per_step: int | None = Field(
        64,
        ge=1,
        description="Rollout budget per step (sum of group sizes). VLM recipe: null is prompts_per_step times "
        "the group size (trainer.num_generations, +1 for mc_grpo; 1 in single mode).",
    )
    n_min: int = Field(2, ge=1, description="Fewest rollouts a picked prompt gets.")
    n_max: int | None = Field(None, ge=1, description="Most rollouts a prompt gets (null: no cap).")
    rho: float = Field(1.0, gt=0, le=1, description="Forgetting factor of the prompt statistics store.")
    prior_strength: float = Field(
        2.0,
        gt=0,
        description="Pseudo-count of the statistics store's shrinkage prior (MoPPS: Beta(1, 1), 2).",
    )

    @model_validator(mode="after")
    def _budget_fits(self) -> AllocationConfig:
        budget = self.rollouts_per_step
        if budget is not None and budget < self.prompts_per_step * self.n_min:
            raise ValueError(
                f"rollouts_per_step ({budget}) must be >= prompts_per_step * n_min "
                f"({self.prompts_per_step} * {self.n_min})"
            )
        if budget is not None and self.n_max is not None and budget > self.prompts_per_step * self.n_max:
            raise ValueError(
                f"rollouts_per_step ({budget}) must be <= prompts_per_step * n_max "
                f"({self.prompts_per_step} * {self.n_max})"
            )
        return self


class PoolSettings(Config):
    enabled: bool = Field(
        False,
        description="Take the flat rollouts from a rollout pool (pipelines/pool, mmrl/flow/pooled.py) "
        "instead of generating them in the training loop.",
    )
    executor: Literal["inprocess", "ray"] = Field(
        "inprocess",
        description="inprocess: worker threads in the trainer process (one GPU); ray: Ray actors.",
    )
    num_workers: int = Field(
        1,
        ge=1,
        description="Rollout workers; a step's prompts are split into one request per worker.",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Most weight versions a sample may lag behind the trainer: 0 synchronous on-policy, "
        "1 generates step k+1 while step k trains (AReaL, arXiv 2505.24298).",
    )
    request_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds a request may run before its worker is replaced (null: wait forever).",
    )
    tis_cap: float = Field(
        2.0,
        ge=1.0,
        description="Cap C of the truncated importance weight min(pi_current / pi_behaviour, C) of "
        "stale samples (TIS); >= 1 so that on-policy samples keep weight 1.",
    )
    device: str | None = Field(
        None,
        description="Device of the rollout workers (null: the trainer's; a Ray actor sees its own GPU as cuda).",
    )
    ray: dict[str, Any] = Field(
        default_factory=dict,
        description="RayOptions of the actors (address, num_cpus, num_gpus, resources, runtime_env).",
    )

    def build_pool(self, factory: Callable[[], Any]) -> Any:
        """The :class:`~pipelines.pool.pool.RolloutPool` these settings describe, its workers built by ``factory``.

        Raises:
            ValueError: ``ray`` holds a key that is not a RayOptions field.
        """
        from pipelines.pool.executors import RayOptions
        from pipelines.pool.pool import RolloutPool

        ray = None
        if self.executor == "ray":
            try:
                ray = RayOptions(**self.ray)
            except TypeError as err:
                raise ValueError(
                    f"pool.ray: {err}; the keys are RayOptions fields (address, num_cpus, num_gpus, "
                    "resources, runtime_env)"
                ) from err
        return RolloutPool(
            factory,
            self.num_workers,
            executor=self.executor,
            max_staleness=self.max_staleness,
            request_timeout=self.request_timeout,
            ray=ray,
        )


class SupervisedSettings(Config):
    """Steps, batch and AdamW settings of a supervised recipe (pretraining, SFT), with the learning-rate schedule
    of :func:`mmrl.schedule.learning_rate`. A recipe's subclass adds its own fields and defaults."""

    steps: int = Field(1000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(16, ge=1, description="Items per optimizer step.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate of AdamW.")
    lr_schedule: LRSchedule = Field(
        "cosine",
        description="After the warm-up: cosine (decay to final_lr_fraction * lr at the last step) or constant.",
    )
    final_lr_fraction: float = Field(0.0, ge=0, le=1, description="Where the cosine ends, as a share of lr.")
    warmup_steps: int = Field(50, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    eval_every: int = Field(0, ge=0, description="Evaluate every this many steps (0: at the end only).")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (``step`` steps done)."""
        return learning_rate(
            step, self.lr, self.steps, self.warmup_steps, self.lr_schedule, self.final_lr_fraction
        )


class SupervisedRecipeConfig(Config):
    """The top level every pretraining/SFT recipe config shares: where its final model is published. The recipe's
    subclass adds ``recipe``, ``run``, ``model``, ``data`` and ``trainer``."""

    out: str | None = Field(
        None,
        description="Folder the final model, its config.yaml and card.md are published to (replaced atomically); "
        "null: only the run's checkpoints.",
    )
