"""Wan2.2 with both experts trained (``model.options.trained_expert: both``) on a tiny random two-expert
``WanPipeline`` (boundary 0.8; of 3 sampler steps on UniPC's flow sigmas, steps 0 and 1 at sigmas 1.0 and 0.86
are the high-noise expert's, step 2 at sigma 0.60 the low-noise expert's): gradients reach each expert only through the rows its sigma
routes to it, GRPO and DiffusionNFT move both, resume is exact, and the saved LoRA files load into the
pipeline's two experts through ``load_lora_weights`` with the trained outputs."""

import json

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel

from mmrl.config import load_config
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer, main
from pipelines.flow.adapters import load_adapter
from pipelines.flow.adapters.wan22 import LOW_EXPERT_WEIGHT_NAME, WanExperts
from pipelines.flow.tiny import TINY_SIZES, build_tiny_pipeline

SIZES = TINY_SIZES["wan22"]
LORA = "model.lora={rank: 4, alpha: 8, target_modules: [to_q, to_k, to_v]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan22_both")
    build_tiny_pipeline("wan22", seed=0).save_pretrained(path)
    return path


def both_config(model_dir, tmp_path, objective: str, *extra: str) -> FlowGRPOConfig:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    overrides = [
        "model.family=wan22",
        f"model.path={model_dir}",
        "model.device=cpu",
        f"model.options={json.dumps({'max_sequence_length': 8, 'trained_expert': 'both'})}",
        f"run.output_dir={tmp_path}",
        "run.progress=false",
        "run.tensorboard=false",
        f"train_prompts={prompts}",
        f"eval_prompts={prompts}",
        "rewards=[{name: video_frames, options: {reward: jpeg_incompressibility}}]",
        f"sampling.height={SIZES['height']}",
        f"sampling.width={SIZES['width']}",
        f"sampling.num_frames={SIZES['num_frames']}",
        "sampling.num_steps=3",
        "sampling.eval_num_steps=3",
        "sampling.sde_window=3",
        "sampling.guidance_scale=2.0",
        "allocation.prompts_per_step=2",
        "allocation.rollouts_per_step=4",
        "trainer.minibatch_size=4",
        "trainer.drop_zero_advantage=false",
        "trainer.lr=1e-2",
        "trainer.eval_prompts=2",
        f"trainer.objective={objective}",
    ]
    return load_config(FlowGRPOConfig, None, [*overrides, *extra])


def lora_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora" in n}


def moved(before: dict[str, torch.Tensor], module: torch.nn.Module) -> bool:
    after = lora_of(module)
    return any(not torch.equal(before[n], after[n]) for n in after)


def test_each_row_backpropagates_into_the_expert_its_sigma_selects(model_dir):
    adapter = load_adapter("wan22", str(model_dir), max_sequence_length=8, trained_expert="both")
    experts = adapter.transformer
    assert isinstance(experts, WanExperts) and adapter.trains_at(torch.tensor([1.0, 0.5])).all()
    assert (
        experts.transformer is adapter.pipe.transformer
        and experts.transformer_2 is adapter.pipe.transformer_2
    )
    experts.requires_grad_(True)
    cond = adapter.encode(["a red circle", "a blue square"])
    x = torch.randn(2, *adapter.latent_shape(SIZES["height"], SIZES["width"], SIZES["num_frames"]))
    for sigma, used, unused in (
        ([1.0, 0.9], experts.transformer, experts.transformer_2),
        ([0.75, 0.2], experts.transformer_2, experts.transformer),
    ):
        experts.zero_grad(set_to_none=True)
        adapter.velocity(x, torch.tensor(sigma), cond).square().mean().backward()
        assert all(p.grad is None for p in unused.parameters())
        assert sum(float(p.grad.abs().sum()) for p in used.parameters() if p.grad is not None) > 0
    # a mixed batch: each expert's gradient is that of its own rows alone
    experts.zero_grad(set_to_none=True)
    adapter.velocity(x, torch.tensor([1.0, 0.5]), cond).square().sum().backward()
    mixed = {n: p.grad.clone() for n, p in experts.named_parameters()}
    experts.zero_grad(set_to_none=True)
    adapter.velocity(x[:1], torch.tensor([1.0]), cond.select([0])).square().sum().backward()
    adapter.velocity(x[1:], torch.tensor([0.5]), cond.select([1])).square().sum().backward()
    for name, param in experts.named_parameters():
        torch.testing.assert_close(mixed[name], param.grad, rtol=1e-5, atol=1e-7)


