"""Shared plumbing of the image rewards: input conversion, CLIP-style preprocessing, the batched base class.

Every image reward accepts ``images`` as a list of PIL images (any sizes) or a ``[B, 3, H, W]`` float tensor in
[0, 1] (uint8 tensors are divided by 255). Preprocessing is done with torch ops on the reward's device, so the
same code path serves inference and differentiable use (reward backpropagation into the pixels):

    x -> resize (bicubic, antialiased) so the shorter side is ``size`` -> centre crop -> (x - mean) / std

This is the transform of open-clip's and transformers' CLIP image processors. Their PIL implementation resizes
uint8 images; ours resizes floats, so scores of a PIL image differ from the reference scripts' by resampling
rounding only (about 1e-3 relative on a real model). HPSv2 letterboxes instead (``resize_mode="longest"``):
the longer side is resized to ``size`` and the rest padded with black, so nothing is cropped away.

Every image must hold at least one pixel (an empty image fails with a ``ValueError``, not deep inside a
model), and every error about one image of a batch names its index, ``images[i]``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from rewards.base import Reward, RewardOutput

ImageBatch = Sequence[Image.Image] | torch.Tensor

#: how an image reaches the model's square input: ``"shortest"`` resizes the shorter side and crops the
#: centre (CLIP), ``"longest"`` resizes the longer side and pads with black (HPSv2); open-clip's names
ResizeMode = Literal["shortest", "longest"]


#: how far a float image may stray outside [0, 1] (rounding of a decoder's output) before it is refused
RANGE_TOLERANCE = 1e-3

#: the 16-bit grey modes of PIL (PNG and TIFF of 16 bits per sample open as one of them)
_16_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")


def pil_to_rgb(image: Image.Image, name: str = "image") -> Image.Image:
    """One PIL image -> 8-bit RGB, its values scaled, not clipped:

        16-bit grey (``I;16``, and ``I``, as 16-bit PNGs open):  v8 = round(v * 255 / 65535)
        float grey (``F``, values in [0, 1] as float tensors are):  v8 = round(v * 255)

    Every other mode is 8 bits per sample already and goes through ``convert("RGB")`` (palette, grey, RGBA).
    (``convert`` alone clips 16-bit values to 255, white, and reads floats as 0..255, black.)

    Raises:
        ValueError: the image cannot be decoded (a truncated or corrupt file, which PIL opens lazily and
            only reads here) or is empty (0 pixels wide or high); a 16-bit image with values outside
            [0, 65535], or a float one with values not finite or outside [0, 1] (by more than
            :data:`RANGE_TOLERANCE`): the message names ``name`` and the range found.
    """
    try:
        image.load()
    except OSError as error:  # PIL raises OSError for a truncated or undecodable file
        raise ValueError(
            f"{name}: the image cannot be decoded ({error}): the file is truncated or corrupt"
        ) from None
    if image.width < 1 or image.height < 1:
        raise ValueError(
            f"{name} is empty ({image.width}x{image.height} pixels): an image needs at least 1x1"
        )
    if image.mode == "RGB":
        return image  # (convert would copy it)
    if image.mode not in (*_16_BIT_MODES, "F"):
        return image.convert("RGB")
    array = np.asarray(image, dtype=np.float64)
    low, high = (float(array.min()), float(array.max())) if array.size else (0.0, 0.0)
    if image.mode == "F":
        if not (np.isfinite(array).all() and low >= -RANGE_TOLERANCE and high <= 1 + RANGE_TOLERANCE):
            raise ValueError(
                f"{name}: a float (mode F) image must hold values in [0, 1], got values in [{low:.4g}, {high:.4g}];"
                " scale it to [0, 1] first"
            )
        scaled = array * 255.0
    else:
        if low < 0 or high > 65535:
            raise ValueError(
                f"{name}: a mode {image.mode} image is read as 16 bits per sample, [0, 65535], but holds values in "
                f"[{low:g}, {high:g}]; scale it to 16 or 8 bits first"
            )
        scaled = array * (255.0 / 65535.0)
    grey = Image.fromarray(np.round(scaled).clip(0, 255).astype(np.uint8))
    return grey.convert("RGB")


def pil_to_tensor(image: Image.Image, name: str = "image") -> torch.Tensor:
    """One PIL image -> ``[3, H, W]`` float32 in [0, 1] (converted to 8-bit RGB first, :func:`pil_to_rgb`)."""
    array = np.asarray(pil_to_rgb(image, name), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(255.0)


def check_image_tensor(images: torch.Tensor, name: str = "images") -> torch.Tensor:
    """Validate a ``[B, 3, H, W]`` tensor and return it as float in [0, 1] (uint8 is divided by 255).

    Float values must be finite and lie in [0, 1] up to :data:`RANGE_TOLERANCE`: a [0, 255] or [-1, 1] image
    would otherwise be clamped to a different picture, scored without a word.

    Raises:
        ValueError: a wrong shape (also ``H`` or ``W`` 0) or dtype, or float values outside [0, 1] or not
            finite (the range found is named).
    """
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{name} must be a [B, 3, H, W] tensor, got shape {tuple(images.shape)}")
    if images.shape[2] < 1 or images.shape[3] < 1:
        raise ValueError(f"{name} has empty images (shape {tuple(images.shape)}): an image needs H, W >= 1")
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise ValueError(f"{name} must be float in [0, 1] or uint8, got dtype {images.dtype}")
    if images.numel():
        low, high = (v.item() for v in images.detach().float().aminmax())  # NaN and inf propagate to these
        if not (math.isfinite(low) and math.isfinite(high)):
            raise ValueError(
                f"{name} holds NaN or infinite values (range [{low}, {high}]): check the decoder that made them"
            )
        if low < -RANGE_TOLERANCE or high > 1 + RANGE_TOLERANCE:
            raise ValueError(
                f"{name} must be float in [0, 1] (or uint8), got values in [{low:.4g}, {high:.4g}]: map [-1, 1] "
                "images with (x + 1) / 2 and [0, 255] ones with x / 255"
            )
    return images


def _sequence(images: ImageBatch, name: str) -> Sequence[Any]:
    if isinstance(images, Image.Image) or not isinstance(images, Sequence):
        raise ValueError(
            f"{name} must be a list of PIL images or a [B, 3, H, W] tensor, got {type(images).__name__}"
        )
    return images


def _tensor_item(image: Any, name: str) -> torch.Tensor:
    """One list item that is not a PIL image: a ``[3, H, W]`` tensor, checked, as float in [0, 1]."""
    if isinstance(image, torch.Tensor) and image.ndim == 3:
        return check_image_tensor(image.unsqueeze(0), name)[0]
    raise ValueError(f"{name} must be a PIL image or a [3, H, W] tensor, got {type(image).__name__}")


def image_list(images: ImageBatch, name: str = "images") -> list[torch.Tensor]:
    """Any accepted image batch -> list of ``[3, H, W]`` float tensors in [0, 1] (sizes may differ)."""
    if isinstance(images, torch.Tensor):
        return list(check_image_tensor(images, name).unbind(0))
    return [
        pil_to_tensor(image, f"{name}[{i}]")
        if isinstance(image, Image.Image)
        else _tensor_item(image, f"{name}[{i}]")
        for i, image in enumerate(_sequence(images, name))
    ]


def check_images(images: ImageBatch, name: str = "images") -> ImageBatch:
    """Check a whole batch before it is cut into chunks, so that an error names the image's index in the batch
    (a chunk's own conversion would count from the chunk's start).

    Returns:
        the checked ``[B, 3, H, W]`` float tensor, or a list of 8-bit RGB PIL images (:func:`pil_to_rgb`) and
        checked ``[3, H, W]`` float tensors.

    Raises:
        ValueError: as :func:`check_image_tensor` and :func:`pil_to_rgb`, naming ``images[i]``.
    """
    if isinstance(images, torch.Tensor):
        return check_image_tensor(images, name)
    return [
        pil_to_rgb(image, f"{name}[{i}]")
        if isinstance(image, Image.Image)
        else _tensor_item(image, f"{name}[{i}]")
        for i, image in enumerate(_sequence(images, name))
    ]


def images_to_uint8(images: ImageBatch) -> list[np.ndarray]:
    """Any accepted image batch -> list of ``[H, W, 3]`` uint8 arrays, rounding as DDPO does: ``round(255 x)``."""
    if isinstance(images, Sequence) and all(isinstance(im, Image.Image) for im in images):
        return [np.asarray(pil_to_rgb(im, f"images[{i}]"), dtype=np.uint8) for i, im in enumerate(images)]
    return [
        (t.detach() * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        for t in image_list(images)
    ]


def images_to_pil(images: ImageBatch) -> list[Image.Image]:
    """Any accepted image batch -> list of RGB PIL images (tensors are rounded to uint8)."""
    if isinstance(images, Sequence) and all(isinstance(im, Image.Image) for im in images):
        return [pil_to_rgb(im, f"images[{i}]") for i, im in enumerate(images)]
    return [Image.fromarray(a) for a in images_to_uint8(images)]


def clip_preprocess(
    pixels: torch.Tensor,
    size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    resize_mode: ResizeMode = "shortest",
) -> torch.Tensor:
    """CLIP image transform on a ``[B, 3, H, W]`` tensor in [0, 1]; differentiable.

    Resize (bicubic, antialiased) by ``s``, then fit ``size`` = (height, width), then normalise with
    ``(x - mean) / std``:

        "shortest":  s = max(height / H, width / W), centre crop to ``size``         (CLIP)
        "longest":   s = min(height / H, width / W), pad with 0 (black) around the image, centred, to ``size``
                     (the left and top pads are the floor of half the padding: HPSv2's ``ResizeMaxSize``)

    Both give the same pixels on an image of the aspect ratio of ``size``.
    """
    _, _, h, w = pixels.shape
    out_h, out_w = size
    if resize_mode == "shortest":
        scale = max(out_h / h, out_w / w)
        new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    elif resize_mode == "longest":
        scale = min(out_h / h, out_w / w)
        # at least one pixel: an extreme aspect ratio must not round a side away
        new_h, new_w = max(1, min(out_h, round(h * scale))), max(1, min(out_w, round(w * scale)))
    else:
        raise ValueError(f"resize_mode must be 'shortest' or 'longest', got {resize_mode!r}")
    if (new_h, new_w) != (h, w):
        pixels = F.interpolate(
            pixels, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True
        )
        # bicubic overshoots at edges; PIL clamps to the uint8 range, so do the same
        pixels = pixels.clamp(0.0, 1.0)
    if resize_mode == "shortest":
        top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
        pixels = pixels[:, :, top : top + out_h, left : left + out_w]
    else:
        top, left = (out_h - new_h) // 2, (out_w - new_w) // 2
        pixels = F.pad(pixels, (left, out_w - new_w - left, top, out_h - new_h - top), value=0.0)
    mean_t = torch.tensor(mean, dtype=pixels.dtype, device=pixels.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype, device=pixels.device).view(1, -1, 1, 1)
    return (pixels - mean_t) / std_t


def prepare_pixels(
    images: ImageBatch,
    size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    resize_mode: ResizeMode = "shortest",
) -> torch.Tensor:
    """Any accepted image batch -> ``[B, 3, *size]`` normalised model input on ``device``, in ``dtype``
    (:func:`clip_preprocess` with ``resize_mode``).

    A tensor batch is transformed in one call (and keeps its autograd graph); a list of PIL images of
    different sizes is transformed image by image. The transform runs in float32 whatever ``dtype`` is, the
    result is cast after: antialiased bicubic resizing has no half-precision CPU kernel, and float32 keeps the
    resampling of a half-precision model's input exact.
    """
    if isinstance(images, torch.Tensor):
        pixels = check_image_tensor(images).to(device=device, dtype=torch.float32)
        return clip_preprocess(pixels, size, mean, std, resize_mode).to(dtype)
    return torch.cat(
        [
            clip_preprocess(t.to(device=device, dtype=torch.float32)[None], size, mean, std, resize_mode)
            for t in image_list(images)
        ]
    ).to(dtype)


def batch_size_of(images: ImageBatch) -> int:
    return images.shape[0] if isinstance(images, torch.Tensor) else len(images)


def check_prompts(prompts: Sequence[str] | None, batch: int, reward: str) -> list[str]:
    """Validate that there is one prompt string per image."""
    if prompts is None:
        raise ValueError(f"reward {reward!r} needs prompts=[...] (one per image)")
    if isinstance(prompts, str) or len(prompts) != batch:
        got = "a string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"reward {reward!r} needs one prompt per image: {batch} images, got {got}")
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"reward {reward!r}: every prompt must be a str")
    return list(prompts)


class ImageRewardBase(Reward):
    """Base of the learned image rewards: device placement, chunking, grad mode.

    Subclasses implement :meth:`score_chunk` on at most ``batch_size`` images. Scores are detached float32 on
    the CPU, except with ``differentiable=True``, where they stay on the reward's device with their graph
    (the model's parameters stay frozen either way: gradients flow to the pixels only).
    """

    #: whether the reward reads ``prompts``
    needs_prompts: bool = True

    def __init__(
        self, device: str | torch.device = "cpu", differentiable: bool = False, batch_size: int = 32
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.device = torch.device(device)
        self.differentiable = differentiable
        self.batch_size = batch_size

    def freeze(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move ``module`` to the reward's device, eval mode, parameters frozen."""
        module = module.to(self.device).eval()
        module.requires_grad_(False)
        return module

    @contextlib.contextmanager
    def grad_mode(self) -> Iterator[None]:
        with torch.enable_grad() if self.differentiable else torch.no_grad():
            yield

    def score_chunk(self, images: ImageBatch, prompts: list[str] | None) -> RewardOutput:
        raise NotImplementedError

    def score(self, *, images: ImageBatch, prompts: Sequence[str] | None = None, **_: Any) -> RewardOutput:
        """Score ``images`` (list of PIL or ``[B, 3, H, W]`` in [0, 1]) against ``prompts`` (one per image).

        Other batch fields (``metadata``, ...) are accepted and ignored, so one batch dict can feed several
        rewards.
        """
        batch = batch_size_of(images)
        prompt_list = check_prompts(prompts, batch, self.name) if self.needs_prompts else None
        images = check_images(images)
        outputs = []
        with self.grad_mode():
            for start in range(0, batch, self.batch_size):
                stop = start + self.batch_size
                outputs.append(
                    self.score_chunk(
                        images[start:stop], None if prompt_list is None else prompt_list[start:stop]
                    )
                )
        return self.finish(concat_outputs(outputs))

    def finish(self, output: RewardOutput) -> RewardOutput:
        if self.differentiable:
            return output
        return RewardOutput(
            scores=output.scores.detach().float().cpu(),
            components={k: v.detach().float().cpu() for k, v in output.components.items()},
            reasons=output.reasons,
        )


def concat_outputs(outputs: Sequence[RewardOutput]) -> RewardOutput:
    """Concatenate chunk outputs along the batch; components and reasons are joined key by key."""
    if not outputs:  # an empty batch
        return RewardOutput(scores=torch.zeros(0))
    if len(outputs) == 1:
        return outputs[0]
    reasons = None
    if any(o.reasons is not None for o in outputs):
        reasons = [r for o in outputs for r in (o.reasons or [None] * len(o.scores))]
    return RewardOutput(
        scores=torch.cat([o.scores for o in outputs]),
        components={k: torch.cat([o.components[k] for o in outputs]) for k in outputs[0].components},
        reasons=reasons,
    )
