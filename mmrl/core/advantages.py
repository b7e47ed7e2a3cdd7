"""Advantage estimators: what each sample learns from.

Every function takes a flat batch (``rewards [N]`` with ``group_ids [N]``; groups may differ in size), is
vectorised over samples and groups, works on any device, and raises ``ValueError`` on NaN rewards, shape
mismatches or empty input rather than dropping anything silently.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from mmrl.core._checks import check_1d, check_finite, check_same_shape
from mmrl.core.groups import Groups, groups_for, make_groups

__all__ = [
    "SumOverRanks",
    "clip_advantages",
    "decoupled_multi_reward",
    "entropy_shaped",
    "group_normalized",
    "median_centered",
    "process_supervised",
    "rloo",
    "single_rollout",
    "tree_depthwise",
]

#: Sums a tensor over every data-parallel rank (an all-reduce every rank enters, e.g.
#: ``mmrl.distributed.all_reduce_sum``): a batch statistic is then taken over the batches of all ranks.
SumOverRanks = Callable[[torch.Tensor], torch.Tensor]


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> Groups:
    check_1d("rewards", rewards)
    check_finite("rewards", rewards)
    return groups_for(rewards, group_ids)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float64: group statistics of float32 rewards (e.g. ``1.1 = 1 + 0.1``) round at ~1e-8, which
    a std of similar size turns into visible advantages; float64 leaves ~1e-16. Results are returned in
    :func:`_result_dtype`."""
    return x.to(torch.float64)


