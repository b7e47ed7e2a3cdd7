"""Rewards on open-clip models: CLIP score and HPSv2.

Both embed the image and the prompt with a CLIP model and score their cosine similarity; they differ in the
weights and in how an image of another aspect ratio is fitted to the model (CLIP crops its centre, HPSv2
letterboxes it). Weights load through open-clip (``create_model(name, pretrained=tag or local file)``), or
an already built ``open_clip.CLIP`` is passed as ``model=`` (tests build a tiny random one from a config
registered with ``open_clip.add_model_config``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from rewards.base import RewardOutput
from rewards.images import ImageBatch, ImageRewardBase, ResizeMode, prepare_pixels
from rewards.registry import register

logger = logging.getLogger(__name__)

Tokenizer = Callable[[list[str]], torch.Tensor]
Precision = Literal["fp32", "fp16", "bf16"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# HPSv2 checkpoints on the Hugging Face hub (https://huggingface.co/xswu/HPSv2), by version.
HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def load_open_clip(
    model_name: str, pretrained: str | None, cache_dir: str | None = None
) -> tuple[torch.nn.Module, Tokenizer]:
    """Build an open-clip model and its tokenizer.

    Args:
        model_name: open-clip architecture name (``open_clip.list_models()``), e.g. ``"ViT-H-14"``, or
            ``"hf-hub:org/repo"``.
        pretrained: a pretrained tag of that architecture (``open_clip.list_pretrained()``, e.g.
            ``"laion2b_s32b_b79k"``), a local checkpoint file, or ``None`` for random weights.
        cache_dir: where open-clip caches downloads (its default when ``None``).
    """
    import open_clip

    model = open_clip.create_model(model_name, pretrained=pretrained, cache_dir=cache_dir)
    return model, open_clip.get_tokenizer(model_name, cache_dir=cache_dir)


class OpenClipReward(ImageRewardBase):
    """Shared part of the open-clip rewards: the model, its preprocessing and its two encoders."""

    #: how an image of another aspect ratio fits the model's square input
    #: (:func:`rewards.images.clip_preprocess`)
    resize_mode: ResizeMode = "shortest"

    def __init__(
        self,
        model_name: str,
        pretrained: str | None,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
        precision: Precision = "fp32",
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        super().__init__(device=device, differentiable=differentiable, batch_size=batch_size)
        if precision not in DTYPES:
            raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
        self.dtype = DTYPES[precision]
        if model is None:
            model, loaded_tokenizer = load_open_clip(model_name, pretrained, cache_dir)
            tokenizer = tokenizer or loaded_tokenizer
        if tokenizer is None:
            import open_clip

            tokenizer = open_clip.get_tokenizer(model_name)
        self.model = self.freeze(model.to(self.dtype))
        self.tokenizer = tokenizer
        cfg = self.model.visual.preprocess_cfg
        size = cfg["size"]
        self.image_size = (size, size) if isinstance(size, int) else tuple(size)
        self.mean, self.std = tuple(cfg["mean"]), tuple(cfg["std"])

    def image_features(self, images: ImageBatch) -> torch.Tensor:
        """``[B, D]`` L2-normalised image embeddings."""
        pixels = prepare_pixels(
            images, self.image_size, self.mean, self.std, self.device, self.dtype, self.resize_mode
        )
        return F.normalize(self.model.encode_image(pixels).float(), dim=-1)

    def text_features(self, prompts: list[str]) -> torch.Tensor:
        """``[B, D]`` L2-normalised text embeddings."""
        tokens = self.tokenizer(prompts).to(self.device)
        return F.normalize(self.model.encode_text(tokens).float(), dim=-1)

    def score_chunk(self, images: ImageBatch, prompts: list[str] | None) -> RewardOutput:
        # prompts is a checked list here: needs_prompts is True
        cosine = (self.image_features(images) * self.text_features(list(prompts or []))).sum(-1)  # [B]
        return RewardOutput(scores=cosine)


@register("clip_score")
class ClipScore(OpenClipReward):
    """CLIP score: cosine similarity of the image and prompt embeddings of an open-clip model.

        score = <f_img / |f_img|, f_txt / |f_txt|>   in [-1, 1]

    (CLIPScore, Hessel et al. 2021, arXiv 2104.08718, rescales it as ``2.5 * max(score, 0)``; the raw cosine
    keeps the sign and the scale that GRPO's group normalisation removes anyway.)

    Args:
        model_name: open-clip architecture, any of ``open_clip.list_models()``.
        pretrained: pretrained tag (``open_clip.list_pretrained_tags_by_model(model_name)``) or local file.
        model, tokenizer: an already built open-clip model / tokenizer (skips loading).
        precision: weights and pixel dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"`` (half precision on GPUs).
        device, differentiable, batch_size: see :class:`rewards.images.ImageRewardBase`.
    """

    def __init__(
        self,
        model_name: str = "ViT-H-14",
        pretrained: str | None = "laion2b_s32b_b79k",
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
        precision: Precision = "fp32",
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        super().__init__(
            model_name, pretrained, model, tokenizer, cache_dir, precision, device, differentiable, batch_size
        )


def load_hps_checkpoint(model: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load an HPSv2 checkpoint (``{"state_dict": ...}`` or a bare state dict) into an open-clip model.

    Raises:
        ValueError: the checkpoint lacks weights the model has (wrong architecture or file).
    """
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys:
        raise ValueError(
            f"HPS checkpoint {str(checkpoint)!r} does not fit the model: missing {result.missing_keys[:5]} "
            f"({len(result.missing_keys)} in all); HPSv2 checkpoints need model_name='ViT-H-14'"
        )
    if result.unexpected_keys:
        logger.warning("HPS checkpoint: ignoring %d unexpected keys", len(result.unexpected_keys))


@register("hpsv2")
class HPSv2(OpenClipReward):
    """Human Preference Score v2 (Wu et al. 2023, arXiv 2306.09341): an open-clip ViT-H-14 fine-tuned on
    human preference pairs; the score is the cosine similarity of its image and prompt embeddings,

        score = <f_img / |f_img|, f_txt / |f_txt|>   (typically 0.2 - 0.35 on real images)

    as in the reference ``score.py`` (``diag(image_features @ text_features.T)``). Images are letterboxed, not
    cropped, as HPSv2's own scorer does (``img_score.py``, ``light_augmentation=True``: ``ResizeMaxSize``):
    the longer side is resized to the model's input size and the rest padded with black, so a 512 x 1024
    image is scored whole (:func:`rewards.images.clip_preprocess`, ``resize_mode="longest"``; square images
    are only resized, as with CLIP's crop).

    Args:
        version: ``"v2.1"`` (default) or ``"v2.0"``: which checkpoint to download from ``xswu/HPSv2``.
        checkpoint: local checkpoint file; overrides ``version`` (no download).
        model_name: open-clip architecture of the checkpoint (``"ViT-H-14"`` for the released ones).
        model, tokenizer: an already built open-clip model / tokenizer; the checkpoint, when given, is loaded
            into it.
        precision: weights and pixel dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        device, differentiable, batch_size: see :class:`rewards.images.ImageRewardBase`.
    """

    resize_mode: ResizeMode = "longest"

    def __init__(
        self,
        version: Literal["v2.0", "v2.1"] = "v2.1",
        checkpoint: str | None = None,
        model_name: str = "ViT-H-14",
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        cache_dir: str | None = None,
        precision: Precision = "fp32",
        device: str | torch.device = "cpu",
        differentiable: bool = False,
        batch_size: int = 32,
    ):
        if version not in HPS_FILES:
            raise ValueError(f"hpsv2 version must be one of {sorted(HPS_FILES)}, got {version!r}")
        if model is None:
            # the checkpoint holds every weight, so the LAION base weights need not be downloaded first
            model, loaded_tokenizer = load_open_clip(model_name, None, cache_dir)
            tokenizer = tokenizer or loaded_tokenizer
            if checkpoint is None:
                from huggingface_hub import hf_hub_download

                checkpoint = hf_hub_download(HPS_REPO, HPS_FILES[version], cache_dir=cache_dir)
        if checkpoint is not None:
            load_hps_checkpoint(model, checkpoint)
        super().__init__(
            model_name, None, model, tokenizer, cache_dir, precision, device, differentiable, batch_size
        )
