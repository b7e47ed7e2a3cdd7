"""A tiny Qwen2.5-VL built from config: random weights, an offline tokenizer, a real processor and chat template.

No weights can be downloaded where mmrl is built and tested, so the shapes world ships its own VLM: the real
``Qwen2_5_VLForConditionalGeneration`` class with a few layers and a small hidden size, a byte-level BPE tokenizer
trained with the ``tokenizers`` library on the task's text plus the Qwen special tokens, and the real
``Qwen2_5_VLProcessor`` (``Qwen2VLImageProcessor``) with a Qwen-style chat template. Saved with
``save_pretrained``, it loads exactly like ``Qwen/Qwen2.5-VL-3B-Instruct``::

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)

so every code path the real model takes (processor, image-token expansion, mRoPE, generate, peft) is exercised.

Image tokens: the vision tower cuts an image into ``patch_size`` pixel patches and merges
``merge_size x merge_size`` of them into one LLM token, so a 64x64 scene with the defaults (8-pixel patches,
2x2 merge) becomes 8x8 patches and 16 image tokens. The image processor resizes every square input to
``image_size x image_size`` (a 32x32 scene is upsampled), so the token count never changes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

M = TypeVar("M", bound=torch.nn.Module)

#: The Qwen2.5-VL special tokens the processor, chat template and model refer to.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: Qwen2.5-VL's chat template minus its default system prompt ("You are a helpful assistant."), which would add
#: ~10 tokens to every tiny-model sequence for nothing; a system message passed explicitly is rendered as usual.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyVLMConfig:
    """Sizes of the tiny VLM. Defaults: ~0.5 M parameters, ~2 MB in fp32.

    Attributes:
        image_size: side of the (square) scenes in pixels; the image processor resizes inputs to this area.
        patch_size: vision patch side in pixels.
        merge_size: patches merged per LLM token along each side (image tokens = (image_size/patch/merge)^2).
        hidden_size: language-model width.
        num_layers: language-model decoder layers.
        num_heads: attention heads (head dim = hidden_size / num_heads, an even number >= 8 for mRoPE).
        num_kv_heads: key/value heads (grouped-query attention as in Qwen2.5).
        intermediate_size: language-model MLP width.
        vision_hidden_size: vision-tower width.
        vision_depth: vision-tower blocks (the last uses full attention, the others windowed, as in Qwen2.5-VL).
        vision_heads: vision attention heads.
        vision_intermediate_size: vision MLP width.
        vocab_size: target BPE vocabulary size before the special tokens (training stops earlier when the
            corpus has no more merges).
        max_position_embeddings: context length recorded in the config.
        seed: seed of the random initialisation.
    """

    image_size: int = 64
    patch_size: int = 8
    merge_size: int = 2
    hidden_size: int = 96
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vision_hidden_size: int = 64
    vision_depth: int = 1
    vision_heads: int = 2
    vision_intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        factor = self.patch_size * self.merge_size
        if self.image_size % factor:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch_size * merge_size = {factor}"
            )
        head_dim = self.hidden_size // self.num_heads
        if self.hidden_size % self.num_heads or head_dim % 2 or head_dim < 8:
            raise ValueError(
                f"hidden_size / num_heads = {self.hidden_size}/{self.num_heads} must be an even integer >= 8 "
                "(mRoPE splits half the head dim into temporal, height and width sections)"
            )


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> Qwen2Tokenizer:
    """Train a Qwen2-style byte-level BPE tokenizer on ``corpus`` and add the Qwen special tokens.

    Pre-tokenisation (Qwen2's split regex, then byte-level) and decoding match ``Qwen2Tokenizer``, so the result
    is a genuine ``Qwen2Tokenizer`` whose only difference from Qwen's is its small vocabulary. Every byte is in
    the alphabet, so any text round-trips, seen or not.

    Args:
        corpus: training texts (the task's questions and answers).
        vocab_size: target vocabulary size before the special tokens.

    Returns:
        The tokenizer; ``eos_token`` is ``<|im_end|>`` (the chat turn end, as in Qwen-Instruct) and
        ``pad_token`` is ``<|endoftext|>``.
    """
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(merge) for merge in trained["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS)})
    return tokenizer


def build_processor(tokenizer: Qwen2Tokenizer, config: TinyVLMConfig) -> Qwen2_5_VLProcessor:
    """The real Qwen2.5-VL processor around ``tokenizer``, sized so a scene gives a handful of image tokens."""
    sizes = {
        "patch_size": config.patch_size,
        "merge_size": config.merge_size,
        "temporal_patch_size": 2,
        # Exactly image_size^2 pixels: a square scene of any size is resized to image_size x image_size, so it
        # always gives the token count the model was trained on.
        "min_pixels": config.image_size**2,
        "max_pixels": config.image_size**2,
    }
    return Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes),
        chat_template=CHAT_TEMPLATE,
    )


def build_model(tokenizer: Qwen2Tokenizer, config: TinyVLMConfig) -> Qwen2_5_VLForConditionalGeneration:
    """A randomly initialised ``Qwen2_5_VLForConditionalGeneration`` matching ``tokenizer`` (seeded)."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    half = config.hidden_size // config.num_heads // 2
    temporal = half // 4  # Qwen's [16, 24, 24] split of 64 rotary frequencies, scaled to this head dim
    mrope_section = [temporal, (half - temporal) // 2, half - temporal - (half - temporal) // 2]
    model_config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": mrope_section,
                "rope_theta": 10000.0,
            },
            "bos_token_id": None,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": config.vision_depth,
            "hidden_size": config.vision_hidden_size,
            "intermediate_size": config.vision_intermediate_size,
            "num_heads": config.vision_heads,
            "patch_size": config.patch_size,
            "spatial_merge_size": config.merge_size,
            "temporal_patch_size": 2,
            # Windows of 4x4 merged tokens, as Qwen2.5-VL's 112 px windows are at 14 px patches.
            "window_size": 4 * config.patch_size * config.merge_size,
            "out_hidden_size": config.hidden_size,
            "fullatt_block_indexes": [config.vision_depth - 1],
        },
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    return random_model(
        Qwen2_5_VLForConditionalGeneration, model_config, config.seed, qwen_generation_config(ids)
    )


def qwen_vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The vision special-token ids a Qwen-VL model config takes, from the tokenizer's vocabulary ``ids``."""
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def qwen_generation_config(ids: dict[str, int]) -> GenerationConfig:
    """Stop on the end of the assistant turn (or end of text), as Qwen-Instruct's generation_config.json does."""
    return GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]
    )


