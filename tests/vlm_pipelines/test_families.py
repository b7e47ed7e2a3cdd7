"""The VLM family registry and its first family: Qwen2.5-VL's conventions, detected from the tiny model."""

import re

import pytest
import torch

from mmrl.vlm.config import VLMLora
from pipelines.vlm.families import (
    VLMFamily,
    family_for_model_type,
    get_vlm_family,
    list_vlm_families,
    register_vlm_family,
)
from pipelines.vlm.families.qwen2_5_vl import Qwen25VL
from pipelines.vlm.published import PUBLISHED_CONFIGS, build_on_meta


def test_the_tiny_vlm_is_served_by_the_qwen25vl_family(tiny):
    model, processor = tiny
    family = family_for_model_type(model.config.model_type)
    assert isinstance(family, Qwen25VL) and family.name == "qwen2_5_vl"
    vocab = processor.tokenizer.get_vocab()
    assert family.suppressed_token_ids(processor.tokenizer) == sorted(
        vocab[t]
        for t in ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
    )
    ids = torch.tensor([[1, family.image_token_id(processor), processor.video_token_id, 2]])
    assert family.token_type_ids(ids, processor).tolist() == [[0, 1, 2, 0]]
    assert family.vision_tower(model.model) is model.model.visual
    assert family.is_vision_parameter("model.visual.blocks.0.attn.qkv.weight")
    assert not family.is_vision_parameter("model.language_model.layers.0.self_attn.q_proj.weight")


def test_image_inputs_count_the_tokens_the_processor_expands(tiny, prompts):
    _, processor = tiny
    family = get_vlm_family("qwen2_5_vl")
    image = prompts[0].images[0]
    tensors, tokens = family.image_inputs(processor, [image, image])
    features = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt"
    )
    expanded = int((features["input_ids"] == processor.image_token_id).sum())
    assert tokens == [expanded, expanded] and set(tensors) == {"pixel_values", "image_grid_thw"}


def test_lora_pattern_skips_the_vision_tower_unless_trained():
    pattern = get_vlm_family("qwen2_5_vl").lora_target_pattern(["q_proj", "out.0"], train_vision=False)
    assert re.fullmatch(pattern, "model.language_model.layers.0.self_attn.q_proj")
    assert re.fullmatch(pattern, "model.language_model.layers.0.out.0")
    assert not re.fullmatch(pattern, "model.language_model.layers.0.out.01")
    assert not re.fullmatch(pattern, "model.visual.blocks.0.attn.q_proj")


@pytest.mark.parametrize("model_id", list(PUBLISHED_CONFIGS))
def test_a_trained_vision_tower_gets_lora_on_every_linear_layer_of_the_published_models(model_id):
    """With ``model.train_vision`` LoRA adapts every linear layer of the tower (EasyR1's all-linear; Qwen3-VL's
    are named qkv, proj, linear_fc1/2, none of the language model's names) and the language model's targets,
    without it none of the tower's; counted on the published architectures built on the meta device."""
    model = build_on_meta(model_id)
    family = family_for_model_type(model.config.model_type)
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    vision = {name for name in linear if family.is_vision_parameter(name)}
    language = {name for name in linear if name not in vision and not name.endswith("lm_head")}
    targets = VLMLora().target_modules
    assert vision and language
    for train_vision in (False, True):
        pattern = family.lora_target_pattern(targets, train_vision)
        adapted = {name for name in linear if re.fullmatch(pattern, name)}
        assert adapted & language == language
        assert adapted & vision == (vision if train_vision else set())


def test_registry_names_what_is_available():
    assert "qwen2_5_vl" in list_vlm_families()
    with pytest.raises(KeyError, match=r"Available: \[.*'qwen2_5_vl'"):
        get_vlm_family("llava")
    with pytest.raises(ValueError, match="no VLM family serves model_type 'llava'"):
        family_for_model_type("llava")
    with pytest.raises(ValueError, match="already registered"):
        register_vlm_family("qwen2_5_vl")(type("Other", (Qwen25VL,), {}))


def test_a_new_family_is_one_decorated_class():
    @register_vlm_family("test_text_first")
    class TextFirst(Qwen25VL):
        model_types = ("test_text_first",)

        def prompt(self, question, images=(), *, system=None, prompt_id=None):
            prompt = super().prompt(question, images, system=system, prompt_id=prompt_id)
            content = prompt.messages[-1]["content"]
            prompt.messages[-1]["content"] = content[-1:] + content[:-1]  # the question before the images
            return prompt

    family = family_for_model_type("test_text_first")
    assert isinstance(family, VLMFamily) and family.name == "test_text_first"
    prompt = family.prompt("how many?", [object()])
    assert [item["type"] for item in prompt.messages[-1]["content"]] == ["text", "image"]
