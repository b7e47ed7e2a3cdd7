import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core import allocation as A
from mmrl.core.stats import PromptStats


def brute_force_best(p, budget, n_min, n_max):
    best = -1.0
    for combo in itertools.product(range(n_min, n_max + 1), repeat=len(p)):
        if sum(combo) != budget:
            continue
        v = float(A.knapsack_value(torch.tensor(combo), torch.tensor(p, dtype=torch.float64)).sum())
        best = max(best, v)
    return best


@settings(max_examples=80)
@given(
    st.lists(st.sampled_from([0.0, 0.05, 0.1, 0.3, 0.5, 0.7, 0.9, 0.97, 1.0]), min_size=1, max_size=4),
    st.integers(1, 3),
    st.integers(0, 6),
    st.data(),
)
def test_knapsack_equals_brute_force(p, n_min, span, data):
    n_max = n_min + span
    budget = data.draw(st.integers(len(p) * n_min, len(p) * n_max))
    counts = A.knapsack(torch.tensor(p), budget, n_min=n_min, n_max=n_max)
    assert counts.dtype == torch.int64
    assert int(counts.sum()) == budget
    assert int(counts.min()) >= n_min and int(counts.max()) <= n_max
    got = float(A.knapsack_value(counts, torch.tensor(p, dtype=torch.float64)).sum())
    assert got == pytest.approx(brute_force_best(p, budget, n_min, n_max), abs=1e-12)


def test_knapsack_value_formula():
    assert float(A.knapsack_value(torch.tensor(2), torch.tensor(0.5))) == pytest.approx(
        (1 - 0.25 - 0.25) * 0.5 * 0.25
    )
    n = torch.arange(1, 10)
    p = torch.tensor(0.3)
    gains = A.knapsack_gain(n, p)
    torch.testing.assert_close(gains, A.knapsack_value(n + 1, p) - A.knapsack_value(n, p))
    assert (gains[1:] <= gains[:-1]).all()  # concave: the greedy is exact


def test_knapsack_prefers_informative_prompts_and_spreads_ties():
    p = torch.tensor([0.0, 1.0, 0.3, 0.0, 1.0])
    counts = A.knapsack(p, 30, n_min=2, n_max=20)
    assert counts[2] == 20  # the only prompt with value takes all it may
    assert counts[[0, 1, 3, 4]].tolist() == [3, 3, 2, 2]  # 2 spare units, lowest index first
    # all-zero value: spare budget spread evenly, lowest index first
    assert A.knapsack(torch.tensor([0.0, 1.0, 0.0]), 10, n_min=1).tolist() == [4, 3, 3]


def test_knapsack_grid_grows_when_needed():
    # no n_max: a mid prompt must get far more than the initial grid width (16)
    p = torch.tensor([0.5] + [0.0] * 3)
    counts = A.knapsack(p, 200, n_min=1)
    assert counts.tolist() == [197, 1, 1, 1] or int(counts[0]) >= 60
    assert int(counts.sum()) == 200


@pytest.mark.parametrize("fn", [A.knapsack, A.sqrt_rule])
def test_infeasible_budget_raises(fn):
    with pytest.raises(ValueError, match="below n_min"):
        fn(torch.tensor([0.5, 0.5]), 3, n_min=2)
    with pytest.raises(ValueError, match="exceeds n_max"):
        fn(torch.tensor([0.5, 0.5]), 9, n_min=1, n_max=4)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        fn(torch.tensor([0.5, 1.5]), 4)


@settings(max_examples=80)
@given(
    st.lists(st.floats(0, 1), min_size=1, max_size=30),
    st.integers(1, 4),
    st.integers(0, 10),
    st.data(),
)
def test_sqrt_rule_budget_bounds_and_monotone(p, n_min, span, data):
    n_max = n_min + span
    budget = data.draw(st.integers(len(p) * n_min, len(p) * n_max))
    pt = torch.tensor(p, dtype=torch.float64)
    counts = A.sqrt_rule(pt, budget, n_min=n_min, n_max=n_max)
    assert int(counts.sum()) == budget
    assert int(counts.min()) >= n_min and int(counts.max()) <= n_max
    w = (pt * (1 - pt)).sqrt()
    order = torch.argsort(w)
    # a prompt with a larger sqrt(p(1-p)) never gets 2+ fewer rollouts than one with a smaller weight
    for a, b in zip(order[:-1].tolist(), order[1:].tolist(), strict=True):
        if w[b] > w[a]:
            assert counts[b] >= counts[a] - 1


def test_sqrt_rule_proportional_when_unconstrained():
    p = torch.tensor([0.5, 0.1, 0.9, 0.5])  # weights .5, .3, .3, .5 -> 5:3:3:5
    assert A.sqrt_rule(p, 160, n_min=0).tolist() == [50, 30, 30, 50]


def test_uniform():
    assert A.uniform(4, 10).tolist() == [3, 3, 2, 2]
    assert int(A.uniform(7, 700).sum()) == 700


