"""Device and dtype names of the configs, resolved once for every recipe."""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import AfterValidator

__all__ = ["DTYPES", "DeviceName", "resolve_device"]

#: config dtype names -> torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _device_name(name: str) -> str:
    """A name ``torch.device`` reads, or ``auto``: checked when the config loads, not when the model does."""
    if name != "auto":
        try:
            torch.device(name)
        except RuntimeError:
            raise ValueError(f"{name!r} is not a device: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    return name


#: a config's device field: ``auto`` or a name ``torch.device`` reads
DeviceName = Annotated[str, AfterValidator(_device_name)]


def resolve_device(name: str) -> torch.device:
    """``"auto"`` (cuda when available, else cpu) or an explicit device; a CUDA device without CUDA is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name!r} but no CUDA device is available; use 'cpu' or 'auto'")
    return device
