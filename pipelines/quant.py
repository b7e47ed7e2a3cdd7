"""Quantized copies of a policy for cheap rollouts ("explorers"), kept in sync with a training LoRA.

The two-stage explore/train rollout (Sol-RL) previews many candidate seeds with a low-precision copy of the
policy and regenerates only a contrastive subset at full precision. This module builds that copy:

* ``quantize_copy(module, scheme)`` returns a :class:`QuantizedCopy` whose ``module`` has the structure of
  ``module`` (peft LoRA layers folded away) with every ``nn.Linear`` outside the skip list replaced by a
  quantized layer of ``scheme``. The training module is only read: its parameters stay bit-identical and the
  copy shares no storage with it.
* ``sync_lora(explorer, trained)`` refreshes the copy after an optimizer step: each LoRA-adapted layer gets
  ``W_eff = W_base + s * B @ A`` (``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA) re-quantized
  from the full-precision base weight of the training module, never from the copy's previous quantized weight,
  so quantization error does not accumulate over steps.
* ``weight_bytes(module)`` counts what the weights occupy, quantized storage included (packed 4-bit codes,
  block scales, nested scales; float8 data and scales).

Schemes (formats, hardware, measured errors and memory: docs/quantization.md):

* ``none``: plain copy in ``compute_dtype`` (the reference; any device).
* ``int8`` (bitsandbytes): int8 weight rows with one fp32 absmax scale per output row, activations quantized
  per row at the matmul (LLM.int8, arXiv 2208.07339, without outlier decomposition). CPU and CUDA.
* ``nf4`` / ``fp4`` (bitsandbytes): 4-bit NormalFloat / FP4 codes with one absmax per 64 weights, the absmax
  values themselves 8-bit quantized by default (QLoRA, arXiv 2305.14314); dequantized to ``compute_dtype``
  for the matmul. CPU and CUDA.
* ``fp8_weight_only`` (torchao): float8 e4m3 weights with one scale per row, matmul in ``compute_dtype``.
  Any device (slow on CPU: dequantizes per call).
* ``fp8`` (torchao): float8 e4m3 weights and dynamically quantized activations, row-wise scales,
  ``torch._scaled_mm``. CUDA compute capability 9.0+ (Hopper).
* ``nvfp4`` (torchao): NVFP4 weights and activations (e2m1 values, an e4m3 scale per 16 values, an fp32 scale
  per tensor). CUDA compute capability 10.0+ (Blackwell).
"""

from __future__ import annotations

import copy
import fnmatch
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from pipelines.lora import (
    check_ties_not_adapted,
    float32_params,
    lora_delta_adapters,
    merged_lora_params,
    unwrap_peft,
)

logger = logging.getLogger(__name__)

Scheme = Literal["none", "int8", "nf4", "fp4", "fp8_weight_only", "fp8", "nvfp4"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)

#: Module-name patterns left unquantized by default (``fnmatch`` globs on the full dotted name; a module whose
#: name or any ancestor's name matches is skipped). Unanchored names match top-level modules only, so
#: ``proj_out`` skips FLUX's final projection but not the ``single_transformer_blocks.N.proj_out`` layers that
#: hold much of its weight. Embedders and output layers are small, and quantizing them costs the most accuracy
#: per byte saved: the timestep/text embedders modulate every block through AdaLN (measured on a random SD3,
#: nf4 output error 0.0075 with this list vs 0.095 with every Linear quantized, for 5.4x vs 6.9x smaller
#: weights). torchao's own NVFP4 filter excludes embedders likewise.
DEFAULT_SKIP: tuple[str, ...] = (
    # diffusers flow transformers (SD3/SD3.5, FLUX.1, SANA, Wan)
    "time_text_embed",  # timestep / pooled-text (/ guidance) embedders: SD3, FLUX
    "time_embed",  # SANA timestep embedder
    "condition_embedder",  # Wan time + text embedders
    "context_embedder",  # text-token projection: SD3, FLUX
    "caption_projection",  # SANA text projection
    "x_embedder",  # FLUX latent-patch embedder
    "pos_embed",  # SD3 patch embedder (conv + positional table)
    "patch_embed",  # SANA patch embedder
    "patch_embedding",  # Wan patch embedder
    "norm_out",  # final AdaLN modulation
    "proj_out",  # final projection to latent patches
    # Qwen-Image
    "img_in",  # latent-patch embedder
    "txt_in",  # text-token projection
    # FLUX.2 [dev] / [klein]: the timestep (+ guidance) embedder and the modulations every block shares
    "time_guidance_embed",
    "double_stream_modulation_img",
    "double_stream_modulation_txt",
    "single_stream_modulation",
    # Z-Image
    "t_embedder",  # timestep embedder
    "cap_embedder",  # caption projection
    "all_x_embedder",  # latent-patch embedders (one per patch size)
    "all_final_layer",  # final AdaLN + projection (one per patch size)
    # transformers language models and VLMs
    "lm_head",
    "*embed_tokens",
)


