"""Random weights at the published VLM sizes (:func:`pipelines.vlm.published.build_random`) and the processor
that drives them (:func:`~pipelines.vlm.published.build_processor`), checked without allocating a real-size
model: on the ``meta`` device, and through a narrow copy of the config that keeps every size deciding how many
image tokens an image becomes, run by the model's own forward."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, PretrainedConfig

from pipelines.vlm.families import family_for_model_type
from pipelines.vlm.inputs import collate_left_padded, prepare_prompts
from pipelines.vlm.published import (
    PUBLISHED_CONFIGS,
    build_on_meta,
    build_processor,
    build_random,
    model_config,
    random_config,
)

CORPUS = [
    "Remove all red shapes. How many shapes are left? Think in <think></think>, then give the number in "
    "<answer></answer>.",
    "<think>shapes 4. red 2. 4-2=2</think><answer>2</answer>",
] * 10

#: model_type -> {config key: the token whose processor id it must hold} ("text_config.": the language
#: model's)
QWEN3_VL_SPECIAL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
SPECIAL_TOKENS = {
    "qwen2_5_vl": {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
        "text_config.eos_token_id": "<|im_end|>",
    },
    "qwen3_vl": QWEN3_VL_SPECIAL_TOKENS,
    # the MoE text config also names bos / eos ids (the dense one names none)
    "qwen3_vl_moe": {
        **QWEN3_VL_SPECIAL_TOKENS,
        "text_config.bos_token_id": "<|endoftext|>",
        "text_config.eos_token_id": "<|im_end|>",
    },
    "gemma3": {
        "boi_token_index": "<start_of_image>",
        "eoi_token_index": "<end_of_image>",
        "image_token_index": "<image_soft_token>",
        "text_config.eos_token_id": "<eos>",
    },
}
#: family -> the tokens generation stops on (the published generation_config.json's eos ids)
STOP_TOKENS = {
    "qwen2_5_vl": {"<|im_end|>", "<|endoftext|>"},
    "qwen3_vl": {"<|im_end|>", "<|endoftext|>"},
    "gemma3": {"<eos>", "<end_of_turn>"},
}
#: model_type -> (text, vision) sizes of a narrow copy; what decides the image-token count (patch, temporal
#: patch and merge sizes, Gemma's image size and tokens per image) is left as published, head dims too (mRoPE)
QWEN3_VL_NARROW_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 128,
    "deepstack_visual_indexes": [0],
}
NARROW = {
    "qwen2_5_vl": (
        {"hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 64},
        {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 128},
    ),
    "qwen3_vl": (
        {"hidden_size": 128, "num_attention_heads": 1, "num_key_value_heads": 1, "intermediate_size": 64},
        QWEN3_VL_NARROW_VISION,
    ),
    # 4 experts of width 32, 2 routed per token (published: 128 of width 768, 8 routed)
    "qwen3_vl_moe": (
        {
            "hidden_size": 128,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        QWEN3_VL_NARROW_VISION,
    ),
    "gemma3": (
        {
            "hidden_size": 64,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "intermediate_size": 64,
        },
        {"hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1},
    ),
}
GEOMETRY = ("patch_size", "temporal_patch_size", "spatial_merge_size", "image_size")


def token_ids(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every ``*token_id*`` / ``*token_index*`` entry of a config dict, sub-configs included."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from token_ids(value, f"{prefix}{key}.")
        elif "token_id" in str(key) or "token_index" in str(key):
            yield f"{prefix}{key}", value


def attribute(config: PretrainedConfig, key: str) -> Any:
    owner, _, name = key.rpartition(".")
    return getattr(getattr(config, owner) if owner else config, name)


def image_token_count(processor: Any, family: Any, size: tuple[int, int]) -> tuple[dict, int]:
    """The processed chat prompt of one ``size`` (width, height) image and its number of image tokens."""
    prompt = family.prompt("How many shapes are left?", [Image.new("RGB", size, (200, 30, 30))])
    prepared, skipped = prepare_prompts(processor, [prompt])
    assert not skipped
    batch = collate_left_padded(prepared, processor.tokenizer.pad_token_id)
    return batch, int((batch["input_ids"] == family.image_token_id(processor)).sum())


@pytest.fixture(scope="module", params=sorted(PUBLISHED_CONFIGS))
def random_meta(request):
    """(hub id, processor, random-weights model built on meta in bfloat16)."""
    torch.set_num_threads(1)
    processor = build_processor(request.param, CORPUS)
    return request.param, processor, build_random(request.param, processor, torch.bfloat16, "meta")


def test_random_model_has_the_published_size_and_config_but_token_ids(random_meta):
    model_id, _, model = random_meta
    published = build_on_meta(model_id)
    assert type(model) is type(published)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in published.parameters())
    assert {n: p.shape for n, p in model.named_parameters()} == {
        n: p.shape for n, p in published.named_parameters()
    }
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert not model.training  # as from_pretrained returns it

    def without_token_ids(config: PretrainedConfig) -> dict:
        values = config.to_dict()
        for key, _ in list(token_ids(values)):
            owner, _, name = key.rpartition(".")
            (values[owner] if owner else values).pop(name)
        return values

    assert without_token_ids(model.config) == without_token_ids(published.config)


def test_every_special_token_id_is_the_processors(random_meta):
    model_id, processor, model = random_meta
    family = family_for_model_type(model.config.model_type)
    vocab = processor.tokenizer.get_vocab()
    for key, token in SPECIAL_TOKENS[model.config.model_type].items():
        assert attribute(model.config, key) == vocab[token], key
        if not key.startswith("text_config."):  # (the tiny Gemma keeps Gemma's <pad> 0, <eos> 1, <bos> 2)
            # the published id names the token in the real vocabulary; the tiny vocabulary's id differs
            assert attribute(model_config(model_id), key) != vocab[token], key
    assert family.image_token_id(processor) in {
        getattr(model.config, "image_token_id", None),
        getattr(model.config, "image_token_index", None),
    }
    # no id of the real vocabulary is left: each one is a token of the tiny one (or unset)
    for key, value in token_ids(model.config.to_dict()):
        assert value is None or 0 <= value < len(processor.tokenizer), (key, value)
    assert set(model.generation_config.eos_token_id) == {vocab[t] for t in STOP_TOKENS[family.name]}
    assert model.generation_config.pad_token_id == processor.tokenizer.pad_token_id


@pytest.mark.parametrize("size", [(448, 448), (896, 448)])
def test_an_image_gives_the_token_count_of_the_published_geometry(random_meta, size):
    _, processor, model = random_meta
    family = family_for_model_type(model.config.model_type)
    vision = model.config.vision_config
    batch, count = image_token_count(processor, family, size)
    width, height = size
    if family.name == "gemma3":
        # SigLIP at 896 px, 14 px patches (64 x 64), average-pooled to mm_tokens_per_image (16 x 16 = 256)
        assert batch["pixel_values"].shape[-2:] == (vision.image_size, vision.image_size) == (896, 896)
        assert count == model.config.mm_tokens_per_image == 256
    else:
        # both sides are multiples of patch x merge (28 and 32), so the processor keeps the size:
        # (H / patch) * (W / patch) patches, merge x merge of them per token
        patch, merge = vision.patch_size, vision.spatial_merge_size
        assert count == (height // patch) * (width // patch) // merge**2
        assert batch["image_grid_thw"].tolist() == [[1, height // patch, width // patch]]
    assert family.image_inputs(processor, [Image.new("RGB", size)])[1] == [count]


def narrow(config: PretrainedConfig) -> PretrainedConfig:
    """``config`` with a narrow, one-layer language model and vision tower; its image geometry unchanged."""
    text, vision = NARROW[config.model_type]
    geometry = {key: getattr(config.vision_config, key, None) for key in GEOMETRY}
    for key, value in text.items():
        setattr(config.text_config, key, value)
    config.text_config.num_hidden_layers = 1
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    assert {key: getattr(config.vision_config, key, None) for key in GEOMETRY} == geometry
    return config


@pytest.mark.parametrize("size", [(448, 336), (640, 480)])
def test_the_models_own_forward_takes_the_processors_image_tokens(random_meta, size):
    """The model's forward checks that it made as many image features as the prompt holds image tokens (it
    raises otherwise); a narrow copy of the random config runs it on the CPU; the published ids fail it."""
    model_id, processor, _ = random_meta
    config = narrow(random_config(model_id, processor))
    family = family_for_model_type(config.model_type)
    batch, count = image_token_count(processor, family, size)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    vision_inputs = {k: v for k, v in batch.items() if k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        features = model.model.get_image_features(**vision_inputs).pooler_output
        logits = model(**batch).logits
    # Qwen: one [tokens, hidden] tensor per image; Gemma: [images, tokens, hidden]
    per_image = features if isinstance(features, tuple | list) else list(features)
    assert sum(f.reshape(-1, f.shape[-1]).shape[0] for f in per_image) == count
    assert logits.shape == (1, batch["input_ids"].shape[1], config.get_text_config().vocab_size)
    # the same sizes with the published special-token ids: the prompt has no image token the model looks for
    published = AutoModelForImageTextToText.from_config(narrow(model_config(model_id))).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="Image features and image tokens do not match"):
        published(**batch)
