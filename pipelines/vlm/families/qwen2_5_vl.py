"""Qwen2.5-VL (and Qwen2-VL): the first registered VLM family, and the tiny shapes VLM's.

- Prompt: one user turn, the images where the question's ``<image>`` placeholders put them, else first and
  then the question (the Qwen-VL chat convention).
- Vision special tokens: ``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
  ``<|video_pad|>``. A sampled ``<|image_pad|>`` breaks the re-scoring forward (the model expects image features
  for every image token), and a sampled ``<|vision_start|>`` opens a region nothing fills, so generation must
  never emit any of them.
- Token types: ``mm_token_type_ids`` (0 text, 1 image token, 2 video token), which the model needs to compute its
  multimodal (3-D) rotary positions; without it transformers silently falls back to 1-D positions and log-probs
  differ from generation's by ~0.1.
- Image features: ``pixel_values`` and ``image_grid_thw`` from the image processor; an image fills
  ``prod(grid_thw) / merge_size^2`` image tokens.
- Vision tower: ``backbone.visual``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from pipelines.vlm.families import VLMFamily, register_vlm_family

__all__ = ["QWEN_VISION_SPECIAL_TOKENS", "Qwen25VL", "mm_token_type_ids"]

QWEN_VISION_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)


def mm_token_type_ids(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int | None
) -> torch.Tensor:
    """Token types as the Qwen-VL processors write them: 0 text, 1 image token, 2 video token.

    Args:
        input_ids: ``[B, L]`` token ids.
        image_token_id: id of ``<|image_pad|>``.
        video_token_id: id of ``<|video_pad|>``, or ``None`` if the model has none.

    Returns:
        ``[B, L]`` int64 tensor.
    """
    types = (input_ids == image_token_id).long()
    if video_token_id is not None:
        types = types + 2 * (input_ids == video_token_id).long()
    return types


@register_vlm_family("qwen2_5_vl")
class Qwen25VL(VLMFamily):
    """Qwen2.5-VL / Qwen2-VL conventions (see the module docstring)."""

    model_types = ("qwen2_5_vl", "qwen2_vl")
    vision_special_tokens = QWEN_VISION_SPECIAL_TOKENS
    vision_module = "visual"
    # attention, SwiGLU MLP, and the patch merger's two layers (visual.merger.mlp.0 / .2)
    vision_lora_targets = ("qkv", "proj", "gate_proj", "up_proj", "down_proj", "mlp.0", "mlp.2")
    token_type_key = "mm_token_type_ids"

    def image_token_id(self, processor: Any) -> int:
        return processor.image_token_id

    def token_type_ids(self, input_ids: torch.Tensor, processor: Any) -> torch.Tensor:
        return mm_token_type_ids(
            input_ids, processor.image_token_id, getattr(processor, "video_token_id", None)
        )

    def image_inputs(
        self, processor: Any, images: Sequence[Image.Image]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        vision = processor.image_processor(images=list(images), return_tensors="pt")
        tokens = (vision["image_grid_thw"].prod(-1) // processor.image_processor.merge_size**2).tolist()
        return {"pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"]}, tokens

    def position_ids(self, backbone: torch.nn.Module, model_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The 3-D rotary positions ``[3, B, L]`` (``get_rope_index``: image tokens on their grid, text after)."""
        positions, _ = backbone.get_rope_index(
            model_inputs["input_ids"],
            model_inputs["mm_token_type_ids"],
            image_grid_thw=model_inputs.get("image_grid_thw"),
            attention_mask=model_inputs["attention_mask"],
        )
        return positions
