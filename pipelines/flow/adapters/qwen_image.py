"""Qwen-Image adapter (``QwenImagePipeline``, ``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``).

Real checkpoint: ``Qwen/Qwen-Image`` (20B MMDiT). Text: the last hidden state of Qwen2.5-VL
(``Qwen2_5_VLForConditionalGeneration``) on the prompt wrapped in the pipeline's chat template, with the template's
system prefix dropped; the adapter pads it to ``max_sequence_length`` tokens with an attention mask, so that every
batch (and every pooled step) has one text length. Latents are kept unpacked ``[B, 16, H/8, W/8]``; ``velocity``
packs them into ``[B, (h/2)(w/2), 64]`` tokens with ``img_shapes`` for the RoPE and unpacks the prediction.
The model takes ``timestep = sigma``. Sigmas: ``linspace(1, 1/S, S)`` with the scheduler's dynamic (exponential)
shift ``mu = calculate_shift(image tokens)`` and its terminal shift, as ``QwenImagePipeline`` does.

Guidance is "true CFG" with the pipeline's norm rescaling, per packed token ``n``::

    v = v_u + w (v_c - v_u);    v <- v * ||v_c||_n / ||v||_n

Decode: ``z * std + mean`` (the VAE's per-channel ``latents_mean`` / ``latents_std``) through the one-frame video
VAE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import QwenImagePipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas, stack_padded
from pipelines.flow.adapters.registry import register_flow_family


def pack_2x2(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` latents as ``[B, (h/2)(w/2), 4C]`` tokens of 2x2 patches (channel-major in a token)."""
    batch, channels, h, w = latents.shape
    patches = latents.view(batch, channels, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, (h // 2) * (w // 2), channels * 4)


def unpack_2x2(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_2x2`: ``[B, (h/2)(w/2), 4C]`` tokens back to ``[B, C, h, w]``."""
    batch, _, packed = tokens.shape
    channels = packed // 4
    patches = tokens.view(batch, h // 2, w // 2, channels, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(batch, channels, h, w)


@register_flow_family("qwen_image")
class QwenImageAdapter(FlowAdapter):
    """Qwen-Image through diffusers' ``QwenImagePipeline``.

    Args:
        pipe: a loaded ``QwenImagePipeline``.
        max_sequence_length: text tokens every prompt is padded to (masked); longer prompts are refused. The
            pipeline truncates at 512 by default; short prompts (GenEval, PickScore) train faster with 128.
    """

    pipeline_class = QwenImagePipeline

    def __init__(self, pipe: QwenImagePipeline, max_sequence_length: int = 512) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        rows = list(embeds) if mask is None else [e[m.bool()] for e, m in zip(embeds, mask, strict=True)]
        embeds, mask = stack_padded(rows, self.max_sequence_length)
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        return self.conditioning_from(self._encode, prompts, cfg, negative_prompt)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        vsf = self.pipe.vae_scale_factor
        if height % (vsf * 2) or width % (vsf * 2):
            raise ValueError(f"height and width must be multiples of {vsf * 2}, got {height}x{width}")
        return (self.transformer.config.in_channels // 4, height // vsf, width // vsf)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        return flow_match_sigmas(
            self.pipe.scheduler, num_steps, image_seq_len=(h // 2) * (w // 2), explicit_linspace=True
        )

    def guide(
        self, v_uncond: torch.Tensor, v_cond: torch.Tensor, guidance_scale: float | torch.Tensor
    ) -> torch.Tensor:
        combined = super().guide(v_uncond, v_cond, guidance_scale)
        h, w = combined.shape[-2:]
        packed, packed_cond = pack_2x2(combined), pack_2x2(v_cond)
        scale = packed_cond.norm(dim=-1, keepdim=True) / packed.norm(dim=-1, keepdim=True)
        return unpack_2x2(packed * scale, h, w)

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        batch, _, h, w = x.shape
        out = self.transformer(
            hidden_states=pack_2x2(x.to(dtype)),
            # the pipeline rounds t = 1000 sigma to the model's dtype, then divides by 1000
            timestep=(sigma * 1000).to(dtype) / 1000,
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            encoder_hidden_states_mask=cond["encoder_hidden_states_mask"],
            img_shapes=[[(1, h // 2, w // 2)]] * batch,
            return_dict=False,
        )[0]
        return unpack_2x2(out, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(shape)
        z = (latents.float().unsqueeze(2) * std + mean).to(vae.dtype)  # one frame: [B, C, 1, h, w]
        image = vae.decode(z, return_dict=False)[0][:, :, 0]
        return ((image.float() + 1) / 2).clamp(0, 1)
