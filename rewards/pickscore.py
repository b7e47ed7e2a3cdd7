"""PickScore (Kirstain et al. 2023, arXiv 2305.01569): a CLIP-H fine-tuned on Pick-a-Pic preferences."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rewards.base import RewardOutput
from rewards.images import ImageBatch, ImageRewardBase, prepare_pixels
from rewards.registry import register


def projected_embeds(output: Any) -> torch.Tensor:
    """The projected embedding from ``get_image_features`` / ``get_text_features``."""
    # transformers 5 returns a model output whose pooler_output is the projected embedding; 4.x a tensor
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def processor_image_geometry(
    image_processor: Any,
) -> tuple[tuple[int, int], tuple[float, ...], tuple[float, ...]]:
    """(crop (height, width), mean, std) of a transformers CLIP image processor."""
    crop = image_processor.crop_size
    get = crop.get if isinstance(crop, dict) else lambda key: getattr(crop, key)
    return (
        (int(get("height")), int(get("width"))),
        tuple(image_processor.image_mean),
        tuple(image_processor.image_std),
    )


@register("pickscore")
class PickScore(ImageRewardBase):
    """PickScore: the CLIP logit of the (image, prompt) pair,

        score = exp(logit_scale) * <f_img / |f_img|, f_txt / |f_txt|>   (about 18 - 23 on real images)

    as in the reference inference code (which then softmaxes over candidate images for ranking; a reward uses
    the logit itself).

    Args:
        model_id: hub id or local directory of the ``CLIPModel`` weights.
        processor_id: hub id or local directory of the processor (tokenizer + image geometry); PickScore was
            trained with ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s.
        model, processor: an already built ``CLIPModel`` / ``CLIPProcessor`` (skips loading).
        dtype: weights dtype, e.g. ``torch.float16`` on a GPU.
        device, differentiable, batch_size: see :class:`rewards.images.ImageRewardBase`.
    """

    def __init__(
        self,
        model_id: str = "yuvalkirstain/PickScore_v1",
        processor_id: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        model: torch.nn.Module | None = None,
        processor: Any = None,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        super().__init__(device=device, differentiable=differentiable, batch_size=batch_size)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(processor_id)
        if model is None:
            from transformers import CLIPModel

            model = CLIPModel.from_pretrained(model_id, dtype=self.dtype)
        self.model = self.freeze(model)
        self.tokenizer = processor.tokenizer
        self.image_size, self.mean, self.std = processor_image_geometry(processor.image_processor)

    def score_chunk(self, images: ImageBatch, prompts: list[str] | None) -> RewardOutput:
        pixels = prepare_pixels(images, self.image_size, self.mean, self.std, self.device, self.dtype)
        tokens = self.tokenizer(
            list(prompts or []), padding=True, truncation=True, max_length=77, return_tensors="pt"
        ).to(self.device)
        image_embeds = F.normalize(
            projected_embeds(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1
        )
        text_embeds = F.normalize(projected_embeds(self.model.get_text_features(**tokens)).float(), dim=-1)
        cosine = (image_embeds * text_embeds).sum(-1)  # [B]
        return RewardOutput(
            scores=self.model.logit_scale.exp().float() * cosine, components={"cosine": cosine}
        )