def _result_dtype(rewards: torch.Tensor) -> torch.dtype:
    """The dtype of the advantages of ``rewards``: their own floating dtype, float32 for integer or bool rewards
    (0/1 verifier scores), whose advantages an integer dtype would truncate (0.71 to 0)."""
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def _batch_mean_std(
    x: torch.Tensor, sum_over_ranks: SumOverRanks | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, population std)`` of ``x [N]`` over the batch: this process's samples, or with
    ``sum_over_ranks`` the samples of every data-parallel rank (as Flow-GRPO and verl take batch statistics
    over the gathered batch). Two passes, the mean and then the squared deviations from it, as ``torch.std``:
    a sum of squares minus the squared sum cancels for rewards far from 0 with a small spread."""
    if sum_over_ranks is None:
        return x.mean(), x.std(correction=0)
    count, total = sum_over_ranks(torch.stack([x.new_tensor(x.numel()), x.sum()]))
    mean = total / count
    squares = sum_over_ranks(((x - mean) ** 2).sum().reshape(1))[0]
    return mean, (squares / count).sqrt()


def group_normalized(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std: Literal["group", "global", "none"] = "group",
    center: Literal["mean", "median"] = "mean",
    eps: float = 1e-6,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Group-relative advantages (GRPO and its scale variants).

    ``A_i = (r_i - c_g(i)) / (s + eps)`` where ``c_g`` is the mean (or lower median) of sample i's group and
    ``s`` is the population std (ddof=0) of the group (``"group"``, GRPO, DeepSeekMath 2402.03300 eq. 3), of
    the raw rewards of the whole batch (``"global"``: group mean, batch std, as TRL's
    ``scale_rewards="batch"``, LitePPO 2508.08221 and Flow-GRPO's ``global_std``; under data parallelism the
    batch of every rank, with ``sum_over_ranks``; not REINFORCE++-baseline 2501.03262, which whitens the
    group-centred rewards ``r_i - c_g(i)`` over the batch), or 1 (``"none"``, Dr.GRPO 2503.20783 sec. 3.1).

    The population std follows Flow-GRPO's per-prompt stat tracker (``np.std``, ddof=0); verl and TRL divide
    by the unbiased std (ddof=1), so their group-std advantages are these times ``sqrt((G-1)/G)`` for a group
    of G (0.935 for G=8). A group whose rewards are all equal gets exactly 0 (:meth:`Groups.varies`), never
    rounding noise divided by ``eps``. Statistics are computed in float64.

    Args:
        rewards: ``[N]`` rewards (float, integer or bool).
        group_ids: ``[N]`` integer group id per sample (any values; groups may differ in size).
        std: which standard deviation divides the centred reward.
        center: ``"mean"`` or ``"median"`` (lower median for even-sized groups, as ``torch.median``).
        eps: added to the std so constant groups give 0, not NaN.
        sum_over_ranks: with ``std="global"``, sums over the data-parallel ranks, so that the batch std is
            the one of every rank's rewards; ``None``: this process holds the whole batch.

    Returns:
        ``[N]`` advantages in the dtype of ``rewards`` (float32 for integer or bool rewards).
    """
    groups = _check_rewards(rewards, group_ids)
    r = _wide(rewards)
    if center == "mean":
        centre = groups.mean(r)
    elif center == "median":
        centre = groups.median(r)[0]
    else:
        raise ValueError(f"center must be 'mean' or 'median', got {center!r}")
    # a constant group is centred to exactly 0, whatever the mean's rounding
    centred = torch.where(groups.varies(r), r - centre[groups.index], 0.0)
    if std == "group":
        scale = groups.std(r)[groups.index]
    elif std == "global":
        scale = _batch_mean_std(r, sum_over_ranks)[1]
    elif std == "none":
        return centred.to(_result_dtype(rewards))
    else:
        raise ValueError(f"std must be 'group', 'global' or 'none', got {std!r}")
    return (centred / (scale + eps)).to(_result_dtype(rewards))


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out advantages (Ahmadian et al. 2402.14740 eq. 5; Kool et al. 2019).

    ``A_i = r_i - (1/(G-1)) * sum_{j != i} r_j = G/(G-1) * (r_i - mean_g)``; exactly 0 for a group of equal
    rewards (:meth:`Groups.varies`).

    Raises:
        ValueError: if any group has a single sample (its leave-one-out baseline is undefined).
    """
    groups = _check_rewards(rewards, group_ids)
    if bool((groups.sizes < 2).any()):
        raise ValueError(
            "rloo needs at least 2 samples per group; a group of size 1 has no leave-one-out baseline"
        )
    r = _wide(rewards)
    sums = groups.sum(r)[groups.index]
    sizes = groups.sizes.to(r.dtype)[groups.index]
    return torch.where(groups.varies(r), r - (sums - r) / (sizes - 1), 0.0).to(_result_dtype(rewards))


def median_centered(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """MC-GRPO median-centred advantages with the pivot sample excluded.

    Each group has an odd number ``G+1`` of samples; ``A_i = (r_i - median_g) / (std_g + eps)`` with the
    population std of the group. The median is scaled by the std, not the MAD: for binary rewards the MAD is
    usually 0 and would blow the advantages up. The sample sitting at the median (the pivot; ties resolved by
    batch order) gets ``A = 0`` and ``pivot_mask = True`` and must be excluded from the loss, leaving ``G``
    trained samples per group (MC-GRPO, "median-centred GRPO"). A group of equal rewards gets exactly 0.

    Not done here: the MC-GRPO reference code also multiplies each group's non-zero advantages by the group
    size over their number, so a group keeps the same total advantage mass however many samples tie with its
    median. Without it, a group with many ties (binary rewards that are mostly right or mostly wrong, e.g.
    ``[1, 0, 0, 0, 0]``: one non-zero advantage) trains with proportionally smaller advantages than there.

    Returns:
        ``(adv [N], pivot_mask [N] bool)``.

    Raises:
        ValueError: if a group has an even number of samples (its median is not a sample).
    """
    groups = _check_rewards(rewards, group_ids)
    if bool((groups.sizes % 2 == 0).any()):
        sizes = groups.sizes[groups.sizes % 2 == 0].unique().tolist()
        raise ValueError(f"median_centered needs odd group sizes (G+1 rollouts); got groups of size {sizes}")
    r = _wide(rewards)
    median, pivot = groups.median(r)
    centred = torch.where(groups.varies(r), r - median[groups.index], 0.0)
    adv = centred / (groups.std(r)[groups.index] + eps)
    pivot_mask = torch.zeros_like(rewards, dtype=torch.bool)
    pivot_mask[pivot] = True
    return adv.masked_fill(pivot_mask, 0.0).to(_result_dtype(rewards)), pivot_mask


def decoupled_multi_reward(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    weights: torch.Tensor | None = None,
    eps: float = 1e-6,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """GDPO: normalise each reward within its group, take the weighted sum, then whiten over the batch.

    ``a_ik = (r_ik - mean_g(r_k)) / (std_g(r_k) + eps)``, ``s_i = sum_k w_k a_ik``,
    ``A_i = (s_i - mean(s)) / (std(s) + eps)`` (Liu et al., GDPO, 2601.05242), ``mean`` and population ``std``
    over the batch (of every data-parallel rank, with ``sum_over_ranks``). Normalising each reward on its
    own keeps reward combinations that plain GRPO on the summed reward collapses to the same advantage. A
    reward that is equal across a group gives that group ``a_ik = 0`` exactly (:meth:`Groups.varies`); a
    group where no reward varies gets ``A_i = 0`` (every group's ``s`` sums to 0, so ``mean(s)`` is 0 up to
    rounding).

    Args:
        rewards: ``[N, K]`` K rewards per sample.
        group_ids: ``[N]``.
        weights: ``[K]`` reward weights (default all ones).
        sum_over_ranks: sums over the data-parallel ranks, for the batch whitening over every rank's samples;
            ``None``: this process holds the whole batch.

    Returns:
        ``[N]`` advantages in the dtype of ``rewards`` (float32 for integer or bool rewards).
    """
    if rewards.ndim != 2 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty [N, K] tensor, got shape {tuple(rewards.shape)}")
    check_finite("rewards", rewards)
    groups = make_groups(group_ids)
    if group_ids.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"group_ids has {group_ids.shape[0]} entries but rewards has {rewards.shape[0]} rows"
        )
    k = rewards.shape[1]
    weights = torch.ones(k, dtype=rewards.dtype, device=rewards.device) if weights is None else weights
    if weights.shape != (k,):
        raise ValueError(f"weights must have shape [{k}] (one per reward), got {tuple(weights.shape)}")
    r = _wide(rewards)
    mean = groups.mean(r)  # [G, K]
    varies = groups.varies(r)  # [N, K]: reward k is not constant in the sample's group
    centred = torch.where(varies, r - mean[groups.index], 0.0)  # [N, K]
    std = groups.std(r, mean)  # [G, K]
    summed = (centred / (std[groups.index] + eps)) @ _wide(weights)  # [N]
    mean, std = _batch_mean_std(summed, sum_over_ranks)
    adv = (summed - mean) / (std + eps)
    # a group with no varying reward has s = 0; keep it at 0 rather than at -mean(s)'s rounding noise / std(s)
    return torch.where(varies.any(dim=1), adv, 0.0).to(_result_dtype(rewards))


def tree_depthwise(
    leaf_rewards: torch.Tensor,
    parent: torch.Tensor,
    tree_ids: torch.Tensor | None = None,
    fusion: Literal["mean", "path_prob"] = "mean",
    edge_logprob: torch.Tensor | None = None,
    eps: float = 1e-8,
    min_std: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BranchGRPO tree advantages: fuse leaf rewards into every node, normalise among nodes of a depth.

    Nodes are numbered ``0..M-1``; ``parent[m]`` is the parent node (``-1`` for a root) and must be smaller than
    ``m`` (nodes listed parents first, as a rollout creates them). A node's reward is the mean of the rewards of
    the leaves below it (``fusion="mean"``) or their path-probability-weighted mean (``"path_prob"``: at each
    node the children are weighted by the softmax of their edge log-probs, so a leaf's weight is the product of
    those along its path). The advantage of node ``m`` is its reward normalised among the ``n`` nodes of the same
    depth ``d`` in the same tree ``t`` (Li et al., BranchGRPO, 2509.06040, "depth-wise advantage"):

        A_m = (R_m - mean_{d,t}) / (std_{d,t} + eps)    if std_{d,t} >= min_std, else 0
        std_{d,t} = sqrt(sum_{k in (d,t)} (R_k - mean_{d,t})^2 / (n - 1))

    the unbiased std (``torch.std``), the threshold ``min_std = 1e-6`` and ``eps = 1e-8`` of the BranchGRPO code
    (``compute_hierarchical_advantages_by_depth``). Every edge ``parent -> m`` trains with ``A_m``. Roots get 0
    (they have no edge), and so does every node of a (tree, depth) level of one node or of node rewards that are
    all equal. Computed in float64: nodes whose rewards are equal in exact arithmetic but reached by different
    sums then differ by ~1e-16, not ~1e-8.

    Args:
        leaf_rewards: ``[M]`` rewards at leaves; entries at internal nodes are ignored (may be NaN).
        parent: ``[M]`` int64 parent index, ``-1`` for roots.
        tree_ids: ``[M]`` tree of each node (default: derived from the roots).
        fusion: ``"mean"`` or ``"path_prob"``.
        edge_logprob: ``[M]`` log-prob of the edge into each node (required for ``"path_prob"``).
        eps: added to the level's std.
        min_std: a level whose std is below this gets advantage 0.

    Returns:
        ``(adv [M], node_reward [M])``.
    """
    check_1d("parent", parent)
    check_same_shape(leaf_rewards=leaf_rewards, parent=parent)
    m = parent.numel()
    ids = torch.arange(m, device=parent.device)
    if bool((parent >= ids).any()):
        raise ValueError("parent[m] must be < m (list parents before their children) or -1 for a root")
    has_child = torch.zeros(m, dtype=torch.bool, device=parent.device)
    has_child[parent[parent >= 0]] = True
    is_leaf = ~has_child
    check_finite("leaf_rewards at leaves", leaf_rewards[is_leaf])

    # Depth and root of every node: one pass per tree level (a handful), never one per node.
    depth = torch.zeros(m, dtype=torch.long, device=parent.device)
    root_of = ids.clone()
    ancestor = parent.clone()
    while bool((ancestor >= 0).any()):
        has = ancestor >= 0
        depth = depth + has.long()
        root_of = torch.where(has, ancestor, root_of)
        ancestor = torch.where(has, parent[ancestor.clamp(min=0)], ancestor)
    tree = root_of if tree_ids is None else tree_ids

    dtype = _result_dtype(leaf_rewards)
    wide = torch.float64  # of the sums and statistics (see _wide)
    if fusion == "mean":
        edge_weight = torch.ones(m, dtype=wide, device=parent.device)
    elif fusion == "path_prob":
        if edge_logprob is None:
            raise ValueError("fusion='path_prob' needs edge_logprob, the log-prob of the edge into each node")
        check_same_shape(edge_logprob=edge_logprob, parent=parent)
        # softmax over siblings: exp(l_c - max) / sum over siblings. The siblings' key is their parent; a root
        # gets m + its id, which no parent id equals: keyed by its own id it would join its children's softmax
        # (and its edge log-prob, far above theirs, would underflow their weights to 0: a NaN node reward)
        sib = torch.where(parent >= 0, parent, m + ids)
        lp = edge_logprob.to(wide)
        sib_max = torch.full((2 * m,), -torch.inf, dtype=wide, device=parent.device).scatter_reduce(
            0, sib, lp, reduce="amax"
        )
        expd = (lp - sib_max[sib]).exp()
        edge_weight = expd / torch.zeros(2 * m, dtype=wide, device=parent.device).index_add(0, sib, expd)[sib]
    else:
        raise ValueError(f"fusion must be 'mean' or 'path_prob', got {fusion!r}")

    # Bottom-up: numerator/denominator of the weighted leaf mean, one level at a time.
    num = torch.where(is_leaf, leaf_rewards.to(wide), torch.zeros((), dtype=wide, device=parent.device))
    den = is_leaf.to(wide)
    for d in range(int(depth.max()), 0, -1):
        at = (depth == d).nonzero().squeeze(1)
        num = num.index_add(0, parent[at], edge_weight[at] * num[at])
        den = den.index_add(0, parent[at], edge_weight[at] * den[at])
    node_reward = num / den

    key = tree * (int(depth.max()) + 1) + depth
    level = make_groups(key)
    mean = level.mean(node_reward)[level.index]
    size = level.sizes.to(wide)[level.index]
    # population std times sqrt(n / (n - 1)): the unbiased std; a level of one node has std 0, so advantage 0
    std = level.std(node_reward)[level.index] * (size / (size - 1).clamp(min=1)).sqrt()
    # equal rewards (std ~1e-16 from rounding) fall under min_std: exactly 0
    adv = torch.where(std >= min_std, (node_reward - mean) / (std + eps), 0.0).masked_fill(parent < 0, 0.0)
    return adv.to(dtype), node_reward.to(dtype)


