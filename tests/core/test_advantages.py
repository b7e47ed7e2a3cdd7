import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core import advantages as A
from mmrl.core.groups import groups_in_band, make_groups, varied_groups


def _batch(draw_sizes, values):
    sizes = draw_sizes
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return torch.tensor(values[: int(sum(sizes))], dtype=torch.float64), ids


@st.composite
def grouped_rewards(draw, min_size=1, odd=False, binary=False):
    n_groups = draw(st.integers(1, 6))
    size = st.integers(min_size, 7).filter(lambda s: s % 2 == 1) if odd else st.integers(min_size, 7)
    sizes = [draw(size) for _ in range(n_groups)]
    elem = st.sampled_from([0.0, 1.0]) if binary else st.floats(-10, 10, allow_nan=False)
    values = [draw(elem) for _ in range(sum(sizes))]
    ids = torch.repeat_interleave(torch.arange(n_groups) * 7 + 3, torch.tensor(sizes))  # non-contiguous ids
    perm = torch.randperm(len(values), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    return torch.tensor(values, dtype=torch.float64)[perm], ids[perm]


def test_group_normalized_hand_values():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    g = torch.tensor([5, 5, 5, 9, 9, 9])
    s0 = math.sqrt(2 / 9)  # population std of [1, 0, 1]
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3]) / (s0 + 1e-6)
    torch.testing.assert_close(A.group_normalized(r, g), expected)
    torch.testing.assert_close(
        A.group_normalized(r, g, std="none"), torch.tensor([1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3])
    )
    torch.testing.assert_close(
        A.group_normalized(r, g, std="global"),
        torch.tensor([1 / 3, -2 / 3, 1 / 3, -1 / 3, -1 / 3, 2 / 3]) / (0.5 + 1e-6),
    )


def test_group_normalized_median_center_uses_lower_median():
    r = torch.tensor([4.0, 1.0, 3.0, 2.0])
    out = A.group_normalized(r, torch.zeros(4, dtype=torch.long), std="none", center="median")
    torch.testing.assert_close(out, r - 2.0)  # torch.median([1,2,3,4]) == 2


def test_constant_group_gives_zero_not_nan():
    out = A.group_normalized(torch.ones(4), torch.zeros(4, dtype=torch.long))
    assert torch.equal(out, torch.zeros(4))


@settings(max_examples=60)
@given(grouped_rewards())
def test_group_advantages_sum_to_zero_per_group(batch):
    r, g = batch
    for std in ("group", "global", "none"):
        adv = A.group_normalized(r, g, std=std)
        for gid in g.unique():
            assert abs(float(adv[g == gid].sum())) < 1e-6 * max(1.0, float(adv.abs().max()))


@settings(max_examples=60)
@given(grouped_rewards(min_size=2))
def test_rloo_matches_loop_and_sums_to_zero(batch):
    r, g = batch
    adv = A.rloo(r, g)
    for i in range(r.numel()):
        others = r[(g == g[i]) & (torch.arange(r.numel()) != i)]
        assert abs(float(adv[i] - (r[i] - others.mean()))) < 1e-9
    for gid in g.unique():
        assert abs(float(adv[g == gid].sum())) < 1e-8


def test_rloo_rejects_singleton_group():
    with pytest.raises(ValueError, match="at least 2"):
        A.rloo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))


@settings(max_examples=60)
@given(grouped_rewards(odd=True, binary=True))
def test_median_centered_one_pivot_per_group(batch):
    r, g = batch
    adv, pivot = A.median_centered(r, g)
    for gid in g.unique():
        in_group = g == gid
        assert int(pivot[in_group].sum()) == 1
        med = r[in_group].median()
        assert float(r[pivot & in_group]) == float(med)
        std = r[in_group].std(correction=0)
        expected = (r[in_group] - med) / (std + 1e-6)
        expected[pivot[in_group]] = 0.0
        torch.testing.assert_close(adv[in_group], expected)
    assert torch.isfinite(adv).all()  # binary rewards: MAD would be 0, the std is not


