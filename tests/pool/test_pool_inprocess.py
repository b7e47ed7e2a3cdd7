"""The in-process pool: same samples as direct calls, weight broadcast, staleness, partial rollouts, faults."""

from __future__ import annotations

import functools
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import rewards
from pipelines.flow.explore import explorer_weights
from pipelines.flow.rollout import SamplingConfig, rollout
from pipelines.pool.flow_worker import FlowRolloutWorker
from pipelines.pool.pool import RolloutPool
from pipelines.pool.protocol import PoolError, RewardError, RolloutRequest, WeightUpdate, WeightVersionError
from pipelines.pool.weights import full_update, lora_update, make_update
from pipelines.pool.workers import RewardWorker, RolloutWorker
from pipelines.quant import quantize_copy


def _sampling() -> SamplingConfig:
    """The sampling of the conftest's worker factory."""
    return SamplingConfig(num_steps=4, height=32, width=32)


def _direct(adapter, request: RolloutRequest):
    """The rollout a worker must reproduce for ``request``."""
    return rollout(
        adapter, request.prompts, request.counts, _sampling(), torch.Generator().manual_seed(request.seed)
    )


def test_request_validation():
    with pytest.raises(ValueError, match="one id and one count per prompt"):
        RolloutRequest("r", ["a"], ["x", "y"], [1, 1], seed=0)
    with pytest.raises(ValueError, match=">= 1"):
        RolloutRequest("r", ["a"], ["x"], [0], seed=0)
    with pytest.raises(ValueError, match="non-empty"):
        RolloutRequest("", ["a"], ["x"], [1], seed=0)
    with pytest.raises(ValueError, match="lora_config"):
        WeightUpdate(1, "lora", {})
    with pytest.raises(ValueError, match="max_staleness"):
        RolloutPool(RolloutWorker, max_staleness=-1)
    with pytest.raises(ValueError, match="max_worker_losses must be >= 1, got 0"):
        RolloutPool(RolloutWorker, max_worker_losses=0)


def test_pool_samples_equal_direct_rollouts(flow_factory, shapes_dir, requests_factory):
    from pipelines.flow.adapters import load_adapter

    requests = requests_factory("r", 3, counts=(2, 1))
    with RolloutPool(flow_factory) as pool:
        batch = pool.run(requests, timeout=60)
        with pytest.raises(ValueError, match="unique"):
            pool.submit(requests[:1])
    adapter = load_adapter("shapes", shapes_dir)
    assert [r.request_id for r in batch.results] == ["r0", "r1", "r2"]
    assert batch.lags == [0, 0, 0] and batch.num_samples == 9
    for request, result in zip(requests, batch.results, strict=True):
        direct = _direct(adapter, request)
        assert torch.equal(result.output.latents, direct.latents)
        assert torch.equal(result.output.log_probs, direct.log_probs)  # every step is an SDE step: no NaN
        assert result.num_samples == 3 and result.weight_version == 0


def test_lora_broadcast_versions_and_samples(flow_factory, trainer_adapter, requests_factory):
    adapter, train = trainer_adapter
    train(1)
    update = make_update(adapter.transformer, version=1)
    # frozen base: only the adapter's tensors travel
    assert update.kind == "lora" and update.state and all(".lora_" in k for k in update.state)
    full_bytes = sum(p.numel() * p.element_size() for p in adapter.transformer.parameters())
    assert update.num_bytes < full_bytes / 5
    (req0,) = requests_factory("v", 1)
    with RolloutPool(flow_factory) as pool:
        before = pool.run([req0]).results[0]
        pool.broadcast(update)
        with pytest.raises(ValueError, match="increase"):
            pool.broadcast(update)
        after = pool.run([replace(req0, request_id="v-again")]).results[0]
        assert pool.worker_info()[0]["version"] == 1
    assert before.weight_version == 0 and after.weight_version == 1
    assert not torch.equal(before.output.latents, after.output.latents)
    # the worker now samples exactly what the trainer's policy samples
    assert torch.equal(after.output.latents, _direct(adapter, req0).latents)


