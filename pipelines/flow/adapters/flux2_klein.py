"""FLUX.2 [klein] adapter (``Flux2KleinPipeline``, ``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``).

Real checkpoints: ``black-forest-labs/FLUX.2-klein-4B`` and ``-9B`` (step-distilled, ``is_distilled``: 4 steps, no
CFG) and ``black-forest-labs/FLUX.2-klein-base-4B`` / ``-9B`` (undistilled: CFG, ~50 steps). Text: hidden states
of layers 9, 18 and 27 of a Qwen3 decoder on the chat-templated prompt, padded to ``max_sequence_length`` tokens
(the pipeline pads and the transformer attends to every position, so no mask is kept), concatenated on the
feature axis. Latents are the pipeline's: the VAE's 2x2-patchified, batch-norm-normalised latents
``[B, 4 * 32, H/16, W/16]``; ``velocity`` flattens them into ``H/16 * W/16`` tokens with 4-axis position ids and
back. The model takes ``timestep = sigma``. Sigmas: ``linspace(1, 1/S, S)`` shifted by FLUX.2's empirical ``mu``
of image tokens and step count. Decode: ``z * sqrt(var + eps) + mean`` (the VAE's batch-norm statistics), unpatchify,
VAE decode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import Flux2KleinPipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("flux2_klein")
class Flux2KleinAdapter(FlowAdapter):
    """FLUX.2 [klein] through diffusers' ``Flux2KleinPipeline``.

    Args:
        pipe: a loaded ``Flux2KleinPipeline``.
        max_sequence_length: text tokens (chat template included) per prompt; the pipeline's default is 512.
        text_encoder_out_layers: the text encoder's hidden states read as the caption (the pipeline's 9, 18, 27).
    """

    pipeline_class = Flux2KleinPipeline

    def __init__(
        self,
        pipe: Flux2KleinPipeline,
        max_sequence_length: int = 512,
        text_encoder_out_layers: Sequence[int] = (9, 18, 27),
    ) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length
        self.text_encoder_out_layers = tuple(text_encoder_out_layers)

    def uses_cfg(self, guidance_scale: float) -> bool:
        # the step-distilled checkpoints have no unconditional branch: the pipeline ignores the scale there
        return guidance_scale > 1.0 and not self.pipe.config.is_distilled

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompts,
            device=self.device,
            max_sequence_length=self.max_sequence_length,
            text_encoder_out_layers=self.text_encoder_out_layers,
        )
        return {"encoder_hidden_states": embeds}

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        return self.conditioning_from(self._encode, prompts, cfg, negative_prompt)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor * 2  # VAE downsampling, then 2x2 patches
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f}, got {height}x{width}")
        return (self.transformer.config.in_channels, height // f, width // f)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        mu = compute_empirical_mu(image_seq_len=h * w, num_steps=num_steps)
        return flow_match_sigmas(self.pipe.scheduler, num_steps, explicit_linspace=True, mu=mu)

    def _guidance_input(self, batch: int, guidance_scale: float, device: torch.device) -> torch.Tensor | None:
        """The transformer's guidance input ``[B]``: none for klein (FLUX.2-dev embeds the scale)."""
        return None

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        batch, channels, h, w = x.shape
        embeds = cond["encoder_hidden_states"].to(dtype)
        tokens = x.to(dtype).reshape(batch, channels, h * w).transpose(1, 2)  # row-major h, w: the ids' order
        out = self.transformer(
            hidden_states=tokens,
            # the pipeline rounds t = 1000 sigma to the model's dtype, then divides by 1000
            timestep=(sigma * 1000).to(dtype) / 1000,
            guidance=self._guidance_input(batch, guidance_scale, x.device),
            encoder_hidden_states=embeds,
            txt_ids=self.pipe._prepare_text_ids(embeds).to(x.device),
            img_ids=self.pipe._prepare_latent_ids(x).to(x.device),
            return_dict=False,
        )[0]
        return out.transpose(1, 2).reshape(batch, channels, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device)
        z = self.pipe._unpatchify_latents(latents.float() * std + mean).to(vae.dtype)
        image = vae.decode(z, return_dict=False)[0]
        return ((image.float() + 1) / 2).clamp(0, 1)
