"""Reward-weighted flow matching (RWR, RAFT-style): pretraining's flow-matching loss on the final samples the
reward prefers to their group, each weighted by its advantage.

Notation: ``B`` final samples ``x0 [B, ...]`` with advantages ``A [B]``; only the ``B+`` samples with ``A > 0``
are kept, ``T = trainer.nft_timesteps`` points each (:meth:`~mmrl.flow.trainer.FlowGRPOTrainer.regression_points`):

    L = mean_ik A_i ||v_theta(x_s_ik, s_ik, c_i) - (eps_ik - x0_i)||^2                   over B+ * T points

(:func:`mmrl.core.losses.reward_weighted_fm_loss`). The number of points depends on the rewards, so an FSDP
launch, whose ranks must make the same forwards, refuses it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmrl.core import losses as loss_lib
from mmrl.flow.objectives.registry import register_objective

if TYPE_CHECKING:
    from mmrl.flow.batch import StepBatch
    from mmrl.flow.trainer import FlowGRPOTrainer

__all__ = ["rwr_update"]


@register_objective(
    "rwr",
    "advantage-weighted flow matching on the preferred samples (RAFT-style)",
    trains_on="final_samples",
    same_count_per_rank=False,
)
def rwr_update(trainer: FlowGRPOTrainer, batch: StepBatch) -> None:
    """One RWR update on the samples of ``batch.final_latents [B, ...]`` whose advantage is positive."""
    weights = batch.sample_adv.clamp(min=0)
    keep = torch.nonzero(weights > 0).flatten()
    if keep.numel() == 0:
        trainer.metrics.add("train/skipped_no_signal", 1.0)
        trainer.idle_update()
        return
    rows, sigma, x_t, target = trainer.regression_points(batch.final_latents[keep], batch.groups[keep])
    cond = batch.cond.select(keep).select(rows)
    point_weights = weights[keep][rows]

    def loss_fn(v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return loss_lib.reward_weighted_fm_loss(v, target[idx].to(v.device), point_weights[idx].to(v.device))

    trainer.regress(x_t, sigma, cond, loss_fn)