def test_median_centered_rejects_even_groups():
    with pytest.raises(ValueError, match="odd group sizes"):
        A.median_centered(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]))


def test_decoupled_multi_reward_formula():
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    g = torch.tensor([0, 0, 1, 1])
    w = torch.tensor([2.0, 1.0], dtype=torch.float64)
    # per-reward group normalisation: each group has one 1 and one 0 per column except where equal
    a0 = torch.tensor([1.0, -1.0, 1.0, -1.0]) / (0.5 + 1e-6) * 0.5
    a1 = torch.tensor([-1.0, 1.0, 1.0, -1.0]) / (0.5 + 1e-6) * 0.5
    s = 2 * a0 + a1
    expected = (s - s.mean()) / (s.std(correction=0) + 1e-6)
    torch.testing.assert_close(A.decoupled_multi_reward(r, g, w), expected.to(torch.float64))


def test_decoupled_keeps_combinations_grpo_collapses():
    # GRPO on the summed reward gives (1,0) and (0,1) the same advantage; GDPO separates them by weight.
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    g = torch.zeros(3, dtype=torch.long)
    grpo = A.group_normalized(r.sum(1), g)
    assert grpo[0] == grpo[1]
    gdpo = A.decoupled_multi_reward(r, g, torch.tensor([2.0, 1.0]))
    assert gdpo[0] > gdpo[1] > gdpo[2]


def test_tree_depthwise_hand_example():
    # root 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5, 6}; leaf rewards 1, 0, 1, 1
    nan = float("nan")
    leaf = torch.tensor([nan, nan, nan, 1.0, 0.0, 1.0, 1.0])
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    adv, node = A.tree_depthwise(leaf, parent)
    torch.testing.assert_close(node, torch.tensor([0.75, 0.5, 1.0, 1.0, 0.0, 1.0, 1.0]))
    # unbiased std (BranchGRPO's torch .std()) + 1e-8. depth 1: rewards 0.5, 1.0 -> mean .75, std 0.25 sqrt(2);
    # depth 2: 1, 0, 1, 1 -> mean .75, std sqrt((3 * 0.25^2 + 0.75^2) / 3) = 0.5
    s1, s2 = 0.25 * math.sqrt(2), 0.5
    expected = torch.tensor(
        [
            0.0,
            -0.25 / (s1 + 1e-8),
            0.25 / (s1 + 1e-8),
            0.25 / (s2 + 1e-8),
            -0.75 / (s2 + 1e-8),
            0.25 / (s2 + 1e-8),
            0.25 / (s2 + 1e-8),
        ]
    )
    torch.testing.assert_close(adv, expected)


def test_tree_depthwise_is_branchgrpos_unbiased_std_advantage():
    """BranchGRPO's ``compute_hierarchical_advantages_by_depth``: ``(R - mean) / (R.std() + 1e-8)`` with torch's
    unbiased std, 0 for a level whose std is below 1e-6."""
    nan = float("nan")
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2])
    adv, node = A.tree_depthwise(torch.tensor([nan, nan, nan, 1.0, 0.0, 0.0, 0.0]), parent)
    torch.testing.assert_close(node, torch.tensor([0.25, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0]))
    # depth 1: 0.5, 0 -> +-1/sqrt(2) (the population std gave +-1); depth 2: 1, 0, 0, 0 -> mean 1/4, unbiased
    # std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 1/2 (the population std, sqrt(3)/4, gave 1.732, -0.577)
    expected = torch.tensor([0.0, 0.7071068, -0.7071068, 1.5, -0.5, -0.5, -0.5])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # a level whose nodes differ by less than BranchGRPO's threshold gets 0 (with the std in the denominator,
    # rewards 1 and 1 + 1.2e-7 would get +-0.7: their difference blown up to the size of a real one)
    close = torch.tensor([nan, 1.0, 1.0 + 1.2e-7])
    adv_close, _ = A.tree_depthwise(close, torch.tensor([-1, 0, 0]))
    assert torch.equal(adv_close, torch.zeros(3))


