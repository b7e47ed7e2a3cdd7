"""Log-prob / entropy recomputation: agreement with the rollout, chunking, entropy formulas, LoRA training."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.logprobs import build_scoring_batch, chunked_token_stats, completion_token_stats


def _score(model, processor, result, prompts, **kwargs):
    batch = build_scoring_batch(
        processor,
        [s.prompt_token_ids for s in result.samples],
        [s.completion_token_ids for s in result.samples],
        [prompts[s.prompt_index].images for s in result.samples],
    )
    return batch, completion_token_stats(model, batch, **kwargs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=0),
        SamplingParams(temperature=0.0, max_new_tokens=8),
        SamplingParams(temperature=0.7, max_new_tokens=8, n=2, seed=1),
    ],
    ids=["sample-t1", "greedy", "sample-t0.7"],
)
def test_recomputed_logprobs_match_behaviour_logprobs(tiny, prompts, params):
    model, processor = tiny
    backend = HFBackend(model, processor)
    result = backend.generate(prompts, params)
    temperature = params.temperature or 1.0
    with torch.no_grad():
        _, stats = _score(
            model,
            processor,
            result,
            prompts,
            temperature=temperature,
            suppressed_token_ids=backend.suppressed_token_ids,
        )
    for row, sample in enumerate(result.samples):
        T = len(sample.completion_token_ids)
        assert bool(stats.mask[row, :T].all()) and not bool(stats.mask[row, T:].any())
        torch.testing.assert_close(stats.logprobs[row, :T], sample.logprobs, rtol=0, atol=1e-5)


def test_text_only_batch_matches(tiny, prompts):
    # Without images the scorer supplies generate()'s attention-mask positions itself (left padding).
    model, processor = tiny
    text_only = [prompts[2], type(prompts[2]).from_question("what colour?")]
    backend = HFBackend(model, processor)
    result = backend.generate(text_only, SamplingParams(max_new_tokens=6, seed=3))
    with torch.no_grad():
        _, stats = _score(
            model, processor, result, text_only, suppressed_token_ids=backend.suppressed_token_ids
        )
    for row, sample in enumerate(result.samples):
        torch.testing.assert_close(
            stats.logprobs[row, : len(sample.logprobs)], sample.logprobs, rtol=0, atol=1e-5
        )


def test_chunked_equals_unchunked(tiny, prompts):
    model, processor = tiny
    result = HFBackend(model, processor).generate(prompts, SamplingParams(max_new_tokens=9, n=2, seed=4))
    with torch.no_grad():
        full = _score(model, processor, result, prompts, chunk_size=10_000)[1]
        for chunk_size in (1, 4):
            chunked = _score(model, processor, result, prompts, chunk_size=chunk_size)[1]
            for name in ("logprobs", "entropy", "sampled_entropy"):
                torch.testing.assert_close(getattr(chunked, name), getattr(full, name), rtol=1e-6, atol=1e-6)


def test_entropy_against_hand_computation():
    torch.manual_seed(0)
    B, T, H, V = 2, 5, 8, 11
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H)
    targets = torch.randint(0, V - 2, (B, T))
    suppressed = [V - 2, V - 1]
    temperature = 0.8
    logprobs, entropy, sampled_entropy = chunked_token_stats(
        hidden, head, targets, temperature=temperature, chunk_size=2, suppressed_token_ids=suppressed
    )
    # by hand: softmax over the allowed tokens only
    logits = head(hidden)[..., : V - 2] / temperature
    p = logits.softmax(-1)
    expected_entropy = -(p * p.log()).sum(-1)
    expected_logprob = p.log().gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p_sampled = expected_logprob.exp()
    torch.testing.assert_close(entropy, expected_entropy)
    torch.testing.assert_close(logprobs, expected_logprob)
    torch.testing.assert_close(sampled_entropy, -p_sampled * p_sampled.log())
    # a uniform distribution over the V - 2 allowed tokens has entropy log(V - 2)
    zero_head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.zeros_(zero_head.weight)
    _, uniform_entropy, _ = chunked_token_stats(hidden, zero_head, targets, suppressed_token_ids=suppressed)
    torch.testing.assert_close(uniform_entropy, torch.full((B, T), float(torch.log(torch.tensor(V - 2.0)))))


def test_chunked_gradients_equal_unchunked_gradients():
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 13, bias=False)
    hidden = torch.randn(3, 7, 6, requires_grad=True)
    targets = torch.randint(0, 13, (3, 7))
    grads = []
    for chunk_size in (100, 3):
        hidden.grad = None
        head.zero_grad()
        logprobs, entropy, _ = chunked_token_stats(hidden, head, targets, chunk_size=chunk_size)
        assert not entropy.requires_grad
        logprobs.sum().backward()
        grads.append((hidden.grad.clone(), head.weight.grad.clone()))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])


def test_scoring_rejects_image_tokens_in_completion(tiny, prompts):
    _, processor = tiny
    with pytest.raises(ValueError, match="suppress vision tokens"):
        build_scoring_batch(
            processor,
            [processor(text=["x"], return_tensors="pt")["input_ids"][0].tolist()],
            [[processor.image_token_id, 5]],
            [[]],
        )
    with pytest.raises(ValueError, match="at least one token"):
        build_scoring_batch(processor, [[1, 2]], [[]], [[]])


def test_lora_step_changes_only_lora_parameters(tiny, prompts):
    model, processor = tiny
    policy = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"])
    )
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # so lora_A gets a gradient on the first step too
    result = HFBackend(policy, processor).generate(prompts, SamplingParams(max_new_tokens=5, n=2, seed=5))
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}
    policy.train()
    optimizer = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    _, stats = _score(policy, processor, result, prompts, chunk_size=2)
    advantages = torch.tensor([1.0, -1.0] * 3).unsqueeze(1)  # [B, 1]
    loss = -(stats.logprobs * advantages).sum() / stats.mask.sum()
    loss.backward()
    optimizer.step()
    changed = {name for name, p in policy.named_parameters() if not torch.equal(p.detach(), before[name])}
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert changed == trainable
