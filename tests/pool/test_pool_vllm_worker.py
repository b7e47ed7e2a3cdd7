"""The VLM worker on the vLLM backend: weight updates land in its CPU copy of the model and reach the engine with
the LoRA merged, once per update, versions in step; the clear error without vLLM. Only the engine is replaced
(``fake_vllm``: vLLM needs a CUDA GPU); the worker, the backend and the weight payloads are the real ones."""

from __future__ import annotations

import copy
import functools
import sys
import time
from dataclasses import replace

import pytest
import torch

from mmrl.vlm.pooled import PooledVLMWorker
from pipelines.pool.pool import RolloutPool
from pipelines.pool.vlm_worker import VLMRolloutWorker
from pipelines.pool.weights import make_update
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.vllm_backend import VLLMBackend

PARAMS = SamplingParams(max_new_tokens=5)
Q_PROJ = "model.language_model.layers.0.self_attn.q_proj.weight"


def _policy(vlm_dir: str):
    """The trainer's policy: a ``PeftModel`` with a LoRA (alpha / r = 2) on q_proj and v_proj."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _train(policy, k: int) -> None:
    """A stand-in for ``k`` optimizer steps: seeded random LoRA factors (B too, so the LoRA is not a no-op)."""
    g = torch.Generator().manual_seed(100 + k)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def _check_merged(pushed: dict[str, torch.Tensor], policy) -> None:
    """``pushed`` is the policy with its LoRA merged, under the transformers checkpoint's names."""
    reference = copy.deepcopy(policy).merge_and_unload().state_dict()
    assert pushed.keys() == reference.keys()
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)
    # and one layer by the formula W + (alpha / r) B @ A
    layer = policy.base_model.model.model.language_model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(pushed[Q_PROJ], expected)


def test_lora_updates_reach_the_engine_merged(fake_vllm, vlm_dir, vlm_requests):
    worker = VLMRolloutWorker.from_vllm(
        vlm_dir,
        PARAMS,
        torch_dtype=torch.float32,
        max_model_len=512,
        gpu_memory_utilization=0.2,
        dtype="float32",
        seed=7,
    )
    (engine,) = fake_vllm.engines
    assert isinstance(worker.backend, VLLMBackend)
    assert {k: engine.kwargs[k] for k in ("max_model_len", "gpu_memory_utilization", "dtype", "seed")} == {
        "max_model_len": 512,
        "gpu_memory_utilization": 0.2,
        "dtype": "float32",
        "seed": 7,
    }
    assert engine.loads == []  # the engine loaded the checkpoint, which is what the CPU copy holds
    assert next(worker.model.parameters()).device.type == "cpu"

    policy = _policy(vlm_dir)
    _train(policy, 1)
    assert worker.load_weights(make_update(policy, version=1)) == 1
    (pushed,) = engine.loads
    _check_merged(pushed, policy)

    # samples are the engine's, stamped with the worker's version
    (request,) = vlm_requests("v", 1, [2, 1])
    result = worker.run(replace(request, weight_version=1))
    assert result.weight_version == 1 and [s.prompt_index for s in result.output.samples] == [0, 0, 1]
    assert {s.weight_version for s in result.output.samples} == {1}
    assert all(torch.equal(s.logprobs, torch.full((5,), -1.5)) for s in result.output.samples)

    # the next update replaces the merged weights (the previous LoRA is not added twice)
    _train(policy, 2)
    assert worker.load_weights(make_update(policy, version=3)) == 3
    assert len(engine.loads) == 2 and worker.backend.weight_version == 2  # one engine sync per update
    assert engine.prefix_cache_resets == 2  # no cached prompt states of the old weights are reused
    _check_merged(engine.loads[1], policy)
    assert not torch.equal(engine.loads[1][Q_PROJ], pushed[Q_PROJ])
    with pytest.raises(ValueError, match="older"):
        worker.load_weights(make_update(policy, version=2))
    assert len(engine.loads) == 2


def test_pooled_worker_pushes_the_initial_weights_once(fake_vllm, vlm_dir):
    policy = _policy(vlm_dir)
    _train(policy, 0)
    worker = PooledVLMWorker.build(
        vlm_dir, PARAMS, make_update(policy, version=0), "vllm", torch_dtype=torch.float32, dtype="float32"
    )
    (engine,) = fake_vllm.engines
    assert (
        worker.version == 0 and len(engine.loads) == 1
    )  # version 0 is the trainer's LoRA, not the checkpoint
    _check_merged(engine.loads[0], policy)
    PooledVLMWorker.build(vlm_dir, PARAMS, None, "vllm", torch_dtype=torch.float32)
    assert fake_vllm.engines[1].loads == []  # nothing to push: the engine runs the checkpoint


def test_pool_broadcast_reaches_every_engine(fake_vllm, vlm_dir, vlm_requests):
    factory = functools.partial(
        VLMRolloutWorker.from_vllm, vlm_dir, PARAMS, torch_dtype=torch.float32, dtype="float32"
    )
    policy = _policy(vlm_dir)
    _train(policy, 1)
    with RolloutPool(factory, num_workers=2) as pool:
        # published while the members are still being built: a member that starts later loads it on start
        pool.broadcast(make_update(policy, version=1))
        deadline = time.monotonic() + 120
        while len(pool.worker_info()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        batch = pool.run(vlm_requests("b", 2, [2]), timeout=120)
        assert [w["version"] for w in pool.worker_info()] == [1, 1]
    assert pool.version == 1 and set(batch.lags) == {0}
    assert {s.weight_version for r in batch.results for s in r.output.samples} == {1}
    assert len(fake_vllm.engines) == 2
    for engine in fake_vllm.engines:
        (pushed,) = engine.loads
        _check_merged(pushed, policy)


def test_without_vllm_the_error_names_the_extra(monkeypatch, vlm_dir):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install mmrl\[vllm\]"):
        PooledVLMWorker.build(vlm_dir, PARAMS, None, "vllm")
    with pytest.raises(ValueError, match="backend must be one of"):
        PooledVLMWorker.build(vlm_dir, PARAMS, None, "sglang")
