"""Reward server under load: throughput, latency, batching, and an exact check of every answer.

    python -m benchmarks.reward_server [--duration 30] [--clients 8] [--images 4] [--size 64]

Starts ``python -m rewards.server`` on 127.0.0.1 (a separate process, as in deployment) serving the CPU reward
``jpeg_incompressibility`` with a bearer token, then runs ``--clients`` closed-loop clients (threads with
persistent HTTP connections) for ``--duration`` seconds. Every request carries its own id and a distinct set of
images whose scores were computed locally beforehand; every answer is checked:

* lost: a request without a 200 answer;
* duplicated: an id answered more than once;
* mismatched: an answer whose id or scores (exactly, in order) are not those of its request.

Reported: requests/s, images/s, latency p50/p99, the server's mean batch size (samples per reward call, from
``/health``), and the three counts, which must all be 0 (the exit status is 1 otherwise).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rewards.jpeg import jpeg_size_kb
from rewards.wire import encode_png


@dataclass
class ClientLog:
    sent: int = 0
    latencies: list[float] = field(default_factory=list)
    answered: dict[str, int] = field(default_factory=dict)  # id -> answers seen
    lost: int = 0
    mismatched: int = 0
    errors: list[str] = field(default_factory=list)


def make_pool(n: int, size: int, seed: int = 0) -> list[Image.Image]:
    """``n`` images with distinct JPEG sizes: noise bands of varying height on grey."""
    rng = np.random.default_rng(seed)
    pool = []
    for i in range(n):
        array = np.full((size, size, 3), 100 + i % 50, dtype=np.uint8)
        rows = 1 + (i * 13) % (size - 1)
        array[:rows] = rng.integers(0, 256, (rows, size, 3), dtype=np.uint8)
        pool.append(Image.fromarray(array))
    return pool


def start_server(config: dict[str, Any], token: str) -> tuple[subprocess.Popen[str], str]:
    path = Path(tempfile.mkdtemp(prefix="reward-bench-")) / "server.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    env = {**os.environ, "MMRL_REWARD_TOKEN": token}
    process = subprocess.Popen(
        [sys.executable, "-m", "rewards.server", "--config", str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = process.stdout.readline() if process.stdout else ""
    if "ready on" not in line:
        process.kill()
        raise RuntimeError(f"reward server did not start: {line!r}")
    return process, line.split()[-1]


def health(url: str) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("GET", "/health")
    data = json.loads(connection.getresponse().read())
    connection.close()
    return data


def client_loop(
    index: int,
    url: str,
    token: str,
    encoded: list[str],
    expected: list[float],
    per_request: int,
    deadline: float,
    log: ClientLog,
) -> None:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    rng = np.random.default_rng(1000 + index)
    seq = 0
    while time.monotonic() < deadline:
        picks = rng.choice(len(encoded), size=per_request, replace=False).tolist()
        request_id = f"c{index}-{seq}"
        seq += 1
        body = json.dumps({"id": request_id, "images": [encoded[i] for i in picks]})
        log.sent += 1
        start = time.perf_counter()
        try:
            connection.request("POST", "/score", body=body, headers=headers)
            response = connection.getresponse()
            data = json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as error:
            log.lost += 1
            log.errors.append(f"{request_id}: {error!r}")
            connection.close()
            connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            continue
        log.latencies.append(time.perf_counter() - start)
        if response.status != 200:
            log.lost += 1
            log.errors.append(f"{request_id}: HTTP {response.status} {data}")
            continue
        answer_id = data.get("id")
        log.answered[answer_id] = log.answered.get(answer_id, 0) + 1
        if answer_id != request_id or data.get("scores") != [expected[i] for i in picks]:
            log.mismatched += 1
    connection.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    # 1. the image pool, its wire encoding and its locally computed scores
    pool = make_pool(args.pool, args.size)
    encoded = encode_png(pool)
    # the server answers float32 scores serialised as JSON floats: compare with the same values
    expected = [float(v) for v in jpeg_size_kb(pool).tolist()]
    if len(set(expected)) < len(expected) // 2:
        raise RuntimeError("image pool scores are not distinct enough to detect mismatches")
    # 2. the server
    token = secrets.token_hex(16)
    config = {
        "reward": "jpeg_incompressibility",
        "host": "127.0.0.1",
        "port": 0,
        "max_batch_size": args.max_batch_size,
        "max_wait_ms": args.max_wait_ms,
        "log_level": "WARNING",
    }
    process, url = start_server(config, token)
    try:
        before = health(url)
        # 3. the clients, closed loop until the deadline
        logs = [ClientLog() for _ in range(args.clients)]
        deadline = time.monotonic() + args.duration
        started = time.perf_counter()
        threads = [
            threading.Thread(
                target=client_loop, args=(i, url, token, encoded, expected, args.images, deadline, logs[i])
            )
            for i in range(args.clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=args.duration + 120)
        elapsed = time.perf_counter() - started
        after = health(url)
    finally:
        process.terminate()
        process.wait(timeout=30)
    # 4. the figures and the checks
    latencies = np.array([x for log in logs for x in log.latencies])
    answered = sum(sum(log.answered.values()) for log in logs)
    duplicated = sum(n - 1 for log in logs for n in log.answered.values() if n > 1)
    sent = sum(log.sent for log in logs)
    lost = sent - answered  # every request without a 200 answer (the clients also count them as they go)
    batches = after["batches"] - before["batches"]
    samples = after["samples"] - before["samples"]
    return {
        "clients": args.clients,
        "duration_s": round(elapsed, 2),
        "images_per_request": args.images,
        "image_size": args.size,
        "max_batch_size": args.max_batch_size,
        "max_wait_ms": args.max_wait_ms,
        "requests": sent,
        "requests_per_s": round(answered / elapsed, 1),
        "images_per_s": round(answered * args.images / elapsed, 1),
        "latency_p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 2),
        "latency_p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 2),
        "mean_batch_size": round(samples / batches, 2) if batches else 0.0,
        "mean_requests_per_batch": round(samples / args.images / batches, 2) if batches else 0.0,
        "lost": lost,
        "lost_seen_by_clients": sum(log.lost for log in logs),
        "duplicated": duplicated,
        "mismatched": sum(log.mismatched for log in logs),
        "errors": [e for log in logs for e in log.errors][:5],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.reward_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent closed-loop clients (default 8)")
    parser.add_argument("--images", type=int, default=4, help="images per request (default 4)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--pool", type=int, default=512, help="distinct images to draw from (default 512)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="server max_batch_size (default 64)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="server max_wait_ms (default 5)")
    parser.add_argument("--output", help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    ok = result["lost"] == result["duplicated"] == result["mismatched"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
