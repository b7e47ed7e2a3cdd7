"""Advantage Weighted Matching's per-point log-likelihood surrogate and its clipped-ratio loss: hand-computed values
and properties of the policy gradient."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core.losses import awm_log_likelihood, clipped_surrogate

WEIGHTINGS = ["uniform", "sigma", "sigma_squared", "huber", "ghuber"]


def test_hand_computed_values_for_every_weighting():
    # point 0: errors (1, -1, 1, -1) -> l = 1; point 1: errors (2, 0, 0, 0) -> l = 1; point 2: exact -> l = 0
    v = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    target = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    sigma = torch.tensor([0.5, 0.25, 0.8])
    d = 1e-10
    expected = {
        "uniform": [-1.0, -1.0, 0.0],
        "sigma": [-0.5, -0.25, 0.0],
        "sigma_squared": [-0.25, -0.0625, 0.0],
        "huber": [-0.5 * (math.sqrt(1 + d) - math.sqrt(d)), -0.25 * (math.sqrt(1 + d) - math.sqrt(d)), 0.0],
        # s ((1 + d)^0.25 - d^0.25) / 0.25
        "ghuber": [-0.5 * ((1 + d) ** 0.25 - d**0.25) * 4, -0.25 * ((1 + d) ** 0.25 - d**0.25) * 4, 0.0],
    }
    for weighting, values in expected.items():
        out = awm_log_likelihood(v, target, sigma, weighting, power=0.25)
        torch.testing.assert_close(out, torch.tensor(values), rtol=1e-6, atol=1e-7, msg=weighting)
    # a non-default power: s ((l + d)^p - d^p) / p with l = 4 (all errors 2), p = 0.5
    out = awm_log_likelihood(
        torch.full((1, 3, 2, 2), 2.0), torch.zeros(1, 3, 2, 2), torch.tensor([0.6]), power=0.5
    )
    torch.testing.assert_close(out, torch.tensor([-0.6 * ((4 + d) ** 0.5 - d**0.5) / 0.5]))


def test_loss_of_a_point_off_policy_hand_computed():
    # l = 0.25 at s = 0.5, uniform: log p = -0.25; the old policy had l_old = 0.5: log p_old = -0.5
    v = torch.tensor([[0.5, 0.5, 0.5, 0.5]], requires_grad=True)
    target = torch.zeros(1, 4)
    logp = awm_log_likelihood(v, target, torch.tensor([0.5]), "uniform")
    old = torch.tensor([-0.5])
    ratio = math.exp(0.25)  # 1.284: outside [1 - 0.2, 1 + 0.2] for A > 0 -> clipped, constant loss
    loss = clipped_surrogate(logp, old, torch.tensor([2.0]), 0.2)
    torch.testing.assert_close(loss, torch.tensor([-2.0 * 1.2]))
    assert ratio > 1.2
    loss.sum().backward()
    assert torch.count_nonzero(v.grad) == 0  # outside the trust region the gradient is exactly zero
    # inside it (clip 1, the paper's): L = -A rho, dL/dv_j = -A rho * d(log p)/dv_j = A rho * 2 v_j / 4
    v.grad = None
    logp = awm_log_likelihood(v, target, torch.tensor([0.5]), "uniform")
    loss = clipped_surrogate(logp, old, torch.tensor([2.0]), 1.0)
    torch.testing.assert_close(loss, torch.tensor([-2.0 * ratio]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.full((1, 4), 2.0 * ratio * 2 * 0.5 / 4))


def test_bad_input_names_the_argument():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="sigma must have shape"):
        awm_log_likelihood(v, v, torch.zeros(3))
    with pytest.raises(ValueError, match="power must be > 0"):
        awm_log_likelihood(v, v, torch.zeros(2), power=0.0)
    with pytest.raises(ValueError, match="weighting must be one of"):
        awm_log_likelihood(v, v, torch.zeros(2), "t")


def test_bfloat16_predictions_are_scored_in_float32():
    v = torch.full((1, 4), 1.001, dtype=torch.bfloat16)
    out = awm_log_likelihood(v, torch.ones(1, 4), torch.tensor([1.0]), "uniform")
    assert out.dtype == torch.float32


points = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(0, 10_000))


@settings(max_examples=40)
@given(points, st.sampled_from(WEIGHTINGS), st.floats(0.05, 1.0))
def test_zero_advantages_give_zero_policy_gradient(shape, weighting, clip):
    n, d, seed = shape
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g, requires_grad=True)
    target, sigma = torch.randn(n, d, generator=g), torch.rand(n, generator=g) * 0.9 + 0.05
    old = awm_log_likelihood(v.detach() + 0.1 * torch.randn(n, d, generator=g), target, sigma, weighting)
    logp = awm_log_likelihood(v, target, sigma, weighting)
    clipped_surrogate(logp, old, torch.zeros(n), clip).sum().backward()
    assert torch.count_nonzero(v.grad) == 0


@settings(max_examples=60)
@given(points, st.sampled_from(WEIGHTINGS), st.floats(0.1, 3.0), st.booleans())
def test_one_step_fits_a_positive_sample_closer_and_pushes_a_negative_one_away(
    shape, weighting, size, positive
):
    n, d, seed = shape
    g = torch.Generator().manual_seed(seed)
    # float64, so that a small step's change of the error is resolved
    v = torch.randn(n, d, generator=g, dtype=torch.float64) * 0.5 + 0.3
    target = torch.randn(n, d, generator=g, dtype=torch.float64)
    sigma = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    v.requires_grad_(True)
    adv = torch.full((n,), size if positive else -size)
    logp = awm_log_likelihood(v, target, sigma, weighting)
    clipped_surrogate(logp, logp.detach(), adv, 1.0).sum().backward()  # on policy: rho = 1
    before = ((v.detach() - target) ** 2).mean(1)
    stepped = v.detach() - 1e-6 * v.grad  # a small gradient step
    after = ((stepped - target) ** 2).mean(1)
    if positive:
        assert bool((after < before).all())
    else:
        assert bool((after > before).all())
