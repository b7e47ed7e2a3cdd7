"""GPU memory a VLM recipe holds before activations (``mmrl memory configs/vlm/...yaml``).

The published architecture (:mod:`pipelines.vlm.published`) is built on the ``meta`` device in ``model.dtype``,
made trainable exactly as the trainer does (:func:`mmrl.vlm.trainer.make_trainable`), and counted with the
rules of :mod:`mmrl.memory`:

* the policy's weights (LoRA factors included); with ``model.load_in_4bit`` the base's Linear weights as NF4
  (transformers' bitsandbytes loading: every Linear but ``lm_head``, no double quantization), counted with
  :func:`pipelines.quant.quantized_bytes`;
* gradients and optimizer states (``trainer.optimizer``) of the trained parameters, in
  ``model.master_weight_dtype`` (float32 master weights of a bfloat16 model by default);
* full fine-tuning's frozen reference copy under ``trainer.beta > 0``, in ``model.dtype`` (LoRA's reference is the
  adapter off);
* with ``generation.backend: vllm`` the colocated engine, which takes ``generation.vllm_gpu_memory_utilization``
  of the GPU while it rolls out and sleeps (weights to CPU memory, KV cache freed) while the trainer updates.
"""

from __future__ import annotations

from mmrl.device import DTYPES
from mmrl.memory import (
    MemoryEstimate,
    MemoryPart,
    module_bytes,
    module_params,
    optimizer_states,
    tensors_bytes,
)
from mmrl.vlm.config import VLMRLVRConfig
from mmrl.vlm.trainer import make_trainable
from pipelines.quant import quantized_bytes
from pipelines.vlm.published import build_on_meta

__all__ = ["estimate_memory"]


def estimate_memory(cfg: VLMRLVRConfig) -> MemoryEstimate:
    """The parts ``cfg``'s trainer keeps on each GPU (see the module docstring).

    Raises:
        OSError: ``model.path`` is neither a local model folder nor a Hub repository whose config can be read
            (published repositories need no download).
    """
    m = cfg.model
    family = m.resolve_family()
    dtype = DTYPES[m.dtype]
    base = build_on_meta(m.path, dtype)
    # the reference copy is taken before the trained weights become master weights (as the trainer does)
    start_count, start_size = sum(p.numel() for p in module_params(base)), module_bytes(base)
    # peft makes each LoRA factor on the CPU, then moves it to its base layer's device and dtype (meta)
    policy = make_trainable(base, m, family)
    count = sum(p.numel() for p in module_params(policy))
    trainable = module_params(policy, trainable_only=True)
    trained_count, trained_size = sum(p.numel() for p in trainable), tensors_bytes(trainable)
    trained_dtype = str(trainable[0].dtype).removeprefix("torch.") if trainable else m.dtype
    if m.load_in_4bit:
        size = quantized_bytes(policy, "nf4", skip=("lm_head",), compute_dtype=dtype, double_quant=False)
        note = f"NF4 base (model.load_in_4bit) + LoRA in {trained_dtype}"
    elif m.lora is not None:
        size = module_bytes(policy)
        note = f"{m.dtype} base + LoRA r{m.lora.rank} in {trained_dtype}"
    else:
        size = module_bytes(policy)
        master = f" master weights of the {m.dtype} model" if trained_dtype != m.dtype else ""
        note = f"trained in full, {trained_dtype}{master}" + (
            "" if m.train_vision else "; vision tower frozen"
        )
    parts = [MemoryPart("policy weights", count, size, sharded=m.lora is None, note=note)]
    if m.load_in_4bit and m.lora is not None:
        # quantized_bytes folds LoRA away (an explorer's view); the trained factors are kept beside the base
        parts.append(MemoryPart("LoRA factors", trained_count, trained_size))
    sharded = m.lora is None  # FSDP is for full fine-tuning only (the trainer refuses LoRA under FSDP)
    parts.append(
        MemoryPart("gradients", trained_count, trained_size, sharded=sharded, note="the parameters' dtype")
    )
    parts.append(optimizer_states(cfg.trainer.optimizer, trained_count, trained_size, sharded=sharded))
    if m.lora is None and cfg.trainer.beta > 0:
        parts.append(
            MemoryPart(
                "reference copy",
                start_count,
                start_size,
                sharded=True,
                note=f"trainer.beta's KL reference, {m.dtype}",
            )
        )
    engine_share = 0.0
    if cfg.generation.backend == "vllm" and not cfg.pool.enabled:
        engine_share = cfg.generation.vllm_gpu_memory_utilization
    return MemoryEstimate(model=m.path, parts=parts, engine_share=engine_share)
