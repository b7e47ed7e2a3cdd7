"""Which prompts get rollouts, and how many each.

Allocators return an int64 tensor of rollouts per prompt that sums to ``budget`` exactly and respects
``n_min <= N_i <= n_max``; selectors return ``k`` distinct prompt indices. All are vectorised over prompts.
:class:`PromptPasses` is the one stateful selector: it walks the pool in passes without replacement.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from mmrl.core._checks import check_1d, check_probabilities
from mmrl.core.stats import PromptStats

__all__ = [
    "PromptPasses",
    "allocate",
    "knapsack",
    "knapsack_gain",
    "knapsack_value",
    "priority_select",
    "sample_prompts",
    "sqrt_rule",
    "thompson_select",
    "uniform",
]


def _bounds(n_prompts: int, budget: int, n_min: int, n_max: int | None) -> int:
    """Validate the budget against the bounds; return the effective upper bound per prompt."""
    if n_prompts <= 0:
        raise ValueError(f"need at least one prompt, got {n_prompts}")
    if n_min < 0:
        raise ValueError(f"n_min must be >= 0, got {n_min}")
    hi = budget - (n_prompts - 1) * n_min if n_max is None else n_max
    if n_max is not None and n_max < n_min:
        raise ValueError(f"n_max ({n_max}) must be >= n_min ({n_min})")
    if budget < n_prompts * n_min:
        raise ValueError(
            f"budget {budget} is below n_min * prompts = {n_min} * {n_prompts} = {n_min * n_prompts}; "
            "raise the budget or lower n_min"
        )
    if budget > n_prompts * hi:
        raise ValueError(
            f"budget {budget} exceeds n_max * prompts = {hi} * {n_prompts} = {hi * n_prompts}; "
            "lower the budget or raise n_max"
        )
    return hi


def uniform(n_prompts: int, budget: int) -> torch.Tensor:
    """Equal split (GRPO): every prompt gets ``budget // n``; the first ``budget % n`` prompts get one more."""
    if n_prompts <= 0:
        raise ValueError(f"need at least one prompt, got {n_prompts}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    counts = torch.full((n_prompts,), budget // n_prompts, dtype=torch.int64)
    counts[: budget % n_prompts] += 1
    return counts


def knapsack_value(n: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Knapsack-RL value of giving ``n >= 1`` rollouts to a prompt of success rate ``p``.

    ``V(N, p) = (1 - p^N - (1-p)^N) * p * (1-p)^2``: the probability that the group has both a success and a
    failure (a non-zero gradient) times the information gain ``p (1-p)^2`` (Li et al., Knapsack RL,
    2509.25849, eq. 6).
    """
    n = n.to(torch.float64)
    p = p.to(torch.float64)
    return (1 - p**n - (1 - p) ** n) * p * (1 - p) ** 2


def knapsack_gain(n: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Marginal value of a rollout: ``V(N+1, p) - V(N, p) = p (1-p)^2 [(1-p) p^N + p (1-p)^N]``.

    Both terms shrink as N grows, so ``V`` is concave in ``N >= 1``: the separable resource-allocation problem
    ``max sum_i V(N_i, p_i)`` s.t. ``sum_i N_i = B`` is solved exactly by taking the ``B - sum n_min`` largest
    marginal gains (greedy is optimal for separable concave objectives; Ibaraki & Katoh, "Resource Allocation
    Problems", 1988, ch. 4).
    """
    n = n.to(torch.float64)
    p = p.to(torch.float64)
    return p * (1 - p) ** 2 * ((1 - p) * p**n + p * (1 - p) ** n)


def knapsack(p: torch.Tensor, budget: int, n_min: int = 1, n_max: int | None = None) -> torch.Tensor:
    """Rollout counts maximising the total Knapsack-RL value exactly.

    Solves ``max sum_i V(N_i, p_i)`` s.t. ``sum_i N_i = budget``, ``n_min <= N_i <= n_max`` by taking the
    largest marginal gains (see :func:`knapsack_gain`). Ties are broken deterministically by (gain descending,
    current count ascending, prompt index ascending), so spare budget among equal gains (e.g. prompts with
    ``p`` of 0 or 1, whose value is always 0) is spread evenly rather than piled on one prompt. The selection is
    one ``kthvalue`` over a ``[P, K]`` grid of gains; ``K`` starts small and doubles only if a prompt saturates
    the grid while its next gain is still above the threshold.

    Args:
        p: ``[P]`` success probabilities in [0, 1].
        budget: total rollouts.
        n_min: at least this many per prompt; must be >= 1 (V is not concave from 0: 0 and 1 rollouts are both
            worth 0, so deciding which prompts get none is a selection problem, see :func:`thompson_select`).
        n_max: at most this many per prompt (default: no cap beyond the budget).

    Returns:
        ``[P]`` int64 counts on ``p``'s device.

    Raises:
        ValueError: if no allocation within the bounds sums to ``budget``, or ``p`` is not in [0, 1].
    """
    check_1d("p", p)
    check_probabilities("p", p)
    if n_min < 1:
        raise ValueError(f"knapsack needs n_min >= 1 (V is concave only from one rollout on), got {n_min}")
    num = p.numel()
    hi = _bounds(num, budget, n_min, n_max)
    extra = budget - num * n_min
    counts = torch.full((num,), n_min, dtype=torch.int64, device=p.device)
    if extra == 0:
        return counts
    p64 = p.to(torch.float64)
    k_full = hi - n_min
    width = min(k_full, max(16, 2 * math.ceil(extra / num)))
    while True:
        n_grid = n_min + torch.arange(width, device=p.device, dtype=torch.float64)  # [K]
        gains = knapsack_gain(n_grid.unsqueeze(0), p64.unsqueeze(1))  # [P, K], non-increasing along K
        flat = gains.flatten()
        threshold = flat.kthvalue(flat.numel() - extra + 1).values
        above = gains > threshold
        ties = gains == threshold
        # Fill the remaining slots with tied gains in (count ascending, prompt ascending) order: walk the grid
        # column by column. Within a row the tied entries are contiguous, so each row takes a prefix.
        need = extra - int(above.sum())
        ties_by_col = ties.t().flatten()
        take_tie = (torch.cumsum(ties_by_col.long(), 0) <= need) & ties_by_col
        take = above | take_tie.view(width, num).t()
        counts = n_min + take.sum(1)
        if width == k_full:
            return counts
        # Only a prompt that filled the whole grid could deserve more; it does iff its next gain beats the
        # threshold (an equal gain ranks after every selected entry, whose count is smaller).
        saturated = counts == n_min + width
        if not bool(saturated.any()):
            return counts
        nxt = knapsack_gain(torch.tensor(float(n_min + width), dtype=torch.float64), p64[saturated])
        if not bool((nxt > threshold).any()):
            return counts
        width = min(k_full, 2 * width)


def sqrt_rule(p: torch.Tensor, budget: int, n_min: int = 1, n_max: int | None = None) -> torch.Tensor:
    """Square-root allocation: ``N_i`` proportional to ``sqrt(p_i (1 - p_i))`` under a fixed total.

    The optimal rollout counts of the GDRO rollout game are proportional to the reward standard deviation
    of the prompt (Panaganti et al., "Group Distributionally Robust Optimization-Driven RL", 2601.19280). The
    continuous solution ``x_i = clip(c * w_i, n_min, n_max)`` with ``sum x = budget`` is found by bisection on c;
    integer counts take the floors and give the remaining units to the largest fractional parts (ties: lower
    index). Prompts with ``w = 0`` get ``n_min`` unless the others are all at ``n_max``, in which case the rest is
    spread evenly over them.

    Returns:
        ``[P]`` int64 counts summing to ``budget``.
    """
    check_1d("p", p)
    check_probabilities("p", p)
    num = p.numel()
    hi = _bounds(num, budget, n_min, n_max)
    w = (p.to(torch.float64) * (1 - p.to(torch.float64))).sqrt()
    positive = w > 0
    lo_f, hi_f = float(n_min), float(hi)
    capacity = int(positive.sum()) * hi + int((~positive).sum()) * n_min
    if capacity < budget:
        # Weighted prompts all at n_max; the zero-weight ones share the rest evenly.
        counts = torch.where(positive, hi, n_min).to(torch.int64)
        zero_idx = (~positive).nonzero().squeeze(1)
        counts[zero_idx] += uniform(zero_idx.numel(), budget - capacity).to(p.device)
        return counts

    def total(c: float) -> float:
        return float((c * w).clamp(lo_f, hi_f).sum())

    low_c, high_c = 0.0, 1.0
    while total(high_c) < budget:
        high_c *= 2.0
    for _ in range(100):
        mid = 0.5 * (low_c + high_c)
        if total(mid) < budget:
            low_c = mid
        else:
            high_c = mid
    x = (high_c * w).clamp(lo_f, hi_f)
    counts = x.floor().to(torch.int64)
    # sum(x) exceeds the budget by at most the bisection's tolerance (far below one unit), so the floors sum to at
    # most the budget: the rounding only ever adds units
    remainder = budget - int(counts.sum())
    if remainder > 0:
        frac = torch.where(counts < hi, x - counts, torch.full_like(x, -1.0))
        order = torch.sort(-frac, stable=True).indices
        counts[order[:remainder]] += 1
    return counts


def _beta_sample(alpha: torch.Tensor, beta: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Beta draws ``X / (X + Y)`` with ``X ~ Gamma(alpha)``, ``Y ~ Gamma(beta)``, reproducible from ``generator``.

    torch's gamma sampler takes no generator, so a seed drawn from ``generator`` seeds a forked RNG.
    """
    a = alpha.to(torch.float64)
    b = beta.to(torch.float64)
    if generator is None:
        x, y = torch._standard_gamma(a), torch._standard_gamma(b)
    else:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        devices = [a.device] if a.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            x, y = torch._standard_gamma(a), torch._standard_gamma(b)
    return x / (x + y)


def thompson_select(
    alpha: torch.Tensor,
    beta: torch.Tensor,
    k: int,
    generator: torch.Generator | None = None,
    target: float = 0.5,
) -> torch.Tensor:
    """Thompson-sampling prompt selection (MoPPS, Qu et al. 2507.04632, Alg. 1).

    Draw ``p_i ~ Beta(alpha_i, beta_i)`` and take the ``k`` prompts whose draw is closest to ``target`` (0.5:
    the success rate with the most learning signal). Uncertain prompts are drawn widely and so get explored.

    Returns:
        ``[k]`` int64 distinct indices, best first.
    """
    check_1d("alpha", alpha)
    if alpha.shape != beta.shape:
        raise ValueError(f"alpha and beta shapes differ: {tuple(alpha.shape)} vs {tuple(beta.shape)}")
    if bool((alpha <= 0).any()) or bool((beta <= 0).any()):
        raise ValueError("Beta parameters alpha and beta must be > 0")
    if not 0 < k <= alpha.numel():
        raise ValueError(f"k must be in [1, {alpha.numel()}] (number of prompts), got {k}")
    draws = _beta_sample(alpha, beta, generator)
    distance = (draws - target).abs()
    return torch.sort(distance, stable=True).indices[:k]


def priority_select(
    p: torch.Tensor, k: int, eps: float = 0.05, generator: torch.Generator | None = None
) -> torch.Tensor:
    """SPO prioritized prompt sampling: draw ``k`` distinct prompts with probability ``∝ sqrt(p(1-p)) + eps``.

    ``eps`` keeps prompts believed solved or hopeless in play (Xu & Ding, SPO, 2509.13232, sec. 3.3).

    Returns:
        ``[k]`` int64 distinct indices in draw order.
    """
    check_1d("p", p)
    check_probabilities("p", p)
    if not 0 < k <= p.numel():
        raise ValueError(f"k must be in [1, {p.numel()}] (number of prompts), got {k}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    weights = (p.to(torch.float64) * (1 - p.to(torch.float64))).sqrt() + eps
    if float(weights.sum()) == 0:
        raise ValueError("all priorities are 0 (every p is 0 or 1 and eps = 0); set eps > 0")
    return torch.multinomial(weights, k, replacement=False, generator=generator)


class PromptPasses:
    """Prompts in passes over the pool without replacement: every prompt once per pass, each pass in a fresh random
    order (what a shuffled data loader does over a dataset; TRL's and verl's default order).

    The state is the set of prompts already drawn in the current pass, so the walk survives a pool that changes
    between steps (prompts still in flight excluded by a rollout pool): a step draws uniformly among the pool's
    prompts not yet drawn in this pass; when fewer than ``k`` remain it takes them all, starts a new pass and
    draws the rest among the others. Over ``m`` full passes every prompt is drawn ``m`` times; with replacement
    (``uniform``) the count of a prompt is Binomial and a share ``e^-m`` of the pool is never drawn.
    """

    def __init__(self) -> None:
        self.drawn: set[Hashable] = set()
        self.passes = 0

    def select(
        self, pool: Sequence[Hashable], k: int, generator: torch.Generator | None = None
    ) -> list[Hashable]:
        """``k`` distinct prompts of ``pool``, the ones not yet drawn in this pass first."""
        if not 0 < k <= len(pool):
            raise ValueError(f"k must be in [1, {len(pool)}] (pool size), got {k}")
        fresh = [prompt for prompt in pool if prompt not in self.drawn]
        chosen = _random_subset(fresh, min(k, len(fresh)), generator)
        self.drawn.update(chosen)
        if len(chosen) < k:  # the pass is over: a new one, among the prompts this step has not taken
            taken = set(chosen)
            rest = _random_subset(
                [prompt for prompt in pool if prompt not in taken], k - len(chosen), generator
            )
            self.drawn = set(rest)
            self.passes += 1
            chosen += rest
        return chosen

    def state_dict(self) -> dict[str, object]:
        return {"drawn": sorted(self.drawn, key=repr), "passes": self.passes}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.drawn = set(state["drawn"])  # type: ignore[call-overload]
        self.passes = int(state["passes"])  # type: ignore[call-overload]


def _random_subset(items: Sequence[Hashable], k: int, generator: torch.Generator | None) -> list[Hashable]:
    """``k`` distinct items of ``items`` in a uniformly random order."""
    return [items[i] for i in torch.randperm(len(items), generator=generator)[:k].tolist()]


def sample_prompts(
    store: PromptStats,
    pool: Sequence[Hashable],
    k: int,
    method: Literal["uniform", "shuffled", "thompson", "priority"] = "uniform",
    generator: torch.Generator | None = None,
    eps: float = 0.05,
    passes: PromptPasses | None = None,
) -> list[Hashable]:
    """Pick ``k`` distinct prompts from ``pool`` using the store's statistics.

    ``uniform`` ignores the store (a random permutation each step: prompts are drawn again across steps);
    ``shuffled`` walks the pool in passes without replacement (``passes`` holds the walk, see
    :class:`PromptPasses`); ``thompson`` is :func:`thompson_select` on the Beta posteriors; ``priority`` is
    :func:`priority_select` on the posterior means. Unseen prompts get the store's shrinkage prior, so no
    evaluation pass over the pool is needed first.
    """
    if not 0 < k <= len(pool):
        raise ValueError(f"k must be in [1, {len(pool)}] (pool size), got {k}")
    if method == "shuffled":
        if passes is None:
            raise ValueError("method 'shuffled' needs the PromptPasses that hold the walk (passes=...)")
        return passes.select(pool, k, generator=generator)
    if method == "uniform":
        chosen = torch.randperm(len(pool), generator=generator)[:k]
    elif method == "thompson":
        alpha, beta = store.alpha_beta(pool)
        chosen = thompson_select(alpha, beta, k, generator=generator)
    elif method == "priority":
        chosen = priority_select(store.success_prob(pool), k, eps=eps, generator=generator)
    else:
        raise ValueError(f"method must be 'uniform', 'shuffled', 'thompson' or 'priority', got {method!r}")
    return [pool[i] for i in chosen.tolist()]


def allocate(
    store: PromptStats,
    prompt_ids: Sequence[Hashable],
    budget: int,
    method: Literal["uniform", "knapsack", "sqrt"] = "uniform",
    n_min: int = 1,
    n_max: int | None = None,
) -> torch.Tensor:
    """Rollouts per prompt for ``prompt_ids`` from the store's success estimates; sums to ``budget``.

    Raises:
        ValueError: no split of ``budget`` over the prompts keeps ``n_min <= N_i <= n_max``.
    """
    if method == "uniform":
        # budget >= P n_min and budget <= P n_max make floor(budget / P) >= n_min and ceil(budget / P) <= n_max
        _bounds(len(prompt_ids), budget, n_min, n_max)
        return uniform(len(prompt_ids), budget)
    p = store.success_prob(prompt_ids).to(torch.float64)
    if method == "knapsack":
        return knapsack(p, budget, n_min=n_min, n_max=n_max)
    if method == "sqrt":
        return sqrt_rule(p, budget, n_min=n_min, n_max=n_max)
    raise ValueError(f"method must be 'uniform', 'knapsack' or 'sqrt', got {method!r}")