def test_tree_depthwise_path_prob_of_a_root_stays_out_of_its_childrens_softmax():
    """A root's edge log-prob (here 0) far above its children's (-800, -801) used to join their softmax, which
    underflowed their weights to 0 and made the root's reward 0 / 0 = NaN; the children's softmax alone weighs
    the leaves 1 : e^-1."""
    nan = float("nan")
    parent = torch.tensor([-1, -1, 0, 0, 1, 1])
    leaf = torch.tensor([nan, nan, 1.0, 0.0, 1.0, 1.0])
    lp = torch.tensor([0.0, 0.0, -800.0, -801.0, -1.0, -1.0])
    adv, node = A.tree_depthwise(leaf, parent, fusion="path_prob", edge_logprob=lp)
    sigmoid_1 = 1 / (1 + math.exp(-1))  # leaf weights e^-800 : e^-801 = 1 : e^-1
    torch.testing.assert_close(node, torch.tensor([sigmoid_1, 1.0, 1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(
        adv, torch.tensor([0.0, 0.0, 0.7071068, -0.7071068, 0.0, 0.0]), atol=1e-6, rtol=0
    )


def test_tree_depthwise_two_trees_normalised_separately_and_path_prob():
    nan = float("nan")
    leaf = torch.tensor([nan, 1.0, 0.0, nan, 5.0, 3.0])
    parent = torch.tensor([-1, 0, 0, -1, 3, 3])
    adv, node = A.tree_depthwise(leaf, parent)
    torch.testing.assert_close(node[[0, 3]], torch.tensor([0.5, 4.0]))
    # two nodes a level: +-(d / 2) / (d / sqrt(2)) = +-1/sqrt(2) with the unbiased std, whatever their spread d
    half = 1 / math.sqrt(2)
    torch.testing.assert_close(adv[[1, 2, 4, 5]], torch.tensor([half, -half, half, -half]), atol=1e-6, rtol=0)
    lp = torch.tensor([0.0, math.log(3.0), 0.0, 0.0, 0.0, 0.0])
    _, node_p = A.tree_depthwise(leaf, parent, fusion="path_prob", edge_logprob=lp)
    torch.testing.assert_close(node_p[0], torch.tensor(0.75))  # weights 3:1 on leaves 1:0


def test_tree_rejects_children_before_parents():
    with pytest.raises(ValueError, match="parent"):
        A.tree_depthwise(torch.tensor([1.0, 0.0]), torch.tensor([1, -1]))


_INT_REWARDS = torch.tensor([1, 0, 0, 1, 1, 0])
_INT_GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


@pytest.mark.parametrize(
    "advantages",
    [
        lambda r: A.group_normalized(r, _INT_GROUPS),
        lambda r: A.group_normalized(r, _INT_GROUPS, std="global"),
        lambda r: A.group_normalized(r, _INT_GROUPS, std="none"),
        lambda r: A.rloo(r, _INT_GROUPS),
        lambda r: A.median_centered(r, _INT_GROUPS)[0],
        lambda r: A.decoupled_multi_reward(torch.stack([r, r.logical_not().to(r.dtype)], dim=1), _INT_GROUPS),
        lambda r: A.single_rollout(r, torch.full((6,), 0.3)),
    ],
    ids=["grpo", "global_std", "dr_grpo", "rloo", "median_centered", "gdpo", "single"],
)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_rewards_give_the_float32_advantages_of_their_values(advantages, dtype):
    """0/1 verifier scores as int64 or bool: the advantages are those of the same rewards as floats, in float32;
    cast back to int64 they were truncated ([1, 0, 0] -> 1, 0, 0 instead of 1.41, -0.71, -0.71)."""
    adv = advantages(_INT_REWARDS.to(dtype))
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, advantages(_INT_REWARDS.float()))


def test_integer_rewards_hand_values():
    # group [1, 0, 0]: mean 1/3, population std sqrt(2)/3 -> 2/3 / (sqrt(2)/3) = sqrt(2), -1/3 / (sqrt(2)/3)
    s = math.sqrt(2) / 3 + 1e-6
    expected = torch.tensor([2 / 3 / s, -1 / 3 / s, -1 / 3 / s, 1 / 3 / s, 1 / 3 / s, -2 / 3 / s])
    torch.testing.assert_close(A.group_normalized(_INT_REWARDS, _INT_GROUPS), expected)
    # leave-one-out: 1 - 0 = 1, 0 - 1/2 = -0.5
    torch.testing.assert_close(
        A.rloo(_INT_REWARDS, _INT_GROUPS), torch.tensor([1.0, -0.5, -0.5, 0.5, 0.5, -1.0])
    )


def test_single_rollout_formula_and_no_centering_by_default():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    b = torch.tensor([0.2, 0.9, 0.5, 0.95])
    d = r - b
    torch.testing.assert_close(A.single_rollout(r, b), d / (d.std(correction=0) + 1e-6))
    assert (A.single_rollout(r, b)[r == 1] > 0).all()  # correct answers stay positive
    centred = A.single_rollout(r, b, center=True)
    assert centred[3] < 0  # what centring would do to a correct answer; hence off by default
    torch.testing.assert_close(A.single_rollout(r, b, scale="none"), d)
    # equal advantages (all rewards 0, one shared prior): no division by a zero std
    zeros, prior = torch.zeros(3), torch.full((3,), 0.1)
    torch.testing.assert_close(A.single_rollout(zeros, prior), zeros - prior)


@settings(max_examples=100)
@given(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=20),
    st.floats(0.0, 3.0),
    st.floats(1.0001, 10.0),
)
def test_entropy_shaping_never_flips_sign(advs, alpha, kappa):
    adv = torch.tensor(advs, dtype=torch.float64)
    ent = torch.rand(len(advs), 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 10
    shaped = A.entropy_shaped(adv, ent, alpha=alpha, kappa=kappa)
    base = adv.unsqueeze(1).expand_as(ent)
    assert torch.equal(torch.sign(shaped), torch.sign(base))
    assert (shaped >= base).all()


def test_entropy_shaping_keeps_a_subnormal_negative_advantage_negative():
    # |A| / kappa rounds up to |A| at the smallest subnormal; the shaped value must still be below zero
    adv = torch.tensor([-5e-324, 5e-324, 0.0], dtype=torch.float64)
    shaped = A.entropy_shaped(adv, torch.full((3, 2), 10.0, dtype=torch.float64), alpha=1.0, kappa=1.5)
    assert (shaped[0] < 0).all() and (shaped[1] > 0).all() and (shaped[2] == 0).all()


def test_entropy_shaping_hand_value_and_detached():
    adv = torch.tensor([[1.0, -1.0, 0.2]])
    ent = torch.tensor([[0.5, 5.0, 5.0]], requires_grad=True)
    out = A.entropy_shaped(adv, ent)
    torch.testing.assert_close(out, torch.tensor([[1.2, -0.5, 0.3]]))
    assert not out.requires_grad


@pytest.mark.parametrize(
    "call",
    [
        lambda: A.group_normalized(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0])),
        lambda: A.group_normalized(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 1])),
        lambda: A.group_normalized(torch.tensor([]), torch.tensor([], dtype=torch.long)),
        lambda: A.group_normalized(torch.tensor([1.0]), torch.tensor([0.5])),
        lambda: A.group_normalized(torch.tensor([1.0]), torch.tensor([0]), std="batch"),
    ],
)
def test_bad_input_raises_clear_error(call):
    with pytest.raises(ValueError):
        call()


