import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.core import losses as L


def test_clipped_surrogate_hand_values():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0])
    loss = L.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.3)
    # ratio 1.5 A=1 -> clipped 1.3; ratio .5 A=-1 -> max(-.5,-.8) -> loss .8; 1.1*2; .7 A=-1 -> clip .8 -> .8
    torch.testing.assert_close(loss, torch.tensor([-1.3, 0.8, -2.2, 0.8]))


def test_ratio_of_sample_to_itself_is_one():
    logp = torch.randn(3, 5)
    loss = L.clipped_surrogate(logp, logp.clone(), torch.tensor([[1.0], [-2.0], [0.5]]))
    torch.testing.assert_close(loss, -torch.tensor([[1.0], [-2.0], [0.5]]).expand(3, 5))


@settings(max_examples=100)
@given(
    st.floats(-3, 3),
    st.floats(-5, 5).filter(lambda a: abs(a) > 1e-3),
    st.floats(0.05, 0.5),
    st.floats(0.05, 0.5),
)
def test_gradient_zero_outside_trust_region(log_ratio, adv, eps_low, eps_high):
    logp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    loss = L.clipped_surrogate(
        logp,
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([adv], dtype=torch.float64),
        eps_low=eps_low,
        eps_high=eps_high,
    )
    loss.sum().backward()
    ratio = math.exp(log_ratio)
    outside = (adv > 0 and ratio > 1 + eps_high) or (adv < 0 and ratio < 1 - eps_low)
    if outside:
        assert logp.grad.item() == 0.0
    else:
        assert logp.grad.item() == pytest.approx(-ratio * adv, rel=1e-9)


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.log(torch.tensor([10.0, 10.0]))
    adv = torch.tensor([-1.0, 1.0])
    plain = L.clipped_surrogate(logp, torch.zeros(2), adv)
    dual = L.clipped_surrogate(logp, torch.zeros(2), adv, dual_clip=3.0)
    torch.testing.assert_close(plain, torch.tensor([10.0, -1.2]))
    torch.testing.assert_close(dual, torch.tensor([3.0, -1.2]))
    with pytest.raises(ValueError, match="dual_clip"):
        L.clipped_surrogate(logp, torch.zeros(2), adv, dual_clip=0.5)


def test_kl_estimators_hand_values():
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-0.5, -1.0])
    torch.testing.assert_close(L.kl_estimate(logp, ref, "k1"), torch.tensor([0.5, 0.0]))
    torch.testing.assert_close(L.kl_estimate(logp, ref, "k2"), torch.tensor([0.125, 0.0]))
    torch.testing.assert_close(L.kl_estimate(logp, ref, "k3"), torch.tensor([math.exp(-0.5) + 0.5 - 1, 0.0]))


