"""Wan2.1 / Wan2.2 text-to-video adapter (``WanPipeline``, ``WanTransformer3DModel``, ``AutoencoderKLWan``).

Real checkpoints: ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``, ``Wan-AI/Wan2.1-T2V-14B-Diffusers``,
``Wan-AI/Wan2.2-T2V-A14B-Diffusers`` (two experts: ``transformer`` for high noise, ``transformer_2`` below
``boundary_ratio``). Text: UMT5 (``max_sequence_length`` 226). Video latents ``[B, 16, F', H/8, W/8]`` with
``F' = (F - 1)/4 + 1``; the model takes ``timestep = 1000 * sigma``; decode maps ``z * std + mean`` (the VAE's
per-channel ``latents_mean``/``latents_std``) through the causal video VAE and returns ``[B, T, 3, H, W]``.
Wan ships a flow UniPC solver; the adapter steps the same flow sigmas (``flow_shift`` from its config) with
Euler/SDE steps. Wan2.2 TI2V-5B (``expand_timesteps``, per-token timesteps) is not supported and is refused;
the two-expert A14B is the ``wan22`` family's (its routing below serves that subclass).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import WanPipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("wan")
class WanAdapter(FlowAdapter):
    """Wan2.x text-to-video through diffusers' ``WanPipeline``.

    ``transformer`` is what RL trains. A two-expert Wan2.2 A14B pipeline (``transformer_2`` below the boundary)
    is refused here: its family is ``wan22`` (:mod:`pipelines.flow.adapters.wan22`), which says which expert
    trains and keeps the other's steps out of the loss.

    Args:
        pipe: a loaded one-expert ``WanPipeline``.
        max_sequence_length: UMT5 tokens (pipeline default 226).

    Raises:
        ValueError: a TI2V pipeline (per-token timesteps), or two experts without the ``wan22`` family.
    """

    pipeline_class = WanPipeline
    is_video = True
    #: the pipeline may hold a second expert (Wan22Adapter); this family trains one-expert pipelines
    two_experts = False

    def __init__(self, pipe: WanPipeline, max_sequence_length: int = 226) -> None:
        if pipe.config.get("expand_timesteps", False):
            raise ValueError("Wan2.2 TI2V (expand_timesteps=True) uses per-token timesteps; not supported")
        if getattr(pipe, "transformer_2", None) is not None and not self.two_experts:
            raise ValueError(
                "model.family=wan: this WanPipeline has two experts (transformer_2, Wan2.2 A14B); use "
                "model.family=wan22, whose model.options.trained_expert says which of them trains"
            )
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        prompts = list(prompts)
        with torch.no_grad():
            embeds, neg_embeds = self.pipe.encode_prompt(
                prompts,
                negative_prompt=negative_prompt,
                do_classifier_free_guidance=cfg,
                max_sequence_length=self.max_sequence_length,
                device=self.device,
            )
        return Conditioning(
            {"encoder_hidden_states": embeds}, {"encoder_hidden_states": neg_embeds} if cfg else None
        )

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        t, s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        _, ph, pw = self.transformer.config.patch_size
        if num_frames is None or (num_frames - 1) % t:
            raise ValueError(
                f"num_frames must be given and num_frames - 1 a multiple of {t}, got {num_frames}"
            )
        if height % (s * ph) or width % (s * pw):
            raise ValueError(f"height and width must be multiples of {s * ph}, got {height}x{width}")
        return (self.transformer.config.in_channels, (num_frames - 1) // t + 1, height // s, width // s)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, f, h, w = self.latent_shape(height, width, num_frames)
        pt, ph, pw = self.transformer.config.patch_size
        seq_len = (f // pt) * (h // ph) * (w // pw)
        return flow_match_sigmas(self.pipe.scheduler, num_steps, image_seq_len=seq_len)

    def _expert_forward(
        self, model: torch.nn.Module, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor
    ) -> torch.Tensor:
        dtype = model.dtype
        return model(
            hidden_states=x.to(dtype),
            timestep=sigma * 1000,  # float32, as the pipeline gives it
            encoder_hidden_states=embeds.to(dtype),
            return_dict=False,
        )[0]

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        embeds = cond["encoder_hidden_states"]
        boundary = self.pipe.config.get("boundary_ratio")
        if boundary is None or self.pipe.transformer_2 is None:
            return self._expert_forward(self.pipe.transformer, x, sigma, embeds)
        # Wan2.2 A14B: sigma * 1000 >= boundary_ratio * 1000 goes to the high-noise expert; rows may differ
        # (a re-scored batch mixes steps), so each expert runs on its own rows.
        high = sigma >= boundary
        out = torch.empty_like(x, dtype=self.pipe.transformer.dtype)
        for mask, model in ((high, self.pipe.transformer), (~high, self.pipe.transformer_2)):
            if mask.any():
                out[mask] = self._expert_forward(model, x[mask], sigma[mask], embeds[mask]).to(out.dtype)
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        z = (latents.float() * std + mean).to(vae.dtype)
        video = vae.decode(z, return_dict=False)[0]  # [B, 3, T, H, W]
        return ((video.float().permute(0, 2, 1, 3, 4) + 1) / 2).clamp(0, 1)