def test_sparse_and_negative_group_ids_match_dense_ids():
    r = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0])
    dense = A.group_normalized(r, torch.tensor([0, 0, 1, 1, 2]))
    for ids in ([-5, -5, 10**12, 10**12, 7], [2, 2, 9, 9, 40]):
        torch.testing.assert_close(A.group_normalized(r, torch.tensor(ids)), dense)


def test_process_supervised_hand_values():
    # two completions, two steps each; rewards 1, 0 | 1, 1: mean 0.75, std sqrt(3)/4
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rows, first, last = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 3, 1, 4]), torch.tensor([2, 5, 3, 4])
    one_group = torch.zeros(4, dtype=torch.long)
    up, down = 1 / math.sqrt(3), -math.sqrt(3)  # (1 - 0.75) / (sqrt(3)/4), (0 - 0.75) / (sqrt(3)/4)
    returns = A.process_supervised(rewards, rows, first, last, one_group, 2, 7)
    expected = torch.tensor(
        [
            [up + down] * 3 + [down] * 3 + [0.0],
            [2 * up] * 4 + [up] + [0.0] * 2,
        ]
    )
    torch.testing.assert_close(returns, expected, atol=1e-5, rtol=0)
    own = A.process_supervised(rewards, rows, first, last, one_group, 2, 7, credit="step")
    expected = torch.tensor([[up] * 3 + [down] * 3 + [0.0], [0.0] + [up] * 4 + [0.0] * 2])
    torch.testing.assert_close(own, expected, atol=1e-5, rtol=0)
    # in two groups each completion's steps are normalised among themselves
    per_row = A.process_supervised(rewards, rows, first, last, rows, 2, 7, credit="step")
    torch.testing.assert_close(per_row[0, :6], torch.tensor([1.0] * 3 + [-1.0] * 3), atol=1e-5, rtol=0)
    assert per_row[1].abs().max() == 0  # equal step rewards: nothing to learn from


