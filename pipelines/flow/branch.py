"""Branching (tree) rollouts: shared denoising prefixes, every node of a step evaluated as one batch.

A tree starts from one initial noise per prompt. At a *split step* every frontier node takes one velocity
evaluation and then ``b`` independent SDE draws from the same Gaussian ``N(mean, std^2)``: ``b`` children whose
edge log-probs are exactly the SDE log-probs of their draws (no widened split noise, so the likelihood that is
optimised is the one that sampled). Between splits each node continues with one draw per SDE step (or an Euler
step outside the SDE window). With splits at steps ``s_1 < ... < s_K`` and factors ``b_1..b_K``, step ``i``
evaluates ``P * prod_{s_k < i} b_k`` latents, all of them — across all trees — in one transformer batch
(BranchGRPO, arXiv 2509.06040, evaluates its nodes one at a time and so never turns its NFE saving into time).

Tree nodes are *segments*: a node starts with the draw that created it and runs until its own split (or the
end); ``parent[m] < m``. Every SDE transition belongs to exactly one node; the trainer gives it that node's
depth-wise advantage (``mmrl.core.advantages.tree_depthwise``). Roots carry the shared prefix, which has no
alternative within its tree and so no advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipelines.flow.adapters.base import Conditioning, FlowAdapter
from pipelines.flow.rollout import (
    SamplingConfig,
    TransitionBatch,
    check_sde_steps,
    rollout_sigmas,
    velocity_batched,
)
from pipelines.flow.sde import ode_step, sde_step

__all__ = ["TreeConfig", "TreeRollout", "prune_transitions", "tree_nfe", "tree_rollout"]


@dataclass(frozen=True)
class TreeConfig:
    """Where and how wide trees branch.

    Attributes:
        split_steps: denoising steps whose SDE draw branches (each must be an SDE step).
        branch_factor: children per split, one int for all splits or one per split (each >= 2).
    """

    split_steps: tuple[int, ...]
    branch_factor: int | tuple[int, ...] = 2

    def factors(self) -> tuple[int, ...]:
        f = (
            (self.branch_factor,) * len(self.split_steps)
            if isinstance(self.branch_factor, int)
            else self.branch_factor
        )
        if len(f) != len(self.split_steps):
            raise ValueError(f"branch_factor has {len(f)} entries for {len(self.split_steps)} split steps")
        if any(b < 2 for b in f):
            raise ValueError(f"every branch factor must be >= 2, got {list(f)}")
        return tuple(f)

    def leaves_per_tree(self) -> int:
        out = 1
        for b in self.factors():
            out *= b
        return out


def tree_nfe(num_prompts: int, num_steps: int, tree: TreeConfig, nfe_per_sample: int = 1) -> int:
    """Transformer evaluations of a tree rollout: ``sum_i P * prod_{s_k < i} b_k`` times the CFG factor."""
    total, width = 0, 1
    splits = dict(zip(tree.split_steps, tree.factors(), strict=True))
    for i in range(num_steps):
        total += num_prompts * width
        width *= splits.get(i, 1)
    return total * nfe_per_sample


@dataclass
class TreeRollout:
    """The result of :func:`tree_rollout` for ``P`` trees with ``L`` leaves in all and ``M`` nodes.

    Attributes:
        prompts: the ``P`` prompts (tree ``t`` belongs to ``prompts[t]``).
        parent: ``[M]`` parent node, -1 for roots; ``parent[m] < m``.
        node_tree: ``[M]`` tree of each node.
        node_depth: ``[M]`` number of splits above the node (roots 0).
        leaf_node: ``[L]`` node of each final sample, in the order of ``images``.
        leaf_tree: ``[L]`` tree (prompt) of each final sample.
        images: ``[L, 3, H, W]`` (video ``[L, T, 3, H, W]``) in [0, 1].
        final_latents: ``[L, ...]`` the clean latents.
        transitions: every SDE transition; ``sample_index`` holds the node the transition belongs to.
        cond: conditioning of the ``P`` trees (``cond.select(leaf_tree)`` gives the leaves').
        nfe: transformer evaluations spent.
        sigmas: ``[S+1]`` schedule.
        config, tree: the settings used.
    """

    prompts: list[str]
    parent: torch.Tensor
    node_tree: torch.Tensor
    node_depth: torch.Tensor
    leaf_node: torch.Tensor
    leaf_tree: torch.Tensor
    images: torch.Tensor
    final_latents: torch.Tensor
    transitions: TransitionBatch
    cond: Conditioning
    nfe: int
    sigmas: torch.Tensor
    config: SamplingConfig = field(repr=False)
    tree: TreeConfig = field(repr=False)

    @property
    def leaf_prompts(self) -> list[str]:
        return [self.prompts[t] for t in self.leaf_tree.tolist()]

    def node_rewards(self, leaf_rewards: torch.Tensor) -> torch.Tensor:
        """``[M]`` with the leaf rewards placed at their nodes and NaN elsewhere (``tree_depthwise``'s input)."""
        out = torch.full((self.parent.numel(),), float("nan"), dtype=torch.float32)
        out[self.leaf_node] = leaf_rewards.float()
        return out


def _validate(config: SamplingConfig, tree: TreeConfig) -> dict[int, int]:
    factors = tree.factors()
    sde = config.sde_steps()
    splits: dict[int, int] = {}
    for step, b in zip(tree.split_steps, factors, strict=True):
        if not 0 <= step < config.num_steps:
            raise ValueError(f"split step {step} is outside 0..{config.num_steps - 1}")
        if not bool(sde[step]):
            raise ValueError(f"split step {step} is an ODE step (deterministic): splits need SDE steps")
        if step in splits:
            raise ValueError(f"split step {step} listed twice")
        splits[step] = b
    return splits


@torch.no_grad()
def tree_rollout(
    adapter: FlowAdapter,
    prompts: Sequence[str],
    config: SamplingConfig,
    tree: TreeConfig,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> TreeRollout:
    """Grow one tree per prompt; see the module docstring.

    Args:
        adapter: the model.
        prompts: ``P`` prompts, one tree each.
        config: sampling settings (its SDE window decides which steps are stochastic).
        tree: split steps and branch factors.
        generator: CPU RNG of the root noise and every SDE draw.
        noise: ``[P, ...]`` root noises instead of drawing them.

    Raises:
        ValueError: a split at an ODE step or out of range, a factor < 2, root noise of the wrong shape, or SDE
            steps that add no noise (:func:`~pipelines.flow.rollout.check_sde_steps`).
    """
    splits = _validate(config, tree)
    prompts = list(prompts)
    num_trees = len(prompts)
    device = adapter.device
    # 1. conditioning once per tree
    cfg = adapter.uses_cfg(config.guidance_scale)
    cond_trees: Conditioning = adapter.encode(prompts, cfg=cfg, negative_prompt=config.negative_prompt)
    sigmas = rollout_sigmas(adapter, config)
    sde = config.sde_steps()
    check_sde_steps(config, sigmas, sde)
    shape = adapter.latent_shape(config.height, config.width, config.num_frames)
    # 2. roots
    x = torch.randn((num_trees, *shape), generator=generator) if noise is None else noise.float()
    if tuple(x.shape) != (num_trees, *shape):
        raise ValueError(f"noise has shape {tuple(x.shape)}, expected {(num_trees, *shape)}")
    parent = [-1] * num_trees
    node_tree = list(range(num_trees))
    node_depth = [0] * num_trees
    row_node = torch.arange(num_trees)  # node of each frontier row
    row_tree = torch.arange(num_trees)
    rec: dict[str, list[torch.Tensor]] = {k: [] for k in ("lat", "nxt", "step", "lp", "node")}
    nfe = 0
    x = x.to(device)
    # 3. denoise the whole frontier of all trees as one batch per step
    for i in range(config.num_steps):
        cond = cond_trees.select(row_tree)
        v = velocity_batched(adapter, x, sigmas[i], cond, config.guidance_scale, config.max_batch_size)
        nfe += x.shape[0] * adapter.nfe_per_sample(config.guidance_scale)
        if not bool(sde[i]):
            x = ode_step(x, v, sigmas[i], sigmas[i + 1])
            continue
        b = splits.get(i, 1)
        if b > 1:
            first = len(parent)
            parents = row_node.repeat_interleave(b)
            trees = row_tree.repeat_interleave(b)
            depth = torch.tensor(node_depth)[parents] + 1
            parent.extend(parents.tolist())
            node_tree.extend(trees.tolist())
            node_depth.extend(depth.tolist())
            row_node = torch.arange(first, first + parents.numel())
            row_tree = trees
            x, v = x.repeat_interleave(b, 0), v.repeat_interleave(b, 0)
        step_noise = torch.randn(x.shape, generator=generator).to(device)
        x_next, lp, _, _ = sde_step(
            x,
            v,
            sigmas[i],
            sigmas[i + 1],
            config.noise_level,
            config.sde_kind,
            noise=step_noise,
            log_prob_form=config.log_prob_form,
        )
        rec["lat"].append(x.cpu())
        rec["nxt"].append(x_next.cpu())
        rec["step"].append(torch.full((x.shape[0],), i, dtype=torch.long))
        rec["lp"].append(lp.cpu())
        rec["node"].append(row_node.clone())
        x = x_next
    # 4. decode the leaves
    images = adapter.decode(x).cpu()
    steps = torch.cat(rec["step"]) if rec["step"] else torch.zeros(0, dtype=torch.long)
    nodes = torch.cat(rec["node"]) if rec["node"] else torch.zeros(0, dtype=torch.long)
    node_tree_t = torch.tensor(node_tree)
    transitions = TransitionBatch(
        latents=torch.cat(rec["lat"]) if rec["lat"] else torch.zeros((0, *shape)),
        next_latents=torch.cat(rec["nxt"]) if rec["nxt"] else torch.zeros((0, *shape)),
        sigma=sigmas[steps],
        sigma_next=sigmas[steps + 1],
        log_probs=torch.cat(rec["lp"]) if rec["lp"] else torch.zeros(0),
        cond=cond_trees.select(node_tree_t[nodes]),
        sample_index=nodes,
        step_index=steps,
        guidance_scale=config.guidance_scale,
        noise_level=config.noise_level,
        sde_kind=config.sde_kind,
        log_prob_form=config.log_prob_form,
    )
    return TreeRollout(
        prompts=prompts,
        parent=torch.tensor(parent),
        node_tree=node_tree_t,
        node_depth=torch.tensor(node_depth),
        leaf_node=row_node,
        leaf_tree=row_tree,
        images=images,
        final_latents=x.cpu(),
        transitions=transitions,
        cond=cond_trees,
        nfe=nfe,
        sigmas=sigmas,
        config=config,
        tree=tree,
    )


def prune_transitions(
    tree: TreeRollout,
    node_adv: torch.Tensor,
    depths: Sequence[int] | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Indices of the transitions to train on after depth and width pruning (forward rollouts are unaffected).

    Args:
        tree: the tree rollout.
        node_adv: ``[M]`` node advantages.
        depths: train only transitions of nodes at these depths (depth pruning); None keeps all.
        width: per tree and depth, train only the ``width`` nodes with the largest ``|A|`` (width pruning; ties
            by node index); None keeps all.

    Returns:
        ``[n]`` int64 indices into ``tree.transitions``, in order.
    """
    keep_node = torch.ones(tree.parent.numel(), dtype=torch.bool)
    if depths is not None:
        keep_node &= torch.isin(tree.node_depth, torch.tensor(list(depths), dtype=torch.long))
    if width is not None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        key = (
            tree.node_tree * (int(tree.node_depth.max()) + 1) + tree.node_depth
        )  # [M] one group per (tree, depth)
        # rank nodes by -|A| within their group (stable: node index breaks ties)
        order = torch.sort(-node_adv.abs(), stable=True).indices
        order = order[torch.sort(key[order], stable=True).indices]
        sizes = torch.bincount(key)
        starts = torch.cumsum(sizes, 0) - sizes
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel()) - starts[key[order]]
        keep_node &= rank < width
    return torch.nonzero(keep_node[tree.transitions.sample_index]).flatten()
