"""Branching rollouts: tree bookkeeping, exact edge log-probs, the NFE formula, pruning."""

import pytest
import torch

from mmrl.core.advantages import tree_depthwise
from mmrl.data.shapes import all_prompts
from pipelines.flow.adapters import load_adapter
from pipelines.flow.branch import TreeConfig, prune_transitions, tree_nfe, tree_rollout
from pipelines.flow.rollout import SamplingConfig, rescore
from pipelines.flow.sde import sde_step
from pipelines.flow.tiny import build_shapes_pipeline


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8)
    path = tmp_path_factory.mktemp("shapes_branch")
    pipe.save_pretrained(path)
    return load_adapter("shapes", str(path))


CFG = SamplingConfig(num_steps=4, height=32, width=32, noise_level=0.7)
PROMPTS = ["a photo of a red circle", "a photo of two squares"]


TWO_SPLITS = TreeConfig(split_steps=(1, 2))


def grow(adapter, tree=TWO_SPLITS, seed=0, config=CFG):
    return tree_rollout(adapter, PROMPTS, config, tree, generator=torch.Generator().manual_seed(seed))


def test_tree_bookkeeping_and_nfe(adapter):
    tr = grow(adapter)
    assert tr.parent.numel() == 2 + 4 + 8 and tr.leaf_node.numel() == 8
    assert (tr.parent < torch.arange(tr.parent.numel())).all()
    assert tr.node_depth[tr.leaf_node].tolist() == [2] * 8
    for leaf, t in zip(tr.leaf_node.tolist(), tr.leaf_tree.tolist(), strict=True):
        path = [leaf]
        while tr.parent[path[-1]] >= 0:
            path.append(int(tr.parent[path[-1]]))
        assert path[-1] == t and len(path) == 3  # leaf -> depth-1 node -> root (tree t)
    assert tr.nfe == tree_nfe(2, 4, TreeConfig(split_steps=(1, 2))) == 2 * (1 + 1 + 2 + 4)
    assert tree_nfe(1, 16, TreeConfig(split_steps=(6, 8, 10, 12))) == 7 + 2 * 2 + 4 * 2 + 8 * 2 + 16 * 3
    assert tr.images.shape == (8, 3, 32, 32)


def test_every_leaf_path_is_a_chain_of_exact_sde_steps(adapter):
    tr = grow(adapter)
    trans = tr.transitions
    # edge log-probs are those of the SDE that drew them: re-scoring reproduces them
    logp, _, _ = rescore(adapter, trans)
    torch.testing.assert_close(logp, trans.log_probs, atol=2e-5, rtol=0)
    for leaf in tr.leaf_node.tolist():
        path = [leaf]
        while tr.parent[path[-1]] >= 0:
            path.append(int(tr.parent[path[-1]]))
        rows = torch.nonzero(torch.isin(trans.sample_index, torch.tensor(path))).flatten()
        rows = rows[torch.argsort(trans.step_index[rows])]
        # exactly one transition per step along the path, each starting where the previous ended
        assert trans.step_index[rows].tolist() == [0, 1, 2, 3]
        for a, b in zip(rows[:-1].tolist(), rows[1:].tolist(), strict=True):
            assert torch.equal(trans.next_latents[a], trans.latents[b])
        last = rows[-1]
        assert torch.equal(trans.next_latents[last], tr.final_latents[tr.leaf_node.tolist().index(leaf)])
    # the log-prob of a transition is the Normal log-density of its draw
    v = adapter.velocity(trans.latents[:3], trans.sigma[:3], trans.cond.select([0, 1, 2]), 1.0)
    _, lp, _, _ = sde_step(
        trans.latents[:3], v, trans.sigma[:3], trans.sigma_next[:3], 0.7, prev_sample=trans.next_latents[:3]
    )
    torch.testing.assert_close(lp, trans.log_probs[:3], atol=2e-5, rtol=0)


def test_deterministic_under_seed_and_children_differ(adapter):
    a, b = grow(adapter, seed=3), grow(adapter, seed=3)
    assert torch.equal(a.final_latents, b.final_latents)
    assert not torch.equal(a.final_latents[0], a.final_latents[1])  # siblings drew different noise


def test_pruning_and_depthwise_advantages(adapter):
    tr = grow(adapter)
    rewards = torch.arange(8, dtype=torch.float32) % 3
    adv, _ = tree_depthwise(tr.node_rewards(rewards), tr.parent)
    assert torch.isfinite(adv).all() and (adv[tr.parent < 0] == 0).all()
    deep = prune_transitions(tr, adv, depths=[2])
    assert (tr.node_depth[tr.transitions.sample_index[deep]] == 2).all()
    narrow = prune_transitions(tr, adv, width=1)
    kept_nodes = tr.transitions.sample_index[narrow].unique()
    for t in range(2):
        for d in range(3):
            in_group = (tr.node_tree[kept_nodes] == t) & (tr.node_depth[kept_nodes] == d)
            assert int(in_group.sum()) <= 1


def test_splits_need_sde_steps(adapter):
    windowed = SamplingConfig(num_steps=4, height=32, width=32, sde_window=(2, 4))
    with pytest.raises(ValueError, match="ODE step"):
        grow(adapter, TreeConfig(split_steps=(1,)), config=windowed)
    tr = grow(adapter, TreeConfig(split_steps=(2,), branch_factor=3), config=windowed)
    assert tr.leaf_node.numel() == 6 and set(tr.transitions.step_index.tolist()) == {2, 3}
    with pytest.raises(ValueError, match=">= 2"):
        TreeConfig(split_steps=(1,), branch_factor=1).factors()
    # steps that add no noise are refused as the flat rollout refuses them (a zero variance in the log-probs)
    with pytest.raises(ValueError, match="noise_level=0 makes every SDE step deterministic"):
        grow(adapter, config=SamplingConfig(num_steps=4, height=32, width=32, noise_level=0.0))
    with pytest.raises(ValueError, match="CPS adds no noise at sigma_next=0"):
        grow(adapter, config=SamplingConfig(num_steps=4, height=32, width=32, sde_kind="cps"))