def test_full_weights_when_base_trains(shapes_dir, requests_factory):
    from pipelines.flow.adapters import load_adapter

    adapter = load_adapter("shapes", shapes_dir)
    with torch.no_grad():
        for p in adapter.transformer.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    update = make_update(adapter.transformer, version=3)
    assert update.kind == "full" and update.state.keys() == adapter.transformer.state_dict().keys()
    worker = FlowRolloutWorker.from_pretrained("shapes", shapes_dir, _sampling())
    (request,) = requests_factory("f", 1)
    with pytest.raises(WeightVersionError, match="holds 0"):
        worker.run(replace(request, weight_version=3))
    assert worker.load_weights(update) == 3
    result = worker.run(replace(request, weight_version=3))
    assert result.weight_version == 3
    assert torch.equal(result.output.latents, _direct(adapter, request).latents)
    with pytest.raises(ValueError, match="older"):
        worker.load_weights(full_update(adapter.transformer, version=2))


def test_quantized_worker_remerges_lora(shapes_dir, trainer_adapter, requests_factory):
    adapter, train = trainer_adapter
    worker = FlowRolloutWorker.from_pretrained("shapes", shapes_dir, _sampling(), explorer_scheme="int8")
    (request,) = requests_factory("q", 1)
    quantized = replace(request, precision="int8")
    stale = worker.run(quantized).output
    train(2)
    worker.load_weights(lora_update(adapter.transformer, version=1))
    fresh = worker.run(quantized).output
    # the explorer equals a quantized copy built from the trainer's current weights (LoRA merged)
    reference = quantize_copy(adapter.transformer, "int8")
    with explorer_weights(adapter, reference.module):
        expected = _direct(adapter, request)
    assert not torch.equal(stale.latents, fresh.latents)
    torch.testing.assert_close(fresh.latents, expected.latents, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="precision 'nf4'"):
        worker.run(replace(request, precision="nf4"))


def test_async_staleness_bound(flow_factory, trainer_adapter, requests_factory):
    adapter, train = trainer_adapter
    for max_staleness in (0, 2):
        lags = []
        with RolloutPool(flow_factory, max_staleness=max_staleness) as pool:
            base = pool.version
            with pytest.raises(ValueError, match="broadcast first"):
                pool.collect(step=base + max_staleness + 1)
            for step, batch in enumerate(
                pool.stream(lambda s, m=max_staleness: requests_factory(f"s{m}-{s}-", 2, seed0=10 * s), 5)
            ):
                assert [r.request_id for r in batch.results] == [
                    f"s{max_staleness}-{step}-0",
                    f"s{max_staleness}-{step}-1",
                ]
                lags.extend(batch.sample_lags().tolist())
                train(step)
                pool.broadcast(make_update(adapter.transformer, version=step + 1))
        assert len(lags) == 5 * 2 * 2
        assert max(lags) <= max_staleness
        if max_staleness == 0:
            assert set(lags) == {0}
        else:
            # requests run ahead of training: some samples really are off-policy, and reported as such
            assert max(lags) > 0


def test_submit_window_requests_each_step_once_in_order(flow_factory, requests_factory):
    made = []

    def make(step):
        made.append(step)
        return requests_factory(f"w{step}-", 1, seed0=step)

    with RolloutPool(flow_factory, max_staleness=2) as pool:
        pool.submit_through(0, make, last_step=3)
        assert made == [0]
        pool.submit_ahead(0, make, last_step=3)  # the window: up to 0 + max_staleness
        assert made == [0, 1, 2]
        pool.submit_through(1, make, last_step=3)  # already requested: nothing is made twice
        assert made == [0, 1, 2]
        assert [r.request_id for r in pool.collect(0).results] == ["w0-0"]
        pool.submit_ahead(2, make, last_step=3)  # never beyond the last step
        assert made == [0, 1, 2, 3]
        assert pool.pending(3) > 0


