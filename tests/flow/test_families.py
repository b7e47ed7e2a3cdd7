"""One flow training step (GRPO, DiffusionNFT and AWM) through the trainer for every model family (tiny random
SD3, FLUX, SANA, Wan, Qwen-Image, Z-Image, FLUX.2 klein), and each family's LoRA loaded back by its own diffusers pipeline."""

import json

import pytest
import torch

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer
from pipelines.flow.tiny import TINY_LOAD_KWARGS, TINY_SIZES, build_tiny_pipeline


def family_config(family: str, objective: str, tmp_path, *extra: str) -> FlowGRPOConfig:
    """A one-step trainer config on the tiny random ``family`` model saved under ``tmp_path / "model"``."""
    sizes = TINY_SIZES[family]
    reward = (
        "[{name: video_frames, options: {reward: jpeg_incompressibility}}]"
        if family == "wan"
        else "[{name: jpeg_incompressibility}]"
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    overrides = [
        f"model.family={family}",
        f"model.path={tmp_path / 'model'}",
        "model.device=cpu",
        f"model.options={json.dumps(TINY_LOAD_KWARGS[family])}",
        f"train_prompts={prompts}",
        f"eval_prompts={prompts}",
        f"rewards={reward}",
        f"sampling.height={sizes['height']}",
        f"sampling.width={sizes['width']}",
        "sampling.num_steps=3",
        "sampling.sde_window=2",
        "sampling.guidance_scale=2.0",
        "allocation.prompts_per_step=2",
        "allocation.rollouts_per_step=4",
        "trainer.minibatch_size=4",
        "trainer.drop_zero_advantage=false",
        f"trainer.objective={objective}",
        "trainer.awm.timesteps=1",  # 3 sampler steps leave step 1 to regress on
    ]
    if "num_frames" in sizes:
        overrides.append(f"sampling.num_frames={sizes['num_frames']}")
    return load_config(FlowGRPOConfig, None, [*overrides, *extra])


@pytest.mark.parametrize("objective", ["grpo", "awm"])
@pytest.mark.parametrize("family", ["sd3", "flux", "sana", "wan", "qwen_image", "z_image", "flux2_klein"])
def test_trainer_step_for_family(family, objective, tmp_path):
    torch.manual_seed(0)
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
    trainer = FlowGRPOTrainer(family_config(family, objective, tmp_path), None)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    assert trainer.evaluate()["eval/reward_mean"] == pytest.approx(trainer.evaluate()["eval/reward_mean"])


# the attention projections of each family's transformer (double-stream families also have the text stream's)
LORA_TARGETS = {
    "qwen_image": "[to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj]",
    "z_image": "[to_q, to_k, to_v, to_out.0]",
    "flux2_klein": "[to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj]",
}


@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_nft_lora_step_saves_what_the_pipeline_loads(family, tmp_path):
    """DiffusionNFT with LoRA on the family's attention projections: the step moves the LoRA, and the saved
    file loads into the family's own pipeline through ``load_lora_weights`` with the trained values."""
    torch.manual_seed(0)
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
    cfg = family_config(
        family,
        "nft",
        tmp_path,
        f"model.lora={{rank: 4, alpha: 8, target_modules: {LORA_TARGETS[family]}}}",
        "trainer.lr=1e-2",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if "lora" in n}
    trainer.train_step()
    trained = {
        n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if "lora" in n
    }
    assert any(not torch.equal(before[n], trained[n]) for n in trained)
    trainer.save_lora(tmp_path / "lora")

    pipe = type(trainer.adapter.pipe).from_pretrained(tmp_path / "model")
    pipe.load_lora_weights(tmp_path / "lora")
    loaded = {
        n.replace(".default_0.", ".default."): p
        for n, p in pipe.transformer.named_parameters()
        if "lora" in n
    }
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    # the file carries alpha / r: the pipeline applies the update with the trained scale
    scales = [s for m in pipe.transformer.modules() if hasattr(m, "scaling") for s in m.scaling.values()]
    assert scales and all(s == pytest.approx(8 / 4) for s in scales)