def test_clamped_k3_is_verls_low_var_kl():
    """verl / EasyR1 low_var_kl: d = ref - logp clamped to [-20, 20], k3 clamped to at most 10. Inside the clamps
    it is TRL's k3; a token the reference finds e^4 times likelier adds 10 (plain: e^4 - 5 = 49.6) and no
    gradient; d = -30 (the policy far likelier) is read as -20, whose k3 (19 + e^-20) is capped at 10 too."""
    logp = torch.tensor([0.0, -5.0, 0.0, -1.0], requires_grad=True)
    ref = torch.tensor([-0.5, -1.0, -30.0, -1.0])
    clamped = L.kl_estimate(logp, ref, "k3", clamp=True)
    expected = torch.tensor([math.exp(-0.5) + 0.5 - 1, 10.0, 10.0, 0.0])
    torch.testing.assert_close(clamped, expected)
    assert float(L.kl_estimate(logp, ref, "k3")[1]) == pytest.approx(math.exp(4.0) - 5.0)
    clamped.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([1 - math.exp(-0.5), 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="k3"):
        L.kl_estimate(logp, ref, "k2", clamp=True)


def test_k3_is_unbiased_for_kl():
    p = torch.distributions.Categorical(probs=torch.tensor([0.7, 0.2, 0.1]))
    q = torch.distributions.Categorical(probs=torch.tensor([0.4, 0.4, 0.2]))
    x = (
        p.sample(
            (400_000,),
        )
        if False
        else torch.multinomial(p.probs, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    )
    est = L.kl_estimate(p.log_prob(x), q.log_prob(x), "k3").mean()
    exact = torch.distributions.kl_divergence(p, q)
    assert float(est) == pytest.approx(float(exact), rel=0.02)


def test_aggregate_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(L.aggregate(loss, mask, "token_mean")) == pytest.approx(10 / 4)
    assert float(L.aggregate(loss, mask, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(L.aggregate(loss, mask, "seq_mean_token_sum_norm")) == pytest.approx(10 / (2 * 3))
    assert float(L.aggregate(loss, mask, "seq_mean_token_sum_norm", max_len=10)) == pytest.approx(10 / 20)
    with pytest.raises(ValueError, match="no token"):
        L.aggregate(loss, torch.zeros_like(mask))


@settings(max_examples=100)
@given(
    st.lists(st.floats(-8, 8), min_size=1, max_size=12),
    st.floats(1.0, 5.0),
    st.sampled_from(["token", "sequence"]),
)
def test_tis_weights_never_exceed_cap(diffs, cap, mode):
    old = torch.tensor([diffs], dtype=torch.float64)
    w = L.truncated_is_weights(old, torch.zeros_like(old), cap=cap, mode=mode)
    assert (w <= cap + 1e-12).all() and (w >= 0).all()
    assert not w.requires_grad


def test_tis_hand_values_and_mask_policy():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.3]]))
    roll = torch.log(torch.tensor([[0.25, 0.9, 0.6]]))
    torch.testing.assert_close(L.truncated_is_weights(old, roll, cap=1.5), torch.tensor([[1.5, 1.0, 0.5]]))
    torch.testing.assert_close(
        L.truncated_is_weights(old, roll, cap=1.5, policy="mask"), torch.tensor([[0.0, 1.0, 0.5]])
    )
    seq = L.truncated_is_weights(old, roll, cap=5.0, mode="sequence", mask=torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(seq, torch.tensor([[2.0, 2.0, 0.0]]))


def test_stale_sample_weights_per_token_with_engine_weights_at_lag_zero():
    current = torch.log(torch.tensor([[0.5, 0.9, 0.3], [0.4, 0.2, 0.8]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.9, 0.6], [0.2, 0.2, 0.8]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    engine = torch.full((2, 3), 0.7)
    # row 0 is stale: its TIS weights; row 1 is fresh: the engine's
    w = L.stale_sample_weights(current, behaviour, torch.tensor([2, 0]), cap=1.5, mask=mask, fresh=engine)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.0, 0.5], [0.7, 0.7, 0.7]]))
    # without engine weights a fresh sample weighs exactly 1 on its tokens, 0 on padding
    w = L.stale_sample_weights(current, behaviour, torch.tensor([2, 0]), cap=1.5, mask=mask)
    assert torch.equal(w[1], torch.tensor([1.0, 1.0, 0.0]))
    seq = L.stale_sample_weights(
        current, behaviour, torch.tensor([1, 1]), cap=5.0, mode="sequence", mask=mask
    )
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="lags must be"):
        L.stale_sample_weights(current, behaviour, torch.tensor([0, 1, 2]), cap=1.5)


@settings(max_examples=100)
@given(
    st.lists(st.tuples(st.floats(-2, 2), st.floats(-3, 3), st.floats(0.01, 4.0)), min_size=1, max_size=16),
    st.floats(0.05, 0.5),
)
def test_weighting_the_loss_term_equals_weighting_the_advantage(rows, eps):
    # the clipped surrogate is positively homogeneous in A: w * L(r, A) = L(r, w * A) for w > 0, so the one
    # convention (weight the per-sample loss term) is what folding the weight into the advantage computed
    log_ratio, adv, w = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))
    old = torch.zeros_like(log_ratio)
    torch.testing.assert_close(
        w * L.clipped_surrogate(log_ratio, old, adv, eps), L.clipped_surrogate(log_ratio, old, w * adv, eps)
    )


def test_gspo_token_logp_gives_sequence_ratio_and_token_gradient():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0]])
    new = L.gspo_token_logp(logp, old, mask)
    ratio = torch.exp(new - old)
    torch.testing.assert_close(ratio, torch.full((1, 3), math.exp(0.25)))
    ratio.sum().backward()
    torch.testing.assert_close(logp.grad, torch.full((1, 3), math.exp(0.25)))


def test_cispo_keeps_every_tokens_gradient_with_its_weight_capped():
    # ratios 0.5, 1.5, 8 (capped at 5), 1; advantages 1, -2, 1, 3
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.5, 8.0, 1.0])).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 1.0, 3.0])
    loss = L.cispo_surrogate(logp, old, adv, weight_max=5.0)
    torch.testing.assert_close(loss, -torch.tensor([0.5, 1.5, 5.0, 1.0]) * adv * logp.detach())
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([0.5, -3.0, 5.0, 3.0]))
    # PPO's clip gives the tokens outside [0.8, 1.28] with the advantage's sign pushing them out no gradient
    clipped = logp.detach().clone().requires_grad_()
    L.clipped_surrogate(clipped, old, adv, 0.2, 0.28).sum().backward()
    torch.testing.assert_close(clipped.grad, -torch.tensor([0.5, -3.0, 0.0, 3.0]))


