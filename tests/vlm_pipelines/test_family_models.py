"""Every registered VLM family on its tiny random model: generate, log-prob recomputation, multi-image prompts,
LoRA save/load. The tiny models are the real transformers classes built from their configs."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForImageTextToText, AutoProcessor

from mmrl.config import ConfigError, load_config
from mmrl.vlm.config import VLMRLVRConfig
from pipelines.vlm.backend import SamplingParams
from pipelines.vlm.families import family_for_model_type, get_vlm_family, list_vlm_families
from pipelines.vlm.hf_backend import HFBackend
from pipelines.vlm.inputs import prepare_prompts
from pipelines.vlm.logprobs import build_scoring_batch, completion_token_stats
from pipelines.vlm.tiny import TinyVLMConfig, build_tiny_vlm
from pipelines.vlm.tiny_gemma3 import build_tiny_gemma3
from pipelines.vlm.tiny_qwen3_vl import build_tiny_qwen3_vl

BUILDERS = {"qwen2_5_vl": build_tiny_vlm, "qwen3_vl": build_tiny_qwen3_vl, "gemma3": build_tiny_gemma3}
#: the tiny model of each checkpoint kind a family serves (a family may serve several model types)
MODELS = {
    "qwen2_5_vl": build_tiny_vlm,
    "qwen3_vl": build_tiny_qwen3_vl,
    "qwen3_vl_moe": functools.partial(build_tiny_qwen3_vl, num_experts=4),
    "gemma3": build_tiny_gemma3,
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_every_shipped_family_has_a_tiny_model_here():
    # (families registered by other tests live in test modules)
    shipped = [n for n in list_vlm_families() if type(get_vlm_family(n)).__module__.startswith("pipelines.")]
    assert sorted(BUILDERS) == shipped


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory, corpus):
    """(family name, model, processor, directory) of a tiny model saved and reloaded through the Auto classes."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    MODELS[request.param](corpus, TinyVLMConfig(seed=0), out_dir=path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    assert model.config.model_type == request.param
    return family_for_model_type(request.param).name, model, AutoProcessor.from_pretrained(path), path


@pytest.fixture(scope="module")
def mixed_prompts(saved, scene):
    """Two images, one image (32 px, upsampled), no image: the image counts a batch must handle together."""
    family = family_for_model_type(saved[1].config.model_type)
    return [
        family.prompt(
            "is the red square left of the blue one?", [scene((220, 20, 20)), scene((20, 20, 220))]
        ),
        family.prompt("what colour is the square?", [scene((20, 200, 20), size=32)], prompt_id="one"),
        family.prompt("how many red circles are there?", prompt_id="none"),
    ]


def _batch(processor, family, result, prompts):
    """The scoring batch of a generation result's samples."""
    return build_scoring_batch(
        processor,
        [s.prompt_token_ids for s in result.samples],
        [s.completion_token_ids for s in result.samples],
        [prompts[s.prompt_index].images for s in result.samples],
        family=family,
    )


def _stats(model, processor, family, backend, result, prompts, temperature):
    batch = _batch(processor, family, result, prompts)
    return completion_token_stats(
        model, batch, temperature=temperature, suppressed_token_ids=backend.suppressed_token_ids
    )


def test_family_is_detected_with_its_vision_tokens_and_tower(saved):
    name, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    assert family.name == name
    vocab = processor.tokenizer.get_vocab()
    assert family.suppressed_token_ids(processor.tokenizer) == sorted(
        vocab[token] for token in family.vision_special_tokens
    )
    image_token = family.image_token_id(processor)
    config_image_token = getattr(model.config, "image_token_id", None) or model.config.image_token_index
    assert image_token == config_image_token  # the id the model fills with image features
    ids = torch.tensor([[vocab[processor.tokenizer.eos_token], image_token, image_token]])
    assert family.token_type_ids(ids, processor).tolist() == [[0, 1, 1]]
    tower = family.vision_tower(model.model)
    assert tower is not None and any(family.is_vision_parameter(n) for n, _ in model.named_parameters())
    vision = {id(p) for p in tower.parameters()}
    for parameter_name, parameter in model.named_parameters():
        assert family.is_vision_parameter(parameter_name) == (id(parameter) in vision), parameter_name


def test_tiny_tokenizer_round_trips_unseen_text(saved):
    tokenizer = saved[2].tokenizer
    text = "Naïve café: 3 × 4 = 12 ✓"  # none of it in the training corpus
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and tokenizer.unk_token_id not in ids


