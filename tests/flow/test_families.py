"""One flow training step (GRPO and AWM) through the trainer for every model family (tiny random SD3, FLUX, SANA,
Wan)."""

import json

import pytest
import torch

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer
from pipelines.flow.tiny import TINY_LOAD_KWARGS, TINY_SIZES, build_tiny_pipeline


@pytest.mark.parametrize("objective", ["grpo", "awm"])
@pytest.mark.parametrize("family", ["sd3", "flux", "sana", "wan"])
def test_trainer_step_for_family(family, objective, tmp_path):
    torch.manual_seed(0)
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
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
    cfg = load_config(FlowGRPOConfig, None, overrides)
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    assert trainer.evaluate()["eval/reward_mean"] == pytest.approx(trainer.evaluate()["eval/reward_mean"])
