"""Image helpers shared by the trainers and the eval command: tensors <-> PIL, grids."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["grid_boxes", "make_grid", "tensor_to_pil"]


def tensor_to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[B, 3, H, W]`` floats in [0, 1] -> list of RGB PIL images (values outside [0, 1] are clipped)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images of shape [B, 3, H, W], got {tuple(images.shape)}")
    arr = (
        (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    )
    return [Image.fromarray(a) for a in arr]


def grid_boxes(
    n: int, width: int, height: int, cols: int | None = None, pad: int = 2
) -> list[tuple[int, int, int, int]]:
    """``(left, top, right, bottom)`` of each of ``n`` cells of ``width x height`` in a :func:`make_grid` grid:
    cell ``i`` sits at row ``i // cols``, column ``i % cols``, with ``pad`` pixels of padding around every cell."""
    cols = cols or math.ceil(math.sqrt(n))
    boxes = []
    for i in range(n):
        r, c = divmod(i, cols)
        x, y = pad + c * (width + pad), pad + r * (height + pad)
        boxes.append((x, y, x + width, y + height))
    return boxes


def make_grid(images: torch.Tensor | Sequence[Any], cols: int | None = None, pad: int = 2) -> Image.Image:
    """Tile images into one RGB grid (white padding), ``cols`` defaulting to a near-square layout; every image is
    resized to the first one's size, and :func:`grid_boxes` gives where each one lands."""
    pils = tensor_to_pil(images) if isinstance(images, torch.Tensor) else [im.convert("RGB") for im in images]
    if not pils:
        raise ValueError("make_grid needs at least one image")
    w, h = pils[0].size
    cols = cols or math.ceil(math.sqrt(len(pils)))
    rows = math.ceil(len(pils) / cols)
    canvas = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    for im, (x, y, right, bottom) in zip(pils, grid_boxes(len(pils), w, h, cols, pad), strict=True):
        canvas[y:bottom, x:right] = np.asarray(im.resize((w, h)))
    return Image.fromarray(canvas)
