"""Flow-model adapters by family name: ``get_adapter("sd3")``, ``load_adapter("flux", "black-forest-labs/FLUX.1-dev")``."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.flux import FluxAdapter
from pipelines.flow.adapters.sana import SanaAdapter
from pipelines.flow.adapters.sd3 import SD3Adapter
from pipelines.flow.adapters.shapes import ShapesAdapter
from pipelines.flow.adapters.wan import WanAdapter
from pipelines.hub import model_not_found

_ADAPTERS: dict[str, type[FlowAdapter]] = {
    cls.family: cls for cls in (SD3Adapter, FluxAdapter, SanaAdapter, WanAdapter, ShapesAdapter)
}


def list_adapters() -> list[str]:
    """Names of every adapter family, sorted."""
    return sorted(_ADAPTERS)


def get_adapter(family: str) -> type[FlowAdapter]:
    """The adapter class of ``family``.

    Raises:
        KeyError: unknown family, listing the available ones.
    """
    if family not in _ADAPTERS:
        raise KeyError(f"unknown flow adapter {family!r}. Available: {list_adapters()}")
    return _ADAPTERS[family]


def load_adapter(
    family: str,
    model_id_or_path: str,
    torch_dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quantization_config: object | None = None,
    **kwargs,
) -> FlowAdapter:
    """``get_adapter(family).from_pretrained(model_id_or_path, ...)``.

    Raises:
        OSError: ``model_id_or_path`` is neither a local folder nor a Hub repository that can be reached; the
            message names both places looked at (a relative path is relative to the working directory).
    """
    cls = get_adapter(family)
    try:
        return cls.from_pretrained(
            model_id_or_path,
            torch_dtype=torch_dtype,
            device=device,
            quantization_config=quantization_config,
            **kwargs,
        )
    except OSError as error:
        if Path(model_id_or_path).exists():
            raise
        raise model_not_found(f"{family!r} model", model_id_or_path, error) from error


__all__ = [
    "Conditioning",
    "FlowAdapter",
    "FluxAdapter",
    "SD3Adapter",
    "SanaAdapter",
    "ShapesAdapter",
    "WanAdapter",
    "flow_match_sigmas",
    "get_adapter",
    "list_adapters",
    "load_adapter",
]
