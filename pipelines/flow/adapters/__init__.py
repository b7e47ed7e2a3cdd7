"""Flow-model adapters by family name: ``get_adapter("sd3")``, ``load_adapter("flux", "black-forest-labs/FLUX.1-dev")``.

Families register themselves with :func:`register_flow_family` (``pipelines/flow/adapters/registry.py``).
"""

from __future__ import annotations

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas, stack_padded
from pipelines.flow.adapters.flux import FluxAdapter
from pipelines.flow.adapters.flux2 import Flux2Adapter
from pipelines.flow.adapters.flux2_klein import Flux2KleinAdapter
from pipelines.flow.adapters.qwen_image import QwenImageAdapter
from pipelines.flow.adapters.registry import get_adapter, list_adapters, load_adapter, register_flow_family
from pipelines.flow.adapters.sana import SanaAdapter
from pipelines.flow.adapters.sd3 import SD3Adapter
from pipelines.flow.adapters.shapes import ShapesAdapter
from pipelines.flow.adapters.wan import WanAdapter
from pipelines.flow.adapters.wan22 import Wan22Adapter
from pipelines.flow.adapters.z_image import ZImageAdapter

__all__ = [
    "Conditioning",
    "FlowAdapter",
    "Flux2Adapter",
    "Flux2KleinAdapter",
    "FluxAdapter",
    "QwenImageAdapter",
    "SD3Adapter",
    "SanaAdapter",
    "ShapesAdapter",
    "Wan22Adapter",
    "WanAdapter",
    "ZImageAdapter",
    "flow_match_sigmas",
    "get_adapter",
    "list_adapters",
    "load_adapter",
    "register_flow_family",
    "stack_padded",
]