@given(
    st.lists(st.tuples(st.floats(-3, 3), st.floats(-3, 3), st.floats(-3, 3)), min_size=1, max_size=32),
    st.floats(1.0, 10.0),
)
def test_cispo_gradient_is_trls_capped_weight_times_the_advantage(rows, weight_max):
    # TRL's loss_type="cispo": per_token_loss = -clamp(coef_1, max=epsilon_high).detach() * advantages * logps
    logp, old, adv = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))
    logp.requires_grad_()
    L.cispo_surrogate(logp, old, adv, weight_max).sum().backward()
    trl_weight = torch.clamp(torch.exp(logp.detach() - old), max=weight_max)
    torch.testing.assert_close(logp.grad, -trl_weight * adv)


def test_gaussian_mean_kl():
    mean = torch.tensor([[1.0, 2.0]])
    ref = torch.tensor([[0.0, 2.0]])
    torch.testing.assert_close(L.gaussian_mean_kl(mean, ref, torch.tensor(0.5)), torch.tensor([1.0]))


def test_diffusion_nft_loss_reduces_to_flow_matching_at_beta_one_positive():
    v = torch.randn(2, 4)
    target = torch.randn(2, 4)
    out = L.diffusion_nft_loss(v, v.clone(), target, torch.tensor([1.0, 0.0]), beta=1.0)
    fm = ((v - target) ** 2).mean(1)
    torch.testing.assert_close(out, fm)  # v+ = v- = v when v_theta == v_old


def test_diffusion_nft_loss_gradient_at_the_sampling_policy_by_hand():
    # at v_theta = v_old: dL/dv = r 2 beta (v - v*) / D - (1 - r) 2 beta (v - v*) / D = 2 beta (2r - 1) (v - v*) / D,
    # toward the target for r > 1/2, away below, none at 1/2; v - v* = [-2, -2], beta 0.5, D 2
    v_old = torch.tensor([[1.0, -1.0]] * 3)
    target = torch.tensor([[3.0, 1.0]] * 3)
    v = v_old.clone().requires_grad_(True)
    L.diffusion_nft_loss(v, v_old, target, torch.tensor([0.8, 0.2, 0.5]), beta=0.5).sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[-0.6, -0.6], [0.6, 0.6], [0.0, 0.0]]))


def test_diffusion_nft_loss_adaptive_weight_by_hand():
    v_old = torch.zeros(1, 2)
    target = torch.tensor([[2.0, -6.0]])
    # v == v_old: v+ = v- = 0, velocity error [-2, 6]; clean-image error at sigma 0.25: [-0.5, 1.5]
    out = L.diffusion_nft_loss(v_old.clone(), v_old, target, torch.tensor([0.3]), sigma=torch.tensor([0.25]))
    torch.testing.assert_close(out, torch.tensor([((0.25 + 2.25) / 2) / 1.0]))
    # the weight is detached, so the loss grows linearly (not quadratically) with the error's scale
    big = L.diffusion_nft_loss(
        v_old.clone(), v_old, 3 * target, torch.tensor([0.3]), sigma=torch.tensor([0.25])
    )
    torch.testing.assert_close(big, 3 * out)


@pytest.mark.gpu
def test_core_functions_match_on_cuda():
    from mmrl.core import advantages as A
    from mmrl.core import allocation as alloc

    g = torch.Generator().manual_seed(0)
    r = torch.rand(1000, generator=g)
    ids = torch.randint(0, 50, (1000,), generator=g)
    torch.testing.assert_close(A.group_normalized(r.cuda(), ids.cuda()).cpu(), A.group_normalized(r, ids))
    torch.testing.assert_close(A.rloo(r.cuda(), ids.cuda()).cpu(), A.rloo(r, ids))
    p = torch.rand(200, generator=g)
    assert torch.equal(alloc.knapsack(p.cuda(), 1600, n_max=32).cpu(), alloc.knapsack(p, 1600, n_max=32))
    logp, old, adv = torch.randn(8, 5), torch.randn(8, 5), torch.randn(8, 1)
    torch.testing.assert_close(
        L.clipped_surrogate(logp.cuda(), old.cuda(), adv.cuda()).cpu(), L.clipped_surrogate(logp, old, adv)
    )


