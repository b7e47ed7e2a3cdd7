"""One VLM trainer step on each non-default family's tiny random model (Qwen3-VL dense and MoE, Gemma 3), detected from the
checkpoint: LoRA only outside the vision tower, behaviour log-probs re-scored exactly, a peft adapter saved."""

import functools

import pytest
import torch

from mmrl.data.shapes_vqa import make_vqa_items
from mmrl.vlm.trainer import VLMRLVRTrainer, main
from pipelines.vlm.tiny_gemma3 import build_tiny_gemma3
from pipelines.vlm.tiny_qwen3_vl import build_tiny_qwen3_vl
from tests.vlm.test_vlm_trainer import make_cfg

#: checkpoint model_type -> tiny builder
BUILDERS = {
    "qwen3_vl": build_tiny_qwen3_vl,
    "qwen3_vl_moe": functools.partial(build_tiny_qwen3_vl, num_experts=4),
    "gemma3": build_tiny_gemma3,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def model_dir(request, tmp_path_factory):
    items = make_vqa_items(60, seed=0)
    corpus = [i.prompt for i in items] + [f"<answer>{i.answer}</answer>" for i in items]
    path = tmp_path_factory.mktemp(request.param)
    BUILDERS[request.param](corpus, out_dir=path)
    return request.param, path


def test_one_group_step_trains_only_language_lora(model_dir, tmp_path):
    model_type, path = model_dir
    cfg = make_cfg(path, tmp_path, "m", "trainer.mode=group", "trainer.advantage=grpo")
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    assert model_type in trainer.family.model_types  # detected from the checkpoint
    named = dict(trainer.model.named_parameters())
    lora = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert not any(trainer.family.is_vision_parameter(n) for n in lora)
    original = trainer.score_samples

    def spread(pairs):  # random weights never answer right: rewards with spread give a learning signal
        _, raw, outputs = original(pairs)
        return torch.arange(len(pairs), dtype=torch.float32) % 2, raw, outputs

    trainer.score_samples = spread
    metrics = trainer.train_step()
    assert metrics["tis/logprob_mismatch"] < 1e-4  # the trainer re-scores what the HF backend sampled
    assert any(not torch.equal(lora[n], named[n]) for n in lora)
    assert all(torch.equal(frozen[n], named[n]) for n in frozen)


def test_main_saves_an_adapter_the_base_model_loads(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    _, path = model_dir
    final = main(make_cfg(path, tmp_path, "run", "trainer.steps=1", "trainer.eval_every=1"))
    assert 0.0 <= final["eval/reward_mean"] <= 1.0
    adapter = tmp_path / "run/checkpoints/step_00000001/adapter"
    PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(path), adapter)
