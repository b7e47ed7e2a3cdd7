"""Weight payloads from the trainer to rollout workers: LoRA-only when the base is frozen, full weights otherwise.

With a frozen base, a LoRA of rank ``r`` on a ``d x d`` layer moves ``2 r d`` numbers instead of ``d^2``: the
payload of the tiny shapes model's LoRA is a few kB against its full weights' MBs, and the ratio grows with the
model. The LoRA payload is peft's own state dict (``get_peft_model_state_dict``: adapter name stripped, keys
relative to the adapted model, a ``PeftModel``'s ``base_model.model.`` prefix removed), so a worker whose model
was adapted with ``add_adapter`` (diffusers / transformers) or wrapped as a ``PeftModel`` loads it alike.
Full payloads carry every tensor under the Hugging Face names with LoRA merged
(:func:`pipelines.vlm.weight_sync.merged_state_dict`).
"""

from __future__ import annotations

import torch

from pipelines.lora import unwrap_peft
from pipelines.pool.protocol import WeightUpdate
from pipelines.vlm.weight_sync import merged_state_dict

_PEFT_PREFIX = "base_model.model."


def has_lora(module: torch.nn.Module) -> bool:
    """Whether ``module`` carries a peft LoRA adapter (``add_adapter`` or ``PeftModel``)."""
    return any(".lora_A." in name for name, _ in module.named_parameters())


def base_frozen(module: torch.nn.Module) -> bool:
    """Whether only LoRA parameters are trainable (then a LoRA payload carries the whole change)."""
    return not any(p.requires_grad for name, p in module.named_parameters() if ".lora_" not in name)


def lora_update(module: torch.nn.Module, version: int, adapter_name: str = "default") -> WeightUpdate:
    """A LoRA-only :class:`WeightUpdate` of ``module``'s adapter ``adapter_name``.

    Raises:
        ValueError: ``module`` has no such adapter.
    """
    configs = getattr(module, "peft_config", None) or {}
    if adapter_name not in configs:
        raise ValueError(
            f"module has no LoRA adapter {adapter_name!r} (adapters: {sorted(configs)}); "
            "use full_update() for a model without LoRA"
        )
    from peft import get_peft_model_state_dict  # peft is imported only where LoRA is used (seconds to import)

    _, is_peft = unwrap_peft(module)
    state = get_peft_model_state_dict(module, adapter_name=adapter_name)
    if is_peft:
        # keys relative to the transformers model, so workers that used add_adapter() load them as they are
        state = {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    return WeightUpdate(
        version=version,
        kind="lora",
        state={k: v.detach().to("cpu", copy=True) for k, v in state.items()},
        lora_config=configs[adapter_name],
    )


def full_update(module: torch.nn.Module, version: int) -> WeightUpdate:
    """A :class:`WeightUpdate` with every tensor of ``module`` (LoRA merged for a ``PeftModel``)."""
    return WeightUpdate(
        version=version,
        kind="full",
        state={k: v.to("cpu", copy=True) for k, v in merged_state_dict(module)},
    )


def make_update(module: torch.nn.Module, version: int) -> WeightUpdate:
    """LoRA-only payload when ``module`` has a LoRA and a frozen base, full weights otherwise."""
    if has_lora(module) and base_frozen(module):
        return lora_update(module, version)
    return full_update(module, version)


def apply_update(module: torch.nn.Module, update: WeightUpdate) -> None:
    """Load ``update`` into a worker's copy of the trained module, in place.

    A LoRA payload injects the adapter first if the module has none yet (peft's ``inject_adapter_in_model``
    with the trainer's config), then loads the tensors; every adapter tensor must be present, so a payload for another adapter
    layout fails loudly instead of leaving stale factors. A full payload must match the module's names.

    Raises:
        ValueError: names that do not match the module.
    """
    if update.kind == "lora":
        from peft import inject_adapter_in_model, set_peft_model_state_dict

        # the adapter's keys are relative to the model inside a PeftModel
        target, is_peft = unwrap_peft(module)
        if not has_lora(module):
            # peft's own injection, not the model's add_adapter(): transformers >= 5.24 gates that on a peft
            # release newer than any published, and the result (layers and peft_config) is the same
            inject_adapter_in_model(update.lora_config, target, adapter_name="default")
        state = {(_PEFT_PREFIX + k if is_peft else k): v for k, v in update.state.items()}
        result = set_peft_model_state_dict(module, state)
        missing = [k for k in result.missing_keys if ".lora_" in k]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"LoRA payload does not match the worker's adapter: missing {missing[:5]}, "
                f"unexpected {list(result.unexpected_keys)[:5]}"
            )
        return
    if has_lora(module):
        raise ValueError("a full-weight payload cannot be loaded into a model with a LoRA adapter; send LoRA")
    names = module.state_dict().keys()
    if names != update.state.keys():
        raise ValueError(
            "full-weight payload does not match the worker's model: missing "
            f"{sorted(names - update.state.keys())[:5]}, unexpected {sorted(update.state.keys() - names)[:5]}"
        )
    module.load_state_dict(update.state, strict=True)
