"""TrainerBase: the optimizer step, the base state and its round trip, checkpoints only where a run writes."""

import torch

from mmrl.bandit.trainer import BanditRecipeConfig
from mmrl.config import load_config
from mmrl.core.stats import PromptStats
from mmrl.trainer_base import TrainerBase


def _base(tmp_path) -> TrainerBase:
    cfg = load_config(BanditRecipeConfig, overrides=[f"run.output_dir={tmp_path}", "run.threads=1"])
    trainer = TrainerBase(cfg)
    trainer.setup_runtime()
    trainer.stats = PromptStats(rho=0.5)
    return trainer


def test_optimizer_step_clips_sets_the_lr_and_zeroes(tmp_path):
    trainer = _base(tmp_path)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    weight.grad = torch.tensor([3.0, 4.0])  # norm 5
    trainer.optimizer_step(optimizer, [weight], max_grad_norm=1.0, lr=0.5)
    torch.testing.assert_close(weight.detach(), -0.5 * torch.tensor([0.6, 0.8]))  # clipped to norm 1, lr 0.5
    assert weight.grad is None and optimizer.param_groups[0]["lr"] == 0.5
    assert trainer.metrics.reduce()["train/grad_norm"] == 5.0  # the norm before clipping


def test_base_state_round_trip_restores_step_statistics_and_rng(tmp_path):
    trainer = _base(tmp_path)
    trainer.step = 7
    trainer.stats.update(["a", "b"], torch.tensor([1.0, 0.0]), step=6)
    state = trainer.base_state()
    expected = torch.rand(3, generator=trainer.generator)
    other = _base(tmp_path)
    other.load_base_state(state)
    assert other.step == 7 and other.stats.prompt_ids == ["a", "b"]
    torch.testing.assert_close(other.stats.success_prob(["a", "b"]), trainer.stats.success_prob(["a", "b"]))
    torch.testing.assert_close(torch.rand(3, generator=other.generator), expected)


def test_nothing_is_written_without_a_run(tmp_path):
    trainer = _base(tmp_path)
    assert not trainer.checkpoint_wanted()
    trainer.write_checkpoint({"step": 0})
    assert not any(tmp_path.iterdir())


def test_a_run_resumed_on_another_number_of_ranks_draws_differently_on_each(tmp_path):
    from mmrl.distributed import DistState

    single = _base(tmp_path)
    single.step = 5
    state = single.base_state()  # a one-process checkpoint: no per-rank states
    draws = []
    for rank in (0, 1):
        trainer = _base(tmp_path)
        trainer.dist = DistState(rank=rank, world_size=2)
        trainer.load_base_state(state)
        draws.append(torch.randint(1000, (8,), generator=trainer.generator).tolist())
        assert trainer.step == 5
    # each rank reseeded from (run.seed, rank, step): different prompts and noise, and the same on a rerun
    assert draws[0] != draws[1]
    again = _base(tmp_path)
    again.dist = DistState(rank=1, world_size=2)
    again.load_base_state(state)
    assert torch.randint(1000, (8,), generator=again.generator).tolist() == draws[1]