def test_prompt_layout_expands_one_image_region_per_image(saved, mixed_prompts):
    _, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    prepared, skipped = prepare_prompts(processor, mixed_prompts)
    assert not skipped
    _, tokens = family.image_inputs(processor, mixed_prompts[0].images)
    image_token = family.image_token_id(processor)
    counts = [prompt.input_ids.count(image_token) for prompt in prepared]
    assert counts == [sum(tokens), tokens[0], 0] and tokens[0] == tokens[1] > 0
    bos = processor.tokenizer.bos_token_id
    for prompt in prepared:  # a template that writes <bos> gets no second one from the tokenizer
        assert prompt.input_ids[:2].count(bos) <= 1 if bos is not None else True
    # the text vLLM is given tokenizes, with the special tokens vLLM adds, to the ids the policy scores
    for prompt in prepared:
        as_vllm = processor(text=[prompt.text], images=prompt.images or None, padding=False)["input_ids"][0]
        assert list(as_vllm) == prompt.input_ids


def test_image_placeholders_interleave_the_image_regions_with_the_text(saved, scene):
    _, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    images = [scene((220, 20, 20)), scene((20, 20, 220))]
    [prepared], _ = prepare_prompts(
        processor, [family.prompt("compare <image> with <image>: which is red?", images)]
    )
    assert "<image>" not in prepared.text
    image_token = family.image_token_id(processor)
    ids = prepared.input_ids
    first = ids.index(image_token)
    last_of_first = first + family.image_inputs(processor, images[:1])[1][0] - 1
    second = ids.index(image_token, last_of_first + 1)
    decode = processor.tokenizer.decode
    assert "compare" in decode(ids[:first]) and "with" not in decode(ids[:first])
    assert "with" in decode(ids[last_of_first + 1 : second]) and "which" not in decode(ids[:second])
    assert "which is red?" in decode(ids[second:])
    with pytest.raises(ValueError, match="2 <image> placeholder"):
        family.prompt("<image> or <image>?", images[:1])


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["t1", "t0.7", "greedy"])
def test_recomputed_logprobs_match_generate_with_multi_image_prompts(saved, mixed_prompts, temperature):
    _, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    backend = HFBackend(model, processor)
    n = 1 if temperature == 0 else 2
    result = backend.generate(
        mixed_prompts, SamplingParams(temperature=temperature, max_new_tokens=8, n=n, seed=5)
    )
    assert sorted({s.prompt_index for s in result.samples}) == [0, 1, 2]
    with torch.no_grad():
        stats = _stats(model, processor, family, backend, result, mixed_prompts, temperature or 1.0)
    for row, sample in enumerate(result.samples):
        T = len(sample.completion_token_ids)
        assert not set(sample.completion_token_ids) & set(backend.suppressed_token_ids)
        torch.testing.assert_close(stats.logprobs[row, :T], sample.logprobs, rtol=0, atol=1e-5)


def test_a_shared_prompt_scores_as_the_whole_rows_with_its_vision_work_done_once(saved, mixed_prompts):
    # Three completions per prompt (two images, one image, none): scoring each distinct prompt once and the
    # completions on its key/value states gives the whole rows' log-probs, entropies and parameter gradients (float
    # rounding apart), with the vision tower run on each prompt's images once; a family without position ids
    # (Gemma 3) scores the whole rows.
    _, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    backend = HFBackend(model, processor)
    result = backend.generate(mixed_prompts, SamplingParams(max_new_tokens=8, n=3, seed=6))
    batch = _batch(processor, family, result, mixed_prompts)
    assert batch.prompt_rows.tolist() == [0, 3, 6]
    assert batch.prompt_of_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    patches = []
    vision = family.vision_tower(model.model)
    hook = vision.register_forward_hook(  # rows of its first tensor input: image patches (Qwen) or images
        lambda _m, args, kwargs, _out: patches.append(
            next(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)).shape[0]
        ),
        with_kwargs=True,
    )
    weights = torch.linspace(-1.0, 1.0, batch.completion_ids.numel()).view_as(batch.completion_ids)
    runs = {}
    try:
        for share in (False, True):
            model.zero_grad(set_to_none=True)
            stats = completion_token_stats(
                model, batch, suppressed_token_ids=backend.suppressed_token_ids, share_prompts=share
            )
            (stats.logprobs * weights).sum().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            runs[share] = stats, grads
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    (whole, whole_grads), (shared, shared_grads) = runs[False], runs[True]
    for name in ("logprobs", "entropy", "sampled_entropy"):
        torch.testing.assert_close(getattr(shared, name), getattr(whole, name), rtol=0, atol=1e-5)
    assert torch.equal(shared.mask, whole.mask)
    assert shared_grads.keys() == whole_grads.keys() and any(family.vision_module in n for n in whole_grads)
    for name, grad in whole_grads.items():
        assert (shared_grads[name] - grad).norm() <= 1e-4 * grad.norm() + 1e-8, name
    if family.position_ids(model.model, batch.model_inputs) is None:
        assert patches[0] == patches[1] and torch.equal(shared.logprobs, whole.logprobs)
    else:
        assert patches[1] * 3 == patches[0] > 0  # every prompt's images once instead of once per completion


