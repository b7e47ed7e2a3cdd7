"""The flow-GRPO trainer on rollouts from an in-process pool: synchronous equals the in-loop path, asynchronous lag
stays bounded, importance weights, config validation. The committed shapes checkpoint, 4 steps at 32x32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.core.losses import clipped_surrogate, stale_sample_weights
from mmrl.flow import rollouts as loop_rollouts
from mmrl.flow import trainer as trainer_module
from mmrl.flow.config import FlowGRPOConfig
from mmrl.flow.pooled import concat_rollouts
from mmrl.flow.trainer import FlowGRPOTrainer
from mmrl.seeding import request_seed
from pipelines.flow.rollout import rollout

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "shapes_flow"
#: per-step metrics that only the pooled path has, or that measure wall time
POOL_ONLY = ("pool/", "tis/", "time/")


def make_cfg(*overrides: str) -> FlowGRPOConfig:
    return load_config(
        FlowGRPOConfig,
        None,
        [
            f"model.path={CHECKPOINT}",
            "model.device=cpu",
            "run.progress=false",
            "run.tensorboard=false",
            "sampling.num_steps=4",
            "sampling.sde_window=2",
            "sampling.window_schedule=random",
            "allocation.prompts_per_step=2",
            "allocation.rollouts_per_step=6",
            "allocation.n_min=3",
            "trainer.steps=3",
            "trainer.minibatch_size=12",
            "trainer.lr=1e-2",
            "trainer.drop_zero_advantage=false",
            "rewards=[{name: jpeg_incompressibility}]",  # a continuous reward: every group has a spread
            *overrides,
        ],
    )


def started(cfg: FlowGRPOConfig) -> FlowGRPOTrainer:
    trainer = FlowGRPOTrainer(cfg, run=None)
    trainer.setup()
    return trainer


def steps(trainer: FlowGRPOTrainer, n: int) -> list[dict[str, float]]:
    out = []
    for _ in range(n):
        out.append(trainer.train_step())
        trainer.step += 1
    return out


def test_synchronous_pool_equals_in_loop_rollouts(monkeypatch):
    cfg = make_cfg()
    plain = started(cfg)
    real_rollout = loop_rollouts.rollout

    def request_seeded(adapter, prompts, counts, config, generator=None, noise=None):
        # the in-loop path with the noise of the pool's single request of this step
        assert generator is plain.generator and noise is None
        seed = request_seed(cfg.run.seed, 0, plain.step, 0)
        return real_rollout(adapter, prompts, counts, config, torch.Generator().manual_seed(seed))

    monkeypatch.setattr(loop_rollouts, "rollout", request_seeded)
    expected = steps(plain, 2)
    monkeypatch.setattr(loop_rollouts, "rollout", real_rollout)

    pooled = started(make_cfg("pool.enabled=true", "pool.max_staleness=0"))
    initial = [p.detach().clone() for p in pooled.trainable]
    try:
        got = steps(pooled, 2)
        assert pooled.rollout_source.last.info["request_seeds"] == [request_seed(cfg.run.seed, 0, 1, 0)]
    finally:
        pooled.cleanup()
    for want, have in zip(expected, got, strict=True):
        assert have["pool/lag_max"] == 0 and have["tis/weight_mean"] == 1.0 and have["tis/clipped_frac"] == 0
        assert {k: v for k, v in have.items() if not k.startswith(POOL_ONLY)} == {
            k: v for k, v in want.items() if not k.startswith("time/")
        }
    for a, b in zip(plain.trainable, pooled.trainable, strict=True):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(initial, pooled.trainable, strict=True))


def test_async_lag_is_bounded_and_stale_samples_are_reweighted():
    trainer = started(make_cfg("pool.enabled=true", "pool.max_staleness=1", "trainer.steps=3"))
    lags, weights, metrics = [], [], []
    collect = trainer.collect

    def recorded():
        batch = collect()
        lags.append(batch.sample_lags)
        weights.append((batch.sample_lags[batch.transitions.sample_index], batch.weights))
        return batch

    trainer.collect = recorded
    try:
        for _ in range(3):
            metrics.append(trainer.train_step())
            trainer.step += 1
    finally:
        trainer.cleanup()
    # step 0 is on-policy; steps 1 and 2 were generated while the previous step trained
    assert [int(lag.max()) for lag in lags] == [0, 1, 1]
    assert all(int(lag.min()) >= 0 for lag in lags)
    for m, lag in zip(metrics, lags, strict=True):
        assert m["pool/lag_max"] == float(lag.max()) <= 1
    for transition_lags, w in weights:
        assert torch.equal(w[transition_lags == 0], torch.ones(int((transition_lags == 0).sum())))
        assert bool(((w > 0) & (w <= 2.0)).all())
    stale_w = weights[1][1][weights[1][0] > 0]
    assert stale_w.numel() and not bool((stale_w == 1).all())  # the policy moved after step 0
    # the stale transitions' old log-probs were re-scored under the weights of the update: ratio starts at 1
    assert metrics[1]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_importance_weights_and_advantage_folding():
    current = torch.tensor([0.3, -0.2, 5.0, 0.1])
    behaviour = torch.tensor([0.1, 0.0, 0.0, 0.4])
    lags = torch.tensor([0, 1, 2, 1])
    w = stale_sample_weights(current, behaviour, lags, cap=2.0)
    torch.testing.assert_close(
        w,
        torch.tensor([1.0, torch.exp(torch.tensor(-0.2)).item(), 2.0, torch.exp(torch.tensor(-0.3)).item()]),
    )
    assert w[0] == 1.0  # lag 0: exactly 1 whatever the log-probs
    # w * L(r, A) = L(r, w * A): weighting the loss term equals folding the weight into the advantage
    logp, old, adv = (
        torch.tensor([0.2, -0.1, 0.05, 0.0]),
        torch.zeros(4),
        torch.tensor([1.0, -2.0, 0.5, -0.3]),
    )
    torch.testing.assert_close(
        clipped_surrogate(logp, old, w * adv, 0.1), w * clipped_surrogate(logp, old, adv, 0.1)
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["sampling.rollout=branch", "tree.split_steps=[0]"], "sampling.rollout=flat"),
        (["explore.enabled=true", "allocation.method=uniform"], "explore.enabled=false"),
        (["pool.tis_cap=0.5"], "tis_cap"),
        (["pool.max_staleness=-1"], "max_staleness"),
        (["pool.executor=threads"], "executor"),
    ],
)
def test_pool_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_cfg("pool.enabled=true", *overrides)


def test_synchronous_pool_resumes_exactly(tmp_path, interrupted_then_resumed):
    from mmrl.run import read_metrics

    def cfg(name: str, *extra: str) -> FlowGRPOConfig:
        return make_cfg(
            "pool.enabled=true",
            f"run.output_dir={tmp_path}",
            f"run.name={name}",
            "run.save_every=1",
            "trainer.eval_every=3",
            "trainer.eval_prompts=2",
            "sampling.eval_num_steps=2",
            *extra,
        )

    straight = trainer_module.main(cfg("a"))
    # the new pool starts from the resumed LoRA as its version 0
    resumed = interrupted_then_resumed(
        FlowGRPOTrainer, trainer_module.main, cfg("b"), cfg("b", "run.resume=true"), at=2
    )
    assert {k: v for k, v in resumed.items() if not k.startswith("time/")} == {
        k: v for k, v in straight.items() if not k.startswith("time/")
    }
    assert len(read_metrics(tmp_path / "b")) == 4


def test_requests_split_over_workers_and_merge():
    trainer = started(make_cfg("pool.enabled=true", "pool.num_workers=2", "trainer.steps=1"))
    try:
        metrics = trainer.train_step()
        last = trainer.rollout_source.last
        assert len(last.info["request_seeds"]) == 2  # 2 prompts, 2 workers: a request each
        assert metrics["rollouts/per_prompt_min"] == 3 and last.sample_lags.numel() == 6
        config = trainer.sampling_config()
        parts = [
            rollout(trainer.adapter, [prompt], [n], config, torch.Generator().manual_seed(seed))
            for prompt, n, seed in (("a red circle", 2, 0), ("two blue squares", 1, 1))
        ]
    finally:
        trainer.cleanup()
    merged = concat_rollouts(parts, "cpu")
    assert merged.group_index.tolist() == [0, 0, 1] and merged.prompts == ["a red circle"] * 2 + [
        "two blue squares"
    ]
    assert torch.equal(merged.latents[2], parts[1].latents[0]) and merged.nfe == parts[0].nfe + parts[1].nfe
    assert len(merged.cond) == 3 and len(merged.transitions()) == 3 * int(config.sde_steps().sum())


def test_ray_pool_trains_like_the_inprocess_pool():
    pytest.importorskip("ray")
    overrides = ("pool.enabled=true", "pool.max_staleness=0")
    local = steps(started(make_cfg(*overrides)), 2)
    remote_trainer = started(
        make_cfg(*overrides, "pool.executor=ray", "pool.ray={num_cpus: 1}", "pool.request_timeout=300")
    )
    try:
        remote = steps(remote_trainer, 2)
    finally:
        remote_trainer.cleanup()
    # the same request seeds on a Ray actor: the same samples, rewards and updates
    for a, b in zip(local, remote, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(POOL_ONLY)} == pytest.approx(
            {k: v for k, v in b.items() if not k.startswith(POOL_ONLY)}, rel=1e-5, abs=1e-6
        )
