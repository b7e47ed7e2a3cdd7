"""The flow GRPO trainer on a tiny random shapes model: one-step invariants, LoRA format, NFT, eval, resume."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.data.shapes import all_prompts
from mmrl.flow.config import FlowGRPOConfig, GuidanceDistillSettings
from mmrl.flow.objectives.grpo import kl_scale
from mmrl.flow.objectives.rwr import rwr_update
from mmrl.flow.trainer import FlowGRPOTrainer, evaluate, main
from mmrl.run import Run, read_metrics
from pipelines.flow.rollout import rollout
from pipelines.flow.tiny import build_shapes_pipeline


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8)
    path = tmp_path_factory.mktemp("shapes_tiny")
    pipe.save_pretrained(path)
    return path


def make_cfg(model_dir, out, name, *overrides):
    return load_config(
        FlowGRPOConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={out}",
            f"run.name={name}",
            "run.progress=false",
            "run.tensorboard=false",
            "sampling.num_steps=4",
            "sampling.eval_num_steps=3",
            "sampling.sde_window=2",
            "allocation.prompts_per_step=2",
            "allocation.rollouts_per_step=8",
            "trainer.steps=2",
            "trainer.eval_every=2",
            "trainer.eval_prompts=4",
            "trainer.minibatch_size=8",
            "trainer.lr=1e-2",
            "trainer.drop_zero_advantage=false",
            # random weights: the shapes verifier scores ~0, so train on a reward with spread
            "rewards=[{name: jpeg_incompressibility}]",
            *overrides,
        ],
    )


def test_grpo_step_trains_lora_only_and_ratio_starts_at_one(model_dir, tmp_path):
    cfg = make_cfg(model_dir, tmp_path, "grpo")
    trainer = FlowGRPOTrainer(cfg, Run(cfg.run, cfg))
    trainer.setup()
    named = dict(trainer.adapter.transformer.named_parameters())
    lora = {n: p.detach().clone() for n, p in named.items() if "lora" in n}
    base = {n: p.detach().clone() for n, p in named.items() if "lora" not in n}
    assert lora and all(not named[n].requires_grad for n in base)
    metrics = trainer.train_step()
    # one optimizer step after all minibatches: every ratio was computed under the sampling weights
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["nfe/rollout"] == 8 * 4
    assert any(not torch.equal(lora[n], named[n]) for n in lora)
    assert all(torch.equal(base[n], named[n]) for n in base)
    for key in ("reward/mean", "policy/kl", "clip/low_frac", "train/zero_std_frac", "train/effective_ratio"):
        assert key in metrics
    trainer.cleanup()


def test_two_updates_per_step_train_the_second_part_off_policy(model_dir, tmp_path):
    """``trainer.updates_per_step=2``: two optimizer steps per training step; the second part's ratios are taken
    after the first step, so they leave 1 (the sampler's log-probs are the old policy's), where one update keeps
    every ratio at 1."""
    cfg = make_cfg(model_dir, tmp_path, "two", "trainer.updates_per_step=2", "trainer.minibatch_size=8")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    original, steps = trainer.step_optimizer, []
    trainer.step_optimizer = lambda: (steps.append(trainer.step), original())
    metrics = trainer.train_step()
    assert steps == [0, 0]
    assert metrics["policy/ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    trainer.cleanup()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("objective", ["grpo", "nft"])
def test_a_bfloat16_model_trains_float32_master_weights(model_dir, tmp_path, objective, lora):
    """In bfloat16 an AdamW step of lr 1e-4 on a weight of 0.05 rounds away (its ulp is 2.4e-4): the trained
    parameters (LoRA factors, or the whole transformer) are float32 master weights of the bfloat16 model, which
    computes in bfloat16 under autocast; frozen weights and buffers stay bfloat16."""
    extra = [] if lora else ["model.lora=null", "trainer.beta=0.01"]
    cfg = make_cfg(
        model_dir, tmp_path, objective, "model.dtype=bfloat16", f"trainer.objective={objective}", *extra
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    transformer = trainer.adapter.transformer
    assert {p.dtype for p in trainer.trainable} == {torch.float32}
    assert {p.dtype for p in transformer.parameters() if not p.requires_grad} <= {torch.bfloat16}
    assert {b.dtype for b in transformer.buffers() if b.is_floating_point()} <= {torch.bfloat16}
    assert trainer.adapter.autocast_dtype == torch.bfloat16
    if not lora:  # the KL reference holds the start weights as loaded
        assert {p.dtype for p in trainer.reference.parameters()} == {torch.bfloat16}
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert all(torch.isfinite(torch.tensor(v)) for k, v in metrics.items() if k.startswith("loss"))
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    assert {p.dtype for p in trainer.trainable} == {torch.float32}


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_kahan"])
def test_pure_bfloat16_training_is_a_choice(model_dir, tmp_path, optimizer):
    """Pure bfloat16 (``model.master_weight_dtype=bfloat16``): at lr 1e-6 plain AdamW's first step rounds away on
    almost every weight, and KahanAdamW keeps it in the weight plus its compensation."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "pure",
        "model.dtype=bfloat16",
        "model.master_weight_dtype=bfloat16",
        "model.lora=null",
        f"trainer.optimizer={optimizer}",
        "trainer.lr=1e-6",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    assert {p.dtype for p in trainer.trainable} == {torch.bfloat16}
    assert trainer.adapter.autocast_dtype is None  # weights and compute in bfloat16: nothing to cast
    weights = [p for p in trainer.trainable if p.dim() == 2]
    before = [p.detach().float().clone() for p in weights]
    trainer.train_step()

    def held(param):  # what the optimizer holds of a weight
        state = trainer.optimizer.state[param]
        return param.detach().float() + (state["compensation"].float() if "compensation" in state else 0)

    moved = torch.cat([(held(p) != b).flatten() for p, b in zip(weights, before, strict=True)]).float().mean()
    assert moved > 0.9 if optimizer == "adamw_kahan" else moved < 0.1


def test_lora_checkpoint_loads_in_diffusers(model_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    final = main(make_cfg(model_dir, tmp_path, "ckpt", "trainer.steps=1", "trainer.eval_every=1"))
    assert "eval/reward_mean" in final
    adapter_dir = tmp_path / "ckpt/checkpoints/step_00000001/adapter"
    assert (adapter_dir / "pytorch_lora_weights.safetensors").is_file()
    pipe = StableDiffusion3Pipeline.from_pretrained(
        model_dir, vae=None, text_encoder_3=None, tokenizer_3=None
    )
    pipe.load_lora_weights(adapter_dir)
    state = torch.load(tmp_path / "ckpt/checkpoints/step_00000001/state.pt", weights_only=False)
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora" in n}
    assert len(loaded) == len(state["trainable"])
    for name, value in state["trainable"].items():
        match = [p for n, p in loaded.items() if n.replace(".default_0", ".default") == name or n == name]
        assert match and torch.equal(match[0], value)


def test_full_finetune_checkpoint_loads_in_diffusers(model_dir, tmp_path):
    from diffusers import SD3Transformer2DModel

    main(
        make_cfg(
            model_dir,
            tmp_path,
            "full",
            "model.lora=null",
            "trainer.objective=nft",
            "trainer.steps=1",
            "trainer.eval_every=1",
        )
    )
    checkpoint = tmp_path / "full/checkpoints/step_00000001"
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    base = SD3Transformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    loaded = SD3Transformer2DModel.from_pretrained(checkpoint / "transformer")
    named = dict(loaded.named_parameters())
    assert set(named) == set(state["trainable"]) == set(dict(base.named_parameters()))
    assert all(torch.equal(named[n], state["trainable"][n]) for n in named)
    assert any(not torch.equal(p, named[n]) for n, p in base.named_parameters())  # the step trained them


def test_nft_objective_and_cfg_free_logprobs(model_dir, tmp_path):
    for extra in (["trainer.objective=nft"], ["sampling.guidance_scale=2.0", "trainer.train_cfg=false"]):
        cfg = make_cfg(model_dir, tmp_path, "x" + str(len(extra)), "trainer.steps=1", *extra)
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        before = [p.detach().clone() for p in trainer.trainable]
        metrics = trainer.train_step()
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))


def test_autocast_trains_fp32_lora_with_bfloat16_forwards(model_dir, tmp_path):
    cfg = make_cfg(
        model_dir, tmp_path, "bf16", "trainer.steps=1", "trainer.objective=nft", "model.autocast=bfloat16"
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    assert trainer.adapter.autocast_dtype == torch.bfloat16
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(p.dtype == torch.float32 for p in trainer.trainable)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))


