"""The tiny shapes-world text-to-image model: the SD3 adapter with the tiny model's defaults.

The model (built by :func:`pipelines.flow.tiny.build_shapes_pipeline`, trained by
``mmrl train configs/pretrain/shapes_flow.yaml``) is a real ``StableDiffusion3Pipeline`` directory: a tiny
``SD3Transformer2DModel``, two tiny ``CLIPTextModelWithProjection`` encoders with a tokenizer trained on the shapes
prompt vocabulary, no T5 and no VAE. Without a VAE it is a pixel-space model (latents are 32x32 RGB images in
[-1, 1]): at 32x32 a learned VAE would cost part of the 15-minute CPU budget and add reconstruction errors that
the shapes verifier would judge, while 3x32x32 pixels are already as small as a 4x8x8 latent grid is useful.
Loading goes through ``StableDiffusion3Pipeline.from_pretrained``, exactly as for SD3.5.
"""

from __future__ import annotations

from diffusers import StableDiffusion3Pipeline

from pipelines.flow.adapters.registry import register_flow_family
from pipelines.flow.adapters.sd3 import SD3Adapter

#: default sampling settings of the shapes model (the pretraining card's evaluation uses these)
SHAPES_RESOLUTION = 32
SHAPES_NUM_STEPS = 10
SHAPES_GUIDANCE_SCALE = 3.0


@register_flow_family("shapes")
class ShapesAdapter(SD3Adapter):
    """SD3 adapter for the pixel-space shapes model; no T5 tokens (``max_sequence_length=0``)."""

    def __init__(self, pipe: StableDiffusion3Pipeline, max_sequence_length: int = 0) -> None:
        super().__init__(pipe, max_sequence_length)
