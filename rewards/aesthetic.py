"""LAION improved aesthetic predictor: a linear-probe MLP on CLIP ViT-L/14 image embeddings.

Architecture and weights of christophschuhmann/improved-aesthetic-predictor (``sac+logos+ava1-l14-linearMSE``),
the aesthetic reward of DDPO (Black et al. 2023, arXiv 2305.13301) and Flow-GRPO; predicts the 1-10 rating of
the SAC/LOGOS/AVA data sets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rewards.base import RewardOutput
from rewards.images import ImageBatch, ImageRewardBase, prepare_pixels
from rewards.pickscore import processor_image_geometry, projected_embeds
from rewards.registry import register


class AestheticMLP(nn.Module):
    """The predictor head: five linear layers, dropout between the first four, no activations (the layer
    indices, and so the state-dict keys ``layers.{0,2,4,6,7}``, match the released file)."""

    def __init__(self, embed_dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(embed_dim, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """``[B, D]`` L2-normalised CLIP image embeddings -> ``[B]`` predicted rating."""
        return self.layers(embeds).squeeze(-1)


@register("aesthetic")
class Aesthetic(ImageRewardBase):
    """LAION aesthetic score: ``score = MLP(f_img / |f_img|)`` with ``f_img`` the CLIP ViT-L/14 image embedding.

    Prompts are not used.

    Args:
        clip_model_id: hub id or local directory of the ``CLIPModel`` and its image processor (only the
            vision tower and its projection run).
        head_repo, head_filename: hub file of the MLP head state dict (the LAION weights as republished for
            TRL's DDPO example).
        head_path: local file of the MLP head state dict; overrides ``head_repo``.
        model, image_processor, head: an already built ``CLIPModel``, ``CLIPImageProcessor`` and
            :class:`AestheticMLP` (skip loading).
        device, differentiable, batch_size: see :class:`rewards.images.ImageRewardBase`.
    """

    needs_prompts = False

    def __init__(
        self,
        clip_model_id: str = "openai/clip-vit-large-patch14",
        head_repo: str = "trl-lib/ddpo-aesthetic-predictor",
        head_filename: str = "aesthetic-model.pth",
        head_path: str | None = None,
        model: torch.nn.Module | None = None,
        image_processor: Any = None,
        head: AestheticMLP | None = None,
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        super().__init__(device=device, differentiable=differentiable, batch_size=batch_size)
        if model is None:
            from transformers import CLIPModel

            model = CLIPModel.from_pretrained(clip_model_id)
        if image_processor is None:
            from transformers import CLIPImageProcessor

            image_processor = CLIPImageProcessor.from_pretrained(clip_model_id)
        if head is None:
            if head_path is None:
                from huggingface_hub import hf_hub_download

                head_path = hf_hub_download(head_repo, head_filename)
            head = AestheticMLP(model.config.projection_dim)
            head.load_state_dict(torch.load(head_path, map_location="cpu", weights_only=True))
        self.model = self.freeze(model)
        self.head = self.freeze(head)
        self.image_size, self.mean, self.std = processor_image_geometry(image_processor)

    def score_chunk(self, images: ImageBatch, prompts: list[str] | None) -> RewardOutput:
        pixels = prepare_pixels(images, self.image_size, self.mean, self.std, self.device)
        embeds = F.normalize(
            projected_embeds(self.model.get_image_features(pixel_values=pixels)).float(), dim=-1
        )
        return RewardOutput(scores=self.head(embeds))
