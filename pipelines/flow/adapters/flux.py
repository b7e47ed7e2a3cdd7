"""FLUX.1 adapter (``FluxPipeline``, ``FluxTransformer2DModel``).

Real checkpoints: ``black-forest-labs/FLUX.1-dev`` (guidance-distilled: the guidance scale is an *input* of the
transformer, one forward per step, no CFG), ``black-forest-labs/FLUX.1-schnell`` (no guidance input).
Text: CLIP pooled output + T5 sequence (``max_sequence_length`` 512). Latents are kept unpacked
``[B, 16, H/8, W/8]`` (the SDE math is elementwise, so the layout is free); ``velocity`` packs them into FLUX's
``[B, (h/2)(w/2), 64]`` tokens with their ``img_ids`` and unpacks the prediction. The model takes
``timestep = sigma`` (the pipeline divides ``scheduler.timesteps`` by 1000). Sigmas: ``linspace(1, 1/S, S)``
with dynamic shifting ``mu = calculate_shift(image tokens)``, as ``FluxPipeline`` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import FluxPipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("flux")
class FluxAdapter(FlowAdapter):
    """FLUX.1 through diffusers' ``FluxPipeline``.

    Args:
        pipe: a loaded ``FluxPipeline``.
        max_sequence_length: T5 tokens (pipeline default 512).
    """

    pipeline_class = FluxPipeline

    def __init__(self, pipe: FluxPipeline, max_sequence_length: int = 512) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length

    def uses_cfg(self, guidance_scale: float) -> bool:
        # FLUX.1 is guidance-distilled: the scale is embedded in the forward, never a second (uncond) pass.
        return False

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        prompts = list(prompts)
        with torch.no_grad():
            embeds, pooled, _ = self.pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                device=self.device,
                max_sequence_length=self.max_sequence_length,
            )
        # cfg is accepted for interface uniformity; distilled guidance needs no negative prompt.
        return Conditioning({"encoder_hidden_states": embeds, "pooled_projections": pooled})

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 packing
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f}, got {height}x{width}")
        channels = self.transformer.config.in_channels // 4
        return (channels, height // self.pipe.vae_scale_factor, width // self.pipe.vae_scale_factor)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        return flow_match_sigmas(
            self.pipe.scheduler,
            num_steps,
            image_seq_len=(h // 2) * (w // 2),
            explicit_linspace=True,
        )

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        batch, channels, h, w = x.shape
        packed = self.pipe._pack_latents(x.to(dtype), batch, channels, h, w)  # [B, (h/2)(w/2), 4C]
        img_ids = self.pipe._prepare_latent_image_ids(batch, h // 2, w // 2, x.device, dtype)
        txt_ids = torch.zeros(cond["encoder_hidden_states"].shape[1], 3, device=x.device, dtype=dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), guidance_scale, device=x.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=packed,
            # the pipeline rounds t = 1000 sigma to the model's dtype, then divides by 1000
            timestep=(sigma * 1000).to(dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_projections"].to(dtype),
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        # unpack takes pixel sizes: latent size times the VAE factor
        vsf = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(out, h * vsf, w * vsf, vsf)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return ((image.float() + 1) / 2).clamp(0, 1)