def save_tiny(model: Any, processor: Any, out_dir: str | Path | None) -> None:
    """``save_pretrained`` model and processor into ``out_dir`` (reload with the Auto classes); nothing when ``None``."""
    if out_dir is not None:
        model.save_pretrained(out_dir)
        processor.save_pretrained(out_dir)


def random_model(model_class: type[M], model_config: Any, seed: int, generation: GenerationConfig) -> M:
    """``model_class(model_config)`` with weights drawn under ``seed``, its ``generation_config`` set, in eval mode.

    The weights are drawn under a forked RNG, so the seed fixes them without resetting the caller's random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(model_config)
    model.generation_config = generation
    return model.eval()


def build_tiny_vlm(
    corpus: Iterable[str],
    config: TinyVLMConfig | None = None,
    out_dir: str | Path | None = None,
) -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor]:
    """Tokenizer, processor and random model in one call; saved to ``out_dir`` when given.

    Args:
        corpus: texts to train the tokenizer on (the task's prompts and answers).
        config: sizes; :class:`TinyVLMConfig` defaults when ``None``.
        out_dir: directory to ``save_pretrained`` model and processor into (reload with the Auto classes).

    Returns:
        ``(model, processor)``.
    """
    config = config or TinyVLMConfig()
    tokenizer = train_tokenizer(corpus, vocab_size=config.vocab_size)
    processor = build_processor(tokenizer, config)
    model = build_model(tokenizer, config)
    save_tiny(model, processor, out_dir)
    return model, processor