def test_thompson_select_distinct_deterministic_and_prefers_uncertain_middle():
    alpha = torch.tensor([100.0, 1.0, 50.0, 1.0])
    beta = torch.tensor([1.0, 100.0, 50.0, 1.0])
    a = A.thompson_select(alpha, beta, 2, generator=torch.Generator().manual_seed(3))
    b = A.thompson_select(alpha, beta, 2, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.unique().numel() == 2
    assert a[0].item() == 2  # Beta(50, 50) draws sit at 0.5
    picks = torch.stack(
        [A.thompson_select(alpha, beta, 1, torch.Generator().manual_seed(s)) for s in range(200)]
    )
    assert (picks != 0).all() and (picks != 1).all()  # saturated prompts never closest to 0.5


def test_priority_select_distinct_and_weighted():
    p = torch.tensor([0.0, 0.5, 1.0, 0.5])
    picks = torch.stack(
        [A.priority_select(p, 2, eps=0.05, generator=torch.Generator().manual_seed(s)) for s in range(300)]
    )
    assert all(row.unique().numel() == 2 for row in picks)
    freq = torch.bincount(picks.flatten(), minlength=4).float()
    assert freq[1] > 3 * freq[0] and freq[3] > 3 * freq[2]
    with pytest.raises(ValueError, match="k must be"):
        A.priority_select(p, 5)


def test_sample_prompts_and_allocate_with_store():
    store = PromptStats()
    pool = [f"q{i}" for i in range(10)]
    store.update(pool[:5], torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]), step=0)
    chosen = A.sample_prompts(store, pool, 4, method="thompson", generator=torch.Generator().manual_seed(0))
    assert len(set(chosen)) == 4 and set(chosen) <= set(pool)
    counts = A.allocate(store, pool, 40, method="knapsack", n_min=2, n_max=8)
    assert int(counts.sum()) == 40
    with pytest.raises(ValueError, match="method"):
        A.allocate(store, pool, 40, method="greedy")


def test_uniform_allocation_names_the_bound_the_budget_breaks():
    store = PromptStats()
    assert A.allocate(store, ["a", "b", "c"], 8, n_min=2, n_max=3).tolist() == [3, 3, 2]
    # no n_max: the budget is below n_min, not an n_max of 0 below n_min
    with pytest.raises(ValueError) as below:
        A.allocate(store, ["a"], 0, n_min=1)
    assert (
        str(below.value) == "budget 0 is below n_min * prompts = 1 * 1 = 1; raise the budget or lower n_min"
    )
    with pytest.raises(ValueError) as above:
        A.allocate(store, ["a", "b"], 9, n_min=1, n_max=4)
    assert str(above.value) == "budget 9 exceeds n_max * prompts = 4 * 2 = 8; lower the budget or raise n_max"


@settings(max_examples=60)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**16))
def test_prompt_passes_draw_every_prompt_once_per_pass(pool_size, k, passes, seed):
    """Over ``passes`` full passes (``passes * pool_size`` draws) every prompt is drawn exactly ``passes`` times,
    each step's prompts are distinct, and a step that crosses a pass boundary takes the old pass's rest first."""
    k = min(k, pool_size)
    pool = list(range(pool_size))
    walk = A.PromptPasses()
    generator = torch.Generator().manual_seed(seed)
    draws: list[int] = []
    while len(draws) < passes * pool_size:
        before = set(pool) - walk.drawn
        step = A.sample_prompts(PromptStats(), pool, k, method="shuffled", generator=generator, passes=walk)
        assert len(set(step)) == k
        assert set(step[: min(k, len(before))]) == set(step) & before
        draws += step
    counts = torch.bincount(torch.tensor(draws[: passes * pool_size]), minlength=pool_size)
    assert counts.tolist() == [passes] * pool_size


def test_prompt_passes_by_hand_across_a_boundary_and_an_excluded_prompt():
    walk = A.PromptPasses()
    generator = torch.Generator().manual_seed(0)
    first = walk.select(list("abcde"), 3, generator)
    # "e" is in flight and left out of the next step's pool: the pass ends with the fresh prompts of a-d
    pool = list("abcd")
    left = set(pool) - set(first)
    assert 1 <= len(left) <= 2
    second = walk.select(pool, 3, generator)
    assert set(second[: len(left)]) == left and len(set(second)) == 3 and set(second) <= set(pool)
    assert walk.passes == 1 and walk.drawn == set(second[len(left) :])


def test_prompt_passes_resume_exactly_and_differ_from_uniform():
    pool = [f"q{i}" for i in range(20)]
    walk, generator = A.PromptPasses(), torch.Generator().manual_seed(3)
    for _ in range(3):
        walk.select(pool, 8, generator)
    saved, rng = walk.state_dict(), generator.get_state()
    expected = [walk.select(pool, 8, generator) for _ in range(4)]
    resumed, generator = A.PromptPasses(), torch.Generator()
    resumed.load_state_dict(saved)
    generator.set_state(rng)
    assert [resumed.select(pool, 8, generator) for _ in range(4)] == expected
    # with replacement, 5 steps of 8 of 20 prompts leave some unseen (e^-2 of the pool on average); a pass never
    uniform = torch.Generator().manual_seed(3)
    seen = {p for _ in range(5) for p in A.sample_prompts(PromptStats(), pool, 8, generator=uniform)}
    walked = A.PromptPasses()
    passes_seen = {p for _ in range(5) for p in walked.select(pool, 8, torch.Generator().manual_seed(3))}
    assert len(passes_seen) == 20 and len(seen) < 20
    with pytest.raises(ValueError, match="PromptPasses"):
        A.sample_prompts(PromptStats(), pool, 8, method="shuffled")
