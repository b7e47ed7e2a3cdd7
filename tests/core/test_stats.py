import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core.allocation import sample_prompts
from mmrl.core.stats import PromptStats, spo_rho


def test_beta_update_with_forgetting_hand_values():
    s = PromptStats(rho=0.5, prior_strength=2.0, prior_mean=0.5)
    s.update(["a", "a"], torch.tensor([1.0, 0.0]), step=0)
    s.update(["a"], torch.tensor([1.0]), step=3)
    # evidence: s = .5*1 + 1 = 1.5, f = .5*1 + 0 = .5; global mean = (2 + 1) / (3 + 2) = .6
    a, b = s.alpha_beta(["a"])
    assert float(a) == pytest.approx(1.5 + 2 * 0.6)
    assert float(b) == pytest.approx(0.5 + 2 * 0.4)
    assert s.counts(["a"]).tolist() == [3]
    assert s.last_step(["a", "zz"]).tolist() == [3, -1]


def test_unseen_prompt_gets_shrinkage_prior():
    s = PromptStats(prior_strength=4.0)
    assert float(s.success_prob(["new"])) == pytest.approx(0.5)
    s.update(["x"] * 10, torch.ones(10), step=0)
    # global mean pulled from .5 towards 1: (10 + 4*.5) / 14
    assert float(s.success_prob(["new"])) == pytest.approx(12 / 14)


def test_running_mean_var_matches_numpy_without_forgetting():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, generator=g, dtype=torch.float64) * 3 + 1
    s = PromptStats(prior_strength=1e-9)
    for chunk in x.split(7):
        s.update(["p"] * chunk.numel(), chunk, step=0)
    mean, var = s.mean_var(["p"])
    assert float(mean) == pytest.approx(float(x.mean()), rel=1e-6)
    assert float(var) == pytest.approx(float(x.var(correction=0)), rel=1e-9)


def test_running_mean_var_with_forgetting_equals_weighted_stats():
    rho = 0.7
    batches = [torch.tensor(v, dtype=torch.float64) for v in ([1.0, 3.0], [2.0], [5.0, 0.0, 4.0])]
    s = PromptStats(rho=rho, prior_strength=1e-12)
    for t, b in enumerate(batches):
        s.update(["p"] * b.numel(), b, step=t)
    weights = torch.cat(
        [
            torch.full((b.numel(),), rho ** (len(batches) - 1 - t), dtype=torch.float64)
            for t, b in enumerate(batches)
        ]
    )
    values = torch.cat(batches)
    wmean = (weights * values).sum() / weights.sum()
    wvar = (weights * (values - wmean) ** 2).sum() / weights.sum()
    mean, var = s.mean_var(["p"])
    assert float(mean) == pytest.approx(float(wmean), rel=1e-9)
    assert float(var) == pytest.approx(float(wvar), rel=1e-9)


def test_per_prompt_rho_and_spo_rho():
    s = PromptStats(rho=1.0)
    s.update(["a", "b"], torch.tensor([1.0, 1.0]), step=0)
    s.update(["a", "b"], torch.tensor([0.0, 0.0]), step=1, rho=torch.tensor([0.5, 1.0]))
    a, _ = s.alpha_beta(["a", "b"])
    prior = s.prior_strength * s.global_mean()
    assert (a - prior).tolist() == pytest.approx([0.5, 1.0])
    with pytest.raises(ValueError, match="same prompt"):
        s.update(["a", "a"], torch.tensor([0.0, 1.0]), step=2, rho=torch.tensor([0.5, 0.9]))
    torch.testing.assert_close(spo_rho(torch.tensor([0.0, 0.06, 1.0])), torch.tensor([0.96, 0.875, 0.875]))
    assert float(spo_rho(torch.tensor(0.01))) == pytest.approx(2 ** (-1 / 6))


def test_state_dict_round_trip():
    s = PromptStats(rho=0.9)
    s.update(["a", "b", "a"], torch.tensor([1.0, 0.0, 0.5]), step=4)
    t = PromptStats()
    t.load_state_dict(s.state_dict())
    assert t.prompt_ids == ["a", "b"]
    for fn in ("success_prob", "counts", "last_step"):
        assert torch.equal(getattr(s, fn)(["a", "b", "c"]), getattr(t, fn)(["a", "b", "c"]))


def test_resume_keeps_the_configured_settings_not_the_checkpoints():
    s = PromptStats(rho=0.9, prior_strength=2.0, prior_mean=0.5)
    s.update(["a", "a", "b"], torch.tensor([1.0, 0.0, 1.0]), step=0)
    # a checkpoint of an older store also held its settings: they are ignored too
    for state in (s.state_dict(), {**s.state_dict(), "rho": 0.9, "prior_strength": 2.0, "prior_mean": 0.5}):
        t = PromptStats(rho=0.5, prior_strength=4.0, prior_mean=0.25)
        t.load_state_dict(state)
        assert (t.rho, t.prior_strength, t.prior_mean) == (0.5, 4.0, 0.25)
        # m = (2 + 4 * .25) / (3 + 4) = 3/7; a: s = 1, f = 1 -> (1 + 4 * 3/7, 1 + 4 * 4/7)
        a, b = t.alpha_beta(["a"])
        assert (float(a), float(b)) == pytest.approx((1 + 12 / 7, 1 + 16 / 7))
        t.update(["a"], torch.tensor([0.0]), step=1)  # forgetting at the configured rho: s = .5 * 1
        assert float(t.alpha_beta(["a"])[0]) == pytest.approx(0.5 + 4 * (2 + 1) / (4 + 4))


