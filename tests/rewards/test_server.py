"""Reward server and client over loopback: auth, limits, malformed payloads, batching, timeouts, restarts.

Servers bind to 127.0.0.1 only, on ports the OS picks; every loop below is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import rewards
from rewards.base import Reward, RewardOutput
from rewards.server import ServerConfig, ServerThread, main
from rewards.wire import encode_batch

TOKEN = "s3cret-token"


def post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{url}/score", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/health", timeout=30) as response:
        return json.loads(response.read())


def distinct_images(n: int, seed: int) -> list[Image.Image]:
    """Images whose JPEG sizes differ, so a swapped or shifted result is caught."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        array = np.full((32, 32, 3), 120, dtype=np.uint8)
        rows = 2 + (i * 7 + seed) % 29  # a noisy band of varying height
        array[:rows] = rng.integers(0, 256, (rows, 32, 3), dtype=np.uint8)
        out.append(Image.fromarray(array))
    return out


JPEG = rewards.build("jpeg_incompressibility")


def config(**overrides: Any) -> ServerConfig:
    base = {"reward": "jpeg_incompressibility", "port": 0, "token": TOKEN, "max_wait_ms": 2.0}
    return ServerConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def server():
    with ServerThread(JPEG, config(max_request_mb=0.1)) as running:
        yield running


def valid_body(n: int = 2, seed: int = 0) -> bytes:
    return json.dumps(encode_batch({"images": distinct_images(n, seed)}, "r1")).encode()


def test_auth_required_and_checked(server) -> None:
    assert post(server.url, valid_body(), token=None)[0] == 401
    assert post(server.url, valid_body(), token="wrong")[0] == 401
    status, data = post(server.url, valid_body())
    assert status == 200 and data["id"] == "r1"
    torch.testing.assert_close(torch.tensor(data["scores"]), JPEG(images=distinct_images(2, 0)))
    with pytest.raises(PermissionError, match="bearer token"):
        rewards.build("remote", url=server.url, retries=0)(images=distinct_images(1, 0))


def test_oversized_request_is_413_and_client_can_chunk(server) -> None:
    big = json.dumps(encode_batch({"images": distinct_images(64, 1)})).encode()
    assert len(big) > 0.1 * 2**20
    status, data = post(server.url, big)
    assert status == 413 and "exceeds" in data["error"]
    client = rewards.build("remote", url=server.url, token=TOKEN, retries=0)
    with pytest.raises(ValueError, match="lower batch_size"):
        client(images=distinct_images(64, 1))
    chunked = rewards.build("remote", url=server.url, token=TOKEN, retries=0, batch_size=16)
    torch.testing.assert_close(chunked(images=distinct_images(64, 1)), JPEG(images=distinct_images(64, 1)))


@pytest.mark.parametrize(
    "body",
    [
        b"not json{",
        b"[1, 2]",
        b'{"images": "abc"}',
        b'{"images": ["!!not base64!!"]}',
        b'{"images": ["aGVsbG8="]}',  # base64 of "hello", not a PNG
        b'{"prompts": [1, 2]}',
        b'{"imagez": []}',
        b"{}",
        b'{"images": []}',
        b'{"id": 5, "completions": ["a"]}',
        b"[" * 20_000 + b"]" * 20_000,  # nested past the JSON parser's recursion limit
        b"\xff\xfe not utf-8",
        b'{"completions": ["a", "b"], "metadata": [{}, "g1"]}',  # metadata items are objects (or null)
    ],
)
def test_malformed_payload_is_400_and_server_stays_up(server, body: bytes) -> None:
    status, data = post(server.url, body)
    assert status == 400, data
    assert data["error"]
    assert post(server.url, valid_body())[0] == 200
    assert health(server.url)["status"] == "ok"


@pytest.mark.parametrize("truth", ["null", "{}", "[]", "NaN", "Infinity", "true", '["4", [4]]'])
def test_a_ground_truth_no_verifier_can_read_is_refused_by_name(truth) -> None:
    """A null, an object or NaN would score 0, as if the completion were wrong: a client's bug, refused."""
    from rewards.wire import WireError, decode_batch

    with pytest.raises(
        WireError, match=r"ground_truths\[1\]: expected a string, a finite number or a non-empty"
    ):
        decode_batch(json.loads(f'{{"completions": ["a", "b"], "ground_truths": ["4", {truth}]}}'))


