"""The vLLM backend's parts that run without a GPU: request building, sampling arguments, result parsing, the
weight-sync payload, and the error without vLLM. The engine itself is replaced by vLLM-shaped output objects."""

from __future__ import annotations

import copy
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.inputs import prepare_prompts
from pipelines.vlm.vllm_backend import (
    SUPPRESS_BIAS,
    VLLMBackend,
    build_requests,
    import_vllm,
    parse_outputs,
    sampling_kwargs,
)
from pipelines.vlm.weight_sync import merged_state_dict


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install mmrl\[vllm\]"):
        import_vllm()
    with pytest.raises(ImportError, match="CUDA GPU"):
        VLLMBackend("Qwen/Qwen2.5-VL-3B-Instruct")


def test_build_requests_carries_text_and_images(tiny, prompts):
    _, processor = tiny
    prepared, _ = prepare_prompts(processor, prompts)
    requests = build_requests(prepared)
    assert len(requests) == 3
    for request, prompt in zip(requests, prompts, strict=True):
        # one unexpanded image slot per image: vLLM expands it with its own Qwen-VL processor
        assert request["prompt"].count("<|image_pad|>") == len(prompt.images)
        assert request["prompt"].endswith("<|im_start|>assistant\n")
        if prompt.images:
            assert request["multi_modal_data"]["image"] == prompt.images
        else:
            assert "multi_modal_data" not in request


def test_sampling_kwargs():
    kwargs = sampling_kwargs(
        SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=7, n=4, seed=3), [9, 4]
    )
    assert kwargs["n"] == 4 and kwargs["max_tokens"] == 7 and kwargs["seed"] == 3
    assert kwargs["temperature"] == 0.9 and kwargs["top_p"] == 0.95 and kwargs["top_k"] == -1
    assert kwargs["logprobs"] == 0 and kwargs["repetition_penalty"] == 1.0
    assert kwargs["logit_bias"] == {9: SUPPRESS_BIAS, 4: SUPPRESS_BIAS}
    assert "logit_bias" not in sampling_kwargs(SamplingParams(), [])


def _completion(token_ids, logprobs, finish_reason, text="t"):
    # vLLM: one {token_id: Logprob} mapping per generated token; the sampled token plus up to `logprobs` others.
    steps = [
        {token: SimpleNamespace(logprob=lp, rank=1), token + 1: SimpleNamespace(logprob=lp - 1.0, rank=2)}
        for token, lp in zip(token_ids, logprobs, strict=True)
    ]
    return SimpleNamespace(token_ids=token_ids, logprobs=steps, finish_reason=finish_reason, text=text)


def test_parse_outputs(tiny, prompts):
    _, processor = tiny
    prepared, _ = prepare_prompts(processor, prompts[:2])
    outputs = [
        SimpleNamespace(
            prompt_token_ids=prepared[0].input_ids,
            outputs=[
                _completion([5, 6, 7], [-0.5, -1.0, -0.1], "stop"),
                _completion([8, 9], [-2.0, -3.0], "length"),
            ],
        ),
        SimpleNamespace(
            prompt_token_ids=prepared[1].input_ids, outputs=[_completion([4], [-0.25], "stop", "x")]
        ),
    ]
    samples = parse_outputs(outputs, prepared, weight_version=3)
    assert [(s.prompt_index, s.sample_index, s.finish_reason) for s in samples] == [
        (0, 0, "stop"),
        (0, 1, "length"),
        (1, 0, "stop"),
    ]
    torch.testing.assert_close(samples[0].logprobs, torch.tensor([-0.5, -1.0, -0.1]))
    assert samples[1].completion_token_ids == [8, 9]
    assert samples[2].text == "x" and samples[2].prompt_id == "b"
    assert samples[0].prompt_token_ids == prepared[0].input_ids
    assert all(s.weight_version == 3 for s in samples)

    aborted = [SimpleNamespace(prompt_token_ids=[1], outputs=[_completion([1], [-1.0], "abort")])]
    with pytest.raises(RuntimeError, match="abort"):
        parse_outputs(aborted, prepared[:1], weight_version=0)
    no_logprobs = [
        SimpleNamespace(
            prompt_token_ids=[1],
            outputs=[SimpleNamespace(token_ids=[1], logprobs=None, finish_reason="stop", text="")],
        )
    ]
    with pytest.raises(RuntimeError, match="logprobs=0"):
        parse_outputs(no_logprobs, prepared[:1], weight_version=0)


def test_weight_sync_payload_merges_lora_under_hf_names(tiny):
    model, _ = tiny
    hf_names = set(model.state_dict())
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "qkv"], modules_to_save=["lm_head"]
    )
    policy = get_peft_model(copy.deepcopy(model), config)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    with torch.no_grad():
        policy.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    payload = dict(merged_state_dict(policy))

    assert set(payload) == hf_names  # the names vLLM's load_weights maps from
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    for name, tensor in payload.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)
    # one layer by the formula W + (alpha / r) * B @ A
    layer = policy.base_model.model.model.language_model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(payload["model.language_model.layers.0.self_attn.q_proj.weight"], expected)
    torch.testing.assert_close(payload["lm_head.weight"], model.lm_head.weight + 1.0)
    # the training model is untouched (out-of-place merge)
    torch.testing.assert_close(
        layer.base_layer.weight, model.model.language_model.layers[0].self_attn.q_proj.weight
    )
    # with the adapter disabled, the payload is the base model
    with policy.disable_adapter():
        base_payload = dict(merged_state_dict(policy))
    torch.testing.assert_close(
        base_payload["model.language_model.layers.0.self_attn.q_proj.weight"],
        model.model.language_model.layers[0].self_attn.q_proj.weight,
    )
    # ... including the modules_to_save layer: its frozen original, not the trained copy (+1)
    assert set(base_payload) == hf_names
    torch.testing.assert_close(base_payload["lm_head.weight"], model.lm_head.weight)


@pytest.mark.parametrize(
    ("engine_kwargs", "environment", "named"),
    [
        ({"tensor_parallel_size": 2}, "0", "tensor_parallel_size=2"),
        ({"pipeline_parallel_size": 2}, "0", "pipeline_parallel_size=2"),
        ({"distributed_executor_backend": "mp"}, "0", "distributed_executor_backend='mp'"),
        ({}, "1", "VLLM_ENABLE_V1_MULTIPROCESSING='1'"),
    ],
)
def test_an_engine_outside_this_process_is_refused(engine_kwargs, environment, named, monkeypatch):
    """Weight sync hands load_weights a generator through LLM.apply_model, which only an in-process engine
    runs without pickling it: a multi-process engine is refused before it is built, naming what moved it."""
    import pipelines.vlm.vllm_backend as backend_module

    built = []
    monkeypatch.setattr(
        backend_module, "import_vllm", lambda: SimpleNamespace(LLM=lambda **kw: built.append(kw))
    )
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", environment)
    family = SimpleNamespace(suppressed_token_ids=lambda tokenizer: [])
    processor = SimpleNamespace(tokenizer=None)
    with pytest.raises(ValueError, match=re.escape(named)):
        VLLMBackend("model", processor, family=family, engine_kwargs=engine_kwargs)
    assert built == []
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")
    VLLMBackend("model", processor, family=family, engine_kwargs={"tensor_parallel_size": 1})
    assert len(built) == 1 and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
