"""Registry of advantage estimators: one name -> one function, read by every trainer and config.

Every estimator has the same signature ``fn(batch: RewardBatch, **options) -> Advantages``: the trainer hands
over the step's rewards (and, for the estimators that ask for it, the statistics store's baseline taken before
the batch updates it), and gets back ``[N]`` advantages and a ``[N]`` mask of the samples that enter the loss.
The registry is the only routing: a trainer never branches on an estimator's name.

Adding one::

    @register_estimator("my_estimator", description="...")
    def my_estimator(batch: RewardBatch, scale: float = 1.0) -> Advantages:
        return Advantages(scale * (batch.rewards - batch.rewards.mean()))

then ``trainer.advantage: my_estimator`` (options under ``trainer.advantage_options``) in any recipe.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from mmrl.core import advantages as adv_lib

__all__ = [
    "Advantages",
    "Estimator",
    "RewardBatch",
    "check_estimator",
    "estimate",
    "get_estimator",
    "list_estimators",
    "register_estimator",
]


@dataclass
class RewardBatch:
    """The rewards of one step, as every estimator receives them.

    Attributes:
        rewards: ``[N]`` combined (weighted-sum) reward per sample.
        group_ids: ``[N]`` group of each sample (the samples of one prompt).
        raw: ``[N, K]`` the K rewards before combining (multi-reward estimators); ``None`` for one reward.
        weights: ``[K]`` the reward weights of ``raw``.
        baseline: ``[N]`` the statistics store's value of each sample's prompt, taken *before* this batch updated
            it; given only to estimators registered with ``needs_baseline=True``.
        sum_over_ranks: under data parallelism, the all-reduce sum over the ranks
            (``mmrl.distributed.all_reduce_sum``), which every rank's estimator calls: an estimator's batch-level
            statistics (``global_std``'s std, ``gdpo``'s whitening, ``single``'s scaling) are then those of every
            rank's samples, as when one process holds them all. ``None``: this process holds the whole batch.
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    raw: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    baseline: torch.Tensor | None = None
    sum_over_ranks: adv_lib.SumOverRanks | None = None


@dataclass
class Advantages:
    """``adv [N]`` per-sample advantages; ``keep [N]`` bool, False for samples excluded from the loss (MC-GRPO's
    pivot); ``None`` keeps every sample."""

    adv: torch.Tensor
    keep: torch.Tensor | None = None

    def keep_mask(self) -> torch.Tensor:
        """``[N]`` bool, all True when the estimator excludes nothing."""
        return torch.ones_like(self.adv, dtype=torch.bool) if self.keep is None else self.keep


@dataclass(frozen=True)
class Estimator:
    """A registered estimator and what it needs from the trainer.

    Attributes:
        name: the registry key (``trainer.advantage``).
        fn: ``fn(batch, **options) -> Advantages``.
        description: one line for config help and error messages.
        needs_baseline: the trainer passes the store's pre-update baseline in ``batch.baseline``.
        single_rollout: one rollout per prompt (a group of one); group estimators need at least two.
        extra_per_group: rollouts a group gets on top of ``num_generations`` (MC-GRPO: its pivot, 1).
        odd_groups: every group must have an odd number of samples (its median is a sample).
        multi_reward: reads ``batch.raw`` / ``batch.weights`` instead of the combined reward.
    """

    name: str
    fn: Callable[..., Advantages]
    description: str
    needs_baseline: bool = False
    single_rollout: bool = False
    extra_per_group: int = 0
    odd_groups: bool = False
    multi_reward: bool = False

    def options(self) -> list[str]:
        """Names of the keyword options ``fn`` accepts besides the batch."""
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


_ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(
    name: str,
    description: str,
    *,
    needs_baseline: bool = False,
    single_rollout: bool = False,
    extra_per_group: int = 0,
    odd_groups: bool = False,
    multi_reward: bool = False,
) -> Callable[[Callable[..., Advantages]], Callable[..., Advantages]]:
    """Function decorator adding an estimator to the registry under ``name`` (see :class:`Estimator`).

    Raises:
        ValueError: ``name`` is already registered to another function.
    """

    def wrap(fn: Callable[..., Advantages]) -> Callable[..., Advantages]:
        if name in _ESTIMATORS and _ESTIMATORS[name].fn is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = Estimator(
            name,
            fn,
            description,
            needs_baseline=needs_baseline,
            single_rollout=single_rollout,
            extra_per_group=extra_per_group,
            odd_groups=odd_groups,
            multi_reward=multi_reward,
        )
        return fn

    return wrap


def list_estimators() -> list[str]:
    """Names of every registered estimator, sorted."""
    return sorted(_ESTIMATORS)


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``.

    Raises:
        KeyError: unknown name, listing the registered ones.
    """
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}. Available: {list_estimators()}")
    return _ESTIMATORS[name]


def check_estimator(name: str, options: Mapping[str, Any], where: str = "trainer.advantage") -> Estimator:
    """Config-time check: ``name`` is registered and ``options`` are keywords its function takes.

    Raises:
        ValueError: naming ``where``, the registered names, or the accepted options.
    """
    if name not in _ESTIMATORS:
        raise ValueError(f"{where}: unknown advantage estimator {name!r}; registered: {list_estimators()}")
    estimator = _ESTIMATORS[name]
    unknown = sorted(set(options) - set(estimator.options()))
    if unknown:
        raise ValueError(
            f"{where}_options: {unknown} are not options of the {name!r} estimator "
            f"(it takes {estimator.options() or 'none'})"
        )
    return estimator


def estimate(name: str, batch: RewardBatch, **options: Any) -> Advantages:
    """``get_estimator(name).fn(batch, **options)``."""
    return get_estimator(name).fn(batch, **options)


# --------------------------------------------------------------------------------------------- the estimators


@register_estimator("grpo", "group mean / group std (GRPO, DeepSeekMath 2402.03300 eq. 3)")
def grpo(batch: RewardBatch, center: Literal["mean", "median"] = "mean") -> Advantages:
    """``center: median``: the group's lower median instead of its mean (robust to one outlying reward)."""
    return Advantages(adv_lib.group_normalized(batch.rewards, batch.group_ids, std="group", center=center))


@register_estimator("dr_grpo", "group mean, no std (Dr.GRPO 2503.20783)")
def dr_grpo(batch: RewardBatch) -> Advantages:
    return Advantages(adv_lib.group_normalized(batch.rewards, batch.group_ids, std="none"))


@register_estimator(
    "global_std",
    "group mean / batch std of the rewards (TRL scale_rewards='batch'; LitePPO 2508.08221; not REINFORCE++)",
)
def global_std(batch: RewardBatch) -> Advantages:
    return Advantages(
        adv_lib.group_normalized(
            batch.rewards, batch.group_ids, std="global", sum_over_ranks=batch.sum_over_ranks
        )
    )


@register_estimator("rloo", "leave-one-out baseline (RLOO 2402.14740)")
def rloo(batch: RewardBatch) -> Advantages:
    return Advantages(adv_lib.rloo(batch.rewards, batch.group_ids))


@register_estimator(
    "mc_grpo",
    "median-centred, pivot excluded; G+1 rollouts per group (MC-GRPO)",
    extra_per_group=1,
    odd_groups=True,
)
def mc_grpo(batch: RewardBatch) -> Advantages:
    adv, pivot = adv_lib.median_centered(batch.rewards, batch.group_ids)
    return Advantages(adv, ~pivot)


@register_estimator(
    "gdpo",
    "each reward normalised in its group, weighted sum, batch-whitened (GDPO 2601.05242)",
    multi_reward=True,
)
def gdpo(batch: RewardBatch) -> Advantages:
    raw = batch.raw if batch.raw is not None else batch.rewards.unsqueeze(1)
    return Advantages(
        adv_lib.decoupled_multi_reward(
            raw, batch.group_ids, batch.weights, sum_over_ranks=batch.sum_over_ranks
        )
    )


@register_estimator(
    "single",
    "one rollout per prompt, A = r - V(x) from the statistics store, batch-std scaled (SPO 2509.13232; MSSR)",
    needs_baseline=True,
    single_rollout=True,
)
def single(
    batch: RewardBatch, center: bool = False, scale: Literal["batch_std", "none"] = "batch_std"
) -> Advantages:
    """``scale: none``: the raw ``r - V(x)``, not divided by the batch std."""
    if batch.baseline is None:
        raise ValueError("the single estimator needs batch.baseline (the store's value before the update)")
    return Advantages(
        adv_lib.single_rollout(
            batch.rewards, batch.baseline, scale=scale, center=center, sum_over_ranks=batch.sum_over_ranks
        )
    )
