"""Vectorised per-group reductions (sum, mean, population std, median) over arbitrary group ids.

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

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``[G]`` per-group sums of ``x [N]``."""
        return torch.zeros(self.num_groups, dtype=x.dtype, device=x.device).index_add_(0, self.index, x)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """``[G]`` per-group means of ``x [N]``."""
        return self.sum(x) / self.sizes.to(x.dtype)

    def std(self, x: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
        """``[G]`` per-group population standard deviations (ddof=0) of ``x [N]``."""
        mean = self.mean(x) if mean is None else mean
        centred = x - mean[self.index]
        return (self.sum(centred * centred) / self.sizes.to(x.dtype)).sqrt()

    def amax(self, x: torch.Tensor) -> torch.Tensor:
        """``[G]`` per-group maxima of ``x [N]``."""
        init = torch.full((self.num_groups,), -torch.inf, dtype=x.dtype, device=x.device)
        return init.scatter_reduce(0, self.index, x, reduce="amax")

    def amin(self, x: torch.Tensor) -> torch.Tensor:
        """``[G]`` per-group minima of ``x [N]``."""
        init = torch.full((self.num_groups,), torch.inf, dtype=x.dtype, device=x.device)
        return init.scatter_reduce(0, self.index, x, reduce="amin")

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
    groups = groups_for(rewards, group_ids)
    varied = (groups.amax(rewards) > groups.amin(rewards))[groups.index]
    return float(varied.double().mean())
