"""The VLM worker in a pool: seeded samples as the backend gives them, LoRA broadcast, APRIL partial rollouts."""

from __future__ import annotations

import torch

from pipelines.pool.pool import PoolBatch, RolloutPool
from pipelines.pool.protocol import RolloutRequest
from pipelines.pool.weights import make_update
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.hf_backend import HFBackend


def assert_same_samples(expected: PoolBatch, got: PoolBatch) -> None:
    """Two pool batches of VLM requests hold the same completions with the same log-probs, request by request."""
    for a, b in zip(expected.results, got.results, strict=True):
        assert [s.completion_token_ids for s in a.output.samples] == [
            s.completion_token_ids for s in b.output.samples
        ]
        assert all(
            torch.equal(x.logprobs, y.logprobs)
            for x, y in zip(a.output.samples, b.output.samples, strict=True)
        )


def _expected(backend: HFBackend, request: RolloutRequest) -> list[list[int]]:
    """The worker's documented recipe: one ``generate`` per distinct count, seeds drawn from the request seed."""
    groups: dict[int, list[int]] = {}
    for index, count in enumerate(request.counts):
        groups.setdefault(count, []).append(index)
    seeds = torch.randint(0, 2**31 - 1, (len(groups),), generator=torch.Generator().manual_seed(request.seed))
    by_prompt: dict[int, list[list[int]]] = {}
    for (count, indices), seed in zip(groups.items(), seeds.tolist(), strict=True):
        result = backend.generate(
            [request.prompts[i] for i in indices], SamplingParams(max_new_tokens=6, n=count, seed=seed)
        )
        for s in result.samples:
            by_prompt.setdefault(indices[s.prompt_index], []).append(s.completion_token_ids)
    return [ids for index in sorted(by_prompt) for ids in by_prompt[index]]


def test_vlm_pool_samples_and_lora_broadcast(vlm_factory, vlm_dir, vlm_requests):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText, AutoProcessor

    requests = vlm_requests("v", 2, [2, 1, 2])
    processor = AutoProcessor.from_pretrained(vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir).eval()
    with RolloutPool(vlm_factory) as pool:
        batch = pool.run(requests, timeout=120)
        for request, result in zip(requests, batch.results, strict=True):
            samples = result.output.samples
            assert result.num_samples == 5 and [s.prompt_index for s in samples] == [0, 0, 1, 2, 2]
            assert [s.completion_token_ids for s in samples] == _expected(
                HFBackend(model, processor), request
            )
            assert result.reward_inputs["ground_truths"] == ["two"] * 5
        # the trainer's policy is a PeftModel; the worker gets the LoRA under the transformers names
        policy = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if ".lora_" in name:
                    p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        update = make_update(policy, version=1)
        assert update.kind == "lora" and not any(k.startswith("base_model.") for k in update.state)
        pool.broadcast(update)
        (after,) = pool.run(vlm_requests("w", 1, [2, 1, 2]), timeout=120).results
    assert after.weight_version == 1 and {s.weight_version for s in after.output.samples} == {1}
    expected = _expected(HFBackend(policy, processor), vlm_requests("w", 1, [2, 1, 2])[0])
    assert [s.completion_token_ids for s in after.output.samples] == expected
    # same request and seed as v0 at version 0: the broadcast LoRA changed what is sampled
    assert expected != [s.completion_token_ids for s in batch.results[0].output.samples]


def test_vlm_partial_rollouts_resume_next_step(vlm_factory, vlm_requests):
    requests = vlm_requests("a", 10, [2])
    with RolloutPool(vlm_factory, max_staleness=1) as pool:
        pool.submit(requests)  # APRIL: over-provision 20 samples for a target of 4
        first = pool.collect(min_samples=4, timeout=120)
        assert 4 <= first.num_samples < 20
        assert pool.pending(step=1) == 20 - first.num_samples  # unfinished requests kept, not discarded
        second = pool.collect(step=1, timeout=120)
    ids = [r.request_id for r in first.results + second.results]
    assert sorted(ids) == sorted(f"a{i}" for i in range(10))  # each exactly once
    assert second.version == 0 and set(second.lags) == {0}


def test_vlm_concurrent_inprocess_workers_sample_as_one(vlm_factory, vlm_requests):
    # two worker threads generate at once: each seeded generate must draw from its own stream, not interleave
    # with the other's on the process-global RNG (hf_backend takes turns)
    requests = vlm_requests("c", 4, [4, 4])
    with RolloutPool(vlm_factory) as pool:
        one = pool.run(requests, timeout=120)
    with RolloutPool(vlm_factory, num_workers=2, max_inflight=1) as pool:
        two = pool.run(requests, timeout=120)
    assert {r.worker for r in two.results} == {0, 1}  # both workers generated
    assert_same_samples(one, two)
