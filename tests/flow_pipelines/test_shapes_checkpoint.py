"""The committed shapes text-to-image checkpoint loads through the adapter path and generates verifiable images."""

from __future__ import annotations

from pathlib import Path

import torch

import rewards
from mmrl.data import shapes
from pipelines.flow.adapters import ShapesAdapter
from pipelines.flow.adapters.shapes import SHAPES_GUIDANCE_SCALE, SHAPES_NUM_STEPS, SHAPES_RESOLUTION
from pipelines.flow.rollout import SamplingConfig, rescore, rollout

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_flow"


def test_checkpoint_is_small_and_has_a_card():
    size = sum(f.stat().st_size for f in CHECKPOINT.rglob("*") if f.is_file())
    assert size <= 12e6
    card = (CHECKPOINT / "card.md").read_text()
    assert "mmrl train configs/pretrain/shapes_flow.yaml" in card and "strict score" in card
    assert "python -m mmrl.flow.pretrain_shapes --eval-only checkpoints/shapes_flow" in card


def test_checkpoint_generates_and_scores():
    adapter = ShapesAdapter.from_pretrained(str(CHECKPOINT))
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
