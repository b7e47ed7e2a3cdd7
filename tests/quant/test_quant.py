"""Quantized explorer copies (pipelines/quant.py): error bounds, memory, skip list, LoRA sync, policy untouched.

Tiny real models built from config with random weights: diffusers SD3 and FLUX transformers, a Qwen2 LM.
Error bounds are measured values with margin (measured on CPU, fp32, all Linear layers quantized:
maxima over the three models, all on the Qwen2 LM: int8 0.009, nf4 0.140, fp4 0.184, fp8_weight_only 0.038;
see docs/quantization.md).
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipelines.quant import (
    check_scheme,
    list_schemes,
    quantize_copy,
    quantized_bytes,
    sync_lora,
    weight_bytes,
)

try:
    import torchao  # noqa: F401

    HAS_TORCHAO = True
except ImportError:  # optional extra mmrl[torchao]
    HAS_TORCHAO = False
CPU_SCHEMES = ["none", "int8", "nf4", "fp4", "fp8_weight_only"]
#: relative output error bounds against the fp32 forward, every Linear quantized (measured maxima x 1.35 or more)
ERROR_BOUND = {"none": 1e-6, "int8": 0.03, "nf4": 0.2, "fp4": 0.25, "fp8_weight_only": 0.06}
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "proj_out"]
peft_warning = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def needs(scheme: str) -> None:
    if scheme in ("fp8_weight_only", "fp8", "nvfp4") and not HAS_TORCHAO:
        pytest.skip("torchao not installed (optional extra mmrl[torchao])")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


# ---------------------------------------------------------------------------------------------------------------
# tiny models and their inputs
# ---------------------------------------------------------------------------------------------------------------


def make_sd3() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=128,
        pooled_projection_dim=32,
        pos_embed_max_size=16,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(2, 4, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 64, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.tensor([500.0, 200.0]),
    }
    return model, inputs


def make_flux() -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    g = torch.Generator().manual_seed(1)
    # 4x4 latent tokens: ids (0, row, col); 8 text tokens with ids 0
    img_ids = torch.stack(
        torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1
    )
    inputs = {
        "hidden_states": torch.randn(2, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 32, generator=g),
        "pooled_projections": torch.randn(2, 32, generator=g),
        "timestep": torch.tensor([0.5, 0.2]),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": torch.zeros(8, 3),
    }
    return model, inputs


def make_lm(tie: bool = False) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )
    g = torch.Generator().manual_seed(1)
    return Qwen2ForCausalLM(config).eval(), {"input_ids": torch.randint(0, 256, (2, 12), generator=g)}


MODELS = {"sd3": make_sd3, "flux": make_flux, "lm": make_lm}


def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.sample


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[nn.Module, dict, torch.Tensor]]:
    models = {}
    for name, make in MODELS.items():
        model, inputs = make()
        models[name] = (model, inputs, forward(model, inputs))
    return models


def with_diffusers_lora(
    model: nn.Module, use_rslora: bool = False, r: int = 4, alpha: float = 8.0
) -> nn.Module:
    """A copy of ``model`` with a LoRA adapter whose B is non-zero (as after some training)."""
    trained = copy.deepcopy(model)
    trained.add_adapter(LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, use_rslora=use_rslora))
    perturb_lora(trained, seed=2)
    return trained


def perturb_lora(model: nn.Module, seed: int) -> None:
    """Stand-in for an optimizer step: new random LoRA factors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def merged_reference(base: nn.Module, trained: nn.Module, scaling: float) -> nn.Module:
    """``base`` with ``W + scaling * B @ A`` written into every LoRA-adapted layer of ``trained`` (fp32)."""
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for name, sub in trained.named_modules():
            if isinstance(sub, LoraLayer):
                a, b = sub.lora_A["default"].weight, sub.lora_B["default"].weight
                ref.get_submodule(name.removeprefix("base_model.model.")).weight += scaling * b @ a
    return ref


