"""The published VLM architectures on the meta device: class, size, language model / vision tower split; the
local-folder path on the tiny models and the committed checkpoints; an unknown Hub id without network."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pipelines.vlm.published as published
from pipelines.vlm.families import family_for_model_type
from pipelines.vlm.published import PUBLISHED_CONFIGS, build_on_meta, model_config
from pipelines.vlm.tiny import TinyVLMConfig
from pipelines.vlm.tiny_gemma3 import build_tiny_gemma3
from pipelines.vlm.tiny_qwen3_vl import build_tiny_qwen3_vl

REPO = Path(__file__).resolve().parents[2]

#: Hub id -> (family, published parameter count, exact totals computed with transformers 5.24 as a regression
#: guard: (total, language model, vision tower)). Unique parameters, tied embeddings counted once.
EXPECTED = {
    # 3.75 B: the Hub page's count for Qwen/Qwen2.5-VL-3B-Instruct (the Hub is not reachable from the tests).
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", 3.75e9, (3_754_622_976, 3_085_938_688, 668_684_288)),
    # 4.44 B: the Hub page's count for Qwen/Qwen3-VL-4B-Instruct ("4.44B parameters", mixpeek.com model page).
    "Qwen/Qwen3-VL-4B-Instruct": ("qwen3_vl", 4.44e9, (4_437_815_808, 4_022_468_096, 415_347_712)),
    # 31.1 B: the Hub page's count for Qwen/Qwen3-VL-30B-A3B-Instruct as model listings quote it ("Parameters
    # 31.07"; 0.1 % from the count, within the 1 % the check allows for a rounded figure); a dump of the
    # checkpoint's safetensors sums to exactly 31,070,754,032. Its LM head is untied (counted apart).
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (
        "qwen3_vl",
        31.1e9,
        (31_070_754_032, 30_220_957_696, 538_631_408),
    ),
    # 4.3 B: the google/gemma-3-4b-it model card ("4.3 billion parameter multimodal model").
    "google/gemma-3-4b-it": ("gemma3", 4.3e9, (4_300_079_472, 3_880_263_168, 416_866_032)),
}


def unique_count(module: torch.nn.Module) -> int:
    """Parameters of ``module``, a tied (shared) tensor counted once (``parameters()`` deduplicates)."""
    return sum(p.numel() for p in module.parameters())


def test_every_published_config_has_expectations():
    assert sorted(PUBLISHED_CONFIGS) == sorted(EXPECTED)


#: Hub ids whose config.json sets tie_word_embeddings false: the checkpoint saves lm_head.weight on its own.
UNTIED = {"Qwen/Qwen3-VL-30B-A3B-Instruct"}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def real(request):
    """(hub id, model built on meta in bfloat16)."""
    return request.param, build_on_meta(request.param)


def test_builds_on_meta_in_bfloat16_as_the_family_class(real):
    model_id, model = real
    family_name, _, _ = EXPECTED[model_id]
    family = family_for_model_type(model.config.model_type)
    assert family.name == family_name
    # the published architecture is the class the backends load (AutoModelForImageTextToText) for its
    # model_type
    assert type(model).__name__ == PUBLISHED_CONFIGS[model_id]["architectures"][0]
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    # the published checkpoints tie the LM head to the input embeddings, but for the 30B-A3B's
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (model_id not in UNTIED)


def test_parameter_count_matches_the_published_figure(real):
    model_id, model = real
    _, published_count, (total, _, _) = EXPECTED[model_id]
    count = unique_count(model)
    assert abs(count - published_count) / published_count < 0.01, (model_id, count)
    assert count == total


def test_language_model_and_vision_tower_split(real):
    model_id, model = real
    _, _, (total, language, vision) = EXPECTED[model_id]
    family = family_for_model_type(model.config.model_type)
    tower = family.vision_tower(model.model)
    assert unique_count(model.model.language_model) == language
    assert unique_count(tower) == vision
    # the family's name test agrees with the module split; what is left over is the projector outside the
    # tower
    named_vision = sum(p.numel() for n, p in model.named_parameters() if family.is_vision_parameter(n))
    assert named_vision == vision
    # an untied LM head is a [vocab, hidden] matrix of its own, outside model.model
    text = model.config.get_text_config()
    head = text.vocab_size * text.hidden_size if model_id in UNTIED else 0
    assert unique_count(model.lm_head) == text.vocab_size * text.hidden_size
    projector = total - language - vision - head
    assert projector == (
        2_950_272 if family.name == "gemma3" else 0
    )  # Qwen's merger sits inside model.visual


def test_mixture_of_experts_activates_its_published_share():
    """Qwen3-VL-30B-A3B runs 8 of its 128 experts per token in each of its 48 layers: about 3 B of its 31 B
    parameters ("A3B"), as its text-only twin Qwen3-30B-A3B's card states (3.3 B activated of 30.5 B)."""
    model = build_on_meta("Qwen/Qwen3-VL-30B-A3B-Instruct")
    text = model.config.text_config
    L, E, k = text.num_hidden_layers, text.num_experts, text.num_experts_per_tok
    per_expert = 3 * text.hidden_size * text.moe_intermediate_size  # gate, up and down projections
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert experts == L * E * per_expert
    language = unique_count(model.model.language_model) + unique_count(model.lm_head)
    active = language - L * (E - k) * per_expert
    assert active == 3_353_032_704
    assert abs(active - 3.3e9) / 3.3e9 < 0.02
    assert abs(language - 30.5e9) / 30.5e9 < 0.01


