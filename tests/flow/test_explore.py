"""Two-stage explore/train: seed selection, same-noise regeneration, rank agreement, the trainer mode."""

import math

import pytest
import torch

from mmrl.config import load_config
from mmrl.data.shapes import all_prompts
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.trainer import FlowGRPOTrainer
from pipelines.flow.adapters import load_adapter
from pipelines.flow.explore import ExploreConfig, explore, select_seeds, spearman, spearman_within
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.flow.tiny import build_shapes_pipeline
from pipelines.quant import quantize_copy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    pipe = build_shapes_pipeline(all_prompts(), num_layers=1, num_attention_heads=2, attention_head_dim=8)
    path = tmp_path_factory.mktemp("shapes_explore")
    pipe.save_pretrained(path)
    return path


def test_select_seeds_rules():
    r = torch.tensor([[0.1, 0.9, 0.5, 0.3, 0.9], [1.0, 0.0, 0.2, 0.4, 0.6]])
    cfg = ExploreConfig(candidates=5, keep_best=2, keep_worst=1)
    assert select_seeds(r, cfg).tolist() == [[1, 4, 0], [0, 4, 1]]
    mixed = ExploreConfig(
        candidates=5, keep_best=1, keep_worst=1, selection="extremes_random", extra_random=2
    )
    chosen = select_seeds(r, mixed, torch.Generator().manual_seed(0))
    assert chosen.shape == (2, 4) and all(row.unique().numel() == 4 for row in chosen)
    rand = select_seeds(r, ExploreConfig(candidates=5, keep_best=2, keep_worst=1, selection="random"))
    assert rand.shape == (2, 3)
    with pytest.raises(ValueError, match="impossible"):
        ExploreConfig(candidates=3, keep_best=2, keep_worst=2)


def test_spearman():
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    assert spearman(torch.tensor([1.0, 1, 2]), torch.tensor([1.0, 2, 3])) == pytest.approx(0.8660254)


def test_spearman_within_ranks_inside_each_prompt_only():
    """Two prompts, an easy one (rewards near 1) and a hard one (near 0): a preview that orders the prompts right
    but each prompt's seeds backwards scores 19/35 pooled (1 - 6 * 16 / 210) and -1 within; a prompt whose full
    rewards tie is left out of the mean."""
    preview = torch.tensor([0.9, 0.8, 0.7, 0.2, 0.1, 0.0])
    full = torch.tensor([0.7, 0.8, 0.9, 0.0, 0.1, 0.2])
    assert spearman(preview, full) == pytest.approx(19 / 35)
    assert spearman_within(preview, full, 3) == pytest.approx(-1.0)
    assert spearman_within(preview, full, [2, 4]) == pytest.approx(
        (-1.0 + 0.2) / 2
    )  # [0.7, .2, .1, 0] vs [.9, 0, .1, .2]
    tied = torch.tensor([0.7, 0.8, 0.9, 0.5, 0.5, 0.5])
    assert spearman_within(preview, tied, 3) == pytest.approx(-1.0)
    assert math.isnan(spearman_within(preview, torch.ones(6), 3))
    with pytest.raises(ValueError, match="add up"):
        spearman_within(preview, full, [2, 2])


def test_explorer_previews_predict_full_precision_and_leave_policy_untouched(model_dir):
    adapter = load_adapter("shapes", str(model_dir))
    before = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters()}
    explorer = quantize_copy(adapter.transformer, "int8")
    sampling = SamplingConfig(num_steps=4, height=32, width=32, sde_window=(0, 0))

    def brightness(images, prompts):
        return images.mean(dim=(1, 2, 3))

    cfg = ExploreConfig(candidates=8, preview_steps=4, keep_best=2, keep_worst=2)
    res = explore(
        adapter,
        explorer.module,
        ["a photo of a red circle", "a photo of two squares"],
        sampling,
        cfg,
        brightness,
        generator=torch.Generator().manual_seed(0),
    )
    assert res.noise.shape == (8, 3, 32, 32) and res.nfe == 2 * 8 * 4
    assert all(torch.equal(before[n], p) for n, p in adapter.transformer.named_parameters())
    # regenerating the chosen seeds at full precision (same ODE) gives nearly the preview's ranking
    full = rollout(
        adapter, ["a photo of a red circle", "a photo of two squares"], 4, sampling, noise=res.noise
    )
    rho = spearman(res.chosen_preview_rewards, brightness(full.images, full.prompts))
    assert rho > 0.8
    # best-kept seeds preview brighter than worst-kept ones
    prev = res.chosen_preview_rewards.view(2, 4)
    assert (prev[:, :2].min(dim=1).values >= prev[:, 2:].max(dim=1).values).all()


@pytest.mark.parametrize(
    "rollout_mode, objective", [("flat", "grpo"), ("branch", "grpo"), ("flat", "awm"), ("branch", "awm")]
)
def test_trainer_explore_mode(model_dir, tmp_path, rollout_mode, objective):
    cfg = load_config(
        FlowGRPOConfig,
        None,
        [
            f"model.path={model_dir}",
            "model.device=cpu",
            f"run.output_dir={tmp_path}",
            "run.progress=false",
            "sampling.num_steps=4",
            "sampling.sde_window=2",
            "allocation.prompts_per_step=2",
            "allocation.rollouts_per_step=8",
            "trainer.minibatch_size=8",
            "trainer.drop_zero_advantage=false",
            "rewards=[{name: jpeg_incompressibility}]",
            "explore.enabled=true",
            "explore.scheme=nf4",
            "explore.candidates=6",
            "explore.keep_best=1",
            "explore.keep_worst=1",
            f"sampling.rollout={rollout_mode}",
            "tree.split_steps=[0]",
            f"trainer.objective={objective}",
            "trainer.awm.timesteps=2",
        ],
    )
    trainer = FlowGRPOTrainer(cfg, None)
    trainer.setup()
    before = [p.detach().clone() for p in trainer.trainable]
    metrics = trainer.train_step()
    assert metrics["nfe/preview"] == 2 * 6 * 4
    assert -1.0 <= metrics["explore/spearman"] <= 1.0
    assert metrics["explore/weight_mb_explorer"] < metrics["explore/weight_mb_policy"]
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.trainable, strict=True))
