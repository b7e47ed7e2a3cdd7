"""A tiny Gemma 3 built from config: the real ``Gemma3ForConditionalGeneration`` with random weights.

Like :mod:`pipelines.vlm.tiny` for Qwen2.5-VL, so the Gemma 3 family runs end to end where nothing can be
downloaded: a SentencePiece-style BPE tokenizer (``▁`` for spaces, byte fallback, as Gemma's) trained with the
``tokenizers`` library and wrapped in the real ``GemmaTokenizer`` with Gemma 3's turn and image tokens, the real
``Gemma3Processor`` and ``Gemma3ImageProcessor``, and a model with a few layers. What it exercises that Qwen does
not:

- a SigLIP vision tower (``vision_tower``) and an average-pooling projector outside it: an image becomes a fixed
  ``mm_tokens_per_image`` tokens whatever its size (Gemma 3: 896 px, 64 x 64 patches pooled to 16 x 16 = 256);
- the prompt carries ``<start_of_image>``, which the processor expands to
  ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n``;
- ``token_type_ids`` (1 on image tokens) make attention bidirectional within each image, in ``generate``'s
  prefill and in a scoring forward alike;
- interleaved sliding-window and global attention layers, and a chat template that starts with ``<bos>``.

Saved with ``save_pretrained`` it loads like ``google/gemma-3-4b-it`` through the Auto classes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessor,
    Gemma3Processor,
    GemmaTokenizer,
    GenerationConfig,
)

from pipelines.vlm.tiny import TinyVLMConfig, random_model, save_tiny

__all__ = ["GEMMA3_CHAT_TEMPLATE", "build_tiny_gemma3", "train_gemma_tokenizer"]

#: Gemma's fixed ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3), then the chat and image tokens.
GEMMA_SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA3_TURN_TOKENS: tuple[str, ...] = ("<start_of_turn>", "<end_of_turn>")
GEMMA3_IMAGE_TOKENS: dict[str, str] = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}

#: Gemma 3's chat layout: ``<bos>``, turns ``<start_of_turn>{user|model}\n...<end_of_turn>\n``, a system message
#: folded into the first user turn, an image written as ``<start_of_image>`` (expanded by the processor).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set prefix = '' %}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set messages = messages[1:] %}"
    "{% endif %}"
    "{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if loop.first %}{{ prefix }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def train_gemma_tokenizer(corpus: Iterable[str], vocab_size: int = 512) -> GemmaTokenizer:
    """Train a Gemma-style BPE (spaces as ``▁``, split before each space, byte fallback) on ``corpus``.

    The vocabulary holds Gemma's five fixed specials first, the 256 ``<0xNN>`` byte tokens (so unseen text
    round-trips through byte fallback), then the learned merges; Gemma 3's turn and image tokens are added as
    special tokens, the image ones under the names ``Gemma3Processor`` reads (``boi_token``, ``image_token``...).
    """
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    # Training splits before each "▁" so merges stay inside a word; GemmaTokenizer then encodes with Gemma's own
    # normalizer and pre-tokenizer, which meet no merge across a word boundary.
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_next", invert=False)
    byte_tokens = [f"<0x{value:02X}>" for value in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(byte_tokens),
        special_tokens=[*GEMMA_SPECIAL_TOKENS, *byte_tokens],
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    trained = bpe.get_vocab()
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    tokenizer = GemmaTokenizer(
        vocab=dict(sorted(trained.items(), key=lambda item: item[1])),
        merges=merges,
        extra_special_tokens=GEMMA3_IMAGE_TOKENS,
        add_bos_token=True,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [*GEMMA3_TURN_TOKENS, *GEMMA3_IMAGE_TOKENS.values()]},
        replace_extra_special_tokens=False,
    )
    return tokenizer


def build_processor(tokenizer: GemmaTokenizer, config: TinyVLMConfig) -> Gemma3Processor:
    """The real Gemma 3 processor around ``tokenizer``: images resized to ``image_size`` squares, each expanded
    to ``(image_size / patch_size / merge_size)^2`` image tokens."""
    image_processor = Gemma3ImageProcessor(
        size={"height": config.image_size, "width": config.image_size},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=_tokens_per_image(config),
    )


def _tokens_per_image(config: TinyVLMConfig) -> int:
    # the projector average-pools merge_size x merge_size patches into one token (Gemma 3: 4 x 4)
    return (config.image_size // config.patch_size // config.merge_size) ** 2


def build_model(tokenizer: GemmaTokenizer, config: TinyVLMConfig) -> Gemma3ForConditionalGeneration:
    """A randomly initialised ``Gemma3ForConditionalGeneration`` matching ``tokenizer`` (seeded)."""
    vocab = tokenizer.get_vocab()
    head_dim = config.hidden_size // config.num_heads
    model_config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim,
            "max_position_embeddings": config.max_position_embeddings,
            # local layers then one global one (Gemma 3: five 1024-token sliding layers per global layer); a
            # window shorter than a prompt, so the sliding mask matters here too
            "sliding_window": 16,
            "layer_types": ["sliding_attention"] * (config.num_layers - 1) + ["full_attention"],
            "pad_token_id": vocab["<pad>"],
            "eos_token_id": vocab["<eos>"],
            "bos_token_id": vocab["<bos>"],
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": config.vision_hidden_size,
            "intermediate_size": config.vision_intermediate_size,
            "num_hidden_layers": config.vision_depth,
            "num_attention_heads": config.vision_heads,
            "image_size": config.image_size,
            "patch_size": config.patch_size,
            "vision_use_head": False,
        },
        mm_tokens_per_image=_tokens_per_image(config),
        boi_token_index=vocab[GEMMA3_IMAGE_TOKENS["boi_token"]],
        eoi_token_index=vocab[GEMMA3_IMAGE_TOKENS["eoi_token"]],
        image_token_index=vocab[GEMMA3_IMAGE_TOKENS["image_token"]],
    )
    # Stop at the end of the model turn or of the text, as gemma-3-*-it's generation_config.json does.
    generation = GenerationConfig(
        eos_token_id=[vocab["<eos>"], vocab["<end_of_turn>"]],
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<bos>"],
    )
    return random_model(Gemma3ForConditionalGeneration, model_config, config.seed, generation)


def build_tiny_gemma3(
    corpus: Iterable[str],
    config: TinyVLMConfig | None = None,
    out_dir: str | Path | None = None,
) -> tuple[Gemma3ForConditionalGeneration, Gemma3Processor]:
    """Tokenizer, processor and random Gemma 3 in one call; saved to ``out_dir`` when given.

    Args:
        corpus: texts to train the tokenizer on.
        config: sizes (:class:`~pipelines.vlm.tiny.TinyVLMConfig`; ``merge_size`` is the projector's pooling).
        out_dir: directory to ``save_pretrained`` model and processor into.

    Returns:
        ``(model, processor)``.
    """
    config = config or TinyVLMConfig()
    tokenizer = train_gemma_tokenizer(corpus, vocab_size=config.vocab_size)
    processor = build_processor(tokenizer, config)
    model = build_model(tokenizer, config)
    save_tiny(model, processor, out_dir)
    return model, processor