def test_dtype_is_honoured():
    model = build_on_meta("Qwen/Qwen3-VL-4B-Instruct", torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_published_table_is_not_mutated_by_building():
    before = json.dumps(PUBLISHED_CONFIGS, sort_keys=True)
    for model_id in PUBLISHED_CONFIGS:
        model_config(model_id)
    assert json.dumps(PUBLISHED_CONFIGS, sort_keys=True) == before


@pytest.fixture(scope="module")
def tiny_folders(tiny, corpus, tmp_path_factory):
    """name -> (folder, loaded model): the conftest's tiny Qwen2.5-VL saved, a tiny Qwen3-VL and Gemma 3."""
    torch.set_num_threads(1)
    folders = {}
    model, processor = tiny
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    folders["qwen2_5_vl"] = (path, model)
    for name, build in (("qwen3_vl", build_tiny_qwen3_vl), ("gemma3", build_tiny_gemma3)):
        path = tmp_path_factory.mktemp(name)
        folders[name] = (path, build(corpus, TinyVLMConfig(seed=0), out_dir=path)[0])
    return folders


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_local_folder_gives_the_loaded_models_size(tiny_folders, name):
    path, model = tiny_folders[name]
    meta = build_on_meta(str(path), torch.float32)
    assert type(meta) is type(model)
    assert unique_count(meta) == unique_count(model)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    assert {n: p.shape for n, p in meta.named_parameters()} == shapes


@pytest.mark.parametrize("folder", sorted(p.name for p in (REPO / "checkpoints").glob("shapes_vlm*")))
def test_committed_checkpoints_build_to_their_saved_size(folder):
    path = REPO / "checkpoints" / folder
    meta = build_on_meta(str(path))
    with safe_open(str(path / "model.safetensors"), framework="pt") as saved:
        names = saved.keys()  # (the handle itself is not iterable)
        saved_count = sum(math.prod(saved.get_slice(name).get_shape()) for name in names)
    # (a tied LM head is saved once, as parameters() counts it)
    assert unique_count(meta) == saved_count


def test_unknown_hub_id_without_network_names_the_id(monkeypatch):
    calls = []

    def offline(repo_id, *args, **kwargs):
        calls.append(repo_id)
        from huggingface_hub.errors import LocalEntryNotFoundError

        raise LocalEntryNotFoundError("no network in this test")

    # the two ways transformers downloads a config file: neither reaches the network here
    monkeypatch.setattr("transformers.utils.hub.hf_hub_download", offline)
    monkeypatch.setattr("transformers.utils.hub.snapshot_download", offline)
    model_id = "mmrl-tests/no-such-vlm-7b"
    with pytest.raises(OSError, match="mmrl-tests/no-such-vlm-7b"):
        model_config(model_id)
    with pytest.raises(OSError, match="mmrl-tests/no-such-vlm-7b"):
        build_on_meta(model_id)
    assert calls and set(calls) == {model_id}
    assert model_id not in published.PUBLISHED_CONFIGS


def test_a_text_only_model_type_is_refused(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no VLM family serves model_type 'qwen2'"):
        build_on_meta(str(tmp_path))
