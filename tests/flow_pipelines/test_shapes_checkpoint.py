"""The committed shapes text-to-image checkpoint loads through the adapter path and generates verifiable images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rewards
from mmrl.data import shapes
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.adapters.shapes import SHAPES_GUIDANCE_SCALE, SHAPES_NUM_STEPS, SHAPES_RESOLUTION
from pipelines.flow.rollout import SamplingConfig, rescore, rollout

ROOT = Path(__file__).resolve().parents[2]
#: each committed shapes base and the most its folder may hold on disk
BASES = {"shapes_flow": 12e6, "shapes_flow_w192": 24e6}


@pytest.mark.parametrize("name", sorted(BASES))
def test_checkpoint_is_small_and_has_a_card(name):
    folder = ROOT / "checkpoints" / name
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= BASES[name]
    card = (folder / "card.md").read_text()
    assert f"mmrl train configs/pretrain/{name}.yaml" in card and "strict score" in card
    assert f"python -m mmrl.flow.pretrain_shapes --eval-only checkpoints/{name}" in card


@pytest.mark.parametrize("name", sorted(BASES))
def test_checkpoint_generates_and_scores(name):
    adapter = ShapesAdapter.from_pretrained(str(ROOT / "checkpoints" / name))
    prompts = shapes.sample_prompts(8, 0, "heldout")
    config = SamplingConfig(
        num_steps=SHAPES_NUM_STEPS,
        guidance_scale=SHAPES_GUIDANCE_SCALE,
        sde_window=(0, 3),
        height=SHAPES_RESOLUTION,
        width=SHAPES_RESOLUTION,
    )
    result = rollout(adapter, prompts, 1, config, generator=torch.Generator().manual_seed(0))
    assert result.images.shape == (8, 3, 32, 32)
    scores = rewards.build("shapes")(images=result.images, prompts=prompts)
    assert scores.shape == (8,) and set(scores.tolist()) <= {0.0, 1.0}
    log_probs, _, _ = rescore(adapter, result.transitions())
    torch.testing.assert_close(log_probs, result.transitions().log_probs, rtol=0, atol=1e-4)