@settings(max_examples=60)
@given(st.data())
def test_process_supervised_properties(data):
    num_rows, num_tokens = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 9))
    num_steps = data.draw(st.integers(0, 10))
    rows = torch.tensor(
        data.draw(st.lists(st.integers(0, num_rows - 1), min_size=num_steps, max_size=num_steps))
    )
    spans = [
        sorted(data.draw(st.lists(st.integers(0, num_tokens - 1), min_size=2, max_size=2))) for _ in rows
    ]
    first = torch.tensor([a for a, _ in spans], dtype=torch.long)
    last = torch.tensor([b for _, b in spans], dtype=torch.long)
    rewards = torch.tensor(
        data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=num_steps, max_size=num_steps)),
        dtype=torch.float64,
    )
    groups = torch.zeros(num_steps, dtype=torch.long)
    returns = A.process_supervised(rewards, rows.long(), first, last, groups, num_rows, num_tokens)
    own = A.process_supervised(rewards, rows.long(), first, last, groups, num_rows, num_tokens, credit="step")
    assert returns.shape == own.shape == (num_rows, num_tokens)
    if num_steps == 0:
        assert returns.abs().max() == 0
        return
    normalised = A.group_normalized(rewards, groups)
    # token 0 of a row is credited with every step of the row; the whole batch's steps sum to 0
    for row in range(num_rows):
        torch.testing.assert_close(returns[row, 0], normalised[rows == row].sum())
    torch.testing.assert_close(own.sum(), (normalised * (last - first + 1)).sum())
    # a return never changes after a row's last step ends: tokens past every step get 0
    for row in range(num_rows):
        ends = last[rows == row]
        after = int(ends.max()) + 1 if ends.numel() else 0
        assert bool((returns[row, after:] == 0).all())