def test_token_types_matter_to_the_scoring_forward(saved, mixed_prompts):
    # Dropping the family's token types changes the log-probs or is refused (3-D positions for Qwen, bidirectional image
    # attention for Gemma 3), so the match above is not a coincidence of the tiny model.
    _, model, processor, _ = saved
    family = family_for_model_type(model.config.model_type)
    backend = HFBackend(model, processor)
    result = backend.generate(mixed_prompts[:1], SamplingParams(max_new_tokens=6, seed=2))
    batch = build_scoring_batch(
        processor,
        [s.prompt_token_ids for s in result.samples],
        [s.completion_token_ids for s in result.samples],
        [mixed_prompts[0].images],
        family=family,
    )
    with torch.no_grad():
        kept = completion_token_stats(model, batch).logprobs
        batch.model_inputs.pop(family.token_type_key)
        try:
            dropped = completion_token_stats(model, batch).logprobs
        except ValueError as error:  # Qwen3-VL refuses images without them
            assert family.token_type_key in str(error)
        else:
            assert (kept - dropped).abs().max() > 1e-4


def test_lora_outside_the_vision_tower_saves_and_loads(saved, mixed_prompts, tmp_path):
    _, model, processor, path = saved
    family = family_for_model_type(model.config.model_type)
    target = family.lora_target_pattern(LORA_TARGETS, train_vision=False)
    policy = get_peft_model(
        AutoModelForImageTextToText.from_pretrained(path), LoraConfig(r=4, target_modules=target)
    )
    adapted = [name for name, _ in policy.named_parameters() if "lora_B" in name]
    assert adapted and not any(family.is_vision_parameter(name) for name in adapted)
    assert all(re.search(r"\.(q|k|v|o)_proj\.", name) for name in adapted)
    torch.manual_seed(0)
    for name, parameter in policy.named_parameters():
        if "lora_B" in name:  # B starts at zero: make the adapter change the outputs
            torch.nn.init.normal_(parameter, std=0.2)
    policy.eval()
    backend = HFBackend(policy, processor)
    result = backend.generate(mixed_prompts, SamplingParams(max_new_tokens=6, seed=1))
    with torch.no_grad():
        trained = _stats(policy, processor, family, backend, result, mixed_prompts, 1.0).logprobs
        base = _stats(model, processor, family, backend, result, mixed_prompts, 1.0).logprobs
    assert (trained - base).abs().max() > 1e-3
    policy.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(path), tmp_path / "adapter"
    )
    with torch.no_grad():
        reloaded = _stats(loaded.eval(), processor, family, backend, result, mixed_prompts, 1.0).logprobs
    torch.testing.assert_close(reloaded, trained, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[2] / "configs/vlm").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_vlm_recipe_loads_with_a_registered_family(path):
    cfg = load_config(VLMRLVRConfig, path)
    # a recipe that names no family relies on detection, which only the Qwen2.5-VL default can skip reading
    family = cfg.model.family or "qwen2_5_vl"
    assert family in BUILDERS
    stem = {"qwen2_5_vl": "Qwen/Qwen2.5-VL-", "qwen3_vl": "Qwen/Qwen3-VL-", "gemma3": "google/gemma-3-"}[
        family
    ]
    assert cfg.model.path.startswith(stem), (cfg.model.path, family)
    # LoRA recipes adapt the language model alone; a full fine-tune may train the vision tower too
    assert cfg.model.lora is None or not cfg.model.train_vision


def test_a_misspelt_family_fails_at_load_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"model.family='gema3' is not registered. Available: \['gemma3'"):
        load_config(VLMRLVRConfig, None, ["model.family=gema3"])
