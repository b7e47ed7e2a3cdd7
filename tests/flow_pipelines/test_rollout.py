"""Flat-group rollouts: groups, shared noise, SDE window, transitions, reproducibility (issue 5, part 3)."""

from __future__ import annotations

import pytest
import torch

from pipelines.flow.rollout import SamplingConfig, expand_groups, rescore, rollout

PROMPTS = ["a photo of a red circle", "a photo of two blue squares", "a cat"]


def _config(**overrides) -> SamplingConfig:
    kwargs = {"num_steps": 4, "height": 32, "width": 32, "noise_level": 0.7, **overrides}
    return SamplingConfig(**kwargs)


@pytest.fixture
def sd3(load_tiny):
    return load_tiny("sd3")


def test_expand_groups_with_different_sizes():
    assert expand_groups(PROMPTS, [3, 1, 2]).tolist() == [0, 0, 0, 1, 2, 2]
    assert expand_groups(PROMPTS[:2], 2).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="entries"):
        expand_groups(PROMPTS, [1, 2])
    with pytest.raises(ValueError, match=">= 1"):
        expand_groups(PROMPTS, [1, 0, 2])


def test_shared_noise_is_shared_within_groups_only(sd3):
    result = rollout(
        sd3, PROMPTS, [3, 1, 2], _config(shared_noise=True), generator=torch.Generator().manual_seed(0)
    )
    x0 = result.latents[:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[1], x0[2]) and torch.equal(x0[4], x0[5])
    assert not torch.equal(x0[0], x0[3]) and not torch.equal(x0[3], x0[4])
    # SDE noise still differs within a group, so the samples do
    assert not torch.equal(result.latents[0, -1], result.latents[1, -1])


def test_independent_noise_differs_within_groups(sd3):
    result = rollout(sd3, PROMPTS[:1], 3, _config(), generator=torch.Generator().manual_seed(0))
    x0 = result.latents[:, 0]
    assert not torch.equal(x0[0], x0[1]) and not torch.equal(x0[1], x0[2])


def test_rollouts_are_reproducible_and_noise_can_be_replayed(sd3):
    config = _config(sde_window=(1, 3))
    a = rollout(sd3, PROMPTS[:2], 2, config, generator=torch.Generator().manual_seed(7))
    b = rollout(sd3, PROMPTS[:2], 2, config, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.latents, b.latents) and torch.allclose(
        a.log_probs, b.log_probs, rtol=0, atol=0, equal_nan=True
    )
    # two-stage regeneration: the same initial noise through an ODE-only sampler is deterministic
    ode = _config(sde_window=(0, 0))
    c = rollout(sd3, PROMPTS[:2], 2, ode, noise=a.latents[:, 0])
    d = rollout(sd3, PROMPTS[:2], 2, ode, noise=a.latents[:, 0])
    assert torch.equal(c.latents, d.latents) and torch.equal(c.latents[:, 0], a.latents[:, 0])


def test_sde_window_outside_steps_are_ode_steps(sd3):
    result = rollout(
        sd3, PROMPTS[:1], 2, _config(sde_window=(1, 3)), generator=torch.Generator().manual_seed(0)
    )
    assert result.sde_steps.tolist() == [False, True, True, False]
    assert (
        torch.isnan(result.log_probs[:, [0, 3]]).all() and torch.isfinite(result.log_probs[:, [1, 2]]).all()
    )
    # step 0 is the Euler ODE step of the velocity at sigma_0
    cond = sd3.encode(PROMPTS[:1]).select([0, 0])
    with torch.no_grad():
        v = sd3.velocity(result.latents[:, 0], result.sigmas[0], cond)
    expected = result.latents[:, 0] + v * (result.sigmas[1] - result.sigmas[0])
    torch.testing.assert_close(result.latents[:, 1], expected, rtol=1e-5, atol=1e-5)


def test_transitions_and_timestep_subsampling(sd3):
    result = rollout(
        sd3, PROMPTS, [1, 2, 1], _config(sde_window=(0, 3)), generator=torch.Generator().manual_seed(0)
    )
    batch = result.transitions()
    assert len(batch) == 4 * 3
    assert batch.sample_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert batch.step_index.tolist() == [0, 1, 2] * 4
    torch.testing.assert_close(batch.next_latents[4], result.latents[1, 2])
    torch.testing.assert_close(batch.sigma_next, result.sigmas[batch.step_index + 1])
    sub = result.transitions(steps=[2])
    assert len(sub) == 4 and sub.step_index.tolist() == [2, 2, 2, 2]
    half = batch.select([0, 5])
    assert half.sample_index.tolist() == [0, 1] and len(half.cond) == 2
    with pytest.raises(ValueError, match="ODE steps"):
        result.transitions(steps=[3])


def test_cfg_rollout_rescore_and_chunked_forwards(sd3):
    config = _config(guidance_scale=3.0, max_batch_size=2)
    result = rollout(sd3, PROMPTS[:2], [2, 1], config, generator=torch.Generator().manual_seed(0))
    assert result.nfe == 3 * 4 * 2
    unchunked = rollout(
        sd3, PROMPTS[:2], [2, 1], _config(guidance_scale=3.0), generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(result.latents, unchunked.latents, rtol=1e-4, atol=1e-4)
    log_probs, means, stds = rescore(sd3, result.transitions())
    torch.testing.assert_close(log_probs, result.transitions().log_probs, rtol=0, atol=1e-4)
    assert means.shape == result.transitions().latents.shape and stds.shape[0] == len(log_probs)
    # CFG-free re-scoring is a different policy: different log-probs
    cfg_free, _, _ = rescore(sd3, result.transitions(), guidance_scale=1.0)
    assert not torch.allclose(cfg_free, log_probs)


def test_invalid_configs_raise(sd3):
    with pytest.raises(ValueError, match="sde_window"):
        _config(sde_window=(2, 9))
    with pytest.raises(ValueError, match="sde_kind"):
        _config(sde_kind="euler")
    with pytest.raises(ValueError, match="CPS"):
        rollout(sd3, PROMPTS[:1], 1, _config(sde_kind="cps"))
    with pytest.raises(ValueError, match="noise_level=0"):
        rollout(sd3, PROMPTS[:1], 1, _config(noise_level=0.0))
    with pytest.raises(ValueError, match="noise has shape"):
        rollout(sd3, PROMPTS[:1], 1, _config(), noise=torch.zeros(1, 4, 8, 8))


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_every_sde_kind_rolls_out(sd3, kind):
    config = _config(sde_kind=kind, sde_window=(0, 3), noise_level=0.5)
    result = rollout(sd3, PROMPTS[:1], 2, config, generator=torch.Generator().manual_seed(0))
    log_probs, _, _ = rescore(sd3, result.transitions())
    torch.testing.assert_close(log_probs, result.transitions().log_probs, rtol=0, atol=1e-4)
