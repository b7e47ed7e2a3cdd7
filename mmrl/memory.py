"""What a recipe holds in GPU memory before its first activation: the bytes of every model, copy and optimizer
state, counted on the published architecture instantiated on PyTorch's ``meta`` device (shapes and dtypes, no
weights, no download beyond config files).

Each front end says what it holds (``mmrl/flow/memory.py``, ``mmrl/vlm/memory.py``) as :class:`MemoryPart` s;
this module adds them up and writes the table ``mmrl memory CONFIG`` prints::

    bytes(weights)    = sum over parameters and buffers of numel * element size
    bytes(gradients)  = bytes(trainable parameters)                      (gradients share the parameters' dtype)
    bytes(AdamW)      = 2 * bytes(trainable parameters)                  (exp_avg, exp_avg_sq in the param dtype)
    bytes(AdamW8bit)  = 2 * numel(trainable parameters)                  (one byte per state, block scales aside)
    bytes(KahanAdamW) = 2 * bytes(trainable parameters) + 4 * numel(...)  (exp_avg, compensation; float32 exp_avg_sq)

Activations (rollouts, the loss's forward and backward, gradient checkpointing's recomputation), reward models
and the CUDA context are not counted: they depend on batch, resolution and kernels, so the estimate is a floor,
and the table says how much of each GPU it leaves for them. Under FSDP (``--fsdp N``) the parts the trainer
shards (the trained model, its gradients, optimizer states, EMA and reference copies) are divided by ``N``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "GIB",
    "GPUS",
    "MemoryEstimate",
    "MemoryPart",
    "check_fits",
    "module_bytes",
    "module_params",
    "optimizer_states",
    "tensors_bytes",
]

#: usable memory of common training GPUs in GiB (about what ``torch.cuda.mem_get_info`` reports free on an idle
#: card: the marketed size less what the driver reserves)
GPUS: dict[str, float] = {
    "RTX 4090 24GB": 23.5,
    "L40S 48GB": 44.5,
    "A100/H100 80GB": 78.0,
    "H200 141GB": 139.0,
}

GIB = 1024**3


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each tensor counted once (a tied embedding is one parameter); meta tensors count
    what they would hold."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def module_params(module: nn.Module, trainable_only: bool = False) -> list[nn.Parameter]:
    """The parameters of ``module`` (each once), only those with ``requires_grad`` when ``trainable_only``."""
    return [p for p in module.parameters() if p.requires_grad or not trainable_only]


def module_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers of ``module``."""
    return tensors_bytes([*module.parameters(), *module.buffers()])


@dataclass(frozen=True)
class MemoryPart:
    """One thing a recipe keeps on each GPU.

    Attributes:
        name: what it is (``transformer weights``, ``AdamW states``...).
        params: how many values it holds (parameters, or states).
        bytes: its size on one GPU without sharding.
        sharded: whether FSDP divides it over the GPUs.
        note: why it is there, or what its size depends on.
    """

    name: str
    params: int
    bytes: int
    sharded: bool = False
    note: str = ""

    def bytes_per_gpu(self, fsdp: int) -> float:
        return self.bytes / fsdp if self.sharded else float(self.bytes)


def optimizer_states(optimizer: str, count: int, size: int, sharded: bool) -> MemoryPart:
    """The states ``trainer.optimizer`` keeps for ``count`` trained values of ``size`` bytes (module docstring)."""
    if optimizer == "adamw8bit":
        return MemoryPart("AdamW8bit states", 2 * count, 2 * count, sharded=sharded, note="one byte each")
    if optimizer == "adamw_kahan":
        note = "exp_avg and Kahan compensation in the parameters' dtype, exp_avg_sq in float32"
        return MemoryPart("KahanAdamW states", 3 * count, 2 * size + 4 * count, sharded=sharded, note=note)
    return MemoryPart("AdamW states", 2 * count, 2 * size, sharded=sharded, note="exp_avg, exp_avg_sq")


