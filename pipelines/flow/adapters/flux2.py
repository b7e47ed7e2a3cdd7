"""FLUX.2 [dev] adapter (``Flux2Pipeline``: Mistral-3 text encoder, guidance-distilled ``Flux2Transformer2DModel``).

Real checkpoint: ``black-forest-labs/FLUX.2-dev`` (32B). Everything but the text and the guidance is FLUX.2
[klein]'s (see :mod:`pipelines.flow.adapters.flux2_klein`): the caption is the hidden states of layers 10, 20 and 30
of ``Mistral3ForConditionalGeneration`` on the prompt in the pipeline's chat format (with its system message),
padded to ``max_sequence_length``; the guidance scale is an input of the transformer (one forward per step, no CFG
pass), as ``Flux2Pipeline(guidance_scale=...)`` passes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import Flux2Pipeline

from pipelines.flow.adapters.flux2_klein import Flux2KleinAdapter
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("flux2")
class Flux2Adapter(Flux2KleinAdapter):
    """FLUX.2 [dev] through diffusers' ``Flux2Pipeline``.

    Args:
        pipe: a loaded ``Flux2Pipeline``.
        max_sequence_length: text tokens per prompt (system message included); the pipeline's default is 512.
        text_encoder_out_layers: the Mistral-3 hidden states read as the caption (the pipeline's 10, 20, 30).
    """

    pipeline_class = Flux2Pipeline

    def __init__(
        self,
        pipe: Flux2Pipeline,
        max_sequence_length: int = 512,
        text_encoder_out_layers: Sequence[int] = (10, 20, 30),
    ) -> None:
        super().__init__(pipe, max_sequence_length, text_encoder_out_layers)

    def uses_cfg(self, guidance_scale: float) -> bool:
        # guidance-distilled: the scale is embedded in the forward, never a second (uncond) pass
        return False

    def _guidance_input(self, batch: int, guidance_scale: float, device: torch.device) -> torch.Tensor | None:
        return torch.full((batch,), guidance_scale, device=device, dtype=torch.float32)
