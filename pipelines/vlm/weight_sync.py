"""Weights to push into a rollout engine: the policy's state dict with its LoRA merged, under the HF names.

A rollout engine (vLLM, or a separate transformers copy of the policy) holds plain weights with the names of the
Hugging Face checkpoint (``model.language_model.layers.0.self_attn.q_proj.weight``, ``model.visual...``,
``lm_head.weight``); vLLM's ``load_weights`` maps those names to its own layout. A peft model's state dict has
other names (``base_model.model.`` prefix, ``.base_layer.`` infix, ``lora_A``/``lora_B`` tensors), so it is
translated here, and each LoRA-wrapped layer's weight is replaced by ``W + scaling * B @ A``.

The merge is computed out of place: the training model is never modified, so there is no merge/unmerge round
trip that would accumulate rounding error in bf16 base weights step after step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_PEFT_PREFIX = "base_model.model."


def _unwrap_peft(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The transformers model inside a peft wrapper (LoRA layers still injected), and whether it was wrapped."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and hasattr(model, "peft_config"):
        return get_base_model(), True
    return model, False


def _merged_lora_param(module: torch.nn.Module, param: str) -> torch.Tensor:
    """``W + sum_a s_a B_a A_a`` (``param="weight"``) or the LoRA-shifted bias of one peft LoRA layer, in fp32
    arithmetic and returned in the base layer's dtype."""
    base = module.get_base_layer()
    original = getattr(base, param)
    value = original.detach().float()
    if getattr(module, "disable_adapters", False):
        return original.detach()
    already_merged = set(getattr(module, "merged_adapters", []))
    for adapter in module.active_adapters:
        if adapter not in module.lora_A or adapter in already_merged:
            # The adapter targets other layers, or peft already folded it into the base weight.
            continue
        if adapter in getattr(module, "lora_variant", {}):
            raise ValueError(
                f"adapter {adapter!r} uses a LoRA variant (e.g. DoRA) that this out-of-place merge does not "
                "implement; train with plain LoRA or call merge_and_unload() on a copy of the model"
            )
        if param == "weight":
            value = value + module.get_delta_weight(adapter).float()
        elif module.lora_bias.get(adapter, False):
            value = value + module.lora_B[adapter].bias.detach().float() * module.scaling[adapter]
    return value.to(original.dtype)


def merged_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of ``model`` with LoRA merged, names as in the HF checkpoint.

    For a plain (non-peft) model this is its ``state_dict()``. For a peft model the names equal those of the
    underlying model's state dict before LoRA was injected (what ``merge_and_unload().state_dict()`` gives), and
    the values of LoRA-wrapped layers are ``W + scaling * B @ A`` (0.21 peft naming: ``.base_layer.`` removed,
    ``lora_*`` tensors dropped, ``modules_to_save`` copies exported under the original name).

    Yielding lets a caller stream a large model into the engine without materialising a second full copy.

    Args:
        model: the policy, a transformers model or a peft ``PeftModel`` around one.

    Yields:
        ``(name, tensor)``: detached tensors on the model's device, in the model's dtype.
    """
    base, is_peft = _unwrap_peft(model)
    if not is_peft:
        for name, tensor in base.state_dict().items():
            yield name, tensor.detach()
        return

    lora_layers = {
        name: module
        for name, module in base.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "get_base_layer")
    }
    for name, tensor in base.state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            # LoRA factors are folded into the base weight; original_module is the frozen twin of a
            # modules_to_save copy, which is exported instead.
            continue
        if ".modules_to_save." in name:
            # "<module>.modules_to_save.<adapter>.<param>" -> "<module>.<param>"
            owner, rest = name.split(".modules_to_save.", 1)
            yield f"{owner}.{rest.split('.', 1)[1]}", tensor.detach()
            continue
        if ".base_layer." in name:
            owner, param = name.rsplit(".base_layer.", 1)
            if owner in lora_layers and param in ("weight", "bias"):
                yield f"{owner}.{param}", _merged_lora_param(lora_layers[owner], param)
                continue
            yield f"{owner}.{param}", tensor.detach()
            continue
        yield name, tensor.detach()