def test_metadata_that_is_not_an_object_is_refused_by_index() -> None:
    """A string or a list would reach the reward's ``metadata[i].get(...)``: a 500 instead of a 400."""
    from rewards.wire import WireError, decode_batch

    with pytest.raises(
        WireError, match=r'^metadata\[1\]: expected a JSON object or null \(one per sample\), got "g1"$'
    ):
        decode_batch({"completions": ["a", "b"], "metadata": [{"group": 1}, "g1"]})
    _, batch = decode_batch({"completions": ["a", "b"], "metadata": [{"group": 1}, None]})
    assert batch["metadata"] == [{"group": 1}, None]


def test_ground_truths_of_every_accepted_form_decode() -> None:
    from rewards.wire import decode_batch

    truths = ["4", 4, 2.5, ["4", "four", 4]]
    _, batch = decode_batch({"completions": ["a"] * 4, "ground_truths": truths})
    assert batch["ground_truths"] == truths


def test_length_mismatch_and_rejected_fields_are_400(server) -> None:
    payload = encode_batch({"images": distinct_images(2, 2)})
    payload["prompts"] = ["only one"]
    status, data = post(server.url, json.dumps(payload).encode())
    assert status == 400 and "common length" in data["error"]
    # decodes, but the reward itself rejects it (jpeg reads images, not completions): still 400, server up
    status, data = post(server.url, b'{"completions": ["a", "b"]}')
    assert status == 400 and "images" in data["error"]
    assert post(server.url, valid_body())[0] == 200


def test_non_loopback_needs_a_token(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MMRL_REWARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="non-loopback"):
        ServerConfig(reward="format", host="0.0.0.0")
    with pytest.raises(ValueError, match="non-loopback"):
        ServerConfig(reward="format", host="reward-box.internal")
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert ServerConfig(reward="format", host=host).token is None
    monkeypatch.setenv("MMRL_REWARD_TOKEN", "from-env")
    assert ServerConfig(reward="format", host="0.0.0.0").token == "from-env"
    monkeypatch.delenv("MMRL_REWARD_TOKEN")
    path = tmp_path / "server.yaml"
    path.write_text("reward: format\nhost: 0.0.0.0\n")
    with pytest.raises(SystemExit) as error:  # main() refuses before binding anything
        main(["--config", str(path)])
    assert error.value.code == 2
    path.write_text("reward: format\nmax_batch_sise: 4\n")
    with pytest.raises(SystemExit):
        main(["--config", str(path)])


def test_dynamic_batching_merges_concurrent_requests() -> None:
    with ServerThread(JPEG, config(max_batch_size=64, max_wait_ms=100.0)) as running:
        client = rewards.build("remote", url=running.url, token=TOKEN, retries=0)
        batches = [distinct_images(2, seed) for seed in range(12)]
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda imgs: client(images=imgs), batches))
        stats = health(running.url)
    for imgs, scores in zip(batches, results, strict=True):
        torch.testing.assert_close(scores, JPEG(images=imgs), rtol=0, atol=0)
    assert stats["requests"] == 12 and stats["samples"] == 24
    assert stats["mean_batch_size"] > 2  # more than one request per reward call


class MinusBatchMean(Reward):
    """``score_i = x_i - mean(x)`` over the batch it is given: a stand-in for a reward whose scores depend on
    the other samples (the pairwise judge's win rates)."""

    def __init__(self, batch_dependent: bool):
        self.batch_dependent = batch_dependent

    def score(self, *, completions: list[str], **_: Any) -> RewardOutput:
        values = torch.tensor([float(c) for c in completions])
        return RewardOutput(scores=values - values.mean())


@pytest.mark.parametrize(
    ("batch_dependent", "expected"),
    [
        (True, [[-0.5, 0.5], [-5.0, 5.0]]),  # each request alone: means 1.5 and 15
        (
            False,
            [[-7.25, -6.25], [1.75, 11.75]],
        ),  # merged: one mean, 8.25 (what a batch-dependent reward must not get)
    ],
)
def test_a_batch_dependent_reward_scores_each_request_alone(batch_dependent, expected) -> None:
    reward = MinusBatchMean(batch_dependent)
    # a batch closes when full (4 samples) or after 2 s: two concurrent requests of 2 would be merged
    with ServerThread(reward, config(reward="minus_mean", max_batch_size=4, max_wait_ms=2000.0)) as running:
        bodies = [b'{"completions": ["1", "2"]}', b'{"completions": ["10", "20"]}']
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda body: post(running.url, body), bodies))
        stats = health(running.url)
    assert [status for status, _ in answers] == [200, 200]
    assert [data["scores"] for _, data in answers] == expected
    assert stats["batches"] == (2 if batch_dependent else 1)


