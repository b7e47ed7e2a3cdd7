"""The pretraining/SFT recipes train exactly as the scripts they replaced: a few steps of each, with the settings
below, give bit-identical losses and weights to a reference recorded from the scripts (commit c81dc47, the
``--steps``/``--max-steps`` mode, same settings). The weights are those the recipe publishes to ``out``: the
trained model (VLMs) or its EMA (flow). A change of the schedule, the EMA, the batch sampling or the order of
random draws fails here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmrl.config import load_config
from mmrl.recipes import get_recipe

REFERENCE = json.loads((Path(__file__).parent / "reference_trajectories.json").read_text())

# settings of the recorded runs, as recipe overrides
SETTINGS = {
    "pretrain_shapes": (
        "flow_pretrain_shapes",
        [
            "trainer.steps=4",
            "trainer.batch_size=4",
            "trainer.warmup_steps=2",
            "data.cond_dropout=0.25",
            "data.renders_per_kind=8",
            "data.eval_prompts=4",
        ],
    ),
    "sft_shapes": (
        "vlm_sft_shapes",
        [
            "trainer.steps=4",
            "data.train_items=64",
            "data.eval_items=14",
            "trainer.batch_size=4",
            "trainer.warmup_steps=2",
            "data.curriculum=0.5",
            "data.number_words=0.5",
            "trainer.caption_fraction=0.5",
            "trainer.vision_pretrain_steps=2",
        ],
    ),
    "sft_reason": (
        "vlm_sft_reason",
        [
            "trainer.steps=4",
            "data.train_items=64",
            "data.eval_items=7",
            "data.curve_items=7",
            "data.samples=0",
            "trainer.batch_size=4",
            "trainer.warmup_steps=2",
            "trainer.vision_pretrain_steps=2",
            "trainer.eval_every=0",
            "data.max_new_tokens=8",
        ],
    ),
}


def weights_digest(folder: Path) -> tuple[str, int]:
    """sha256 over the published safetensors (every tensor, sorted by ``subfolder/name``) and the tensor count."""
    state = {}
    for file in sorted(folder.rglob("*.safetensors")):
        prefix = "" if file.parent == folder else f"{file.parent.name}/"
        state.update({prefix + name: value for name, value in load_file(file).items()})
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(state[name].float().contiguous().numpy().tobytes())
    return digest.hexdigest(), len(state)


def run_recording_losses(monkeypatch, recipe_name: str, overrides: list[str], tmp_path: Path) -> list[float]:
    """Run the recipe; return the value of every loss it backpropagated, in order."""
    losses: list[float] = []
    backward = torch.Tensor.backward

    def recording(tensor: torch.Tensor, *args, **kwargs):
        losses.append(tensor.item())
        return backward(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recording)
    recipe = get_recipe(recipe_name)
    schema, entry = recipe.load()
    base = [
        f"run.output_dir={tmp_path}",
        "run.seed=0",
        "run.threads=1",
        "run.progress=false",
        "run.tensorboard=false",
        f"out={tmp_path / 'published'}",
    ]
    entry(load_config(schema, overrides=[*base, *overrides]))
    return losses


@pytest.mark.parametrize("script", sorted(SETTINGS))
def test_recipe_repeats_the_scripts_trajectory(monkeypatch, tmp_path, script):
    recipe_name, overrides = SETTINGS[script]
    losses = run_recording_losses(monkeypatch, recipe_name, overrides, tmp_path)
    reference = REFERENCE[script]
    assert losses == reference["losses"]
    assert weights_digest(tmp_path / "published") == (reference["weights_sha256"], reference["tensors"])
