"""Wan2.2 A14B text-to-video adapter: ``WanPipeline`` with two experts switched at the boundary timestep.

Real checkpoint: ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``. ``transformer`` (the high-noise expert) denoises while
``sigma >= boundary_ratio`` (0.875), ``transformer_2`` (the low-noise expert) below; everything else is Wan2.1's
(see :mod:`pipelines.flow.adapters.wan`). ``model.options.trained_expert`` says which experts RL trains:

* ``high``: ``transformer`` only (layout and motion: the early, noisy steps); ``transformer_2`` is frozen;
* ``low``: ``transformer_2`` only (detail); ``transformer`` is frozen;
* ``both``: both experts, each on the steps its sigma routes to it. ``adapter.transformer`` is then a
  :class:`WanExperts` holding the two, so one optimizer, one LoRA config (an adapter per expert), one EMA and
  one checkpoint cover both.

A transition or regression point trains the expert that computed its velocity; with one expert trained, points on
the frozen expert's steps carry no gradient and are left out, so the SDE window should lie on the trained
expert's steps (the high expert's sigmas are the first ones).

LoRA files load with diffusers' own API: the high expert's (``pytorch_lora_weights.safetensors``) with
``pipe.load_lora_weights(DIR)``, the low expert's (:data:`LOW_EXPERT_WEIGHT_NAME`) with
``pipe.load_lora_weights(DIR, load_into_transformer_2=True)``, adding ``weight_name=LOW_EXPERT_WEIGHT_NAME``
when the folder holds both. ``model.options.guidance_scale_2`` is the pipeline's ``guidance_scale_2``: the scale
of the low-noise expert's steps (the model card samples at 4.0 and 3.0); unset, ``sampling.guidance_scale``
guides both, as in the pipeline. As there, whether CFG runs at all follows ``sampling.guidance_scale``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import WanPipeline
from diffusers.models import WanTransformer3DModel
from torch import nn

from pipelines.flow.adapters.registry import register_flow_family
from pipelines.flow.adapters.wan import WanAdapter

__all__ = ["LORA_FILES", "LOW_EXPERT_WEIGHT_NAME", "Wan22Adapter", "WanExperts"]

#: file of the low-noise expert's LoRA beside the high expert's ``pytorch_lora_weights.safetensors``; diffusers'
#: default file lookup does not pick it, so a plain ``load_lora_weights(DIR)`` loads the high expert's
LOW_EXPERT_WEIGHT_NAME = "pytorch_lora_weights_transformer_2.safetensors"
#: the LoRA file of each expert in a saved folder (``pytorch_lora_weights.safetensors`` for the high one)
LORA_FILES = {"transformer": "pytorch_lora_weights.safetensors", "transformer_2": LOW_EXPERT_WEIGHT_NAME}

#: ``trained_expert`` -> the pipeline components RL trains
EXPERT_COMPONENTS: dict[str, tuple[str, ...]] = {
    "high": ("transformer",),
    "low": ("transformer_2",),
    "both": ("transformer", "transformer_2"),
}


def _check_expert(trained_expert: str) -> None:
    if trained_expert not in EXPERT_COMPONENTS:
        raise ValueError(
            f"model.options.trained_expert must be one of {list(EXPERT_COMPONENTS)}, got {trained_expert!r}"
        )


class WanExperts(nn.Module):
    """Wan2.2's two experts as one trained module: parameters named ``transformer.*`` (high noise) and
    ``transformer_2.*`` (low noise), as the pipeline's attributes and its LoRA files name them.

    It is never called itself (the adapter routes each row to one expert); it carries what training does to
    a denoiser (``requires_grad_``, ``train``/``eval``, ``add_adapter``, adapters on/off, gradient
    checkpointing, state dicts, copies) to both experts at once.
    """

    #: quantized explorer copies apply their skip patterns below each expert (pipelines/quant.py)
    quantize_roots = ("transformer", "transformer_2")

    def __init__(self, transformer: WanTransformer3DModel, transformer_2: WanTransformer3DModel) -> None:
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2

    @property
    def experts(self) -> tuple[nn.Module, nn.Module]:
        return (self.transformer, self.transformer_2)

    @property
    def config(self) -> Any:
        """The high-noise expert's config (the two share patch size, channels and layout)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def peft_config(self) -> dict:
        """The LoRA configs, the same on both experts (one ``model.lora`` section adapts both)."""
        return self.transformer.peft_config

    @peft_config.setter
    def peft_config(self, value: dict) -> None:  # peft's injection into this module records its config here
        for expert in self.experts:
            expert.peft_config = value

    def add_adapter(self, adapter_config: Any, adapter_name: str = "default") -> None:
        for expert in self.experts:
            expert.add_adapter(adapter_config, adapter_name=adapter_name)

    def enable_adapters(self) -> None:
        for expert in self.experts:
            expert.enable_adapters()

    def disable_adapters(self) -> None:
        for expert in self.experts:
            expert.disable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing()

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError(
            "WanExperts is not called: the adapter routes each row to transformer or transformer_2"
        )


