"""The pretraining/SFT recipes as `mmrl train` runs them: their configs (errors name the key), exact resume, and
published folders and checkpoints that load with the real classes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from mmrl.checkpoint import LATEST_FILE
from mmrl.cli import main as cli_main
from mmrl.config import ConfigError, load_config
from mmrl.recipes import get_recipe
from tests.recipes.test_recipe_trajectories import SETTINGS, weights_digest

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "pretrain"
# the shapes model has no VAE and no T5: diffusers wants the missing components named
NO_VAE_NO_T5 = {"vae": None, "text_encoder_3": None, "tokenizer_3": None}
RECIPE_OF = {
    "shapes_flow.yaml": "flow_pretrain_shapes",
    "shapes_flow_w192.yaml": "flow_pretrain_shapes",
    "shapes_vlm.yaml": "vlm_sft_shapes",
    "shapes_vlm_reason.yaml": "vlm_sft_reason",
    "shapes_vlm_reason_slips.yaml": "vlm_sft_reason",
}


@pytest.mark.parametrize("name", sorted(RECIPE_OF))
def test_committed_config_validates_and_errors_name_the_key(name):
    schema = get_recipe(RECIPE_OF[name]).load_config_class()
    cfg = load_config(schema, CONFIGS / name)
    assert cfg.recipe == RECIPE_OF[name] and cfg.out is not None
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.warmup'\. Did you mean 'warmup_steps'\?"):
        load_config(schema, CONFIGS / name, ["trainer.warmup=3"])
    with pytest.raises(ConfigError, match=r"trainer\.batch_size: Input should be greater than or equal to 1"):
        load_config(schema, CONFIGS / name, ["trainer.batch_size=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'data\.nope'"):
        load_config(schema, CONFIGS / name, ["data.nope=1"])
    # `mmrl eval` (a prompt file through a flow/VLM sampler) is for the RL recipes; these re-score with --eval-only
    with pytest.raises(ValueError, match="`mmrl eval` does not apply"):
        get_recipe(RECIPE_OF[name]).load_evaluate()


def _run(tmp_path: Path, script: str, out: Path, extra: list[str]) -> int:
    recipe_name, overrides = SETTINGS[script]
    return cli_main(
        [
            "train",
            str(CONFIGS / next(n for n, r in RECIPE_OF.items() if r == recipe_name)),
            *overrides,
            f"run.output_dir={tmp_path}",
            "run.name=run",
            "run.threads=1",
            "run.progress=false",
            "run.tensorboard=false",
            "run.save_every=2",
            "run.keep_last=4",
            f"out={out}",
            *extra,
        ]
    )


@pytest.mark.parametrize("script", ["pretrain_shapes", "sft_shapes"])
def test_resume_from_a_middle_checkpoint_ends_bit_identical(tmp_path, script):
    _run(tmp_path / "straight", script, tmp_path / "straight_model", [])
    # an interrupted run: its last checkpoint is step 2
    checkpoints = tmp_path / "straight" / "run" / "checkpoints"
    interrupted = tmp_path / "interrupted" / "run"
    shutil.copytree(tmp_path / "straight" / "run", interrupted)
    shutil.rmtree(interrupted / "checkpoints" / "step_00000004")
    (interrupted / "checkpoints" / LATEST_FILE).write_text("step_00000002\n")
    _run(tmp_path / "interrupted", script, tmp_path / "resumed_model", ["run.resume=true"])
    assert weights_digest(tmp_path / "resumed_model") == weights_digest(tmp_path / "straight_model")
    resumed = torch.load(interrupted / "checkpoints" / "step_00000004" / "state.pt", weights_only=False)
    straight = torch.load(checkpoints / "step_00000004" / "state.pt", weights_only=False)
    assert resumed["step"] == 4
    for key in ("losses", "curve"):  # (the VLM trainer's training record)
        assert resumed.get(key) == straight.get(key)


def test_flow_recipe_publishes_a_diffusers_pipeline_with_card(tmp_path):
    out = tmp_path / "model"
    _run(tmp_path, "pretrain_shapes", out, [])
    card = (out / "card.md").read_text()
    assert (
        "strict score" in card
        and "Reproduce the score: `python -m mmrl.flow.pretrain_shapes --eval-only" in card
    )
    assert "- training: 4 steps of batch 4" in card
    for folder in (out, tmp_path / "run" / "checkpoints" / "step_00000002" / "model"):
        pipe = StableDiffusion3Pipeline.from_pretrained(folder, **NO_VAE_NO_T5)
        assert isinstance(pipe, StableDiffusion3Pipeline) and pipe.transformer.config.in_channels == 3
    # the published weights are the EMA, which differs from the trained weights
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000004" / "state.pt", weights_only=False)
    live = state["modules"]["0.proj_out.weight"]
    published = StableDiffusion3Pipeline.from_pretrained(
        out, **NO_VAE_NO_T5
    ).transformer.proj_out.weight.detach()
    torch.testing.assert_close(published, state["ema"]["0.proj_out.weight"], rtol=0, atol=0)
    assert not torch.equal(published, live)


def test_the_width_192_base_was_made_by_its_committed_config():
    schema = get_recipe("flow_pretrain_shapes").load_config_class()
    folder = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_flow_w192"
    assert load_config(schema, folder / "config.yaml") == load_config(
        schema, CONFIGS / "shapes_flow_w192.yaml"
    )
    transformer = StableDiffusion3Pipeline.from_pretrained(folder, **NO_VAE_NO_T5).transformer.config
    assert transformer.num_attention_heads * transformer.attention_head_dim == 192


def test_flow_recipe_continues_a_saved_model_on_the_digits_world(tmp_path):
    out = tmp_path / "digits_model"
    committed = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_flow"
    _run(
        tmp_path,
        "pretrain_shapes",
        out,
        [f"model.init={committed}", "data.digits_share=0.5", "trainer.steps=2"],
    )
    pipe = StableDiffusion3Pipeline.from_pretrained(out, **NO_VAE_NO_T5)
    base = StableDiffusion3Pipeline.from_pretrained(committed, **NO_VAE_NO_T5)
    assert "4</w>" in pipe.tokenizer.get_vocab() and "4</w>" not in base.tokenizer.get_vocab()
    card = (out / "card.md").read_text()
    assert "50% of each batch, signs of the digits world" in card and "OCR score" in card


def test_flow_recipe_trains_on_a_prompt_file_of_one_kind(tmp_path, monkeypatch, capsys):
    """``data.train_prompts``: a file of pair prompts is rendered alone, every batch draws from it."""
    from mmrl.flow.pretrain_shapes import ShapesPretrainer, render_pool

    pairs = ["a photo of a red circle and a blue square", "a photo of a green triangle and a red square"]
    prompt_file = tmp_path / "pairs.txt"
    prompt_file.write_text("\n".join(pairs) + "\n")
    pool = render_pool(6, 0, prompts=pairs)
    assert (
        list(pool) == ["pair"]
        and set(pool["pair"][0]) == set(pairs)
        and pool["pair"][1].shape == (6, 3, 32, 32)
    )
    batches = []
    original = ShapesPretrainer.batch
    monkeypatch.setattr(ShapesPretrainer, "batch", lambda self: batches.append(original(self)) or batches[-1])
    _run(tmp_path, "pretrain_shapes", tmp_path / "model", [f"data.train_prompts={prompt_file}"])
    drawn = {prompt for prompts, _ in batches for prompt in prompts}
    assert len(batches) == 4 and drawn <= {*pairs, ""} and drawn & set(pairs)
    prompt_file.write_text("a photo of a red circle\na photo of a mauve circle\n")
    assert (
        _run(
            tmp_path,
            "pretrain_shapes",
            tmp_path / "model2",
            [f"data.train_prompts={prompt_file}", "run.name=bad"],
        )
        == 2
    )
    assert re.search(r"data\.train_prompts: .*pairs\.txt line 2: .*mauve", capsys.readouterr().err)
