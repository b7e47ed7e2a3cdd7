"""One flow training step (GRPO, DiffusionNFT and AWM) through the trainer for every model family (tiny random
SD3, FLUX, SANA, Wan2.1, Wan2.2 (either expert), Qwen-Image, Z-Image, FLUX.2 klein and dev), and each family's LoRA loaded back by its own diffusers pipeline."""

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
        if "num_frames" in TINY_SIZES[family]
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
    "flux2": "[to_q, to_k, to_v, add_q_proj, add_k_proj, add_v_proj]",
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


@pytest.mark.parametrize("objective", ["grpo", "nft"])
@pytest.mark.parametrize("expert", ["high", "low"])
def test_wan22_trains_one_expert_and_freezes_the_other(expert, objective, tmp_path):
    """Wan2.2 (``model.options.trained_expert``): the LoRA of the named expert moves, the other expert is frozen
    and untouched, and the saved LoRA loads into that expert of the pipeline (the low one with
    ``load_into_transformer_2=True``)."""
    torch.manual_seed(0)
    build_tiny_pipeline("wan22", seed=0).save_pretrained(tmp_path / "model")
    options = {**TINY_LOAD_KWARGS["wan22"], "trained_expert": expert}
    cfg = family_config(
        "wan22",
        objective,
        tmp_path,
        f"model.options={json.dumps(options)}",
        "model.lora={rank: 4, alpha: 8, target_modules: [to_q, to_k, to_v]}",
        "trainer.lr=1e-2",
        "sampling.sde_window=3",  # steps 0 (high expert) and 1 (low expert) are SDE steps
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    pipe = trainer.adapter.pipe
    trained, frozen = (
        (pipe.transformer, pipe.transformer_2) if expert == "high" else (pipe.transformer_2, pipe.transformer)
    )
    assert trainer.adapter.transformer is trained
    assert not any("lora" in n for n, _ in frozen.named_parameters())
    frozen_before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    before = {n: p.detach().clone() for n, p in trained.named_parameters() if "lora" in n}
    trainer.train_step()
    after = {n: p.detach().clone() for n, p in trained.named_parameters() if "lora" in n}
    assert any(not torch.equal(before[n], after[n]) for n in after)
    assert all(torch.equal(frozen_before[n], p) for n, p in frozen.named_parameters())
    trainer.save_lora(tmp_path / "lora")

    loaded_pipe = type(pipe).from_pretrained(tmp_path / "model")
    loaded_pipe.load_lora_weights(tmp_path / "lora", load_into_transformer_2=expert == "low")
    target = loaded_pipe.transformer if expert == "high" else loaded_pipe.transformer_2
    other = loaded_pipe.transformer_2 if expert == "high" else loaded_pipe.transformer
    loaded = {n.replace(".default_0.", ".default."): p for n, p in target.named_parameters() if "lora" in n}
    assert loaded.keys() == after.keys()
    for name, value in after.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0)
    assert not any("lora" in n for n, _ in other.named_parameters())


def test_wan22_refuses_a_one_expert_pipeline_and_unknown_experts(tmp_path):
    from pipelines.flow.adapters import load_adapter

    build_tiny_pipeline("wan", seed=0).save_pretrained(tmp_path / "wan21")
    with pytest.raises(ValueError, match="two-expert"):
        load_adapter("wan22", str(tmp_path / "wan21"))
    build_tiny_pipeline("wan22", seed=0).save_pretrained(tmp_path / "wan22")
    with pytest.raises(ValueError, match="trained_expert"):
        load_adapter("wan22", str(tmp_path / "wan22"), trained_expert="middle")


def test_guidance_distilled_flux_trains_at_the_guidance_it_samples_with(tmp_path, monkeypatch):
    """FLUX.1 dev takes the guidance scale as an input of its one forward (no CFG pass): the likelihood-free
    objectives regress, and GRPO without train_cfg scores, the velocity at the sampled scale, not at 1."""
    torch.manual_seed(0)
    build_tiny_pipeline("flux", seed=0).save_pretrained(tmp_path / "model")
    trainer = FlowGRPOTrainer(family_config("flux", "nft", tmp_path, "sampling.guidance_scale=3.5"), None)
    trainer.setup()
    cond = trainer.adapter.encode(["a red circle"])
    assert trainer.regression_guidance(cond) == 3.5
    x, sigma = torch.randn(1, *trainer.adapter.latent_shape(32, 32)), torch.tensor([0.5])
    assert not torch.allclose(
        trainer.adapter.velocity(x, sigma, cond, 3.5), trainer.adapter.velocity(x, sigma, cond, 1.0)
    )

    cfg = family_config("flux", "grpo", tmp_path, "sampling.guidance_scale=3.5", "trainer.train_cfg=false")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()

    def rescored(*args, **kwargs):
        raise AssertionError("the sampled log-probs are the behaviour log-probs: nothing to re-score")

    monkeypatch.setattr(trainer, "transition_log_probs", rescored)
    metrics = trainer.train_step()
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
