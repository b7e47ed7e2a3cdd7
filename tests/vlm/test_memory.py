"""`mmrl memory` for VLM recipes: the estimate built on meta equals, part by part, the bytes a real trainer holds
after an optimizer step (the committed tiny VLM on the CPU), and every published recipe gets one without a
download."""

from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.memory import GIB, module_bytes, tensors_bytes
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.memory import estimate_memory
from mmrl.vlm.trainer import VLMRLVRTrainer
from tests.flow.test_memory import optimizer_state_bytes, step_optimizer
from tests.vlm.test_vlm_trainer import make_cfg

CASES = {
    "LoRA": [],
    "LoRA in bfloat16": ["model.dtype=bfloat16"],
    "full fine-tuning with a KL reference": ["model.lora=null", "trainer.beta=0.01"],
    "full fine-tuning with the vision tower": [
        "model.lora=null",
        "trainer.beta=0",
        "model.train_vision=true",
    ],
    # float32 master weights of a bfloat16 model: its language model trained in float32, the reference bfloat16
    "full fine-tuning in bfloat16, master weights": [
        "model.lora=null",
        "model.dtype=bfloat16",
        "trainer.beta=0.01",
    ],
    "full fine-tuning in pure bfloat16": [
        "model.lora=null",
        "model.dtype=bfloat16",
        "model.master_weight_dtype=bfloat16",
        "trainer.beta=0.01",
    ],
    "full fine-tuning in pure bfloat16, KahanAdamW": [
        "model.lora=null",
        "model.dtype=bfloat16",
        "model.master_weight_dtype=bfloat16",
        "trainer.optimizer=adamw_kahan",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_equals_what_the_trainer_holds(case, tmp_path):
    cfg = make_cfg("checkpoints/shapes_vlm", tmp_path, "memory", *CASES[case])
    estimate = estimate_memory(cfg)
    trainer = VLMRLVRTrainer(cfg, None)
    trainer.setup()
    step_optimizer(trainer)
    held = {
        "policy weights": module_bytes(trainer.model),
        "gradients": tensors_bytes(trainer.trainable),
        **optimizer_state_bytes(trainer.optimizer),
    }
    if trainer.reference is not None:
        held["reference copy"] = module_bytes(trainer.reference)
    assert {part.name: part.bytes for part in estimate.parts} == held
    vision = sum(
        p.numel() for n, p in trainer.model.named_parameters() if trainer.family.is_vision_parameter(n)
    )
    trained = {part.name: part.params for part in estimate.parts}["gradients"]
    if cfg.model.lora is None:
        total = sum(p.numel() for p in trainer.model.parameters())
        assert trained == (total if cfg.model.train_vision else total - vision)


@pytest.mark.parametrize("path", sorted(Path("configs/vlm").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_published_recipe_is_estimated_without_a_download(path, monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    cfg = load_config(VLMRLVRConfig, str(path), [])
    estimate = estimate_memory(cfg)
    parts = {part.name: part for part in estimate.parts}
    assert 3e9 < parts["policy weights"].params < (3.2e10 if cfg.model.lora is None else 5e9)
    # a bfloat16 base, two bytes per value; the trained values (LoRA factors, or the whole model) in
    # model.master_weight_dtype, float32 unless the recipe trains in pure bfloat16
    trained = parts["gradients"].params
    trained_bytes = 4 if cfg.model.master_weight_dtype == "float32" else 2
    weights = 2 * (parts["policy weights"].params - trained) + trained_bytes * trained
    assert 0 <= parts["policy weights"].bytes - weights < 1e6  # the rest: buffers (rotary frequencies)
    assert parts["gradients"].bytes == trained_bytes * trained
    if cfg.model.lora is None:
        assert trained == parts["policy weights"].params  # model.train_vision: every weight trains
    header = path.read_text().split("\nrecipe:")[0].replace("\n# ", " ")
    # the header quotes this estimate: on one GPU, or per GPU under FSDP over 8
    one, eight = (f"{estimate.resident_bytes(fsdp) / GIB:.1f} GiB" for fsdp in (1, 8))
    assert one in header and (cfg.model.lora is not None or ("--fsdp=8" in header and eight in header))
    if cfg.generation.backend == "vllm":
        share = cfg.generation.vllm_gpu_memory_utilization
        assert estimate.peak_bytes(78 * GIB) == pytest.approx(estimate.resident_bytes() + share * 78 * GIB)
        assert "vLLM engine" in estimate.table()


def test_qlora_counts_the_base_in_nf4_and_the_factors_beside_it(tmp_path):
    full = estimate_memory(make_cfg("checkpoints/shapes_vlm", tmp_path, "bf16", "model.dtype=bfloat16"))
    nf4 = estimate_memory(
        make_cfg("checkpoints/shapes_vlm", tmp_path, "nf4", "model.dtype=bfloat16", "model.load_in_4bit=true")
    )
    full_parts = {part.name: part for part in full.parts}
    nf4_parts = {part.name: part for part in nf4.parts}
    assert nf4_parts["LoRA factors"].bytes == full_parts["gradients"].bytes
    assert nf4_parts["policy weights"].bytes < 0.6 * full_parts["policy weights"].bytes