@dataclass(frozen=True)
class MemoryEstimate:
    """The parts a recipe holds, and the table of them.

    Attributes:
        model: the model id or folder the estimate was built from.
        parts: what stays on the GPU through the whole run.
        phases: what one phase of a step adds on top of ``parts`` (the live weights while the EMA is
            evaluated); only the largest counts, phases do not overlap.
        engine_share: the share of the GPU's memory a colocated vLLM engine takes while it rolls out (its
            ``gpu_memory_utilization``; it sleeps while the trainer updates); 0 without one.
    """

    model: str
    parts: Sequence[MemoryPart]
    phases: Sequence[MemoryPart] = ()
    engine_share: float = 0.0

    def resident_bytes(self, fsdp: int = 1) -> float:
        """Bytes on each GPU of everything kept through the run."""
        return sum(part.bytes_per_gpu(fsdp) for part in self.parts)

    def peak_bytes(self, gpu_bytes: float, fsdp: int = 1) -> float:
        """:meth:`resident_bytes` plus the largest phase, on a GPU of ``gpu_bytes`` (the engine's share is of
        that)."""
        phase = max((p.bytes_per_gpu(fsdp) for p in self.phases), default=0.0)
        return self.resident_bytes(fsdp) + max(phase, self.engine_share * gpu_bytes)

    def table(self, fsdp: int = 1) -> str:
        """The parts one per row (GiB per GPU), the totals, and what each known GPU has left for activations."""
        rows = [("part", "values", "GiB per GPU", "note")]
        rows += [_row(part, fsdp) for part in self.parts]
        rows.append(("resident", "", f"{self.resident_bytes(fsdp) / GIB:.2f}", ""))
        rows += [_row(phase, fsdp, prefix="+ during ") for phase in self.phases]
        if self.engine_share:
            share = f"{self.engine_share:g} of the GPU"
            rows.append(
                ("+ during rollouts: vLLM engine", "", share, "weights and KV cache; asleep while training")
            )
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [self.model + (f", FSDP over {fsdp} GPUs" if fsdp > 1 else ", one GPU")]
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
            lines.append("  ".join([*cells, row[3]]).rstrip())
        fits = []
        for name, size in GPUS.items():
            peak = self.peak_bytes(size * GIB, fsdp) / GIB
            fits.append(f"{name}: {size - peak:.1f} GiB left" if peak < size else f"{name}: does not fit")
        lines.append(
            "peak without activations, left on each GPU for activations, reward models and the CUDA context:"
        )
        lines.append("  " + "; ".join(fits))
        return "\n".join(lines)


def _row(part: MemoryPart, fsdp: int, prefix: str = "") -> tuple[str, str, str, str]:
    values = f"{part.params / 1e9:.3f} B" if part.params >= 1e7 else f"{part.params / 1e6:.2f} M"
    note = part.note + (" (sharded)" if part.sharded and fsdp > 1 else "")
    return (prefix + part.name, values, f"{part.bytes_per_gpu(fsdp) / GIB:.2f}", note)


def check_fits(estimate: MemoryEstimate, free_bytes: float, total_bytes: float, fsdp: int = 1) -> float:
    """The estimate's peak on a GPU of ``total_bytes`` with ``free_bytes`` free; raises when it cannot fit.

    Called before a trainer loads any weight on a GPU: a recipe whose weights and training state alone exceed
    what is free would fail with an out-of-memory error only after minutes of loading.

    Raises:
        MemoryError: the peak exceeds ``free_bytes``; the message has the estimate's table and what to change.
    """
    peak = estimate.peak_bytes(total_bytes, fsdp)
    if peak > free_bytes:
        raise MemoryError(
            f"this recipe holds {peak / GIB:.1f} GiB per GPU before any activation (`mmrl memory`), and the GPU has "
            f"{free_bytes / GIB:.1f} GiB free of {total_bytes / GIB:.1f}: train LoRA (model.lora), shard with FSDP "
            "(configs/accelerate/fsdp.yaml), use trainer.optimizer=adamw8bit (or pure bfloat16: "
            "model.master_weight_dtype=bfloat16 with trainer.optimizer=adamw_kahan), or take a larger GPU.\n"
            + estimate.table(fsdp)
        )
    return peak