def test_partial_rollouts_carry_unfinished_requests(flow_factory, requests_factory):
    requests = requests_factory("a", 8, counts=(4,))
    with RolloutPool(flow_factory, max_staleness=1) as pool:
        pool.submit(requests)  # over-provisioned: the step needs 4 samples, 32 are requested
        first = pool.collect(min_samples=4, timeout=60)
        assert 4 <= first.num_samples < 32
        carried = pool.pending(step=1)
        assert carried == 32 - first.num_samples  # nothing discarded
        pool.submit(requests_factory("b", 1, counts=(4,), seed0=100), step=1)
        second = pool.collect(step=1, timeout=60)
    ids = [r.request_id for r in first.results + second.results]
    assert sorted(ids) == sorted([f"a{i}" for i in range(8)] + ["b0"])  # each exactly once
    # carried requests are delivered first, before the step's own
    assert ids[-1] == "b0"


def _hang_once(request: RolloutRequest, release: threading.Event, hung: list) -> int:
    """A task whose first run of request ``"h1"`` hangs until released (a stuck GPU kernel, a deadlock)."""
    if request.request_id == "h1" and not hung:
        hung.append(threading.current_thread().name)
        release.wait(30)
    return request.seed


def test_hung_worker_is_replaced_and_its_request_requeued(caplog, requests_factory):
    release, hung = threading.Event(), []
    factory = functools.partial(RolloutWorker, functools.partial(_hang_once, release=release, hung=hung))
    try:
        with (
            caplog.at_level(logging.WARNING, logger="pipelines.pool.pool"),
            RolloutPool(factory, num_workers=2, request_timeout=0.5) as pool,
        ):
            batch = pool.run(requests_factory("h", 4), timeout=30)
            assert [r.output for r in batch.results] == [0, 1, 2, 3]
            assert pool.stats["worker_lost"] == 1 and pool.stats["requeued"] >= 1
            release.set()  # the hung call now returns late: its answer must not be delivered again
            later = pool.run(requests_factory("k", 2), timeout=30)
            assert [r.request_id for r in later.results] == ["k0", "k1"]
        assert "exceeded request_timeout=0.5s on request 'h1'" in caplog.text
    finally:
        release.set()


class _PlainWorker(RolloutWorker):
    """A task worker with no model: a weight load changes nothing and takes ``load_s`` seconds."""

    def __init__(self, fn, load_s: float = 0.0) -> None:
        super().__init__(fn)
        self.load_s = load_s

    def apply_weights(self, update: WeightUpdate) -> None:
        time.sleep(self.load_s)


def test_weight_load_slower_than_request_timeout_keeps_the_worker(requests_factory):
    # full weights of a big model take longer to load than a request may run: the request queued behind the
    # load must not be timed while the load runs (that killed the worker, whose replacement reloaded, forever)
    factory = functools.partial(_PlainWorker, lambda request: request.seed, load_s=0.4)
    with RolloutPool(factory, request_timeout=0.2) as pool:
        pool.broadcast(WeightUpdate(1, "full", {}))
        batch = pool.run(requests_factory("l", 2), timeout=10)
        assert [r.output for r in batch.results] == [0, 1] and batch.lags == [0, 0]
        assert pool.stats["worker_lost"] == 0 and pool.worker_info()[0]["version"] == 1


def test_request_is_carried_at_most_once(requests_factory):
    b1_ran = threading.Event()

    def task(request: RolloutRequest) -> str:
        if request.request_id == "slow":  # still generating when the step after the next has its samples
            b1_ran.wait(30)
            time.sleep(0.3)
        elif request.request_id == "b1":
            b1_ran.set()
        return request.request_id

    def req(rid: str, seed: int) -> RolloutRequest:
        return RolloutRequest(rid, ["p"], ["x"], [1], seed=seed)

    factory = functools.partial(_PlainWorker, task)
    with RolloutPool(factory, num_workers=2, max_staleness=0, max_inflight=1) as pool:
        pool.submit([req("slow", 0), req("a0", 1), req("a1", 2)], step=0)
        first = pool.collect(0, min_samples=2, timeout=30)
        pool.broadcast(WeightUpdate(1, "full", {}))
        pool.submit([req("b0", 3), req("b1", 4)], step=1)
        # min_samples are complete with b0 and b1, but "slow" was carried once already: it is waited for
        second = pool.collect(1, min_samples=2, timeout=30)
        assert pool.pending(2) == 0 and pool.stats["carried"] == 1
    assert [r.request_id for r in first.results] == ["a0", "a1"] and first.lags == [0, 0]
    assert [r.request_id for r in second.results] == ["slow", "b0", "b1"]
    assert second.lags == [1, 0, 0]  # max_staleness + 1 at most


