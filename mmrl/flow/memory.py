"""GPU memory a flow recipe holds before activations (``mmrl memory configs/flow/...yaml``).

The pipeline's published architecture (:mod:`pipelines.flow.published`) is built on the ``meta`` device in
``model.dtype``, the trained denoiser(s) made trainable exactly as the trainer does (:func:`make_trainable`), and
every tensor the trainer keeps is counted (:mod:`mmrl.memory` has the byte rules):

* every pipeline component's weights (text encoders, VAE, the experts), LoRA factors included;
* gradients and optimizer states of the trained parameters;
* the frozen start copies full fine-tuning keeps (:func:`start_copies`: KL reference, distillation teacher);
* the EMA (``trainer.ema_decay``) and old-policy (``trainer.old_policy_decay``) copies of the trained parameters,
  float32 at least (:func:`mmrl.ema.shadow_dtype`);
* the quantized explorer (``explore.enabled``), counted with :func:`pipelines.quant.quantized_bytes`;
* during evaluation with an EMA, the live weights' copy the swap keeps.

A rollout pool's workers (``pool.enabled``) hold their own copies on their own devices: not counted here.
"""

from __future__ import annotations

import torch

from mmrl.device import DTYPES
from mmrl.ema import shadow_dtype
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import make_trainable, start_copies
from mmrl.memory import (
    MemoryEstimate,
    MemoryPart,
    module_bytes,
    module_params,
    optimizer_states,
    tensors_bytes,
)
from pipelines.flow.adapters import get_adapter
from pipelines.flow.published import build_on_meta
from pipelines.quant import quantized_bytes

__all__ = ["estimate_memory"]


def estimate_memory(cfg: FlowGRPOConfig) -> MemoryEstimate:
    """The parts ``cfg``'s trainer keeps on each GPU (see the module docstring).

    Raises:
        OSError: ``model.path`` is neither a local pipeline folder nor a Hub repository whose configs can be
            read (published repositories need no download).
    """
    components = build_on_meta(cfg.model.path, DTYPES[cfg.model.dtype])
    trained = get_adapter(cfg.model.family).trained_components(cfg.model.options)
    for module in components.values():
        module.requires_grad_(False)
    # the frozen start copies are taken before the trained weights become master weights (as the trainer does)
    start_count = sum(p.numel() for name in trained for p in module_params(components[name]))
    start_size = sum(module_bytes(components[name]) for name in trained)
    for name in trained:
        # peft makes each LoRA factor on the CPU, then moves it to its base layer's device and dtype (meta)
        make_trainable(components[name], cfg.model.lora, DTYPES[cfg.model.master_weight_dtype])

    parts = [
        MemoryPart(
            f"{name} weights",
            sum(p.numel() for p in module_params(module)),
            module_bytes(module),
            sharded=name in trained,
            note=_component_note(name, name in trained, cfg),
        )
        for name, module in components.items()
    ]
    trainable = [p for name in trained for p in module_params(components[name], trainable_only=True)]
    count, size = sum(p.numel() for p in trainable), tensors_bytes(trainable)
    parts.append(MemoryPart("gradients", count, size, sharded=True, note="the trained parameters' dtype"))
    parts.append(optimizer_states(cfg.trainer.optimizer, count, size, sharded=True))
    average_size = sum(p.numel() * shadow_dtype(p.dtype).itemsize for p in trainable)  # float32 at least
    for copy in start_copies(cfg):
        note = {
            "reference": "full fine-tuning's start weights: KL reference and distillation teacher",
            "distill_teacher": "trainer.guidance_distill.refresh_every's teacher",
        }[copy]
        parts.append(
            MemoryPart(f"{copy} copy", start_count, start_size, sharded=copy == "reference", note=note)
        )
    if cfg.trainer.ema_decay:
        parts.append(
            MemoryPart(
                "EMA", count, average_size, sharded=True, note=f"trainer.ema_decay {cfg.trainer.ema_decay}"
            )
        )
    if cfg.trainer.old_policy_decay:
        parts.append(
            MemoryPart("old policy", count, average_size, sharded=True, note="trainer.old_policy_decay's EMA")
        )
    if cfg.explore.enabled:
        parts.append(_explorer_part(components, trained, cfg))
    phases = []
    if cfg.trainer.ema_decay:
        phases.append(
            MemoryPart(
                "evaluation", count, size, sharded=True, note="the live weights while the EMA is swapped in"
            )
        )
    return MemoryEstimate(model=cfg.model.path, parts=parts, phases=phases)


def _component_note(name: str, trained: bool, cfg: FlowGRPOConfig) -> str:
    dtype = cfg.model.dtype
    if not trained:
        return f"frozen, {dtype}"
    master = cfg.model.master_weight_dtype
    if cfg.model.lora is None:
        return f"trained in full, {master}" + (
            f" master weights of the {dtype} model" if master != dtype else ""
        )
    return f"frozen {dtype} base + LoRA r{cfg.model.lora.rank} in {master}"


def _explorer_part(
    components: dict[str, torch.nn.Module], trained: tuple[str, ...], cfg: FlowGRPOConfig
) -> MemoryPart:
    scheme = cfg.explore.scheme
    dtype = DTYPES[cfg.model.dtype]
    size = sum(quantized_bytes(components[name], scheme, compute_dtype=dtype) for name in trained)
    count = sum(
        p.numel() for name in trained for key, p in components[name].named_parameters() if "lora_" not in key
    )
    return MemoryPart("explorer", count, size, note=f"explore.scheme {scheme}: a quantized copy, LoRA merged")
