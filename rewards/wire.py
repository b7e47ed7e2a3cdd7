"""The reward server's wire format: JSON, with images as base64-encoded PNG.

Request (``POST /score``, ``Content-Type: application/json``), one object whose fields are per-sample lists of
one common length ``B``::

    {"id": "any string, echoed back",                 # optional
     "images": ["<base64 PNG>", ...],                  # image rewards
     "videos": [["<base64 PNG>", ...], ...],           # video rewards: one list of frames per sample
     "prompts": ["a red circle", ...],
     "completions": ["<think>..</think><answer>3</answer>", ...],   # text verifiers
     "ground_truths": ["3", ...],                      # str, number or list of acceptable answers
     "metadata": [{...}, ...]}

Response (200)::

    {"id": "...", "scores": [float, ...], "components": {"name": [float, ...]}, "reasons": [str | null, ...]}

Errors: ``{"error": "message"}`` with 400 (malformed payload or input the reward rejects), 401 (missing or wrong
bearer token), 413 (body over the size limit), 504 (not scored within the per-request timeout), 500 (reward
failure). PNG is lossless, so a tensor image travels exactly as its ``round(255 x)`` uint8 version.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from rewards.base import RewardOutput
from rewards.images import ImageBatch, images_to_uint8

#: the per-sample fields a request may carry; everything else except "id" is rejected
FIELDS: tuple[str, ...] = ("images", "videos", "prompts", "completions", "ground_truths", "metadata")


#: largest decoded image accepted (pixels): a few kB of PNG can declare a huge all-zero image
MAX_IMAGE_PIXELS = 2**26


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


def decode_png(data: Any, where: str) -> Image.Image:
    if not isinstance(data, str):
        raise WireError(f"{where}: expected a base64 PNG string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw), formats=["PNG"])  # reads the header only
        if image.width * image.height > MAX_IMAGE_PIXELS:
            raise WireError(f"{where}: {image.width}x{image.height} exceeds {MAX_IMAGE_PIXELS} pixels")
        image.load()
    except WireError:
        raise
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as error:
        raise WireError(f"{where}: not a base64-encoded PNG ({error})") from error
    return image.convert("RGB")


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
    """A request body (parsed JSON) -> (request id, batch for ``Reward.score``).

    Raises:
        WireError: wrong structure, unknown field, lengths that differ, an image that is not a PNG.
    """
    if not isinstance(payload, dict):
        raise WireError(f"request body must be a JSON object, got {type(payload).__name__}")
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
        if not isinstance(value, list):
            raise WireError(f"{key!r} must be a list (one entry per sample), got {type(value).__name__}")
        if key == "images":
            value = [decode_png(item, f"images[{i}]") for i, item in enumerate(value)]
        elif key == "videos":
            for i, frames in enumerate(value):
                if not isinstance(frames, list) or not frames:
                    raise WireError(f"videos[{i}] must be a non-empty list of base64 PNG frames")
            value = [
                [decode_png(f, f"videos[{i}][{t}]") for t, f in enumerate(v)] for i, v in enumerate(value)
            ]
        elif key == "prompts" and not all(isinstance(p, str) for p in value):
            raise WireError("every prompt must be a string")
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
