"""The published architectures of the real VLMs the recipes train, built on PyTorch's ``meta`` device.

What it is for: knowing what a real-model recipe (``configs/vlm/*.yaml``) costs in GPU memory before launching
it, and real-size smoke tests, on a machine that cannot download weights. :func:`build_on_meta` instantiates
the very ``*ForConditionalGeneration`` class mmrl trains, at its published size, on the ``meta`` device: every
parameter and buffer has its real shape and dtype and no storage, so building takes about a second and no
memory. :func:`model_config` gives the config it is built from: a local folder's ``config.json``, the embedded
published config of a known Hub id (no network), or any other Hub id's ``config.json`` (one small download).

Random weights at the published size (``python -m benchmarks.real_size``): :func:`build_random` instantiates
the same class with each module's own random initialisation, drawn in the given dtype on the given device, and
:func:`build_processor` gives the processor that drives it. The published tokenizers cannot be downloaded, so
for a published id the processor holds the family's tiny tokenizer (:mod:`pipelines.vlm.tiny`,
:mod:`pipelines.vlm.tiny_gemma3`: a small vocabulary trained on the caller's texts plus the real special
tokens; the tiny models' chat template, the real markup without Qwen's default system prompt) and the
*published* image processor (:data:`PUBLISHED_IMAGE_PROCESSORS`: patch, merge and pixel bounds, or Gemma 3's
896 px square), so an image expands to the number of image tokens the real model takes. What differs from the
real checkpoint, besides the weights, is the special-token ids and nothing else: the config's image / video /
vision start and end ids (Gemma: start, end and soft image token) and the language model's bos / eos ids are
the tiny tokenizer's ids of the same tokens, which are valid ids of the real, larger vocabulary
(:func:`random_config`). Every size (vocabulary included) is the published one; a prompt's text tokenises to a
different number of tokens than with the real tokenizer, its image to the same number.

The embedded configs are the models' published ``config.json`` files with their values unchanged, keeping only
the keys the installed transformers (5.x) config classes read; left out, as nothing reads them:

- ``Qwen/Qwen2.5-VL-3B-Instruct``: ``vision_token_id``, ``vision_config.in_chans``,
  ``vision_config.spatial_patch_size``, ``transformers_version`` ("4.41.2"). The file is in the flat pre-4.49
  layout (language-model keys at the top level, ``rope_scaling`` of type "mrope"); ``Qwen2_5_VLConfig`` moves
  them into ``text_config`` itself. Verified against two independent public copies of the file found on GitHub
  by their values (the search index did not name either repository): a Markdown dump headed
  "Qwen/Qwen2.5-VL-3B-Instruct" holding the config, the module tree and a torchinfo table, whose per-block
  counts (vision block 19,702,200, merger MLP 36,707,328, patch embedding 1,505,280, decoder layer 77,076,992)
  equal the ones this config builds; and the same values written as keyword arguments of a ``qwen2_5_vl``
  config in a Qwen2.5-VL-based robot policy's configuration code.
- ``Qwen/Qwen3-VL-4B-Instruct``: ``text_config.bos_token_id``, ``text_config.eos_token_id``,
  ``text_config.tie_word_embeddings`` (the top-level ``tie_word_embeddings``, the one read, is kept; both are
  true), ``transformers_version`` ("4.57.0.dev0"). Verified against kohya-ss/musubi-tuner
  ``src/musubi_tuner/krea2/krea2_encoder.py`` (``QWEN3_VL_4B_INSTRUCT_CONFIG``, vendored from the Hub file)
  and an independent copy written as ``Qwen3VLConfig`` keyword arguments in a DiffSynth-style
  ``WanMLLMEncoder`` (repository not named by the search index); the two agree key for key.
- ``Qwen/Qwen3-VL-30B-A3B-Instruct``: ``text_config.norm_topk_prob`` (true; no config field, and transformers'
  router renormalises the 8 selected experts' weights unconditionally, which is what true means),
  ``transformers_version`` ("4.57.0.dev0"). Unlike the 4B's, this text config class reads ``bos_token_id`` /
  ``eos_token_id``, so they are kept (151643 / 151645, ``<|endoftext|>`` / ``<|im_end|>``). Verified against
  (1) a Markdown model-information report of the checkpoint folder (repository not named by the search index)
  quoting the file verbatim under "Qwen3-VL-30B-A3B-Instruct/config.json", with its module tree and a
  safetensors table (882 tensors, 31,070,754,032 parameters: this config builds the same 882 tensors and
  count); (2) an independent Rust parser test (repository not named) holding "an inline copy" of the file
  "transcribed byte-for-byte" at Hub commit 1fc78ad, which agrees on every key it copies: every size and
  expert count, the vision token ids, rope and vision keys, ``tie_word_embeddings`` false, ``rms_norm_eps``,
  ``mlp_only_layers``, ``decoder_sparse_step``; (3) for the language model, haod0ng/Agentic-MLLM-RL
  ``scripts/models/qwen3-vl-30B-A3B.sh`` (Megatron arguments: 48 layers, 2048 hidden, 6144 FFN, 32 heads, 4
  query groups, 128 KV channels, RMSNorm 1e-6, SwiGLU, untied embeddings, vocabulary 151,936, rotary base 5e6,
  128 experts of width 768, top 8) and a Swift test's "real shape" ``text_config`` (the same sizes). Found in
  copy (1) only, the others not naming them: ``text_config.attention_dropout`` (0.0), ``text_config.dtype``
  ("bfloat16"), ``text_config.use_cache`` (true), ``vision_config.initializer_range`` (0.02), the text
  ``bos_token_id`` / ``eos_token_id`` (Qwen's usual ids, which :func:`random_config` replaces anyway) and
  ``text_config.hidden_act`` / ``initializer_range`` ("silu", 0.02; source (3) says SwiGLU, and another copy
  of such a Megatron script ``--init-method-std 0.02``); none changes a shape, and each equals the 4B's value.
- ``google/gemma-3-4b-it``: ``eos_token_id`` ([1, 106]; transformers 5 reads it from
  ``generation_config.json``, not from ``Gemma3Config``), ``transformers_version`` ("4.50.0.dev0"). The file
  names few keys (no ``vocab_size``, head counts or ``head_dim``): ``Gemma3TextConfig``'s defaults, which are
  the 4B's (262,208 tokens, 8 heads, 4 KV heads, head_dim 256), fill the rest, as they do when transformers
  loads the Hub file. Verified against a fixture quoting the file's top-level and ``text_config`` keys
  verbatim (a Rust test of config classification, "The shape of google/gemma-3-4b-it's config.json, vision
  tower omitted") and a C# test quoting the file's keys with its whole ``vision_config`` ("The original
  gemma-3-4b-it's config.json names few keys"; repositories not named by the search index). The token ids,
  ``mm_tokens_per_image`` and the ``text_config`` sizes, rope scaling and sliding window also match
  AI-Hypercomputer/maxtext ``MaxText/utils/ckpt_conversion/utils/hf_model_configs.py`` (``gemma3_4b_config``,
  an expanded copy).

Parameter counts (unique parameters, tied embeddings counted once), computed from these configs with
transformers 5.24 against the published figures:

==============================  ==============  ===============  ===============  ======================
model                           total           language model   vision tower     published
==============================  ==============  ===============  ===============  ======================
Qwen/Qwen2.5-VL-3B-Instruct     3,754,622,976   3,085,938,688    668,684,288 (a)  3.75 B (b)
Qwen/Qwen3-VL-4B-Instruct       4,437,815,808   4,022,468,096    415,347,712 (a)  4.44 B (c)
Qwen/Qwen3-VL-30B-A3B-Instruct  31,070,754,032  30,220,957,696   538,631,408 (a)  31.1 B (f)
google/gemma-3-4b-it            4,300,079,472   3,880,263,168    416,866,032 (d)  4.3 B (e)
==============================  ==============  ===============  ===============  ======================

(a) the Qwen towers (``model.visual``) include their patch merger. (b) the Hub page's figure; no public copy
of it was found without Hub access, but the torchinfo table cited above agrees block by block with the
computed counts. (c) the Hub page's figure as third-party model listings quote it ("4.4B params"; "Dense
transformer (36 layers, GQA 32/8) with 4.44B parameters", mixpeek.com's model page). (d) the SigLIP tower
(``model.vision_tower``) only; Gemma's projector (``model.multi_modal_projector``, 2,950,272) sits outside
both. (e) the model card's "4.3 billion parameter" size, as repackaged-model cards and a parameter-count test
("what each model card claims": 4.30e9) quote it. (f) the Hub page's count, as model listings quote it
("Parameters 31.07" for the Instruct model; "31.1B-parameter" for its Thinking twin of the same architecture);
no count quoted from the model card itself was found beyond the name's 30B total / 3B active. Its LM head is
untied: the total is the language model, the tower and ``lm_head`` (151,936 x 2,048 = 311,164,928); the
safetensors table of source (1) above sums to the same 31,070,754,032. Per token 8 of the 128 experts run:
3,353,032,704 language-model parameters active (embeddings and head included), 3,891,664,112 with the tower.
The language model has the shapes of the text-only Qwen3-30B-A3B, whose card states 30.5 B total and 3.3 B
activated: the language model with its head here sums to 30,532,122,624.

Example::

    model = build_on_meta("Qwen/Qwen3-VL-4B-Instruct")           # no download, no memory
    n = sum(p.numel() for p in model.parameters())                 # 4,437,815,808
    model = build_on_meta("checkpoints/shapes_vlm", torch.float32)  # a local folder's config.json
    processor = build_processor("google/gemma-3-4b-it", questions)  # tiny tokenizer, published image geometry
    model = build_random("google/gemma-3-4b-it", processor, torch.bfloat16, "cuda")  # 8.6 GB, random
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    ProcessorMixin,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from pipelines.hub import model_not_found
from pipelines.vlm.families import family_for_model_type
from pipelines.vlm.tiny import CHAT_TEMPLATE, train_tokenizer
from pipelines.vlm.tiny_gemma3 import GEMMA3_CHAT_TEMPLATE, train_gemma_tokenizer

__all__ = [
    "GEMMA_3_4B_IT",
    "PUBLISHED_CONFIGS",
    "PUBLISHED_IMAGE_PROCESSORS",
    "QWEN2_5_VL_3B_INSTRUCT",
    "QWEN3_VL_4B_INSTRUCT",
    "QWEN3_VL_30B_A3B_INSTRUCT",
    "build_on_meta",
    "build_processor",
    "build_random",
    "model_config",
    "random_config",
]

#: ``Qwen/Qwen2.5-VL-3B-Instruct``'s ``config.json`` (flat layout; sources in the module docstring).
QWEN2_5_VL_3B_INSTRUCT: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

#: ``Qwen/Qwen3-VL-4B-Instruct``'s ``config.json`` (sources in the module docstring).
QWEN3_VL_4B_INSTRUCT: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "initializer_range": 0.02,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

#: ``Qwen/Qwen3-VL-30B-A3B-Instruct``'s ``config.json`` (sources in the module docstring): Qwen3-VL-4B's
#: layout with a mixture-of-experts language model (128 experts of width 768, 8 routed per token, in every
#: layer) and an untied LM head.
QWEN3_VL_30B_A3B_INSTRUCT: dict[str, Any] = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text",
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        # (as published; Qwen3VLMoeConfig renames it qwen3_vl_moe_vision, the vision sub-config's type)
        "model_type": "qwen3_vl_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}

#: ``google/gemma-3-4b-it``'s ``config.json`` (sources in the module docstring; unnamed keys take the
#: ``Gemma3TextConfig`` / ``SiglipVisionConfig`` defaults, as they do when transformers loads the Hub file).
GEMMA_3_4B_IT: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}

#: Hub id -> embedded published ``config.json``: the models the ``configs/vlm`` recipes name.
PUBLISHED_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-VL-3B-Instruct": QWEN2_5_VL_3B_INSTRUCT,
    "Qwen/Qwen3-VL-4B-Instruct": QWEN3_VL_4B_INSTRUCT,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": QWEN3_VL_30B_A3B_INSTRUCT,
    "google/gemma-3-4b-it": GEMMA_3_4B_IT,
}

#: Qwen3-VL's ``preprocessor_config.json``, one file for the family's sizes (the entries below share it;
#: :func:`build_processor` copies it before use).
_QWEN3_VL_IMAGE_PROCESSOR: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

#: Hub id -> the image-processing keys of its published ``preprocessor_config.json``: what decides how many
#: image tokens an image becomes (patch and merge sizes, pixel bounds; Gemma 3: the fixed square) and the
#: normalisation. The class is the family's (:func:`build_processor`): transformers 5 names Qwen3-VL's
#: ``Qwen2VLImageProcessorFast`` ``Qwen2VLImageProcessor``. Sources (repositories not named by the search
#: index): Qwen2.5-VL's file quoted in a Rust test ("Trimmed from Qwen/Qwen2.5-VL-7B-Instruct"; the family's
#: sizes share one processor file), its pixel bounds also in other projects' processor settings; Qwen3-VL's
#: file quoted in Python and Swift tests and dumped from a Qwen3.5 checkpoint (the same file); Gemma 3's
#: written out by a NeMo-RL Gemma 3 job script and offline loaders (``image_seq_length`` 256, the config's
#: ``mm_tokens_per_image``, goes to the processor). Qwen3-VL-30B-A3B takes the family's file on the same
#: ground as Qwen2.5-VL-3B: no public copy of its own ``preprocessor_config.json`` was found, but its
#: ``vision_config`` has the 4B's patch geometry (16 px patches, temporal patch 2, merge 2) and the file
#: recurs unchanged across the family's checkpoints.
PUBLISHED_IMAGE_PROCESSORS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "Qwen/Qwen3-VL-4B-Instruct": _QWEN3_VL_IMAGE_PROCESSOR,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _QWEN3_VL_IMAGE_PROCESSOR,
    "google/gemma-3-4b-it": {
        "size": {"height": 896, "width": 896},
        "resample": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pan_and_scan": None,
    },
}

#: every special-token id a Qwen2.5-VL or Qwen3-VL config names (the dense Qwen3-VL's text config names no bos /
#: eos ids, which random_config then leaves unset; the MoE's does)
_QWEN_CONFIG_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "text_config.bos_token_id": "<|endoftext|>",
    "text_config.eos_token_id": "<|im_end|>",
}
_QWEN_GENERATION_TOKENS: dict[str, Any] = {
    "bos_token_id": "<|endoftext|>",
    "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
    "pad_token_id": "<|endoftext|>",
}
#: family -> {config key: the token whose id it holds} (``text_config.`` keys are the language model's): every
#: token id of the published configs, as the tokens they name in the real vocabulary (a key a config of the
#: family leaves unset is skipped for it).
_CONFIG_TOKENS: dict[str, dict[str, str]] = {
    "qwen2_5_vl": _QWEN_CONFIG_TOKENS,
    "qwen3_vl": _QWEN_CONFIG_TOKENS,
    "gemma3": {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
        "text_config.pad_token_id": "<pad>",
        "text_config.eos_token_id": "<eos>",
        "text_config.bos_token_id": "<bos>",
    },
}
#: family -> the token ids of the published ``generation_config.json``, as tokens (stop on the end of the turn
#: or of the text); its sampling defaults are left out, as the generation backends pass every sampling knob.
_GENERATION_TOKENS: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": _QWEN_GENERATION_TOKENS,
    "qwen3_vl": _QWEN_GENERATION_TOKENS,
    "gemma3": {"bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"], "pad_token_id": "<pad>"},
}


def model_config(model_id_or_path: str) -> PretrainedConfig:
    """The transformers config of a VLM: a local folder's, a known Hub id's published one, or a Hub download.

    1. a local folder: ``AutoConfig.from_pretrained(folder)`` (its ``config.json``);
    2. a Hub id in :data:`PUBLISHED_CONFIGS`: the embedded published config, no network;
    3. any other Hub id: ``AutoConfig.from_pretrained(hub_id)``, which downloads ``config.json`` only.

    Args:
        model_id_or_path: a local folder (absolute, or relative to the working directory) or a Hub id.

    Returns:
        The config (a fresh object: callers may change it).

    Raises:
        OSError: neither a local folder nor a known id, and the Hub could not supply it (both places named,
            with the loader's reason); or a local folder without a readable ``config.json``.
    """
    if Path(model_id_or_path).is_dir():
        return AutoConfig.from_pretrained(model_id_or_path)
    if model_id_or_path in PUBLISHED_CONFIGS:
        # a deep copy: Qwen2_5_VLConfig rewrites its vision_config dict in place (Qwen3VLMoeConfig its vision
        # model_type), and the table must stay as published
        return AutoConfig.for_model(**copy.deepcopy(PUBLISHED_CONFIGS[model_id_or_path]))
    try:
        return AutoConfig.from_pretrained(model_id_or_path)
    # a string that is no valid repo id fails the Hub's id check with a ValueError
    except (OSError, ValueError) as error:
        raise model_not_found("VLM config", model_id_or_path, error) from error


def build_on_meta(model_id_or_path: str, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The model mmrl trains for ``model_id_or_path``, built on the ``meta`` device: real shapes, no storage.

    The class is the one the VLM backends load (``AutoModelForImageTextToText``, i.e. the
    ``*ForConditionalGeneration`` class of the config's ``model_type``), once a registered VLM family is known
    to serve that ``model_type``. Nothing is allocated and no weight is initialised, so a 4 B model builds in
    about a second; its parameters can be counted and their bytes summed (``numel() * element_size()``), not
    computed with.

    Args:
        model_id_or_path: a local folder or a Hub id (resolved by :func:`model_config`).
        dtype: the parameters' dtype (the published checkpoints' is bfloat16).

    Returns:
        The model, in train mode as ``from_config`` leaves it, every parameter and buffer on ``meta``.

    Raises:
        OSError: the config cannot be found (see :func:`model_config`).
        ValueError: no registered VLM family serves the config's ``model_type`` (the registered ones named).
    """
    return _instantiate(model_config(model_id_or_path), dtype, "meta")


def _instantiate(config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str) -> PreTrainedModel:
    """``AutoModelForImageTextToText.from_config(config)`` on ``device``, its weights made in ``dtype`` there
    (no float32 first draw: transformers sets the default dtype while the modules are built)."""
    # Only a model_type some family serves is one mmrl can train; this raises for any other.
    family_for_model_type(config.model_type)
    with torch.device(device):
        return AutoModelForImageTextToText.from_config(config, dtype=dtype)


def _family_name(config: PretrainedConfig) -> str:
    """The family serving ``config``, one :func:`build_processor` knows how to drive."""
    family = family_for_model_type(config.model_type).name
    if family not in _CONFIG_TOKENS:
        raise ValueError(
            f"no random-weights processor for the {family!r} family (model_type {config.model_type!r}); "
            f"available: {sorted(_CONFIG_TOKENS)}"
        )
    return family


def build_processor(model_id_or_path: str, corpus: Iterable[str]) -> ProcessorMixin:
    """The processor that drives :func:`build_random`'s model of ``model_id_or_path``.

    A Hub id of :data:`PUBLISHED_IMAGE_PROCESSORS` (no network): the family's tiny tokenizer trained on
    ``corpus`` (about 512 tokens plus the real special tokens), the tiny models' chat template, and the
    published image processor, so an image becomes as many image tokens as with the real processor: Qwen ``(H
    / patch) * (W / patch) / merge^2`` after its resize to a multiple of ``patch * merge`` within the pixel
    bounds (a 448 x 448 image: 256 for Qwen2.5-VL, 196 for Qwen3-VL); Gemma 3 ``mm_tokens_per_image`` (256)
    for any image, resized to 896 x 896. Qwen processors get a video processor of the image patch geometry
    (the recipes ask no video questions). Anything else (a local folder, another Hub id): its own processor
    (``AutoProcessor``), whose token ids its config already holds; ``corpus`` is then unused.

    Raises:
        OSError: the config or the processor cannot be found (both places named, see :func:`model_config`).
        ValueError: no registered VLM family serves the model, or none this function drives.
    """
    if Path(model_id_or_path).is_dir() or model_id_or_path not in PUBLISHED_IMAGE_PROCESSORS:
        try:
            return AutoProcessor.from_pretrained(model_id_or_path)
        except (OSError, ValueError) as error:  # (a string that is no repo id fails the Hub's id check)
            if Path(model_id_or_path).exists():
                raise
            raise model_not_found("VLM processor", model_id_or_path, error) from error
    config = model_config(model_id_or_path)
    family = _family_name(config)
    published = copy.deepcopy(PUBLISHED_IMAGE_PROCESSORS[model_id_or_path])
    if family == "gemma3":
        return Gemma3Processor(
            image_processor=Gemma3ImageProcessor(**published),
            tokenizer=train_gemma_tokenizer(corpus),
            chat_template=GEMMA3_CHAT_TEMPLATE,
            image_seq_length=config.mm_tokens_per_image,
        )
    processor_class, video_class = (
        (Qwen3VLProcessor, Qwen3VLVideoProcessor)
        if family == "qwen3_vl"
        else (Qwen2_5_VLProcessor, Qwen2VLVideoProcessor)
    )
    geometry = {key: published[key] for key in ("patch_size", "temporal_patch_size", "merge_size")}
    return processor_class(
        image_processor=Qwen2VLImageProcessor(**published),
        tokenizer=train_tokenizer(corpus),
        video_processor=video_class(**geometry),
        chat_template=CHAT_TEMPLATE,
    )


def _token_ids(tokens: str | list[str], vocab: dict[str, int]) -> int | list[int]:
    return vocab[tokens] if isinstance(tokens, str) else [vocab[token] for token in tokens]


def random_config(model_id_or_path: str, processor: ProcessorMixin) -> PretrainedConfig:
    """:func:`model_config` with each special-token id it sets changed to ``processor``'s tokenizer's id of
    that token.

    The published ids (Qwen's ``<|image_pad|>`` 151655, Gemma's ``<image_soft_token>`` 262144...) belong to
    the real vocabulary; a processor with another tokenizer writes its own ids of those tokens, which the
    model must look for. Sizes are untouched: a small vocabulary's ids are valid rows of the real embedding
    table.

    Raises:
        OSError, ValueError: as :func:`build_processor`.
    """
    config = model_config(model_id_or_path)
    vocab = processor.tokenizer.get_vocab()
    for key, token in _CONFIG_TOKENS[_family_name(config)].items():
        owner, _, name = key.rpartition(".")
        holder = getattr(config, owner) if owner else config
        # a key the published config leaves unset stays unset (Qwen3-VL's dense text config has no bos / eos)
        if getattr(holder, name, None) is not None:
            setattr(holder, name, vocab[token])
    return config


def build_random(
    model_id_or_path: str,
    processor: ProcessorMixin,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
) -> PreTrainedModel:
    """The published architecture with random weights, driven by ``processor`` (:func:`build_processor`): a
    real-size VLM without its checkpoint, for smoke tests of memory and step time (``benchmarks.real_size``).

    What differs from the real checkpoint: the weights (each module's own initialisation, drawn in ``dtype``
    on ``device``) and the special-token ids, which are ``processor``'s (:func:`random_config`; so are the
    stop, pad and bos ids of its ``generation_config``, which holds nothing else). A random model almost never
    samples a stop token, so its completions run to ``max_new_tokens``: a step's worst case. Its ids outside
    the tiny vocabulary decode to nothing.

    Args:
        model_id_or_path: a Hub id or a local folder (see :func:`model_config`).
        processor: the processor whose token ids the model takes.
        dtype: the weights' dtype.
        device: where the weights are made (``"meta"``: shapes only, nothing allocated).

    Returns:
        The model in eval mode, as ``from_pretrained`` returns it.

    Raises:
        OSError, ValueError: as :func:`build_processor`.
    """
    config = random_config(model_id_or_path, processor)
    model = _instantiate(config, dtype, device)
    vocab = processor.tokenizer.get_vocab()
    generation = _GENERATION_TOKENS[_family_name(config)]
    model.generation_config = GenerationConfig(
        **{key: _token_ids(tokens, vocab) for key, tokens in generation.items()}
    )
    return model.eval()
