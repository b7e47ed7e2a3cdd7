"""benchmarks/real_size.py on the VLM recipes, on the CPU: a tiny local VLM folder stands in for a published
model, so the code path a GPU session runs at real size (random weights built from the config, the processor
of ``build_processor``, the recipe's own trainer with the smoke test's data, backend and batch) is checked."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

import benchmarks.real_size as real_size
from benchmarks.real_size import SMOKES, main
from pipelines.vlm.tiny import TinyVLMConfig, build_tiny_vlm
from pipelines.vlm.tiny_gemma3 import build_tiny_gemma3
from pipelines.vlm.tiny_qwen3_vl import build_tiny_qwen3_vl

CORPUS = [
    "How many shapes are left? Think in <think></think>, then give the number in <answer>2</answer>."
] * 20
#: every VLM recipe, with the tiny builder of its family
RECIPES = {
    "configs/vlm/qwen25vl_3b_geometry_group.yaml": build_tiny_vlm,
    "configs/vlm/qwen25vl_3b_geometry_single.yaml": build_tiny_vlm,
    "configs/vlm/qwen3vl_4b_geometry_group.yaml": build_tiny_qwen3_vl,
    "configs/vlm/gemma3_4b_geometry_group.yaml": build_tiny_gemma3,
    "configs/vlm/qwen3vl_30b_a3b_geometry_group.yaml": functools.partial(build_tiny_qwen3_vl, num_experts=4),
}
VLLM = "hf (recipe: vllm; it cannot load a model built in memory)"


@pytest.fixture(autouse=True)
def one_thread():
    # one thread: on a shared, oversubscribed CPU a second thread makes every parallel region wait for it
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_folder(recipe: str, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    RECIPES[recipe](CORPUS, TinyVLMConfig(seed=0), out_dir=folder)
    return folder


def smoke_args(folder: Path, *overrides: str) -> argparse.Namespace:
    """The command line's settings: one prompt, two samples, 64 px images (the tiny processors' size)."""
    return argparse.Namespace(
        prompts=1, images=2, image_size=64, device="cpu", overrides=[f"model.path={folder}", *overrides]
    )


def test_every_vlm_recipe_is_listed():
    assert sorted(RECIPES) == sorted(str(p) for p in Path("configs/vlm").glob("*.yaml"))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_two_steps_of_a_recipe_on_random_weights(recipe, tmp_path):
    folder = tiny_folder(recipe, tmp_path)
    out = tmp_path / "rows.json"
    command = [
        "--device",
        "cpu",
        "--recipes",
        recipe,
        "--steps",
        "2",
        "--image-size",
        "64",
        "--out",
        str(out),
    ]
    rows = main([*command, "--set", f"model.path={folder}", "generation.max_new_tokens=8"])
    (row,) = rows
    assert row["recipe"] == Path(recipe).stem
    assert row["setup_s"] > 0
    assert len(row["step_s"]) == 2 and all(seconds > 0 for seconds in row["step_s"])
    assert row["estimate_resident_gib"] > 0
    # the recipes that roll out with vLLM run transformers' generate, and say so; the others run it already
    uses_vllm = real_size.load_config(real_size.VLMRLVRConfig, recipe, []).generation.backend == "vllm"
    assert row.get("backend") == (VLLM if uses_vllm else None)
    assert not {"after_setup_gib", "after_step_gib", "peak_gib", "skipped"} & row.keys()  # no memory on a CPU
    assert json.loads(out.read_text()) == rows


@pytest.mark.parametrize(
    ("recipe", "prompts"),
    [("configs/vlm/qwen25vl_3b_geometry_group.yaml", 1), ("configs/vlm/qwen25vl_3b_geometry_single.yaml", 2)],
)
def test_smoke_config_keeps_the_recipes_training_settings(recipe, prompts, tmp_path, monkeypatch):
    folder = tiny_folder(recipe, tmp_path)
    cfg, backend = SMOKES["vlm_rlvr"].config(recipe, tmp_path / "unused", smoke_args(folder))
    recipe_cfg = real_size.load_config(real_size.VLMRLVRConfig, recipe, [])
    # the recipe's own: LoRA, dtype, checkpointing, generation length and context, verifiers, loss
    assert cfg.model.lora == recipe_cfg.model.lora and cfg.model.lora.rank == 64
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing
    assert cfg.generation.max_new_tokens == 2048 and cfg.generation.max_model_len == 4096
    assert [r.name for r in cfg.rewards] == ["math_verify", "format"]
    assert cfg.trainer == recipe_cfg.trainer.model_copy(
        update={
            "minibatch_size": 2,
            **({"num_generations": 2, "dynamic_sampling": False} if prompts == 1 else {}),
        }
    )
    # the smoke test's: generated questions on real-size images, transformers' generate, 2 samples a step
    assert (cfg.data.train, cfg.data.eval, cfg.data.image_size) == (
        "shapes_math:train",
        "shapes_math:heldout",
        64,
    )
    assert cfg.generation.backend == "hf" and backend == VLLM
    assert cfg.allocation.prompts_per_step == prompts and cfg.rollouts_per_step == 2
    # the recipe names no family: the trainer reads a published id's from its embedded config, not from the Hub
    import transformers

    def offline(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    assert recipe_cfg.model.family is None and recipe_cfg.model.path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert SMOKES["vlm_rlvr"].trainer(recipe_cfg, None).family.name == "qwen2_5_vl"


def test_the_trainer_builds_random_weights_with_the_processors_ids(tmp_path):
    recipe = "configs/vlm/gemma3_4b_geometry_group.yaml"
    folder = tiny_folder(recipe, tmp_path)
    cfg, _ = SMOKES["vlm_rlvr"].config(recipe, tmp_path / "unused", smoke_args(folder))
    trainer = SMOKES["vlm_rlvr"].trainer(cfg, None)
    trainer.setup()
    saved = AutoModelForImageTextToText.from_pretrained(folder)
    built = trainer.model.get_input_embeddings().weight
    # the folder's architecture in the recipe's dtype, not its weights
    assert built.shape == saved.get_input_embeddings().weight.shape and built.dtype == torch.bfloat16
    assert not torch.equal(built.float(), saved.get_input_embeddings().weight)
    tokenizer = trainer.processor.tokenizer
    assert trainer.model.config.image_token_index == tokenizer.convert_tokens_to_ids("<image_soft_token>")
    trainer.cleanup()


def test_published_sizes_are_no_cpu_check():
    recipes = ["configs/vlm/gemma3_4b_geometry_group.yaml", "configs/vlm/qwen25vl_3b_geometry_single.yaml"]
    rows = main(["--device", "cpu", "--recipes", *recipes])
    # `mmrl memory`'s figures in the recipes' headers (the hf backend holds no vLLM share)
    assert [row["skipped"] for row in rows] == [
        "a 9.8 GiB model is no CPU check (tiny model.path: --set)",
        "a 8.8 GiB model is no CPU check (tiny model.path: --set)",
    ]
    assert all("step_s" not in row for row in rows)


def test_default_recipes_are_every_flow_and_vlm_recipe(monkeypatch):
    measured = []
    monkeypatch.setattr(
        real_size, "measure", lambda recipe, *_: measured.append(recipe) or {"recipe": recipe}
    )
    main(["--device", "cpu"])
    expected = sorted(
        str(p) for folder in ("configs/flow", "configs/vlm") for p in Path(folder).glob("*.yaml")
    )
    assert sorted(measured) == expected and any(r.startswith("configs/vlm/") for r in measured)
