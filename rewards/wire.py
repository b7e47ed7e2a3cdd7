"""The reward server's wire format: JSON, with images as base64-encoded PNG.

Request (``POST /score``, ``Content-Type: application/json``), one object whose fields are per-sample lists of
one common length ``B``::

    {"id": "any string, echoed back",                 # optional
     "images": ["<base64 PNG>", ...],                  # image rewards
     "videos": [["<base64 PNG>", ...], ...],           # video rewards: one list of frames per sample
     "prompts": ["a red circle", ...],
     "completions": ["<think>..</think><answer>3</answer>", ...],   # text verifiers
     "ground_truths": ["3", ...],                      # str, number or list of acceptable answers
     "references": ["red 1. red 2", ...],              # reference solutions (reasoning_steps), str or null
     "metadata": [{...}, ...]}                         # one object (or null) per sample

Response (200)::

    {"id": "...", "scores": [float, ...], "components": {"name": [float, ...]}, "reasons": [str | null, ...]}

Errors: ``{"error": "one-line message"}`` with 400 (malformed payload or input the reward rejects), 401
(missing or wrong bearer token), 408 (request not received within the server's read timeout), 413 (body or
decoded pixels over the per-request limit), 503 (the server's in-flight budget or connection cap is full: retry
later), 504 (not scored within the per-request timeout), 500 (reward failure). PNG is lossless, so a tensor
image travels exactly as its ``round(255 x)`` uint8 version.

Decoded size is known before decoding: a PNG's first chunk (IHDR) holds its width and height, and it sits in
the first 24 bytes of the file, so :func:`decoded_pixels` reads only the first 32 base64 characters of each
image. A few kB of PNG can declare a 8192 x 8192 image (a decompression bomb); such requests are refused from
their headers.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from rewards.base import RewardOutput
from rewards.images import ImageBatch, images_to_uint8, pil_to_rgb

#: the per-sample fields a request may carry; everything else except "id" is rejected
FIELDS: tuple[str, ...] = (
    "images",
    "videos",
    "prompts",
    "completions",
    "ground_truths",
    "references",
    "metadata",
)


#: the eight bytes every PNG file starts with
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class WireError(ValueError):
    """A payload that does not follow the wire format (the server answers 400)."""


def encode_png(images: ImageBatch) -> list[str]:
    """Images (list of PIL or ``[B, 3, H, W]`` in [0, 1]) -> base64 PNG strings."""
    out = []
    for array in images_to_uint8(images):
        buffer = io.BytesIO()
        # compress_level 1: the payload crosses a LAN or loopback, encode time matters more than bytes
        Image.fromarray(array).save(buffer, format="PNG", compress_level=1)
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def png_size(data: Any, where: str) -> tuple[int, int]:
    """``(width, height)`` of a base64 PNG from its IHDR chunk, decoding only the first 32 base64 characters.

    Layout of a PNG's first 24 bytes: signature (8), IHDR length (4), ``b"IHDR"`` (4), width (4), height (4),
    both big-endian.

    Raises:
        WireError: not a string, or not the start of a PNG.
    """
    if not isinstance(data, str):
        raise WireError(f"{where}: expected a base64 PNG string, got {type(data).__name__}")
    try:
        head = base64.b64decode(data[:32], validate=True)
    except (binascii.Error, ValueError) as error:
        raise WireError(f"{where}: not a base64-encoded PNG ({error})") from None
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        raise WireError(f"{where}: not a base64-encoded PNG (no PNG signature and IHDR header)")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _image_fields(payload: dict[str, Any]) -> list[tuple[Any, str]]:
    """Every (base64 PNG, location) of a request, images then video frames, with the structure checked."""
    out: list[tuple[Any, str]] = []
    images = payload.get("images")
    if images is not None:
        if not isinstance(images, list):
            raise WireError(f"'images' must be a list (one entry per sample), got {type(images).__name__}")
        out += [(item, f"images[{i}]") for i, item in enumerate(images)]
    videos = payload.get("videos")
    if videos is not None:
        if not isinstance(videos, list):
            raise WireError(f"'videos' must be a list (one entry per sample), got {type(videos).__name__}")
        for i, frames in enumerate(videos):
            if not isinstance(frames, list) or not frames:
                raise WireError(f"videos[{i}] must be a non-empty list of base64 PNG frames")
            out += [(frame, f"videos[{i}][{t}]") for t, frame in enumerate(frames)]
    return out


def decoded_pixels(payload: Any) -> int:
    """Pixels a request's images and video frames will decode to, ``sum(width * height)``, read from the PNG
    headers without decoding anything (see the module docstring).

    Raises:
        WireError: the body is not a JSON object, or an image is not a base64 PNG.
    """
    if not isinstance(payload, dict):
        raise WireError(f"request body must be a JSON object, got {type(payload).__name__}")
    total = 0
    for data, where in _image_fields(payload):
        width, height = png_size(data, where)
        total += width * height
    return total


def decode_png(data: Any, where: str) -> Image.Image:
    """A base64 PNG -> 8-bit RGB PIL image (16-bit grey scaled, :func:`rewards.images.pil_to_rgb`; callers bound
    its size first with :func:`decoded_pixels`).

    Raises:
        WireError: not a base64-encoded PNG.
    """
    png_size(data, where)  # a clear error for what is not a PNG at all
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw), formats=["PNG"])  # reads the header only
        image.load()
    except WireError:
        raise
    # (Pillow raises SyntaxError for a PNG whose chunks are broken)
    except (binascii.Error, ValueError, OSError, SyntaxError, Image.DecompressionBombError) as error:
        raise WireError(f"{where}: not a base64-encoded PNG ({error})") from error
    try:
        return pil_to_rgb(image, where)  # a 16-bit grey PNG is scaled to 8 bits, not clipped to white
    except ValueError as error:
        raise WireError(str(error)) from None


def encode_batch(batch: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
    """A reward batch (the keyword arguments of ``Reward.score``) -> a JSON-serialisable request."""
    unknown = sorted(set(batch) - set(FIELDS))
    if unknown:
        raise ValueError(f"cannot send batch fields {unknown} to a reward server; allowed: {list(FIELDS)}")
    payload: dict[str, Any] = {} if request_id is None else {"id": request_id}
    for key, value in batch.items():
        if value is None:
            continue
        if key == "images":
            payload[key] = encode_png(value)
        elif key == "videos":
            videos = value.unbind(0) if isinstance(value, torch.Tensor) else value
            payload[key] = [encode_png(frames) for frames in videos]
        else:
            payload[key] = list(value)
    return payload


def batch_length(batch: dict[str, Any]) -> int:
    """The common length ``B`` of the per-sample fields of a batch."""
    lengths = {len(v) for k, v in batch.items() if k in FIELDS and v is not None}
    if len(lengths) != 1:
        raise ValueError(f"batch fields must be lists of one common length, got lengths {sorted(lengths)}")
    return lengths.pop()


def decode_batch(payload: Any) -> tuple[str | None, dict[str, Any]]:
    """A request body (parsed JSON) -> (request id, batch for ``Reward.score``). Decodes every image: bound
    the request's :func:`decoded_pixels` first.

    Raises:
        WireError: wrong structure, unknown field, lengths that differ, an image that is not a PNG.
    """
    decoded_pixels(payload)  # checks that the body is an object whose images are PNGs
    request_id = payload.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise WireError("'id' must be a string")
    unknown = sorted(set(payload) - {*FIELDS, "id"})
    if unknown:
        raise WireError(f"unknown fields {unknown}; allowed: {[*FIELDS, 'id']}")
    batch: dict[str, Any] = {}
    for key in FIELDS:
        if key not in payload:
            continue
        value = payload[key]
        if not isinstance(value, list):  # (images and videos were checked by decoded_pixels)
            raise WireError(f"{key!r} must be a list (one entry per sample), got {type(value).__name__}")
        if key == "images":
            value = [decode_png(item, f"images[{i}]") for i, item in enumerate(value)]
        elif key == "videos":
            value = [
                [decode_png(f, f"videos[{i}][{t}]") for t, f in enumerate(v)] for i, v in enumerate(value)
            ]
        elif key == "prompts" and not all(isinstance(p, str) for p in value):
            raise WireError("every prompt must be a string")
        elif key == "references" and not all(r is None or isinstance(r, str) for r in value):
            raise WireError("every reference must be a string or null")
        elif key == "metadata":
            for index, meta in enumerate(value):
                # rewards read metadata[i].get(...), after checking for null: anything else fails there, a 500
                if meta is not None and not isinstance(meta, dict):
                    raise WireError(
                        f"metadata[{index}]: expected a JSON object or null (one per sample), got "
                        f"{json.dumps(meta)[:80]}"
                    )
        elif key == "ground_truths":
            for index, truth in enumerate(value):
                if not _is_answer(truth):
                    raise WireError(
                        f"ground_truths[{index}]: expected a string, a finite number or a non-empty list of them, "
                        f"got {json.dumps(truth)[:80]}"
                    )
        batch[key] = value
    if not batch:
        raise WireError(f"request has no data; send at least one of {list(FIELDS)}")
    try:
        size = batch_length(batch)
    except ValueError as error:
        raise WireError(str(error)) from error
    if size == 0:
        raise WireError("empty batch")
    return request_id, batch


def _is_answer(truth: Any) -> bool:
    """A ground truth a verifier can compare against: a string, a finite number, or a non-empty list of those
    (the acceptable answers). A null, an object or NaN is a client's bug that would score 0 as a wrong answer."""
    if isinstance(truth, list):
        return bool(truth) and all(_is_single_answer(item) for item in truth)
    return _is_single_answer(truth)


