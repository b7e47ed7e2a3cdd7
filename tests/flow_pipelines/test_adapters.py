"""Every adapter family: tiny random model -> save_pretrained -> adapter.from_pretrained -> rollout -> LoRA step."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from peft import LoraConfig

from mmrl.data.shapes import all_prompts
from pipelines.flow.adapters import ShapesAdapter, get_adapter, list_adapters, load_adapter
from pipelines.flow.adapters.qwen_image import pack_2x2
from pipelines.flow.rollout import SamplingConfig, rescore, rollout, rollout_sigmas
from pipelines.flow.tiny import TINY_LOAD_KWARGS as LOAD_KWARGS
from pipelines.flow.tiny import TINY_SIZES as SIZES
from pipelines.flow.tiny import build_shapes_pipeline

FAMILIES = list(LOAD_KWARGS)
PROMPTS = ["a photo of a red circle", "a green triangle left of a yellow circle"]


def _config(family: str, **overrides) -> SamplingConfig:
    kwargs = {
        "num_steps": 4,
        "guidance_scale": 1.0,
        "noise_level": 0.7,
        "sde_window": (0, 3),
        **SIZES[family],
    }
    kwargs.update(overrides)
    return SamplingConfig(**kwargs)


def euler_stepping(sigmas: torch.Tensor) -> FlowMatchEulerDiscreteScheduler:
    """An Euler scheduler that steps exactly ``sigmas`` ``[S+1]`` whatever step count the pipeline asks for: what
    a rollout on a multistep solver's sigmas (SANA, Wan) integrates, for its pipeline to repeat."""
    euler = FlowMatchEulerDiscreteScheduler(shift=1.0)  # (shift 1: the sigmas are taken as given)
    set_timesteps = euler.set_timesteps
    euler.set_timesteps = lambda *args, **kwargs: set_timesteps(
        sigmas=sigmas[:-1].tolist(), device=kwargs.get("device")
    )
    return euler


