"""Invariants of the stateless SDE/ODE step (issue 5, part 1)."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core.losses import gaussian_mean_kl
from pipelines.flow.rollout import SamplingConfig
from pipelines.flow.sde import (
    PEER_LOG_PROB_FORM,
    SDE_KINDS,
    gaussian_log_prob,
    ode_step,
    sde_mean_std,
    sde_noise_scale,
    sde_step,
)


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
        x,
        v,
        sigma,
        sigma_next,
        0.5,
        kind,
        generator=torch.Generator().manual_seed(0),
        log_prob_form="gaussian",
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


@settings(max_examples=40)
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
    prev, lp, mean, std = sde_step(
        x, v, sigma, sigma_next, noise_level, kind, noise=noise, log_prob_form="gaussian"
    )
    assert torch.all(std > 0)
    torch.testing.assert_close(prev, mean + std * noise)
    expected = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(prev).mean(dim=(1, 2))
    torch.testing.assert_close(lp, expected, rtol=1e-5, atol=1e-5)
    # the log-prob is maximal at the mean
    _, lp_mean, _, _ = sde_step(x, v, sigma, sigma_next, noise_level, kind, prev_sample=mean)
    _, lp_peer, _, _ = sde_step(x, v, sigma, sigma_next, noise_level, kind, prev_sample=prev)
    assert torch.all(lp_mean >= lp_peer)


# --- the conventions of the peers' code (Flow-GRPO's sd3_sde_with_logprob and its KL; DanceGRPO's flux_step) ---


def _flow_grpo_noise_scale(sigma: float, sigma_next: float, a: float, first_next: float) -> float:
    """Flow-GRPO's std_dev_t: a * sqrt(s / (1 - s)), with the schedule's second sigma in place of s = 1."""
    return a * math.sqrt(sigma / (1 - (first_next if sigma == 1 else sigma)))


@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.96), (0.9, 0.8), (0.5, 0.3), (0.1, 0.0)])
def test_noise_scale_is_each_papers_sigma_t(sigma, sigma_next):
    s, s_next = torch.tensor([sigma]), torch.tensor([sigma_next])
    expected = _flow_grpo_noise_scale(sigma, sigma_next, 0.7, sigma_next)
    torch.testing.assert_close(sde_noise_scale(s, s_next, 0.7, "flow_grpo"), torch.tensor([expected]))
    torch.testing.assert_close(sde_noise_scale(s, s_next, 0.3, "dance"), torch.tensor([0.3]))
    torch.testing.assert_close(
        sde_noise_scale(s, s_next, 0.7, "cps"), torch.tensor([sigma_next * math.sin(0.7 * math.pi / 2)])
    )
    # the transition std is sigma_t sqrt|dt| for flow_grpo and dance, sigma_t itself for cps
    x, v = _batch(5, shape=(1, 4))
    for kind, a in (("flow_grpo", 0.7), ("dance", 0.3)):
        _, std = sde_mean_std(x, v, s, s_next, a, kind)
        torch.testing.assert_close(
            std.flatten(), sde_noise_scale(s, s_next, a, kind) * math.sqrt(sigma - sigma_next)
        )


def test_peer_log_prob_forms():
    assert PEER_LOG_PROB_FORM == {"flow_grpo": "gaussian", "dance": "gaussian", "cps": "squared_error"}


def test_cps_log_prob_is_flow_grpos_squared_error_and_its_clip_range_carries_over():
    x, v = _batch(6)
    sigma, sigma_next, a = torch.tensor([0.9, 0.6, 0.3]), torch.tensor([0.8, 0.4, 0.1]), 0.6
    prev, lp, mean, std = sde_step(
        x, v, sigma, sigma_next, a, "cps", generator=torch.Generator().manual_seed(1)
    )
    # Flow-GRPO: log_prob = -((prev_sample - prev_sample_mean) ** 2), then the mean over non-batch dims
    torch.testing.assert_close(lp, (-((prev - mean) ** 2)).mean(dim=(1, 2, 3)))
    # a policy whose mean moved: Flow-GRPO's log-ratio is 2 std^2 times the Gaussian one, step by step
    _, lp_new, _, _ = sde_step(x, v + 0.05, sigma, sigma_next, a, "cps", prev_sample=prev)
    _, g_old, _, _ = sde_step(x, v, sigma, sigma_next, a, "cps", prev_sample=prev, log_prob_form="gaussian")
    _, g_new, _, _ = sde_step(
        x, v + 0.05, sigma, sigma_next, a, "cps", prev_sample=prev, log_prob_form="gaussian"
    )
    torch.testing.assert_close(lp_new - lp, 2 * std.flatten() ** 2 * (g_new - g_old), rtol=1e-4, atol=1e-7)


def test_flow_grpo_kl_form_is_exact_kl_times_dt_on_a_shift3_schedule():
    """Flow-GRPO's KL divides by 2 sigma_t^2; the exact Gaussian KL by 2 sigma_t^2 |dt|. On a 10-step shift-3
    schedule the exact form is 3.7x to 25x the Flow-GRPO form before the last step (and ~112x at it)."""
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.float()
    x, v = _batch(7, shape=(1, 3, 4, 4))
    ratios = []
    for i in range(10):
        s, s_next = sigmas[i : i + 1], sigmas[i + 1 : i + 2]
        mean, std = sde_mean_std(x, v, s, s_next, 0.7, "flow_grpo")
        ref_mean, _ = sde_mean_std(x, v + 0.1, s, s_next, 0.7, "flow_grpo")
        exact = gaussian_mean_kl(mean, ref_mean, std)
        sigma_t = _flow_grpo_noise_scale(float(s), float(s_next), 0.7, float(sigmas[1]))
        flow_grpo = ((mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * sigma_t**2)  # Flow-GRPO's kl_loss
        scale = sde_noise_scale(s.view(-1, 1, 1, 1), s_next.view(-1, 1, 1, 1), 0.7, "flow_grpo")
        torch.testing.assert_close(gaussian_mean_kl(mean, ref_mean, scale), flow_grpo, rtol=1e-5, atol=0)
        torch.testing.assert_close(exact, flow_grpo / float(s - s_next), rtol=1e-5, atol=0)
        ratios.append(float(exact / flow_grpo))
    assert 3.5 < min(ratios[:-1]) < 4.0 and 24.0 < max(ratios[:-1]) < 26.0
    assert 100 < ratios[-1] < 120


def test_cps_noise_level_above_one_is_refused():
    """CPS's std ``s' sin(a pi / 2)`` peaks at ``a = 1`` (std ``s'``), is ~5e-17 at ``a = 2`` and negative above
    (Flow-GRPO's range is (0, 1]): such an ``a`` is refused, not sampled with a vanishing or negative std."""
    x, v = _batch()
    _, std = sde_mean_std(x, v, 0.6, 0.4, 1.0, "cps")
    torch.testing.assert_close(std.flatten(), torch.full((3,), 0.4))
    for a in (1.5, 2.0, 2.5):
        with pytest.raises(ValueError, match=r"cps needs noise_level in \[0, 1\]"):
            sde_step(x, v, 0.6, 0.4, a, "cps", generator=torch.Generator().manual_seed(0))
        with pytest.raises(ValueError, match=r"cps needs noise_level in \[0, 1\]"):  # (the KL's scale)
            sde_noise_scale(torch.tensor([0.6]), torch.tensor([0.4]), a, "cps")
        with pytest.raises(ValueError, match=r"cps needs noise_level in \[0, 1\]"):  # the pipeline's settings
            SamplingConfig(sde_kind="cps", noise_level=a, sde_window=(0, 2))
    # Flow-GRPO's a and DanceGRPO's eta have no such bound
    _, std = sde_mean_std(x, v, 0.6, 0.4, 1.5, "dance")
    torch.testing.assert_close(std.flatten(), torch.full((3,), 1.5 * math.sqrt(0.2)))