# ---------------------------------------------------------------------------------------------------------------
# schemes, hardware checks
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_scheme_lists_available(built):
    model, _, _ = built["sd3"]
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'int4'. Available: \['none'"):
        quantize_copy(model, "int4")
    assert set(list_schemes()) == {*CPU_SCHEMES, "fp8", "nvfp4"}


@pytest.mark.parametrize(
    ("scheme", "requirement"),
    [("fp8", r"compute capability >= 9\.0 \(Hopper"), ("nvfp4", r"compute capability >= 10\.0 \(Blackwell")],
)
def test_gpu_generation_schemes_raise_on_cpu(built, scheme, requirement):
    # The hardware check comes before the torchao import, so this holds with or without torchao.
    model, _, _ = built["sd3"]
    with pytest.raises(ValueError, match=f"{requirement}.*the module is on 'cpu'"):
        quantize_copy(model, scheme)


@pytest.mark.skipif(HAS_TORCHAO, reason="checks the error raised without torchao")
def test_torchao_scheme_without_torchao_says_how_to_install():
    with pytest.raises(ImportError, match=r"pip install 'mmrl\[torchao\]'"):
        check_scheme("fp8_weight_only", "cpu")


# ---------------------------------------------------------------------------------------------------------------
# output error, memory, skip list
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_output_error_bound_all_linear_quantized(built, model_name, scheme):
    needs(scheme)
    model, inputs, ref = built[model_name]
    explorer = quantize_copy(model, scheme, skip=())
    err = rel_err(forward(explorer.module, inputs), ref)
    assert err < ERROR_BOUND[scheme], f"{model_name}/{scheme}: relative error {err:.4f}"
    if scheme != "none":
        assert err > 0  # the layers really are quantized
        assert all(
            type(explorer.module.get_submodule(n).weight) is not nn.Parameter for n in explorer.quantized
        )


@pytest.mark.parametrize("model_name", ["sd3", "flux"])
def test_default_skip_list_lowers_error(built, model_name):
    # The embedders condition every block through AdaLN; quantizing them costs most of the error
    # (measured nf4: SD3 0.0055 vs 0.0945, FLUX 0.0086 vs 0.1045).
    model, inputs, ref = built[model_name]
    err_default = rel_err(forward(quantize_copy(model, "nf4").module, inputs), ref)
    err_all = rel_err(forward(quantize_copy(model, "nf4", skip=()).module, inputs), ref)
    assert err_default < 0.5 * err_all


def test_compute_dtype_bf16(built):
    model, inputs, ref = built["sd3"]
    explorer = quantize_copy(model, "nf4", compute_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for n, p in explorer.module.named_parameters() if "proj_out" in n)
    inputs = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
    out = forward(explorer.module, inputs)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.05


def test_nf4_weight_memory_ratio(built):
    # SD3 with its Linear layers dominating (1.09 M params): nf4 with the default skip list.
    model, _, _ = built["sd3"]
    explorer = quantize_copy(model, "nf4")
    assert weight_bytes(model) == 4 * sum(p.numel() for p in model.parameters())
    assert weight_bytes(model) / weight_bytes(explorer.module) >= 3.5


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("scheme", ["nf4", "fp4"])
def test_weight_bytes_counts_4bit_storage(scheme, double_quant):
    n_out, n_in, block = 128, 256, 64
    q = quantize_copy(nn.Linear(n_in, n_out), scheme, double_quant=double_quant).module
    blocks = n_out * n_in // block
    codes = n_out * n_in // 2  # two 4-bit codes per byte
    code_table = 16 * 4  # the 16 fp32 levels of nf4 / fp4
    # double quantization: uint8 absmax per block + fp32 absmax per 256 blocks + the 256-entry fp32 code table
    scales = blocks + 4 * math.ceil(blocks / 256) + 256 * 4 if double_quant else 4 * blocks
    assert weight_bytes(q) == codes + scales + code_table + 4 * n_out


@pytest.mark.parametrize("scheme", ["int8", "fp8_weight_only"])
def test_weight_bytes_counts_8bit_storage(scheme):
    needs(scheme)
    n_out, n_in = 128, 256
    q = quantize_copy(nn.Linear(n_in, n_out), scheme).module
    expected = n_out * n_in + 4 * n_out + 4 * n_out  # codes + fp32 scale per row + fp32 bias
    assert weight_bytes(q) == expected
    with torch.no_grad():
        q(torch.randn(3, n_in))  # bitsandbytes moves its scales into the matmul state here
    assert weight_bytes(q) == expected


SD3_SKIPPED = {
    "time_text_embed.timestep_embedder.linear_1",
    "time_text_embed.timestep_embedder.linear_2",
    "time_text_embed.text_embedder.linear_1",
    "time_text_embed.text_embedder.linear_2",
    "context_embedder",
    "norm_out.linear",
    "proj_out",
}


def test_skip_list_respected(built):
    sd3 = quantize_copy(built["sd3"][0], "nf4")
    flux = quantize_copy(built["flux"][0], "nf4")
    lm = quantize_copy(built["lm"][0], "nf4")
    assert set(sd3.skipped) == SD3_SKIPPED
    assert set(flux.skipped) == (SD3_SKIPPED - {"proj_out"}) | {"x_embedder", "proj_out"}
    assert lm.skipped == ("lm_head",)
    for explorer in (sd3, flux, lm):
        for name in explorer.skipped:
            layer = explorer.module.get_submodule(name)
            assert type(layer) is nn.Linear and layer.weight.dtype == torch.float32
        assert explorer.quantized and not set(explorer.quantized) & set(explorer.skipped)
    # unanchored patterns match top-level names only: FLUX's per-block proj_out layers are quantized
    assert "single_transformer_blocks.0.proj_out" in flux.quantized
    assert type(lm.module.get_submodule("model.embed_tokens")) is nn.Embedding
    # a pattern matching a parent skips its whole subtree
    custom = quantize_copy(built["sd3"][0], "int8", skip=("transformer_blocks.0",))
    assert all(n.startswith("transformer_blocks.0.") for n in custom.skipped)
    assert not any(n.startswith("transformer_blocks.0.") for n in custom.quantized)
    with pytest.raises(ValueError, match=r"write skip=\('proj_out',\)"):
        quantize_copy(built["sd3"][0], "int8", skip="proj_out")


def test_tied_weights_stay_tied():
    model, _ = make_lm(tie=True)
    explorer = quantize_copy(model, "nf4").module
    assert explorer.lm_head.weight is explorer.model.embed_tokens.weight
    assert weight_bytes(explorer) < weight_bytes(model)


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_quantizing_one_side_of_a_tie_counts_both(scheme):
    """With the default skip list a tied lm_head stays with its embedding; quantized (no skip), it becomes a
    layer of its own beside the full-precision embedding, and the estimate counts both, as the copy holds them."""
    needs(scheme)
    model, _ = make_lm(tie=True)
    copied = quantize_copy(model, scheme, skip=()).module
    assert copied.lm_head.weight is not copied.model.embed_tokens.weight
    assert quantized_bytes(model, scheme, skip=()) == weight_bytes(copied)


@pytest.mark.parametrize(
    ("lora", "adapted"),
    [
        ({"target_modules": ["lm_head"]}, "lm_head.base_layer.weight"),
        ({"target_modules": ["embed_tokens"]}, "model.embed_tokens.base_layer.weight"),
        ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "lm_head.original_module.weight"),
    ],
)
def test_a_tie_adapted_on_one_side_is_refused(lora, adapted):
    """Tied embeddings with an adapter on one side: the trained model computes with ``W`` under one name and an
    adapted matrix under the other, which a copy that keeps the tie cannot hold (before, the head's merged weight
    was written into the shared tensor, and the copy's embeddings were the head's). Refused, naming the names;
    the same adapter away from the tie is fine."""
    from pipelines.vlm.weight_sync import merged_state_dict

    model, _ = make_lm(tie=True)
    trained = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, **lora))
    with pytest.raises(ValueError, match=re.escape(adapted)):
        quantize_copy(trained, "none")
    with pytest.raises(ValueError, match=re.escape(adapted)):
        next(merged_state_dict(trained))
    untied, _ = make_lm(tie=False)
    assert "lm_head.weight" in dict(merged_state_dict(get_peft_model(untied, LoraConfig(r=4, **lora))))
    quantize_copy(get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"])), "none")


# ---------------------------------------------------------------------------------------------------------------
# LoRA merge and sync
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["sd3", "flux"])
def test_none_scheme_matches_unmerged_diffusers_lora_forward(built, model_name):
    model, inputs, _ = built[model_name]
    trained = with_diffusers_lora(model)
    explorer = quantize_copy(trained, "none")
    peft_out = forward(trained, inputs)
    assert rel_err(peft_out, forward(model, inputs)) > 0.05  # the adapter changes the output
    torch.testing.assert_close(forward(explorer.module, inputs), peft_out, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(m, LoraLayer) for m in explorer.module.modules())
    assert not getattr(explorer.module, "_hf_peft_config_loaded", False)


