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

from pipelines.lora import check_ties_not_adapted, merged_lora_params, unwrap_peft


def merged_state_dict(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every weight of ``model`` with LoRA merged, names as in the HF checkpoint.

    For a plain model this is its ``state_dict()``. For a peft ``PeftModel``, or a model adapted in place with
    ``add_adapter`` (a rollout worker's copy, :func:`pipelines.pool.weights.apply_update`), the names equal those
    of the underlying model's state dict before LoRA was injected (what ``merge_and_unload().state_dict()``
    gives), and the values of LoRA-wrapped layers are ``W + scaling * B @ A`` (0.21 peft naming:
    ``.base_layer.`` removed, ``lora_*`` tensors dropped, ``modules_to_save`` copies exported under the original
    name).

    Yielding lets a caller stream a large model into the engine without materialising a second full copy.

    Args:
        model: the policy, a transformers model or a peft ``PeftModel`` around one.

    Yields:
        ``(name, tensor)``: detached tensors on the model's device, in the model's dtype.

    Raises:
        ValueError: a tied parameter adapted under one of its names only (:func:`check_ties_not_adapted`).
    """
    check_ties_not_adapted(model)
    base, is_peft = unwrap_peft(model)
    lora_layers = {
        name: module
        for name, module in base.named_modules()
        if hasattr(module, "lora_A") and hasattr(module, "get_base_layer")
    }
    if not is_peft and not lora_layers:
        for name, tensor in base.state_dict().items():
            yield name, tensor.detach()
        return

    # a modules_to_save wrapper holds the frozen original and a trained copy per adapter: export the one its
    # forward runs now (peft: the first active adapter's copy, the original while adapters are disabled)
    in_use = {name: _copy_in_use(module) for name, module in base.named_modules() if _saves_modules(module)}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue  # LoRA factors are folded into the base weight below
        marker = next((m for m in (".modules_to_save.", ".original_module.") if m in name), None)
        if marker is not None:
            # "<module>.modules_to_save.<adapter>.<param>" or "<module>.original_module.<param>" -> "<module>.<param>"
            owner = name.partition(marker)[0]
            prefix = f"{owner}.{in_use[owner]}."
            if name.startswith(prefix):
                yield f"{owner}.{name.removeprefix(prefix)}", tensor.detach()
            continue
        if ".base_layer." in name:
            owner, param = name.rsplit(".base_layer.", 1)
            if owner in lora_layers and param in ("weight", "bias"):
                merged = merged_lora_params(lora_layers[owner], owner)[param]
                yield f"{owner}.{param}", merged.to(tensor.dtype)
                continue
            yield f"{owner}.{param}", tensor.detach()
            continue
        yield name, tensor.detach()


def _saves_modules(module: torch.nn.Module) -> bool:
    """Whether ``module`` is peft's ``modules_to_save`` wrapper (a trained copy beside the frozen original)."""
    return hasattr(module, "modules_to_save") and hasattr(module, "original_module")


def _copy_in_use(wrapper: torch.nn.Module) -> str:
    """The state-dict prefix, below ``wrapper``, of the copy its forward runs: ``modules_to_save.<adapter>`` of
    the first active adapter, or ``original_module`` when adapters are disabled or that adapter has no copy."""
    active = list(wrapper.active_adapters)
    if getattr(wrapper, "disable_adapters", False) or not active or active[0] not in wrapper.modules_to_save:
        return "original_module"
    return f"modules_to_save.{active[0]}"
