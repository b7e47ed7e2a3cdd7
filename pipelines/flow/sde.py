"""One denoising step of a flow-matching model, deterministic (ODE) or stochastic (SDE) with its log-prob.

Notation (rectified flow, as in SD3/FLUX/SANA/Wan): ``x_s = (1 - s) x0 + s eps`` with ``s`` the sigma in
[0, 1] (1 = pure noise), the model predicts the velocity ``v = eps - x0``, and one step goes from ``s`` to
``s' < s`` with ``d = s' - s < 0``. From ``x`` and ``v``:

    x0_hat = x - s v            (predicted clean sample)
    x1_hat = x + (1 - s) v      (predicted noise)

Every function here is stateless: ``sigma``, ``sigma_next`` and the noise are explicit arguments, so a trainer can
re-score a stored transition at any step (diffusers' schedulers keep a hidden step index instead). All math is in
float32 whatever the input dtype: log-prob differences of bf16 means would be dominated by rounding.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

SDEKind = Literal["flow_grpo", "dance", "cps"]
SDE_KINDS: tuple[SDEKind, ...] = ("flow_grpo", "dance", "cps")

LogProbForm = Literal["gaussian", "squared_error"]
LOG_PROB_FORMS: tuple[LogProbForm, ...] = ("gaussian", "squared_error")

# The log-prob each SDE kind uses in the code of the paper it is named after, so that a published clip range
# carries over: Flow-GRPO's and DanceGRPO's SDE steps score the full Gaussian density; Flow-GRPO's CPS step drops
# the constants and the 1 / (2 std^2) factor (its log-ratios are 2 std^2 times the Gaussian ones).
PEER_LOG_PROB_FORM: dict[SDEKind, LogProbForm] = {
    "flow_grpo": "gaussian",
    "dance": "gaussian",
    "cps": "squared_error",
}

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or ``[B]`` sigma as a float32 tensor of shape ``[B, 1, ..., 1]`` broadcastable against ``like``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(
            f"sigma must be a scalar or a [B] tensor with B={like.shape[0]}, got shape {tuple(t.shape)}"
        )
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def ode_step(
    x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> torch.Tensor:
    """Euler step of the probability-flow ODE: ``x' = x + v * (s' - s)``.

    Equals ``FlowMatchEulerDiscreteScheduler.step`` for the same sigmas (diffusers also steps in float32).

    Args:
        x: ``[B, ...]`` current latents at ``sigma``.
        v: ``[B, ...]`` predicted velocity.
        sigma, sigma_next: scalars or ``[B]`` tensors.

    Returns:
        ``[B, ...]`` float32 latents at ``sigma_next``.
    """
    x32 = x.float()
    s = _per_sample(sigma, x32)
    s_next = _per_sample(sigma_next, x32)
    return x32 + v.float() * (s_next - s)


def check_noise_level(noise_level: float, kind: SDEKind) -> None:
    """The noise levels an SDE kind takes: ``a >= 0``, and for cps ``a <= 1`` (Flow-GRPO's range): its std
    ``s' sin(a pi / 2)`` rises to ``s'`` at ``a = 1``, falls back to 0 at ``a = 2`` and below 0 after it.

    Raises:
        ValueError: a level outside that range.
    """
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if kind == "cps" and noise_level > 1:
        raise ValueError(
            f"sde_kind cps needs noise_level in [0, 1] (its std is s' sin(a pi / 2)), got {noise_level}"
        )


def sde_noise_scale(
    sigma: torch.Tensor, sigma_next: torch.Tensor, noise_level: float, kind: SDEKind
) -> torch.Tensor:
    """The SDE's noise scale ``sigma_t`` at one step, as the paper of each kind defines it (float32).

        flow_grpo:  sigma_t = a * sqrt(s / (1 - s))   (at s = 1: s' in the denominator)
        dance:      sigma_t = eta
        cps:        sigma_t = s' * sin(a * pi / 2)    (CPS's sigma_t is the transition std itself)

    The transition std is ``sigma_t * sqrt(-d)`` for flow_grpo and dance, ``sigma_t`` for cps. Flow-GRPO's KL
    on SDE means divides by ``2 sigma_t^2`` (see ``mmrl.core.losses.gaussian_mean_kl``). The cps ``a`` lies in
    ``[0, 1]`` (:func:`check_noise_level`).

    Args:
        sigma, sigma_next: float32 tensors broadcastable against each other (``[B, 1, ..., 1]`` or ``[B]``).

    Raises:
        ValueError: unknown ``kind``, or a cps ``noise_level`` outside ``[0, 1]``.
    """
    if kind == "cps":
        check_noise_level(noise_level, kind)
        return sigma_next * math.sin(noise_level * math.pi / 2)
    if kind == "flow_grpo":
        # At s = 1, s / (1 - s) is infinite; Flow-GRPO evaluates the ratio with the next sigma there.
        denom = 1 - torch.where(sigma >= 1, sigma_next, sigma)
        return noise_level * torch.sqrt(sigma / denom)
    if kind == "dance":
        return torch.full_like(sigma, float(noise_level))
    raise ValueError(f"unknown SDE kind {kind!r}. Available: {list(SDE_KINDS)}")


def sde_mean_std(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    kind: SDEKind = "flow_grpo",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``[B, ...]`` and std ``[B, 1, ..., 1]`` of the Gaussian transition ``p(x' | x)`` of one SDE step.

    ``flow_grpo`` (Flow-GRPO, arXiv 2505.05470, its ODE-to-SDE conversion), with ``a = noise_level``:

        sigma_t = a * sqrt(s / (1 - s))          (at s = 1 the denominator uses s' instead, as the paper's code)
        mean    = x + [v + sigma_t^2 / (2 s) * (x + (1 - s) v)] * d
        std     = sigma_t * sqrt(-d)

    ``dance`` (DanceGRPO, arXiv 2505.07818, the ``flux_step`` SDE solver) uses a constant ``eta = noise_level``:
    the score ``-(x - (1 - s) x0_hat) / s^2 = -(x + (1 - s) v) / s`` enters the drift with ``eta^2 / 2``, so

        mean = x + [v + eta^2 / (2 s) * (x + (1 - s) v)] * d
        std  = eta * sqrt(-d)

    ``cps`` (Coefficients-Preserving Sampling, Flow-CPS, arXiv 2509.05952), DDIM-like: the noise added
    plus the deterministic noise part keep the coefficient of the noise at exactly ``s'``:

        std  = s' * sin(a * pi / 2)
        mean = (1 - s') x0_hat + sqrt(s'^2 - std^2) * x1_hat

    With ``noise_level = 0`` all three reduce to the Euler ODE step ``x + v d`` with std 0. CPS has std 0 at
    ``s' = 0`` (the last step is deterministic).

    Raises:
        ValueError: unknown ``kind``, negative ``noise_level``, or a cps ``noise_level`` above 1.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}. Available: {list(SDE_KINDS)}")
    check_noise_level(noise_level, kind)
    x32, v32 = x.float(), v.float()
    s = _per_sample(sigma, x32)
    s_next = _per_sample(sigma_next, x32)
    d = s_next - s  # < 0
    std_dev_t = sde_noise_scale(s, s_next, noise_level, kind)
    if kind == "cps":
        std = std_dev_t
        x0_hat = x32 - s * v32
        x1_hat = x32 + (1 - s) * v32
        # clamp: s'^2 - std^2 >= 0 analytically (sin <= 1); rounding could make it -1e-9 and sqrt NaN.
        mean = (1 - s_next) * x0_hat + torch.sqrt((s_next**2 - std**2).clamp_min(0.0)) * x1_hat
        return mean, std
    mean = x32 + (v32 + std_dev_t**2 / (2 * s) * (x32 + (1 - s) * v32)) * d
    std = std_dev_t * torch.sqrt(-d)
    return mean, std


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample log-density of ``N(mean, std^2 I)``, **averaged** over all non-batch dimensions.

        log p = mean_dims[ -(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi) ]

    The mean (not the sum) keeps per-step ratios near 1 (Flow-GRPO's convention, hence clip ranges ~1e-4).
    Where ``std == 0`` the transition is deterministic and the density is undefined; those samples get
    log-prob 0 (a point mass carries no policy gradient; rollouts never train on such steps).

    Returns:
        ``[B]`` float32.
    """
    sample32, mean32 = sample.float(), mean.float()
    std32 = std.float().expand_as(mean32)
    zero = std32 == 0
    safe_std = torch.where(zero, torch.ones_like(std32), std32)
    lp = -((sample32 - mean32) ** 2) / (2 * safe_std**2) - torch.log(safe_std) - _LOG_SQRT_2PI
    lp = torch.where(zero, torch.zeros_like(lp), lp)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def squared_error_log_prob(sample: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Flow-GRPO's CPS log-prob: ``-mean_dims (x' - mean)^2``, the Gaussian log-density without its constants
    and without the ``1 / (2 std^2)`` factor. Its log-ratios are ``2 std^2`` times the Gaussian ones, so a clip
    range published for CPS (Flow-GRPO's code) applies to this form, not to :func:`gaussian_log_prob`.

    Returns:
        ``[B]`` float32.
    """
    lp = -((sample.float() - mean.float()) ** 2)
    return lp.mean(dim=tuple(range(1, lp.ndim)))


def transition_log_prob(
    sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, form: LogProbForm
) -> torch.Tensor:
    """``[B]`` log-prob of ``x'`` in the given form: ``"gaussian"`` (:func:`gaussian_log_prob`) or
    ``"squared_error"`` (:func:`squared_error_log_prob`; a point mass, ``std == 0``, still scores 0)."""
    if form == "gaussian":
        return gaussian_log_prob(sample, mean, std)
    if form == "squared_error":
        deterministic = (std.float().expand_as(mean) == 0).flatten(1).all(1)  # [B]
        return torch.where(
            deterministic, torch.zeros((), device=mean.device), squared_error_log_prob(sample, mean)
        )
    raise ValueError(f"unknown log-prob form {form!r}. Available: {list(LOG_PROB_FORMS)}")


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    kind: SDEKind = "flow_grpo",
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: torch.Tensor | None = None,
    log_prob_form: LogProbForm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One stochastic step ``x -> x'`` with the log-prob of ``x'``: ``x' = mean + std * noise``.

    See :func:`sde_mean_std` for the three kinds and their formulas, :func:`transition_log_prob` for the
    log-prob forms.

    Args:
        x: ``[B, ...]`` latents at ``sigma`` (any float dtype; the step is computed in float32).
        v: ``[B, ...]`` velocity predicted at ``(x, sigma)`` (after CFG, if any).
        sigma, sigma_next: scalars or ``[B]`` tensors, ``sigma_next < sigma``.
        noise_level: ``a`` of Flow-GRPO (paper: 0.7), ``eta`` of DanceGRPO (paper: 0.3), or CPS's ``a`` in
            ``[0, 1]``.
        kind: ``"flow_grpo"``, ``"dance"`` or ``"cps"``.
        noise: ``[B, ...]`` standard normal draw; drawn with ``generator`` when ``None``.
        generator: RNG for the draw when ``noise`` is ``None``.
        prev_sample: ``[B, ...]`` an already taken ``x'``; when given, nothing is drawn and its log-prob is
            returned (re-scoring under the current weights).
        log_prob_form: ``"gaussian"`` or ``"squared_error"``; ``None`` takes the form of the code of the paper
            the kind is named after (:data:`PEER_LOG_PROB_FORM`: squared error for cps, Gaussian otherwise), so
            its published clip range carries over.

    Returns:
        ``(prev_sample [B, ...], log_prob [B], mean [B, ...], std [B, 1, ..., 1])``, all float32.

    Raises:
        ValueError: unknown ``kind``, negative ``noise_level`` (above 1 for cps), or ``noise`` / ``prev_sample`` of
            the wrong shape.
    """
    mean, std = sde_mean_std(x, v, sigma, sigma_next, noise_level, kind)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
        elif noise.shape != mean.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(mean.shape)}")
        prev_sample = mean + std * noise.float()
    elif prev_sample.shape != mean.shape:
        raise ValueError(f"prev_sample has shape {tuple(prev_sample.shape)}, expected {tuple(mean.shape)}")
    prev_sample = prev_sample.float()
    # detach: the log-prob is a function of the policy's mean only; the action itself is data.
    form = PEER_LOG_PROB_FORM[kind] if log_prob_form is None else log_prob_form
    log_prob = transition_log_prob(prev_sample.detach(), mean, std, form)
    return prev_sample, log_prob, mean, std