def test_process_supervised_refuses_bad_spans():
    one = torch.ones(1)
    zero = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="first <= last"):
        A.process_supervised(one, zero, torch.tensor([3]), torch.tensor([2]), zero, 1, 5)
    with pytest.raises(ValueError, match="first <= last"):
        A.process_supervised(one, zero, zero, torch.tensor([5]), zero, 1, 5)
    with pytest.raises(ValueError, match=r"step_rows must lie in \[0, 1\)"):
        A.process_supervised(one, torch.tensor([1]), zero, zero, zero, 1, 5)
    with pytest.raises(ValueError, match="credit must be"):
        A.process_supervised(one, zero, zero, zero, zero, 1, 5, credit="future")
    with pytest.raises(ValueError, match="step_rewards contains NaN"):
        A.process_supervised(torch.tensor([float("nan")]), zero, zero, zero, zero, 1, 5)


# Float32 sums such as 1 + 0.1 are not representable: the mean of ten of them is not the value itself (by
# ~1e-8), and the old code divided that noise by a std of the same size plus eps, giving the whole group
# +-0.1.
_ONE_ONE = float(torch.tensor(1.0) + torch.tensor(0.1))  # math_verify 1 + format weight 0.1, in float32


@pytest.mark.parametrize("center", ["mean", "median"])
@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_equal_rounded_rewards_give_exactly_zero_group_normalized(std, center):
    r = torch.tensor([_ONE_ONE] * 10 + [0.1] * 10 + [1.0, 0.0])  # float32, two constant groups
    g = torch.tensor([0] * 10 + [1] * 10 + [2, 2])
    adv = A.group_normalized(r, g, std=std, center=center)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:20], torch.zeros(20))
    scale = {"group": 0.5, "global": float(r.double().std(correction=0)), "none": 1.0}[std]
    centre = 0.5 if center == "mean" else 0.0  # lower median of [1, 0] is 0
    expected = (torch.tensor([1.0, 0.0], dtype=torch.float64) - centre) / (
        scale + (0 if std == "none" else 1e-6)
    )
    torch.testing.assert_close(adv[20:], expected.float())


def test_equal_rounded_rewards_give_exactly_zero_rloo_and_median_centered():
    r = torch.tensor([_ONE_ONE] * 10 + [0.1] * 10 + [1.0, 0.0, 0.0])
    g = torch.tensor([0] * 10 + [1] * 10 + [2] * 3)
    adv = A.rloo(r, g)
    assert torch.equal(adv[:20], torch.zeros(20))
    torch.testing.assert_close(adv[20:], torch.tensor([1.0, -0.5, -0.5]))
    r_odd = torch.tensor([_ONE_ONE] * 9 + [0.1] * 9 + [1.0, 0.0, 0.0])  # MC-GRPO needs odd group sizes
    g_odd = torch.tensor([0] * 9 + [1] * 9 + [2] * 3)
    mc, pivot = A.median_centered(r_odd, g_odd)  # (its median is a sample: 0 before the fix too)
    assert torch.equal(mc[:18], torch.zeros(18)) and int(pivot.sum()) == 3
    torch.testing.assert_close(mc[18:], torch.tensor([1.0, 0.0, 0.0]) / (math.sqrt(2) / 3 + 1e-6))


def test_equal_rounded_leaf_rewards_give_exactly_zero_tree_depthwise():
    # root 0 -> {1, 2}, each with five leaves of 1.1: every node's reward is 1.1, so every advantage is 0
    nan = float("nan")
    parent = torch.tensor([-1, 0, 0] + [1] * 5 + [2] * 5)
    leaf = torch.tensor([nan] * 3 + [_ONE_ONE] * 10)
    adv, node = A.tree_depthwise(leaf, parent)
    assert torch.equal(adv, torch.zeros(13))
    torch.testing.assert_close(node, torch.full((13,), _ONE_ONE))