def test_rwr_objective_trains_on_clean_ode_samples_with_guided_regression(model_dir, tmp_path):
    cfg = make_cfg(
        model_dir, tmp_path, "rwr", "trainer.steps=1", "trainer.objective=rwr", "sampling.guidance_scale=2.0"
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    # the likelihood-free objectives sample without SDE noise; GRPO keeps its window
    assert trainer.sampling_config().sde_window == (0, 0)
    batch = trainer.collect()
    assert trainer.regression_guidance(batch.cond) == 2.0
    assert trainer.regression_guidance(batch.cond.select([0])) == 2.0
    before = [p.detach().clone() for p in trainer.trainable]
    rwr_update(trainer, batch)
    moved = any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    assert moved == bool((batch.sample_adv > 0).any())
    # nothing preferred in any group: no update at all
    before = [p.detach().clone() for p in trainer.trainable]
    rwr_update(trainer, replace(batch, sample_adv=torch.zeros_like(batch.sample_adv)))
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    grpo = FlowGRPOTrainer(make_cfg(model_dir, tmp_path, "g", "sampling.window_schedule=fixed"), None)
    assert grpo.sde_window(0) == (0, 2)


def test_objectives_are_registered_with_what_the_step_needs_and_unknown_names_are_refused(
    model_dir, tmp_path
):
    from mmrl.flow.objectives import get_objective, list_objectives, register_objective

    assert list_objectives() == ["awm", "grpo", "nft", "rwr"]
    assert get_objective("grpo").trains_on == "transitions"
    assert list_objectives("final_samples") == ["awm", "nft", "rwr"]
    assert [name for name in list_objectives() if not get_objective(name).same_count_per_rank] == ["rwr"]
    with pytest.raises(
        ValueError, match=r"trainer\.objective: unknown flow objective 'ppo'; registered: \['awm'"
    ):
        make_cfg(model_dir, tmp_path, "bad", "trainer.objective=ppo")
    with pytest.raises(ValueError, match="flow objective 'nft' is already registered"):
        register_objective("nft", "another", trains_on="final_samples")(lambda trainer, batch: None)


def test_a_new_objective_is_one_registration_and_trains_through_the_shared_regression(
    model_dir, tmp_path, monkeypatch
):
    from mmrl.flow.objectives import registry

    monkeypatch.setattr(registry, "_OBJECTIVES", dict(registry._OBJECTIVES))  # registered for this test only
    calls = []

    @registry.register_objective("plain_fm", "flow matching on every sample", trains_on="final_samples")
    def plain_fm(trainer, batch):
        calls.append(len(batch.prompts))
        rows, sigma, x_t, target = trainer.regression_points(batch.final_latents, batch.groups)

        def loss_fn(v, idx):
            return ((v - target[idx].to(v.device)) ** 2).flatten(1).mean(1)

        trainer.regress(x_t, sigma, batch.cond.select(rows), loss_fn)

    cfg = make_cfg(
        model_dir,
        tmp_path,
        "plainfm",
        "trainer.objective=plain_fm",
        "trainer.steps=1",
        "trainer.guidance_distill.weight=0.5",  # accepted: it regresses on the final samples
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    assert trainer.sampling_config().sde_window == (0, 0)  # clean ODE samples, as for nft / awm / rwr
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert calls == [8]
    assert (
        metrics["loss"] > 0 and metrics["policy/guidance_gap"] > 0
    )  # the trainer's distillation term joined
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    trainer.cleanup()


def test_an_objective_checks_its_own_settings_when_a_config_names_it(model_dir, tmp_path, monkeypatch):
    from mmrl.flow.objectives import registry

    monkeypatch.setattr(registry, "_OBJECTIVES", dict(registry._OBJECTIVES))
    seen = []

    def needs_eight_steps(cfg):
        seen.append(cfg.trainer.objective)
        if cfg.sampling.num_steps < 8:
            raise ValueError(f"sampling.num_steps ({cfg.sampling.num_steps}): eight_steps needs at least 8")

    registry.register_objective(
        "eight_steps", "needs 8 sampler steps", trains_on="final_samples", check_config=needs_eight_steps
    )(lambda trainer, batch: None)
    with pytest.raises(ValueError, match=r"sampling\.num_steps \(4\): eight_steps needs at least 8"):
        make_cfg(model_dir, tmp_path, "eight", "trainer.objective=eight_steps", "sampling.num_steps=4")
    make_cfg(model_dir, tmp_path, "eight", "trainer.objective=eight_steps", "sampling.num_steps=8")
    make_cfg(model_dir, tmp_path, "nft", "trainer.objective=nft", "sampling.num_steps=4")  # not its check
    assert seen == ["eight_steps", "eight_steps"]


def test_regression_points_share_sigma_and_noise_within_a_prompt_group(model_dir, tmp_path):
    x0 = torch.randn(6, 3, 8, 8)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    for shared in (True, False):
        cfg = make_cfg(
            model_dir,
            tmp_path,
            f"crn{shared}",
            "trainer.objective=nft",
            "trainer.nft_timesteps=2",
            f"trainer.shared_regression_noise={str(shared).lower()}",
        )
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        rows, sigma, x_t, target = trainer.regression_points(x0, groups)
        assert rows.tolist() == [0, 1, 2, 3, 4, 5] * 2
        eps = target + x0[rows]  # v* = eps - x0
        torch.testing.assert_close(
            x_t, (1 - sigma.view(-1, 1, 1, 1)) * x0[rows] + sigma.view(-1, 1, 1, 1) * eps
        )
        same_draw = [(0, 1), (1, 2), (3, 4), (6, 7), (9, 11)]  # same group, same timestep
        assert all(torch.allclose(eps[a], eps[b], atol=1e-6) == shared for a, b in same_draw)
        if shared:
            assert all(sigma[a] == sigma[b] for a, b in same_draw)
        assert not torch.allclose(eps[0], eps[3]) and not torch.allclose(
            eps[0], eps[6]
        )  # other group, other timestep


@pytest.mark.parametrize(
    ("fraction", "selection", "sde_steps", "kept"),
    [
        (0.99, "first", 10, [0, 1, 2, 3, 4, 5, 6, 7, 8]),  # Flow-GRPO: int(0.99 * 10) = 9, never the last
        (0.99, "random", 10, 9),  # DanceGRPO: 9 of the 10, drawn
        (0.6, "random", 10, 6),
        (0.3, "first", 4, [0]),  # int(1.2) = 1
        (0.1, "first", 4, [0]),  # at least one
    ],
)
def test_timestep_fraction_trains_int_fraction_times_the_sde_steps_as_the_peers(
    model_dir, tmp_path, fraction, selection, sde_steps, kept
):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "fraction",
        f"trainer.timestep_fraction={fraction}",
        f"trainer.timestep_selection={selection}",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.generator = torch.Generator().manual_seed(0)  # what setup seeds; no model is needed here
    window = torch.zeros(sde_steps + 2, dtype=torch.bool)
    window[2:] = True  # SDE steps 2 .. sde_steps + 1 (an SDE window after two ODE steps)
    steps = trainer._train_steps(window)
    if isinstance(kept, list):
        assert steps.tolist() == [step + 2 for step in kept]
    else:
        assert steps.numel() == kept and len(set(steps.tolist())) == kept and bool(window[steps].all())


def test_soft_updated_old_policy_samples_and_is_checkpointed(model_dir, tmp_path):
    cfg = make_cfg(model_dir, tmp_path, "old", "trainer.objective=nft", "trainer.old_policy_decay=0.5")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    start = [p.detach().clone() for p in trainer.trainable]
    trainer.train_step()
    live = [p.detach().clone() for p in trainer.trainable]
    assert any(not torch.equal(a, b) for a, b in zip(start, live, strict=True))
    with trainer.sampling_weights():  # the old policy moved half way to the trained weights
        for a, b, p in zip(start, live, trainer.trainable, strict=True):
            torch.testing.assert_close(p, 0.5 * a + 0.5 * b)
    assert all(torch.equal(a, p) for a, p in zip(live, trainer.trainable, strict=True))  # restored afterwards
    state = trainer.state_dict()
    assert state["old_policy"] is not None
    other = FlowGRPOTrainer(cfg, None)
    other.setup()
    other.load_state(state)
    with other.sampling_weights(), trainer.sampling_weights():
        assert all(torch.equal(a, b) for a, b in zip(other.trainable, trainer.trainable, strict=True))


def test_old_policy_decay_ramps_as_diffusion_nft(model_dir, tmp_path):
    """DiffusionNFT's return_decay: 0 for the flat steps, then rate per step up to the cap; the first update of
    a ramp starting at 0 copies the trained weights."""
    ramp = ("trainer.objective=nft", "trainer.old_policy_decay=0.5", "trainer.old_policy_decay_rate=0.001")
    trainer = FlowGRPOTrainer(make_cfg(model_dir, tmp_path, "ramp", *ramp), None)
    assert [trainer.old_policy_decay(n) for n in (0, 1, 250, 500, 900)] == pytest.approx(
        [0, 0.001, 0.25, 0.5, 0.5]
    )
    ocr = (
        "trainer.old_policy_decay=0.999",
        "trainer.old_policy_decay_rate=0.0075",
        "trainer.old_policy_decay_flat_steps=75",
    )
    trainer = FlowGRPOTrainer(make_cfg(model_dir, tmp_path, "ocr", "trainer.objective=nft", *ocr), None)
    assert [trainer.old_policy_decay(n) for n in (0, 75, 76, 175, 300)] == pytest.approx(
        [0, 0, 0.0075, 0.75, 0.999]
    )
    trainer = FlowGRPOTrainer(make_cfg(model_dir, tmp_path, "ramp", *ramp), None)
    trainer.setup()
    trainer.train_step()
    with trainer.sampling_weights():
        sampled = [p.detach().clone() for p in trainer.trainable]
    assert all(torch.equal(a, b) for a, b in zip(sampled, trainer.trainable, strict=True))
    with pytest.raises(ValueError, match=r"trainer\.old_policy_decay_rate ramps .* which is null"):
        make_cfg(model_dir, tmp_path, "bad", "trainer.old_policy_decay_rate=0.001")


def test_likelihood_free_kl_to_reference_is_zero_before_the_first_update(model_dir, tmp_path):
    # one optimizer step per call: every minibatch sees the starting LoRA (B = 0), so v == v_ref exactly
    for objective in ("rwr", "nft"):
        cfg = make_cfg(
            model_dir,
            tmp_path,
            "kl" + objective,
            "trainer.steps=1",
            f"trainer.objective={objective}",
            "trainer.beta=0.5",
            "trainer.minibatch_size=4",
        )
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        metrics = trainer.train_step()  # the JPEG reward always spreads, so rwr has preferred images
        assert metrics["policy/kl"] == 0.0
        assert trainer.train_step()["policy/kl"] > 0.0


def test_kl_form_flow_grpo_divides_by_the_noise_scale_exact_by_the_step_std(model_dir, tmp_path):
    kls = {}
    for form in ("flow_grpo", "exact"):
        cfg = make_cfg(model_dir, tmp_path, "klform" + form, "trainer.beta=0.5", f"trainer.kl_form={form}")
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        trans = rollout(
            trainer.adapter,
            ["a red circle"],
            4,
            trainer.sampling_config(),
            generator=torch.Generator().manual_seed(0),
        ).transitions()
        std = torch.full((len(trans), 1, 1, 1), 0.3)
        sigma, sigma_next = trans.sigma.view(-1, 1, 1, 1), trans.sigma_next.view(-1, 1, 1, 1)
        # Flow-GRPO's std_dev_t = a sqrt(s / (1 - s)), the next sigma standing in for s = 1
        flow_grpo_scale = 0.7 * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_next, sigma)))
        torch.testing.assert_close(kl_scale(form, trans, std), std if form == "exact" else flow_grpo_scale)
        trainer.train_step()
        kls[form] = trainer.train_step()["policy/kl"]  # same seed: the same rollouts, the KL in two forms
        trainer.cleanup()
    # exact = flow_grpo / |dt| per transition, and every |dt| < 1
    assert kls["exact"] > kls["flow_grpo"] > 0


