"""JPEG (in)compressibility, the hand-written rewards of DDPO (Black et al. 2023, arXiv 2305.13301,
sec. 6.1), on DDPO's scale:

    size_kB(x)                 = len(JPEG(round(255 x), quality=95)) / 1000
    jpeg_incompressibility(x)  =  size_kB(x)
    jpeg_compressibility(x)    = -size_kB(x)

Flow-GRPO's compression task (arXiv 2505.05470, its ``rewards.py``) scores ``-size_kB(x) / 500`` instead (its
incompressibility is ``size_kB(x)``, as here). GRPO's per-group normalisation, ``(r - mean) / std``, cancels
the factor, so a run on this reward alone trains as Flow-GRPO's does; a weighted sum with other rewards does
not: there the factor is part of the weight (weight ``w / 500`` here is Flow-GRPO's ``w``).

Encoded with Pillow (libjpeg-turbo), quality 95, default 4:2:0 chroma subsampling, no optimisation pass, as the
DDPO code does. Tensors are rounded to uint8 first, as in DDPO: ``round(255 x)`` clamped to [0, 255].
"""

from __future__ import annotations

import io
from typing import Any

import torch
from PIL import Image

from rewards.base import Reward, RewardOutput
from rewards.images import ImageBatch, images_to_uint8
from rewards.registry import register


def jpeg_size_kb(images: ImageBatch, quality: int = 95) -> torch.Tensor:
    """``[B]`` float32: size in kB (1000 bytes) of each image encoded as JPEG at ``quality``."""
    sizes = []
    for array in images_to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegReward(Reward):
    sign: float = 1.0

    def __init__(self, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
        self.quality = quality

    def score(self, *, images: ImageBatch, **_: Any) -> RewardOutput:
        """Score ``images`` (list of PIL or ``[B, 3, H, W]`` in [0, 1]); other batch fields are ignored."""
        size = jpeg_size_kb(images, self.quality)
        return RewardOutput(scores=self.sign * size, components={"jpeg_kb": size})


@register("jpeg_incompressibility")
class JpegIncompressibility(_JpegReward):
    """``score = size_kB(JPEG(x, quality))``: rewards detail and texture."""

    sign = 1.0


@register("jpeg_compressibility")
class JpegCompressibility(_JpegReward):
    """``score = -size_kB(JPEG(x, quality))``: rewards flat, simple images (DDPO's scale; Flow-GRPO divides by
    500, see the module docstring)."""

    sign = -1.0
