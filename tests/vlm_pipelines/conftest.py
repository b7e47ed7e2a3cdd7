"""Shared tiny models for the VLM pipeline tests: built once per session (building and importing cost seconds)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from pipelines.vlm.inputs import VLMPrompt
from pipelines.vlm.tiny import TinyVLMConfig, build_tiny_vlm

CORPUS = [
    "how many red circles are there? answer as <answer>...</answer>",
    "what colour is the square? answer as <answer>...</answer>",
    "is the blue triangle left of the green circle? answer as <answer>...</answer>",
    "<answer>two</answer>",
    "<answer>blue</answer>",
    "<answer>yes</answer>",
    "<answer>no</answer>",
] * 20


def _scene(colour: tuple[int, int, int], size: int = 64) -> Image.Image:
    """A grey scene with one filled square, enough for the processor and model."""
    image = Image.new("RGB", (size, size), (128, 128, 128))
    ImageDraw.Draw(image).rectangle((size // 4, size // 4, size // 2, size // 2), fill=colour)
    return image


@pytest.fixture(scope="session")
def scene():
    """``scene(colour, size=64)`` -> a PIL scene (a fixture, as test modules cannot import each other)."""
    return _scene


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    """The texts the tiny tokenizer was trained on."""
    return CORPUS


@pytest.fixture(scope="session")
def tiny():
    """(model, processor): the tiny Qwen2.5-VL with random weights, fp32, eval mode."""
    # One thread: on a shared, oversubscribed CPU a second thread makes every parallel region wait for it.
    torch.set_num_threads(1)
    return build_tiny_vlm(CORPUS, TinyVLMConfig(seed=0))


@pytest.fixture(scope="session")
def prompts() -> list[VLMPrompt]:
    """Three prompts: a 64x64 scene, a 32x32 scene (upsampled by the processor), and a text-only question."""
    return [
        VLMPrompt.from_question("how many red circles are there?", [_scene((220, 20, 20))], prompt_id="a"),
        VLMPrompt.from_question(
            "what colour is the square?", [_scene((20, 20, 220), size=32)], prompt_id="b"
        ),
        VLMPrompt.from_question("is the blue triangle left of the green circle?", prompt_id="c"),
    ]
