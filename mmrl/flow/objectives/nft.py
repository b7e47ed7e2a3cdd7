"""DiffusionNFT: negative-aware fine-tuning on the final samples (Zheng et al., "DiffusionNFT: Online Diffusion
Reinforcement with Forward Process", arXiv 2509.16117).

Notation: ``B`` final samples ``x0 [B, ...]`` with advantages ``A [B]``, ``T = trainer.nft_timesteps`` points
per sample drawn from the sampler's sigmas (:meth:`~mmrl.flow.trainer.FlowGRPOTrainer.regression_points`),
``x_s = (1 - s) x0 + s eps``, target ``v* = eps - x0``; ``v_old`` is the sampling ("old") policy's velocity at the
same points:

    r    = clip(0.5 + 0.5 A / A_max, 0, 1)                                   [B]   optimality probability
    v+   = (1 - beta) v_old + beta v_theta,   v- = (1 + beta) v_old - beta v_theta    implicit policies
    L    = mean_ik r_i ||v+ - v*||^2 + (1 - r_i) ||v- - v*||^2

(:func:`mmrl.core.losses.diffusion_nft_loss`, eq. 8; with ``trainer.nft_adaptive_weight`` each error is measured
on the implied clean image and divided by its detached mean, as the paper's reference code does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmrl.core import losses as loss_lib
from mmrl.flow.objectives.registry import register_objective

if TYPE_CHECKING:
    from mmrl.flow.batch import StepBatch
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = ["nft_update"]


@register_objective(
    "nft", "DiffusionNFT's negative-aware flow matching on the final samples", trains_on="final_samples"
)
def nft_update(trainer: FlowGRPOTrainer, batch: StepBatch) -> None:
    """One DiffusionNFT update on ``batch.final_latents [B, ...]`` with advantages ``batch.sample_adv [B]``."""
    t = trainer.cfg.trainer
    optimality = (0.5 + 0.5 * batch.sample_adv / t.adv_clip_max).clamp(0, 1)
    rows, sigma, x_t, target = trainer.regression_points(batch.final_latents, batch.groups)
    cond = batch.cond.select(rows)
    v_old = trainer.sampling_velocities(x_t, sigma, cond)

    def loss_fn(v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return loss_lib.diffusion_nft_loss(
            v,
            v_old[idx].to(v.device),
            target[idx].to(v.device),
            optimality[rows[idx]].to(v.device),
            t.nft_beta,
            sigma=sigma[idx].to(v.device) if t.nft_adaptive_weight else None,
        )

    trainer.regress(x_t, sigma, cond, loss_fn)