# per objective, settings under which its training points reach both experts: GRPO's SDE window covers the 3
# steps, NFT draws 3 points per image over them; AWM regresses steps 1 .. floor(f n) - 1, one per stratum, so with
# 5 steps (sigmas 1.0, 0.92, 0.82 | 0.67, 0.43) its 4 strata are steps 1 and 2 (high expert), 3 and 4 (low)
REACHES_BOTH = {
    "grpo": ("trainer.beta=0.01",),  # (the reference: both experts' adapters switched off)
    "nft": ("trainer.nft_timesteps=3", "trainer.beta=0.01"),
    "awm": ("sampling.num_steps=5", "trainer.awm.timesteps=4", "trainer.awm.timestep_fraction=1.0"),
}


@pytest.mark.parametrize("objective", list(REACHES_BOTH))
def test_a_lora_step_trains_both_experts_under_one_optimizer(model_dir, tmp_path, objective):
    cfg = both_config(model_dir, tmp_path, objective, LORA, *REACHES_BOTH[objective])
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    pipe = trainer.adapter.pipe
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    for expert in (pipe.transformer, pipe.transformer_2):
        lora = [p for n, p in expert.named_parameters() if "lora" in n]
        assert lora and all(id(p) in optimized for p in lora)
    assert len(optimized) == len(trainer.trainable) == len(lora_of(pipe.transformer)) * 2
    base = {
        n: p.detach().clone() for n, p in trainer.adapter.transformer.named_parameters() if "lora" not in n
    }
    high, low = lora_of(pipe.transformer), lora_of(pipe.transformer_2)
    metrics = trainer.train_step()
    assert metrics.get("train/skipped_no_signal", 0.0) == 0.0
    if objective != "awm":  # LoRA B starts at zero: the adapters-off reference equals the policy at step 1
        assert metrics["policy/kl"] == 0.0
    # after the step the reference (adapters off on both experts) is the base model, at either expert's sigma
    adapter = trainer.adapter
    untrained = load_adapter("wan22", str(model_dir), max_sequence_length=8, trained_expert="both")
    cond = adapter.encode(["a red circle", "a blue square"])
    x = torch.randn(2, *adapter.latent_shape(SIZES["height"], SIZES["width"], SIZES["num_frames"]))
    sigma = torch.tensor([1.0, 0.5])
    with torch.no_grad():
        policy = adapter.velocity(x, sigma, cond)
        with trainer.reference_policy():
            reference = adapter.velocity(x, sigma, cond)
        torch.testing.assert_close(reference, untrained.velocity(x, sigma, cond), rtol=1e-5, atol=1e-6)
    for row in range(2):
        assert not torch.allclose(policy[row], reference[row], atol=1e-6)
    assert moved(high, pipe.transformer) and moved(low, pipe.transformer_2)
    assert all(
        torch.equal(base[n], p) for n, p in trainer.adapter.transformer.named_parameters() if n in base
    )


def test_grpo_on_the_high_experts_steps_leaves_the_low_expert_untouched(model_dir, tmp_path):
    """SDE only on step 0 (sigma 1.0): every trained transition is the high expert's."""
    trainer = FlowGRPOTrainer(both_config(model_dir, tmp_path, "grpo", LORA, "sampling.sde_window=1"), None)
    trainer.setup()
    pipe = trainer.adapter.pipe
    high, low = lora_of(pipe.transformer), lora_of(pipe.transformer_2)
    trainer.train_step()
    assert moved(high, pipe.transformer) and not moved(low, pipe.transformer_2)