@peft_warning
def test_none_scheme_matches_unmerged_peft_lm_forward(built):
    model, inputs, _ = built["lm"]
    trained = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    perturb_lora(trained, seed=3)
    explorer = quantize_copy(trained, "none")
    assert type(explorer.module) is Qwen2ForCausalLM
    torch.testing.assert_close(
        forward(explorer.module, inputs), forward(trained, inputs), rtol=1e-5, atol=1e-5
    )
    perturb_lora(trained, seed=4)
    assert sync_lora(explorer, trained) == 4  # q_proj and v_proj of 2 layers
    torch.testing.assert_close(
        forward(explorer.module, inputs), forward(trained, inputs), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merge_formula(built, use_rslora):
    model, _, _ = built["sd3"]
    r, alpha = 4, 8.0
    trained = with_diffusers_lora(model, use_rslora=use_rslora, r=r, alpha=alpha)
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r  # rsLoRA, arXiv 2312.03732
    explorer = quantize_copy(trained, "none").module
    reference = merged_reference(model, trained, scaling)
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_out.0", "proj_out"):
        torch.testing.assert_close(explorer.get_submodule(name).weight, reference.get_submodule(name).weight)


@pytest.mark.parametrize(("scheme", "tol"), [("int8", 0.03), ("nf4", 0.2)])
def test_sync_matches_merged_reference(built, scheme, tol):
    model, inputs, _ = built["sd3"]
    trained = with_diffusers_lora(model)
    explorer = quantize_copy(trained, scheme)
    perturb_lora(trained, seed=5)  # an optimizer step
    rebuilt = explorer.sync(trained)
    lora_layers = {n for n, m in trained.named_modules() if isinstance(m, LoraLayer)}
    assert rebuilt == len(lora_layers & set(explorer.quantized)) > 0
    # an adapted layer on the skip list: merged and copied, not quantized
    assert "proj_out" in lora_layers - set(explorer.quantized)

    reference = merged_reference(model, trained, scaling=8.0 / 4)
    ref_out = forward(reference, inputs)
    out = forward(explorer.module, inputs)
    assert rel_err(out, ref_out) < tol
    # the same as quantizing the merged fp32 model directly: the merge adds no error of its own
    direct = forward(quantize_copy(reference, scheme).module, inputs)
    assert rel_err(out, direct) < 1e-3
    # the skipped layer holds the exact merge
    torch.testing.assert_close(explorer.module.proj_out.weight, reference.proj_out.weight)


def storages(module: nn.Module) -> set[int]:
    """Storage addresses of a module's parameters (the inner tensors of torchao tensor subclasses)."""
    out = set()
    for p in module.parameters():
        if is_traceable_wrapper_subclass(p):
            out |= {getattr(p, n).untyped_storage().data_ptr() for n in p.__tensor_flatten__()[0]}
        else:
            out.add(p.untyped_storage().data_ptr())
    return out


def quantized_state(explorer) -> dict[str, torch.Tensor]:
    out = {}
    for name in explorer.quantized:
        weight = explorer.module.get_submodule(name).weight
        out[name] = weight.detach().clone()
        out[name + ".absmax"] = weight.quant_state.absmax.clone()
    return out


def test_sync_never_accumulates_error(built):
    model, _, _ = built["sd3"]
    trained = with_diffusers_lora(model)
    explorer = quantize_copy(trained, "nf4")
    first = quantized_state(explorer)
    for _ in range(3):
        explorer.sync(trained)
    perturb_lora(trained, seed=6)
    explorer.sync(trained)
    assert any(not torch.equal(first[k], v) for k, v in quantized_state(explorer).items())
    perturb_lora(trained, seed=2)  # back to the factors of the first build
    explorer.sync(trained)
    # re-quantized from the full-precision base each time: bit-identical to the first quantization
    for key, value in quantized_state(explorer).items():
        assert torch.equal(first[key], value), key


@peft_warning
@pytest.mark.parametrize("scheme", ["none", "int8", "nf4", "fp8_weight_only"])
def test_training_module_never_modified(built, scheme):
    needs(scheme)
    model, inputs, _ = built["sd3"]
    trained = with_diffusers_lora(model)
    trained.train()
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in trained.named_parameters()}
    explorer = quantize_copy(trained, scheme)
    forward(explorer.module, inputs)
    explorer.sync(trained)
    after = dict(trained.named_parameters())
    assert after.keys() == before.keys()
    for name, (value, requires_grad) in before.items():
        assert torch.equal(after[name], value) and after[name].requires_grad == requires_grad, name
    assert trained.training and not explorer.module.training
    # no storage shared with the policy
    assert not storages(trained) & storages(explorer.module)
    assert not any(p.requires_grad for p in explorer.module.parameters())


