"""Wan2.2 A14B text-to-video adapter: ``WanPipeline`` with two experts switched at the boundary timestep.

Real checkpoint: ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``. ``transformer`` (the high-noise expert) denoises while
``sigma >= boundary_ratio`` (0.875), ``transformer_2`` (the low-noise expert) below; everything else is Wan2.1's
(see :mod:`pipelines.flow.adapters.wan`). RL trains one expert and keeps the other frozen, named by the
``trained_expert`` option (``model.options.trained_expert``): ``high`` shapes layout and motion (the early, noisy
steps), ``low`` detail. The SDE window should lie on the trained expert's steps (the high expert's sigmas are the
first ones): transitions on the frozen expert's steps carry no gradient.

A LoRA of the high expert loads with ``pipe.load_lora_weights(DIR)``; one of the low expert with
``pipe.load_lora_weights(DIR, load_into_transformer_2=True)``. One guidance scale serves both experts (the
pipeline's ``guidance_scale_2`` is not modelled).
"""

from __future__ import annotations

from typing import Literal

import torch
from diffusers import WanPipeline

from pipelines.flow.adapters.registry import register_flow_family
from pipelines.flow.adapters.wan import WanAdapter


@register_flow_family("wan22")
class Wan22Adapter(WanAdapter):
    """Wan2.2 A14B through diffusers' ``WanPipeline`` with both experts.

    Args:
        pipe: a loaded two-expert ``WanPipeline`` (``transformer_2`` and ``boundary_ratio`` set).
        max_sequence_length: UMT5 tokens (pipeline default 226).
        trained_expert: ``"high"`` (``transformer``) or ``"low"`` (``transformer_2``); the other one is frozen.

    Raises:
        ValueError: the pipeline has one expert, or ``trained_expert`` is neither ``high`` nor ``low``.
    """

    def __init__(
        self,
        pipe: WanPipeline,
        max_sequence_length: int = 226,
        trained_expert: Literal["high", "low"] = "high",
    ) -> None:
        if pipe.transformer_2 is None or pipe.config.get("boundary_ratio") is None:
            raise ValueError(
                "wan22 needs a two-expert WanPipeline (transformer_2 and boundary_ratio, as "
                "Wan-AI/Wan2.2-T2V-A14B-Diffusers); use family 'wan' for Wan2.1"
            )
        if trained_expert not in ("high", "low"):
            raise ValueError(f"model.options.trained_expert must be 'high' or 'low', got {trained_expert!r}")
        super().__init__(pipe, max_sequence_length)
        self.trained_expert = trained_expert
        frozen = pipe.transformer_2 if trained_expert == "high" else pipe.transformer
        frozen.requires_grad_(False)

    @property
    def trained_component(self) -> str:
        return "transformer" if self.trained_expert == "high" else "transformer_2"

    @property
    def boundary(self) -> float:
        """The sigma at and above which the high-noise expert denoises."""
        return float(self.pipe.config.boundary_ratio)

    def trains_at(self, sigma: torch.Tensor) -> torch.Tensor:
        high = sigma >= self.boundary
        return high if self.trained_expert == "high" else ~high