def _is_single_answer(truth: Any) -> bool:
    if isinstance(truth, bool):  # (JSON true is no answer a verifier reads)
        return False
    if isinstance(truth, int | float):
        return math.isfinite(truth)
    return isinstance(truth, str)


def _floats(values: torch.Tensor) -> list[float | None]:
    # JSON has no NaN/inf: send null, decoded back to NaN
    return [v if math.isfinite(v) else None for v in values.detach().float().cpu().tolist()]


def encode_output(output: RewardOutput, request_id: str | None = None) -> dict[str, Any]:
    """A :class:`RewardOutput` -> a JSON-serialisable response."""
    return {
        "id": request_id,
        "scores": _floats(output.scores),
        "components": {k: _floats(v) for k, v in output.components.items()},
        "reasons": output.reasons,
    }


def _tensor(values: Sequence[float | None]) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def decode_output(data: Any) -> RewardOutput:
    """A response body (parsed JSON) -> :class:`RewardOutput`.

    Raises:
        WireError: the response does not follow the wire format.
    """
    try:
        return RewardOutput(
            scores=_tensor(data["scores"]),
            components={k: _tensor(v) for k, v in (data.get("components") or {}).items()},
            reasons=data.get("reasons"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise WireError(f"malformed reward server response: {error}") from error
