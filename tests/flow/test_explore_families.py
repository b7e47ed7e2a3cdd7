"""The quantized explorer (two-stage explore/train) on the newer flow families' tiny random models (Qwen-Image,
Z-Image, FLUX.2 [klein] and [dev], Wan2.2 with one or both experts trained), with the quantizations that run on a
CPU (bitsandbytes int8 / nf4; the recipes' fp8 and nvfp4 need Hopper / Blackwell GPUs): the copy computes the
policy's velocity up to quantization error, keeps each family's embedders and output layers in full precision,
and a training step previews, regenerates and trains."""

import json

import pytest
import torch

from mmrl.flow.trainer import FlowGRPOTrainer
from pipelines.flow.adapters import get_adapter
from pipelines.flow.explore import explorer_weights
from pipelines.flow.tiny import TINY_LOAD_KWARGS, TINY_SIZES, build_tiny_pipeline
from pipelines.quant import quantize_copy
from tests.flow.test_families import family_config

# (family, adapter options beyond the tiny defaults)
CASES = [
    ("qwen_image", {}),
    ("z_image", {}),
    ("flux2_klein", {}),
    ("flux2", {}),
    ("wan22", {"trained_expert": "low"}),
    ("wan22", {"trained_expert": "both"}),
]
IDS = ["qwen_image", "z_image", "flux2_klein", "flux2", "wan22_low", "wan22_both"]
# the transformer's repeated blocks: what the explorer quantizes (everything outside them stays full precision)
BLOCKS = (
    "transformer_blocks.",
    "single_transformer_blocks.",
    "layers.",
    "noise_refiner.",
    "context_refiner.",
    "blocks.",
)


@pytest.mark.parametrize(("family", "options"), CASES, ids=IDS)
def test_explorer_matches_the_policy_velocity_and_quantizes_only_blocks(family, options):
    torch.manual_seed(0)
    adapter = get_adapter(family)(
        build_tiny_pipeline(family, seed=0), **{**TINY_LOAD_KWARGS[family], **options}
    )
    sizes = TINY_SIZES[family]
    cond = adapter.encode(["a red circle", "a blue square"])
    x = torch.randn(2, *adapter.latent_shape(sizes["height"], sizes["width"], sizes.get("num_frames")))
    sigma = torch.tensor([0.9, 0.5])  # Wan2.2: one row per expert
    policy = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters()}
    with torch.no_grad():
        v = adapter.velocity(x, sigma, cond)
        for scheme, tolerance in (("int8", 0.01), ("nf4", 0.15)):
            explorer = quantize_copy(adapter.transformer, scheme)
            with explorer_weights(adapter, explorer.module):
                v_explorer = adapter.velocity(x, sigma, cond)
            error = float((v_explorer - v).norm() / v.norm())
            assert 0 < error < tolerance, (scheme, error)
            assert explorer.quantized
            roots = ("transformer.", "transformer_2.") if options.get("trained_expert") == "both" else ("",)
            relative = [
                name.removeprefix(root)
                for name in explorer.quantized
                for root in roots
                if name.startswith(root)
            ]
            assert len(relative) == len(explorer.quantized)
            assert all(name.startswith(BLOCKS) for name in relative), relative
    # building and using the copy leaves the policy bit-identical
    assert all(torch.equal(policy[n], p) for n, p in adapter.transformer.named_parameters())
    if options.get("trained_expert") == "both":  # both experts quantized, each with its own skip list
        assert {name.split(".")[0] for name in explorer.quantized} == {"transformer", "transformer_2"}


@pytest.mark.parametrize(("family", "options"), CASES, ids=IDS)
def test_explore_step_previews_regenerates_and_trains(family, options, tmp_path):
    torch.manual_seed(0)
    build_tiny_pipeline(family, seed=0).save_pretrained(tmp_path / "model")
    cfg = family_config(
        family,
        "grpo",
        tmp_path,
        f"model.options={json.dumps({**TINY_LOAD_KWARGS[family], **options})}",
        "sampling.sde_window=3",
        "explore.enabled=true",
        "explore.scheme=int8",
        "explore.candidates=4",
        "explore.preview_steps=2",
        "explore.keep_best=1",
        "explore.keep_worst=1",
        "allocation.method=uniform",
        "trainer.lr=1e-2",
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    nfe_each = trainer.adapter.nfe_per_sample(cfg.sampling.guidance_scale)
    assert metrics["nfe/preview"] == 2 * 4 * 2 * nfe_each  # prompts x candidates x preview steps
    assert metrics["explore/weight_mb_explorer"] < metrics["explore/weight_mb_policy"]
    assert -1.0 <= metrics["explore/spearman"] <= 1.0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
