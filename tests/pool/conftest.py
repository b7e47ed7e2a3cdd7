"""Shared pieces of the pool tests: saved tiny models (shapes flow model, VLM), worker factories, requests, and a
LoRA "training step"."""

from __future__ import annotations

import functools

import pytest
import torch
from PIL import Image

from pipelines.flow.adapters import load_adapter
from pipelines.flow.rollout import SamplingConfig
from pipelines.flow.tiny import build_shapes_pipeline
from pipelines.pool.flow_worker import FlowRolloutWorker
from pipelines.pool.protocol import RolloutRequest
from pipelines.pool.vlm_worker import VLMRolloutWorker
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.inputs import VLMPrompt
from pipelines.vlm.tiny import TinyVLMConfig, build_tiny_vlm

PROMPTS = [
    "a photo of a red circle",
    "a photo of two blue squares",
    "a photo of a green triangle",
    "a photo of a yellow circle",
]
#: 4 steps at 32x32: a request of a few samples takes tens of milliseconds on one CPU thread
SAMPLING = SamplingConfig(num_steps=4, height=32, width=32)


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # The CPU is shared and tiny models gain nothing from threads (measured: 2 threads ran 30x slower under load).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A random tiny shapes model (1 layer), saved as a diffusers directory."""
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(PROMPTS, num_layers=1, num_attention_heads=2, attention_head_dim=8)
    path = tmp_path_factory.mktemp("pool_shapes")
    pipe.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def flow_factory(shapes_dir):
    """A picklable factory of flow rollout workers (what Ray actors call to build their worker)."""
    return functools.partial(FlowRolloutWorker.from_pretrained, "shapes", shapes_dir, SAMPLING, num_threads=1)


def make_requests(prefix: str, n: int, counts: tuple[int, ...] = (2,), seed0: int = 0) -> list[RolloutRequest]:
    """``n`` requests of ``len(counts)`` prompts each, seeds ``seed0, seed0+1, ...``."""
    return [
        RolloutRequest(
            request_id=f"{prefix}{i}",
            prompt_ids=[f"p{(i + j) % len(PROMPTS)}" for j in range(len(counts))],
            prompts=[PROMPTS[(i + j) % len(PROMPTS)] for j in range(len(counts))],
            counts=list(counts),
            seed=seed0 + i,
        )
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def requests_factory():
    """``make_requests`` as a fixture (test modules cannot import each other under importlib mode)."""
    return make_requests


@pytest.fixture
def trainer_adapter(shapes_dir):
    """``train(step)``-able policy: the model with a LoRA whose factors a fake optimizer step moves.

    Returns ``(adapter, step)``; ``step(k)`` sets the LoRA factors to seeded random values (a stand-in for
    ``k`` optimizer steps that changes the policy reproducibly).
    """
    from peft import LoraConfig

    adapter = load_adapter("shapes", shapes_dir)
    transformer = adapter.transformer
    transformer.requires_grad_(False)
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                   init_lora_weights="gaussian")
    )

    def step(k: int) -> None:
        g = torch.Generator().manual_seed(1000 + k)
        with torch.no_grad():
            for name, p in transformer.named_parameters():
                if ".lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))

    return adapter, step


QUESTIONS = ["how many red circles are there?", "what colour is the square?", "is the circle left?"]
VLM_CORPUS = [*QUESTIONS, "<answer>two</answer>", "<answer>blue</answer>", "<answer>yes</answer>"] * 20


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """A random tiny Qwen2.5-VL with its processor, saved with ``save_pretrained``."""
    path = tmp_path_factory.mktemp("pool_vlm")
    build_tiny_vlm(VLM_CORPUS, TinyVLMConfig(seed=0), out_dir=path)
    return str(path)


@pytest.fixture(scope="session")
def vlm_factory(vlm_dir):
    """A picklable factory of VLM rollout workers (transformers backend, 6 new tokens)."""
    return functools.partial(VLMRolloutWorker.from_pretrained, vlm_dir, SamplingParams(max_new_tokens=6),
                             num_threads=1)


def make_vlm_requests(prefix: str, n: int, counts: list[int]) -> list[RolloutRequest]:
    """``n`` requests over the first ``len(counts)`` questions about one 32x32 scene, seeds ``0..n-1``."""
    scene = Image.new("RGB", (32, 32), (200, 30, 30))
    prompts = [VLMPrompt.from_question(q, [scene], prompt_id=f"q{j}") for j, q in enumerate(QUESTIONS)]
    return [
        RolloutRequest(f"{prefix}{i}", [p.prompt_id for p in prompts[: len(counts)]], prompts[: len(counts)],
                       counts, seed=i, metadata=[{"ground_truth": "two"}] * len(counts))
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def vlm_requests():
    """``make_vlm_requests`` as a fixture."""
    return make_vlm_requests