def test_rewards_above_one_keep_the_prior_centre_a_success_rate():
    """A verifier's 1 plus a format bonus of 0.1: the evidence and the prior centres both take min(r, 1)."""
    s = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5)
    for step in range(20):
        s.update(["a"], torch.tensor([1.1]), step=step)
    # s = 20, f = 0; m = (20 + 2 * .5) / (20 + 2) = 21/22
    assert s.global_mean() == pytest.approx(21 / 22)
    a, b = s.alpha_beta(["a", "unseen"])
    assert a.tolist() == pytest.approx([20 + 2 * 21 / 22, 2 * 21 / 22])
    assert b.tolist() == pytest.approx([2 / 22, 2 / 22])
    assert s.success_prob(["a"]).tolist() == pytest.approx([(20 + 42 / 22) / 22])
    g = torch.Generator().manual_seed(0)
    for method in ("thompson", "priority"):
        assert len(sample_prompts(s, ["a", "unseen"], 1, method, generator=g)) == 1
    # a checkpoint that summed the unclipped rewards (22 over 20) resumes with its sum bounded by the count
    legacy = {**s.state_dict(), "global_sum": 22.0}
    t = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5)
    t.load_state_dict(legacy)
    assert t.global_mean() == pytest.approx(21 / 22)


def test_merge_of_disjoint_shards_equals_one_store():
    ids = ["a", "b", "a", "c", "b", "a"]
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    whole = PromptStats()
    whole.update(ids, r, step=1)
    left, right = PromptStats(), PromptStats()
    left.update(ids[:3], r[:3], step=1)
    right.update(ids[3:], r[3:], step=1)
    left.merge(right)
    q = ["a", "b", "c", "d"]
    torch.testing.assert_close(left.alpha_beta(q), whole.alpha_beta(q))
    torch.testing.assert_close(left.mean_var(q), whole.mean_var(q))
    assert torch.equal(left.counts(q), whole.counts(q))


def test_bad_input():
    s = PromptStats()
    with pytest.raises(ValueError, match="NaN"):
        s.update(["a"], torch.tensor([float("nan")]), step=0)
    with pytest.raises(ValueError, match="prompt ids"):
        s.update(["a", "b"], torch.tensor([1.0]), step=0)
    with pytest.raises(ValueError, match="rho"):
        PromptStats(rho=0.0)


def test_grouped_prior_is_the_groups_mean_shrunk_to_the_global_mean_hand_values():
    groups = {"a1": "add", "a2": "add", "r1": "remove"}
    s = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5, prior_groups=groups)
    s.update(["a1", "a1", "r1", "x"], torch.tensor([1.0, 1.0, 0.0, 0.0]), step=0)
    # global m = (2 + 2 * .5) / (4 + 2) = .5; add: (2 + 2 * .5) / (2 + 2) = .75; remove: (0 + 1) / (1 + 2) = 1/3
    centre = s.prior_centre(["a2", "r1", "x", "unseen"])
    assert centre.tolist() == pytest.approx([0.75, 1 / 3, 0.5, 0.5])
    # an unseen prompt of a group gets the group's centre alone; a seen one adds its own evidence to it
    assert s.success_prob(["a2", "unseen"]).tolist() == pytest.approx([0.75, 0.5])
    a, b = s.alpha_beta(["r1"])
    assert (float(a), float(b)) == pytest.approx((0 + 2 / 3, 1 + 4 / 3))
    mean, _ = s.mean_var(["a1", "a2"])
    assert mean.tolist() == pytest.approx([(2 * 1.0 + 2 * 0.75) / 4, 0.75])
    # without groups the same rewards give every unseen prompt the global mean
    plain = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5)
    plain.update(["a1", "a1", "r1", "x"], torch.tensor([1.0, 1.0, 0.0, 0.0]), step=0)
    assert plain.success_prob(["a2"]).tolist() == pytest.approx([0.5])


