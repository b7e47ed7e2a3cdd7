"""Policy-gradient losses, KL estimators, loss aggregation and off-policy corrections.

Losses are returned unreduced (per token or per sample) so the caller picks the aggregation with
:func:`aggregate`; log-probs are natural-log densities of the sampled actions (tokens, or SDE transitions whose
log-prob is the mean over dimensions, see ``pipelines/flow/sde.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from mmrl.core._checks import check_finite, check_same_shape

__all__ = [
    "aggregate",
    "awm_log_likelihood",
    "cispo_surrogate",
    "clip_fractions",
    "clipped_surrogate",
    "diffusion_nft_loss",
    "gaussian_mean_kl",
    "gspo_token_logp",
    "guidance_distillation_loss",
    "kl_estimate",
    "reward_weighted_fm_loss",
    "stale_sample_weights",
    "truncated_is_weights",
]


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate, unreduced, with asymmetric clip range and optional dual clip.

    ``rho = exp(logp - old_logp)``;
    ``L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)`` (Schulman et al. 1707.06347 eq. 7;
    clip-higher ``eps_high > eps_low`` from DAPO 2503.14476 eq. 10). With ``dual_clip = c > 1`` the loss of a
    negative-advantage sample is additionally capped at ``-c * A`` (Ye et al. 1912.09729 eq. 5), so a huge ratio
    on a bad sample cannot dominate the batch. Outside the trust region the loss is constant in ``logp`` and the
    gradient is exactly zero.

    Args:
        logp: ``[...]`` log-probs under the current policy (carries the gradient).
        old_logp: ``[...]`` log-probs under the policy that produced the samples (no gradient).
        adv: advantages broadcastable to ``logp`` (e.g. ``[B, 1]`` for sequence advantages over ``[B, T]``).
        eps_low: lower clip range.
        eps_high: upper clip range (default ``eps_low``).
        dual_clip: dual-clip constant ``c > 1``, or None.

    Returns:
        Per-element loss with the shape of ``logp``.
    """
    check_same_shape(logp=logp, old_logp=old_logp)
    eps_high = eps_low if eps_high is None else eps_high
    if eps_low < 0 or eps_high < 0:
        raise ValueError(f"clip ranges must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    adv = adv.expand_as(logp) if adv.shape != logp.shape else adv
    ratio = torch.exp(logp - old_logp.detach())
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    return loss


def cispo_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, weight_max: float = 5.0
) -> torch.Tensor:
    """CISPO's per-element loss: REINFORCE on every token, weighted by its capped, detached importance ratio.

    ``rho = exp(logp - old_logp)``; ``L = -sg(min(rho, weight_max)) * A * logp``, so
    ``dL/dlogp = -min(rho, weight_max) * A`` (MiniMax-M1 2506.13585 eq. 4 with no lower bound, the form of
    ScaleRL 2510.13786 and TRL's ``loss_type="cispo"``, whose ``epsilon_high`` is ``weight_max``, 5.0). Where
    :func:`clipped_surrogate` gives a token outside the trust region exactly zero gradient, here every token keeps
    one (rare, high-ratio tokens such as "wait" or "however" stay in the update); the cap bounds its weight. The
    value itself is no objective to read: only its gradient is.

    Args:
        logp: ``[...]`` log-probs under the current policy (carries the gradient).
        old_logp: ``[...]`` log-probs under the policy that produced the samples (no gradient).
        adv: advantages broadcastable to ``logp``.
        weight_max: cap on the importance weight, > 0.

    Returns:
        Per-element loss with the shape of ``logp``.
    """
    check_same_shape(logp=logp, old_logp=old_logp)
    if weight_max <= 0:
        raise ValueError(f"weight_max must be > 0, got {weight_max}")
    adv = adv.expand_as(logp) if adv.shape != logp.shape else adv
    weight = torch.exp(logp - old_logp).clamp(max=weight_max).detach()
    return -weight * adv * logp