@pytest.mark.parametrize(
    ("batch_dependent", "groups", "expected"),
    [
        # groups a = [1, 2], b = [10, 20] travel whole, each in one request: means 1.5 and 15
        (True, ["a", "b", "a", "b"], [-0.5, -5.0, 0.5, 5.0]),
        # a reward that does not depend on its batch is cut in runs of batch_size: [1, 10], [2, 20]
        (False, ["a", "b", "a", "b"], [-4.5, 4.5, -9.0, 9.0]),
        # no group and no prompt: nothing tells the groups apart, so the batch is one group
        (True, None, "would split a group of 4 samples"),
    ],
)
def test_the_client_keeps_groups_whole_for_a_batch_dependent_reward(
    batch_dependent, groups, expected
) -> None:
    reward = MinusBatchMean(batch_dependent)
    with ServerThread(reward, config(reward="minus_mean")) as running:
        assert health(running.url)["batch_dependent"] is batch_dependent
        client = rewards.build("remote", url=running.url, token=TOKEN, retries=0, batch_size=2)
        batch = {"completions": ["1", "10", "2", "20"]}
        if groups is not None:
            batch["metadata"] = [{"group": g} for g in groups]
        if isinstance(expected, str):
            with pytest.raises(ValueError, match=expected):
                client.score(**batch)
        else:
            assert client.score(**batch).scores.tolist() == expected


def test_linked_groups_join_samples_sharing_a_prompt_or_a_group() -> None:
    from rewards.remote import linked_groups

    prompts = ["cat", "dog", "cat", "fox", "owl", "dog"]
    metadata = [None, {"group": 7}, {}, {"group": 7}, {"group": 9}, None]
    # 1 and 3 share group 7, 1 and 5 the prompt "dog": {1, 3, 5}; 4 stands alone
    assert linked_groups(prompts, metadata, 6) == [[0, 2], [1, 3, 5], [4]]
    assert linked_groups(None, [{"group": 1}, None, {"group": 1}, None], 4) == [[0, 2], [1, 3]]


def test_the_pairwise_judge_and_its_video_form_are_batch_dependent() -> None:
    judge = rewards.build("vlm_judge_pairwise", judge=object())
    assert judge.batch_dependent and not rewards.build("vlm_judge", judge=object()).batch_dependent
    assert rewards.build("video_frames", reward=judge).batch_dependent
    assert not rewards.build("video_frames", reward="jpeg_incompressibility").batch_dependent


class Miscount(Reward):
    """Returns ``len(completions) + extra`` scores (or that many reasons, with ``in_reasons``): a broken reward."""

    name = "miscount"

    def __init__(self, extra: int, in_reasons: bool = False):
        self.extra, self.in_reasons = extra, in_reasons

    def score(self, *, completions: list[str], **_: Any) -> RewardOutput:
        n = len(completions)
        if self.in_reasons:
            return RewardOutput(scores=torch.zeros(n), reasons=[None] * (n + self.extra))
        return RewardOutput(scores=torch.arange(n + self.extra, dtype=torch.float32))


@pytest.mark.parametrize(
    ("extra", "in_reasons", "what"),
    [(1, False, "4 scores"), (-1, False, "2 scores"), (-2, True, "1 reasons")],
)
def test_a_reward_returning_other_than_one_score_per_sample_fails_the_request(
    extra, in_reasons, what
) -> None:
    with ServerThread(Miscount(extra, in_reasons), config(reward="miscount")) as running:
        status, data = post(running.url, b'{"completions": ["a", "b", "c"]}')
    assert status == 500
    assert data["error"] == (
        f"reward failed: RuntimeError: reward 'miscount' returned {what} for a batch of 3 samples; a reward must "
        "return one per sample, in order"
    )


