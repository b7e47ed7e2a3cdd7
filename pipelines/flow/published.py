"""The published component configurations of the real flow models mmrl's recipes use, and a builder that
instantiates them on PyTorch's ``meta`` device.

What it is for: a recipe under ``configs/flow/`` names a Hugging Face pipeline (``model.path``) whose weights
are tens of gigabytes. Built on ``meta``, every component of that pipeline has its real classes, parameter
shapes and dtypes and allocates nothing, so memory estimates (weights, gradients, optimizer state, LoRA) and
real-size smoke tests (shapes, wiring, module names for LoRA targets) run without a download and without a
GPU. ``component_configs`` answers for a local diffusers directory (read from disk), a repository embedded
here (no network) or any other hub id (only ``model_index.json`` and the components' ``config.json`` are
fetched).

Sources. Each embedded dict holds the values of the component's published ``config.json``, limited to the keys
the installed class (diffusers) or configuration class (transformers) accepts; bookkeeping keys
(``_diffusers_version``, ``architectures``, ``torch_dtype``...) are left out, and an absent key means the
class default equals the published value. The values were checked against public copies found by exact-string
search over GitHub code (loaders that embed a repository's configs to run offline, conversion scripts, tests);
the search shows excerpts, mostly without the repository's name, so the copies are described, not named:

* ``stabilityai/stable-diffusion-3.5-medium``: transformer against two independent loader copies of
  ``transformer/config.json`` (24 layers, 24x64 heads, ``dual_attention_layers`` 0-12, ``qk_norm`` rms_norm,
  ``pos_embed_max_size`` 384); VAE against a loader's copy (16 latent channels, no quant convs, scaling
  1.5305, shift 0.0609). CLIP-L/14 and OpenCLIP bigG/14 (with projection) against ``openai/clip-vit-large-
  patch14`` and SDXL ``text_encoder_2`` copies (the SD3 family ships the same towers); T5 = ``google/t5-v1_1-
  xxl`` (copies embedded in FLUX loaders).
* ``black-forest-labs/FLUX.1-dev``: transformer against several copies of ``transformer/config.json`` (19
  double + 38 single blocks, 24x128 heads, guidance embedding); VAE against copies of ``vae/config.json``
  (scaling 0.3611, shift 0.1159); CLIP-L and T5-XXL as above.
* ``black-forest-labs/FLUX.2-dev`` and ``black-forest-labs/FLUX.2-klein-9B``: transformers against
  ``huggingface/diffusers`` ``scripts/convert_flux2_to_diffusers.py`` (``flux2-dev``: 8 + 48 blocks, 48x128
  heads, joint dim 15360; ``klein-9b``: 8 + 24 blocks, 32x128 heads, joint dim 12288, no guidance embedding);
  VAE (``AutoencoderKLFlux2``: 32 latent channels, 2x2 patch, batch-norm statistics) against copies of
  ``vae/config.json``; text encoders Mistral-Small-3.2-24B-Instruct-2506 (the id that script loads) and
  Qwen3-8B against a FLUX.2 architecture reference quoting both ``config.json`` files.
* ``Qwen/Qwen-Image``: transformer against copies of ``transformer/config.json`` (60 layers, 24x128 heads,
  joint dim 3584); VAE (``AutoencoderKLQwenImage`` with its latent statistics) against copies of
  ``vae/config.json``; text encoder = Qwen2.5-VL-7B-Instruct's ``config.json`` (two copies).
* ``Tongyi-MAI/Z-Image-Turbo``: transformer, text encoder (Qwen3-4B) and VAE (FLUX.1's) against several
  copies quoting the repository's configs (``dim`` 3840, 30 layers, 2 refiner layers, ``axes_lens``
  1536/512/512, which differs from the class default 1024).
* ``Efficient-Large-Model/Sana_1600M_1024px_diffusers``: transformer against ``huggingface/diffusers``
  ``scripts/convert_sana_to_diffusers.py`` (``SanaMS_1600M_P1_D20`` at 1024 px: 20 layers, 70x32
  linear-attention heads, 20x112 cross-attention heads, ``sample_size`` 32, no q/k norm, which only SANA 1.5
  and Sprint add); DC-AE (``dc-ae-f32c32-sana-1.0``) against a pinned copy of the pipeline's VAE config; text
  encoder = Gemma-2-2B-it as ``Gemma2Model``, against Gemma-2 2B configs (PaliGemma-2 conversion, engines).
* ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` and ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``: transformers against
  Hugging Face's Wan conversion presets (``Wan-T2V-1.3B``: 30 layers, 12x128 heads, FFN 8960;
  ``Wan2.2-T2V-A14B``: 40 layers, 40x128 heads, FFN 13824, both experts alike) and the original Wan configs;
  UMT5-XXL encoder (vocabulary 256384) and ``AutoencoderKLWan`` against several copies.

Published sizes of the denoisers, and what the built modules count (unique parameters, see
tests/flow_pipelines/test_published.py, which checks every component against its figure):

===========================  ==============================  =================================================
model                        published                       built here
===========================  ==============================  =================================================
SD3.5 medium MMDiT-X         2.5 B (model card)              2.243 B + 0.226 B positional table (a buffer)
FLUX.1 [dev]                 12 B (model card), 11.9 B       11.901 B
FLUX.2 [dev]                 32 B (model card)               32.223 B
FLUX.2 [klein] 9B            9 B (model card)                9.079 B
Qwen-Image                   20 B (model card), 20.43 B      20.430 B
Z-Image-Turbo                6 B (model card), 6.15 B        6.155 B
SANA 1600M                   1.6 B (model name, paper)       1.604 B
Wan2.1 T2V 1.3B              1.3 B (model name, nominal)     1.419 B (released weights: 5.68 GB, float32)
Wan2.2 T2V A14B              14 B per expert (nominal)       14.288 B per expert, 28.577 B for both
===========================  ==============================  =================================================
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from pipelines.hub import model_not_found

Library = Literal["diffusers", "transformers"]


@dataclass(frozen=True)
class Component:
    """One model of a diffusers pipeline: where its class lives, the class, and its ``config.json`` as a dict.

    ``config`` holds the keys the class (diffusers) or its configuration class (transformers) accepts.
    """

    library: Library
    class_name: str
    config: dict


# --------------------------------------------------------------------------------------------------------------
# Text encoders shared by several pipelines
# --------------------------------------------------------------------------------------------------------------

# openai/clip-vit-large-patch14 text tower (SD3's text_encoder, FLUX.1's text_encoder): 123 M parameters
_CLIP_L = {
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "quick_gelu",
    "hidden_size": 768,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "projection_dim": 768,
    "vocab_size": 49408,
}

# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text tower with projection (SD3's text_encoder_2): 695 M parameters
_CLIP_G = {
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "dropout": 0.0,
    "eos_token_id": 2,
    "hidden_act": "gelu",
    "hidden_size": 1280,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 77,
    "num_attention_heads": 20,
    "num_hidden_layers": 32,
    "pad_token_id": 1,
    "projection_dim": 1280,
    "vocab_size": 49408,
}

# google/t5-v1_1-xxl, encoder only (SD3's text_encoder_3, FLUX.1's text_encoder_2): 4.76 B parameters
_T5_XXL = {
    "classifier_dropout": 0.0,
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}

# google/umt5-xxl, encoder only (Wan's text_encoder): 5.68 B parameters (each layer has its own position bias);
# T5 v1.1 XXL's published config but for these two values
_UMT5_XXL = {**_T5_XXL, "scalable_attention": True, "vocab_size": 256384}

# Qwen/Qwen2.5-VL-7B-Instruct (Qwen-Image's text_encoder, vision tower included): 8.29 B parameters
_QWEN25_VL_7B = {
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}

# Qwen/Qwen3-4B (Z-Image's text_encoder, loaded as Qwen3Model: no LM head, which is tied anyway): 4.02 B
_QWEN3_4B = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen/Qwen3-8B (FLUX.2 [klein] 9B's text_encoder, Qwen3ForCausalLM): 8.19 B parameters
_QWEN3_8B = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# mistralai/Mistral-Small-3.2-24B-Instruct-2506 (FLUX.2 [dev]'s text_encoder, Pixtral vision tower included):
# 24.0 B parameters
_MISTRAL_SMALL_3_2 = {
    "image_token_index": 10,
    # the checkpoint has its own lm_head (text_config says untied); transformers 5 reads the top-level flag,
    # whose default (True) would tie it and drop 671 M parameters
    "tie_word_embeddings": False,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "text_config": {
        "model_type": "mistral",
        "attention_dropout": 0.0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 131072,
    },
    "vision_config": {
        "model_type": "pixtral",
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
}

# google/gemma-2-2b-it as SANA ships it (Gemma2Model: the decoder without the tied LM head): 2.61 B parameters
_GEMMA2_2B = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}

# --------------------------------------------------------------------------------------------------------------
# Autoencoders shared by several pipelines
# --------------------------------------------------------------------------------------------------------------

_DOWN4 = ["DownEncoderBlock2D"] * 4
_UP4 = ["UpDecoderBlock2D"] * 4

# FLUX.1's 16-channel VAE (Z-Image ships the same): 83.8 M parameters
_FLUX1_VAE = {
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": _DOWN4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "up_block_types": _UP4,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}

# Wan2.1's causal 3-D VAE (Wan2.1 and Wan2.2 A14B); Qwen-Image's AutoencoderKLQwenImage has the same values
_WAN_LATENTS_MEAN = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
]  # fmt: skip
_WAN_LATENTS_STD = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
]  # fmt: skip
_WAN_VAE = {
    "attn_scales": [],
    "base_dim": 96,
    "dim_mult": [1, 2, 4, 4],
    "dropout": 0.0,
    "latents_mean": _WAN_LATENTS_MEAN,
    "latents_std": _WAN_LATENTS_STD,
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
    "z_dim": 16,
}

# --------------------------------------------------------------------------------------------------------------
# The pipelines
# --------------------------------------------------------------------------------------------------------------

_SD35_MEDIUM = {
    "transformer": Component(
        "diffusers",
        "SD3Transformer2DModel",
        {
            "attention_head_dim": 64,
            "caption_projection_dim": 1536,
            "dual_attention_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
            "in_channels": 16,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 24,
            "out_channels": 16,
            "patch_size": 2,
            "pooled_projection_dim": 2048,
            "pos_embed_max_size": 384,
            "qk_norm": "rms_norm",
            "sample_size": 128,
        },
    ),
    "text_encoder": Component("transformers", "CLIPTextModelWithProjection", _CLIP_L),
    "text_encoder_2": Component("transformers", "CLIPTextModelWithProjection", _CLIP_G),
    "text_encoder_3": Component("transformers", "T5EncoderModel", _T5_XXL),
    "vae": Component(
        "diffusers",
        "AutoencoderKL",
        {
            "act_fn": "silu",
            "block_out_channels": [128, 256, 512, 512],
            "down_block_types": _DOWN4,
            "force_upcast": True,
            "in_channels": 3,
            "latent_channels": 16,
            "latents_mean": None,
            "latents_std": None,
            "layers_per_block": 2,
            "mid_block_add_attention": True,
            "norm_num_groups": 32,
            "out_channels": 3,
            "sample_size": 1024,
            "scaling_factor": 1.5305,
            "shift_factor": 0.0609,
            "up_block_types": _UP4,
            "use_post_quant_conv": False,
            "use_quant_conv": False,
        },
    ),
}

_FLUX1_DEV = {
    "transformer": Component(
        "diffusers",
        "FluxTransformer2DModel",
        {
            "attention_head_dim": 128,
            "guidance_embeds": True,
            "in_channels": 64,
            "joint_attention_dim": 4096,
            "num_attention_heads": 24,
            "num_layers": 19,
            "num_single_layers": 38,
            "patch_size": 1,
            "pooled_projection_dim": 768,
        },
    ),
    "text_encoder": Component("transformers", "CLIPTextModel", _CLIP_L),
    "text_encoder_2": Component("transformers", "T5EncoderModel", _T5_XXL),
    "vae": Component("diffusers", "AutoencoderKL", _FLUX1_VAE),
}

# FLUX.2's VAE (FLUX.2 [dev] and [klein] ship the same; the published "force_upcast" is not an argument of the
# installed AutoencoderKLFlux2): 84.0 M parameters
_FLUX2_VAE = {
    "act_fn": "silu",
    "batch_norm_eps": 0.0001,
    "batch_norm_momentum": 0.1,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": _DOWN4,
    "in_channels": 3,
    "latent_channels": 32,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "patch_size": [2, 2],
    "sample_size": 1024,
    "up_block_types": _UP4,
    "use_post_quant_conv": True,
    "use_quant_conv": True,
}

_FLUX2_DEV = {
    "transformer": Component(
        "diffusers",
        "Flux2Transformer2DModel",
        {
            "attention_head_dim": 128,
            "axes_dims_rope": [32, 32, 32, 32],
            "eps": 1e-06,
            "guidance_embeds": True,
            "in_channels": 128,
            "joint_attention_dim": 15360,
            "mlp_ratio": 3.0,
            "num_attention_heads": 48,
            "num_layers": 8,
            "num_single_layers": 48,
            "out_channels": None,
            "patch_size": 1,
            "rope_theta": 2000,
            "timestep_guidance_channels": 256,
        },
    ),
    "text_encoder": Component("transformers", "Mistral3ForConditionalGeneration", _MISTRAL_SMALL_3_2),
    "vae": Component("diffusers", "AutoencoderKLFlux2", _FLUX2_VAE),
}

_FLUX2_KLEIN_9B = {
    "transformer": Component(
        "diffusers",
        "Flux2Transformer2DModel",
        {
            "attention_head_dim": 128,
            "axes_dims_rope": [32, 32, 32, 32],
            "eps": 1e-06,
            "guidance_embeds": False,
            "in_channels": 128,
            "joint_attention_dim": 12288,
            "mlp_ratio": 3.0,
            "num_attention_heads": 32,
            "num_layers": 8,
            "num_single_layers": 24,
            "out_channels": None,
            "patch_size": 1,
            "rope_theta": 2000,
            "timestep_guidance_channels": 256,
        },
    ),
    "text_encoder": Component("transformers", "Qwen3ForCausalLM", _QWEN3_8B),
    "vae": Component("diffusers", "AutoencoderKLFlux2", _FLUX2_VAE),
}

_QWEN_IMAGE = {
    "transformer": Component(
        "diffusers",
        "QwenImageTransformer2DModel",
        {
            "attention_head_dim": 128,
            "axes_dims_rope": [16, 56, 56],
            "guidance_embeds": False,
            "in_channels": 64,
            "joint_attention_dim": 3584,
            "num_attention_heads": 24,
            "num_layers": 60,
            "out_channels": 16,
            "patch_size": 2,
        },
    ),
    "text_encoder": Component("transformers", "Qwen2_5_VLForConditionalGeneration", _QWEN25_VL_7B),
    "vae": Component("diffusers", "AutoencoderKLQwenImage", _WAN_VAE),
}

_Z_IMAGE_TURBO = {
    "transformer": Component(
        "diffusers",
        "ZImageTransformer2DModel",
        {
            "all_f_patch_size": [1],
            "all_patch_size": [2],
            "axes_dims": [32, 48, 48],
            "axes_lens": [1536, 512, 512],
            "cap_feat_dim": 2560,
            "dim": 3840,
            "in_channels": 16,
            "n_heads": 30,
            "n_kv_heads": 30,
            "n_layers": 30,
            "n_refiner_layers": 2,
            "norm_eps": 1e-05,
            "qk_norm": True,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
        },
    ),
    "text_encoder": Component("transformers", "Qwen3Model", _QWEN3_4B),
    "vae": Component("diffusers", "AutoencoderKL", _FLUX1_VAE),
}

_SANA_1600M_1024 = {
    "transformer": Component(
        "diffusers",
        "SanaTransformer2DModel",
        {
            "attention_bias": False,
            "attention_head_dim": 32,
            "caption_channels": 2304,
            "cross_attention_dim": 2240,
            "cross_attention_head_dim": 112,
            "dropout": 0.0,
            "in_channels": 32,
            "interpolation_scale": None,
            "mlp_ratio": 2.5,
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "num_attention_heads": 70,
            "num_cross_attention_heads": 20,
            "num_layers": 20,
            "out_channels": 32,
            "patch_size": 1,
            "sample_size": 32,
        },
    ),
    "text_encoder": Component("transformers", "Gemma2Model", _GEMMA2_2B),
    "vae": Component(
        "diffusers",
        "AutoencoderDC",
        {
            "attention_head_dim": 32,
            "decoder_act_fns": "silu",
            "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
            "decoder_block_types": [
                "ResBlock",
                "ResBlock",
                "ResBlock",
                "EfficientViTBlock",
                "EfficientViTBlock",
                "EfficientViTBlock",
            ],
            "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
            "decoder_norm_types": "rms_norm",
            "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
            "downsample_block_type": "Conv",
            "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
            "encoder_block_types": [
                "ResBlock",
                "ResBlock",
                "ResBlock",
                "EfficientViTBlock",
                "EfficientViTBlock",
                "EfficientViTBlock",
            ],
            "encoder_layers_per_block": [2, 2, 2, 3, 3, 3],
            "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
            "in_channels": 3,
            "latent_channels": 32,
            "scaling_factor": 0.41407,
            "upsample_block_type": "interpolate",
        },
    ),
}


def _wan_expert(num_attention_heads: int, ffn_dim: int, num_layers: int) -> Component:
    """A Wan text-to-video DiT config (every published key; Wan2.1 and Wan2.2 differ only in these three)."""
    return Component(
        "diffusers",
        "WanTransformer3DModel",
        {
            "added_kv_proj_dim": None,
            "attention_head_dim": 128,
            "cross_attn_norm": True,
            "eps": 1e-06,
            "ffn_dim": ffn_dim,
            "freq_dim": 256,
            "image_dim": None,
            "in_channels": 16,
            "num_attention_heads": num_attention_heads,
            "num_layers": num_layers,
            "out_channels": 16,
            "patch_size": [1, 2, 2],
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 1024,
            "text_dim": 4096,
        },
    )


_WAN21_T2V_1P3B = {
    "transformer": _wan_expert(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "text_encoder": Component("transformers", "UMT5EncoderModel", _UMT5_XXL),
    "vae": Component("diffusers", "AutoencoderKLWan", _WAN_VAE),
}

_WAN22_T2V_A14B = {
    # the high-noise expert (sigma above the pipeline's boundary_ratio 0.875) and the low-noise expert
    "transformer": _wan_expert(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "transformer_2": _wan_expert(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "text_encoder": Component("transformers", "UMT5EncoderModel", _UMT5_XXL),
    "vae": Component("diffusers", "AutoencoderKLWan", _WAN_VAE),
}

#: ``{hub id: {model_index component name: Component}}`` for every ``model.path`` of ``configs/flow/*.yaml``
PUBLISHED: dict[str, dict[str, Component]] = {
    "stabilityai/stable-diffusion-3.5-medium": _SD35_MEDIUM,
    "black-forest-labs/FLUX.1-dev": _FLUX1_DEV,
    "black-forest-labs/FLUX.2-dev": _FLUX2_DEV,
    "black-forest-labs/FLUX.2-klein-9B": _FLUX2_KLEIN_9B,
    "Qwen/Qwen-Image": _QWEN_IMAGE,
    "Tongyi-MAI/Z-Image-Turbo": _Z_IMAGE_TURBO,
    "Efficient-Large-Model/Sana_1600M_1024px_diffusers": _SANA_1600M_1024,
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": _WAN21_T2V_1P3B,
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": _WAN22_T2V_A14B,
}


# --------------------------------------------------------------------------------------------------------------
# Reading configs
# --------------------------------------------------------------------------------------------------------------


def _model_class(library: str, class_name: str) -> type[torch.nn.Module] | None:
    """The class ``library.class_name`` if it is a model (holds parameters), else ``None`` (tokenizers,
    schedulers, processors, or a name the installed library does not have)."""
    if library == "diffusers":
        import diffusers

        cls = getattr(diffusers, class_name, None)
        base = diffusers.ModelMixin
    elif library == "transformers":
        import transformers

        cls = getattr(transformers, class_name, None)
        base = transformers.PreTrainedModel
    else:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, base) else None


def _model_entries(index: dict) -> dict[str, tuple[Library, str]]:
    """``{component name: (library, class name)}`` of the models in a ``model_index.json`` (entries that are
    absent, ``[null, null]``, or not models are skipped)."""
    entries = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list | tuple) or len(entry) != 2:
            continue
        library, class_name = entry
        if library is None or class_name is None or _model_class(library, class_name) is None:
            continue
        entries[name] = (library, class_name)
    return entries


def _read_json(path: Path | str) -> dict:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def component_configs(model_id_or_path: str) -> dict[str, Component]:
    """The model components of a diffusers pipeline, ``{model_index name: Component}``, without weights.

    Looked up in this order: a local pipeline directory (its ``model_index.json`` and each model's
    ``config.json``); a repository embedded in :data:`PUBLISHED` (no network); any other hub id (only
    ``model_index.json`` and the models' ``config.json`` are downloaded, with ``huggingface_hub``).
    Tokenizers, schedulers, processors and components saved as absent (``[null, null]``) are not models and
    are left out.

    Args:
        model_id_or_path: a local directory or a Hugging Face repository id.

    Returns:
        a fresh dict (the caller may modify the configs); components in ``model_index.json`` order for local
        and downloaded pipelines.

    Raises:
        OSError: neither a local directory nor a repository the Hub could supply (``pipelines.hub``'s message,
            naming the id and both places looked at).
    """
    local = Path(model_id_or_path)
    if local.is_dir():
        entries = _model_entries(_read_json(local / "model_index.json"))
        return {
            name: Component(library, class_name, _read_json(local / name / "config.json"))
            for name, (library, class_name) in entries.items()
        }
    if model_id_or_path in PUBLISHED:
        # deep copies: the embedded dicts (some shared between pipelines) must never change
        return copy.deepcopy(PUBLISHED[model_id_or_path])
    from huggingface_hub import hf_hub_download

    try:
        entries = _model_entries(_read_json(hf_hub_download(model_id_or_path, "model_index.json")))
        return {
            name: Component(
                library,
                class_name,
                _read_json(hf_hub_download(model_id_or_path, "config.json", subfolder=name)),
            )
            for name, (library, class_name) in entries.items()
        }
    except Exception as error:  # every Hub failure (offline, 404, gated, malformed id) means "not found"
        raise model_not_found("pipeline", model_id_or_path, error) from error


# --------------------------------------------------------------------------------------------------------------
# Building on meta
# --------------------------------------------------------------------------------------------------------------


def _cast_like_diffusers_load(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give ``model``'s floating parameters and persistent buffers the dtypes that diffusers'
    ``from_pretrained(..., dtype=dtype)`` gives them: ``dtype``, except float32 for names with a part in the
    class's ``_keep_in_fp32_modules`` (Wan keeps its time embedder, norms and modulation table in float32).
    Non-persistent buffers (rotary tables) keep the dtype they were built in, as after loading."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    replaced: dict[int, torch.nn.Parameter] = {}  # a tied parameter is replaced once, and stays tied
    for prefix, module in model.named_modules():
        parts = prefix.split(".") if prefix else []
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            if id(param) not in replaced:
                target = torch.float32 if any(m in [*parts, key] for m in keep) else dtype
                replaced[id(param)] = torch.nn.Parameter(param.to(target), requires_grad=param.requires_grad)
            module._parameters[key] = replaced[id(param)]
        for key, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_floating_point() or key in module._non_persistent_buffers_set:
                continue
            module._buffers[key] = buffer.to(
                torch.float32 if any(m in [*parts, key] for m in keep) else dtype
            )


def _build_one(
    component: Component, dtype: torch.dtype, device: torch.device | str = "meta"
) -> torch.nn.Module:
    cls = _model_class(component.library, component.class_name)
    if cls is None:
        raise ValueError(
            f"{component.library}.{component.class_name} is not a model class of the installed "
            f"{component.library}; update {component.library} or check the pipeline's model_index.json"
        )
    with torch.device(device):
        if component.library == "diffusers":
            # on a real device the weights are made in dtype at once: a float32 first draw of a 20 B model
            # would need twice its memory
            default = torch.get_default_dtype()
            if torch.device(device).type != "meta":
                torch.set_default_dtype(dtype)
            try:
                model = cls.from_config(component.config)
            finally:
                torch.set_default_dtype(default)
            _cast_like_diffusers_load(model, dtype)
        else:
            config = cls.config_class.from_dict(component.config)
            # transformers' own dtype handling: weights in dtype, float32-kept modules and buffers as loaded
            model = cls._from_config(config, dtype=dtype)
    return model.eval()


def build_on_meta(model_id_or_path: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.nn.Module]:
    """Every model component of a pipeline instantiated on the ``meta`` device: real classes, real shapes,
    nothing allocated.

    Diffusers components: ``<class>.from_config(config)``, floating parameters and persistent buffers then
    cast as ``from_pretrained(..., dtype=dtype)`` casts them (``_keep_in_fp32_modules`` stay float32).
    Transformers components: ``<config class>.from_dict(config)`` then ``<model class>._from_config(config,
    dtype=dtype)``. Memory of a component in bytes = ``sum(p.numel() * p.element_size())`` over its unique
    parameters (``module.parameters()`` counts a tied weight once).

    Args:
        model_id_or_path: a local pipeline directory or a Hugging Face repository id (see
            :func:`component_configs`).
        dtype: the weights' dtype (``torch.bfloat16`` as the recipes load them).

    Returns:
        ``{model_index component name: module on meta, in eval mode}``.

    Raises:
        OSError: the pipeline cannot be found (see :func:`component_configs`).
        ValueError: a component class the installed diffusers / transformers does not have.
    """
    return {
        name: _build_one(component, dtype) for name, component in component_configs(model_id_or_path).items()
    }


def build_random(
    model_id_or_path: str, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda"
) -> dict[str, torch.nn.Module]:
    """Every model component of a pipeline with random weights (each class's own initialisation) on ``device``,
    as :func:`build_on_meta` builds them on ``meta``: a real-size pipeline without its checkpoint, for smoke
    tests of memory and step time (``python -m benchmarks.real_size``). The weights are drawn in ``dtype``.

    Raises:
        OSError: the pipeline cannot be found (see :func:`component_configs`).
        ValueError: a component class the installed diffusers / transformers does not have.
    """
    return {
        name: _build_one(component, dtype, device)
        for name, component in component_configs(model_id_or_path).items()
    }