def clip_fractions(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    eps_low: float,
    eps_high: float | None = None,
    mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Shares of elements whose ratio was clipped, over the elements ``mask`` selects (default: all).

        clip/low_frac  = sum(m * [rho < 1 - eps_low  and A < 0]) / sum(m)
        clip/high_frac = sum(m * [rho > 1 + eps_high and A > 0]) / sum(m)

    Only elements where clipping changes the objective are counted, and padding never is (TRL's
    ``clip_ratio/low_mean`` and ``clip_ratio/high_mean``, verl's ``pg_clipfrac``: masked means over completion
    tokens).

    Args:
        logp, old_logp: ``[...]`` log-probs under the current and the old policy.
        adv: advantages broadcastable to ``logp``.
        mask: ``[...]`` 1 on real elements (completion tokens), 0 on padding.
    """
    eps_high = eps_low if eps_high is None else eps_high
    adv = adv.expand_as(logp) if adv.shape != logp.shape else adv
    ratio = torch.exp((logp - old_logp).detach())
    weight = torch.ones_like(ratio) if mask is None else mask.to(ratio.dtype)
    count = weight.sum().clamp(min=1.0)
    low = (((ratio < 1 - eps_low) & (adv < 0)).to(ratio.dtype) * weight).sum() / count
    high = (((ratio > 1 + eps_high) & (adv > 0)).to(ratio.dtype) * weight).sum() / count
    return {"clip/low_frac": low, "clip/high_frac": high}


def gspo_token_logp(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rewrite token log-probs so :func:`clipped_surrogate` becomes GSPO's sequence-level objective.

    GSPO (Zheng et al. 2507.18071 eq. 7, "GSPO-token") uses the length-normalised sequence ratio
    ``s_i = exp(mean_t (logp_t - old_t))`` for every token of sequence i:
    ``log s_it = sg[log s_i] + logp_t - sg[logp_t]``. Returns ``old_logp + log s_it`` so that
    ``exp(result - old_logp) = s_it``: its value is the sequence ratio, its gradient the token's.

    Args:
        logp, old_logp, mask: ``[B, T]``; ``mask`` is 1 on completion tokens.
    """
    check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    m = mask.to(logp.dtype)
    lengths = m.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = (((logp - old_logp) * m).sum(-1, keepdim=True) / lengths).detach()
    return old_logp.detach() + seq_log_ratio + logp - logp.detach()


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: Literal["k1", "k2", "k3"] = "k3",
    clamp: bool = False,
) -> torch.Tensor:
    """Per-element estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence").

    With ``d = ref_logp - logp``: ``k1 = -d``; ``k2 = d^2 / 2``; ``k3 = exp(d) - d - 1`` (unbiased, always >= 0,
    low variance; the GRPO default, 2402.03300 eq. 4; TRL's form).

    ``clamp`` (k3 only) is verl's and EasyR1's ``low_var_kl``: ``d`` clamped to ``[-20, 20]`` and ``k3`` to at most
    10, so a token the reference finds far likelier than the policy (``exp(d)`` large) adds at most 10 and no
    gradient, where the plain form grows as ``exp(d)``.
    """
    check_same_shape(logp=logp, ref_logp=ref_logp)
    d = ref_logp - logp
    if clamp and kind != "k3":
        raise ValueError(f"clamp is verl's low_var_kl, a k3 estimator; got kind {kind!r}")
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        if clamp:
            d = d.clamp(-20.0, 20.0)
            return (torch.exp(d) - d - 1.0).clamp(max=10.0)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def gaussian_mean_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL on the means of two Gaussian SDE transitions, per sample (Flow-GRPO 2505.05470 eq. 10).

    ``KL = ||mu_theta - mu_ref||^2 / (2 s^2)``, averaged over the non-batch dimensions to match the per-dimension
    mean log-probs of the SDE step. With ``s`` the transition std ``sigma_t sqrt|dt|`` this is the exact KL of the
    two transitions; Flow-GRPO's code divides by the noise scale ``sigma_t`` alone (``s = sigma_t``: the exact KL
    times ``|dt|``, a KL per unit time), and its published ``beta`` is for that form
    (``pipelines.flow.sde.sde_noise_scale``; the flow trainer's ``kl_form``).

    Args:
        mean, ref_mean: ``[B, ...]`` transition means under the policy and the reference.
        std: the scale ``s``, broadcastable to ``mean`` (``[B, 1, ...]`` or a scalar).

    Returns:
        ``[B]``.
    """
    check_same_shape(mean=mean, ref_mean=ref_mean)
    kl = (mean - ref_mean) ** 2 / (2.0 * std**2)
    return kl.flatten(1).mean(1)


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean",
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    - ``token_mean``: ``sum(L * m) / sum(m)``, every token weighs the same (DAPO 2503.14476 eq. 12).
    - ``seq_mean_token_mean``: ``mean_b [sum_t L m / sum_t m]``, every sequence weighs the same (GRPO); rows with
      no token are left out of the mean.
    - ``seq_mean_token_sum_norm``: ``sum(L * m) / (B * max_len)``, a constant normaliser with no length bias
      (Dr.GRPO 2503.20783 sec. 3.1); ``max_len`` defaults to ``T``.

    Raises:
        ValueError: if the mask selects no token.
    """
    check_same_shape(loss=loss, mask=mask)
    m = mask.to(loss.dtype)
    total = m.sum()
    if float(total) == 0:
        raise ValueError("aggregate: the mask selects no token; nothing to average")
    if mode == "token_mean":
        return (loss * m).sum() / total
    if mode == "seq_mean_token_mean":
        per_seq_tokens = m.sum(-1)
        has = per_seq_tokens > 0
        per_seq = (loss * m).sum(-1)[has] / per_seq_tokens[has]
        return per_seq.mean()
    if mode == "seq_mean_token_sum_norm":
        length = loss.shape[-1] if max_len is None else max_len
        rows = loss.shape[0] if loss.ndim > 1 else 1
        return (loss * m).sum() / (rows * length)
    raise ValueError(
        f"mode must be 'token_mean', 'seq_mean_token_mean' or 'seq_mean_token_sum_norm', got {mode!r}"
    )


def truncated_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cap: float = 2.0,
    mode: Literal["token", "sequence"] = "token",
    mask: torch.Tensor | None = None,
    policy: Literal["truncate", "mask"] = "truncate",
) -> torch.Tensor:
    """Truncated importance weights for samples drawn by a different engine (vLLM, a quantized copy).

    The trainer's old policy ``pi_old`` and the rollout engine ``pi_rollout`` differ numerically; the loss of
    each token is multiplied by ``w = min(pi_old / pi_rollout, C)`` held constant (no gradient) (Yao et al.,
    "Your efficient RL framework secretly brings you off-policy RL training", 2025; TIS). ``mode="sequence"``
    uses the sequence ratio ``exp(sum_t m_t (old_t - rollout_t))`` for all tokens of the sequence.
    ``policy="mask"`` zeroes samples whose ratio exceeds ``cap`` instead of truncating them (masked IS).

    Returns:
        Detached weights with the shape of ``old_logp``; never above ``cap``; zero on masked-out tokens.
    """
    check_same_shape(old_logp=old_logp, rollout_logp=rollout_logp)
    check_finite("old_logp", old_logp)
    check_finite("rollout_logp", rollout_logp)
    if cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    m = torch.ones_like(old_logp) if mask is None else mask.to(old_logp.dtype)
    check_same_shape(old_logp=old_logp, mask=m)
    log_ratio = (old_logp - rollout_logp).detach()
    if mode == "sequence":
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(old_logp)
    elif mode != "token":
        raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")
    # clamp the exponent so exp never overflows; anything above log(cap) is capped or masked anyway
    ratio = torch.exp(log_ratio.clamp(max=math.log(cap) + 1.0))
    if policy == "truncate":
        weights = ratio.clamp(max=cap)
    elif policy == "mask":
        weights = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
    else:
        raise ValueError(f"policy must be 'truncate' or 'mask', got {policy!r}")
    return weights * m