def test_saved_lora_loads_into_both_experts_of_the_pipeline_with_the_trained_outputs(model_dir, tmp_path):
    trainer = FlowGRPOTrainer(both_config(model_dir, tmp_path, "grpo", LORA), None)
    trainer.setup()
    trainer.train_step()
    trainer.save_lora(tmp_path / "lora")
    assert sorted(f.name for f in (tmp_path / "lora").iterdir()) == [
        "pytorch_lora_weights.safetensors",
        LOW_EXPERT_WEIGHT_NAME,
    ]

    def generate(pipe: WanPipeline) -> torch.Tensor:
        return pipe(
            "a red circle",
            height=SIZES["height"],
            width=SIZES["width"],
            num_frames=SIZES["num_frames"],
            num_inference_steps=3,
            guidance_scale=2.0,
            max_sequence_length=8,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).frames

    trained = generate(trainer.adapter.pipe)
    base = generate(WanPipeline.from_pretrained(model_dir))
    high_only = WanPipeline.from_pretrained(model_dir)
    high_only.load_lora_weights(tmp_path / "lora")  # diffusers' default file: the high expert's
    loaded = WanPipeline.from_pretrained(model_dir)
    loaded.load_lora_weights(tmp_path / "lora")
    loaded.load_lora_weights(
        tmp_path / "lora", weight_name=LOW_EXPERT_WEIGHT_NAME, load_into_transformer_2=True
    )
    torch.testing.assert_close(generate(loaded), trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(base, trained, atol=1e-4)
    assert not torch.allclose(generate(high_only), trained, atol=1e-4)

    # the trainer reads the folder back (model.init_lora) into both experts
    again = FlowGRPOTrainer(
        both_config(model_dir, tmp_path, "grpo", LORA, f"model.init_lora={tmp_path / 'lora'}"), None
    )
    again.setup()
    for name, value in lora_of(trainer.adapter.transformer).items():
        torch.testing.assert_close(
            dict(again.adapter.transformer.named_parameters())[name], value, rtol=0, atol=0
        )


def test_full_fine_tuning_of_both_experts_resumes_exactly_and_saves_both_folders(
    model_dir, tmp_path, interrupted_then_resumed
):
    args = (
        "model.lora=null",
        "trainer.steps=3",
        "run.save_every=1",
        "trainer.eval_every=3",
        "trainer.beta=0.01",
    )
    straight = main(both_config(model_dir, tmp_path, "grpo", "run.name=a", *args))
    resumed = interrupted_then_resumed(
        FlowGRPOTrainer,
        main,
        both_config(model_dir, tmp_path, "grpo", "run.name=b", *args),
        both_config(model_dir, tmp_path, "grpo", "run.name=b", *args, "run.resume=true"),
        at=2,
    )
    drop = ("time/rollout_s", "time/train_s")
    assert {k: v for k, v in resumed.items() if k not in drop} == {
        k: v for k, v in straight.items() if k not in drop
    }
    assert straight["policy/kl"] > 0  # the reference (a frozen copy of both experts) was swapped in
    last = sorted((tmp_path / "a" / "checkpoints").iterdir())[-1]
    state = torch.load(last / "state.pt", weights_only=False)["trainable"]
    base = WanPipeline.from_pretrained(model_dir)
    for component in ("transformer", "transformer_2"):
        expert = WanTransformer3DModel.from_pretrained(last / component)
        weights = dict(expert.named_parameters())
        own = {n.removeprefix(component + "."): t for n, t in state.items() if n.startswith(component + ".")}
        assert own.keys() == weights.keys()
        for name, value in own.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0)
        untrained = dict(getattr(base, component).named_parameters())
        assert any(not torch.equal(untrained[n], weights[n]) for n in weights)
    # `mmrl export` puts both fine-tuned experts into the pipeline it writes
    from mmrl.export import export_run

    exported = WanPipeline.from_pretrained(export_run(tmp_path / "a", tmp_path / "export"))
    for name, value in state.items():
        component, _, param = name.partition(".")
        torch.testing.assert_close(getattr(exported, component).get_parameter(param), value, rtol=0, atol=0)


def test_both_experts_are_refused_under_fsdp(model_dir, tmp_path):
    trainer = FlowGRPOTrainer(both_config(model_dir, tmp_path, "grpo"), None)
    trainer.setup()
    with pytest.raises(ValueError, match="trained_expert: both"):
        trainer._check_fsdp()