def test_no_worker_left_is_an_error_not_a_hang(requests_factory):
    release, hung = threading.Event(), []
    factory = functools.partial(RolloutWorker, functools.partial(_hang_once, release=release, hung=hung))
    try:
        with RolloutPool(factory, request_timeout=0.3, respawn=False) as pool:
            pool.submit(requests_factory("h", 2))
            with pytest.raises(PoolError, match="no rollout worker is left"):
                pool.collect(timeout=30)
    finally:
        release.set()


def _hang_on_poison(request: RolloutRequest, release: threading.Event) -> int:
    """A task that deadlocks on the request named "poison", whichever worker runs it, until ``release``."""
    if request.request_id == "poison":
        release.wait(30)
    return request.seed


def test_a_request_that_hangs_every_worker_fails_alone():
    release = threading.Event()
    requests = [RolloutRequest(rid, ["p"], ["x"], [1], seed=i) for i, rid in enumerate(["poison", "ok"])]
    factory = functools.partial(RolloutWorker, functools.partial(_hang_on_poison, release=release))
    try:
        with RolloutPool(factory, num_workers=2, request_timeout=0.3) as pool:
            pool.submit(requests)
            # the default max_worker_losses=3: three workers are replaced, then the request is given up
            with pytest.raises(
                PoolError,
                match=r"request 'poison' lost 3 rollout workers \(max_worker_losses=3\); the last one, worker \d, "
                r"exceeded request_timeout=0.3s on request 'poison'",
            ):
                pool.collect(timeout=15)
            batch = pool.collect(timeout=15)  # the other request is delivered as usual
            assert [(r.request_id, r.output) for r in batch.results] == [("ok", 1)]
            assert pool.stats["worker_lost"] == 3 and pool.stats["respawned"] == 3
            # the last replacement may still be starting on a busy machine: both are back within seconds
            deadline = time.monotonic() + 10
            while pool.num_workers < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pool.num_workers == 2
    finally:
        release.set()


def test_a_recipes_pool_section_sets_the_losses_a_request_may_cause():
    """``pool.max_worker_losses: 1`` in a recipe: the poison request fails at its first lost worker."""
    from mmrl.sections import PoolSettings

    release = threading.Event()
    factory = functools.partial(RolloutWorker, functools.partial(_hang_on_poison, release=release))
    settings = PoolSettings(num_workers=2, request_timeout=0.3, max_worker_losses=1)
    try:
        with settings.build_pool(factory) as pool:
            pool.submit([RolloutRequest("poison", ["p"], ["x"], [1], seed=0)])
            with pytest.raises(PoolError, match=r"lost 1 rollout workers \(max_worker_losses=1\)"):
                pool.collect(timeout=15)
            assert pool.stats["worker_lost"] == 1
    finally:
        release.set()
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PoolSettings(max_worker_losses=0)


