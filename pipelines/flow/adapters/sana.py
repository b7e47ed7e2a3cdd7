"""SANA adapter (``SanaPipeline``, linear-attention ``SanaTransformer2DModel``, ``AutoencoderDC``).

Real checkpoints: ``Efficient-Large-Model/Sana_600M_512px_diffusers``, ``Efficient-Large-Model/Sana_1600M_1024px_diffusers``,
``Efficient-Large-Model/SANA1.5_1.6B_1024px_diffusers``. Text: Gemma-2 last hidden states with an attention mask,
prefixed by the pipeline's "complex human instruction" (kept by default, as ``SanaPipeline.__call__`` does).
Latents ``[B, 32, H/32, W/32]``; the model takes ``timestep = 1000 * sigma * timestep_scale``; decode divides by
the autoencoder's ``scaling_factor``. SANA ships a flow DPM-Solver; the adapter steps the same flow sigmas with
Euler/SDE steps (``flow_shift`` from the scheduler config, dynamic shifting when the config enables it).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from diffusers import SanaPipeline

from pipelines.flow.adapters.base import Conditioning, FlowAdapter, flow_match_sigmas
from pipelines.flow.adapters.registry import register_flow_family

# The instruction SanaPipeline.__call__ prepends by default; read from diffusers so it never drifts.
DEFAULT_COMPLEX_HUMAN_INSTRUCTION: list[str] = (
    inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
)


@register_flow_family("sana")
class SanaAdapter(FlowAdapter):
    """SANA through diffusers' ``SanaPipeline``.

    Args:
        pipe: a loaded ``SanaPipeline``.
        max_sequence_length: prompt tokens after the instruction (pipeline default 300).
        complex_human_instruction: instruction lines prepended to every prompt; ``None`` disables it.
    """

    pipeline_class = SanaPipeline

    def __init__(
        self,
        pipe: SanaPipeline,
        max_sequence_length: int = 300,
        complex_human_instruction: list[str] | None = DEFAULT_COMPLEX_HUMAN_INSTRUCTION,
    ) -> None:
        super().__init__(pipe)
        self.max_sequence_length = max_sequence_length
        self.complex_human_instruction = complex_human_instruction

    def encode(self, prompts: Sequence[str], cfg: bool = False, negative_prompt: str = "") -> Conditioning:
        prompts = list(prompts)
        with torch.no_grad():
            embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
                prompts,
                do_classifier_free_guidance=cfg,
                negative_prompt=negative_prompt,
                device=self.device,
                max_sequence_length=self.max_sequence_length,
                complex_human_instruction=self.complex_human_instruction,
            )
        cond = {"encoder_hidden_states": embeds, "encoder_attention_mask": mask}
        uncond = {"encoder_hidden_states": neg_embeds, "encoder_attention_mask": neg_mask} if cfg else None
        return Conditioning(cond, uncond)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor * self.transformer.config.patch_size
        if height % f or width % f:
            raise ValueError(f"height and width must be multiples of {f}, got {height}x{width}")
        vsf = self.pipe.vae_scale_factor
        return (self.transformer.config.in_channels, height // vsf, width // vsf)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width)
        patch = self.transformer.config.patch_size
        return flow_match_sigmas(self.pipe.scheduler, num_steps, image_seq_len=(h // patch) * (w // patch))

    def _forward(
        self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], guidance_scale: float
    ) -> torch.Tensor:
        dtype = self.transformer.dtype
        out = self.transformer(
            x.to(dtype),
            encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
            encoder_attention_mask=cond["encoder_attention_mask"],
            timestep=sigma
            * 1000
            * self.transformer.config.timestep_scale,  # float32, as the pipeline gives it
            return_dict=False,
        )[0]
        # checkpoints with a learned variance output 2C channels; the velocity is the first half
        if self.transformer.config.out_channels // 2 == x.shape[1]:
            out = out.chunk(2, dim=1)[0]
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return ((image.float() + 1) / 2).clamp(0, 1)