@pytest.mark.parametrize("experts", ["both", "low"])
def test_lora_exports_load_and_merge_into_the_trained_experts(model_dir, tmp_path, monkeypatch, experts):
    """``mmrl export``: the LoRA export's model card loads each expert's file into its expert; the merged export
    holds ``W + (alpha / r) B A`` in exactly the trained experts."""
    from safetensors.torch import load_file

    from mmrl.export import export_run
    from tests.infra.test_export import load_as_the_card_says

    options = json.dumps({"max_sequence_length": 8, "trained_expert": experts})
    cfg = both_config(
        model_dir,
        tmp_path,
        "grpo",
        LORA,
        f"model.options={options}",
        "run.name=run",
        "trainer.steps=1",
        "run.save_every=1",
        "trainer.eval_every=1",
    )
    main(cfg)
    run = tmp_path / "run"
    adapter_dir = run / "checkpoints/step_00000001/adapter"
    trained = {"transformer_2": load_file(adapter_dir / LOW_EXPERT_WEIGHT_NAME)}
    if experts == "both":
        trained["transformer"] = load_file(adapter_dir / "pytorch_lora_weights.safetensors")
    else:
        assert [f.name for f in adapter_dir.iterdir()] == [LOW_EXPERT_WEIGHT_NAME]

    pipe = load_as_the_card_says(export_run(run, tmp_path / "lora"), monkeypatch)["pipe"]
    for component in ("transformer", "transformer_2"):
        loaded = {
            "transformer." + n.replace(".default_0", ""): p
            for n, p in getattr(pipe, component).named_parameters()
            if "lora" in n
        }
        if component not in trained:
            assert not loaded
            continue
        assert loaded.keys() == trained[component].keys()
        assert all(torch.equal(loaded[n], trained[component][n]) for n in loaded)

    merged_pipe = load_as_the_card_says(export_run(run, tmp_path / "merged", merge=True), monkeypatch)["pipe"]
    base = WanPipeline.from_pretrained(model_dir)
    scale = cfg.model.lora.alpha / cfg.model.lora.rank
    for component in ("transformer", "transformer_2"):
        merged = dict(getattr(merged_pipe, component).named_parameters())
        original = dict(getattr(base, component).named_parameters())
        if component not in trained:
            assert all(torch.equal(merged[n], original[n]) for n in original)
            continue
        lora = trained[component]
        layers = [
            k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in lora if ".lora_A." in k
        ]
        for layer in layers:
            a, b = lora[f"transformer.{layer}.lora_A.weight"], lora[f"transformer.{layer}.lora_B.weight"]
            expected = original[f"{layer}.weight"] + scale * b @ a
            torch.testing.assert_close(merged[f"{layer}.weight"], expected, atol=1e-6, rtol=1e-5)
        assert any(not torch.equal(merged[f"{n}.weight"], original[f"{n}.weight"]) for n in layers)


def test_pooled_rollouts_sample_with_both_experts_updated_lora(model_dir, tmp_path):
    """``pool.enabled``: the workers build the same two-expert module and receive both experts' LoRA. After a
    first update moved both experts, the second step's pooled samples re-score to ratio 1 under the trainer's
    weights: the worker sampled with both updated experts (a stale expert would show in the ratio)."""
    cfg = both_config(
        model_dir,
        tmp_path,
        "grpo",
        LORA,
        "pool.enabled=true",
        "pool.num_workers=1",
        "pool.max_staleness=0",
        "trainer.steps=2",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    try:
        pipe = trainer.adapter.pipe
        high, low = lora_of(pipe.transformer), lora_of(pipe.transformer_2)
        trainer.train_step()
        assert moved(high, pipe.transformer) and moved(low, pipe.transformer_2)
        trainer.step += 1  # (the training loop counts the steps)
        second = trainer.train_step()
        assert second["pool/lag_mean"] == 0.0
        assert second["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5), second["policy/ratio_mean"]
    finally:
        trainer.cleanup()


def test_the_wan_family_refuses_a_two_expert_pipeline(model_dir):
    """``family: wan`` routed the low-noise steps to a second expert it neither trained nor froze; the two-expert
    pipeline is the ``wan22`` family's, which says which expert trains."""
    from pipelines.flow.adapters.registry import load_adapter

    with pytest.raises(
        ValueError, match=r"model.family=wan: this WanPipeline has two experts .*model.family=wan22"
    ):
        load_adapter("wan", str(model_dir))
    assert load_adapter("wan22", str(model_dir)).pipe.transformer_2 is not None
