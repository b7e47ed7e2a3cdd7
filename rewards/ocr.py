"""OCR reward for text rendering (Flow-GRPO's text-rendering task): does the image show the text asked for?

    score = 1 - min(d, |t|) / |t|,   d = 0 if t is a substring of r else Levenshtein(r, t)

with ``t`` the target text and ``r`` the recognised text, both lower-cased with every whitespace character
removed. The target is the ``target`` field of the sample's metadata, or else the first double-quoted span of
the prompt (``'a sign that says "47"'`` -> ``47``). Recognising the target among other text costs nothing, and
reading a lot of unrelated text costs at most the whole target (the distance is capped at ``|t|``), as in
Flow-GRPO (arXiv 2505.05470, its ``ocr.py``).

The OCR model is PP-OCRv4 (detection + recognition, the family Flow-GRPO uses through PaddleOCR) run by ONNX
Runtime through the ``rapidocr-onnxruntime`` package, whose wheel holds the model files: nothing is downloaded.
Optional: ``pip install mmrl[ocr]``; imported only when the reward is built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from rewards.base import Reward, RewardOutput
from rewards.images import ImageBatch, batch_size_of, images_to_uint8
from rewards.registry import register

INSTALL_HINT = "the 'ocr' reward needs the rapidocr-onnxruntime package: pip install mmrl[ocr]"

# the first "..." (or “...”) span of a prompt
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def quoted_text(prompt: str) -> str | None:
    """The first double-quoted span of ``prompt`` (straight or curly quotes), ``None`` when there is none."""
    match = _QUOTED.search(prompt)
    if match is None:
        return None
    return match.group(1) if match.group(1) is not None else match.group(2)


def normalise_text(text: str) -> str:
    """Lower-case and drop every whitespace character (the recogniser emits stray and ideographic spaces)."""
    return "".join(text.split()).lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character, each costing 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_similarity(recognised: str, target: str) -> float:
    """``1 - min(d, |t|) / |t|`` of the module docstring, in [0, 1] (1: the target was read).

    Raises:
        ValueError: the target is empty after normalisation.
    """
    r, t = normalise_text(recognised), normalise_text(target)
    if not t:
        raise ValueError(f"the OCR target {target!r} is empty once whitespace is removed")
    distance = 0 if t in r else levenshtein(r, t)
    return 1.0 - min(distance, len(t)) / len(t)


def checked_target(target: str, what: str) -> str:
    """``target``, refused when it is empty once whitespace is removed: there is nothing to read, and
    :func:`ocr_similarity` would divide by its length.

    Raises:
        ValueError: naming ``what`` (where the target came from).
    """
    if not normalise_text(target):
        raise ValueError(f"{what} {target!r} is empty once whitespace is removed: there is no text to read")
    return target


def render_text(text: str, width: int, height: int, size: int) -> Image.Image:
    """A reference render: black ``text`` centred on a white ``width`` x ``height`` RGB image, in Pillow's bundled
    font at ``size`` pixels (no system font needed). What the reward should read exactly, for checks and
    calibration."""
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=size)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((width - (right - left)) / 2 - left, (height - (bottom - top)) / 2 - top), text, "black", font)
    return image


def ink_crop(image: np.ndarray, margin: float = 0.25, contrast: int = 48) -> np.ndarray:
    """Crop an ``[H, W, 3]`` uint8 image to its text: the pixels whose grey level differs from the median of the
    image border by more than ``contrast``, plus ``margin`` x the text height on each side. An image without
    such pixels is returned whole. The recogniser expects a tight line crop (what detection would give it)."""
    grey = image.astype(np.float32).mean(axis=2)
    border = np.concatenate([grey[0], grey[-1], grey[:, 0], grey[:, -1]])
    ink = np.abs(grey - np.median(border)) > contrast
    if not ink.any():
        return image
    rows, cols = np.nonzero(ink)
    top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    pad = round(margin * float(bottom - top)) + 1
    return image[max(0, top - pad) : bottom + pad, max(0, left - pad) : right + pad]


@register("ocr")
class OcrReward(Reward):
    """PP-OCR reading of each image scored against its target text (see the module docstring).

    ``mode="detect"`` finds text boxes and reads each (any layout; about 0.6-1 s per image on one CPU core);
    ``mode="recognize"`` skips detection and reads the whole image, cropped to its ink, as one line of text
    (single-line renders on a plain background; about 30-60 ms per image). Each image is read alone in both
    modes, as Flow-GRPO does, so a score never depends on the rest of the batch (the recogniser pads the
    crops it reads together to the widest one). Images lower than ``min_height`` pixels are first upscaled
    (bicubic) by the smallest integer factor that reaches it.

    Components: ``exact`` (1 where the normalised target was read whole). Reasons: ``None`` for an exact read,
    otherwise what was read against what was asked (``nothing read`` when no text passed ``min_confidence``).

    Args:
        mode: ``"detect"`` (detection + recognition) or ``"recognize"`` (recognition only).
        device: ``"cpu"``, or ``"cuda"`` (needs the onnxruntime-gpu package instead of onnxruntime).
        min_confidence: text boxes the recogniser is less sure of are dropped (PaddleOCR's ``drop_score``, 0.5).
        min_height: upscale images lower than this (pixels); 0 never upscales.
        batch_size: text boxes of one image per recognition forward pass (``mode="detect"``).
        threads: ONNX Runtime intra-op threads (``None``: its default, every core).

    Raises:
        ImportError: rapidocr-onnxruntime is not installed (with the pip command that installs it).
        ValueError: a bad option, or ``device="cuda"`` without ONNX Runtime's CUDA provider.
    """

    def __init__(
        self,
        mode: Literal["detect", "recognize"] = "detect",
        device: str = "cpu",
        min_confidence: float = 0.5,
        min_height: int = 64,
        batch_size: int = 16,
        threads: int | None = None,
    ):
        if mode not in ("detect", "recognize"):
            raise ValueError(f"mode must be 'detect' or 'recognize', got {mode!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if not 0.0 <= min_confidence <= 1.0 or min_height < 0 or batch_size < 1:
            raise ValueError(
                "need 0 <= min_confidence <= 1, min_height >= 0, batch_size >= 1; got "
                f"{min_confidence}, {min_height}, {batch_size}"
            )
        try:
            import onnxruntime
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as error:
            raise ImportError(INSTALL_HINT) from error
        use_cuda = device == "cuda"
        if use_cuda and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ValueError(
                "device='cuda' needs ONNX Runtime's CUDA provider: pip uninstall onnxruntime && "
                "pip install onnxruntime-gpu"
            )
        options: dict[str, Any] = {
            "det_use_cuda": use_cuda,
            "rec_use_cuda": use_cuda,
            "cls_use_cuda": use_cuda,
            "rec_batch_num": batch_size,
            "text_score": min_confidence,
        }
        if threads is not None:
            options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        self.engine = RapidOCR(**options)
        self.mode = mode
        self.min_confidence = min_confidence
        self.min_height = min_height

    def targets(
        self, size: int, prompts: Sequence[str] | None, metadata: Sequence[dict[str, Any]] | None
    ) -> list[str]:
        """Each sample's target: ``metadata[i]["target"]``, else the quoted span of ``prompts[i]``.

        Raises:
            ValueError: a sample has neither, or its target is empty (before anything is read), or the lengths
                do not match the batch.
        """
        for name, values in (("prompts", prompts), ("metadata", metadata)):
            if values is not None and (isinstance(values, str) or len(values) != size):
                raise ValueError(f"reward 'ocr' needs one entry of {name} per image ({size} images)")
        out = []
        for i in range(size):
            meta = metadata[i] if metadata is not None else None
            if meta is not None and not isinstance(meta, dict):
                raise ValueError(f"reward 'ocr': metadata[{i}] must be a dict, got {type(meta).__name__}")
            if meta and meta.get("target") is not None:
                out.append(checked_target(str(meta["target"]), f"reward 'ocr': metadata[{i}]['target']"))
                continue
            target = quoted_text(prompts[i]) if prompts is not None else None
            if target is None:
                prompt = "no prompt" if prompts is None else f"prompt {prompts[i]!r}"
                raise ValueError(
                    f"reward 'ocr': sample {i} has no target text: {prompt} has no double-quoted span and "
                    'metadata has no "target"'
                )
            out.append(checked_target(target, f"reward 'ocr': the quoted target of prompt {i}"))
        return out

    def check_prompt(self, prompt: str) -> None:
        """Refuse a prompt without a target to read: no double-quoted span (the trainers pass prompts only, so
        the span is the target), or one that is empty once whitespace is removed.

        Raises:
            ValueError: the prompt is refused (the message says why).
        """
        target = quoted_text(prompt)
        if target is None:
            raise ValueError(
                "the ocr reward reads the text to render from the prompt's first double-quoted span, and "
                f"{prompt!r} has none"
            )
        checked_target(target, "its quoted target")

    def read(self, images: ImageBatch) -> list[str]:
        """The text PP-OCR reads in each image (boxes joined top to bottom, left to right; ``""``: none)."""
        arrays = [self._upscale(a)[:, :, ::-1] for a in images_to_uint8(images)]  # RGB -> BGR, as cv2 reads
        if self.mode == "recognize":
            texts = []
            for array in arrays:
                # one call per image: the recogniser pads every crop of a call to the call's widest aspect
                # ratio, so crops recognised together would read differently than each alone
                lines, _ = self.engine.text_rec([np.ascontiguousarray(ink_crop(array))])
                text, score = lines[0][:2]
                texts.append(text if score >= self.min_confidence else "")
            return texts
        texts = []
        for array in arrays:
            result, _ = self.engine(np.ascontiguousarray(array), use_cls=False)
            texts.append("".join(box[1] for box in result) if result else "")
        return texts

    def _upscale(self, image: np.ndarray) -> np.ndarray:
        height = image.shape[0]
        if height >= self.min_height:
            return image
        import cv2  # a dependency of rapidocr-onnxruntime

        factor = math.ceil(self.min_height / height)
        return cv2.resize(image, (image.shape[1] * factor, height * factor), interpolation=cv2.INTER_CUBIC)

    @torch.no_grad()
    def score(
        self,
        *,
        images: ImageBatch,
        prompts: Sequence[str] | None = None,
        metadata: Sequence[dict[str, Any]] | None = None,
        **_: Any,
    ) -> RewardOutput:
        size = batch_size_of(images)
        targets = self.targets(size, prompts, metadata)
        texts = self.read(images)
        scores = [ocr_similarity(text, target) for text, target in zip(texts, targets, strict=True)]
        reasons: list[str | None] = []
        for text, target, value in zip(texts, targets, scores, strict=True):
            if not normalise_text(text):
                reasons.append(f"nothing read (expected {target!r})")
            elif value < 1.0:
                reasons.append(f"read {text.strip()!r}, expected {target!r}")
            else:
                reasons.append(None)
        return RewardOutput(
            scores=torch.tensor(scores, dtype=torch.float32),
            components={"exact": torch.tensor([float(v == 1.0) for v in scores], dtype=torch.float32)},
            reasons=reasons,
        )