@register_flow_family("wan22")
class Wan22Adapter(WanAdapter):
    """Wan2.2 A14B through diffusers' ``WanPipeline`` with both experts.

    Args:
        pipe: a loaded two-expert ``WanPipeline`` (``transformer_2`` and ``boundary_ratio`` set).
        max_sequence_length: UMT5 tokens (pipeline default 226).
        trained_expert: ``"high"`` (``transformer``), ``"low"`` (``transformer_2``) or ``"both"``; with one
            expert trained the other one is frozen.
        guidance_scale_2: CFG scale of the low-noise expert's steps (``sigma < boundary``); ``None`` uses the
            sampling's guidance scale there too.

    Raises:
        ValueError: the pipeline has one expert, ``trained_expert`` is not one of the three, or
            ``guidance_scale_2`` is below 1.
    """

    two_experts = True

    def __init__(
        self,
        pipe: WanPipeline,
        max_sequence_length: int = 226,
        trained_expert: Literal["high", "low", "both"] = "high",
        guidance_scale_2: float | None = None,
    ) -> None:
        if pipe.transformer_2 is None or pipe.config.get("boundary_ratio") is None:
            raise ValueError(
                "wan22 needs a two-expert WanPipeline (transformer_2 and boundary_ratio, as "
                "Wan-AI/Wan2.2-T2V-A14B-Diffusers); use family 'wan' for Wan2.1"
            )
        _check_expert(trained_expert)
        if guidance_scale_2 is not None and guidance_scale_2 < 1:
            raise ValueError(
                f"model.options.guidance_scale_2 must be >= 1 (1: no guidance), got {guidance_scale_2}"
            )
        super().__init__(pipe, max_sequence_length)
        self.trained_expert = trained_expert
        self.guidance_scale_2 = guidance_scale_2
        #: the trained pair (both experts trained): one object for the optimizer, EMA and LoRA hooks to refer to
        self._experts = WanExperts(pipe.transformer, pipe.transformer_2) if trained_expert == "both" else None
        if trained_expert != "both":
            frozen = pipe.transformer_2 if trained_expert == "high" else pipe.transformer
            frozen.requires_grad_(False)

    @classmethod
    def trained_components(cls, options: Mapping[str, Any]) -> tuple[str, ...]:
        default = inspect.signature(cls.__init__).parameters["trained_expert"].default
        expert = options.get("trained_expert", default)
        _check_expert(expert)
        return EXPERT_COMPONENTS[expert]

    @property
    def trained_component(self) -> str:
        if self.trained_expert == "both":
            raise AttributeError(
                "both Wan2.2 experts are trained: the trained module is adapter.transformer (WanExperts)"
            )
        (component,) = self.trained_components({"trained_expert": self.trained_expert})
        return component

    @property
    def transformer(self) -> nn.Module:
        """The trained expert, or with both trained a :class:`WanExperts` of the pipeline's current experts."""
        if self.trained_expert != "both":
            return super().transformer
        high, low = self.pipe.transformer, self.pipe.transformer_2
        if self._experts.transformer is high and self._experts.transformer_2 is low:
            return self._experts
        return WanExperts(high, low)  # a pair swapped in for a while (reference copy, explorer)

    def trained_parts(self) -> dict[str, nn.Module]:
        if self.trained_expert != "both":
            return super().trained_parts()
        return {"transformer": self.pipe.transformer, "transformer_2": self.pipe.transformer_2}

    @contextmanager
    def swapped_denoiser(self, module: nn.Module) -> Iterator[None]:
        if self.trained_expert != "both":
            with super().swapped_denoiser(module):
                yield
            return
        pipe = self.pipe
        live = pipe.transformer, pipe.transformer_2
        pipe.transformer, pipe.transformer_2 = module.transformer, module.transformer_2
        try:
            yield
        finally:
            pipe.transformer, pipe.transformer_2 = live

    @property
    def boundary(self) -> float:
        """The sigma at and above which the high-noise expert denoises."""
        return float(self.pipe.config.boundary_ratio)

    def guidance_at(self, sigma: torch.Tensor, guidance_scale: float) -> float | torch.Tensor:
        """``guidance_scale`` on the high-noise expert's rows, ``guidance_scale_2`` (when set) on the others:
        ``WanPipeline`` switches the scale with the expert."""
        if self.guidance_scale_2 is None:
            return guidance_scale
        high = torch.as_tensor(sigma) >= self.boundary
        return torch.where(high, guidance_scale, self.guidance_scale_2).float()

    def trains_at(self, sigma: torch.Tensor) -> torch.Tensor:
        high = sigma >= self.boundary
        if self.trained_expert == "both":
            return torch.ones_like(high)
        return high if self.trained_expert == "high" else ~high

    def save_lora(self, directory: Path) -> None:
        """One file per trained expert: the high expert's in diffusers' default file, the low expert's in
        :data:`LOW_EXPERT_WEIGHT_NAME` (alone in the folder when only that expert is trained, so a plain
        ``load_lora_weights(DIR, load_into_transformer_2=True)`` finds it)."""
        for component, model in self.trained_parts().items():
            self._save_lora_file(directory, model, weight_name=LORA_FILES[component])

    def load_lora(self, directory: Path) -> None:
        for component, model in self.trained_parts().items():
            self._load_lora_file(directory, model, weight_name=LORA_FILES[component])