def test_reward_weighted_fm_loss_hand_values():
    v = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    target = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    out = L.reward_weighted_fm_loss(v, target, torch.tensor([0.5, 2.0]))
    # per-sample mean squared error (1 + 4) / 2 = 2.5 and (4 + 0) / 2 = 2, times the weights
    torch.testing.assert_close(out, torch.tensor([1.25, 4.0]))
    with pytest.raises(ValueError, match="non-negative"):
        L.reward_weighted_fm_loss(v, target, torch.tensor([1.0, -1.0]))


def test_clip_fractions_count_real_tokens_only():
    # 2 sequences x 4 positions; the second has one real token. Ratios: exp(+-0.5) = 1.65 / 0.61
    logp = torch.tensor([[0.5, -0.5, 0.0, 0.5], [0.5, 0.5, 0.5, 0.5]])
    old = torch.zeros(2, 4)
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    out = L.clip_fractions(logp, old, adv, eps_low=0.2, eps_high=0.28, mask=mask)
    # high: row 0 position 0 only (position 3 is padding) -> 1 of 4 real tokens; low: none (row 1 has A<0, rho>1)
    assert out["clip/high_frac"].item() == pytest.approx(1 / 4)
    assert out["clip/low_frac"].item() == 0.0
    unmasked = L.clip_fractions(logp, old, adv, eps_low=0.2, eps_high=0.28)
    assert unmasked["clip/high_frac"].item() == pytest.approx(
        2 / 8
    )  # padding counted: the bias masking removes


def _trl_grpo_loss(logp, old, ref, adv, mask, eps_low, eps_high, beta, loss_type, max_completion_length):
    """TRL GRPOTrainer's loss, written from its documentation: per-token clipped objective minus beta * k3,
    reduced per loss_type ("grpo": mean of per-sequence token means; "bnpo"/"dapo": token mean; "dr_grpo":
    token sum over batch * max_completion_length)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    per_token = per_token + beta * per_token_kl
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    return (per_token * mask).sum() / (per_token.size(0) * max_completion_length)


@pytest.mark.parametrize(
    ("loss_type", "loss_agg"),
    [
        ("grpo", "seq_mean_token_mean"),
        ("dapo", "token_mean"),
        ("bnpo", "token_mean"),
        ("dr_grpo", "seq_mean_token_sum_norm"),
    ],
)
def test_vlm_loss_equals_trls_with_the_same_epsilon_and_beta(loss_type, loss_agg):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=g) * 2
    old = logp + 0.3 * torch.randn(4, 6, generator=g)
    ref = logp + 0.2 * torch.randn(4, 6, generator=g)
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]])
    eps_low, eps_high, beta = 0.2, 0.28, 0.04
    # the VLM trainer's minibatch loss (its composition pinned in tests/vlm/test_vlm_trainer.py): clipped_surrogate
    # (epsilon_low, epsilon_high) + beta * k3, then aggregate(loss_agg)
    per_token = L.clipped_surrogate(logp, old, adv.unsqueeze(1), eps_low, eps_high)
    per_token = per_token + beta * L.kl_estimate(logp, ref, kind="k3")
    ours = L.aggregate(per_token, mask, mode=loss_agg, max_len=8)
    theirs = _trl_grpo_loss(logp, old, ref, adv, mask.float(), eps_low, eps_high, beta, loss_type, 8)
    torch.testing.assert_close(ours, theirs)


def test_guidance_distillation_loss_hand_values():
    # teacher at w = 3: v_w = u + 3 (c - u); sample 0: u = 0, c = 1 -> v_w = 3 everywhere; v = (3, 1) -> (0 + 4) / 2
    # sample 1: u = 1, c = 0 -> v_w = 1 - 3 = -2; v = (-2, -2) -> 0
    v = torch.tensor([[3.0, 1.0], [-2.0, -2.0]])
    u = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    c = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    v_w = u + 3.0 * (c - u)
    torch.testing.assert_close(L.guidance_distillation_loss(v, v_w), torch.tensor([2.0, 0.0]))
    # w = 1 distils the conditional velocity: (3 - 1)^2 / 2 and (-2 - 0)^2
    torch.testing.assert_close(L.guidance_distillation_loss(v, c), torch.tensor([2.0, 4.0]))
    # the gradient reaches v only, as 2 (v - v_w) / D
    v = v.clone().requires_grad_(True)
    v_w.requires_grad_(True)
    L.guidance_distillation_loss(v, v_w).sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -2.0], [0.0, 0.0]]))
    assert v_w.grad is None
    with pytest.raises(ValueError, match="v_guided"):
        L.guidance_distillation_loss(v, c[:, :1])
