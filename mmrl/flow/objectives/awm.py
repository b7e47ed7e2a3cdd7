"""Advantage Weighted Matching (AWM): the flow-matching loss of pretraining, on the policy's own samples, weighted
by each sample's advantage (Xue et al., "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models", arXiv 2509.25050; timestep rule, weighting and defaults from its released SD3.5 recipes).

Notation: ``B`` final samples ``x0 [B, C, H, W]`` (or ``[B, C, F, H, W]`` for video) with advantages ``A [B]``;
``T`` regression points per sample (``trainer.awm.timesteps``), ``N = B * T`` points in all. Point ``(i, k)``
re-noises ``x0_i`` at the sigma ``s_k`` of a sampler step: ``x_s = (1 - s) x0 + s eps``, target ``v* = eps - x0``.

    l_ik     = mean((v_theta(x_s, s, c_i) - v*)^2)                          [N]  matching error
    log p_ik = -w(l_ik, s_k)                                                [N]  (ghuber: w = s l^p / p)
    rho_ik   = exp(log p_ik - log p_old_ik)                                 [N]
    A^_i     = clip(A_i, -A_max, A_max) * a_max / A_max                     [B]  (A_max = trainer.adv_clip_max)
    L        = mean_ik max(-A^_i rho_ik, -A^_i clip(rho_ik, 1 - e, 1 + e))
               + beta mean((v_theta - v_ref)^2) + beta_old mean((v_theta - v_old)^2)

On policy (one optimizer step per rollout batch, the sampling policy = the trained weights) ``rho = 1`` and the
gradient is ``sum_ik A^_i grad w(l_ik, s_k)`` / N: pretraining's loss with each sample weighted by its advantage,
so a better-than-its-group image is fitted more closely and a worse one pushed away, without an SDE, a
log-density, or the noisy per-step targets of DDPO-style objectives (the paper's variance argument).

Sampler steps (the paper's "discrete without init" rule, ``trainer.awm.time_type``; its PickScore configs use
``discrete``, which starts at step 0): the steps ``1 .. floor(f * n) - 1`` of the ``n``-step sampling schedule
(``f = timestep_fraction``) are cut into ``T`` equal strata and one step is drawn uniformly in each, so every
update covers the noise range evenly and never regresses on pure noise (step 0) or on the last, nearly clean
steps. The paper's code uses one draw for the whole batch; here each prompt group (with
``trainer.shared_regression_noise``, else each image) draws its own, sharing sigma and noise within the group so
the noise, common to the group, cancels in the advantage-weighted gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from mmrl.core import losses as loss_lib
from mmrl.flow.objectives.registry import register_objective

if TYPE_CHECKING:
    from mmrl.flow.batch import StepBatch
    from mmrl.flow.config import FlowGRPOConfig
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = ["TimeType", "awm_update", "check_awm_config", "stratified_steps"]


#: AWM's ``time_type``: where the strata of regressed sampler steps start (:func:`stratified_steps`)
TimeType = Literal["discrete_wo_init", "discrete", "discrete_with_init"]


def _step_range(time_type: TimeType, num_steps: int, fraction: float) -> tuple[int, int, int]:
    """``(first, last, init)`` of ``time_type``: strata over the steps ``first .. last - 1``, ``last = floor(fraction
    * num_steps)``, after ``init`` fixed step-0 points (1 for ``discrete_with_init``, else 0).

    Raises:
        ValueError: an unknown ``time_type``.
    """
    if time_type not in ("discrete_wo_init", "discrete", "discrete_with_init"):
        raise ValueError(f"unknown time_type {time_type!r}: discrete_wo_init, discrete or discrete_with_init")
    first = 0 if time_type == "discrete" else 1
    return first, int(fraction * num_steps), int(time_type == "discrete_with_init")


def stratified_steps(
    n_owners: int,
    num_timesteps: int,
    num_steps: int,
    fraction: float,
    generator: torch.Generator,
    time_type: TimeType = "discrete_wo_init",
) -> torch.Tensor:
    """``[T, n_owners]`` sampler step indices: for each owner one step drawn uniformly in each of equal strata of
    the steps ``first .. last - 1``, ``last = floor(fraction * num_steps)``, by AWM's ``time_type``:

    * ``discrete_wo_init`` (AWM's GenEval and OCR configs): ``T`` strata from ``first = 1``, never step 0;
    * ``discrete`` (its PickScore configs): ``T`` strata from ``first = 0``;
    * ``discrete_with_init``: step 0, then ``T - 1`` strata from ``first = 1``.

    Stratum ``k`` of ``S`` holds the steps ``e_k .. e_{k+1} - 1`` with ``e_k = floor(first + k (last - first) /
    S)``; the strata are disjoint and, when ``S <= last - first``, none is empty, so each owner's ``T`` steps are
    distinct and increasing in ``k``.

    Raises:
        ValueError: fewer steps in the range than strata, or an unknown ``time_type``.
    """
    first, last, init = _step_range(time_type, num_steps, fraction)
    strata = num_timesteps - init
    if strata > last - first:
        raise ValueError(
            f"{num_timesteps} timesteps ({time_type}) need {strata} sampler steps in {first} .. {last - 1} "
            f"(fraction {fraction} of {num_steps} steps)"
        )
    step_zero = torch.zeros(init, n_owners, dtype=torch.long)  # discrete_with_init's fixed point
    if strata == 0:
        return step_zero
    edges = torch.floor(first + torch.arange(strata + 1, dtype=torch.float64) * (last - first) / strata)
    edges = edges.long()
    width = (edges[1:] - edges[:-1]).unsqueeze(1)  # [S, 1], each >= 1
    offset = torch.floor(torch.rand(strata, n_owners, generator=generator, dtype=torch.float64) * width)
    return torch.cat([step_zero, edges[:-1].unsqueeze(1) + offset.long()])


def check_awm_config(cfg: FlowGRPOConfig) -> None:
    """Config-time form of :func:`stratified_steps`'s requirement: ``trainer.awm.timesteps`` distinct sampler
    steps must fit in the range ``trainer.awm.time_type`` draws from.

    Raises:
        ValueError: naming ``trainer.awm.timesteps`` and the steps available.
    """
    settings = cfg.trainer.awm
    num_steps = cfg.sampling.num_steps
    first, last, init = _step_range(settings.time_type, num_steps, settings.timestep_fraction)
    available = last - first + init
    if settings.timesteps > available:
        raise ValueError(
            f"trainer.awm.timesteps ({settings.timesteps}) exceeds the {max(available, 0)} sampler steps it draws "
            f"from (time_type {settings.time_type}: steps {first} .. floor(trainer.awm.timestep_fraction * "
            f"sampling.num_steps) - 1 with timestep_fraction={settings.timestep_fraction}, num_steps={num_steps}"
            f"{', and step 0' if init else ''}): lower timesteps or raise num_steps / timestep_fraction"
        )


@register_objective(
    "awm",
    "Advantage Weighted Matching: the flow-matching loss weighted by every sample's advantage (settings in "
    "trainer.awm)",
    trains_on="final_samples",
    check_config=check_awm_config,
)
def awm_update(trainer: FlowGRPOTrainer, batch: StepBatch) -> None:
    """One AWM update of ``trainer``'s weights on the final samples ``batch.final_latents [B, ...]`` with
    advantages ``batch.sample_adv [B]``, through the trainer's minibatched regression (the reference KL, the
    guidance distillation, gradient accumulation and optimizer steps are the trainer's)."""
    t = trainer.cfg.trainer
    adv = batch.sample_adv
    settings = t.awm
    num_steps = trainer.cfg.sampling.num_steps

    # 1. regression points: T stratified sampler steps per owner (prompt group or image), shared noise
    def draw(n_owners: int) -> torch.Tensor:
        return stratified_steps(
            n_owners,
            settings.timesteps,
            num_steps,
            settings.timestep_fraction,
            trainer.generator,
            settings.time_type,
        )

    rows, sigma, x_t, target = trainer.regression_points(
        batch.final_latents, batch.groups, settings.timesteps, draw
    )
    cond = batch.cond.select(rows)
    scaled_adv = adv.clamp(-t.adv_clip_max, t.adv_clip_max) * (settings.advantage_max / t.adv_clip_max)
    point_adv = scaled_adv[rows].float()  # [N]

    # 2. the sampling policy at the points, where it differs from the weights about to be trained
    v_old = old_logp = None
    if trainer.old_policy is not None or t.gradient_accumulation > 0 or t.updates_per_step > 1:
        v_old = trainer.sampling_velocities(x_t, sigma, cond).float()
        old_logp = loss_lib.awm_log_likelihood(
            v_old, target, sigma, settings.weighting, settings.ghuber_power
        )

    # 3. clipped ratio of the weighted matching log-likelihoods (+ the pull toward the sampling policy)
    def loss_fn(v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        logp = loss_lib.awm_log_likelihood(
            v,
            target[idx].to(v.device),
            sigma[idx].to(v.device),
            settings.weighting,
            settings.ghuber_power,
        )
        # on policy the ratio is exactly 1 and only its gradient, grad log p, matters
        old = logp.detach() if old_logp is None else old_logp[idx].to(v.device)
        a = point_adv[idx].to(v.device)
        loss = loss_lib.clipped_surrogate(logp, old, a, settings.clip_range)
        n = len(idx)
        trainer.metrics.add("awm/log_p", logp.detach().mean(), count=n)
        trainer.metrics.add("policy/ratio_mean", torch.exp(logp - old).detach().mean(), count=n)
        trainer.metrics.add_dict(loss_lib.clip_fractions(logp, old, a, settings.clip_range), count=n)
        if v_old is not None and settings.old_kl_beta > 0:
            kl_old = ((v.float() - v_old[idx].to(v.device)) ** 2).flatten(1).mean(1)
            loss = loss + settings.old_kl_beta * kl_old
            trainer.metrics.add("policy/kl_old", kl_old.detach().mean(), count=n)
        return loss

    trainer.regress(x_t, sigma, cond, loss_fn)
