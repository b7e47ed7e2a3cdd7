"""Flow-GRPO: the clipped-ratio loss on the SDE transitions of the rollouts, plus a KL on the SDE means to the
reference (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470, eq. 8-10).

Notation: ``N`` stored transitions ``x_t -> x_{t-1}`` with advantages ``A [N]``, the behaviour log-probs
``log p_old [N]`` they were sampled with, and importance weights ``w [N]`` (stale pooled samples, else 1).
Each minibatch re-scores its transitions under the current weights (:func:`pipelines.flow.rollout.rescore`):

    rho_n = exp(log p_n - log p_old_n)                                                   [N]
    L     = mean_n w_n max(-A_n rho_n, -A_n clip(rho_n, 1 - e_low, 1 + e_high))
            + beta mean_n ||mu_n - mu_ref_n||^2 / (2 s_n^2)

with ``mu`` the SDE step's mean, ``mu_ref`` the reference policy's (the LoRA switched off, or the frozen base
copy) and ``s`` per ``trainer.kl_form``: the transition std (``exact``: the Gaussian KL of the transition) or
the SDE noise scale sigma_t Flow-GRPO's code divides by (``flow_grpo``, ``std / sqrt|dt|``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmrl.core import losses as loss_lib
from mmrl.flow.objectives.registry import register_objective
from pipelines.flow.rollout import TransitionBatch, rescore
from pipelines.flow.sde import sde_noise_scale

if TYPE_CHECKING:
    from mmrl.flow.batch import StepBatch
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = ["grpo_update", "kl_scale"]


@register_objective(
    "grpo",
    "clipped ratio on the SDE transitions' log-probs + KL on the SDE means (Flow-GRPO)",
    trains_on="transitions",
)
def grpo_update(trainer: FlowGRPOTrainer, batch: StepBatch) -> None:
    """One Flow-GRPO update on ``batch.transitions`` with their advantages ``batch.adv [N]``; ``batch.weights
    [N]`` (stale samples' importance weights) multiply each transition's clipped-ratio term."""
    t = trainer.cfg.trainer
    trans, adv_t = batch.transitions, batch.adv
    weights = batch.weights if batch.weights is not None else torch.ones(len(trans))
    keep = torch.ones(len(trans), dtype=torch.bool)
    if t.drop_zero_advantage:
        keep &= adv_t != 0
    keep &= trainer.adapter.trains_at(
        trans.sigma
    ).cpu()  # steps of an expert not trained (Wan2.2): no gradient
    if not keep.any():
        trainer.metrics.add("train/skipped_no_signal", 1.0)
        trainer.idle_update(passes=t.ppo_epochs)
        return
    if not keep.all():
        rows = torch.nonzero(keep).flatten()
        trans, adv_t, weights = trans.select(rows), adv_t[rows], weights[rows]
    # The ratio's log-probs are the guided ones as sampled (train_cfg, or a family without a CFG pass), else
    # the CFG-free policy's, whose behaviour log-probs the sampling weights give again at guidance 1.
    as_sampled = trainer.trains_as_sampled(trans.guidance_scale)
    cfg_scale = None if as_sampled else 1.0
    nfe_each = trainer.adapter.nfe_per_sample(trans.guidance_scale if as_sampled else 1.0)
    if as_sampled:
        old_logp = trans.log_probs
    else:
        with trainer.sampling_weights():
            old_logp = trainer.transition_log_probs(trans, 1.0)
    trainer.adapter.transformer.train()
    for _ in range(t.ppo_epochs):
        for idx, scale in trainer.minibatches(len(trans)):
            mb = trans.select(idx)
            logp, mean, std = rescore(trainer.adapter, mb, cfg_scale)
            adv = adv_t[idx].to(logp.device)
            old = old_logp[idx].to(logp.device)
            per_sample = loss_lib.clipped_surrogate(logp, old, adv, t.epsilon_low, t.epsilon_high)
            loss = (per_sample * weights[idx].to(per_sample.device)).mean()
            trainer.nfe_total += len(mb) * nfe_each
            if t.beta > 0:
                with torch.no_grad(), trainer.reference_policy():
                    _, ref_mean, _ = rescore(trainer.adapter, mb, cfg_scale)
                kl = loss_lib.gaussian_mean_kl(mean, ref_mean, kl_scale(t.kl_form, mb, std))
                loss = loss + t.beta * kl.mean()
                trainer.metrics.add("policy/kl", kl.mean(), count=len(mb))
                trainer.nfe_total += len(mb) * nfe_each
            (loss * scale).backward()
            trainer.metrics.add("loss", loss, count=len(mb))
            trainer.metrics.add("policy/ratio_mean", torch.exp(logp - old).mean(), count=len(mb))
            trainer.metrics.add_dict(
                loss_lib.clip_fractions(logp, old, adv, t.epsilon_low, t.epsilon_high), count=len(mb)
            )


def kl_scale(kl_form: str, transitions: TransitionBatch, std: torch.Tensor) -> torch.Tensor:
    """The ``s`` of ``||mu - mu_ref||^2 / (2 s^2)`` for ``transitions`` whose step std is ``std [b, ...]``: the
    std itself (``kl_form: exact``) or the SDE noise scale ``sigma_t`` that Flow-GRPO's code divides by
    (``kl_form: flow_grpo``: ``std / sqrt|dt|`` for the Flow-GRPO SDE, the std itself for cps)."""
    if kl_form == "exact":
        return std
    shape = (-1, *([1] * (std.ndim - 1)))
    sigma = transitions.sigma.to(std.device).view(shape)
    sigma_next = transitions.sigma_next.to(std.device).view(shape)
    return sde_noise_scale(sigma, sigma_next, transitions.noise_level, transitions.sde_kind)