def test_eval_rewards_replace_the_training_rewards_in_evaluation(model_dir, tmp_path):
    cfg = make_cfg(model_dir, tmp_path, "ev", "eval_rewards=[{name: shapes}]")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    out = trainer.evaluate()
    assert "eval/shapes/mean" in out and "eval/jpeg_incompressibility/mean" not in out
    assert out["eval/reward_mean"] == pytest.approx(out["eval/shapes/mean"])
    with pytest.raises(ValueError, match="eval_rewards"):
        make_cfg(model_dir, tmp_path, "ev2", "eval_rewards=[]")


def test_a_reward_for_what_the_family_does_not_decode_or_an_unknown_family_is_refused_at_load(
    model_dir, tmp_path
):
    video_reward = "[{name: temporal_consistency}]"
    for key in ("rewards", "eval_rewards"):
        with pytest.raises(
            ValueError,
            match=rf"{key}\.0: the 'temporal_consistency' reward scores \['videos'\], and a flow_grpo "
            r"\(model.family 'shapes': images\) run gives each reward \['images', 'prompts'\]",
        ):
            make_cfg(model_dir, tmp_path, "vid", f"{key}={video_reward}")
    with pytest.raises(
        ValueError, match=r"extra_eval\.motion\.rewards\.0: the 'temporal_consistency' reward"
    ):
        make_cfg(
            model_dir,
            tmp_path,
            "vid",
            f"extra_eval={{motion: {{prompts: shapes:heldout, rewards: {video_reward}}}}}",
        )
    with pytest.raises(
        ValueError,
        match=r"rewards\.0: the 'jpeg_incompressibility' reward scores \['images'\], and a flow_grpo "
        r"\(model.family 'wan': videos\) run gives each reward \['videos', 'prompts'\]",
    ):
        make_cfg(model_dir, tmp_path, "img", "model.family=wan")
    make_cfg(model_dir, tmp_path, "ok", "model.family=wan", f"rewards={video_reward}")
    with pytest.raises(ValueError, match=r"model.family: unknown flow adapter 'sd4'. Available: \['flux'"):
        make_cfg(model_dir, tmp_path, "fam", "model.family=sd4")


@pytest.mark.parametrize("rollout_mode", ["flat", "branch"])
def test_saved_training_samples_hold_the_rewards_trained_on_scored_once(model_dir, tmp_path, rollout_mode):
    mode = ("sampling.rollout=branch", "tree.split_steps=[0, 1]") if rollout_mode == "branch" else ()
    cfg = make_cfg(
        model_dir,
        tmp_path,
        f"samples{rollout_mode}",
        "trainer.sample_every=1",
        "rewards=[{name: shapes, options: {partial: true}}]",
        *mode,
    )
    trainer = FlowGRPOTrainer(cfg, Run(cfg.run, cfg))
    trainer.setup()
    scored = []
    score = trainer.score

    def recording_score(images, prompts, evaluation=False):
        raw, components = score(images, prompts, evaluation=evaluation)
        scored.append(raw)
        return raw, components

    trainer.score = recording_score
    trainer.train_step()
    assert len(scored) == 1
    records = [json.loads(line) for line in next(trainer.run.samples_dir.glob("train_*.jsonl")).open()]
    assert [r["shapes"] for r in records] == pytest.approx(scored[0][: len(records), 0].tolist())
    assert all("shapes/count" in r and "advantage" in r for r in records)
    trainer.cleanup()


def test_resume_is_exact(model_dir, tmp_path, interrupted_then_resumed):
    args = ("trainer.steps=3", "run.save_every=1", "trainer.eval_every=3")
    straight = main(make_cfg(model_dir, tmp_path, "a", *args))
    resumed = interrupted_then_resumed(
        FlowGRPOTrainer,
        main,
        make_cfg(model_dir, tmp_path, "b", *args),
        make_cfg(model_dir, tmp_path, "b", *args, "run.resume=true"),
        at=2,
    )
    drop = ("time/rollout_s", "time/train_s")
    assert {k: v for k, v in resumed.items() if k not in drop} == {
        k: v for k, v in straight.items() if k not in drop
    }
    assert len(read_metrics(tmp_path / "b")) == 4


