"""The shared learning-rate schedule (hand-computed values, invariants) and the EMA's warm-up."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mmrl.ema import EMA
from mmrl.schedule import learning_rate


def test_hand_computed_values():
    # warm-up over 4 steps: 1/4, 2/4, 3/4 of the peak, then the cosine from the peak
    assert [learning_rate(s, 0.2, 10, 4, "cosine") for s in range(4)] == [0.05, 0.1, 0.15000000000000002, 0.2]
    assert learning_rate(5, 0.2, 10, 4, "cosine") == pytest.approx(0.1)  # half way: cos(pi/2) = 0
    assert learning_rate(10, 0.2, 10, 4, "cosine", final_fraction=0.1) == pytest.approx(0.02)
    assert learning_rate(20, 0.2, 10, 0, "cosine") == pytest.approx(0.0)  # past the end: held at the floor
    assert learning_rate(7, 0.2, 10, 4, "constant") == 0.2
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        learning_rate(5, 0.2, 10, 0, "linear")  # type: ignore[arg-type]


def test_cosine_is_the_flow_rl_formula_to_the_bit_and_the_pretraining_scripts_to_an_ulp():
    # the flow RL trainer computed lr * 0.5 * (1 + cos(pi * step / steps)) before it used this function: the same
    # bits keep its committed figures repeatable; the pretraining scripts computed pi * (step / total), which
    # rounds differently in the last bit on some steps (their committed weights came from wall-clock budgets)
    for total in (60, 120, 300):
        for step in range(total + 1):
            assert learning_rate(step, 3e-4, total, schedule="cosine") == 3e-4 * 0.5 * (
                1.0 + math.cos(math.pi * step / total)
            )
    for step in range(300):
        progress = step / 300
        assert learning_rate(step, 3e-3, 300, schedule="cosine") == pytest.approx(
            3e-3 * (0.5 * (1.0 + math.cos(math.pi * progress))), rel=1e-14, abs=1e-18
        )
        assert learning_rate(step, 1e-3, 300, schedule="cosine", final_fraction=0.1) == pytest.approx(
            1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * progress))), rel=1e-14, abs=1e-18
        )


@given(
    peak=st.floats(1e-6, 1.0),
    total=st.integers(1, 500),
    warmup=st.integers(0, 50),
    floor=st.floats(0.0, 1.0),
)
def test_cosine_rises_then_falls_between_peak_and_floor(peak, total, warmup, floor):
    rates = [learning_rate(s, peak, total, warmup, "cosine", floor) for s in range(total + warmup + 2)]
    assert all(0 < r <= peak * (1 + 1e-12) for r in rates[:warmup])
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(rates[:warmup]))
    after = rates[warmup:]
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(after))
    assert all(floor * peak * (1 - 1e-9) <= r <= peak * (1 + 1e-12) for r in after)


def test_ema_warm_up_decay_follows_the_update_count():
    module = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        module.weight.fill_(0.0)
    ema = EMA(module, decay=0.9)
    with torch.no_grad():
        module.weight.fill_(1.0)
    ema.update(num_updates=0)  # decay min(0.9, 1/10) = 0.1: the average moves 90% of the way
    assert ema.shadow["weight"].item() == pytest.approx(0.9)
    ema.update(num_updates=1000)  # decay 0.9: 10% of the remaining 0.1
    assert ema.shadow["weight"].item() == pytest.approx(0.91)
    ema.update()  # no count: the plain decay
    assert ema.shadow["weight"].item() == pytest.approx(0.919)


def test_the_average_of_bfloat16_weights_follows_them_in_float32():
    """Weights converging slowly (as KahanAdamW's bfloat16 weights do, one ulp at a time): an average kept in
    bfloat16 would stay near where it started (each step's 1% of a few ulps rounds away: 0.0055 off the converged
    weights after 3,000 steps, from 0.008 at the start); the float32 one follows them (5e-5 off)."""
    torch.manual_seed(0)
    truth = torch.randn(4096) * 0.05
    target = truth + torch.randn(4096) * 0.01
    module = torch.nn.Linear(4096, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(truth)
    ema = EMA(module, 0.99)
    assert ema.shadow["weight"].dtype == torch.float32
    for _ in range(3000):
        truth += (target - truth) * 0.002
        with torch.no_grad():
            module.weight.copy_(truth)
        ema.update()
    assert (ema.shadow["weight"][0] - truth).abs().mean() < 2e-4
    with ema.swapped():
        assert module.weight.dtype == torch.bfloat16
        assert torch.equal(module.weight[0], ema.shadow["weight"][0].bfloat16())