def process_supervised(
    step_rewards: torch.Tensor,
    step_rows: torch.Tensor,
    step_first: torch.Tensor,
    step_last: torch.Tensor,
    step_groups: torch.Tensor,
    num_rows: int,
    num_tokens: int,
    credit: Literal["return", "step"] = "return",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Token advantages from rewards on the steps of each completion (process supervision).

    Each step ``j`` is a span of tokens ``step_first[j] .. step_last[j]`` of completion ``step_rows[j]`` with a
    reward ``r_j`` (e.g. 1 if the step is a right one, else 0). The rewards are normalised among the steps of a
    group, ``r~_j = (r_j - mean_g(r)) / (std_g(r) + eps)`` (population std over every step of the group's
    completions), and turned into token advantages:

    * ``credit="return"``: ``A_{i,t} = sum_{j of i: last_j >= t} r~_j``, the sum of the normalised rewards of
      the steps that end at or after token ``t`` (DeepSeekMath 2402.03300, sec. 4.1.3, GRPO with process
      supervision): a token is credited with everything that follows it;
    * ``credit="step"``: ``A_{i,t} = r~_j`` for the tokens of step ``j`` and 0 elsewhere: each step answers for
      itself only, so a wrong count written after a right one does not lower the right one.

    Tokens after a completion's last step (e.g. its answer) get 0 from the steps; add a sequence advantage for them.

    Args:
        step_rewards: ``[S]`` reward of each step.
        step_rows: ``[S]`` int64 completion (row) of each step, in ``[0, num_rows)``.
        step_first, step_last: ``[S]`` int64 first and last token of each step (inclusive), in
            ``[0, num_tokens)``, ``first <= last``.
        step_groups: ``[S]`` the group a step is normalised in (group mode: its completion's prompt group;
            single rollout: one group for the whole batch).
        num_rows, num_tokens: the shape ``[B, T]`` of the result.

    Returns:
        ``[num_rows, num_tokens]`` float advantages (zero rows for completions without steps).
    """
    if step_rewards.ndim != 1:
        raise ValueError(f"step_rewards must be 1-D [S], got shape {tuple(step_rewards.shape)}")
    check_same_shape(
        step_rewards=step_rewards,
        step_rows=step_rows,
        step_first=step_first,
        step_last=step_last,
        step_groups=step_groups,
    )
    if credit not in ("return", "step"):
        raise ValueError(f"credit must be 'return' or 'step', got {credit!r}")
    dtype = _result_dtype(step_rewards)
    out = torch.zeros(num_rows, num_tokens, dtype=dtype, device=step_rewards.device)
    if step_rewards.numel() == 0:  # no completion stated a step
        return out
    check_finite("step_rewards", step_rewards)
    if bool((step_rows < 0).any() or (step_rows >= num_rows).any()):
        raise ValueError(f"step_rows must lie in [0, {num_rows}), got {step_rows.tolist()}")
    if bool((step_first < 0).any() or (step_last >= num_tokens).any() or (step_first > step_last).any()):
        raise ValueError(f"step token spans must satisfy 0 <= first <= last < {num_tokens}")
    normalised = group_normalized(step_rewards.to(dtype), step_groups, eps=eps)
    tokens = torch.arange(num_tokens, device=step_rewards.device)
    if credit == "return":
        covers = tokens[None, :] <= step_last[:, None]  # [S, T]: step j is at or after token t
    else:
        covers = (tokens[None, :] >= step_first[:, None]) & (tokens[None, :] <= step_last[:, None])
    return out.index_add(0, step_rows, covers.to(dtype) * normalised[:, None])


def single_rollout(
    rewards: torch.Tensor,
    baseline: torch.Tensor,
    scale: Literal["batch_std", "none"] = "batch_std",
    center: bool = False,
    eps: float = 1e-6,
    sum_over_ranks: SumOverRanks | None = None,
) -> torch.Tensor:
    """Single-rollout advantages against a persistent per-prompt baseline (SPO 2509.13232; MSSR).

    ``A_i = r_i - V(x_i)`` with ``V`` the prompt's value from the statistics store (``PromptStats.value``), then
    divided by the batch std of ``A`` (``scale="batch_std"``) when that std exceeds ``eps``; a batch whose
    advantages are all equal (e.g. every reward 0 against one shared prior) keeps them unscaled, since dividing by
    ``eps`` would blow a -0.1 up to -1e5. Centring ``A`` on its batch mean is optional and off by default: with
    one rollout per prompt it can turn a correct answer's advantage negative. The batch mean and std are those
    of every data-parallel rank's advantages with ``sum_over_ranks`` (all ranks then agree on whether to scale).

    Args:
        rewards: ``[N]`` one reward per prompt (float, integer or bool; integer or bool give float32).
        baseline: ``[N]`` the prompt's value estimate, taken before this batch's update.
        sum_over_ranks: sums over the data-parallel ranks; ``None``: this process holds the whole batch.
    """
    check_1d("rewards", rewards)
    check_finite("rewards", rewards)
    check_same_shape(rewards=rewards, baseline=baseline)
    check_finite("baseline", baseline)
    adv = rewards.to(_result_dtype(rewards)) - baseline
    if center:
        adv = adv - _batch_mean_std(adv, sum_over_ranks)[0]
    if scale == "batch_std":
        std = _batch_mean_std(adv, sum_over_ranks)[1]
        return adv / (std + eps) if std > eps else adv
    if scale == "none":
        return adv
    raise ValueError(f"scale must be 'batch_std' or 'none', got {scale!r}")


def entropy_shaped(
    adv: torch.Tensor, entropy: torch.Tensor, alpha: float = 0.4, kappa: float = 2.0
) -> torch.Tensor:
    """Entropy-shaped token advantages (Cheng et al., "Reasoning with Exploration: An Entropy Perspective",
    2506.14758, eq. 6; used by MSSR).

    ``A_t <- A_t + min(alpha * H_t.detach(), |A_t| / kappa)``. The bonus is never larger than ``|A_t| / kappa``,
    so with ``kappa > 1`` it can shrink a negative advantage but never flip its sign, and a zero advantage stays
    zero.

    Args:
        adv: ``[B]`` sequence advantages (broadcast over tokens) or ``[B, T]`` token advantages.
        entropy: ``[B, T]`` token entropies (detached here; the bonus carries no gradient).
        alpha: entropy coefficient (paper: 0.4).
        kappa: clip ratio of the bonus to ``|A|`` (paper: 2).
    """
    if kappa <= 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    if adv.ndim == 1 and entropy.ndim == 2:
        adv = adv.unsqueeze(1).expand_as(entropy)
    check_same_shape(adv=adv, entropy=entropy)
    bonus = torch.minimum(alpha * entropy.detach(), adv.abs() / kappa)
    shaped = adv + bonus
    # In floating point |A| / kappa can round up to |A| for tiny (subnormal) A, and A + bonus would reach 0:
    # a negative advantage is kept at least one representable step below zero, as the exact formula keeps it.
    below_zero = torch.nextafter(torch.zeros_like(shaped), torch.full_like(shaped, -1.0))
    return torch.where(adv < 0, torch.minimum(shaped, below_zero), shaped)


def clip_advantages(adv: torch.Tensor, max_abs: float) -> torch.Tensor:
    """Clamp advantages to ``[-max_abs, max_abs]`` (Flow-GRPO clips at 5)."""
    if max_abs <= 0:
        raise ValueError(f"max_abs must be > 0, got {max_abs}")
    return adv.clamp(-max_abs, max_abs)
