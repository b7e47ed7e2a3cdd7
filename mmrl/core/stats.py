"""The per-prompt statistics store shared by the baseline, the prompt sampler and the allocator.

One store keyed by prompt id holds, per prompt:

- decayed success/failure evidence ``(s, f)`` for rewards in [0, 1]. The Beta posterior is
  ``alpha = s + k * m``, ``beta = f + k * (1 - m)``: a shrinkage prior of strength ``k`` centred on the current
  global success rate ``m`` (so an unseen prompt starts at the population mean without an initialisation pass,
  and the prior follows the population as the policy improves). With ``prior_groups`` (prompt id -> group, e.g.
  the question's template) the centre of a grouped prompt is its group's running mean shrunk to ``m`` with the
  same strength, ``m_g = (S_g + k * m) / (N_g + k)`` (``S_g, N_g``: the group's sum of rewards clipped to [0, 1]
  and count; ``m`` is the same over every reward, so both centres are success rates in (0, 1)), a two-level
  hierarchical prior: with one rollout per prompt and few revisits a prompt's baseline is then its kind's
  success rate, not everyone's;
- a decayed running mean / variance of the unclipped rewards (weighted Welford / Chan merge), shrunk the same
  way toward a centre of unclipped rewards: the value ``V(x)`` a single-rollout baseline subtracts
  (:meth:`PromptStats.value`). For rewards in [0, 1] it equals the Beta posterior mean; for others (a verifier
  plus a format bonus, a preference model's logits) it is their expected reward where the Beta mean would be a
  clipped success rate;
- the number of observations and the last step seen.

Forgetting (discounting old evidence as the policy drifts) happens at each update of a prompt:
``s <- rho * s + sum r``, ``f <- rho * f + sum (1 - r)`` (MoPPS 2507.04632 eq. 6; SPO 2509.13232 eq. 4), with
``rho`` a constant or per prompt, e.g. SPO's KL-adaptive ``rho = clip(2^(-D / 0.06), 0.875, 0.96)`` from
:func:`spo_rho`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from mmrl.core._checks import check_1d, check_finite

__all__ = ["PromptStats", "spo_rho"]


def spo_rho(mean_abs_logp_change: torch.Tensor, half_life: float = 0.06) -> torch.Tensor:
    """SPO's KL-adaptive forgetting factor ``rho = clip(2^(-D / half_life), 0.875, 0.96)``.

    ``D`` is the mean absolute change of the log-prob of the prompt's last response between the policy that
    sampled it and the current one (SPO 2509.13232 sec. 3.2): the more the policy moved, the faster old
    evidence is forgotten.
    """
    return torch.clamp(torch.pow(2.0, -mean_abs_logp_change / half_life), 0.875, 0.96)


_FIELDS = ("success", "failure", "weight", "mean", "m2", "count", "last_step")


class PromptStats:
    """Per-prompt reward statistics with forgetting, a shrinkage prior, checkpointing and rank merging.

    Args:
        rho: default forgetting factor in (0, 1]; 1 keeps all evidence.
        prior_strength: pseudo-count ``k`` of the shrinkage prior (MoPPS uses a Beta(1, 1) prior: k = 2).
        prior_mean: success rate assumed before any reward has been seen.
        prior_groups: optional group of each prompt id; a grouped prompt's prior is centred on its group's
            running mean (module docstring). Prompts not in it keep the global centre.
        device: where the tensors live.

    Example:
        >>> stats = PromptStats(rho=0.9)
        >>> stats.update(["a", "a", "b"], torch.tensor([1.0, 0.0, 1.0]), step=0)
        >>> stats.success_prob(["a", "b", "unseen"])  # posterior means
    """

    def __init__(
        self,
        rho: float = 1.0,
        prior_strength: float = 2.0,
        prior_mean: float = 0.5,
        prior_groups: Mapping[Hashable, Hashable] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not 0 < rho <= 1:
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if not 0 < prior_mean < 1:
            raise ValueError(f"prior_mean must be in (0, 1), got {prior_mean}")
        self.rho = rho
        self.prior_strength = prior_strength
        self.prior_mean = prior_mean
        self.device = torch.device(device)
        self._index: dict[Hashable, int] = {}
        self._ids: list[Hashable] = []
        self._data = {name: torch.zeros(0, dtype=torch.float64, device=self.device) for name in _FIELDS}
        # Global totals (no forgetting) behind the shrinkage prior's centre: clipped rewards for the Beta
        # posterior, unclipped ones for the value.
        self._global_sum = 0.0
        self._global_raw_sum = 0.0
        self._global_count = 0.0
        # Group totals (no forgetting, like the global ones) behind a grouped prompt's prior centre.
        self._group_names: list[Hashable] = sorted(set((prior_groups or {}).values()), key=repr)
        group_index = {name: g for g, name in enumerate(self._group_names)}
        self._group_of = {pid: group_index[name] for pid, name in (prior_groups or {}).items()}
        self._group_sum = torch.zeros(len(self._group_names), dtype=torch.float64, device=self.device)
        self._group_raw_sum = torch.zeros(len(self._group_names), dtype=torch.float64, device=self.device)
        self._group_count = torch.zeros(len(self._group_names), dtype=torch.float64, device=self.device)

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, prompt_id: Hashable) -> bool:
        return prompt_id in self._index

    @property
    def prompt_ids(self) -> list[Hashable]:
        return list(self._ids)

    def _lookup(self, prompt_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index [n] clamped to >= 0, known [n] bool)`` for ids, unseen ones flagged unknown."""
        idx = torch.tensor([self._index.get(p, -1) for p in prompt_ids], dtype=torch.long, device=self.device)
        return idx.clamp(min=0), idx >= 0

    def _grow(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        for p in prompt_ids:
            if p not in self._index:
                self._index[p] = len(self._ids)
                self._ids.append(p)
        n = len(self._ids)
        have = self._data["success"].numel()
        if n > have:
            extra = n - have
            for name in _FIELDS:
                pad = torch.zeros(extra, dtype=torch.float64, device=self.device)
                if name == "last_step":
                    pad -= 1
                self._data[name] = torch.cat([self._data[name], pad])
        return torch.tensor([self._index[p] for p in prompt_ids], dtype=torch.long, device=self.device)

    def global_mean(self) -> float:
        """Centre of the shrinkage prior: ``m = (S + k * prior_mean) / (N + k)``, the mean of every reward seen
        clipped to [0, 1] (``S``: their sum, ``N``: their count), pulled to ``prior_mean`` by k."""
        k = self.prior_strength
        return (self._global_sum + k * self.prior_mean) / (self._global_count + k)

    def _groups(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` group index of each id, -1 for an ungrouped one."""
        return torch.tensor(
            [self._group_of.get(p, -1) for p in prompt_ids], dtype=torch.long, device=self.device
        )

    def prior_centre(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` centre of each prompt's shrinkage prior: ``m_g = (S_g + k * m) / (N_g + k)`` for a grouped
        prompt, the global mean ``m`` otherwise."""
        return self._centre(prompt_ids, self.global_mean(), self._group_sum)

    def value_centre(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` the same centres over unclipped rewards, toward which :meth:`value` shrinks: ``m_g`` and ``m``
        with ``S_g, S`` the sums of the rewards themselves (equal to :meth:`prior_centre` for rewards in [0, 1])."""
        k = self.prior_strength
        global_value = (self._global_raw_sum + k * self.prior_mean) / (self._global_count + k)
        return self._centre(prompt_ids, global_value, self._group_raw_sum)

    def _centre(
        self, prompt_ids: Sequence[Hashable], global_centre: float, group_sums: torch.Tensor
    ) -> torch.Tensor:
        centre = torch.full((len(prompt_ids),), global_centre, dtype=torch.float64, device=self.device)
        if not self._group_of:
            return centre
        groups = self._groups(prompt_ids)
        grouped = groups >= 0
        if bool(grouped.any()):
            g = groups[grouped]
            k = self.prior_strength
            centre[grouped] = (group_sums[g] + k * global_centre) / (self._group_count[g] + k)
        return centre

    # ------------------------------------------------------------------ update
    def update(
        self,
        prompt_ids: Sequence[Hashable],
        rewards: torch.Tensor,
        step: int,
        rho: float | torch.Tensor | None = None,
    ) -> None:
        """Fold a batch of rewards into the store (several rewards per prompt allowed: a group).

        For each prompt with rewards ``r_1..r_n`` in this batch: ``s <- rho s + sum c``,
        ``f <- rho f + sum (1 - c)`` with ``c = clip(r, 0, 1)``, the global and group totals of the prior centres
        add the same ``c`` (the Beta part is only meaningful for rewards in [0, 1]; rewards outside it leave
        ``s, f`` and those centres as clipped evidence), and the running mean/variance and the value's centres
        absorb the unclipped batch, the mean/variance with old weight ``rho * w``.

        Args:
            prompt_ids: ``n`` hashable ids, aligned with ``rewards``.
            rewards: ``[n]`` rewards.
            step: training step (recorded as last seen).
            rho: forgetting factor: None (the store's), a float, or a ``[n]`` tensor aligned with the rewards
                (all entries of one prompt must agree; e.g. :func:`spo_rho` per prompt).
        """
        rewards = rewards.detach().to(device=self.device, dtype=torch.float64)
        check_1d("rewards", rewards)
        check_finite("rewards", rewards)
        if len(prompt_ids) != rewards.numel():
            raise ValueError(f"{len(prompt_ids)} prompt ids but {rewards.numel()} rewards")
        idx = self._grow(prompt_ids)
        uniq, inverse = torch.unique(idx, return_inverse=True)

        if rho is None:
            rho_u = torch.full((uniq.numel(),), self.rho, dtype=torch.float64, device=self.device)
        elif isinstance(rho, torch.Tensor) and rho.ndim > 0:
            rho_t = rho.detach().to(device=self.device, dtype=torch.float64)
            if rho_t.shape != rewards.shape:
                raise ValueError(
                    f"rho tensor must align with rewards {tuple(rewards.shape)}, got {tuple(rho_t.shape)}"
                )
            hi = torch.full((uniq.numel(),), -torch.inf, dtype=torch.float64, device=self.device)
            lo = torch.full((uniq.numel(),), torch.inf, dtype=torch.float64, device=self.device)
            hi = hi.scatter_reduce(0, inverse, rho_t, reduce="amax")
            lo = lo.scatter_reduce(0, inverse, rho_t, reduce="amin")
            if not torch.equal(hi, lo):
                raise ValueError("rho differs between rewards of the same prompt; give one rho per prompt")
            rho_u = hi
        else:
            rho_u = torch.full((uniq.numel(),), float(rho), dtype=torch.float64, device=self.device)
        if bool(((rho_u <= 0) | (rho_u > 1)).any()):
            raise ValueError("rho must lie in (0, 1]")

        def per_prompt(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(uniq.numel(), dtype=torch.float64, device=self.device).index_add_(
                0, inverse, x
            )

        n_b = per_prompt(torch.ones_like(rewards))
        sum_b = per_prompt(rewards)
        mean_b = sum_b / n_b
        m2_b = per_prompt((rewards - mean_b[inverse]) ** 2)
        clipped = rewards.clamp(0.0, 1.0)

        d = self._data
        d["success"][uniq] = rho_u * d["success"][uniq] + per_prompt(clipped)
        d["failure"][uniq] = rho_u * d["failure"][uniq] + per_prompt(1.0 - clipped)
        # Chan et al. parallel variance merge, with the old weight discounted by rho.
        w_old = rho_u * d["weight"][uniq]
        w_new = w_old + n_b
        delta = mean_b - d["mean"][uniq]
        d["mean"][uniq] = d["mean"][uniq] + delta * n_b / w_new
        d["m2"][uniq] = rho_u * d["m2"][uniq] + m2_b + delta**2 * w_old * n_b / w_new
        d["weight"][uniq] = w_new
        d["count"][uniq] = d["count"][uniq] + n_b
        d["last_step"][uniq] = float(step)
        # The prior centres take the clipped rewards, as the evidence does: with rewards above 1 (a verifier plus a
        # format bonus) an unclipped centre passes 1 and beta = f + k (1 - m) turns negative.
        self._global_sum += float(clipped.sum())
        self._global_raw_sum += float(rewards.sum())
        self._global_count += float(rewards.numel())
        if self._group_of:
            groups = self._groups(prompt_ids)
            grouped = groups >= 0
            self._group_sum.index_add_(0, groups[grouped], clipped[grouped])
            self._group_raw_sum.index_add_(0, groups[grouped], rewards[grouped])
            self._group_count.index_add_(0, groups[grouped], torch.ones_like(rewards[grouped]))

    def update_distributed(
        self,
        prompt_ids: Sequence[Hashable],
        rewards: torch.Tensor,
        step: int,
        rho: float | None = None,
        group: Any = None,
    ) -> None:
        """All-gather this rank's (ids, rewards) and apply the union on every rank, keeping stores identical.

        With torch.distributed not initialised this is :meth:`update`.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            self.update(prompt_ids, rewards, step, rho)
            return
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (list(prompt_ids), rewards.detach().cpu().tolist()), group=group)
        all_ids = [p for ids, _ in gathered for p in ids]
        all_rewards = torch.tensor([r for _, rs in gathered for r in rs], dtype=torch.float64)
        self.update(all_ids, all_rewards, step, rho)

    # ------------------------------------------------------------------ queries
    def alpha_beta(self, prompt_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n], [n])`` Beta posterior parameters; unseen prompts get the shrinkage prior alone."""
        idx, known = self._lookup(prompt_ids)
        k, m = self.prior_strength, self.prior_centre(prompt_ids)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        s = torch.where(known, self._data["success"][idx] if len(self) else zero, zero)
        f = torch.where(known, self._data["failure"][idx] if len(self) else zero, zero)
        return s + k * m, f + k * (1 - m)

    def success_prob(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` posterior mean success ``alpha / (alpha + beta)`` (the single-rollout baseline)."""
        a, b = self.alpha_beta(prompt_ids)
        return a / (a + b)

    def value(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` the prompt's expected reward ``V(x) = (w * mu + k * m_v) / (w + k)``: the decayed running mean
        ``mu`` of its rewards (decayed weight ``w``) shrunk to :meth:`value_centre` ``m_v`` with strength ``k``;
        an unseen prompt gets ``m_v``. The single-rollout baseline.

        For rewards in [0, 1] this is :meth:`success_prob` (``w = s + f`` and ``w * mu = s`` under the same
        forgetting); for rewards outside it (a format bonus on top of a verifier, a preference model's scores)
        it stays their expected reward, where the Beta posterior would be a clipped success rate.
        """
        return self.mean_var(prompt_ids)[0]

    def mean_var(self, prompt_ids: Sequence[Hashable]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n], [n])`` :meth:`value` and the decayed weighted population variance of the prompt's rewards
        (0 when unseen)."""
        idx, known = self._lookup(prompt_ids)
        k, centre = self.prior_strength, self.value_centre(prompt_ids)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        if len(self) == 0:
            return centre, torch.zeros(len(prompt_ids), dtype=torch.float64, device=self.device)
        w = torch.where(known, self._data["weight"][idx], zero)
        mu = torch.where(known, self._data["mean"][idx], zero)
        m2 = torch.where(known, self._data["m2"][idx], zero)
        mean = (w * mu + k * centre) / (w + k)
        var = torch.where(w > 0, m2 / w.clamp(min=1e-12), zero)
        return mean, var

    def counts(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` int64 number of rewards ever observed per prompt."""
        idx, known = self._lookup(prompt_ids)
        if len(self) == 0:
            return torch.zeros(len(prompt_ids), dtype=torch.int64, device=self.device)
        return torch.where(known, self._data["count"][idx], torch.zeros((), dtype=torch.float64)).to(
            torch.int64
        )

    def last_step(self, prompt_ids: Sequence[Hashable]) -> torch.Tensor:
        """``[n]`` int64 last step each prompt was updated, -1 if never."""
        idx, known = self._lookup(prompt_ids)
        if len(self) == 0:
            return torch.full((len(prompt_ids),), -1, dtype=torch.int64, device=self.device)
        return torch.where(known, self._data["last_step"][idx], torch.full((), -1.0, dtype=torch.float64)).to(
            torch.int64
        )

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """The store's evidence, everything needed to restore it exactly (ids as a list, tensors on CPU).

        Its settings (``rho``, ``prior_strength``, ``prior_mean``) are not part of it: they come from the
        constructor, which a resumed run builds from its config (see :meth:`load_state_dict`).
        """
        return {
            "ids": list(self._ids),
            "tensors": {name: t.cpu().clone() for name, t in self._data.items()},
            "global_sum": self._global_sum,
            "global_raw_sum": self._global_raw_sum,
            "global_count": self._global_count,
            "group_totals": self._group_totals(),
            "group_raw_sums": self._group_raw_sums(),
        }

    def _group_totals(self) -> dict[Hashable, tuple[float, float]]:
        """``{group: (clipped reward sum, count)}`` of every group of ``prior_groups``."""
        return {
            name: (float(self._group_sum[g]), float(self._group_count[g]))
            for g, name in enumerate(self._group_names)
        }

    def _group_raw_sums(self) -> dict[Hashable, float]:
        """``{group: unclipped reward sum}`` of every group of ``prior_groups``."""
        return {name: float(self._group_raw_sum[g]) for g, name in enumerate(self._group_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the evidence of :meth:`state_dict`, keeping this store's ``rho``, ``prior_strength`` and
        ``prior_mean``: a resumed run uses the settings of its config (which its config.yaml records), not the
        checkpoint's; the settings older checkpoints also hold are ignored.

        Raises:
            ValueError: the state lacks a field, or holds totals of groups this store's ``prior_groups`` lack.
        """
        missing = {"ids", "tensors", "global_sum", "global_count"} - set(state)
        if missing:
            raise ValueError(f"PromptStats state is missing {sorted(missing)}")
        self._ids = list(state["ids"])
        self._index = {p: i for i, p in enumerate(self._ids)}
        self._data = {name: state["tensors"][name].to(self.device, torch.float64).clone() for name in _FIELDS}
        # A checkpoint written before the centres took clipped rewards may hold a sum outside [0, count] (a centre
        # past 1); bounding it keeps the resumed centres success rates.
        # A checkpoint written before the value's centres existed holds one sum per centre (the unclipped rewards'
        # in older ones, the clipped rewards' since): the value's centres start from it, exactly for rewards in
        # [0, 1].
        self._global_count = float(state["global_count"])
        self._global_raw_sum = float(state.get("global_raw_sum", state["global_sum"]))
        self._global_sum = min(max(float(state["global_sum"]), 0.0), self._global_count)
        totals = state.get("group_totals", {})
        raw_sums = state.get("group_raw_sums", {g: t for g, (t, _) in totals.items()})
        self._load_group_totals(
            {g: (min(max(t, 0.0), n), n) for g, (t, n) in totals.items()}, raw_sums, replace=True
        )

    def _load_group_totals(
        self,
        totals: Mapping[Hashable, tuple[float, float]],
        raw_sums: Mapping[Hashable, float],
        replace: bool,
    ) -> None:
        """Set (``replace``) or add the ``{group: (clipped reward sum, count)}`` totals and the ``{group:
        unclipped reward sum}`` of a state or another store."""
        unknown = (set(totals) | set(raw_sums)) - set(self._group_names)
        if unknown:
            raise ValueError(
                f"PromptStats: totals of groups {sorted(unknown, key=repr)} that this store's prior_groups do not "
                f"name (it has {self._group_names}); build the store with the same prior_groups"
            )
        if replace:
            self._group_sum.zero_()
            self._group_raw_sum.zero_()
            self._group_count.zero_()
        for g, name in enumerate(self._group_names):
            total, count = totals.get(name, (0.0, 0.0))
            self._group_sum[g] += total
            self._group_raw_sum[g] += raw_sums.get(name, 0.0)
            self._group_count[g] += count

    def merge(self, other: PromptStats) -> None:
        """Add ``other``'s evidence into this store (in place).

        For stores that saw disjoint observations (data-parallel shards, separate runs): success/failure evidence
        and counts add, means/variances combine by Chan's formula, last step is the max. Exact without forgetting,
        and with forgetting when both stores updated a shared prompt at the same steps with the same rho (a
        prompt's group split across ranks). To keep ranks identical during training prefer
        :meth:`update_distributed`.
        """
        if len(other) == 0:
            return
        idx = self._grow(other._ids)
        o = other._data
        d = self._data
        d["success"][idx] += o["success"].to(self.device)
        d["failure"][idx] += o["failure"].to(self.device)
        w_a, w_b = d["weight"][idx], o["weight"].to(self.device)
        w = w_a + w_b
        delta = o["mean"].to(self.device) - d["mean"][idx]
        safe_w = w.clamp(min=1e-300)
        d["mean"][idx] = torch.where(w > 0, d["mean"][idx] + delta * w_b / safe_w, d["mean"][idx])
        d["m2"][idx] = (
            d["m2"][idx]
            + o["m2"].to(self.device)
            + torch.where(w > 0, delta**2 * w_a * w_b / safe_w, torch.zeros_like(w))
        )
        d["weight"][idx] = w
        d["count"][idx] += o["count"].to(self.device)
        d["last_step"][idx] = torch.maximum(d["last_step"][idx], o["last_step"].to(self.device))
        self._global_sum += other._global_sum
        self._global_raw_sum += other._global_raw_sum
        self._global_count += other._global_count
        self._load_group_totals(other._group_totals(), other._group_raw_sums(), replace=False)