def list_schemes() -> list[str]:
    """Names accepted by :func:`quantize_copy`."""
    return list(SCHEMES)


def check_scheme(scheme: str, device: torch.device | str) -> None:
    """Raise a clear error if ``scheme`` cannot run on ``device`` here; return silently otherwise.

    Hardware is checked before the optional torchao import, so a user without a suitable GPU learns that first.

    Raises:
        ValueError: unknown scheme, or a GPU-generation scheme on a device that lacks it.
        ImportError: a torchao scheme without torchao installed.
    """
    spec = scheme_spec(scheme)
    device = torch.device(device)
    if spec.min_capability is not None:
        if device.type != "cuda":
            found = f"the module is on {device.type!r}"
        else:
            capability = torch.cuda.get_device_capability(device)
            found = (
                f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}"
            )
            if capability >= spec.min_capability:
                found = ""
        if found:
            raise ValueError(
                f"quantization scheme {scheme!r} needs {spec.hardware}; {found}. Elsewhere use "
                "'fp8_weight_only' (any device, needs torchao), or 'int8' / 'nf4' / 'fp4' (bitsandbytes, CPU and CUDA)."
            )
    if spec.library == "torchao":
        try:
            import torchao  # noqa: F401
        except ImportError as err:
            raise ImportError(
                f"quantization scheme {scheme!r} needs torchao: pip install 'mmrl[torchao]'"
            ) from err


def _eligible(scheme: str, layer: nn.Linear) -> bool:
    """Whether ``scheme``'s kernels accept this layer's shape; other layers stay in ``compute_dtype``."""
    multiple = scheme_spec(scheme).dims_multiple_of
    return layer.in_features % multiple == 0 and layer.out_features % multiple == 0