def test_full_finetune_sync_refreshes_trainable_layers(built):
    model, inputs, _ = built["sd3"]
    trained = copy.deepcopy(model)
    trained.requires_grad_(False)
    explorer = quantize_copy(trained, "nf4")
    assert explorer.sync(trained) == 0  # nothing trainable, nothing to refresh
    block = trained.transformer_blocks[1]
    block.requires_grad_(True)
    with torch.no_grad():  # stand-in for an optimizer step on the trainable block
        for p in block.parameters():
            p.add_(0.02 * torch.randn_like(p))
    assert explorer.sync(trained) == sum(type(m) is nn.Linear for m in block.modules())
    torch.testing.assert_close(
        forward(explorer.module, inputs), forward(quantize_copy(trained, "nf4").module, inputs)
    )


def test_dora_is_rejected(built):
    trained = copy.deepcopy(built["sd3"][0])
    trained.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], use_dora=True))
    with pytest.raises(ValueError, match="LoRA variant"):
        quantize_copy(trained, "nf4")


# ---------------------------------------------------------------------------------------------------------------
# GPU paths (skipped without CUDA)
# ---------------------------------------------------------------------------------------------------------------


@peft_warning
@pytest.mark.parametrize("scheme", CPU_SCHEMES)
@pytest.mark.parametrize("model_name", list(MODELS))
def test_quantized_bytes_equals_the_copy_and_needs_no_weights(built, model_name, scheme):
    """The memory estimate's count from shapes alone: the bytes of the real copy, for a LoRA-adapted model
    (factors folded away), either 4-bit scale layout, bf16 compute, and the same model on the meta device."""
    needs(scheme)
    model = built[model_name][0]
    trained = (
        get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"]))
        if model_name == "lm"
        else with_diffusers_lora(model)
    )
    for double_quant in (True, False):
        for dtype in (None, torch.bfloat16):
            kwargs = {"double_quant": double_quant, "compute_dtype": dtype}
            real = weight_bytes(quantize_copy(trained, scheme, **kwargs).module)
            assert quantized_bytes(trained, scheme, **kwargs) == real
            assert quantized_bytes(copy.deepcopy(trained).to("meta"), scheme, **kwargs) == real