def test_an_abandoned_hung_worker_does_not_keep_the_interpreter_from_exiting():
    # a daemon thread per in-process member: a ThreadPoolExecutor's would be joined at exit, forever
    script = textwrap.dedent(
        """
        import functools, threading
        from pipelines.pool.pool import RolloutPool
        from pipelines.pool.protocol import RolloutRequest
        from pipelines.pool.workers import RolloutWorker

        hung, never = [], threading.Event()

        def task(request):
            if not hung:  # the first call deadlocks for good
                hung.append(1)
                never.wait()
            return request.seed

        with RolloutPool(functools.partial(RolloutWorker, task), request_timeout=0.3) as pool:
            batch = pool.run([RolloutRequest("a", ["p"], ["x"], [1], seed=7)], timeout=30)
            print("outputs", [r.output for r in batch.results], "lost", pool.stats["worker_lost"], flush=True)
        """
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the process did not exit; its output: {err.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert "outputs [7] lost 1" in done.stdout


class _LoadFailsOnce(RolloutWorker):
    """A worker whose weight load raises for the first ``len(failures)`` loads of the whole pool (a payload that
    does not match, out of memory while loading)."""

    def __init__(self, fn, failures: list) -> None:
        super().__init__(fn)
        self.failures = failures

    def apply_weights(self, update: WeightUpdate) -> None:
        if self.failures:
            self.failures.pop()
            raise ValueError("LoRA payload does not match the worker's adapter")


def test_a_worker_that_fails_to_load_weights_is_taken_out_of_service(requests_factory):
    lost_load = r"failed to load weights: ValueError\(\"LoRA payload does not match the worker's adapter\"\)"
    # one worker: a clear error, then no worker left; before, its refusals were re-queued in a busy loop
    factory = functools.partial(_LoadFailsOnce, lambda request: request.seed, failures=[1])
    with RolloutPool(factory) as pool:
        pool.broadcast(WeightUpdate(1, "full", {}))
        pool.submit(requests_factory("a", 2))
        with pytest.raises(PoolError, match=rf"rollout worker 0 {lost_load}; it is out of service"):
            pool.collect(timeout=10)
        with pytest.raises(PoolError, match=rf"no rollout worker is left: worker 0 {lost_load}"):
            pool.collect(timeout=10)
        assert pool.stats["version_refusals"] == 0 and pool.stats["retired"] == 1
        assert pool.pending() == 4  # both requests (2 samples each) wait: none ran with the old weights
    # two workers, one load fails: the other serves every request with the new weights
    factory = functools.partial(_LoadFailsOnce, lambda request: request.seed, failures=[1])
    with RolloutPool(factory, num_workers=2) as pool:
        pool.broadcast(WeightUpdate(1, "full", {}))
        with pytest.raises(PoolError, match=rf"rollout worker \d {lost_load}; it is out of service") as err:
            pool.run(requests_factory("b", 4), timeout=10)
        batch = pool.collect(timeout=10)
        bad = int(str(err.value).split()[2])  # "rollout worker <index> failed ..."
        assert [r.output for r in batch.results] == [0, 1, 2, 3] and batch.lags == [0, 0, 0, 0]
        assert {r.worker for r in batch.results} == {1 - bad} and pool.num_workers == 1
        assert pool.stats["version_refusals"] == 0 and pool.stats["respawned"] == 0


class _WrongAnswers(RolloutWorker):
    """Answers request ``"dict"`` with a dict and request ``"other"`` with another request's result (worker
    bugs); any other request as it should."""

    def run(self, request: RolloutRequest) -> object:
        if request.request_id == "dict":
            return {"request_id": request.request_id}
        result = super().run(request)
        return replace(result, request_id="someone-else") if request.request_id == "other" else result


class _TensorReward(rewards.Reward):
    """Returns a bare tensor where a ``RewardOutput`` is due."""

    def score(self, **batch):
        return torch.zeros(len(batch["completions"]))


def test_a_malformed_answer_fails_only_its_request():
    def req(rid: str, seed: int = 0) -> RolloutRequest:
        return RolloutRequest(rid, ["p"], ["x"], [1], seed=seed)

    with RolloutPool(functools.partial(_WrongAnswers, lambda request: request.seed)) as pool:
        pool.submit([req("dict"), req("other"), req("fine", seed=5)])
        with pytest.raises(
            PoolError,
            match=r"rollout worker 0 answered request 'dict' with a dict \{'request_id': 'dict'\}, "
            "not its RolloutResult",
        ):
            pool.collect(timeout=10)
        with pytest.raises(
            PoolError,
            match="rollout worker 0 answered request 'other' with the RolloutResult of request 'someone-else'",
        ):
            pool.collect(timeout=10)
        assert [(r.request_id, r.output) for r in pool.collect(timeout=10).results] == [("fine", 5)]
        # the pool did not break down: later requests are served
        assert [r.output for r in pool.run([req("later", seed=6)], timeout=10).results] == [6]
    factory = functools.partial(_TextWorker, lambda request: [request.request_id])
    with RolloutPool(factory, reward=functools.partial(RewardWorker, _TensorReward())) as pool:
        for rid in ("d", "e"):  # every request fails alone, with its own error
            with pytest.raises(
                RewardError,
                match=rf"reward worker 0 answered request '{rid}' with a Tensor tensor\(\[0\.\]\), "
                "not a RewardOutput",
            ):
                pool.run([req(rid)], timeout=10)
        assert pool.stats["reward_retries"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reward_workers_score_and_failures_surface(flow_factory, requests_factory, caplog):
    requests = requests_factory("w", 2)
    jpeg = functools.partial(RewardWorker.build, "jpeg_compressibility")
    with RolloutPool(flow_factory, reward=jpeg) as pool:
        batch = pool.run(requests, timeout=60)
    for result in batch.results:
        expected = rewards.build("jpeg_compressibility").score(images=result.output.images)
        torch.testing.assert_close(result.reward.scores, expected.scores)
        assert result.reward_inputs is None
    # a reward server that is down: retried, then a clear error (never a zero reward)
    down = functools.partial(
        RewardWorker.build, "remote", url=f"http://127.0.0.1:{_free_port()}", retries=0, timeout=5
    )
    with (
        caplog.at_level(logging.WARNING, logger="pipelines.pool.pool"),
        RolloutPool(flow_factory, reward=down, reward_retries=2) as pool,
    ):
        with pytest.raises(RewardError, match="failed 3 times"):
            pool.run(requests_factory("x", 1), timeout=60)
        assert pool.stats["reward_retries"] == 2
    assert "retry 2/2" in caplog.text


class _SlowReward(rewards.Reward):
    """A reward taking 0.15 s per call, recording when it ran (a heavy reward model)."""

    def __init__(self, spans: list) -> None:
        self.spans = spans

    def score(self, **batch):
        start = time.perf_counter()
        time.sleep(0.15)
        self.spans.append((start, time.perf_counter()))
        return rewards.RewardOutput(scores=torch.zeros(len(batch["completions"])))


def _slow_task(request: RolloutRequest, spans: list) -> list[str]:
    start = time.perf_counter()
    time.sleep(0.15)
    spans.append((start, time.perf_counter()))
    return ["x"] * request.num_samples


class _TextWorker(RolloutWorker):
    def reward_inputs(self, request, output):
        return {"completions": output}


def test_scoring_overlaps_generation(requests_factory):
    gen, score = [], []
    factory = functools.partial(_TextWorker, functools.partial(_slow_task, spans=gen))
    reward = functools.partial(RewardWorker, _SlowReward(score))
    start = time.perf_counter()
    with RolloutPool(factory, reward=reward) as pool:
        pool.run(requests_factory("o", 4), timeout=30)
    elapsed = time.perf_counter() - start
    # generation of request i+1 runs while request i is scored: 4 x 0.15 s each, ~0.75 s instead of 1.2 s
    overlaps = sum(1 for g in gen for s in score if g[0] < s[1] and s[0] < g[1])
    assert overlaps >= 2 and elapsed < 1.1


class _HangingReward(rewards.Reward):
    """A reward whose call on the completion ``"A"`` hangs until released; records what it scored."""

    def __init__(self, release: threading.Event, scored: list) -> None:
        self.release, self.scored = release, scored

    def score(self, **batch):
        self.scored.append(batch["completions"][0])
        if batch["completions"][0] == "A":
            self.release.wait(30)
        return rewards.RewardOutput(scores=torch.ones(len(batch["completions"])))


def test_lost_reward_worker_charges_only_the_running_call():
    release, scored = threading.Event(), []
    factory = functools.partial(_TextWorker, lambda request: [request.request_id])
    reward = functools.partial(RewardWorker, _HangingReward(release, scored))
    requests = [RolloutRequest(rid, ["p"], ["x"], [1], seed=i) for i, rid in enumerate("AB")]
    try:
        with RolloutPool(factory, reward=reward, reward_retries=0, request_timeout=0.5) as pool:
            pool.submit(requests)  # B's scoring call waits behind A's, which hangs, on the one reward worker
            with pytest.raises(RewardError, match="'A' failed 1 times"):
                pool.collect(timeout=30)
            # B never ran on the lost worker: it is scored by the replacement, with no attempt spent
            batch = pool.collect(timeout=30)
            assert pool.stats["worker_lost"] == 1 and pool.stats["reward_retries"] == 0
        assert [r.request_id for r in batch.results] == ["B"] and batch.results[0].reward.scores.tolist() == [
            1.0
        ]
        assert scored == ["A", "B"]
    finally:
        release.set()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_ray_tensor_serializer_round_trips_exactly(dtype):
    from pipelines.pool.executors import _tensor_from_numpy, _tensor_to_numpy

    source = (torch.randn(4, 6) * 100).to(dtype).t()  # non-contiguous
    if dtype.is_floating_point:
        source.requires_grad_(True)
    packed = _tensor_to_numpy(source)
    packed[0].setflags(write=False)  # as the object store hands it out
    back = _tensor_from_numpy(packed)
    assert back.dtype == dtype and back.shape == source.shape and not back.requires_grad
    assert torch.equal(back, source.detach())
    back.zero_()  # a private, writable copy
    assert not torch.equal(back, source.detach())


def test_inprocess_shutdown_waits_for_running_calls_and_cancels_queued_ones():
    from pipelines.pool.executors import InProcessExecutor

    class Slow:
        def __init__(self) -> None:
            self.done: list[int] = []

        def work(self, i: int) -> int:
            time.sleep(0.3)
            self.done.append(i)
            return i

    executor = InProcessExecutor(Slow, 1)
    executor.start(0).result()
    member = executor.members[0]
    running = executor.call(0, "work", 1)
    queued = executor.call(0, "work", 2)
    time.sleep(0.05)  # the first call is running, the second waits in the member's queue
    executor.shutdown()
    assert member.done == [1] and running.result() == 1 and queued.cancelled()


class _FakeRay:
    """What :class:`pipelines.pool.executors.RayExecutor` calls of ``ray`` when it starts and stops (no actor is
    started here): whether a cluster runs, and how often it was started and shut down."""

    def __init__(self) -> None:
        self.running = False
        self.starts = self.shutdowns = 0
        self.util = type("util", (), {"register_serializer": staticmethod(lambda *a, **k: None)})

    def is_initialized(self) -> bool:
        return self.running

    def init(self, **kwargs) -> None:
        self.running, self.starts = True, self.starts + 1

    def shutdown(self) -> None:
        self.running, self.shutdowns = False, self.shutdowns + 1

    def remote(self, cls):
        return type("actor_class", (), {"options": lambda _self, **kwargs: _self})()


def test_the_local_ray_cluster_stops_with_the_last_executor_whichever_closes_first(monkeypatch):
    from pipelines.pool import executors

    fake = _FakeRay()
    monkeypatch.setattr(executors, "import_ray", lambda: fake)
    first, second = executors.RayExecutor(lambda: None, 1), executors.RayExecutor(lambda: None, 1)
    assert fake.starts == 1  # the first started the local cluster, the second joined it
    first.shutdown()  # the one that started it closes first: the other's actors must keep their cluster
    first.shutdown()  # (closing twice counts once)
    assert fake.running and fake.shutdowns == 0
    second.shutdown()
    assert not fake.running and fake.shutdowns == 1
    # a cluster the caller started is never shut down by an executor
    fake.running = True
    executors.RayExecutor(lambda: None, 1).shutdown()
    assert fake.running and fake.shutdowns == 1


def test_a_tensor_sent_through_ray_lands_on_the_receivers_own_device():
    from pipelines.pool.executors import _receiving_device, _tensor_from_numpy, _tensor_to_numpy

    assert _receiving_device("cuda:1") == "cuda" and _receiving_device("cuda") == "cuda"
    assert _receiving_device("cpu") == "cpu"
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.int64):
        # float dtypes numpy lacks travel as their bits (an fp8 explorer's full weight update included)
        sent = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
        received = _tensor_from_numpy(_tensor_to_numpy(sent))
        assert received.dtype == dtype and torch.equal(received.float(), sent.float()), dtype
