"""Teaching the committed shapes model the digits world's words keeps what its text encoders say about the shapes
prompts, bit for bit, and gives the digits their own tokens; an extra_eval set is checked like the main one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.data import digits, shapes
from mmrl.flow.config import FlowEvalSet, FlowGRPOConfig
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.tiny import extend_shapes_vocabulary

ROOT = Path(__file__).resolve().parents[2]


def encode(pipe, prompts):
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            device="cpu",
            max_sequence_length=0,
        )
    return embeds, pooled


def test_extension_keeps_shapes_encodings_and_adds_digit_tokens():
    pipe = ShapesAdapter.from_pretrained(str(ROOT / "checkpoints/shapes_flow")).pipe
    kept = [*shapes.sample_prompts(40, 0, "all"), ""]
    before = encode(pipe, kept)
    unknown = pipe.tokenizer.unk_token
    assert unknown in pipe.tokenizer.tokenize(digits.prompt_for("47"))  # the base cannot read digits
    added = extend_shapes_vocabulary(pipe, digits.all_prompts(), shapes.all_prompts())
    assert {f"{d}</w>" for d in "0123456789"} | {'"</w>', "sign</w>", "number</w>"} <= set(added)
    after = encode(pipe, kept)
    for old, new in zip(before, after, strict=True):
        assert torch.equal(old, new)
    tokens = pipe.tokenizer.tokenize(digits.prompt_for("47"))
    assert tokens == [
        "a</w>",
        "sign</w>",
        "with</w>",
        "the</w>",
        "number</w>",
        '"</w>',
        "4</w>",
        "7</w>",
        '"</w>',
    ]
    assert pipe.text_encoder.get_input_embeddings().num_embeddings == len(pipe.tokenizer)
    embeds_47, _ = encode(pipe, [digits.prompt_for("47"), digits.prompt_for("74")])
    assert not torch.allclose(embeds_47[0], embeds_47[1])  # the order of the digits reaches the encoder


def test_extension_refuses_prompts_longer_than_the_positions():
    pipe = ShapesAdapter.from_pretrained(str(ROOT / "checkpoints/shapes_flow")).pipe
    with pytest.raises(ValueError, match="positions"):
        extend_shapes_vocabulary(pipe, ['a big sign with the long number "1234567"'], shapes.all_prompts())


def test_extra_eval_sets_are_checked():
    with pytest.raises(ValueError, match="at least one reward"):
        FlowEvalSet(prompts="shapes:heldout", rewards=[])
    cfg = FlowGRPOConfig.model_validate(
        {"extra_eval": {"shapes": {"prompts": "shapes:heldout@8", "rewards": [{"name": "shapes"}]}}}
    )
    assert cfg.extra_eval["shapes"].num_prompts is None