def test_decoupled_constant_reward_column_adds_nothing():
    # column 1 is constant in each group (1.1 in group 0, 0 in group 1): only column 0 may move advantages.
    # The old code gave group 0 a shift of w_1 * (rounding / (rounding + eps)) ~ -0.05 that whitening kept.
    col0 = torch.tensor([1.0] * 5 + [0.0] * 5)
    raw = torch.cat(
        [torch.stack([col0, torch.full((10,), _ONE_ONE)], 1), torch.stack([col0, torch.zeros(10)], 1)]
    )
    raw = torch.cat([raw, torch.tensor([[0.0, 0.1]] * 3)])  # group 2: no reward varies
    g = torch.tensor([0] * 10 + [1] * 10 + [2] * 3)
    adv = A.decoupled_multi_reward(raw, g, torch.tensor([1.0, 0.5]))
    a0 = (col0.double() - 0.5) / (0.5 + 1e-6)  # column 0 normalised in its group: +-1 / (1 + 2e-6)
    s = torch.cat([a0, a0, torch.zeros(3, dtype=torch.float64)])  # weight 1 on column 0; group 2: 0
    expected = (s - s.mean()) / (s.std(correction=0) + 1e-6)
    torch.testing.assert_close(adv, expected.float())
    assert torch.equal(adv[20:], torch.zeros(3))


def test_groups_varies_per_sample_and_per_column():
    groups = make_groups(torch.tensor([4, 4, 9, 9, 9]))
    x = torch.tensor([[1.0, 2.0], [1.0, 3.0], [0.0, 5.0], [1.0, 5.0], [0.0, 5.0]])
    expected = torch.tensor([[False, True], [False, True], [True, False], [True, False], [True, False]])
    assert torch.equal(groups.varies(x), expected)
    assert torch.equal(groups.varies(x[:, 0]), expected[:, 0])
    assert torch.equal(varied_groups(x[:, 1], torch.tensor([4, 4, 9, 9, 9])), expected[:, 1])
    # several rewards (GDPO): a group counts as varying when any one of them varies
    assert varied_groups(x, torch.tensor([4, 4, 9, 9, 9])).tolist() == [True] * 5
    assert varied_groups(x[:2, :1], torch.tensor([4, 4])).tolist() == [False, False]
    with pytest.raises(ValueError, match=r"rewards \(5, 2\) and group_ids \(4,\) hold different numbers"):
        varied_groups(x, torch.tensor([4, 4, 9, 9]))
    torch.testing.assert_close(groups.mean(x), torch.tensor([[1.0, 2.5], [1 / 3, 5.0]]))


def test_groups_in_band_keeps_the_groups_whose_mean_lies_strictly_inside():
    scores = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.1, 0.1, 0.0, 0.5, 0.25, 0.75])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])  # means 1, .95, .1, 0, .5
    assert groups_in_band(scores, ids, 0.01, 0.99).tolist() == [False] * 2 + [True] * 4 + [False] + [True] * 3
    # strict on both sides: a mean equal to a bound is outside
    assert groups_in_band(scores, ids, 0.1, 0.5).tolist() == [False] * 10
    with pytest.raises(ValueError, match=r"the band's low \(0.5\) must be below its high \(0.5\)"):
        groups_in_band(scores, ids, 0.5, 0.5)
    with pytest.raises(ValueError, match="group_ids"):
        groups_in_band(scores, ids[:4], 0.01, 0.99)


@given(
    sizes=st.lists(st.integers(1, 99), min_size=1, max_size=6),
    data=st.data(),
)
def test_band_of_one_percent_keeps_the_varied_groups_of_binary_scores(sizes, data):
    """EasyR1's (0.01, 0.99) on 0/1 scores and groups of fewer than 100 samples is DAPO's rule."""
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    bits = data.draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
    scores = torch.tensor(bits, dtype=torch.float32)
    assert torch.equal(groups_in_band(scores, ids, 0.01, 0.99), varied_groups(scores, ids))
