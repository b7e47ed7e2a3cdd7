"""Stable Diffusion 3 / 3.5 adapter (``StableDiffusion3Pipeline``, MMDiT ``SD3Transformer2DModel``).

Real checkpoints: ``stabilityai/stable-diffusion-3-medium-diffusers``, ``stabilityai/stable-diffusion-3.5-medium``,
``stabilityai/stable-diffusion-3.5-large``. Text: two CLIP-with-projection encoders (penultimate hidden states
concatenated, pooled projections concatenated) plus an optional T5 (absent T5 = zeros, as the pipeline does).
Latents ``[B, 16, H/8, W/8]``; the model is called with ``timestep = 1000 * sigma``; decode undoes the VAE's
``scaling_factor`` and ``shift_factor``. Sigmas: ``FlowMatchEulerDiscreteScheduler`` with ``shift = 3``.

A pipeline saved without a VAE (``vae=None``) is a *pixel-space* model: latents are images in [-1, 1] with
``in_channels`` channels and ``decode`` maps them to [0, 1]. The tiny shapes model uses this (see ``shapes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import StableDiffusion3Pipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("sd3")
class SD3Adapter(FlowAdapter):
    """SD3/SD3.5 through diffusers' ``StableDiffusion3Pipeline``.

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline``.
        max_sequence_length: T5 tokens (pipeline default 256). Without a T5 encoder these are zero rows that
            still cost attention; pixel-space tiny models set 0.
    """

    pipeline_class = StableDiffusion3Pipeline

    def __init__(self, pipe: StableDiffusion3Pipeline, max_sequence_length: int = 256) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length

    @property
    def pixel_space(self) -> bool:
        return self.pipe.vae is None

    @property
    def vae_scale_factor(self) -> int:
        return 1 if self.pixel_space else self.pipe.vae_scale_factor

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        prompts = list(prompts)
        with torch.no_grad():
            embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
                do_classifier_free_guidance=cfg,
                device=self.device,
                max_sequence_length=self.max_sequence_length,
            )
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        uncond = {"encoder_hidden_states": neg_embeds, "pooled_projections": neg_pooled} if cfg else None
        return Conditioning(cond, uncond)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.vae_scale_factor * self.transformer.config.patch_size
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f}, got {height}x{width}")
        # the positional table is cropped, never extended: SD3.5's 384 patches per side are 6,144 pixels
        max_patches = self.transformer.config.pos_embed_max_size
        if max_patches is not None and max(height, width) // f > max_patches:
            raise ValueError(
                f"height and width must be at most {max_patches * f} pixels (the model's positional table, "
                f"pos_embed_max_size, holds {max_patches} patches of {f} pixels per side), got {height}x{width}"
            )
        return (
            self.transformer.config.in_channels,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
        )

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        patch = self.transformer.config.patch_size
        return flow_match_sigmas(self.pipe.scheduler, num_steps, image_seq_len=(h // patch) * (w // patch))

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        return self.transformer(
            hidden_states=x.to(dtype),
            # SD3 was trained on timesteps t = 1000 * sigma (diffusers' scheduler.timesteps), given in float32
            # as the pipeline gives them: bfloat16 would round t by up to 2 near 1000
            timestep=sigma * 1000,
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            pooled_projections=cond["pooled_projections"].to(dtype),
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if self.pixel_space:
            return ((latents.float() + 1) / 2).clamp(0, 1)
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return ((image.float() + 1) / 2).clamp(0, 1)