def test_quantized_bytes_of_the_gpu_formats():
    """fp8: a byte per value + an fp32 scale per row; nvfp4: half a byte per value + an e4m3 scale per 16 values
    + an fp32 scale per tensor (checked against real torchao copies by the GPU test below)."""
    layer = nn.Linear(64, 32, bias=True, device="meta", dtype=torch.bfloat16)
    bias = 32 * 2
    assert quantized_bytes(layer, "fp8", skip=()) == 32 * 64 + 32 * 4 + bias
    assert quantized_bytes(layer, "fp8_weight_only", skip=()) == 32 * 64 + 32 * 4 + bias
    assert quantized_bytes(layer, "nvfp4", skip=()) == 32 * 64 // 2 + 32 * 64 // 16 + 4 + bias
    assert quantized_bytes(layer, "none", skip=()) == 32 * 64 * 2 + bias
    with pytest.raises(ValueError, match="unknown quantization scheme 'fp6'"):
        quantized_bytes(layer, "fp6")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "nf4", "fp4", "fp8", "nvfp4"])
def test_gpu_schemes_bf16(built, scheme):
    needs(scheme)
    minimum = {"fp8": (9, 0), "nvfp4": (10, 0)}.get(scheme, (0, 0))
    if torch.cuda.get_device_capability() < minimum:
        pytest.skip(f"{scheme} needs compute capability {minimum}")
    model, inputs, _ = built["sd3"]
    trained = with_diffusers_lora(model).to("cuda", torch.bfloat16)
    explorer = quantize_copy(trained, scheme)
    assert explorer.compute_dtype == torch.bfloat16
    inputs = {k: v.to("cuda", torch.bfloat16) for k, v in inputs.items()}
    perturb_lora(trained, seed=7)
    explorer.sync(trained)
    # last use of `trained`: moved back to CPU fp32 (in place) to build the fp32-merged reference
    reference = merged_reference(model, trained.float().cpu(), scaling=2.0).to("cuda", torch.bfloat16)
    bound = 0.05 if scheme == "int8" else 0.25
    assert rel_err(forward(explorer.module, inputs), forward(reference, inputs)) < bound
    assert quantized_bytes(trained, scheme, compute_dtype=torch.bfloat16) == weight_bytes(explorer.module)
