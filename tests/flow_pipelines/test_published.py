"""The published flow-model configs build on meta at their published sizes; local and downloaded pipelines
read back exactly what loading them gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch

from pipelines.flow.adapters import ShapesAdapter, get_adapter
from pipelines.flow.published import PUBLISHED, Component, build_on_meta, component_configs
from pipelines.flow.tiny import TINY_LOAD_KWARGS

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_flow"

B, M = 1e9, 1e6
SD35, FLUX1 = "stabilityai/stable-diffusion-3.5-medium", "black-forest-labs/FLUX.1-dev"
FLUX2, KLEIN = "black-forest-labs/FLUX.2-dev", "black-forest-labs/FLUX.2-klein-9B"
QWEN, ZIMAGE = "Qwen/Qwen-Image", "Tongyi-MAI/Z-Image-Turbo"
SANA = "Efficient-Large-Model/Sana_1600M_1024px_diffusers"
WAN21, WAN22 = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"

# (repo, component) -> (published parameter count, relative tolerance, source). The tolerance is 1% wherever
# the source gives the figure to that precision; the headline figures that are nominal (a model's name) carry
# the tolerance they support, said beside them. VAEs have no published count except FLUX.2's.
PUBLISHED_SIZES: dict[tuple[str, str], tuple[float, float, str]] = {
    # SD3.5 medium's transformer: see test_sd35_medium_counts_its_stored_positional_table
    (SD35, "text_encoder"): (123 * M, 0.01, "CLIP ViT-L/14 text tower: 123 M"),
    (SD35, "text_encoder_2"): (695 * M, 0.01, "OpenCLIP ViT-bigG/14 text tower: 695 M"),
    (SD35, "text_encoder_3"): (4.76 * B, 0.01, "T5 v1.1 XXL encoder: 4.76 B"),
    (FLUX1, "transformer"): (11.9 * B, 0.01, "FLUX.1 [dev] release: 11.9 B (12 B on the model card)"),
    (FLUX1, "text_encoder"): (123 * M, 0.01, "CLIP ViT-L/14 text tower: 123 M"),
    (FLUX1, "text_encoder_2"): (4.76 * B, 0.01, "T5 v1.1 XXL encoder: 4.76 B"),
    (FLUX2, "transformer"): (32 * B, 0.01, "FLUX.2 [dev] model card: 32 B"),
    (FLUX2, "text_encoder"): (24 * B, 0.01, "Mistral Small 3.1 / 3.2 model cards: 24 B"),
    # the count a public FLUX.2 [klein] VAE loader reports from the released weights
    (FLUX2, "vae"): (84_046_115, 0.01, "AutoencoderKLFlux2 released weights"),
    (KLEIN, "transformer"): (9 * B, 0.01, "FLUX.2 [klein] 9B model card: 9 B flow model"),
    (KLEIN, "text_encoder"): (8.2 * B, 0.01, "Qwen3-8B model card: 8.2 B"),
    (KLEIN, "vae"): (84_046_115, 0.01, "AutoencoderKLFlux2 released weights"),
    (QWEN, "transformer"): (20.43 * B, 0.01, "Qwen-Image: 20.43 B (Hub parameter count; 20 B on the card)"),
    (QWEN, "text_encoder"): (8.29 * B, 0.01, "Qwen2.5-VL-7B-Instruct: 8.29 B (Hub parameter count)"),
    (ZIMAGE, "transformer"): (6.15 * B, 0.01, "Z-Image: 6.15 B (6 B on the model card)"),
    (ZIMAGE, "text_encoder"): (4.0 * B, 0.01, "Qwen3-4B model card: 4.0 B"),
    (SANA, "transformer"): (1.6 * B, 0.01, "SANA paper (arXiv 2410.10629): Sana-1.6B"),
    (SANA, "text_encoder"): (2.61 * B, 0.01, "Gemma 2 report (arXiv 2408.00118): 2B model, 2.61 B"),
    # "1.3B" is the model's name: the released DiT has 1.42 B parameters (5.68 GB in float32), hence 10%
    (WAN21, "transformer"): (1.3 * B, 0.10, "Wan2.1 model name (nominal)"),
    (WAN21, "text_encoder"): (5.7 * B, 0.01, "UMT5-XXL encoder: ~5.7 B"),
    # "A14B": 14 B active per step, nominal; each released expert has 14.29 B (as Wan2.1 14B), hence 3%
    (WAN22, "transformer"): (14 * B, 0.03, "Wan2.2 A14B model card (nominal)"),
    (WAN22, "transformer_2"): (14 * B, 0.03, "Wan2.2 A14B model card (nominal)"),
    (WAN22, "text_encoder"): (5.7 * B, 0.01, "UMT5-XXL encoder: ~5.7 B"),
}

# Regression guard: the exact unique-parameter counts of the installed classes (diffusers 0.42.1, transformers
# 5.24.0) built from the embedded configs; a change means a config value or a library's layout changed.
EXACT_SIZES: dict[str, dict[str, int]] = {
    SD35: {
        "transformer": 2_243_171_520,
        "text_encoder": 123_650_304,
        "text_encoder_2": 694_659_840,
        "text_encoder_3": 4_762_310_656,
        "vae": 83_819_683,
    },
    FLUX1: {
        "transformer": 11_901_408_320,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
        "vae": 83_819_683,
    },
    FLUX2: {
        "transformer": 32_223_281_152,
        "text_encoder": 24_011_361_280,
        "vae": 84_046_115,
    },
    KLEIN: {
        "transformer": 9_078_581_248,
        "text_encoder": 8_190_735_360,
        "vae": 84_046_115,
    },
    QWEN: {
        "transformer": 20_430_401_088,
        "text_encoder": 8_292_166_656,
        "vae": 126_892_531,
    },
    ZIMAGE: {
        "transformer": 6_154_908_736,
        "text_encoder": 4_022_468_096,
        "vae": 83_819_683,
    },
    SANA: {
        "transformer": 1_604_462_752,
        "text_encoder": 2_614_341_888,
        "vae": 312_250_275,
    },
    WAN21: {
        "transformer": 1_418_996_800,
        "text_encoder": 5_680_910_336,
        "vae": 126_892_531,
    },
    WAN22: {
        "transformer": 14_288_491_584,
        "transformer_2": 14_288_491_584,
        "text_encoder": 5_680_910_336,
        "vae": 126_892_531,
    },
}


def num_parameters(module: torch.nn.Module) -> int:
    """Unique parameters (``parameters()`` yields a tied weight once)."""
    return sum(p.numel() for p in module.parameters())


def signature(module: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of every parameter and buffer."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors}


@pytest.fixture(scope="module")
def published_models():
    """``{repo: {component: module on meta}}`` of every embedded pipeline, bfloat16, built once."""
    return {repo: build_on_meta(repo) for repo in PUBLISHED}


def test_every_recipe_model_is_embedded():
    paths = set()
    for recipe in (Path(__file__).resolve().parents[2] / "configs" / "flow").glob("*.yaml"):
        paths.update(
            line.split("path:")[1].strip() for line in recipe.read_text().splitlines() if " path: " in line
        )
    assert paths and paths <= set(PUBLISHED)


@pytest.mark.parametrize("repo", list(PUBLISHED))
def test_published_models_build_on_meta_at_their_published_sizes(published_models, repo):
    models = published_models[repo]
    assert set(models) == set(EXACT_SIZES[repo])
    for name, module in models.items():
        assert isinstance(module, torch.nn.Module)
        tensors = [*module.parameters(), *module.buffers()]
        assert all(t.device.type == "meta" for t in tensors), name  # nothing allocated
        assert {p.dtype for p in module.parameters()} <= {torch.bfloat16, torch.float32}
        count = num_parameters(module)
        assert count == EXACT_SIZES[repo][name], (name, count)
        if (repo, name) in PUBLISHED_SIZES:
            figure, rel_tol, source = PUBLISHED_SIZES[repo, name]
            assert abs(count - figure) <= rel_tol * figure, (name, count, figure, source)


def test_sd35_medium_counts_its_stored_positional_table(published_models):
    # "2.5 billion parameters" (stabilityai/stable-diffusion-3.5-medium model card, Stability AI's SD3.5
    # announcement) counts every stored tensor of the MMDiT-X. diffusers keeps the 384x384 positional table as
    # a persistent buffer, not a parameter: 2.243 B parameters + 0.226 B table = 2.470 B stored, which is the
    # card's figure at the precision it is given (two digits; 1.2% below 2.5 B)
    transformer = published_models[SD35]["transformer"]
    table = transformer.pos_embed.pos_embed
    assert table.shape == (1, 384 * 384, 1536)
    assert round((num_parameters(transformer) + table.numel()) / B, 1) == 2.5


def test_wan_keeps_its_float32_modules_in_float32(published_models):
    expert = published_models[WAN22]["transformer_2"]
    assert expert.scale_shift_table.dtype == torch.float32  # _keep_in_fp32_modules, as from_pretrained does
    assert expert.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16


def test_component_configs_are_fresh_copies():
    configs = component_configs(FLUX1)
    assert isinstance(configs["vae"], Component) and configs["vae"].class_name == "AutoencoderKL"
    configs["vae"].config["latent_channels"] = 4
    assert component_configs(ZIMAGE)["vae"].config["latent_channels"] == 16
    assert component_configs(FLUX1)["vae"].config["latent_channels"] == 16


@pytest.mark.parametrize("family", list(TINY_LOAD_KWARGS))
def test_local_pipeline_matches_the_loaded_one(saved_pipelines, family):
    directory = str(saved_pipelines[family])
    pipe = (
        get_adapter(family)
        .from_pretrained(directory, torch_dtype=torch.bfloat16, **TINY_LOAD_KWARGS[family])
        .pipe
    )
    loaded = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    built = build_on_meta(directory, torch.bfloat16)
    assert set(built) == set(loaded)
    for name, module in built.items():
        assert type(module) is type(loaded[name])
        assert num_parameters(module) == num_parameters(loaded[name])
        assert signature(module) == signature(loaded[name]), name


def test_shapes_checkpoint_matches_the_loaded_one():
    pipe = ShapesAdapter.from_pretrained(str(CHECKPOINT)).pipe
    built = build_on_meta(str(CHECKPOINT), torch.float32)
    # the shapes model is pixel-space: no VAE (saved as [null, null]) and no T5
    assert set(built) == {"transformer", "text_encoder", "text_encoder_2"}
    for name, module in built.items():
        assert num_parameters(module) == num_parameters(getattr(pipe, name))
        assert signature(module) == signature(getattr(pipe, name)), name


def test_unknown_hub_id_downloads_only_configs(saved_pipelines, monkeypatch, tmp_path):
    # A Hub repository is read through hf_hub_download of model_index.json and <component>/config.json only
    source = Path(saved_pipelines["flux2_klein"])
    requested = []

    def fake_download(repo_id, filename, subfolder=None, **kwargs):
        requested.append(f"{subfolder}/{filename}" if subfolder else filename)
        target = tmp_path / requested[-1]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / requested[-1], target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    configs = component_configs("someone/tiny-klein")
    assert sorted(requested) == [
        "model_index.json",
        "text_encoder/config.json",
        "transformer/config.json",
        "vae/config.json",
    ]
    assert configs == component_configs(str(source))
    assert configs["transformer"].config == json.loads((source / "transformer" / "config.json").read_text())


def test_unknown_hub_id_without_network_names_the_id(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(OSError, match="someone/not-a-pipeline") as caught:
        build_on_meta("someone/not-a-pipeline")
    assert "no such folder" in str(caught.value) and "Hugging Face Hub" in str(caught.value)
    assert "ConnectionError: no network" in str(caught.value)