def _is_skipped(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` or one of its ancestors (``a``, ``a.b``, ...) matches a pattern."""
    parts = name.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes for pattern in patterns)


# --------------------------------------------------------------------------------------------------------------
# Building one quantized layer from a full-precision weight
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    blocksize: int
    double_quant: bool


def _bias_param(bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Parameter | None:
    if bias is None:
        return None
    return nn.Parameter(bias.detach().to(dtype=dtype, copy=True), requires_grad=False)


def _build_plain(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    out_features, in_features = weight.shape
    # meta: no throw-away allocation + random init of a weight that is overwritten right away
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().to(dtype=dtype, copy=True), requires_grad=False)
    layer.bias = _bias_param(bias, dtype)
    return layer


def _build_bnb_4bit(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scheme: str, opts: _Options
) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=bias is not None,
        compute_dtype=dtype,
        compress_statistics=opts.double_quant,
        quant_type=scheme,
        device="meta",
    )
    # Quantized from the weight in compute dtype, so dequantization returns the compute dtype directly.
    data, state = bnb.functional.quantize_4bit(
        weight.detach().to(dtype).contiguous(),
        blocksize=opts.blocksize,
        compress_statistics=opts.double_quant,
        quant_type=scheme,
    )
    layer.weight = bnb.nn.Params4bit(
        data,
        requires_grad=False,
        quant_state=state,
        blocksize=opts.blocksize,
        compress_statistics=opts.double_quant,
        quant_type=scheme,
        module=layer,
        bnb_quantized=True,
    )
    layer.quant_state = state
    layer.bias = _bias_param(bias, dtype)
    # On AVX512-BF16 CPUs bitsandbytes 0.50 rewrites the weight into a bf16 "packed" layout at the first eval
    # forward: it fails for in_features not a multiple of the block size, computes in bf16 whatever the
    # compute dtype, and (without the optional `kernels` package) is no faster than the generic
    # dequantize + matmul path (measured 17.6 vs 16.2 ms for a 1024x512 layer, batch 256). Keep the generic path.
    layer.support_avx512bf16_for_cpu = False
    return layer


def _build_bnb_int8(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scheme: str, opts: _Options
) -> nn.Module:
    import bitsandbytes as bnb

    out_features, in_features = weight.shape
    layer = bnb.nn.Linear8bitLt(
        in_features, out_features, bias=bias is not None, has_fp16_weights=False, threshold=0.0, device="meta"
    )
    # Row-wise absmax: CB = round(127 * W / SCB), SCB[i] = max_j |W[i, j]| (fp32 scales). From fp16, as
    # bitsandbytes' own Int8Params does: its CUDA kernel accepts only fp16 (and weights are far below 65504).
    codes, scales, _ = bnb.functional.int8_vectorwise_quant(weight.detach().to(torch.float16).contiguous())
    layer.weight = bnb.nn.Int8Params(codes, requires_grad=False, has_fp16_weights=False, CB=codes, SCB=scales)
    layer.bias = _bias_param(bias, dtype)
    return layer


def _build_torchao(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scheme: str, opts: _Options
) -> nn.Module:
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        PerRow,
        quantize_,
    )

    # set_inductor_config=False: torchao would otherwise change global torch._inductor settings at every
    # (re-)quantization, a side effect on the caller's whole process.
    if scheme == "fp8_weight_only":
        config = Float8WeightOnlyConfig(granularity=PerRow(), set_inductor_config=False)
    elif scheme == "fp8":
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    else:
        from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

        # The fused Triton activation-scaling kernel needs the optional MSLK package; the plain path does not.
        config = NVFP4DynamicActivationNVFP4WeightConfig(use_triton_kernel=False)
    layer = _build_plain(weight, bias, dtype)
    quantize_(layer, config)
    return layer


def _build_unquantized(
    weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, scheme: str, opts: _Options
) -> nn.Module:
    return _build_plain(weight, bias, dtype)


def _row_scaled_bytes(out_features: int, in_features: int, opts: _Options) -> int:
    """One byte per value (int8 or float8) and an fp32 scale per output row."""
    return out_features * in_features + 4 * out_features


def _bnb_4bit_bytes(out_features: int, in_features: int, opts: _Options) -> int:
    """Packed 4-bit codes, a 16-entry fp32 code table, and per block an fp32 absmax, or with double quantization
    a uint8 absmax plus an fp32 per 256 blocks and a 256-entry fp32 code table."""
    n = out_features * in_features
    blocks = -(-n // opts.blocksize)
    absmax = blocks + 4 * -(-blocks // 256) + 4 * 256 if opts.double_quant else 4 * blocks
    return -(-n // 2) + 4 * 16 + absmax


def _nvfp4_bytes(out_features: int, in_features: int, opts: _Options) -> int:
    """Packed e2m1 codes, an e4m3 scale per 16 values and one fp32 scale per tensor."""
    n = out_features * in_features
    return -(-n // 2) + n // 16 + 4


@dataclass(frozen=True)
class QuantScheme:
    """What mmrl knows of one quantization scheme: one entry of :data:`SCHEME_SPECS` per scheme.

    Attributes:
        library: where its kernels come from (``torchao`` is an optional dependency; bitsandbytes is required).
        build: ``(weight, bias, compute_dtype, scheme, options) -> layer`` computing ``x @ Q(W).T + b``.
        stored_bytes: ``(out_features, in_features, options) -> bytes`` of one stored weight (None: the
            weight stays in ``compute_dtype``).
        dims_multiple_of: a Linear layer is quantized only if both its dimensions are multiples of this
            (fp8 GEMMs need 16-aligned dimensions; NVFP4 scales blocks of 16 along both).
        min_capability: the CUDA compute capability its kernels need (None: any device).
        hardware: that requirement in words, for the error that names it.
    """

    library: Literal["torch", "bitsandbytes", "torchao"]
    build: Callable[[torch.Tensor, torch.Tensor | None, torch.dtype, str, _Options], nn.Module]
    stored_bytes: Callable[[int, int, _Options], int] | None
    dims_multiple_of: int = 1
    min_capability: tuple[int, int] | None = None
    hardware: str = "any device"


#: every scheme by name; a new scheme is a builder, a byte count and an entry here (and a name in ``Scheme``)
SCHEME_SPECS: dict[str, QuantScheme] = {
    "none": QuantScheme("torch", _build_unquantized, None),
    "int8": QuantScheme("bitsandbytes", _build_bnb_int8, _row_scaled_bytes),
    "nf4": QuantScheme("bitsandbytes", _build_bnb_4bit, _bnb_4bit_bytes),
    "fp4": QuantScheme("bitsandbytes", _build_bnb_4bit, _bnb_4bit_bytes),
    "fp8_weight_only": QuantScheme("torchao", _build_torchao, _row_scaled_bytes),
    # fp8 tensor cores start at sm89 (Ada) and torchao accepts it; mmrl asks for Hopper, the generation the
    # row-wise fp8 recipe is meant and checked for (DESIGN.md: "FP8 Hopper and newer").
    "fp8": QuantScheme(
        "torchao",
        _build_torchao,
        _row_scaled_bytes,
        dims_multiple_of=16,
        min_capability=(9, 0),
        hardware="an NVIDIA GPU with compute capability >= 9.0 (Hopper: H100/H200, or newer)",
    ),
    # FP4 tensor-core GEMMs exist only from Blackwell on.
    "nvfp4": QuantScheme(
        "torchao",
        _build_torchao,
        _nvfp4_bytes,
        dims_multiple_of=16,
        min_capability=(10, 0),
        hardware="an NVIDIA GPU with compute capability >= 10.0 (Blackwell: B200/GB200, or newer)",
    ),
}
assert set(SCHEME_SPECS) == set(SCHEMES), "every name of Scheme has an entry in SCHEME_SPECS"


def scheme_spec(scheme: str) -> QuantScheme:
    """The :class:`QuantScheme` of ``scheme``.

    Raises:
        ValueError: an unknown scheme, listing the known ones.
    """
    if scheme not in SCHEME_SPECS:
        raise ValueError(f"unknown quantization scheme {scheme!r}. Available: {list(SCHEMES)}")
    return SCHEME_SPECS[scheme]


def _build_layer(
    scheme: str, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, opts: _Options
) -> nn.Module:
    """A fresh quantized linear layer computing ``x @ Q(W).T + b`` in ``dtype``."""
    return scheme_spec(scheme).build(weight, bias, dtype, scheme, opts)


# --------------------------------------------------------------------------------------------------------------
# Reading effective (LoRA-merged) parameters from the training module
# --------------------------------------------------------------------------------------------------------------


def _tuner_kind(module: nn.Module) -> Literal["lora", "other", None]:
    """``"lora"`` for a peft LoRA layer, ``"other"`` for another peft wrapper, None for a plain module."""
    # imported here, not at module level: peft pulls in transformers (seconds), which plain callers never need
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    if isinstance(module, LoraLayer):
        return "lora"
    if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
        return "other"
    return None


def effective_params(layer: nn.Module, name: str = "") -> dict[str, torch.Tensor]:
    """The parameters ``layer`` computes with, LoRA folded in, as fresh fp32 tensors (a plain layer: its own).

    For a peft LoRA layer with active adapters ``a`` (peft's ``scaling[a]``: ``lora_alpha / r``, or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``; LoRA, arXiv 2106.09685 eqn. 3; rsLoRA, arXiv 2312.03732)::

        weight = W_base + sum_a scaling[a] * B_a @ A_a      (reshaped by peft for conv / embedding layers)
        bias   = b_base + sum_a scaling[a] * b_B_a          (only adapters trained with lora_bias=True)

    Adapters already merged into the base weight by peft, and disabled adapters, contribute nothing.

    Args:
        layer: a module owning parameters directly (a LoRA wrapper counts as owning its base layer's).
        name: its qualified name, for error messages.

    Returns:
        ``{param_name: tensor}`` in fp32 (non-float parameters keep their dtype), detached, never aliasing
        ``layer``'s storage.

    Raises:
        ValueError: a LoRA variant (DoRA) or a peft wrapper other than LoRA (``modules_to_save``, LoHa, ...).
    """
    kind = _tuner_kind(layer)
    if kind == "other":
        raise ValueError(
            f"module {name!r} is a {type(layer).__name__}; the quantized copy folds only plain LoRA layers "
            "(no modules_to_save, LoHa, LoKr, ...)"
        )

    if kind is None:
        return float32_params(layer)
    return merged_lora_params(layer, name)


def _needs_refresh(layer: nn.Module) -> bool:
    """After a training step: a LoRA layer with an update in use, or any layer with trainable parameters."""
    if _tuner_kind(layer) == "lora" and lora_delta_adapters(layer, ""):
        return True
    own = layer.get_base_layer() if _tuner_kind(layer) == "lora" else layer
    return any(p.requires_grad for p in own.parameters(recurse=False))


# --------------------------------------------------------------------------------------------------------------
# The explorer
# --------------------------------------------------------------------------------------------------------------


@dataclass
class QuantizedCopy:
    """A quantized rollout copy of a training module.

    Attributes:
        module: the copy, in eval mode, no parameter requires grad; call it like the training module.
        scheme: the quantization scheme of its Linear layers.
        compute_dtype: dtype of activations and of every unquantized parameter.
        quantized: names of the Linear layers stored in ``scheme``.
        skipped: names of Linear layers left in ``compute_dtype`` (skip patterns, or shapes ``scheme`` rejects).
        blocksize: bitsandbytes 4-bit block size (weights per absmax scale).
        double_quant: whether bitsandbytes 4-bit absmax scales are themselves 8-bit quantized.
    """

    module: nn.Module
    scheme: Scheme
    compute_dtype: torch.dtype
    quantized: tuple[str, ...]
    skipped: tuple[str, ...]
    blocksize: int = 64
    double_quant: bool = True

    def sync(self, trained: nn.Module) -> int:
        """Same as :func:`sync_lora` ``(self, trained)``."""
        return sync_lora(self, trained)


def _first_float_param(module: nn.Module) -> torch.Tensor:
    for p in module.parameters():
        if p.is_floating_point():
            return p
    raise ValueError(f"{type(module).__name__} has no floating-point parameter to quantize")


def _base_and_patterns(module: nn.Module, skip: Iterable[str]) -> tuple[nn.Module, tuple[str, ...]]:
    """The model under a peft wrapper, and the skip patterns applied below each of its ``quantize_roots``."""
    if isinstance(skip, str):
        raise ValueError(
            f"skip must be a sequence of patterns, got the string {skip!r}; write skip=({skip!r},)"
        )
    base, _ = unwrap_peft(module)
    # a container of several models (Wan2.2's two experts) names them in `quantize_roots`: the patterns then
    # apply below each model, as they would to that model alone
    roots = getattr(base, "quantize_roots", ())
    return base, tuple(skip) + tuple(f"{root}.{pattern}" for root in roots for pattern in skip)


def _skeleton(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``base``'s structure whose parameters are meta placeholders (floats in ``dtype``), with peft
    LoRA wrappers folded into their base layers and peft's adapter flags cleared."""
    # each parameter is replaced by a placeholder through the deepcopy memo (tied parameters share one
    # placeholder, so ties survive)
    memo: dict[int, object] = {
        id(p): nn.Parameter(
            torch.empty_like(p, device="meta", dtype=dtype if p.is_floating_point() else p.dtype),
            requires_grad=False,
        )
        for p in base.parameters()
    }
    copied = copy.deepcopy(base, memo)
    for name in _lora_wrappers(copied):
        copied.set_submodule(name, copied.get_submodule(name).get_base_layer())
    for name, sub in copied.named_modules():
        if _tuner_kind(sub) == "other":
            raise ValueError(
                f"module {name!r} is a {type(sub).__name__}; the quantized copy folds only plain LoRA layers "
                "(no modules_to_save, LoHa, LoKr, ...)"
            )
        # The copy has no adapters; a stale flag would make diffusers/transformers adapter methods look for them.
        if getattr(sub, "_hf_peft_config_loaded", False):
            sub._hf_peft_config_loaded = False
        if "peft_config" in vars(sub):
            del sub.peft_config
    return copied


def _choose_layers(copied: nn.Module, scheme: str, skip: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(quantized, skipped) names: every exact ``nn.Linear``, skipped where a pattern or the kernels say so."""
    quantized, skipped = [], []
    for name, sub in copied.named_modules():
        if type(sub) is nn.Linear:
            (skipped if _is_skipped(name, skip) or not _eligible(scheme, sub) else quantized).append(name)
    return quantized, skipped


def _lora_wrappers(base: nn.Module) -> list[str]:
    return [name for name, sub in base.named_modules() if _tuner_kind(sub) == "lora"]


def _write(explorer: QuantizedCopy, base: nn.Module, names: Iterable[str]) -> int:
    """Write the effective parameters of ``base``'s modules ``names`` into the explorer; count rebuilt layers.

    Quantized layers are rebuilt from the fresh full-precision weight; other parameters are copied in place
    into the explorer's tensors (in place keeps tied parameters tied).
    """
    opts = _Options(explorer.blocksize, explorer.double_quant)
    quantized = set(explorer.quantized)
    rebuilt = 0
    with torch.no_grad():
        for name in names:
            try:
                target = explorer.module.get_submodule(name)
            except AttributeError as err:
                raise ValueError(
                    f"the explorer has no module {name!r}: build it with quantize_copy() of this training module"
                ) from err
            params = effective_params(base.get_submodule(name), name)
            if name in quantized:
                layer = _build_layer(
                    explorer.scheme, params["weight"], params.get("bias"), explorer.compute_dtype, opts
                )
                if name:
                    explorer.module.set_submodule(name, layer)
                else:  # the module being copied is itself a Linear
                    explorer.module = layer
                rebuilt += 1
                continue
            for param_name, value in params.items():
                getattr(target, param_name).copy_(value)
    return rebuilt


def quantize_copy(
    module: nn.Module,
    scheme: Scheme,
    *,
    skip: Iterable[str] = DEFAULT_SKIP,
    compute_dtype: torch.dtype | None = None,
    blocksize: int = 64,
    double_quant: bool = True,
) -> QuantizedCopy:
    """Build a quantized copy of ``module`` for rollouts, with its current LoRA (if any) merged in.

    Every ``nn.Linear`` (exact class) whose name matches no ``skip`` pattern becomes a ``scheme`` layer holding
    ``Q(W_eff)``, ``W_eff`` as in :func:`effective_params`; the rest of the copy holds ``compute_dtype`` copies.
    peft LoRA wrappers are folded away, so the copy is a plain model of the base architecture (a ``PeftModel``
    yields a copy of its base model). The copy lives on the device of ``module``.

    The weights are never deep-copied in full precision: the structure is copied with meta placeholders and
    each layer is then written once from the training module, so the peak extra memory is the finished copy
    plus one full-precision layer.

    Args:
        module: the training policy: a diffusers / transformers / any torch model, optionally with a peft LoRA
            adapter (diffusers ``add_adapter``, or a peft ``PeftModel``). Only read.
        scheme: one of :data:`SCHEMES` (see the module docstring for format and hardware).
        skip: ``fnmatch`` patterns of module names kept unquantized (a match on an ancestor counts; a module
            with a ``quantize_roots`` attribute, a container of models, has them applied below each root too);
            :data:`DEFAULT_SKIP` covers diffusers embedders / output layers and LM ``lm_head`` / ``embed_tokens``.
        compute_dtype: activation dtype and dtype of unquantized parameters; default the dtype of ``module``'s
            first floating parameter (bf16 is the usual choice on GPU).
        blocksize: bitsandbytes 4-bit block size (64 is bitsandbytes' and QLoRA's default).
        double_quant: quantize the 4-bit absmax scales to 8 bit (QLoRA's "double quantization": scale storage
            per weight 32/64 = 0.5 bit -> 8/64 + 32/(64*256) = 0.127 bit).

    Returns:
        The :class:`QuantizedCopy`.

    Raises:
        ValueError: unknown scheme, unsupported hardware (fp8: sm90+, nvfp4: sm100+), a training module whose
            Linear weights are already quantized, an unsupported peft wrapper, or a tied parameter adapted
            under one of its names only (:func:`pipelines.lora.check_ties_not_adapted`).
        ImportError: torchao scheme without torchao.
    """
    base, skip = _base_and_patterns(module, skip)
    check_ties_not_adapted(base)
    reference = _first_float_param(base)
    check_scheme(scheme, reference.device)
    for name, sub in base.named_modules():
        if isinstance(sub, nn.Linear) and type(sub.weight) is not nn.Parameter:
            raise ValueError(
                f"layer {name!r} of the training module holds a {type(sub.weight).__name__} weight; the explorer is "
                "built from full-precision weights, so pass the float (bf16/fp32) training module"
            )
    dtype = compute_dtype or reference.dtype
    device = reference.device
    # 1. the structure with meta placeholders, LoRA folded away
    copied = _skeleton(base, dtype)
    # 2. choose the layers to quantize
    quantized, skipped = _choose_layers(copied, scheme, skip)
    # 3. allocate the unquantized parameters (one tensor per placeholder, so ties stay ties); buffers
    #    (positional tables, ...) are cast like module.to(dtype) would
    real: dict[int, nn.Parameter] = {}
    owners = []
    for name, sub in copied.named_modules():
        if sub._parameters:
            owners.append(name)
        for buffer_name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[buffer_name] = buffer.to(dtype)
        if name in quantized:
            continue
        for param_name, placeholder in sub._parameters.items():
            if placeholder is not None:
                if id(placeholder) not in real:
                    real[id(placeholder)] = nn.Parameter(
                        torch.empty_like(placeholder, device=device), requires_grad=False
                    )
                sub._parameters[param_name] = real[id(placeholder)]
    explorer = QuantizedCopy(
        module=copied.eval(),
        scheme=scheme,
        compute_dtype=dtype,
        quantized=tuple(quantized),
        skipped=tuple(skipped),
        blocksize=blocksize,
        double_quant=double_quant,
    )
    # 4. write every parameter from the training module: LoRA merged, quantized where chosen
    _write(explorer, base, owners)
    logger.info(
        "quantized copy (%s): %d Linear layers quantized, %d kept in %s; weights %.2f MB -> %.2f MB",
        scheme,
        len(quantized),
        len(skipped),
        dtype,
        weight_bytes(base) / 1e6,
        weight_bytes(explorer.module) / 1e6,
    )
    return explorer


def sync_lora(explorer: QuantizedCopy, trained: nn.Module) -> int:
    """Refresh ``explorer`` from the training module after an optimizer step, without modifying ``trained``.

    Each LoRA layer with an active, unmerged adapter is re-quantized from ``W_base + sum_a s_a B_a @ A_a``
    computed from ``trained``'s full-precision base weight (never from the explorer's quantized weight, so
    error does not build up across steps); every other module with trainable parameters (full fine-tuning,
    trainable norms) is refreshed the same way. Frozen, non-LoRA parameters are assumed unchanged since
    :func:`quantize_copy`.

    Args:
        explorer: from :func:`quantize_copy` of ``trained`` (same architecture and adapter layout).
        trained: the training module, peft-wrapped or with injected LoRA layers.

    Returns:
        Number of quantized layers rebuilt.

    Raises:
        ValueError: ``trained`` has a LoRA layer or trainable module the explorer does not have.
    """
    base, _ = unwrap_peft(trained)
    wrappers = _lora_wrappers(base)
    names = [
        name
        for name, sub in base.named_modules()
        # base_layer / lora_A / lora_B inside a LoRA wrapper are handled through the wrapper
        if not any(name.startswith(w + ".") for w in wrappers) and _needs_refresh(sub)
    ]
    return _write(explorer, base, names)


def _tensor_bytes(t: torch.Tensor, seen: set[tuple[int, int]]) -> int:
    """Bytes of ``t``'s data; a tensor subclass (torchao) counts its inner tensors; shared storage counts once."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n), seen) for n in inner if getattr(t, n) is not None)
    key = (t.data_ptr(), t.numel() * t.element_size())
    if t.is_meta or key in seen:
        return 0
    seen.add(key)
    return key[1]


def _quant_state_tensors(param: torch.Tensor, owner: nn.Module) -> list[torch.Tensor]:
    """Scales that bitsandbytes keeps beside a quantized weight rather than as parameters."""
    state = getattr(param, "quant_state", None)  # Params4bit
    if state is not None:
        tensors = [state.absmax, state.code]
        if state.nested:
            tensors += [state.state2.absmax, state.state2.code]
        return tensors
    scales = getattr(param, "SCB", None)  # Int8Params before the first forward
    if scales is None and hasattr(owner, "state"):
        scales = getattr(
            owner.state, "SCB", None
        )  # Linear8bitLt moves it to its matmul state at the first forward
    return [scales] if isinstance(scales, torch.Tensor) else []


def weight_bytes(module: nn.Module) -> int:
    """Bytes held by ``module``'s parameters, counting quantized storage as stored.

    bitsandbytes 4-bit: packed codes (``numel/2`` bytes) + absmax (fp32 per block, or uint8 per block + fp32 per
    256 blocks with double quantization) + code tables; int8: codes + fp32 row scales; torchao tensors: their
    inner data and scale tensors. Tensors sharing storage (tied weights) count once. Buffers are not weights
    and are not counted.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for owner in module.modules():
        for param in owner._parameters.values():
            if param is None:
                continue
            total += _tensor_bytes(param, seen)
            total += sum(_tensor_bytes(t, seen) for t in _quant_state_tensors(param, owner))
    return total


def quantized_bytes(
    module: nn.Module,
    scheme: Scheme,
    *,
    skip: Iterable[str] = DEFAULT_SKIP,
    compute_dtype: torch.dtype | None = None,
    blocksize: int = 64,
    double_quant: bool = True,
) -> int:
    """What :func:`weight_bytes` of ``quantize_copy(module, scheme, ...)``'s copy comes to, from shapes alone.

    Nothing is quantized or allocated, so ``module`` may live on the ``meta`` device and the scheme's library
    and hardware are not needed (memory estimates of real models: ``mmrl memory``). The same layers are chosen
    as :func:`quantize_copy` chooses; per quantized ``[out, in]`` weight of ``n = out * in`` values, plus the
    bias in ``compute_dtype``:

    * ``none``: ``n`` values of ``compute_dtype``;
    * ``int8``: ``n`` int8 codes + one fp32 scale per row;
    * ``nf4`` / ``fp4``: ``ceil(n / 2)`` packed bytes + a 16-entry fp32 code table + per block of
      ``blocksize``: an fp32 absmax, or with ``double_quant`` a uint8 absmax + one fp32 per 256 blocks + a
      256-entry fp32 code table;
    * ``fp8_weight_only`` / ``fp8``: ``n`` float8 values + one fp32 scale per row (torchao, row-wise);
    * ``nvfp4``: ``ceil(n / 2)`` packed e2m1 bytes + one e4m3 scale per 16 values + one fp32 scale per tensor.

    Every other parameter counts in ``compute_dtype`` (floats) or its own dtype, tied parameters once (a quantized
    layer's own, since quantizing one side breaks the tie), LoRA factors not at all (they are folded into the
    copy's weights). The bitsandbytes counts equal :func:`weight_bytes` of a real copy exactly (tests/quant); the
    torchao ones follow its tensor layouts.
    """
    stored_bytes = scheme_spec(scheme).stored_bytes
    options = _Options(blocksize, double_quant)
    base, skip = _base_and_patterns(module, skip)
    dtype = compute_dtype or _first_float_param(base).dtype
    copied = _skeleton(base, dtype)
    quantized, _ = _choose_layers(copied, scheme, skip)
    total = 0
    seen: set[int] = set()
    for name, sub in copied.named_modules():
        for param_name, param in sub._parameters.items():
            if param is None:
                continue
            if name in quantized:  # rebuilt as a layer of its own: a tie to another module is broken
                quantized_weight = param_name == "weight" and stored_bytes is not None
                total += (
                    stored_bytes(*param.shape, options)
                    if quantized_weight
                    else param.numel() * param.element_size()
                )
            elif id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total
