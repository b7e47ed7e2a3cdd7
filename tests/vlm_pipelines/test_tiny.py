"""The tiny shapes VLM: tokenizer, processor, image-token budget, save and reload through the Auto classes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, Qwen2_5_VLForConditionalGeneration

from pipelines.vlm.inputs import VLMPrompt, collate_left_padded, prepare_prompts
from pipelines.vlm.tiny import QWEN_SPECIAL_TOKENS, TinyVLMConfig


def test_tokenizer_round_trip(tiny, corpus):
    tokenizer = tiny[1].tokenizer
    unseen = ["an unseen purple hexagon, 3 of them?! ünïcode ✓", "  spaces\tand\nnewlines  "]
    for text in [*sorted(set(corpus)), *unseen]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    # the trained merges compress the task's text well below one token per character
    assert len(tokenizer(corpus[0])["input_ids"]) < len(corpus[0]) / 2


def test_special_tokens_are_single_ids(tiny):
    tokenizer = tiny[1].tokenizer
    for token in QWEN_SPECIAL_TOKENS:
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [
            tokenizer.convert_tokens_to_ids(token)
        ]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("size", [32, 64, 128])
def test_every_square_scene_gives_16_image_tokens(tiny, scene, size):
    # resized to 64x64: (64 / 8-px patches / 2x2 merge)^2 = 16 tokens, whatever the input size
    processor = tiny[1]
    prompt = VLMPrompt.from_question("what colour?", [scene((1, 2, 3), size)])
    prepared, _ = prepare_prompts(processor, [prompt])
    assert prepared[0].input_ids.count(processor.image_token_id) == 16
    assert prepared[0].features["image_grid_thw"].tolist() == [[1, 8, 8]]


def test_config_rejects_bad_sizes():
    with pytest.raises(ValueError, match="image_size=60"):
        TinyVLMConfig(image_size=60)
    with pytest.raises(ValueError, match="even integer >= 8"):
        TinyVLMConfig(hidden_size=36, num_heads=4)


def test_save_and_reload_through_auto_classes(tiny, prompts, tmp_path):
    model, processor = tiny
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)

    processor2 = AutoProcessor.from_pretrained(tmp_path)
    model2 = AutoModelForImageTextToText.from_pretrained(tmp_path).eval()

    assert isinstance(model2, Qwen2_5_VLForConditionalGeneration)
    assert type(processor2) is type(processor)
    assert processor2.chat_template == processor.chat_template
    prepared, _ = prepare_prompts(processor, prompts)
    prepared2, _ = prepare_prompts(processor2, prompts)
    assert [p.input_ids for p in prepared2] == [p.input_ids for p in prepared]
    batch = collate_left_padded(prepared, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        torch.testing.assert_close(model2(**batch).logits, model(**batch).logits)
    assert set(model2.generation_config.eos_token_id) == {
        processor.tokenizer.convert_tokens_to_ids("<|im_end|>"),
        processor.tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }
