"""The transformers generation backend: shapes, finish reasons, skipping, seeding, weight sync."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model

from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.inputs import VLMPrompt, prepare_prompts
from pipelines.vlm.weight_sync import merged_state_dict


def test_generate_shapes_and_finish_reasons(tiny, prompts):
    model, processor = tiny
    backend = HFBackend(model, processor)
    result = backend.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=0))

    assert result.skipped == []
    assert [(s.prompt_index, s.sample_index) for s in result.samples] == [
        (i, j) for i in range(3) for j in range(2)
    ]
    prepared, _ = prepare_prompts(processor, prompts)
    for sample in result.samples:
        assert sample.prompt_token_ids == prepared[sample.prompt_index].input_ids
        assert sample.prompt_id == prompts[sample.prompt_index].prompt_id
        assert sample.logprobs.shape == (len(sample.completion_token_ids),)
        assert sample.logprobs.dtype == torch.float32
        assert bool((sample.logprobs <= 0).all()) and bool(torch.isfinite(sample.logprobs).all())
        ends_with_stop = sample.completion_token_ids[-1] in backend.stop_token_ids
        assert sample.finish_reason == ("stop" if ends_with_stop else "length")
        if sample.finish_reason == "length":
            assert len(sample.completion_token_ids) == 6
        # trap 1: vision special tokens are never sampled
        assert not set(sample.completion_token_ids) & set(backend.suppressed_token_ids)
        assert sample.weight_version == 0


def test_prompt_that_cannot_fit_is_skipped_with_reason(tiny, prompts, scene, caplog):
    model, processor = tiny
    long_prompt = VLMPrompt.from_question("what colour " * 40, [scene((0, 0, 0))], prompt_id="long")
    backend = HFBackend(model, processor, max_prompt_length=60)
    with caplog.at_level(logging.WARNING):
        result = backend.generate([prompts[0], long_prompt], SamplingParams(max_new_tokens=3))
    assert [s.prompt_index for s in result.samples] == [0]
    assert [(s.index, s.prompt_id) for s in result.skipped] == [(1, "long")]
    assert "image tokens cannot be truncated" in result.skipped[0].reason
    assert "max_prompt_length=60" in result.skipped[0].reason
    assert "skipping prompt 1" in caplog.text


def test_completion_is_cut_at_the_context_limit(tiny, prompts):
    model, processor = tiny
    prepared, _ = prepare_prompts(processor, prompts[:1])
    limit = len(prepared[0].input_ids) + 2
    backend = HFBackend(model, processor, max_model_len=limit)
    result = backend.generate(prompts[:1], SamplingParams(max_new_tokens=8, n=3, seed=1))
    for sample in result.samples:
        assert len(sample.prompt_token_ids) + len(sample.completion_token_ids) <= limit
        assert len(sample.logprobs) == len(sample.completion_token_ids)
        if sample.completion_token_ids[-1] not in backend.stop_token_ids:
            assert sample.finish_reason == "length"
    too_small = HFBackend(model, processor, max_model_len=len(prepared[0].input_ids))
    assert len(too_small.generate(prompts[:1], SamplingParams(max_new_tokens=2)).skipped) == 1


def test_trained_model_stops(tiny, prompts):
    # Overfit a copy on one answer; greedy decoding must then reproduce it and finish with "stop".
    model, processor = tiny
    model = copy.deepcopy(model).train()
    prepared, _ = prepare_prompts(processor, prompts[:1])
    answer = processor.tokenizer("<answer>two</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    features = prepared[0].features
    input_ids = torch.cat([features["input_ids"], torch.tensor([answer])], dim=1)
    labels = torch.full_like(input_ids, -100)
    labels[0, -len(answer) :] = torch.tensor(answer)
    inputs = {
        **features,
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": torch.cat(
            [features["mm_token_type_ids"], torch.zeros(1, len(answer))], 1
        ).long(),
    }
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(40):
        optimizer.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        optimizer.step()
    backend = HFBackend(model.eval(), processor)
    sample = backend.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12)).samples[0]
    assert sample.finish_reason == "stop"
    assert sample.completion_token_ids == answer
    assert sample.text == "<answer>two</answer>"


def test_seeded_generation_is_reproducible_and_leaves_global_rng_alone(tiny, prompts):
    model, processor = tiny
    backend = HFBackend(model, processor, batch_size=2)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = backend.generate(prompts, SamplingParams(max_new_tokens=5, n=2, seed=7))
    assert torch.equal(torch.rand(3), expected_next)
    second = backend.generate(prompts, SamplingParams(max_new_tokens=5, n=2, seed=7))
    assert [s.completion_token_ids for s in first.samples] == [s.completion_token_ids for s in second.samples]


def test_sync_weights_copies_merged_lora_and_bumps_version(tiny, prompts):
    model, processor = tiny
    policy = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # LoRA B starts at zero; make the adapter non-trivial
    rollout_copy = copy.deepcopy(model)
    backend = HFBackend(rollout_copy, processor)
    assert backend.sync_weights(policy) == 1
    assert backend.weight_version == 1
    merged = dict(merged_state_dict(policy))
    for name, tensor in rollout_copy.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=0)
    assert backend.generate(prompts[:1], SamplingParams(max_new_tokens=2)).samples[0].weight_version == 1
    # the backend's own module needs no copy, only a new version
    same = HFBackend(policy, processor)
    assert same.sync_weights(policy) == 1


def test_image_slots_must_match_images(tiny, scene):
    model, processor = tiny
    bad = VLMPrompt(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], images=[scene((0, 0, 0))]
    )
    with pytest.raises(ValueError, match="1 images"):
        HFBackend(model, processor).generate([bad], SamplingParams(max_new_tokens=1))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"n": 0}, "n must"),
        ({"temperature": 0.0, "n": 2}, "greedy"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