def stale_sample_weights(
    current_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    lags: torch.Tensor,
    cap: float,
    mode: Literal["token", "sequence"] = "token",
    mask: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one off-policy correction of stale samples: weights for each sample's policy-gradient loss term.

    A sample generated ``lag > 0`` weight versions ago was drawn by an older policy ``pi_behaviour``; its loss
    term is multiplied by ``w = min(pi_current / pi_behaviour, C)`` (:func:`truncated_is_weights`, held
    constant). Samples with ``lag == 0`` come from the current weights and get ``fresh`` (an engine's TIS
    weights, when the rollout engine is not the trainer), else exactly 1 (0 on masked-out tokens).

    Args:
        current_logp, behaviour_logp: ``[N]`` per-sample (flow transitions) or ``[N, T]`` per-token log-probs.
        lags: ``[N]`` weight versions each sample lags behind the trainer.
        cap: ``C >= 1``.
        mode, mask: as :func:`truncated_is_weights` (``[N, T]`` inputs).
        fresh: weights of the lag-0 samples, shaped as ``current_logp``; ``None``: 1.

    Returns:
        Detached weights shaped as ``current_logp``.
    """
    check_same_shape(current_logp=current_logp, behaviour_logp=behaviour_logp)
    if lags.ndim != 1 or lags.shape[0] != current_logp.shape[0]:
        raise ValueError(f"lags must be [N] = [{current_logp.shape[0]}], got {tuple(lags.shape)}")
    weights = truncated_is_weights(current_logp, behaviour_logp, cap, mode=mode, mask=mask)
    if fresh is None:
        fresh = torch.ones_like(weights) if mask is None else mask.to(weights.dtype)
    stale = (lags > 0).to(weights.device).view(-1, *([1] * (weights.ndim - 1)))
    return torch.where(stale, weights, fresh)


def diffusion_nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_target: torch.Tensor,
    optimality: torch.Tensor,
    beta: float = 1.0,
    sigma: torch.Tensor | None = None,
) -> torch.Tensor:
    """DiffusionNFT negative-aware flow-matching loss, per sample (Zheng et al. 2509.16117 eq. 8).

    The implicit positive and negative policies are ``v+ = (1 - beta) v_old + beta v_theta`` and
    ``v- = (1 + beta) v_old - beta v_theta``; with ``r in [0, 1]`` the sample's optimality probability
    (normalised reward), ``L = r ||v+ - v*||^2 + (1 - r) ||v- - v*||^2`` where ``v* = eps - x0`` is the
    flow-matching target at the noised point. Likelihood-free: it trains on clean samples with any solver.

    Args:
        v_theta: ``[B, ...]`` current velocity prediction (carries the gradient).
        v_old: ``[B, ...]`` velocity of the sampling policy at the same point (no gradient).
        v_target: ``[B, ...]`` flow-matching target ``eps - x0``.
        optimality: ``[B]`` in [0, 1].
        beta: guidance strength of the implicit policies.
        sigma: ``[B]`` noise levels of the points. When given, each error is measured on the implied clean image,
            ``x0_hat - x0 = sigma (v* - v)``, and divided by its own detached mean absolute value (the adaptive
            weighting of DiffusionNFT's reference code): every point then pulls with comparable strength whatever
            its noise level, instead of the few large-error points dominating the batch.

    Returns:
        ``[B]`` losses (mean over non-batch dims).
    """
    check_same_shape(v_theta=v_theta, v_old=v_old, v_target=v_target)
    if optimality.shape != v_theta.shape[:1]:
        raise ValueError(f"optimality must have shape [{v_theta.shape[0]}], got {tuple(optimality.shape)}")
    v_old = v_old.detach()
    positive = (1.0 - beta) * v_old + beta * v_theta
    negative = (1.0 + beta) * v_old - beta * v_theta
    if sigma is None:
        pos_err = ((positive - v_target) ** 2).flatten(1).mean(1)
        neg_err = ((negative - v_target) ** 2).flatten(1).mean(1)
    else:
        pos_err, neg_err = (
            _adaptive_x0_error(positive - v_target, sigma),
            _adaptive_x0_error(negative - v_target, sigma),
        )
    r = optimality.to(pos_err.dtype)
    return r * pos_err + (1.0 - r) * neg_err


def _adaptive_x0_error(v_err: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``mean(e^2) / sg(mean|e|)`` per sample of the clean-image error ``e = sigma * v_err``."""
    x0_err = sigma.view(-1, *([1] * (v_err.ndim - 1))) * v_err
    scale = x0_err.detach().abs().flatten(1).mean(1).clamp(min=1e-5)
    return (x0_err**2).flatten(1).mean(1) / scale


def reward_weighted_fm_loss(
    v_theta: torch.Tensor, v_target: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Reward-weighted flow matching, per sample: ``w ||v_theta - v*||^2`` (mean over non-batch dims).

    With ``w = max(A, 0)`` this is advantage-weighted regression on the policy's own samples (RWR, Peters &
    Schaal 2007; for diffusion models RAFT, Dong et al. 2304.06767, when ``w`` is a 0/1 filter of the best
    samples). Unlike :func:`diffusion_nft_loss` it never pushes away from negatives, so it cannot diverge
    from the data it regresses on; it only sharpens the policy toward what the reward prefers.

    Args:
        v_theta: ``[B, ...]`` current velocity prediction.
        v_target: ``[B, ...]`` flow-matching target ``eps - x0`` at the noised point.
        weights: ``[B]`` non-negative sample weights.
    """
    check_same_shape(v_theta=v_theta, v_target=v_target)
    if weights.shape != v_theta.shape[:1]:
        raise ValueError(f"weights must have shape [{v_theta.shape[0]}], got {tuple(weights.shape)}")
    if bool((weights < 0).any()):
        raise ValueError("reward-weighted regression needs non-negative weights")
    return weights.to(v_theta.dtype) * ((v_theta - v_target) ** 2).flatten(1).mean(1)


AWMWeighting = Literal["uniform", "sigma", "sigma_squared", "huber", "ghuber"]


def awm_log_likelihood(
    v_theta: torch.Tensor,
    v_target: torch.Tensor,
    sigma: torch.Tensor,
    weighting: AWMWeighting = "ghuber",
    power: float = 0.25,
    delta: float = 1e-10,
) -> torch.Tensor:
    """Advantage Weighted Matching's log-likelihood surrogate of each regression point: its weighted flow-matching
    error, negated (Xue et al. 2509.25050; the weightings of its released code).

    With ``l = mean((v_theta - v*)^2)`` over the non-batch dims (``v* = eps - x0`` at ``x_s = (1 - s) x0 + s eps``)
    the surrogate is ``log p = -w(l, s)``::

        uniform        w = l
        sigma          w = s l
        sigma_squared  w = s^2 l
        huber          w = s (sqrt(l + delta) - sqrt(delta))
        ghuber         w = s ((l + delta)^p - delta^p) / p      (generalised Huber, p = ``power``)

    ``uniform`` is the pretraining loss itself. ``ghuber`` with ``p < 1`` shrinks the gradient of points with a
    large error by ``l^(p - 1)`` (a robust loss) and scales each point by its noise level ``s``; ``delta`` keeps
    that gradient finite at ``l = 0``. Every form is 0 at ``l = 0`` and increasing in ``l``.

    Args:
        v_theta: ``[N, ...]`` velocity prediction at the points (carries the gradient).
        v_target: ``[N, ...]`` flow-matching target ``eps - x0``.
        sigma: ``[N]`` noise level ``s`` of each point.
        weighting: one of the forms above.
        power: ``p`` of ``ghuber`` (> 0; 0.25 in the paper's recipes).
        delta: offset of ``huber`` / ``ghuber``.

    Returns:
        ``[N]`` log-likelihood surrogates (<= 0), float32 or wider.

    Raises:
        ValueError: shapes disagree, ``power <= 0`` or an unknown ``weighting``.
    """
    check_same_shape(v_theta=v_theta, v_target=v_target)
    if sigma.shape != v_theta.shape[:1]:
        raise ValueError(f"sigma must have shape [{v_theta.shape[0]}], got {tuple(sigma.shape)}")
    if power <= 0:
        raise ValueError(f"power must be > 0, got {power}")
    # float32 at least: under bfloat16 autocast the squared error of a good prediction would round to 0
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    err = ((v_theta.to(dtype) - v_target.to(dtype)) ** 2).flatten(1).mean(1)
    s = sigma.to(dtype)
    if weighting == "uniform":
        weighted = err
    elif weighting == "sigma":
        weighted = s * err
    elif weighting == "sigma_squared":
        weighted = s**2 * err
    elif weighting == "huber":
        weighted = s * (torch.sqrt(err + delta) - math.sqrt(delta))
    elif weighting == "ghuber":
        weighted = s * ((err + delta) ** power - delta**power) / power
    else:
        raise ValueError(
            f"weighting must be one of uniform, sigma, sigma_squared, huber, ghuber; got {weighting!r}"
        )
    return -weighted


def guidance_distillation_loss(v_theta: torch.Tensor, v_guided: torch.Tensor) -> torch.Tensor:
    """Guidance distillation, per sample: the squared distance of the (CFG-free) velocity to a teacher's guided one.

        v_w = v_uncond + w (v_cond - v_uncond)            (CFG, Ho & Salimans 2207.12598; a family whose pipeline
                                                           guides otherwise, as Qwen-Image's norm rescale, its own)
        L   = mean((v_theta - v_w)^2)                       over the non-batch dims

    With the teacher the frozen base and the points ``x_s`` noised from the policy's own samples, this teaches
    the CFG-free policy what guidance adds (guidance distillation, Meng et al. 2210.03142, eq. 5, without the
    ``w`` input: one fixed scale), on the states the policy visits; it needs no reward.

    Args:
        v_theta: ``[B, ...]`` the trained velocity (carries the gradient).
        v_guided: ``[B, ...]`` the teacher's guided velocity ``v_w`` at the same points (no gradient flows to it).

    Returns:
        ``[B]`` losses, float32 or wider.
    """
    check_same_shape(v_theta=v_theta, v_guided=v_guided)
    # float32 at least: under bfloat16 autocast small distances would round away
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    return ((v_theta.to(dtype) - v_guided.detach().to(dtype)) ** 2).flatten(1).mean(1)
