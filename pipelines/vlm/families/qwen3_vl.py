"""Qwen3-VL (``Qwen3VLForConditionalGeneration``, and the mixture-of-experts ``Qwen3VLMoeForConditionalGeneration``
of Qwen3-VL-30B-A3B / 235B-A22B): Qwen2.5-VL's conventions on a new vision tower.

What the family interface sees is unchanged from Qwen2.5-VL, so this class inherits it:

- Prompt: one user turn, the images where the question's ``<image>`` placeholders put them, else first.
- Vision special tokens: ``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``,
  ``<|video_pad|>`` (the same ids as Qwen2.5-VL's), never generated.
- Token types: ``mm_token_type_ids`` (0 text, 1 image, 2 video). Qwen3-VL needs them even more than Qwen2.5-VL:
  without them transformers warns and falls back to 1-D positions, and the interleaved 3-D rotary positions of
  generation are lost.
- Image features: ``pixel_values`` and ``image_grid_thw``; an image fills ``prod(grid_thw) / merge_size^2``
  tokens, with 16-pixel patches (Qwen2.5-VL: 14).
- Vision tower: ``backbone.visual`` (its DeepStack mergers live inside it, so they are frozen or trained with it;
  its linear layers are ``qkv``, ``proj``, ``linear_fc1`` and ``linear_fc2``, not the language model's names).

What differs lives inside the model (DeepStack features added to the first decoder layers, interleaved mRoPE,
timestamped video prompts; in the MoE models, routed experts), which transformers implements; scoring calls the
same backbone as ``generate``.
"""

from __future__ import annotations

from pipelines.vlm.families import register_vlm_family
from pipelines.vlm.families.qwen2_5_vl import Qwen25VL

__all__ = ["Qwen3VL"]


@register_vlm_family("qwen3_vl")
class Qwen3VL(Qwen25VL):
    """Qwen3-VL conventions (see the module docstring)."""

    model_types = ("qwen3_vl", "qwen3_vl_moe")
    # attention and MLP of the tower, its mergers' two layers (linear_fc1 / linear_fc2 in both)
    vision_lora_targets = ("qkv", "proj", "linear_fc1", "linear_fc2")
