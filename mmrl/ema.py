"""Exponential moving average of trainable parameters, swapped in for evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from mmrl.distributed import full_tensor, shard_like

__all__ = ["EMA", "shadow_dtype"]


def shadow_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an average of ``dtype`` parameters is kept in: at least float32. A bfloat16 average cannot follow a
    parameter that moves by less than ``2^-9 |ema| / (1 - decay)`` (each step's ``(1 - decay) (param - ema)``
    rounds away): at decay 0.99 that is 20% of the weight, so in pure bfloat16 training the average stays where
    it started."""
    return torch.promote_types(dtype, torch.float32)


class EMA:
    """``ema <- decay * ema + (1 - decay) * param`` over the trainable parameters of ``module``, kept in
    :func:`shadow_dtype` (float32 for bfloat16 parameters).

    ``with ema.swapped(): evaluate()`` runs with the averaged weights and restores the live ones afterwards.
    """

    def __init__(self, module: nn.Module, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().to(shadow_dtype(p.dtype), copy=True) for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, num_updates: int | None = None, decay: float | None = None) -> None:
        """One averaging step. With ``num_updates`` (updates done before this one) the decay is
        ``min(decay, (1 + n) / (10 + n))``, TensorFlow's warm-up, so that the first averages forget the random
        initialisation quickly. ``decay`` in [0, 1) replaces the configured one for this step (a schedule; 0
        copies the weights)."""
        decay = self.decay if decay is None else decay
        if not 0 <= decay < 1:
            raise ValueError(f"EMA decay must be in [0, 1) for an update, got {decay}")
        if num_updates is not None:
            decay = min(decay, (1 + num_updates) / (10 + num_updates))
        for name, p in self.params.items():
            self.shadow[name].lerp_(p.detach().to(self.shadow[name].dtype), 1.0 - decay)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        live = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(live[n])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors (gathered from the shards of an FSDP-sharded module: a collective)."""
        return {n: full_tensor(t).clone() for n, t in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for n in self.shadow:
            self.shadow[n].copy_(shard_like(state[n], self.shadow[n]))
