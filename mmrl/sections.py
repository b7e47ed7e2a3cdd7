"""Config sections every recipe shares: rewards, LoRA, prompt selection and rollout allocation, rollout pools, and
the optimisation settings of the supervised (pretraining, SFT) recipes.

A recipe subclasses a section only to change its defaults (the VLM's LoRA targets other module names than the
flow transformer's); the fields, their checks and their meaning are written here once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import model_validator

from mmrl.config import Config, Field
from mmrl.schedule import LRSchedule, learning_rate

if TYPE_CHECKING:
    from mmrl.core.estimators import Estimator

__all__ = [
    "AllocationConfig",
    "LoraSettings",
    "PoolSettings",
    "RewardSpec",
    "SupervisedRecipeConfig",
    "SupervisedSettings",
    "check_gdpo_estimator",
    "check_group_sizes",
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

    @model_validator(mode="after")
    def _registered(self) -> RewardSpec:
        """The name is a registered reward and the options fit its constructor: checked when the config loads, not
        when a trainer builds the reward (after loading its model).

        Raises:
            ValueError: an unknown name (listing the registered ones), an option the constructor does not take
                (unless it takes ``**options``), or a required option missing.
        """
        from rewards.registry import get_reward_class, list_rewards

        registered = list_rewards()
        if self.name not in registered:
            raise ValueError(f"unknown reward name {self.name!r}; registered: {registered}")
        params = inspect.signature(get_reward_class(self.name)).parameters.values()
        keywords = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        named = [p.name for p in keywords]
        unknown = sorted(set(self.options) - set(named))
        if unknown and not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ValueError(
                f"options {unknown} are not options of the {self.name!r} reward (it takes {named or 'none'})"
            )
        required = [p.name for p in keywords if p.default is p.empty and p.name not in self.options]
        if required:
            raise ValueError(f"the {self.name!r} reward needs the options {required}")
        return self


def check_reward_inputs(specs: list[RewardSpec], given: tuple[str, ...], recipe: str, where: str) -> None:
    """Each reward can be scored on the batch fields the recipe gives (``given``, e.g. a VLM run's completions):
    a reward whose ``score`` requires another field (an image reward in a text recipe) is refused when the
    config loads, not after the model has loaded.

    Raises:
        ValueError: naming the entry, its reward, the fields it needs and the ones given.
    """
    import inspect

    from rewards.registry import get_reward_class

    for index, spec in enumerate(specs):
        parameters = inspect.signature(get_reward_class(spec.name).score).parameters.values()
        needed = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        missing = [name for name in needed if name not in given]
        if missing:
            raise ValueError(
                f"{where}.{index}: the {spec.name!r} reward scores {needed}, and a {recipe} run gives each "
                f"reward {list(given)}"
            )


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
        if self.rollouts_per_step is not None:
            self.check_budget(self.rollouts_per_step, "allocation.rollouts_per_step")
        return self

    def check_budget(self, budget: int, budget_key: str) -> None:
        """A step's budget splits over the prompts within the bounds:
        ``prompts_per_step * n_min <= budget <= prompts_per_step * n_max``.

        Args:
            budget: the step's rollout budget, as the recipe resolves it (a recipe may derive it when
                ``rollouts_per_step`` is null).
            budget_key: the config keys the budget comes from, for the message.

        Raises:
            ValueError: naming ``budget_key`` and the bound it breaks.
        """
        p = self.prompts_per_step
        if budget < p * self.n_min:
            raise ValueError(
                f"{budget_key} = {budget} must be >= allocation.prompts_per_step * allocation.n_min "
                f"({p} * {self.n_min})"
            )
        if self.n_max is not None and budget > p * self.n_max:
            raise ValueError(
                f"{budget_key} = {budget} must be <= allocation.prompts_per_step * allocation.n_max "
                f"({p} * {self.n_max})"
            )


def check_gdpo_estimator(advantage: str | None, num_rewards: int) -> None:
    """Where ``trainer.multi_reward=gdpo`` applies (several rewards) the estimator is GDPO: an explicit
    ``trainer.advantage`` naming another one would be silently replaced, so it is refused.

    Raises:
        ValueError: naming both keys and the two ways out.
    """
    if advantage not in (None, "gdpo"):
        raise ValueError(
            f"trainer.multi_reward=gdpo with {num_rewards} rewards trains with the gdpo estimator, not "
            f"trainer.advantage={advantage}: leave trainer.advantage null, or set "
            f"trainer.multi_reward=weighted_sum to train {advantage} on the weighted sum"
        )


def check_group_sizes(
    estimator: Estimator,
    allocation: AllocationConfig,
    budget: int | None,
    budget_key: str = "allocation.rollouts_per_step",
) -> None:
    """Config-time check that the allocation gives every group a size ``estimator`` can use, so that a config
    fails when it loads rather than at the first step (after its model has loaded):

    - an ``odd_groups`` estimator (MC-GRPO: the median is a sample) needs equal, odd groups: the uniform split of
      a budget ``B = g * P`` with ``g`` odd (``P``: ``allocation.prompts_per_step``);
    - a group estimator (not ``single_rollout``) compares the rollouts of a prompt, and needs at least 2 in each
      group (RLOO's leave-one-out baseline is undefined for one): ``B >= 2 P`` with the uniform split (its
      smallest group is ``floor(B / P)``), ``allocation.n_min >= 2`` with the others.

    Args:
        estimator: the registered estimator of the recipe.
        allocation: the recipe's allocation section.
        budget: the step's rollout budget as the recipe resolves it; ``None`` where the allocation does not size
            the groups (tree rollouts, the explorer): only the method is checked then.
        budget_key: the config keys the budget comes from, for the messages.

    Raises:
        ValueError: naming the estimator and the keys to change.
    """
    name, method, p = estimator.name, allocation.method, allocation.prompts_per_step
    if estimator.odd_groups and method != "uniform":
        raise ValueError(
            f"trainer.advantage={name} needs odd, equal group sizes: use allocation.method=uniform (got {method})"
        )
    if budget is None or estimator.single_rollout:
        return
    if estimator.odd_groups and budget % p != 0:
        raise ValueError(
            f"trainer.advantage={name} needs equal group sizes: {budget_key} gives {budget} rollouts a step, not a "
            f"multiple of allocation.prompts_per_step ({p})"
        )
    if estimator.odd_groups and (budget // p) % 2 == 0:
        raise ValueError(
            f"trainer.advantage={name} needs odd group sizes (its median is a sample): {budget_key} gives "
            f"{budget} rollouts a step, {budget // p} (even) for each of allocation.prompts_per_step ({p}) prompts"
        )
    if method == "uniform" and budget < 2 * p:
        raise ValueError(
            f"trainer.advantage={name} compares the rollouts of a prompt, at least 2: {budget_key} gives {budget} "
            f"rollouts a step, fewer than 2 each for allocation.prompts_per_step ({p}) prompts"
        )
    if method != "uniform" and allocation.n_min < 2:
        raise ValueError(
            f"trainer.advantage={name} compares the rollouts of a prompt, at least 2: allocation.n_min "
            f"({allocation.n_min}) lets allocation.method={method} give a prompt fewer; set allocation.n_min >= 2"
        )


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
    max_worker_losses: int = Field(
        3,
        ge=1,
        description="Workers one request may lose (dying, or past request_timeout, while running it) before "
        "the request fails alone with an error naming it, instead of being retried on a new worker.",
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
            max_worker_losses=self.max_worker_losses,
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
        description="After the warm-up: cosine (over steps 0..steps, from lr toward final_lr_fraction * lr, which "
        "step = steps would take) or constant.",
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
