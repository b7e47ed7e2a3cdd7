"""Shared pieces of the pool tests: saved tiny models (shapes flow model, VLM), worker factories, requests, a
LoRA "training step", and a stand-in for the vLLM engine (which needs a CUDA GPU)."""

from __future__ import annotations

import functools
import sys
from types import ModuleType, SimpleNamespace

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


def make_requests(
    prefix: str, n: int, counts: tuple[int, ...] = (2,), seed0: int = 0
) -> list[RolloutRequest]:
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
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
            init_lora_weights="gaussian",
        )
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
    return functools.partial(
        VLMRolloutWorker.from_pretrained, vlm_dir, SamplingParams(max_new_tokens=6), num_threads=1
    )


def make_vlm_requests(prefix: str, n: int, counts: list[int]) -> list[RolloutRequest]:
    """``n`` requests over the first ``len(counts)`` questions about one 32x32 scene, seeds ``0..n-1``."""
    scene = Image.new("RGB", (32, 32), (200, 30, 30))
    prompts = [VLMPrompt.from_question(q, [scene], prompt_id=f"q{j}") for j, q in enumerate(QUESTIONS)]
    return [
        RolloutRequest(
            f"{prefix}{i}",
            [p.prompt_id for p in prompts[: len(counts)]],
            prompts[: len(counts)],
            counts,
            seed=i,
            metadata=[{"ground_truth": "two"}] * len(counts),
        )
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def vlm_requests():
    """``make_vlm_requests`` as a fixture."""
    return make_vlm_requests


class _FakeLLM:
    """Stands in for ``vllm.LLM`` (the engine needs vLLM and a CUDA GPU): the calls
    :class:`pipelines.vlm.vllm_backend.VLLMBackend` makes, answered on CPU with vLLM-shaped objects.

    ``apply_model`` hands the function an engine model whose ``load_weights`` records each pushed state dict in
    ``loads`` (``reset_prefix_cache`` counts its calls); ``generate`` tokenizes each prompt with the model's processor (image slots expanded, as vLLM does)
    and draws ``n`` completions of ``max_tokens`` ordinary tokens from ``seed``, each token with log-prob -1.5
    (not the policy's: the trainer's TIS then has a mismatch to weight).
    """

    def __init__(self, model: str, engines: list, **kwargs) -> None:
        from transformers import AutoProcessor

        self.kwargs = kwargs
        self.loads: list[dict[str, torch.Tensor]] = []
        self.prefix_cache_resets = 0
        self.processor = AutoProcessor.from_pretrained(model)
        engines.append(self)

    def apply_model(self, fn):
        def load_weights(weights):
            self.loads.append({name: tensor.detach().clone() for name, tensor in weights})

        return [fn(SimpleNamespace(load_weights=load_weights))]

    def reset_prefix_cache(self) -> bool:
        self.prefix_cache_resets += 1
        return True

    def generate(self, requests, sampling_params, use_tqdm=True):
        p = sampling_params
        tokenizer = self.processor.tokenizer
        banned = set(getattr(p, "logit_bias", None) or {}) | set(tokenizer.all_special_ids)
        vocab = torch.tensor([i for i in range(tokenizer.vocab_size) if i not in banned])
        g = torch.Generator().manual_seed(p.seed)
        outputs = []
        for request in requests:
            images = request.get("multi_modal_data", {}).get("image")
            prompt_ids = self.processor(text=[request["prompt"]], images=images)["input_ids"][0]
            prompt_ids = [int(t) for t in prompt_ids]
            completions = []
            for _ in range(p.n):
                ids = vocab[torch.randint(len(vocab), (p.max_tokens,), generator=g)].tolist()
                completions.append(
                    SimpleNamespace(
                        token_ids=ids,
                        text=tokenizer.decode(ids, skip_special_tokens=True),
                        finish_reason="length",
                        logprobs=[{t: SimpleNamespace(logprob=-1.5, rank=1)} for t in ids],
                    )
                )
            outputs.append(SimpleNamespace(prompt_token_ids=prompt_ids, outputs=completions))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """A ``vllm`` module whose ``LLM`` is :class:`_FakeLLM`, returned by ``import_vllm`` without its GPU check.

    (Faking ``torch.cuda.is_available`` instead would send torch's optimizers to look for a CUDA device.) Returns
    the module; ``module.engines`` lists the engines built, in order.
    """
    from pipelines.vlm import vllm_backend

    engines: list[_FakeLLM] = []
    module = ModuleType("vllm")
    module.engines = engines
    module.LLM = functools.partial(_FakeLLM, engines=engines)
    module.SamplingParams = SimpleNamespace
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr(vllm_backend, "import_vllm", lambda: module)
    return module
