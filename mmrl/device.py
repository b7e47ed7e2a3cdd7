"""Device and dtype names of the configs, resolved once for every recipe."""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "resolve_device"]

#: config dtype names -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (cuda when available, else cpu) or an explicit device; a CUDA device without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r} but no CUDA device is available; use 'cpu' or 'auto'")
    return device