class SlowImages(Reward):
    """Scores images after ``seconds``; ``done`` is set when the model call ends."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.done = threading.Event()

    def score(self, *, images: list[Image.Image], **_: Any) -> RewardOutput:
        time.sleep(self.seconds)
        self.done.set()
        return RewardOutput(scores=torch.zeros(len(images)))


def test_a_timed_out_request_holds_its_pixels_until_its_scoring_ends() -> None:
    """The 504 does not free the decoded images (the model call runs on): their pixels stay counted, so the
    next request finds the budget full, until the batcher is through with them."""
    reward = SlowImages(1.5)
    pixels = 32 * 32
    cfg = config(reward="slow", request_timeout_s=0.2, max_request_pixels=pixels, max_pixels_in_flight=pixels)
    with ServerThread(reward, cfg) as running:
        status, _ = post(running.url, valid_body(1))
        assert status == 504 and not reward.done.is_set()
        assert running.server.pixels_in_flight == pixels
        assert post(running.url, valid_body(1))[0] == 503  # the budget is still full
        assert reward.done.wait(timeout=10)
        for _ in range(200):  # the batcher releases on the event loop, right after the call (bounded wait)
            if running.server.pixels_in_flight == 0:
                break
            time.sleep(0.01)
        assert running.server.pixels_in_flight == 0
        reward.seconds = 0.0
        assert post(running.url, valid_body(1))[0] == 200


def test_a_request_dropped_while_queued_releases_its_pixels() -> None:
    reward = SlowImages(1.0)
    pixels = 32 * 32
    cfg = config(
        reward="slow",
        request_timeout_s=0.3,
        max_batch_size=1,
        max_request_pixels=pixels,
        max_pixels_in_flight=2 * pixels,
    )
    with ServerThread(reward, cfg) as running:
        with ThreadPoolExecutor(2) as pool:  # one is scored, the other waits in the queue behind it
            statuses = list(pool.map(lambda _: post(running.url, valid_body(1))[0], range(2)))
        assert statuses == [504, 504]
        assert running.server.pixels_in_flight == 2 * pixels  # one in the model call, one queued
        for _ in range(300):  # bounded: the call ends after 1 s, then the queued job is dropped
            if running.server.pixels_in_flight == 0:
                break
            time.sleep(0.01)
        assert running.server.pixels_in_flight == 0
        assert health(running.url)["batches"] == 1  # the queued request was dropped, not scored


def test_an_ipv6_host_is_bracketed_in_urls() -> None:
    from rewards.server import http_url

    assert http_url("::1", 8765) == "http://[::1]:8765"
    assert http_url("127.0.0.1", 8765) == "http://127.0.0.1:8765"
    with ServerThread(rewards.build("exact_match"), config(reward="exact_match", host="::1")) as running:
        assert running.url == f"http://[::1]:{running.server.port}"
        client = rewards.build("remote", url=running.url, token=TOKEN, retries=0)
        assert client(completions=["a", "b"], ground_truths=["a", "a"]).tolist() == [1.0, 0.0]


class SlowReward(Reward):
    """Sleeps before scoring: a stand-in for a heavy model, to exercise the per-request timeout."""

    def score(self, *, completions: list[str], **_: Any) -> RewardOutput:
        time.sleep(float(completions[0]))
        return RewardOutput(scores=torch.zeros(len(completions)))


def test_request_timeout_is_504_and_server_recovers() -> None:
    with ServerThread(SlowReward(), config(reward="slow", request_timeout_s=0.3)) as running:
        status, data = post(running.url, b'{"completions": ["1.0"]}')
        assert status == 504 and "request_timeout_s" in data["error"]
        # a running model call cannot be interrupted: the worker is busy until the 1 s sleep ends
        time.sleep(1.0)
        status, data = post(running.url, b'{"completions": ["0"]}')
        assert status == 200 and data["scores"] == [0.0]


def test_a_failing_request_does_not_fail_its_batch(open_clip_name, open_clip_weights) -> None:
    reward = rewards.build(
        "temporal_consistency", model_name=open_clip_name, pretrained=str(open_clip_weights)
    )
    frames = distinct_images(4, 3)
    good = [{"videos": [frames[:2]]}, {"videos": [frames[1:3]]}, {"videos": [frames[2:]]}]
    bad = {"videos": [frames[:1]]}  # one frame: temporal_consistency raises ValueError
    with ServerThread(reward, config(reward="temporal_consistency", max_wait_ms=200.0)) as running:
        bodies = [json.dumps(encode_batch(b)).encode() for b in [good[0], bad, good[1], good[2]]]
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda body: post(running.url, body), bodies))
        stats = health(running.url)
    assert [status for status, _ in answers] == [200, 400, 200, 200]
    assert ">= 2 frames" in answers[1][1]["error"]
    for (_, data), batch in zip([answers[0], answers[2], answers[3]], good, strict=True):
        torch.testing.assert_close(torch.tensor(data["scores"]), reward(**batch), rtol=1e-5, atol=1e-6)
    assert stats["batches"] < 4  # the requests were merged (then retried one by one)


def test_client_survives_server_restart_mid_stream() -> None:
    first = ServerThread(JPEG, config()).start()
    port = first.server.port
    url = first.url
    client = rewards.build(
        "remote", url=url, token=TOKEN, retries=10, backoff_s=0.05, max_backoff_s=0.5, timeout=10
    )
    requests = [distinct_images(3, seed) for seed in range(30)]
    results: list[torch.Tensor] = []
    done = threading.Event()

    def stream() -> None:
        for imgs in requests:
            results.append(client(images=imgs))
            time.sleep(0.01)
        done.set()

    worker = threading.Thread(target=stream)
    worker.start()
    for _ in range(500):  # wait (bounded) until the stream is under way
        if len(results) >= 5:
            break
        time.sleep(0.01)
    first.stop()
    stopped_at = len(results)
    time.sleep(0.5)  # the client keeps retrying against a closed port meanwhile
    second = ServerThread(JPEG, config(port=port)).start()
    try:
        assert done.wait(timeout=60)
        worker.join(timeout=5)
    finally:
        second.stop()
    assert 5 <= stopped_at < len(requests)  # the restart really happened mid-stream
    assert len(results) == len(requests)
    for imgs, scores in zip(requests, results, strict=True):  # every result correct, in order
        torch.testing.assert_close(scores, JPEG(images=imgs), rtol=0, atol=0)


def test_the_vlm_trainers_batch_reaches_a_reference_checking_reward() -> None:
    """What the VLM trainer sends every verifier (completions, ground truths, reference solutions) crosses the
    wire: a remote ``reasoning_steps`` scores against the references as the local one does."""
    local = rewards.build("reasoning_steps")
    batch = {
        "completions": ["<think>red 1. red 2</think>", "<think>blue 1</think>"],
        "ground_truths": ["2", "1"],
        "references": ["red 1. red 2", "red 1"],
    }
    with ServerThread(local, config(reward="reasoning_steps")) as running:
        client = rewards.build("remote", url=running.url, token=TOKEN, retries=0)
        remote = client.score(**batch)
        status, data = post(running.url, json.dumps({**batch, "references": [3, None]}).encode())
    assert remote.scores.tolist() == local.score(**batch).scores.tolist() == [1.0, 0.0]
    assert status == 400 and "every reference must be a string or null" in data["error"]


def test_client_gives_up_after_retries() -> None:
    client = rewards.build("remote", url="http://127.0.0.1:9", retries=2, backoff_s=0.01, timeout=2)
    start = time.monotonic()
    with pytest.raises(rewards.remote.RemoteRewardError, match="after 3 attempts"):
        client(completions=["a"], ground_truths=["a"])
    assert time.monotonic() - start < 5


def test_server_module_cli_serves_and_stops(tmp_path, monkeypatch) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("reward: exact_match\nhost: 127.0.0.1\nport: 0\nmax_wait_ms: 1\n")
    monkeypatch.setenv("MMRL_REWARD_TOKEN", TOKEN)  # read by both the server and the client
    process = subprocess.Popen(
        [sys.executable, "-m", "rewards.server", "--config", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    try:
        line = process.stdout.readline()  # "reward server ready on http://127.0.0.1:PORT"
        assert "ready on" in line, line
        url = line.split()[-1]
        client = rewards.build("remote", url=url, retries=0)  # token from MMRL_REWARD_TOKEN
        out = client.score(completions=["<answer>Red</answer>", "blue"], ground_truths=["red", "red"])
        assert out.scores.tolist() == [1.0, 0.0]
        assert out.reasons[0] is None and "does not match" in out.reasons[1]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
