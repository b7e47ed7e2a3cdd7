"""Input validation shared by the core's public functions.

The core is called with tensors produced by rollouts and reward models; a NaN reward or a misaligned group id
would otherwise flow silently into the loss. Each check raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch


def check_finite(name: str, x: torch.Tensor) -> None:
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"{name} contains NaN or inf (first at index {bad}); fix the reward/log-prob source")


def check_1d(name: str, x: torch.Tensor) -> None:
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty")


def check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def check_probabilities(name: str, p: torch.Tensor) -> None:
    check_finite(name, p)
    if bool(((p < 0) | (p > 1)).any()):
        raise ValueError(f"{name} must lie in [0, 1]; got min {p.min().item()}, max {p.max().item()}")
