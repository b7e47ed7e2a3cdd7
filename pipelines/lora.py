"""LoRA arithmetic shared by every consumer of a training policy's weights (rollout engines, quantized copies).

A peft LoRA layer computes with ``W_base + sum_a scaling[a] * B_a @ A_a`` over its active adapters
(``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; LoRA arXiv 2106.09685 eq. 3, rsLoRA
arXiv 2312.03732). These helpers compute that out of place, in fp32, never modifying the training module, so no
merge/unmerge round trip accumulates rounding error step after step.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = [
    "check_ties_not_adapted",
    "float32_params",
    "lora_delta_adapters",
    "merged_lora_params",
    "unwrap_peft",
]


def unwrap_peft(module: nn.Module) -> tuple[nn.Module, bool]:
    """The model inside a peft ``PeftModel`` (LoRA layers still injected), and whether it was wrapped."""
    get_base_model = getattr(module, "get_base_model", None)
    if callable(get_base_model) and hasattr(module, "peft_config"):
        return get_base_model(), True
    return module, False


def lora_delta_adapters(layer: nn.Module, name: str = "") -> list[str]:
    """Active adapters of a peft LoRA ``layer`` whose update is not already folded into its base weight.

    Raises:
        ValueError: an adapter uses a LoRA variant (DoRA) that an out-of-place merge does not implement.
    """
    if getattr(layer, "disable_adapters", False):
        return []
    merged = set(getattr(layer, "merged_adapters", []))
    adapters = [a for a in layer.active_adapters if a in layer.lora_A and a not in merged]
    for adapter in adapters:
        if adapter in getattr(layer, "lora_variant", {}):
            raise ValueError(
                f"layer {name!r}: adapter {adapter!r} uses a LoRA variant (e.g. DoRA) that the out-of-place merge "
                "does not implement; train with plain LoRA (use_dora=False)"
            )
    return adapters


def float32_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters (not its children's) as fresh fp32 tensors that never alias its storage;
    non-float parameters keep their dtype."""
    return {
        n: p.detach().to(dtype=torch.float32 if p.is_floating_point() else p.dtype, copy=True)
        for n, p in module.named_parameters(recurse=False)
    }


def merged_lora_params(layer: nn.Module, name: str = "") -> dict[str, torch.Tensor]:
    """``{"weight": W_base + sum_a s_a B_a A_a, "bias": b + sum_a s_a b_B_a, ...}`` of a peft LoRA layer.

    Returns fresh fp32 tensors (non-float parameters keep their dtype) that never alias the layer's storage;
    the bias term is added only for adapters trained with ``lora_bias=True``.
    """
    params = float32_params(layer.get_base_layer())
    for adapter in lora_delta_adapters(layer, name):
        # peft's delta is scaling * B @ A laid out like the base weight (transposed for fan_in_fan_out)
        params["weight"] += layer.get_delta_weight(adapter).detach().float()
        if layer.lora_bias.get(adapter, False):
            params["bias"] += layer.lora_B[adapter].bias.detach().float() * layer.scaling[adapter]
    return params


def check_ties_not_adapted(module: nn.Module) -> None:
    """Refuse a model with a tied parameter (one tensor under two names: a language model's input embedding and
    output head with ``tie_word_embeddings``) that an adapter wraps under one of its names.

    The trained model then computes with two matrices, ``W`` under one name and ``W + s B A`` (LoRA) or a trained
    ``modules_to_save`` copy under the other, while a copy built from its plain weights keeps the tie and holds
    only one of them: a rollout worker given full weights, a quantized explorer, a vLLM engine (which skips
    ``lm_head`` of a tied checkpoint). A LoRA-only update to a worker with the same adapter is unaffected.

    Raises:
        ValueError: naming the tied parameter's names.
    """
    base, _ = unwrap_peft(module)
    names_by_tensor: dict[int, list[str]] = {}
    for name, param in base.named_parameters(remove_duplicate=False):
        names_by_tensor.setdefault(id(param), []).append(name)
    for names in names_by_tensor.values():
        adapted = [name for name in names if ".base_layer." in name or ".original_module." in name]
        if len(names) > 1 and adapted:
            raise ValueError(
                f"the tied parameter {' = '.join(names)} is adapted under {', '.join(adapted)} only, so the "
                "trained model's two uses of it differ, and a rollout copy that keeps the tie cannot hold both: "
                "leave the tied module out of the LoRA target modules and modules_to_save"
            )
