"""Z-Image adapter (``ZImagePipeline``, ``ZImageTransformer2DModel``, FLUX's 16-channel ``AutoencoderKL``).

Real checkpoints: ``Tongyi-MAI/Z-Image-Turbo`` (6B single-stream DiT, distilled: 8-9 steps, no CFG) and
``Tongyi-MAI/Z-Image`` (the undistilled base, CFG). Text: the second-to-last hidden state of a Qwen3 decoder on the
prompt in the tokenizer's chat template, real tokens only; the adapter pads them to ``max_sequence_length`` with a
mask and hands the transformer the unpadded rows (it takes per-sample lists). Latents ``[B, 16, H/8, W/8]``, one
frame added for the transformer (it patchifies 1x2x2 itself).

The transformer runs on the reversed clock and predicts the negated velocity; per sample::

    t = 1 - sigma;    v = -transformer([x], t, [text])

Guidance: ``ZImagePipeline(guidance_scale=w)`` computes ``v_c + w (v_c - v_u)``, which is mmrl's
``v_u + g (v_c - v_u)`` at ``g = 1 + w``: set ``sampling.guidance_scale`` to the pipeline's scale plus one (1 for
Turbo's 0). The pipeline's optional CFG renormalisation and truncation (off by default) are not applied.
Sigmas: ``linspace(1, 1/S, S)`` through the scheduler's shift (static 3 on Turbo, or dynamic by image tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from diffusers import ZImagePipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas, stack_padded
from pipelines.flow.adapters.registry import register_flow_family


@register_flow_family("z_image")
class ZImageAdapter(FlowAdapter):
    """Z-Image through diffusers' ``ZImagePipeline``.

    Args:
        pipe: a loaded ``ZImagePipeline``.
        max_sequence_length: text tokens (chat template included) each prompt is cut and padded to; the
            pipeline's default is 512.
    """

    pipeline_class = ZImagePipeline

    def __init__(self, pipe: ZImagePipeline, max_sequence_length: int = 512) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length

    def _encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        rows, _ = self.pipe.encode_prompt(
            prompts,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        embeds, mask = stack_padded(rows, self.max_sequence_length)
        return {"cap_feats": embeds, "cap_mask": mask}

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        return self.conditioning_from(self._encode, prompts, cfg, negative_prompt)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        vsf = self.pipe.vae_scale_factor
        if height % (vsf * 2) or width % (vsf * 2):
            raise ValueError(f"height and width must be multiples of {vsf * 2}, got {height}x{width}")
        return (self.transformer.config.in_channels, height // vsf, width // vsf)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        return flow_match_sigmas(
            self.pipe.scheduler, num_steps, image_seq_len=(h // 2) * (w // 2), explicit_linspace=True
        )

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        embeds, mask = cond["cap_feats"].to(dtype), cond["cap_mask"].bool()
        text = [row[keep] for row, keep in zip(embeds, mask, strict=True)]
        frames = list(x.to(dtype).unsqueeze(2).unbind(0))  # [C, 1, h, w] per sample
        # the time is given in float32, as the pipeline gives it
        out = self.transformer(frames, 1 - sigma, text, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return ((image.float() + 1) / 2).clamp(0, 1)