def test_registry_lists_every_family():
    assert set(FAMILIES) | {"shapes"} == set(list_adapters())
    with pytest.raises(KeyError, match="Available"):
        get_adapter("sdxl")


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_rollout_equals_the_diffusers_pipeline(family, load_tiny):
    """With an empty SDE window the adapter reproduces the pipeline's own Euler sampling loop.

    SANA and Wan ship multistep solvers, which integrate differently from the Euler step; their pipelines are
    given an Euler scheduler that steps the solver's own sigmas (the schedule the adapter steps, checked against
    the solver by ``test_sigmas_equal_the_pipeline_schedule``), so the comparison checks encoding, timestep
    scaling and layout.
    """
    adapter = load_tiny(family)
    pipe = adapter.pipe
    sizes = SIZES[family]
    config = _config(family, sde_window=(0, 0))
    noise = torch.randn((1, *adapter.latent_shape(**sizes)), generator=torch.Generator().manual_seed(0))
    ours = rollout(adapter, PROMPTS[:1], 1, config, noise=noise)
    assert ours.sde_steps.sum() == 0 and torch.isnan(ours.log_probs).all()
    if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
        pipe.scheduler = euler_stepping(ours.sigmas)

    call = {"num_inference_steps": config.num_steps, "output_type": "latent", **sizes}
    if family == "flux":
        # FluxPipeline takes packed latents and embeds guidance; the adapter packs inside `velocity`
        latents = pipe._pack_latents(noise, 1, *noise.shape[1:])
        call.update(guidance_scale=config.guidance_scale, max_sequence_length=8)
    elif family in ("flux2_klein", "flux2"):
        latents = noise  # the pipeline steps on patchified, normalised latents as the adapter does
        call.update(guidance_scale=1.0, max_sequence_length=16, text_encoder_out_layers=(1, 2, 3))
    elif family == "z_image":
        latents = noise
        call.update(guidance_scale=0.0, max_sequence_length=16)  # the pipeline's 0 is mmrl's 1: no CFG
    elif family == "qwen_image":
        latents = pipe._pack_latents(noise, 1, *noise.shape[1:])
        call.update(true_cfg_scale=1.0, max_sequence_length=16)
    else:
        latents = noise
        call.update(guidance_scale=1.0, max_sequence_length=8)
    if family == "sana":
        call["complex_human_instruction"] = None
    out = pipe(prompt=PROMPTS[0], latents=latents, **call)
    theirs = out.images if hasattr(out, "images") else out.frames
    if family in ("flux", "qwen_image"):
        vsf = pipe.vae_scale_factor
        theirs = pipe._unpack_latents(theirs, sizes["height"], sizes["width"], vsf)
        theirs = theirs.reshape(noise.shape)  # Qwen-Image's has a frame axis of 1
    if family in ("flux2_klein", "flux2"):
        theirs = klein_latents(pipe, theirs)
    torch.testing.assert_close(ours.latents[:, -1], theirs.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_rescore_and_lora_step(family, load_tiny):
    adapter = load_tiny(family)
    config = _config(family)
    result = rollout(adapter, PROMPTS, [2, 1], config, generator=torch.Generator().manual_seed(0))

    # shapes: B = 3 samples, S = 4 steps, SDE on steps 0..2
    latent_shape = adapter.latent_shape(**SIZES[family])
    assert result.latents.shape == (3, 5, *latent_shape)
    assert result.log_probs.shape == (3, 4)
    assert result.sde_steps.tolist() == [True, True, True, False]
    assert torch.isfinite(result.log_probs[:, :3]).all() and torch.isnan(result.log_probs[:, 3]).all()
    frames = (SIZES[family]["num_frames"],) if adapter.is_video else ()
    assert result.images.shape == (3, *frames, 3, SIZES[family]["height"], SIZES[family]["width"])
    assert result.images.min() >= 0 and result.images.max() <= 1
    assert result.nfe == 3 * 4 * adapter.nfe_per_sample(config.guidance_scale)
    assert result.prompts == [PROMPTS[0], PROMPTS[0], PROMPTS[1]]

    # re-scoring the stored transitions under the same weights gives back the behaviour log-probs
    batch = result.transitions()
    assert len(batch) == 9
    log_probs, _, _ = rescore(adapter, batch)
    torch.testing.assert_close(log_probs, batch.log_probs, rtol=0, atol=1e-4)

    # one LoRA step on the GRPO surrogate: LoRA weights move, base weights do not
    transformer = adapter.transformer
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    lora = {n: p.detach().clone() for n, p in transformer.named_parameters() if "lora_" in n}
    base = {n: p.detach().clone() for n, p in transformer.named_parameters() if "lora_" not in n}
    assert lora and all(p.requires_grad == ("lora_" in n) for n, p in transformer.named_parameters())
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-2)
    advantages = torch.tensor([1.0, -1.0, 0.5])[batch.sample_index]
    log_probs, _, _ = rescore(adapter, batch)
    ratio = torch.exp(log_probs - batch.log_probs)
    loss = -(ratio * advantages).mean()
    loss.backward()
    optimizer.step()
    after = dict(transformer.named_parameters())
    # peft initialises B = 0, so the first step moves every B (A's gradient is B^T(...) = 0 at step one)
    assert all(not torch.equal(after[n], p) for n, p in lora.items() if "lora_B" in n)
    assert all(torch.equal(after[n], p) for n, p in base.items())