def test_grouped_prior_survives_state_dict_and_merge():
    groups = {"a": "g1", "b": "g1", "c": "g2"}
    ids = ["a", "b", "c", "a", "c"]
    r = torch.tensor([1.5, 0.0, 3.0, 1.0, -0.5])  # outside [0, 1] too: the value's centres are not clipped
    whole = PromptStats(prior_groups=groups)
    whole.update(ids, r, step=0)
    restored = PromptStats(prior_groups=groups)
    restored.load_state_dict(whole.state_dict())
    q = ["a", "b", "c", "new"]
    torch.testing.assert_close(restored.alpha_beta(q), whole.alpha_beta(q))
    torch.testing.assert_close(restored.value(q), whole.value(q))
    left, right = PromptStats(prior_groups=groups), PromptStats(prior_groups=groups)
    left.update(ids[:2], r[:2], step=0)
    right.update(ids[2:], r[2:], step=0)
    left.merge(right)
    torch.testing.assert_close(left.prior_centre(q), whole.prior_centre(q))
    torch.testing.assert_close(left.value(q), whole.value(q))
    with pytest.raises(ValueError, match="prior_groups"):
        PromptStats().load_state_dict(whole.state_dict())


@settings(max_examples=50)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 1)), min_size=1, max_size=30))
def test_grouped_centre_lies_between_the_global_mean_and_the_groups_own_mean(rows):
    """m_g is a convex combination of the group's data mean and the global centre, and a store whose groups
    cover no prompt behaves exactly as one without groups."""
    groups = {"a": "g1", "b": "g1", "c": "g2"}
    ids = [pid for pid, _ in rows]
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float64)
    grouped, plain, empty = PromptStats(prior_groups=groups), PromptStats(), PromptStats(prior_groups={})
    for store in (grouped, plain, empty):
        store.update(ids, rewards, step=0)
    m = grouped.global_mean()
    for pid, name in groups.items():
        own = [r for p, r in rows if groups.get(p) == name]
        centre = float(grouped.prior_centre([pid]))
        low, high = min([m, *own]), max([m, *own])
        assert low - 1e-12 <= centre <= high + 1e-12
    assert float(grouped.prior_centre(["d"])) == pytest.approx(m)
    q = ["a", "b", "c", "d", "new"]
    torch.testing.assert_close(empty.alpha_beta(q), plain.alpha_beta(q))


@settings(max_examples=60)
@given(
    st.lists(
        st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.floats(0, 1)), min_size=1, max_size=8),
        min_size=1,
        max_size=6,
    ),
    st.floats(0.5, 1.0),
    st.booleans(),
)
def test_value_equals_the_beta_posterior_mean_for_rewards_in_the_unit_interval(batches, rho, grouped):
    """For rewards in [0, 1] the decayed running mean shrunk to the value's centre is the Beta posterior mean:
    ``w = s + f`` and ``w * mu = s`` under the same forgetting, and the two centres hold the same sums."""
    store = PromptStats(rho=rho, prior_groups={"a": "g", "b": "g"} if grouped else None)
    for step, rows in enumerate(batches):
        store.update(
            [pid for pid, _ in rows], torch.tensor([r for _, r in rows], dtype=torch.float64), step=step
        )
    q = ["a", "b", "c", "d", "unseen"]
    torch.testing.assert_close(store.value(q), store.success_prob(q), rtol=0, atol=1e-12)


def test_value_of_rewards_above_one_is_their_expected_reward_hand_values():
    """A verifier's 1 plus a format bonus of 0.1: the baseline is the mean of the sum, not a clipped success rate."""
    s = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5)
    s.update(["a", "a"], torch.tensor([1.1, 0.0]), step=0)
    # value centre (1.1 + 2 * .5) / (2 + 2) = .525; a: (2 * .55 + 2 * .525) / (2 + 2) = .5375
    assert s.value(["a", "unseen"]).tolist() == pytest.approx([0.5375, 0.525])
    # the Beta posterior counts the 1.1 as one success: s = 1, f = 1, centre (1 + 1) / 4 = .5
    assert s.success_prob(["a", "unseen"]).tolist() == pytest.approx([0.5, 0.5])
    # a preference model's scores (PickScore-like, around 21): the baseline follows them
    p = PromptStats(rho=1.0, prior_strength=2.0, prior_mean=0.5)
    for step in range(10):
        p.update(["x", "y"], torch.tensor([21.0, 22.0]), step=step)
    centre = (10 * 43 + 2 * 0.5) / (20 + 2)
    assert p.value(["x", "new"]).tolist() == pytest.approx([(10 * 21 + 2 * centre) / 12, centre])
    assert float(p.success_prob(["x"])) <= 1.0


def test_value_centres_of_an_old_checkpoint_start_from_its_one_sum_per_centre():
    """A checkpoint from before the value's centres holds one sum per centre: exact for rewards in [0, 1]."""
    groups = {"a": "g1", "b": "g1", "c": "g2"}
    q = ["a", "b", "c", "new"]
    unit = PromptStats(prior_groups=groups)
    unit.update(["a", "b", "c", "a", "c"], torch.tensor([1.0, 0.0, 1.0, 1.0, 0.25]), step=0)
    old = {k: v for k, v in unit.state_dict().items() if k not in ("global_raw_sum", "group_raw_sums")}
    resumed = PromptStats(prior_groups=groups)
    resumed.load_state_dict(old)
    torch.testing.assert_close(resumed.value(q), unit.value(q))
