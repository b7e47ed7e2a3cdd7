"""Vectorised per-group reductions (sum, mean, population std, min/max, median) over arbitrary group ids.

A batch of rollouts is flat: sample ``i`` belongs to group ``group_ids[i]`` (a prompt, a tree depth, ...).
Groups may have different sizes (the allocator gives prompts different rollout counts), so reductions use
``index_add_`` on contiguous group indices instead of a ``[n_groups, group_size]`` reshape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.core._checks import check_1d, check_same_shape


@dataclass(frozen=True)
class Groups:
    """Contiguous group structure of a flat batch.

    Attributes:
        index: ``[N]`` int64, the contiguous group index (0..G-1) of each sample, in order of first id value.
        sizes: ``[G]`` int64, samples per group.
    """

    index: torch.Tensor
    sizes: torch.Tensor

    @property
    def num_groups(self) -> int:
        return int(self.sizes.numel())

    def _sizes_like(self, x: torch.Tensor) -> torch.Tensor:
        """Group sizes in ``x``'s dtype, shaped ``[G, 1, ...]`` to broadcast over ``x``'s trailing dims."""
        return self.sizes.to(x.dtype).view(-1, *(1,) * (x.ndim - 1))

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``[G, ...]`` per-group sums of ``x [N, ...]`` (each trailing column separately)."""
        out = torch.zeros((self.num_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.index, x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``[G, ...]`` per-group means of ``x [N, ...]``."""
        return self.sum(x) / self._sizes_like(x)

    def std(self, x: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
        """``[G, ...]`` per-group population standard deviations (ddof=0) of ``x [N, ...]``."""
        mean = self.mean(x) if mean is None else mean
        centred = x - mean[self.index]
        return (self.sum(centred * centred) / self._sizes_like(x)).sqrt()

    def _scatter(self, x: torch.Tensor, reduce: str, fill: float) -> torch.Tensor:
        init = torch.full((self.num_groups, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        index = self.index.view(-1, *(1,) * (x.ndim - 1)).expand_as(x)  # [N, ...]: the group of every entry
        return init.scatter_reduce(0, index, x, reduce=reduce)

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """``[G, ...]`` per-group maxima of ``x [N, ...]``."""
        return self._scatter(x, "amax", -torch.inf)

    def amin(self, x: torch.Tensor) -> torch.Tensor:
        """``[G, ...]`` per-group minima of ``x [N, ...]``."""
        return self._scatter(x, "amin", torch.inf)

    def varies(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` bool: True where the sample's group holds two different values of ``x [N, ...]``.

        The comparison is exact (``max > min``, no tolerance). A group of equal rewards has a centred reward
        of exactly 0 in exact arithmetic, but in floating point its mean is not exactly its reward (ten
        float32 ``1.1``: ``sum / 10`` is off by ~1e-8), and dividing that noise by a std of the same size
        plus ``eps`` gives advantages of order 0.1, one sign for the whole group. Estimators zero such groups
        with this mask.
        """
        return (self.amax(x) > self.amin(x))[self.index]

    def sort_within(self, x: torch.Tensor) -> torch.Tensor:
        """Permutation ``[N]`` ordering samples by (group, value); ties keep batch order (stable)."""
        by_value = torch.sort(x, stable=True).indices
        by_group = torch.sort(self.index[by_value], stable=True).indices
        return by_value[by_group]

    def starts(self) -> torch.Tensor:
        """``[G]`` offset of each group's first sample in the :meth:`sort_within` order."""
        return torch.cumsum(self.sizes, 0) - self.sizes

    def median(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-group lower median (``torch.median``'s convention) and the sample index holding it.

        Returns:
            ``([G] median values, [G] int64 index into the batch of the median sample)``. For an even-sized group
            the lower of the two middle values is taken, as ``torch.median`` does.
        """
        order = self.sort_within(x)
        pos = self.starts() + (self.sizes - 1) // 2
        sample = order[pos]
        return x[sample], sample


def make_groups(group_ids: torch.Tensor) -> Groups:
    """Build :class:`Groups` from a ``[N]`` integer tensor of group ids (any values, any order)."""
    check_1d("group_ids", group_ids)
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
    lo, hi = int(group_ids.min()), int(group_ids.max())
    if lo >= 0 and hi < 4 * group_ids.numel():
        # Dense non-negative ids (the usual prompt indices): relabel with a bincount, O(N), instead of the
        # sort inside torch.unique. Same result: contiguous indices in increasing id order.
        counts = torch.bincount(group_ids, minlength=hi + 1)
        present = counts > 0
        relabel = torch.cumsum(present, 0) - 1
        return Groups(index=relabel[group_ids], sizes=counts[present])
    _, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return Groups(index=index, sizes=sizes)


def groups_for(rewards: torch.Tensor, group_ids: torch.Tensor) -> Groups:
    """:func:`make_groups` after checking ``group_ids`` aligns with ``rewards``."""
    check_same_shape(rewards=rewards, group_ids=group_ids)
    return make_groups(group_ids)


def effective_ratio(rewards: torch.Tensor, group_ids: torch.Tensor) -> float:
    """Fraction of samples in groups whose rewards are not all equal (the groups that carry gradient).

    A group of identical rewards has zero advantage for every member under any group-relative estimator,
    so its rollouts were spent without learning signal (DAPO 2503.14476 sec. 3.2 "dynamic sampling").
    """
    return float(varied_groups(rewards, group_ids).double().mean())


def varied_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool, True for the samples of groups whose rewards are not all equal (:meth:`Groups.varies`);
    for ``rewards [N, K]`` (several rewards, as GDPO reads them), groups where any one of them varies.

    DAPO's dynamic sampling (2503.14476 sec. 3.2) keeps exactly these samples: it drops or keeps whole groups,
    never one sample of a group that varies, whatever its own advantage.
    """
    if rewards.shape[:1] != group_ids.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} hold different numbers "
            "of samples"
        )
    varies = make_groups(group_ids).varies(rewards)
    return varies if varies.ndim == 1 else varies.flatten(1).any(dim=1)


def groups_in_band(scores: torch.Tensor, group_ids: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``[N]`` bool, True for the samples of groups whose mean score lies strictly between ``low`` and ``high``:
    ``low < mean_{j in g(i)} scores_j < high``.

    EasyR1's online filtering (``algorithm.filter_low`` / ``filter_high``, 0.01 / 0.99 in its DAPO launches)
    keeps these groups, whole. On 0/1 scores and groups of fewer than 100 samples, the band (0.01, 0.99) keeps
    exactly :func:`varied_groups`; on graded scores (a weighted sum of accuracy and format) it differs both
    ways: it keeps a group of equal scores whose value lies inside the band (advantage 0), and drops a group whose
    scores vary around a mean outside it.
    """
    if not low < high:
        raise ValueError(f"the band's low ({low}) must be below its high ({high})")
    groups = groups_for(scores, group_ids)
    # in the scores' own precision, as the bounds are compared: 0.1 in float32 is not above a bound of 0.1
    mean = groups.mean(scores if scores.is_floating_point() else scores.float())[groups.index]
    return (mean > low) & (mean < high)
