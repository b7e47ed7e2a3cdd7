"""A tiny Qwen3-VL built from config: the real ``Qwen3VLForConditionalGeneration`` with random weights.

The Qwen3-VL counterpart of :mod:`pipelines.vlm.tiny`: the same offline byte-level BPE tokenizer and Qwen chat
template (Qwen3-VL keeps Qwen2.5-VL's vision special tokens and chat markup), the real ``Qwen3VLProcessor``, and a
model with a few layers. What differs from Qwen2.5-VL, and so what this exercises:

- the vision tower has learned absolute position embeddings (``num_position_embeddings``, a square grid) on top of
  2-D rotary ones, and no windowed attention;
- *DeepStack*: the features of the vision blocks listed in ``deepstack_visual_indexes`` are added to the hidden
  states of the first language-model layers at the image-token positions;
- interleaved multimodal rotary positions (``mrope_section`` of the temporal/height/width frequencies, written
  ``t h w t h w ...``), and an explicit ``head_dim``.

With ``num_experts > 0`` the language model is the mixture-of-experts one (``Qwen3VLMoeForConditionalGeneration``,
as ``Qwen/Qwen3-VL-30B-A3B-Instruct``): every decoder layer routes each token to ``num_experts_per_tok`` experts.

Saved with ``save_pretrained`` it loads like ``Qwen/Qwen3-VL-2B-Instruct`` through the Auto classes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from transformers import (
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from pipelines.vlm.tiny import (
    CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    TinyVLMConfig,
    qwen_generation_config,
    qwen_vision_token_ids,
    random_model,
    save_tiny,
    train_tokenizer,
)

__all__ = ["build_tiny_qwen3_vl"]


def _processor(tokenizer: Qwen2Tokenizer, config: TinyVLMConfig) -> Qwen3VLProcessor:
    sizes = {"patch_size": config.patch_size, "merge_size": config.merge_size, "temporal_patch_size": 2}
    # Exactly image_size^2 pixels, so every square scene gives the same number of image tokens.
    pixels = {"shortest_edge": config.image_size**2, "longest_edge": config.image_size**2}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes, size=pixels),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**sizes, size=pixels),
        chat_template=CHAT_TEMPLATE,
    )


def _model(
    tokenizer: Qwen2Tokenizer, config: TinyVLMConfig, num_experts: int
) -> Qwen3VLForConditionalGeneration | Qwen3VLMoeForConditionalGeneration:
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    head_dim = config.hidden_size // config.num_heads
    half = head_dim // 2
    # Qwen3-VL's [24, 20, 20] split of 64 rotary frequencies, scaled to this head dim (interleaved t h w).
    spatial = (half - half // 4) // 2
    mrope_section = [half - 2 * spatial, spatial, spatial]
    patches_per_side = config.image_size // config.patch_size
    experts = (
        {
            "num_experts": num_experts,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": config.intermediate_size // 2,
        }
        if num_experts
        else {}
    )
    config_class, model_class = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if num_experts
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    model_config = config_class(
        text_config={
            **experts,
            "vocab_size": len(tokenizer),
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": config.max_position_embeddings,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": mrope_section,
                "mrope_interleaved": True,
                "rope_theta": 10000.0,
            },
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": config.vision_depth + 1,
            "hidden_size": config.vision_hidden_size,
            "intermediate_size": config.vision_intermediate_size,
            "num_heads": config.vision_heads,
            "patch_size": config.patch_size,
            "spatial_merge_size": config.merge_size,
            "temporal_patch_size": 2,
            "out_hidden_size": config.hidden_size,
            # a grid as large as one scene's patches (Qwen3-VL: 48 x 48, interpolated for other sizes)
            "num_position_embeddings": patches_per_side**2,
            # the first block's features are stacked into the first LM layer (Qwen3-VL: blocks 8, 16, 24)
            "deepstack_visual_indexes": [0],
        },
        **qwen_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    return random_model(model_class, model_config, config.seed, qwen_generation_config(ids))


def build_tiny_qwen3_vl(
    corpus: Iterable[str],
    config: TinyVLMConfig | None = None,
    out_dir: str | Path | None = None,
    *,
    num_experts: int = 0,
) -> tuple[Qwen3VLForConditionalGeneration | Qwen3VLMoeForConditionalGeneration, Qwen3VLProcessor]:
    """Tokenizer, processor and random Qwen3-VL in one call; saved to ``out_dir`` when given.

    Args:
        corpus: texts to train the tokenizer on.
        config: sizes (:class:`~pipelines.vlm.tiny.TinyVLMConfig`; the vision tower gets one block more than
            ``vision_depth`` so a DeepStack block sits before the last one).
        out_dir: directory to ``save_pretrained`` model and processor into.
        num_experts: experts per decoder layer; 0 builds the dense model.

    Returns:
        ``(model, processor)``.
    """
    config = config or TinyVLMConfig()
    tokenizer = train_tokenizer(corpus, vocab_size=config.vocab_size)
    processor = _processor(tokenizer, config)
    model = _model(tokenizer, config, num_experts)
    save_tiny(model, processor, out_dir)
    return model, processor
