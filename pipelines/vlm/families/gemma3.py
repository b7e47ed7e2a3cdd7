"""Gemma 3 (``Gemma3ForConditionalGeneration``: gemma-3-4b/12b/27b-it): a SigLIP tower and bidirectional image
attention.

- Prompt: one user turn, the images where the question's ``<image>`` placeholders put them, else first and
  then the question (Gemma 3's examples put images first too); the
  chat template writes ``<start_of_image>`` per image, which the processor expands to ``\\n\\n<start_of_image>``,
  ``mm_tokens_per_image`` x ``<image_soft_token>``, ``<end_of_image>\\n\\n``.
- Vision special tokens: ``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``. A sampled
  ``<image_soft_token>`` has no image feature to fill it, and the re-scoring forward would fail.
- Token types: ``token_type_ids`` (0 text, 1 image token). The model attends bidirectionally within each image
  where they are 1; ``generate`` passes them in its prefill, so the scoring forward must pass them too or
  log-probs differ from the rollout's.
- Image features: ``pixel_values`` ``[num_images, 3, S, S]``; every image fills ``mm_tokens_per_image`` tokens
  (256 for the released models), since pan-and-scan crops are off by default.
- Vision tower: ``backbone.vision_tower`` (the pooling projector ``multi_modal_projector`` sits outside it and is
  trained with the language model in full fine-tuning).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from pipelines.vlm.families import VLMFamily, register_vlm_family

__all__ = ["Gemma3"]


@register_vlm_family("gemma3")
class Gemma3(VLMFamily):
    """Gemma 3 conventions (see the module docstring)."""

    model_types = ("gemma3",)
    vision_special_tokens = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
    vision_module = "vision_tower"
    # SigLIP's attention and MLP (the projector into the language model is a parameter, not a linear layer)
    vision_lora_targets = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")
    token_type_key = "token_type_ids"

    def image_token_id(self, processor: Any) -> int:
        # (processor.image_token_id is <start_of_image>, the placeholder the text carries before expansion)
        return processor.tokenizer.image_token_id

    def token_type_ids(self, input_ids: torch.Tensor, processor: Any) -> torch.Tensor:
        return (input_ids == self.image_token_id(processor)).long()

    def image_inputs(
        self, processor: Any, images: Sequence[Image.Image]
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        vision = processor.image_processor(images=list(images), return_tensors="pt")
        if int(vision["pixel_values"].shape[0]) != len(images):
            raise ValueError(
                f"the image processor returned {vision['pixel_values'].shape[0]} crops for {len(images)} images; "
                "turn pan-and-scan off (do_pan_and_scan=False) to score Gemma 3 rollouts"
            )
        return {"pixel_values": vision["pixel_values"]}, [processor.image_seq_length] * len(images)
