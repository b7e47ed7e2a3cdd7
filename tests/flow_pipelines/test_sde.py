"""Invariants of the stateless SDE/ODE step (issue 5, part 1)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.flow.sde import SDE_KINDS, gaussian_log_prob, ode_step, sde_mean_std, sde_step


def _batch(seed: int = 0, shape=(3, 4, 5, 6)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_noise_level_zero_equals_diffusers_euler_step(kind):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(8)
    x, _ = _batch()
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn_like(x)
        sigma, sigma_next = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        expected = scheduler.step(v, t, x, return_dict=False)[0]
        prev, _, mean, std = sde_step(x, v, sigma, sigma_next, noise_level=0.0, kind=kind)
        torch.testing.assert_close(prev, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(mean, expected, rtol=0, atol=1e-6)
        assert torch.all(std == 0)
        torch.testing.assert_close(ode_step(x, v, sigma, sigma_next), expected, rtol=0, atol=0)
        x = expected


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_self_ratio_is_exactly_one(kind):
    x, v = _batch(1)
    prev, log_prob, _, _ = sde_step(x, v, 0.7, 0.5, 0.7, kind, generator=torch.Generator().manual_seed(3))
    _, again, _, _ = sde_step(x, v, 0.7, 0.5, 0.7, kind, prev_sample=prev)
    assert torch.equal(torch.exp(again - log_prob), torch.ones_like(log_prob))


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_log_prob_is_mean_of_normal_log_density(kind):
    x, v = _batch(2)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    sigma_next = torch.tensor([0.8, 0.4, 0.1])
    prev, log_prob, mean, std = sde_step(
        x, v, sigma, sigma_next, 0.5, kind, generator=torch.Generator().manual_seed(0)
    )
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_empirical_moments_match_mean_and_std(kind):
    x, v = _batch(4, shape=(2, 8))
    draws = 20000
    xs = x.repeat(draws, 1)  # [draws*2, 8]: draw many x' from the same two states
    vs = v.repeat(draws, 1)
    prev, _, mean, std = sde_step(xs, vs, 0.8, 0.6, 0.9, kind, generator=torch.Generator().manual_seed(5))
    prev = prev.view(draws, 2, 8)
    mean, std = mean.view(draws, 2, 8)[0], std.view(draws, 2, 1)[0]
    # standard error of the mean is std/sqrt(draws); 5 standard errors is a safe bound
    torch.testing.assert_close(prev.mean(0), mean, rtol=0, atol=5 * float(std.max()) / math.sqrt(draws))
    torch.testing.assert_close(prev.std(0), std.expand(2, 8), rtol=0.03, atol=0)


def test_formulas_written_out():
    x, v = _batch(6)
    s, s_next, a = 0.6, 0.45, 0.7
    d = s_next - s
    # Flow-GRPO
    sig = a * math.sqrt(s / (1 - s))
    mean, std = sde_mean_std(x, v, s, s_next, a, "flow_grpo")
    torch.testing.assert_close(mean, x + (v + sig**2 / (2 * s) * (x + (1 - s) * v)) * d)
    torch.testing.assert_close(std.flatten(), torch.full((3,), sig * math.sqrt(-d)))
    # DanceGRPO: constant eta
    mean, std = sde_mean_std(x, v, s, s_next, a, "dance")
    torch.testing.assert_close(mean, x + (v + a**2 / (2 * s) * (x + (1 - s) * v)) * d)
    torch.testing.assert_close(std.flatten(), torch.full((3,), a * math.sqrt(-d)))
    # CPS
    cps_std = s_next * math.sin(a * math.pi / 2)
    mean, std = sde_mean_std(x, v, s, s_next, a, "cps")
    expected = (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - cps_std**2) * (x + (1 - s) * v)
    torch.testing.assert_close(mean, expected)
    torch.testing.assert_close(std.flatten(), torch.full((3,), cps_std))


def test_flow_grpo_at_sigma_one_uses_next_sigma():
    x, v = _batch(7)
    _, std = sde_mean_std(x, v, 1.0, 0.8, 0.7, "flow_grpo")
    expected = 0.7 * math.sqrt(1.0 / (1 - 0.8)) * math.sqrt(0.2)
    torch.testing.assert_close(std.flatten(), torch.full((3,), expected))
    assert torch.isfinite(sde_step(x, v, 1.0, 0.8, 0.7)[1]).all()


def test_per_sample_sigmas_match_scalar_sigmas():
    x, v = _batch(8)
    noise = torch.randn_like(x)
    sig = torch.tensor([0.9, 0.5, 0.2])
    sig_next = torch.tensor([0.7, 0.3, 0.0])
    prev, lp, _, _ = sde_step(x, v, sig, sig_next, 0.7, noise=noise)
    for b in range(3):
        p_b, lp_b, _, _ = sde_step(
            x[b : b + 1], v[b : b + 1], float(sig[b]), float(sig_next[b]), 0.7, noise=noise[b : b + 1]
        )
        torch.testing.assert_close(prev[b : b + 1], p_b)
        torch.testing.assert_close(lp[b : b + 1], lp_b)


def test_low_precision_inputs_are_computed_in_float32():
    x, v = _batch(9)
    prev, lp, mean, std = sde_step(x.bfloat16(), v.bfloat16(), 0.5, 0.4, 0.7, generator=torch.Generator())
    assert prev.dtype == lp.dtype == mean.dtype == std.dtype == torch.float32


def test_bad_arguments_raise():
    x, v = _batch()
    with pytest.raises(ValueError, match="unknown SDE kind"):
        sde_step(x, v, 0.5, 0.4, 0.7, kind="ddim")
    with pytest.raises(ValueError, match="noise has shape"):
        sde_step(x, v, 0.5, 0.4, 0.7, noise=torch.zeros(2))
    with pytest.raises(ValueError, match="sigma must be"):
        sde_step(x, v, torch.tensor([0.5, 0.4]), 0.3, 0.7)


def test_deterministic_transition_has_zero_log_prob():
    mean = torch.zeros(2, 3)
    assert torch.equal(gaussian_log_prob(mean, mean, torch.zeros(2, 1)), torch.zeros(2))


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(SDE_KINDS),
    sigma=st.floats(0.05, 1.0),
    frac=st.floats(0.05, 0.95),
    noise_level=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_log_prob_and_reparametrisation(kind, sigma, frac, noise_level, seed):
    sigma_next = sigma * frac
    x, v = _batch(seed, shape=(2, 3, 4))
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1))
    prev, lp, mean, std = sde_step(x, v, sigma, sigma_next, noise_level, kind, noise=noise)
    assert torch.all(std > 0)
    torch.testing.assert_close(prev, mean + std * noise)
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(prev).mean(dim=(1, 2))
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)
    # the log-prob is maximal at the mean
    _, lp_mean, _, _ = sde_step(x, v, sigma, sigma_next, noise_level, kind, prev_sample=mean)
    assert torch.all(lp_mean >= lp)