def test_eval_writes_scores_and_grid(model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a red circle\n\na photo of two squares\n")
    extra = f"extra_eval={{again: {{prompts: {prompts}, rewards: [{{name: shapes, options: {{partial: true}}}}]}}}}"
    cfg = make_cfg(model_dir, tmp_path, "e", "rewards=[{name: shapes}]", extra)
    summary = evaluate(cfg, str(prompts), tmp_path / "eval", None, images_per_prompt=2)
    # the extra set: the same prompts and noise under the partial credit, with every mean the trainer logs
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup(for_training=False)
    logged = trainer.evaluate()
    assert {key for key in summary if key.startswith("again/")} == {
        "again/reward_mean",
        "again/shapes_mean",
        "again/shapes/object_mean",
        "again/shapes/count_mean",
        "again/shapes/colour_mean",
        "again/shapes/position_mean",
        "again/shapes/strict_mean",
    }
    assert summary["again/reward_mean"] >= summary["reward_mean"]  # partial credit >= the strict score
    assert logged["eval/again/reward_mean"] == pytest.approx(
        evaluate(cfg, str(prompts), tmp_path / "eval1", None, images_per_prompt=1)["again/reward_mean"]
    )
    assert summary["images"] == 4 and 0.0 <= summary["reward_mean"] <= 1.0
    lines = [json.loads(line) for line in (tmp_path / "eval/scores.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["a photo of a red circle"] * 2 + ["a photo of two squares"] * 2
    for key in ("shapes", "shapes/object", "shapes/count", "shapes/colour", "shapes/position"):
        assert summary[f"{key}_mean"] == pytest.approx(sum(r[key] for r in lines) / len(lines)), key
    assert (tmp_path / "eval/grid.png").is_file()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompt"):
        evaluate(cfg, str(empty), tmp_path / "eval2", None, images_per_prompt=1)


@pytest.mark.parametrize("objective", ["grpo", "nft"])
def test_branch_rollout_mode_trains(model_dir, tmp_path, objective):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "br" + objective,
        "sampling.rollout=branch",
        "tree.split_steps=[0, 1]",
        "tree.fusion=path_prob",
        "tree.width=2",
        f"trainer.objective={objective}",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    # 2 trees x 4 leaves; window of 2 SDE steps starting somewhere in 4 steps, splits at its first two steps
    assert metrics["tree/nodes"] == 2 * (1 + 2 + 4)
    assert metrics["nfe/rollout"] < 8 * 4  # shared prefixes: fewer evaluations than 8 flat samples
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))


def test_non_finite_reward_stops_the_run_before_its_step_writes(model_dir, tmp_path, monkeypatch):
    import rewards
    from rewards.base import RewardCheckError, RewardOutput

    jpeg = rewards.build("jpeg_incompressibility")
    calls = []

    def nan_on_third_call(**batch):  # evaluation at step 0, training steps 1 and 2
        out = jpeg.score(**batch)
        calls.append(len(out.scores))
        if len(calls) == 3:
            out.scores[5] = float("nan")
        return RewardOutput(scores=out.scores)

    cfg = make_cfg(model_dir, tmp_path, "nan", "trainer.steps=3", "trainer.eval_every=3")
    trainer = FlowGRPOTrainer(cfg, Run(cfg.run, cfg))
    trainer.setup()
    monkeypatch.setattr(trainer.rewards[0], "score", nan_on_third_call)
    stats_before = None
    original_step = trainer.train_step

    def step_and_remember():
        nonlocal stats_before
        stats_before = trainer.stats.state_dict() if trainer.step == 1 else stats_before
        return original_step()

    monkeypatch.setattr(trainer, "train_step", step_and_remember)
    with pytest.raises(
        RewardCheckError,
        match=r"'jpeg_incompressibility' returned 1 non-finite score\(s\) of 8; the first is nan at sample 5 \(prompt '",
    ):
        trainer.train()
    trainer.cleanup()
    assert [r["step"] for r in read_metrics(tmp_path / "nan")] == [0, 1]  # nothing of step 2
    after = trainer.stats.state_dict()  # the statistics store did not see step 2's rewards either
    assert after["ids"] == stats_before["ids"] and after["global_count"] == stats_before["global_count"]
    assert all(torch.equal(after["tensors"][k], v) for k, v in stats_before["tensors"].items())


def test_eval_prompts_outside_the_grammar_are_refused_before_generation(model_dir, tmp_path, monkeypatch):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a red circle\n# fine so far\na photo of three dragons\n")
    cfg = make_cfg(model_dir, tmp_path, "g", "rewards=[{name: shapes}]")
    monkeypatch.setattr(FlowGRPOTrainer, "generate", lambda *a, **k: pytest.fail("generated before checking"))
    with pytest.raises(
        ValueError, match=r"p\.txt line 3: cannot parse shapes prompt 'a photo of three dragons'"
    ):
        evaluate(cfg, str(prompts), tmp_path / "eval", None, images_per_prompt=1)


# ---------------------------------------------------------------- Advantage Weighted Matching (objective=awm)
AWM = ("trainer.objective=awm", "trainer.awm.timesteps=2")  # 4 sampler steps leave steps 1..2 to draw from


@pytest.mark.parametrize(
    "rollout_mode, lora",
    [("flat", True), ("flat", False), ("branch", True)],
    ids=["flat", "flat-full", "branch"],
)
def test_awm_step_trains_on_policy_in_each_rollout_mode(model_dir, tmp_path, rollout_mode, lora):
    extra = ["model.lora=null"] if not lora else []
    if rollout_mode == "branch":
        extra += ["sampling.rollout=branch", "tree.split_steps=[0, 1]"]
    cfg = make_cfg(model_dir, tmp_path, "awm" + rollout_mode + str(lora), *AWM, "trainer.beta=0.5", *extra)
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    named = dict(trainer.adapter.transformer.named_parameters())
    before = {n: p.detach().clone() for n, p in named.items()}
    metrics = trainer.train_step()
    # one optimizer step after all minibatches and no old policy: ratio exactly 1, the reference not yet left
    assert metrics["policy/ratio_mean"] == 1.0
    assert metrics["policy/kl"] == 0.0
    assert metrics["awm/log_p"] < 0 and "policy/kl_old" not in metrics
    images = 8  # flat: 8 rollouts; branch: 2 trees x 4 leaves
    # rollout + per point (2 per image) one policy and one reference forward
    assert metrics["nfe/total"] == metrics["nfe/rollout"] + 2 * (2 * images)
    trained = [n for n, p in named.items() if p.requires_grad]
    assert trained and (all("lora" in n for n in trained) if lora else len(trained) == len(named))
    assert any(not torch.equal(before[n], named[n]) for n in trained)
    assert all(torch.equal(before[n], p) for n, p in named.items() if not p.requires_grad)
    assert trainer.train_step()["policy/kl"] > 0.0


def remember_regression_points(trainer):
    """``{"value": (rows, sigma, x_t, target)}``, the last regression points ``trainer`` drew, kept from now on."""
    points = {}
    draw = trainer.regression_points

    def remember(*args, **kwargs):
        points["value"] = draw(*args, **kwargs)
        return points["value"]

    trainer.regression_points = remember
    return points


@pytest.mark.parametrize("objective", [AWM, ("trainer.objective=nft",)])
def test_advantage_sign_moves_the_sample_fit_and_zero_advantages_move_nothing(model_dir, tmp_path, objective):
    """AWM and DiffusionNFT on their first update (the weights are the sampling policy): a sample with A > 0 is
    fitted more closely, one with A < 0 less (NFT: optimality r = 1/2 + A / (2 A_max) above or below 1/2), and
    A = 0 gives no gradient at all."""
    from mmrl.core.losses import awm_log_likelihood

    cfg = make_cfg(
        model_dir,
        tmp_path,
        "sign",
        *objective,
        "trainer.beta=0.0",
        "trainer.weight_decay=0.0",
        "trainer.lr=1e-4",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    batch = trainer.collect()
    points = remember_regression_points(trainer)

    def log_p_of_sample(sample):  # mean AWM log-likelihood (the fit) of one sample's points, at the update's
        rows, sigma, x_t, target = points["value"]
        keep = torch.nonzero(rows == sample).flatten()
        with torch.no_grad():
            v = trainer.adapter.velocity(x_t[keep], sigma[keep], batch.cond.select(rows[keep]), 1.0)
        return float(awm_log_likelihood(v, target[keep], sigma[keep]).mean())

    # zero advantages: zero gradient, and Adam without weight decay leaves the weights exactly where they were
    before = [p.detach().clone() for p in trainer.trainable]
    trainer.objective.update(trainer, replace(batch, sample_adv=torch.zeros(8)))
    assert all(torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
    for sign in (1.0, -1.0):  # only sample 3 weighted: its points fit better (A > 0) or worse (A < 0)
        adv = torch.zeros(8)
        adv[3] = sign
        state = [p.detach().clone() for p in trainer.trainable]
        trainer.optimizer.state.clear()  # each sign's step from a fresh Adam: no momentum of the other sign
        # the same points for the update and the check
        trainer.regression_points = lambda *args, **kwargs: points["value"]
        start = log_p_of_sample(3)
        trainer.objective.update(trainer, replace(batch, sample_adv=adv))
        assert (log_p_of_sample(3) - start) * sign > 0
        with torch.no_grad():
            for p, s in zip(trainer.trainable, state, strict=True):
                p.copy_(s)


def test_awm_points_are_stratified_and_shared_within_a_prompt_group(model_dir, tmp_path):
    from mmrl.flow.objectives.awm import stratified_steps

    # 10 steps, fraction 0.9: steps 1..8 cut into 6 strata {1} {2} {3, 4} {5} {6} {7, 8}
    steps = stratified_steps(500, 6, 10, 0.9, torch.Generator().manual_seed(0))
    strata = [{1}, {2}, {3, 4}, {5}, {6}, {7, 8}]
    assert steps.shape == (6, 500)
    assert all(set(steps[k].tolist()) == strata[k] for k in range(6))
    with pytest.raises(
        ValueError, match=r"3 timesteps \(discrete_wo_init\) need 3 sampler steps in 1 \.\. 2"
    ):
        stratified_steps(1, 3, 4, 0.9, torch.Generator())
    # AWM's other time_types, as its train_sd3_awm.py draws them: `discrete` from step 0 (steps 0..8 in 6 strata
    # {0} {1, 2} {3} {4, 5} {6} {7, 8}, edges linspace(0, 9, 7)); `discrete_with_init` step 0, then 5 strata of 1..8
    steps = stratified_steps(500, 6, 10, 0.9, torch.Generator().manual_seed(0), "discrete")
    strata = [{0}, {1, 2}, {3}, {4, 5}, {6}, {7, 8}]
    assert all(set(steps[k].tolist()) == strata[k] for k in range(6))
    steps = stratified_steps(500, 6, 10, 0.9, torch.Generator().manual_seed(0), "discrete_with_init")
    strata = [{0}, {1}, {2, 3}, {4}, {5, 6}, {7, 8}]
    assert all(set(steps[k].tolist()) == strata[k] for k in range(6))
    assert stratified_steps(3, 1, 10, 0.9, torch.Generator(), "discrete_with_init").tolist() == [[0, 0, 0]]
    strata = [{1}, {2}, {3, 4}, {5}, {6}, {7, 8}]
    cfg = make_cfg(model_dir, tmp_path, "awmpts", "trainer.objective=awm", "sampling.num_steps=10")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    schedule = trainer.adapter.sigmas(10, 32, 32, None).float()
    x0, groups = torch.randn(6, 3, 8, 8), torch.tensor([0, 0, 0, 1, 1, 1])
    draw = lambda n: stratified_steps(n, 6, 10, 0.9, trainer.generator)  # noqa: E731
    rows, sigma, _, target = trainer.regression_points(x0, groups, 6, draw)
    assert rows.tolist() == list(range(6)) * 6
    sigma = sigma.view(6, 6)  # [T, B]
    for k in range(6):
        assert set(sigma[k].tolist()) <= {float(schedule[i]) for i in strata[k]}
        assert sigma[k, 0] == sigma[k, 1] == sigma[k, 2] and sigma[k, 3] == sigma[k, 4] == sigma[k, 5]
    eps = (target + x0[rows]).view(6, 6, -1)
    torch.testing.assert_close(eps[:, 0], eps[:, 2], atol=1e-6, rtol=0)


def test_awm_with_a_soft_updated_old_policy_pulls_toward_it_and_resumes_exactly(
    model_dir, tmp_path, interrupted_then_resumed
):
    old = ("trainer.old_policy_decay=0.5", "trainer.awm.clip_range=0.5")
    cfg = make_cfg(model_dir, tmp_path, "awmold", *AWM, *old)
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    first = trainer.train_step()  # the old policy still equals the weights: ratio 1, no pull
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["policy/kl_old"] == 0.0
    second = trainer.train_step()  # now it lags half a step behind
    assert second["policy/kl_old"] > 0.0 and second["policy/ratio_mean"] != pytest.approx(1.0, abs=1e-7)
    assert 0.0 <= second["clip/low_frac"] <= 1.0
    args = (*AWM, *old, "trainer.steps=3", "run.save_every=1", "trainer.eval_every=3")
    straight = main(make_cfg(model_dir, tmp_path, "awma", *args))
    resumed = interrupted_then_resumed(
        FlowGRPOTrainer,
        main,
        make_cfg(model_dir, tmp_path, "awmb", *args),
        make_cfg(model_dir, tmp_path, "awmb", *args, "run.resume=true"),
        at=2,
    )
    drop = ("time/rollout_s", "time/train_s")
    assert {k: v for k, v in resumed.items() if k not in drop} == {
        k: v for k, v in straight.items() if k not in drop
    }


@pytest.mark.parametrize(
    "overrides, weights",
    [
        (("trainer.objective=grpo", "trainer.beta=0.5"), {"policy/kl": 0.5}),
        ((*AWM, "trainer.beta=0.5"), {"policy/kl": 0.5}),
        (
            (*AWM, "trainer.beta=0", "trainer.old_policy_decay=0.5", "trainer.awm.old_kl_beta=2.0"),
            {"policy/kl_old": 2.0},
        ),
        (
            (*AWM, "trainer.beta=0.5", "trainer.old_policy_decay=0.5"),
            {"policy/kl": 0.5, "policy/kl_old": 1.0},
        ),
    ],
)
def test_zero_advantages_leave_exactly_the_kl_terms_in_the_loss(model_dir, tmp_path, overrides, weights):
    """With every advantage 0 the clipped surrogate is 0, so the loss an update minimises is its KL terms alone:
    ``beta * KL(ref)`` (+ AWM's ``old_kl_beta * KL(old)``), added, not subtracted (a pull toward, not away)."""
    cfg = make_cfg(model_dir, tmp_path, "klterms", *overrides)
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    trainer.train_step()  # the weights leave the reference and the soft-updated old policy
    batch = trainer.collect()
    trainer.metrics.reduce()  # the rollout's metrics
    zero = replace(batch, adv=torch.zeros_like(batch.adv), sample_adv=torch.zeros_like(batch.sample_adv))
    trainer.objective.update(trainer, zero)
    metrics = trainer.metrics.reduce()
    assert all(metrics[name] > 1e-6 for name in weights)
    expected = sum(weight * metrics[name] for name, weight in weights.items())
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5)


def test_awm_clips_the_advantages_then_rescales_them_to_advantage_max(model_dir, tmp_path, monkeypatch):
    """``A^ = clip(A, -adv_clip_max, adv_clip_max) * advantage_max / adv_clip_max``, each point weighted by its
    sample's: at 5 and 1 (the paper's A / 5), A = 7, -2.5, 1, 0, -9, 5, 2, -1 weigh 1, -0.5, 0.2, 0, -1, 1, 0.4,
    -0.2."""
    from mmrl.core import losses as loss_lib
    from mmrl.flow.objectives.awm import awm_update

    cfg = make_cfg(
        model_dir, tmp_path, "awmscale", *AWM, "trainer.adv_clip_max=5", "trainer.awm.advantage_max=1"
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    batch = trainer.collect()
    points = remember_regression_points(trainer)
    seen = []
    surrogate = loss_lib.clipped_surrogate

    def record(logp, old, adv, *args, **kwargs):
        seen.append(adv.detach().clone())
        return surrogate(logp, old, adv, *args, **kwargs)

    monkeypatch.setattr(loss_lib, "clipped_surrogate", record)
    advantages = torch.tensor([7.0, -2.5, 1.0, 0.0, -9.0, 5.0, 2.0, -1.0])
    awm_update(trainer, replace(batch, sample_adv=advantages))
    scaled = torch.tensor([1.0, -0.5, 0.2, 0.0, -1.0, 1.0, 0.4, -0.2])
    # every point once (the minibatches' order aside)
    torch.testing.assert_close(torch.cat(seen).sort().values, scaled[points["value"][0]].sort().values)


def test_awm_config_errors_name_the_key(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"trainer\.awm\.timesteps \(6\) exceeds the 2 sampler steps"):
        make_cfg(model_dir, tmp_path, "bad", "trainer.objective=awm")
    with pytest.raises(ValueError, match=r"trainer\.awm\.weighting"):
        make_cfg(model_dir, tmp_path, "bad", *AWM, "trainer.awm.weighting=t")
    with pytest.raises(ValueError, match=r"trainer\.awm\.ghuber_power"):
        make_cfg(model_dir, tmp_path, "bad", *AWM, "trainer.awm.ghuber_power=0")
    make_cfg(model_dir, tmp_path, "fine", "trainer.awm.timesteps=6")  # only checked for objective=awm
    # 10 steps at fraction 0.9: 8 steps from step 1, 9 from step 0 (`discrete`), 9 with step 0 added
    nine = ("trainer.objective=awm", "sampling.num_steps=10", "trainer.awm.timesteps=9")
    with pytest.raises(ValueError, match=r"timesteps \(9\) exceeds the 8 sampler steps .* discrete_wo_init"):
        make_cfg(model_dir, tmp_path, "bad", *nine)
    for time_type in ("discrete", "discrete_with_init"):
        make_cfg(model_dir, tmp_path, "fine", *nine, f"trainer.awm.time_type={time_type}")
    with pytest.raises(ValueError, match=r"trainer\.awm\.time_type"):
        make_cfg(model_dir, tmp_path, "bad", *AWM, "trainer.awm.time_type=uniform")


def test_regression_forwards_are_counted_twice_under_cfg(model_dir, tmp_path):
    """NFT on CFG-3 samples regresses the guided velocity (``train_cfg``): every point's old-policy, reference
    and trained forwards are CFG passes of two transformer rows each, so each counts 2 in the NFE."""
    for scale, each in ((3.0, 2), (1.0, 1)):
        cfg = make_cfg(
            model_dir,
            tmp_path,
            f"nfe{scale}",
            "trainer.objective=nft",
            "trainer.beta=0.1",
            f"sampling.guidance_scale={scale}",
        )
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.setup()
        batch = trainer.collect()
        rows, sigma, x_t, _ = trainer.regression_points(batch.final_latents, batch.groups)
        cond = batch.cond.select(rows)
        assert trainer.regression_guidance(cond) == scale
        start = trainer.nfe_total
        trainer.sampling_velocities(x_t, sigma, cond)
        assert trainer.nfe_total - start == each * len(rows)
        start = trainer.nfe_total
        trainer.regress(x_t, sigma, cond, lambda v, idx: v.sum(dim=tuple(range(1, v.ndim))) * 0.0)
        assert trainer.nfe_total - start == 2 * each * len(
            rows
        )  # the reference's forwards and the trained ones


# ---------------------------------------------------------------- guidance distillation (trainer.guidance_distill)
@pytest.mark.parametrize("lora", [True, False])
def test_guidance_distillation_pulls_the_cfg_free_velocity_toward_the_frozen_teachers_cfg(
    model_dir, tmp_path, lora
):
    extra = () if lora else ("model.lora=null", "trainer.lr=1e-3")  # every weight moves: a smaller step
    cfg = make_cfg(
        model_dir,
        tmp_path,
        f"distill{lora}",
        "trainer.objective=nft",
        "trainer.guidance_distill.weight=1.0",
        "trainer.guidance_distill.guidance_scale=3.0",
        *extra,
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    batch = trainer.collect()
    rows, sigma, x_t, _ = trainer.regression_points(batch.final_latents, batch.groups)
    cond = batch.cond.select(rows)
    # the teacher is the start weights with CFG 3 on the negative prompt: what sampling at scale 3 would use
    guided = trainer.adapter.encode(batch.prompts, cfg=True).select(rows)
    with torch.no_grad():
        expected = trainer.adapter.velocity(x_t, sigma, guided, 3.0)
    nfe = trainer.nfe_total
    v_teacher = trainer.teacher_velocity(x_t, sigma, cond)
    assert trainer.nfe_total - nfe == 2 * len(rows)
    torch.testing.assert_close(v_teacher, expected, rtol=1e-4, atol=1e-5)
    # guided as the family's pipeline guides (Qwen-Image rescales to the conditional norm): the adapter's guide
    halves = []
    trainer.adapter.guide = lambda v_u, v_c, w: halves.append(w) or 2.0 * v_c
    with torch.no_grad():
        v_cond = trainer.adapter.velocity(x_t, sigma, cond, 1.0)
    torch.testing.assert_close(trainer.teacher_velocity(x_t, sigma, cond), 2.0 * v_cond, rtol=1e-4, atol=1e-5)
    assert halves == [3.0]
    del trainer.adapter.guide

    # with the objective's own term switched off, the distillation alone closes the gap step by step
    gaps = []
    for _ in range(6):
        trainer.regress(x_t, sigma, cond, lambda v, idx: v.sum(dim=tuple(range(1, v.ndim))) * 0.0)
        gaps.append(trainer.metrics.reduce()["policy/guidance_gap"])
    assert gaps[0] > 0 and gaps[-1] < 0.7 * gaps[0], gaps
    # the teacher stays where it was: the same velocities after the updates
    with torch.no_grad():
        torch.testing.assert_close(trainer.teacher_velocity(x_t, sigma, cond), v_teacher)


def test_guidance_distillation_config_errors_name_the_key(model_dir, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"trainer\.guidance_distill\.weight applies to the objectives that regress on the final samples "
        r"\(awm, nft, rwr\), not grpo",
    ):
        make_cfg(model_dir, tmp_path, "bad", "trainer.guidance_distill.weight=1.0")  # objective grpo
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.guidance_scale"):
        make_cfg(
            model_dir, tmp_path, "bad", "trainer.objective=nft", "trainer.guidance_distill.guidance_scale=0.5"
        )
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "bad",
        "trainer.objective=nft",
        "trainer.guidance_distill.weight=1.0",
        "trainer.guidance_distill.guidance_scale=1.0",
    )
    with pytest.raises(ValueError, match="needs a teacher with an unconditional branch"):
        FlowGRPOTrainer(cfg, None).setup()


def test_guidance_distillation_weight_schedule_hand_values():
    # constant: the weight until step `steps`, then off
    off_after = GuidanceDistillSettings(weight=0.5, steps=4)
    assert [off_after.weight_at(step, 10) for step in range(6)] == [0.5, 0.5, 0.5, 0.5, 0.0, 0.0]
    assert GuidanceDistillSettings(weight=0.5).weight_at(99, 10) == 0.5 * (99 < 10)  # null: ends with the run
    # cosine over S = 4 steps: w * (1 + cos(pi k / 4)) / 2 = 2 * {1, 0.85355, 0.5, 0.14645}, then 0
    cosine = GuidanceDistillSettings(weight=2.0, schedule="cosine", steps=4)
    expected = [2.0, 1.0 + 2**-0.5, 1.0, 1.0 - 2**-0.5, 0.0, 0.0]
    assert [cosine.weight_at(step, 10) for step in range(6)] == pytest.approx(expected, abs=1e-12)
    # steps null: the cosine spans the run, trainer.steps = 2 -> 1, 0.5 (k = 0, 1), 0 at k = 2
    run_long = GuidanceDistillSettings(weight=1.0, schedule="cosine")
    assert [run_long.weight_at(step, 2) for step in range(3)] == pytest.approx([1.0, 0.5, 0.0], abs=1e-12)


def test_guidance_distillation_schedule_errors_name_the_key_and_off_skips_the_teacher(model_dir, tmp_path):
    distill = ("trainer.objective=nft", "trainer.guidance_distill.weight=1.0")
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.steps"):
        make_cfg(model_dir, tmp_path, "bad", *distill, "trainer.guidance_distill.steps=0")
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.schedule"):
        make_cfg(model_dir, tmp_path, "bad", *distill, "trainer.guidance_distill.schedule=linear")
    cfg = make_cfg(model_dir, tmp_path, "offafter1", *distill, "trainer.guidance_distill.steps=1")
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    nfe = trainer.nfe_total
    first = trainer.train_step()  # step 0: the teacher's two forwards per regression point
    trainer.step += 1
    with_teacher = trainer.nfe_total - nfe
    assert first["policy/guidance_weight"] == 1.0 and first["policy/guidance_gap"] > 0
    nfe = trainer.nfe_total
    second = trainer.train_step()  # step 1 >= steps: off, no teacher forwards, nothing logged for it
    without_teacher = trainer.nfe_total - nfe
    assert "policy/guidance_gap" not in second and "policy/guidance_weight" not in second
    points = cfg.allocation.rollouts_per_step * cfg.trainer.nft_timesteps
    assert with_teacher - without_teacher == 2 * points


# ---------------------------------------------------------------- EMA of the weights (trainer.ema_decay)
@pytest.mark.parametrize("lora", [True, False])
def test_ema_warms_up_and_is_what_evaluation_and_the_exported_weights_hold(model_dir, tmp_path, lora):
    extra = () if lora else ("model.lora=null", "trainer.lr=1e-3")
    cfg = make_cfg(
        model_dir, tmp_path, f"ema{lora}", "trainer.objective=nft", "trainer.ema_decay=0.9", *extra
    )
    trainer = FlowGRPOTrainer(cfg, Run(cfg.run, cfg))
    trainer.setup()
    start = [p.detach().clone() for p in trainer.trainable]
    trainer.train_step()  # one optimizer step (8 rollouts, minibatch 8) at step n = 0
    trainer.step += 1
    first = [p.detach().clone() for p in trainer.trainable]
    trainer.train_step()  # n = 1
    trainer.step += 1
    live = [p.detach().clone() for p in trainer.trainable]
    # n = 0: d = min(0.9, 1 / 10) = 0.1, ema = 0.1 start + 0.9 first;
    # n = 1: d = min(0.9, 2 / 11), ema = 2/11 ema + 9/11 live (without the warm-up: 0.81 start + 0.09 first + 0.1 live)
    expected = [
        (2 / 11) * (0.1 * a + 0.9 * b) + (9 / 11) * c for a, b, c in zip(start, first, live, strict=True)
    ]
    assert any(not torch.equal(a, c) for a, c in zip(start, live, strict=True))
    with trainer.evaluation_weights():
        for value, p in zip(expected, trainer.trainable, strict=True):
            torch.testing.assert_close(p, value, rtol=1e-5, atol=1e-7)
    assert all(torch.equal(a, p) for a, p in zip(live, trainer.trainable, strict=True))  # restored afterwards

    # the checkpoint's diffusers weights are the EMA; state.pt keeps the live weights (to resume) and the EMA
    trainer.save_checkpoint()
    trainer.cleanup()
    checkpoint = tmp_path / f"ema{lora}/checkpoints/step_00000002"
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    names = [n for n, p in trainer.adapter.transformer.named_parameters() if p.requires_grad]
    for name, value, p in zip(names, expected, live, strict=True):
        torch.testing.assert_close(state["ema"][name], value, rtol=1e-5, atol=1e-7)
        assert torch.equal(state["trainable"][name], p)
    if lora:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(
            model_dir, vae=None, text_encoder_3=None, tokenizer_3=None
        )
        pipe.load_lora_weights(checkpoint / "adapter")
        loaded = {n.replace(".default_0", ".default"): p for n, p in pipe.transformer.named_parameters()}
    else:
        from diffusers import SD3Transformer2DModel

        loaded = dict(SD3Transformer2DModel.from_pretrained(checkpoint / "transformer").named_parameters())
    for name in names:
        assert torch.equal(loaded[name], state["ema"][name]), name

    # `mmrl eval` of the checkpoint scores the EMA: the trainer's own evaluation at step 2
    prompts = tmp_path / "heldout.txt"
    held_out = trainer.eval_pool[: cfg.trainer.eval_prompts]
    prompts.write_text("\n".join(held_out) + "\n")
    summary = evaluate(cfg, str(prompts), tmp_path / f"eval{lora}", checkpoint, images_per_prompt=1)
    other = FlowGRPOTrainer(cfg, None)
    other.setup()
    other.load_state(state)
    assert summary["reward_mean"] == pytest.approx(other.evaluate()["eval/reward_mean"])
    with other.evaluation_weights():
        for name, p in zip(names, other.trainable, strict=True):
            assert torch.equal(p, state["ema"][name])


def test_ema_updates_once_every_nth_training_step(model_dir, tmp_path):
    """``trainer.ema_every=2`` (Flow-Factory's ema_update_interval) with two optimizer steps per training step: the
    EMA stays at the start after step 0 and takes one update after step 1, ``ema = 2/11 start + 9/11 live``
    (d = min(0.9, 2 / 11) at n = 1), not one per optimizer step."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "every",
        "trainer.objective=nft",
        "trainer.ema_decay=0.9",
        "trainer.ema_every=2",
        "trainer.updates_per_step=2",
        "trainer.minibatch_size=4",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    names = list(trainer.ema.shadow)
    start = {n: trainer.ema.shadow[n].clone() for n in names}
    optimizer_steps = []
    original = trainer.step_optimizer
    trainer.step_optimizer = lambda: (optimizer_steps.append(trainer.step), original())
    trainer.train_step()
    trainer.step += 1
    assert optimizer_steps == [0, 0]
    assert all(torch.equal(trainer.ema.shadow[n], start[n]) for n in names)
    trainer.train_step()
    trainer.step += 1
    live = dict(zip(names, (p.detach() for p in trainer.trainable), strict=True))
    assert any(not torch.equal(live[n], start[n]) for n in names)
    for n in names:
        torch.testing.assert_close(trainer.ema.shadow[n], (2 / 11) * start[n] + (9 / 11) * live[n])


def test_self_teacher_is_refreshed_from_the_ema_every_n_steps_and_resumes(model_dir, tmp_path):
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "selfteacher",
        "model.lora=null",
        "trainer.lr=1e-3",
        "trainer.objective=nft",
        "trainer.beta=0.01",
        "trainer.ema_decay=0.9",
        "trainer.guidance_distill.weight=1.0",
        "trainer.guidance_distill.refresh_every=2",
        "trainer.steps=3",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()

    def weights(module):
        return [p.detach().clone() for p in module.parameters()]

    start = weights(trainer.adapter.transformer)
    live = []
    for _ in range(2):  # steps 0 and 1: the teacher is the start weights
        metrics = trainer.train_step()
        trainer.step += 1
        live.append(weights(trainer.adapter.transformer))
        assert "policy/teacher_refreshed" not in metrics
        assert all(torch.equal(a, b) for a, b in zip(weights(trainer.distill_teacher), start, strict=True))
    # step 2: the teacher becomes the EMA after two updates, 2/11 (0.1 start + 0.9 live_1) + 9/11 live_2
    assert trainer.refresh_teacher()
    for teacher, a, b, c in zip(trainer.distill_teacher.parameters(), start, *live, strict=True):
        torch.testing.assert_close(
            teacher, (2 / 11) * (0.1 * a + 0.9 * b) + (9 / 11) * c, rtol=1e-5, atol=1e-7
        )
    # the distillation's target is that teacher's CFG-3 velocity, not the start model's
    batch = trainer.collect()
    rows, sigma, x_t, _ = trainer.regression_points(batch.final_latents, batch.groups)
    cond, guided = batch.cond.select(rows), trainer.adapter.encode(batch.prompts, cfg=True).select(rows)
    v_teacher = trainer.teacher_velocity(x_t, sigma, cond)
    with torch.no_grad(), trainer.evaluation_weights():
        expected = trainer.adapter.velocity(x_t, sigma, guided, 3.0)
    with torch.no_grad(), trainer.reference_policy():  # trainer.beta's reference stays the start weights
        assert all(
            torch.equal(a, b) for a, b in zip(weights(trainer.adapter.transformer), start, strict=True)
        )
        from_start = trainer.adapter.velocity(x_t, sigma, guided, 3.0)
    torch.testing.assert_close(v_teacher, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expected, from_start, rtol=1e-4, atol=1e-5)
    assert trainer.train_step()["policy/teacher_refreshed"] == 1.0  # the step's own refresh (step 2 % 2 == 0)
    trainer.step += 1
    # the teacher is part of the resumable state
    state = trainer.state_dict()
    other = FlowGRPOTrainer(cfg, None)
    other.setup()
    other.load_state(state)
    assert all(
        torch.equal(a, b)
        for a, b in zip(weights(other.distill_teacher), weights(trainer.distill_teacher), strict=True)
    )
    assert not other.refresh_teacher()  # step 3: not a multiple of 2


def test_self_teacher_config_errors_name_the_key(model_dir, tmp_path):
    distill = ("trainer.objective=nft", "trainer.guidance_distill.weight=1.0")
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.refresh_every .*model\.lora set"):
        make_cfg(model_dir, tmp_path, "bad", *distill, "trainer.guidance_distill.refresh_every=5")
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.refresh_every .*weight 0\.0"):
        make_cfg(
            model_dir,
            tmp_path,
            "bad",
            "trainer.objective=nft",
            "model.lora=null",
            "trainer.guidance_distill.refresh_every=5",
        )
    with pytest.raises(ValueError, match=r"trainer\.guidance_distill\.refresh_every"):
        make_cfg(
            model_dir,
            tmp_path,
            "bad",
            *distill,
            "model.lora=null",
            "trainer.guidance_distill.refresh_every=0",
        )


@pytest.mark.parametrize("schedule", ["sliding", "random"])
def test_cps_windows_end_before_the_last_step_and_its_transitions_train(model_dir, tmp_path, schedule):
    """CPS adds no noise at the last step (sigma_next = 0): a moving window never reaches it."""
    cfg = make_cfg(
        model_dir, tmp_path, f"cps{schedule}", "sampling.sde_kind=cps", f"sampling.window_schedule={schedule}"
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    windows = {trainer.sde_window(step) for step in range(40)}
    assert windows == {(0, 2), (1, 3)}  # 4 steps, window 2: never (2, 4)
    trainer.train_step()
    # whatever the objective (nft's rollouts sample the window too; they failed at the first step), and with no
    # window at all (every step SDE)
    for objective in ("grpo", "nft"):
        for window in ("4", "null"):
            with pytest.raises(
                ValueError,
                match=rf"sde_kind=cps adds no noise at the last step: .*\(got {window.replace('null', 'None')}",
            ):
                make_cfg(
                    model_dir,
                    tmp_path,
                    "cps",
                    "sampling.sde_kind=cps",
                    f"sampling.sde_window={window}",
                    f"trainer.objective={objective}",
                )


@pytest.mark.parametrize("schedule", ["fixed", "sliding", "random"])
def test_sde_window_range_keeps_the_window_inside_it(model_dir, tmp_path, schedule):
    """verl's Qwen-Image OCR shape on 8 steps: a window of 2 inside steps 1 <= i < 6 starts at 1, 2, 3 or 4."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        f"range{schedule}",
        "sampling.num_steps=8",
        "sampling.sde_window_range=[1, 6]",
        f"sampling.window_schedule={schedule}",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    windows = [trainer.sde_window(step) for step in range(40)]
    starts = {(1, 3), (2, 4), (3, 5), (4, 6)}
    if schedule == "fixed":
        assert set(windows) == {(1, 3)}
    elif schedule == "sliding":
        assert windows[:5] == [(1, 3), (2, 4), (3, 5), (4, 6), (1, 3)]
    else:
        assert set(windows) == starts
    # CPS never noises the last step: [5, 8] with a window of 2 leaves starts 5 only
    cps = make_cfg(
        model_dir,
        tmp_path,
        "rangecps",
        "sampling.num_steps=8",
        "sampling.sde_kind=cps",
        "sampling.sde_window_range=[5, 8]",
    )
    trainer = FlowGRPOTrainer(cps, None)
    trainer.setup()
    assert {trainer.sde_window(step) for step in range(20)} == {(5, 7)}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sampling.sde_window=null", "sampling.sde_window_range=[0, 3]"], "set sampling.sde_window too"),
        (["sampling.sde_window_range=[2, 5]"], r"sde_window_range \[2, 5\] must satisfy .*num_steps \(4\)"),
        (["sampling.sde_window_range=[1, 2]"], r"hold the sampling.sde_window of 2 steps"),
        (["sampling.sde_kind=cps", "sampling.sde_window_range=[2, 4]"], "before the last step"),
    ],
)
def test_sde_window_range_errors_name_the_keys(model_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_cfg(model_dir, tmp_path, "bad", *overrides)


def test_cps_noise_level_above_one_is_refused_at_load(tmp_path):
    """CPS's std ``s' sin(a pi / 2)`` is 0 at ``a = 2`` and negative above; Flow-GRPO's CPS range is (0, 1]."""
    cps = make_cfg(tmp_path, tmp_path, "cps1", "sampling.sde_kind=cps", "sampling.noise_level=1")
    assert cps.sampling.noise_level == 1
    with pytest.raises(
        ValueError, match=r"sampling\.noise_level \(2\.0\) must be at most 1 with sampling\.sde_kind cps"
    ):
        make_cfg(tmp_path, tmp_path, "cps2", "sampling.sde_kind=cps", "sampling.noise_level=2")
    # Flow-GRPO's own SDE takes any a > 0
    assert make_cfg(tmp_path, tmp_path, "sde2", "sampling.noise_level=2").sampling.noise_level == 2


def test_sampling_shift_reaches_rollouts_evaluation_and_the_regressed_points(model_dir, tmp_path):
    """sampling.shift 1.5 on 4 steps (the model's scheduler shifts by 3): rollouts and evaluation get it, and NFT
    regresses at the shifted sigmas."""
    cfg = make_cfg(model_dir, tmp_path, "shift", "sampling.shift=1.5", "trainer.objective=nft")
    assert cfg.sampling.rollout_settings((0, 2)).shift == 1.5
    assert cfg.sampling.rollout_settings((0, 0), num_steps=3).shift == 1.5
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    t = torch.linspace(1, 0, 5)[:-1]
    shifted = 1.5 * t / (1 + 0.5 * t)
    own = trainer.adapter.sigmas(4, 32, 32)[:-1]
    assert not torch.isclose(own[1:, None], shifted[None, 1:]).any()
    _, sigma, _, _ = trainer.regression_points(
        torch.zeros(8, 4, 8, 8), torch.arange(8) // 4, num_timesteps=64
    )
    visited = torch.isclose(sigma[:, None], shifted[None, :]).any(dim=1)
    assert visited.all()
    with pytest.raises(ValueError, match=r"sampling\.shift"):
        make_cfg(model_dir, tmp_path, "shift0", "sampling.shift=0")


def test_per_sample_timesteps_draw_each_samples_own_steps_without_the_last(model_dir, tmp_path):
    """DanceGRPO's selection: each sample trains its own int(0.6 * 7) = 4 of the 7 SDE steps left once the last of
    8 is skipped (ignore_last), and its transitions are exactly those (sample, step) pairs."""
    cfg = make_cfg(
        model_dir,
        tmp_path,
        "per_sample",
        "sampling.num_steps=8",
        "sampling.sde_window=null",
        "trainer.timestep_fraction=0.6",
        "trainer.timestep_selection=per_sample",
        "trainer.timestep_skip_last=true",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    steps = trainer._train_steps(torch.ones(8, dtype=torch.bool), 16)
    assert steps.shape == (16, 4)
    assert all(row.tolist() == sorted(set(row.tolist())) for row in steps)  # distinct, in order
    assert int(steps.max()) <= 6  # never the last step
    assert len({tuple(row.tolist()) for row in steps}) > 1  # each sample its own draw
    batch = trainer.collect()
    trans = batch.transitions
    samples = batch.final_latents.shape[0]
    assert torch.bincount(trans.sample_index, minlength=samples).tolist() == [4] * samples
    assert int(trans.step_index.max()) <= 6
    per_sample = trans.step_index.reshape(samples, 4)
    assert len({tuple(row.tolist()) for row in per_sample}) > 1
    torch.testing.assert_close(trans.sigma, trainer.adapter.sigmas(8, 32, 32)[trans.step_index])
    trainer.train_step()  # and the update takes them
    with pytest.raises(ValueError, match="timestep_selection=per_sample draws steps per sample"):
        make_cfg(
            model_dir, tmp_path, "branch", "sampling.rollout=branch", "trainer.timestep_selection=per_sample"
        )


def test_minibatch_scales_average_each_optimizer_step_including_a_short_last_group(model_dir, tmp_path):
    cfg = make_cfg(
        model_dir, tmp_path, "accum", "trainer.minibatch_size=2", "trainer.gradient_accumulation=2"
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    events = []
    trainer.step_optimizer = lambda: events.append("step")
    for idx, scale in trainer.minibatches(10):  # 5 minibatches: groups of 2, 2 and 1
        events.append((len(idx), scale))
    assert events == [(2, 0.5), (2, 0.5), "step", (2, 0.5), (2, 0.5), "step", (2, 1.0), "step"]
    # a short minibatch weighs its items like the others: 9 items in groups of (2, 2), (2, 2), (1)
    events.clear()
    for idx, scale in trainer.minibatches(9):
        events.append((len(idx), scale))
    assert events == [(2, 0.5), (2, 0.5), "step", (2, 0.5), (2, 0.5), "step", (1, 1.0), "step"]
    # one optimizer step over everything (gradient_accumulation 0): 5 items of 2, 2 and 1 weigh 1/5 each
    trainer.cfg.trainer.gradient_accumulation = 0
    events.clear()
    for idx, scale in trainer.minibatches(5):
        events.append((len(idx), scale))
    assert events == [(2, 0.4), (2, 0.4), (1, 0.2), "step"]
    # two optimizer steps per pass (trainer.updates_per_step, Flow-Factory's gradient_step_per_epoch): 5
    # minibatches in parts of ceil(5 / 2) = 3 and 2, each part's items averaged over that part
    trainer.cfg.trainer.updates_per_step = 2
    events.clear()
    for idx, scale in trainer.minibatches(10):
        events.append((len(idx), scale))
    assert events == [(2, 1 / 3), (2, 1 / 3), (2, 1 / 3), "step", (2, 0.5), (2, 0.5), "step"]
    with pytest.raises(
        ValueError, match=r"trainer\.updates_per_step \(2\) and trainer\.gradient_accumulation"
    ):
        make_cfg(model_dir, tmp_path, "both", "trainer.updates_per_step=2", "trainer.gradient_accumulation=2")


def test_tree_and_guided_distillation_settings_are_refused_at_config_time(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"allocation\.rollouts_per_step: flat flow rollouts need a budget"):
        make_cfg(model_dir, tmp_path, "b", "allocation.rollouts_per_step=null")
    branch = ("sampling.rollout=branch", "sampling.sde_window=4")
    with pytest.raises(ValueError, match=r"tree\.split_steps lists \[2\] more than once"):
        make_cfg(model_dir, tmp_path, "t", *branch, "tree.split_steps=[0, 2, 2]", "tree.branch_factor=2")
    with pytest.raises(
        ValueError, match=r"tree\.branch_factor: every branch factor must be >= 2, got \[1, 2\]"
    ):
        make_cfg(model_dir, tmp_path, "t", *branch, "tree.split_steps=[0, 2]", "tree.branch_factor=[1, 2]")
    with pytest.raises(
        ValueError, match=r"tree\.branch_factor: branch_factor has 3 entries for 2 split steps"
    ):
        make_cfg(model_dir, tmp_path, "t", *branch, "tree.split_steps=[0, 2]", "tree.branch_factor=[2, 2, 2]")
    distilled_guided = (
        "trainer.objective=nft",
        "trainer.guidance_distill.weight=1.0",
        "sampling.guidance_scale=3.0",
    )
    with pytest.raises(
        ValueError, match=r"sampling\.guidance_scale 3\.0 and trainer\.train_cfg .* applied twice"
    ):
        make_cfg(model_dir, tmp_path, "g", *distilled_guided)
    # CFG-free training of guided samples: the CFG-free velocity is what is distilled
    make_cfg(model_dir, tmp_path, "g", *distilled_guided, "trainer.train_cfg=false")


def test_the_shipped_fsdp_recipes_pass_the_fsdp_checks():
    """Every flow config whose launch line names configs/accelerate/fsdp.yaml is accepted by the FSDP checks
    (the checks read the config and the number of trained denoisers; the hub models are not loaded here)."""
    from types import SimpleNamespace

    def check_fsdp(cfg: FlowGRPOConfig) -> None:
        trainer = FlowGRPOTrainer(cfg, None)
        trainer.adapter = SimpleNamespace(trained_parts=lambda: ["transformer"])  # one trained denoiser
        trainer._check_fsdp()

    root = Path(__file__).resolve().parents[2]
    paths = [p for p in sorted((root / "configs" / "flow").glob("*.yaml")) if "fsdp.yaml" in p.read_text()]
    assert len(paths) >= 2
    for path in paths:
        check_fsdp(load_config(FlowGRPOConfig, path, []))
    grpo = ["trainer.objective=grpo", "trainer.drop_zero_advantage=true"]
    with pytest.raises(ValueError, match=r"trainer\.drop_zero_advantage: a per-rank number of transitions"):
        check_fsdp(load_config(FlowGRPOConfig, paths[0], grpo))
