"""The Ray pool on a local 2-CPU cluster: same samples as in-process, broadcast, a worker killed mid-batch."""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

import rewards
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.pool.executors import RayOptions
from pipelines.pool.pool import RolloutPool
from pipelines.pool.protocol import PoolError, RolloutRequest
from pipelines.pool.weights import make_update
from pipelines.pool.workers import RewardWorker, RolloutWorker
from tests.pool.test_pool_vlm import assert_same_samples

ray = pytest.importorskip("ray")
JPEG = rewards.build("jpeg_compressibility")


@pytest.fixture(scope="module")
def ray_pool(flow_factory):
    """Two CPU rollout actors and a reward actor, shared by the tests of this module in order (actors take seconds to start)."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    # the reward actor reserves no CPU so that all three actors fit the 2-CPU test cluster
    pool = RolloutPool(
        flow_factory,
        num_workers=2,
        executor="ray",
        ray=RayOptions(num_cpus=1),
        reward=functools.partial(RewardWorker.build, "jpeg_compressibility"),
        reward_ray=RayOptions(num_cpus=0),
        max_staleness=1,
        request_timeout=120,
    )
    try:
        yield pool
    finally:
        pool.close()
        ray.shutdown()


def _wait_workers(pool: RolloutPool, n: int, timeout: float = 300) -> None:
    # generous: each actor imports torch + diffusers and builds a model, minutes on a loaded 2-core machine
    deadline = time.monotonic() + timeout
    while pool.num_workers < n:
        assert time.monotonic() < deadline, f"only {pool.num_workers} of {n} Ray workers started"
        time.sleep(0.1)


def _direct(adapter, request):
    return rollout(
        adapter,
        request.prompts,
        request.counts,
        SamplingConfig(num_steps=4, height=32, width=32),
        torch.Generator().manual_seed(request.seed),
    )


def test_ray_samples_equal_inprocess(ray_pool, flow_factory, requests_factory):
    requests = requests_factory("r", 6, counts=(2, 1))
    with RolloutPool(flow_factory) as local:
        expected = local.run(requests, timeout=60)
    _wait_workers(ray_pool, 2)
    batch = ray_pool.run([replace(r, request_id="ray-" + r.request_id) for r in requests], timeout=120)
    assert {r.worker for r in batch.results} == {0, 1}  # both actors worked
    for got, want in zip(batch.results, expected.results, strict=True):
        assert got.request_id == "ray-" + want.request_id and got.weight_version == 0
        assert torch.equal(got.output.latents, want.output.latents)
        assert torch.equal(got.output.log_probs, want.output.log_probs)
        torch.testing.assert_close(got.reward.scores, JPEG.score(images=got.output.images).scores)
    with pytest.raises(PoolError, match="precision 'nf4'"):  # the worker's own error reaches the trainer
        ray_pool.run([replace(requests[0], request_id="bad", precision="nf4")], timeout=120)


def test_ray_lora_broadcast_and_staleness(ray_pool, trainer_adapter, requests_factory):
    adapter, train = trainer_adapter
    lags = []
    for step, batch in enumerate(ray_pool.stream(lambda s: requests_factory(f"b{s}-", 2, seed0=s), 3)):
        lags.extend(batch.sample_lags().tolist())
        for result in batch.results:
            if result.weight_version == batch.version:  # generated with the trainer's current weights
                request = requests_factory(f"b{step}-", 2, seed0=step)[int(result.request_id[-1])]
                assert torch.equal(result.output.latents, _direct(adapter, request).latents)
        train(step)
        ray_pool.broadcast(make_update(adapter.transformer, version=ray_pool.version + 1))
    assert max(lags) <= 1
    assert [w["version"] for w in ray_pool.worker_info()] == [ray_pool.version] * 2


def test_ray_worker_killed_mid_batch(ray_pool, trainer_adapter, requests_factory, caplog):
    adapter, train = trainer_adapter
    train(7)
    ray_pool.broadcast(make_update(adapter.transformer, version=ray_pool.version + 1))
    victim = ray_pool.worker_info()[1]["pid"]
    requests = requests_factory("k", 16, counts=(8,), seed0=50)
    with caplog.at_level(logging.WARNING, logger="pipelines.pool.pool"):
        ray_pool.submit(requests)  # dispatched at once: each actor has a request in flight (~0.1 s of work)
        time.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        batch = ray_pool.collect(timeout=120)
    # every request answered exactly once, by the survivor or the replacement, with the current weights
    assert [r.request_id for r in batch.results] == [r.request_id for r in requests]
    assert ray_pool.stats["worker_lost"] == 1 and ray_pool.stats["requeued"] >= 1
    assert all(r.reward is not None for r in batch.results)
    assert "rollout worker 1 died" in caplog.text
    for request, result in zip(requests, batch.results, strict=True):
        assert result.weight_version == ray_pool.version
        assert torch.equal(result.output.latents, _direct(adapter, request).latents)
    # the pool keeps going
    assert len(ray_pool.run(requests_factory("after", 2), timeout=120).results) == 2


def test_ray_reward_worker_killed_is_retried(ray_pool, requests_factory, caplog):
    (reward_worker,) = ray_pool.worker_info("reward")
    lost, retries = ray_pool.stats["worker_lost"], ray_pool.stats["reward_retries"]
    requests = requests_factory("s", 4, seed0=70)
    with caplog.at_level(logging.WARNING, logger="pipelines.pool.pool"):
        # the only reward actor dies; the pool still believes in it, so the first scoring call fails
        os.kill(reward_worker["pid"], signal.SIGKILL)
        batch = ray_pool.run(requests, timeout=120)
    assert [r.request_id for r in batch.results] == [r.request_id for r in requests]
    for result in batch.results:  # every reward is the real one, computed by the replacement
        torch.testing.assert_close(result.reward.scores, JPEG.score(images=result.output.images).scores)
    assert ray_pool.stats["worker_lost"] == lost + 1 and ray_pool.stats["reward_retries"] > retries
    assert "reward worker 0 died" in caplog.text


def test_ray_vlm_worker_equals_inprocess(ray_pool, vlm_factory, vlm_requests):
    requests = vlm_requests("m", 2, [2, 1])
    with RolloutPool(vlm_factory) as local:
        expected = local.run(requests, timeout=120)
    # no CPU reserved: the 2-CPU cluster is taken by the flow actors of ray_pool
    with RolloutPool(vlm_factory, executor="ray", ray=RayOptions(num_cpus=0)) as remote:
        got = remote.run(requests, timeout=120)
    assert_same_samples(expected, got)


def test_ray_request_that_kills_every_worker_fails_alone(ray_pool):
    # (ray_pool: the test cluster is up) a local function, so that Ray pickles it by value for the actors
    def task(request: RolloutRequest) -> int:
        if request.request_id == "poison":
            os._exit(137)  # the actor's process dies on this input (out of memory, a segfault)
        return request.seed

    requests = [RolloutRequest(rid, ["p"], ["x"], [1], seed=i) for i, rid in enumerate(["poison", "ok"])]
    # no CPU reserved: the 2-CPU cluster is taken by the flow actors of ray_pool
    with RolloutPool(
        functools.partial(RolloutWorker, task), executor="ray", ray=RayOptions(num_cpus=0)
    ) as pool:
        pool.submit(requests)
        with pytest.raises(
            PoolError,
            match=r"request 'poison' lost 3 rollout workers \(max_worker_losses=3\); the last one, worker 0, "
            r"died \(\w+\)",
        ):
            pool.collect(timeout=120)
        batch = pool.collect(timeout=120)  # "ok", queued behind it, was re-queued at no cost each time
        assert [(r.request_id, r.output) for r in batch.results] == [("ok", 1)]
        assert pool.stats["worker_lost"] == 3 and pool.stats["respawned"] == 3