def test_cfg_runs_one_batched_forward_and_doubles_nfe(load_tiny):
    adapter = load_tiny("sd3")
    cond = adapter.encode(PROMPTS, cfg=True)
    assert cond.uncond is not None
    x = torch.randn((2, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    calls = []
    hook = adapter.transformer.register_forward_hook(
        lambda m, args, kwargs, out: calls.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    with torch.no_grad():
        v = adapter.velocity(x, 0.5, cond, guidance_scale=4.0)
        hook.remove()
        v_c = adapter.velocity(x, 0.5, type(cond)(cond.cond), 1.0)
        v_u = adapter.velocity(x, 0.5, type(cond)(cond.uncond), 1.0)
    assert calls == [4]  # cond and uncond in one forward of 2B
    torch.testing.assert_close(v, v_u + 4.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)
    assert adapter.nfe_per_sample(4.0) == 2 and adapter.nfe_per_sample(1.0) == 1
    with pytest.raises(ValueError, match="cfg=True"):
        adapter.velocity(x, 0.5, adapter.encode(PROMPTS), guidance_scale=4.0)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_autocast_computes_in_bfloat16_and_returns_float32(load_tiny, guidance):
    adapter = load_tiny("sd3")
    cond = adapter.encode(PROMPTS, cfg=guidance > 1)
    x = torch.randn((2, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    dtypes = []
    hook = adapter.transformer.proj_out.register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    with torch.no_grad():
        full = adapter.velocity(x, 0.5, cond, guidance)
        adapter.autocast_dtype = torch.bfloat16
        mixed = adapter.velocity(x, 0.5, cond, guidance)
    hook.remove()
    assert dtypes == [torch.float32, torch.bfloat16]
    assert mixed.dtype == torch.float32 and not torch.equal(mixed, full)
    # bfloat16 keeps 8 bits of mantissa: the velocity agrees to a few parts in a hundred
    assert float((mixed - full).norm() / full.norm()) < 0.05
    assert all(p.dtype == torch.float32 for p in adapter.transformer.parameters())


def test_flux_embeds_guidance_instead_of_cfg(load_tiny):
    adapter = load_tiny("flux")
    cond = adapter.encode(PROMPTS[:1])
    x = torch.randn((1, *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        v1, v4 = adapter.velocity(x, 0.5, cond, 1.0), adapter.velocity(x, 0.5, cond, 4.0)
    assert adapter.nfe_per_sample(4.0) == 1
    assert not torch.allclose(v1, v4)  # the scale is an input of the distilled model


def test_qwen_image_true_cfg_with_norm_rescale_equals_the_pipeline(load_tiny):
    """Qwen-Image guides with ``v * ||v_c|| / ||v||`` per packed token; the adapter's ODE sampling with CFG and a
    negative prompt reproduces ``QwenImagePipeline(true_cfg_scale=...)``."""
    adapter = load_tiny("qwen_image")
    pipe, sizes = adapter.pipe, SIZES["qwen_image"]
    config = _config("qwen_image", sde_window=(0, 0), guidance_scale=3.0)
    noise = torch.randn((1, *adapter.latent_shape(**sizes)), generator=torch.Generator().manual_seed(1))
    ours = rollout(adapter, PROMPTS[:1], 1, config, noise=noise)
    out = pipe(
        PROMPTS[0],
        negative_prompt="",
        true_cfg_scale=3.0,
        max_sequence_length=16,
        latents=pipe._pack_latents(noise, 1, *noise.shape[1:]),
        num_inference_steps=config.num_steps,
        output_type="latent",
        **sizes,
    )
    theirs = pipe._unpack_latents(out.images, sizes["height"], sizes["width"], pipe.vae_scale_factor)
    torch.testing.assert_close(ours.latents[:, -1], theirs.reshape(noise.shape), rtol=1e-4, atol=1e-4)
    # the rescale is not plain CFG: the guided velocity keeps the conditional norm per token
    cond = adapter.encode(PROMPTS[:1], cfg=True)
    with torch.no_grad():
        v = adapter.velocity(noise, 0.7, cond, 3.0)
        v_c = adapter.velocity(noise, 0.7, type(cond)(cond.cond), 1.0)
    torch.testing.assert_close(pack_2x2(v).norm(dim=-1), pack_2x2(v_c).norm(dim=-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(v, v_c)


def klein_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """A FLUX.2 pipeline's latent output back in the space it steps in: ``Flux2KleinPipeline`` returns them
    de-normalised and unpatchified ``[B, C, H, W]``, ``Flux2Pipeline`` as its ``[B, h w, 4C]`` tokens."""
    if latents.ndim == 3:
        batch, tokens, channels = latents.shape
        side = int(tokens**0.5)
        return latents.float().transpose(1, 2).reshape(batch, channels, side, side)
    bn = pipe.vae.bn
    patches = pipe._patchify_latents(latents.float())
    return (patches - bn.running_mean.view(1, -1, 1, 1)) / torch.sqrt(
        bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps
    )


def assert_guided_sample_equals_the_pipeline(adapter, family: str) -> torch.Tensor:
    """A noise-free rollout at guidance 3 ends on the FLUX.2 pipeline's latents from the same noise (returned)."""
    pipe, sizes = adapter.pipe, SIZES[family]
    config = _config(family, sde_window=(0, 0), guidance_scale=3.0)
    noise = torch.randn((1, *adapter.latent_shape(**sizes)), generator=torch.Generator().manual_seed(1))
    ours = rollout(adapter, PROMPTS[:1], 1, config, noise=noise)
    out = pipe(
        prompt=PROMPTS[0],
        guidance_scale=3.0,
        latents=noise,
        num_inference_steps=config.num_steps,
        output_type="latent",
        max_sequence_length=16,
        text_encoder_out_layers=(1, 2, 3),
        **sizes,
    )
    torch.testing.assert_close(ours.latents[:, -1], klein_latents(pipe, out.images), rtol=1e-4, atol=1e-4)
    return noise


def test_flux2_klein_cfg_equals_the_pipeline_and_distilled_runs_without(load_tiny):
    """The undistilled klein base guides with plain CFG (one batched forward of 2B); a step-distilled checkpoint
    (``is_distilled``) ignores the scale, as ``Flux2KleinPipeline`` does."""
    adapter = load_tiny("flux2_klein")
    assert_guided_sample_equals_the_pipeline(adapter, "flux2_klein")
    assert adapter.nfe_per_sample(3.0) == 2
    adapter.pipe.register_to_config(is_distilled=True)
    assert adapter.nfe_per_sample(3.0) == 1


def test_flux2_dev_embeds_guidance_and_equals_the_pipeline(load_tiny):
    """FLUX.2 [dev] is guidance-distilled: one forward per sample with the scale as an input, as
    ``Flux2Pipeline(guidance_scale=...)`` samples."""
    adapter = load_tiny("flux2")
    noise = assert_guided_sample_equals_the_pipeline(adapter, "flux2")
    cond = adapter.encode(PROMPTS[:1])
    with torch.no_grad():
        v1, v4 = adapter.velocity(noise, 0.5, cond, 1.0), adapter.velocity(noise, 0.5, cond, 4.0)
    assert adapter.nfe_per_sample(4.0) == 1 and not torch.allclose(v1, v4)


def test_z_image_guidance_scale_is_the_pipeline_scale_plus_one(load_tiny):
    """``ZImagePipeline(guidance_scale=w)`` guides with ``v_c + w (v_c - v_u)``: the adapter at mmrl's
    ``guidance_scale = w + 1`` samples the same latents (reversed-clock timestep and negated output included)."""
    adapter = load_tiny("z_image")
    pipe, sizes = adapter.pipe, SIZES["z_image"]
    config = _config("z_image", sde_window=(0, 0), guidance_scale=3.0)
    noise = torch.randn((1, *adapter.latent_shape(**sizes)), generator=torch.Generator().manual_seed(1))
    ours = rollout(adapter, PROMPTS[:1], 1, config, noise=noise)
    out = pipe(
        PROMPTS[0],
        negative_prompt="",
        guidance_scale=2.0,
        latents=noise,
        num_inference_steps=config.num_steps,
        output_type="latent",
        max_sequence_length=16,
        **sizes,
    )
    torch.testing.assert_close(ours.latents[:, -1], out.images.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sigmas_equal_the_pipeline_schedule(family, load_tiny):
    """The schedule the adapter steps is the one the diffusers pipeline sets on its scheduler (for SANA's
    DPM-Solver and Wan's UniPC: the solver's flow sigmas, not the Euler scheduler's at the same shift)."""
    adapter = load_tiny(family)
    seen = {}

    def grab(pipe, i, t, kwargs):
        seen["sigmas"] = pipe.scheduler.sigmas.clone()
        return kwargs

    extra = {"text_encoder_out_layers": (1, 2, 3)} if family.startswith("flux2") else {}
    if family == "sana":
        extra["complex_human_instruction"] = None
    adapter.pipe(
        prompt=PROMPTS[0],
        num_inference_steps=6,
        output_type="latent",
        max_sequence_length=8,
        callback_on_step_end=grab,
        **SIZES[family],
        **extra,
    )
    pipeline_sigmas, ours = seen["sigmas"].float(), adapter.sigmas(6, **SIZES[family])
    torch.testing.assert_close(ours[1:-1], pipeline_sigmas[1:-1])
    # a rollout starts from pure noise at 1 (SANA's DPM-Solver labels it 0.9997) and ends at a clean sample
    assert ours[0] == 1 and pipeline_sigmas[0] >= 0.999 and ours[-1] == 0 == pipeline_sigmas[-1]


def test_a_static_shift_replaces_the_family_schedule_as_dancegrpo_samples_flux(load_tiny):
    """sampling.shift 3 on FLUX (whose pipeline shifts by image size): DanceGRPO's sd3_time_shift(3, linspace(1, 0,
    S + 1)), by hand; without it the family's own schedule."""
    adapter = load_tiny("flux")
    config = SamplingConfig(num_steps=6, height=32, width=32, shift=3.0)
    t = torch.linspace(1, 0, 7)
    torch.testing.assert_close(rollout_sigmas(adapter, config), 3 * t / (1 + 2 * t))
    own = SamplingConfig(num_steps=6, height=32, width=32)
    torch.testing.assert_close(rollout_sigmas(adapter, own), adapter.sigmas(6, 32, 32))
    assert not torch.allclose(adapter.sigmas(6, 32, 32), 3 * t / (1 + 2 * t))
    shifted = rollout(adapter, PROMPTS[:1], 2, config, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(shifted.sigmas, 3 * t / (1 + 2 * t))
    with pytest.raises(ValueError, match="shift must be > 0"):
        SamplingConfig(shift=0.0)


def test_decode_maps_latents_to_unit_range(load_tiny):
    adapter = load_tiny("sd3")
    images = adapter.decode(torch.randn((2, *adapter.latent_shape(32, 32))) * 5)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


def test_latent_shape_rejects_bad_sizes(load_tiny):
    with pytest.raises(ValueError, match="multiples"):
        load_tiny("sd3").latent_shape(30, 32)
    # the tiny SD3's positional table holds 16 patches of 4 pixels per side
    assert load_tiny("sd3").latent_shape(32, 64)[1:] == (16, 32)
    with pytest.raises(ValueError, match=r"at most 64 pixels \(the model's positional table"):
        load_tiny("sd3").latent_shape(32, 68)
    with pytest.raises(ValueError, match="num_frames"):
        load_tiny("wan").latent_shape(16, 16, num_frames=4)


def test_shapes_model_loads_through_the_sd3_path_in_pixel_space(tmp_path):
    """A random shapes model (no VAE, no T5) saves, reloads via ShapesAdapter, samples and re-scores."""
    torch.manual_seed(0)
    build_shapes_pipeline(
        all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8
    ).save_pretrained(tmp_path)
    adapter = ShapesAdapter.from_pretrained(str(tmp_path))
    assert adapter.pixel_space and adapter.pipe.text_encoder_3 is None
    assert adapter.latent_shape(32, 32) == (3, 32, 32)
    prompt = "a photo of a purple triangle left of a yellow circle"
    ids = adapter.pipe.tokenizer(prompt).input_ids
    assert adapter.pipe.tokenizer.decode(ids, skip_special_tokens=True) == prompt
    assert len(ids) == len(prompt.split()) + 2  # every shapes word is one token
    config = SamplingConfig(num_steps=3, height=32, width=32, guidance_scale=2.0, sde_window=(0, 2))
    result = rollout(adapter, [prompt], 2, config, generator=torch.Generator().manual_seed(0))
    assert result.images.shape == (2, 3, 32, 32)
    log_probs, _, _ = rescore(adapter, result.transitions())
    torch.testing.assert_close(log_probs, result.transitions().log_probs, rtol=0, atol=1e-4)


def test_missing_model_names_the_folder_and_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        OSError, match=r"'checkpoints/shapes_flow': there is no such folder under .*Hub could not"
    ):
        load_adapter("shapes", "checkpoints/shapes_flow")


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_model_sees_the_pipelines_timestep(family, load_tiny):
    """In bfloat16 the transformer gets the timestep in the form its pipeline gives it: float32 (SD3, Z-Image) or
    integer (SANA, Wan) ones in float32, not rounded to bfloat16 (which moves t = 777.7 to 776); FLUX's,
    Qwen-Image's and FLUX.2's pipelines round ``1000 sigma`` to the model's dtype, and so does the adapter."""
    adapter = load_tiny(family)
    adapter.pipe.to(torch.bfloat16)
    denoiser = adapter.pipe.transformer
    seen = []
    hook = denoiser.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["timestep"] if "timestep" in kwargs else args[1]),
        with_kwargs=True,
    )
    sizes = SIZES[family]
    call = {"max_sequence_length": 16 if family in ("qwen_image", "z_image", "flux2_klein", "flux2") else 8}
    call.update({"text_encoder_out_layers": (1, 2, 3)} if family.startswith("flux2") else {})
    call.update({"complex_human_instruction": None} if family == "sana" else {})
    call.update({"guidance_scale": 0.0} if family == "z_image" else {"guidance_scale": 1.0})
    call.update({"true_cfg_scale": 1.0} if family == "qwen_image" else {})
    with torch.no_grad():
        adapter.pipe(prompt=PROMPTS[0], num_inference_steps=6, output_type="latent", **call, **sizes)
        theirs = seen[:2]
        seen.clear()
        sigmas = adapter.sigmas(6, **sizes)
        noise = torch.randn((1, *adapter.latent_shape(**sizes)))
        cond = adapter.encode(PROMPTS[:1])
        for sigma in sigmas[:2]:
            adapter.velocity(noise, sigma.reshape(1), cond)
    hook.remove()
    for ours, pipeline in zip(seen, theirs, strict=True):
        assert ours.dtype == (pipeline.dtype if pipeline.is_floating_point() else torch.float32)
        # SANA's and Wan's solvers hand the model whole timesteps (999, 963...): the adapter's are exact
        tolerance = 1.0 if family in ("sana", "wan", "wan22") else 1e-4 * float(pipeline.abs().max())
        torch.testing.assert_close(ours.double(), pipeline.double(), rtol=0, atol=tolerance)


def test_wan22_second_guidance_scale_guides_the_low_noise_experts_steps_as_the_pipeline(saved_pipelines):
    """``model.options.guidance_scale_2`` is ``WanPipeline``'s: guidance 2.0 on the high-noise expert's steps, 1.5
    on the low-noise expert's, the ODE rollout equal to the pipeline's; without it the scale is 2.0 throughout."""
    options = {**LOAD_KWARGS["wan22"], "guidance_scale_2": 1.5}
    adapter = get_adapter("wan22").from_pretrained(str(saved_pipelines["wan22"]), **options)
    sizes = SIZES["wan22"]
    config = _config("wan22", sde_window=(0, 0), guidance_scale=2.0)
    noise = torch.randn((1, *adapter.latent_shape(**sizes)), generator=torch.Generator().manual_seed(0))
    ours = rollout(adapter, PROMPTS[:1], 1, config, noise=noise)
    assert adapter.guidance_at(ours.sigmas[:-1], 2.0).tolist() == [2.0, 2.0, 1.5, 1.5]  # boundary 0.8

    adapter.pipe.scheduler = euler_stepping(ours.sigmas)
    call = {"prompt": PROMPTS[0], "num_inference_steps": 4, "output_type": "latent", "max_sequence_length": 8}
    theirs = adapter.pipe(latents=noise, guidance_scale=2.0, guidance_scale_2=1.5, **call, **sizes).frames
    torch.testing.assert_close(ours.latents[:, -1], theirs.float(), rtol=1e-4, atol=1e-4)
    one_scale = adapter.pipe(latents=noise, guidance_scale=2.0, **call, **sizes).frames
    assert (theirs - one_scale).abs().max() > 1e-3
    with pytest.raises(ValueError, match="guidance_scale_2 must be >= 1"):
        get_adapter("wan22").from_pretrained(
            str(saved_pipelines["wan22"]), **{**options, "guidance_scale_2": 0.5}
        )
