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

``--abuse`` runs the same good clients while a separate attacker process (localhost only, every loop bounded by
``--duration``) holds ``--slow`` slow connections open (each sends a request line and then one header byte per
second, or, for ``--slow-bodies`` of them, whole authorised headers declaring a 1 MB body and then one body byte
per second; each reconnects when the server closes it) and ``--bombers`` clients send a stream of decompression
bombs (requests of ``--bomb-images`` 1-bit PNGs of 8192 x 8192 pixels, about 11 kB each, which the server must
refuse with 413 from their headers). It also samples the server's resident memory (``/proc``, Linux) and
reports its peak. Goals, checked in the exit status: good requests' p99 under ``--p99-goal-ms`` (1000), peak
RSS under ``--rss-budget-mb`` (2048), nothing lost, duplicated or mismatched.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import io
import json
import multiprocessing
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


def start_server(config: dict[str, Any], token: str) -> tuple[subprocess.Popen[str], str, Path]:
    """Start the server process; returns it, its URL and the file its log (stderr) goes to."""
    folder = Path(tempfile.mkdtemp(prefix="reward-bench-"))
    path = folder / "server.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    log = folder / "server.log"
    env = {**os.environ, "MMRL_REWARD_TOKEN": token}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "rewards.server", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    line = process.stdout.readline() if process.stdout else ""
    if "ready on" not in line:
        process.kill()
        raise RuntimeError(f"reward server did not start: {line!r}; its log: {log.read_text()[-2000:]}")
    return process, line.split()[-1], log


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


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB, from ``/proc`` (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def bomb_png(side: int = 8192) -> str:
    """A base64 1-bit all-black PNG of ``side`` x ``side`` pixels: a few kB that decode to ``side**2`` pixels."""
    buffer = io.BytesIO()
    Image.new("1", (side, side)).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def _slow_connection(
    host: str, port: int, deadline: float, counts: dict[str, int], start: bytes
) -> None:
    """Reconnect until ``deadline``; each connection sends ``start`` (a request line, or whole headers), then
    one byte per second (of a header, or of the body) until the server answers or closes it."""
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(1.0)
            continue
        counts["opened"] += 1
        answer = b"open at the end"
        try:
            writer.write(start)
            while loop.time() < deadline:
                try:
                    answer = await asyncio.wait_for(reader.read(64), 1.0)
                    break  # the server answered or closed the connection
                except asyncio.TimeoutError:
                    writer.write(b"a")
                    await writer.drain()
        except OSError:
            answer = b"reset"
        if answer.startswith(b"HTTP/1.1 408"):
            counts["closed_408"] += 1
        elif answer.startswith(b"HTTP/1.1 503"):
            counts["refused_503"] += 1
        elif answer == b"open at the end":
            counts["open_at_end"] += 1
        else:
            counts["closed_other"] += 1
        writer.close()


async def _bomber(url: str, token: str, body: bytes, deadline: float, counts: dict[str, int]) -> None:
    """Send decompression-bomb requests back to back until ``deadline``; count the answers by status."""
    parts = urllib.parse.urlsplit(url)
    loop = asyncio.get_running_loop()
    head = (
        f"POST /score HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    while loop.time() < deadline:
        try:
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            writer.write(head + body)
            await writer.drain()
            status = (await asyncio.wait_for(reader.readline(), 30.0)).split()
            counts[f"bomb_{status[1].decode() if len(status) > 1 else 'no_answer'}"] += 1
            writer.close()
        except (OSError, asyncio.TimeoutError):
            counts["bomb_failed"] += 1
            await asyncio.sleep(0.1)


def attacker(url: str, token: str, args: dict[str, Any], deadline_in: float, out: Any) -> None:
    """The attacker process: ``args["slow"]`` slow connections (``args["slow_bodies"]`` of them send whole,
    authorised headers and then drip the body) and ``args["bombers"]`` bomb senders."""
    import collections
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args["slow"] + 256)), hard))
    counts: dict[str, int] = collections.defaultdict(int)
    body = json.dumps({"images": [bomb_png()] * args["bomb_images"]}).encode()
    parts = urllib.parse.urlsplit(url)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_in
        tasks = []
        slow_header = b"POST /score HTTP/1.1\r\nHost: bench\r\nX-Slow: "
        slow_body = (
            f"POST /score HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        ).encode()
        for i in range(args["slow"]):  # ramp up: 100 new connections per 0.1 s
            start = slow_body if i < args["slow_bodies"] else slow_header
            tasks.append(
                asyncio.ensure_future(_slow_connection(parts.hostname, parts.port, deadline, counts, start))
            )
            if i % 100 == 99:
                await asyncio.sleep(0.1)
        tasks += [
            asyncio.ensure_future(_bomber(url, token, body, deadline, counts)) for _ in range(args["bombers"])
        ]
        await asyncio.gather(*tasks)

    asyncio.run(main())
    out.put(dict(counts))


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
        "log_level": args.log_level,
    }
    process, url, log = start_server(config, token)
    peak_rss = [rss_mb(process.pid)]
    attack = None
    try:
        before = health(url)
        if args.abuse:  # 3a. the attacker, started first so the good clients run under the whole attack
            attack_out: Any = multiprocessing.get_context("spawn").Queue()
            attack_args = {
                "slow": args.slow,
                "slow_bodies": args.slow_bodies,
                "bombers": args.bombers,
                "bomb_images": args.bomb_images,
            }
            attack = multiprocessing.get_context("spawn").Process(
                target=attacker, args=(url, token, attack_args, args.duration + args.ramp_s, attack_out)
            )
            attack.start()
            time.sleep(args.ramp_s)
        # 3. the clients, closed loop until the deadline
        logs = [ClientLog() for _ in range(args.clients)]
        deadline = time.monotonic() + args.duration
        started = time.perf_counter()
        sampling = threading.Event()

        def sample_rss() -> None:
            while not sampling.wait(0.1):
                peak_rss.append(rss_mb(process.pid))

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
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
        attack_counts = {}
        if attack is not None:
            attack_counts = attack_out.get(timeout=args.duration + 120)
            attack.join(timeout=60)
        sampling.set()
        sampler.join(timeout=5)
        peak_rss.append(rss_mb(process.pid, "VmHWM"))  # the kernel's own peak, between samples too
    finally:
        if attack is not None and attack.is_alive():
            attack.terminate()
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
        "server_peak_rss_mb": round(max(peak_rss), 1),
        "server_log_level": args.log_level,
        "server_log_bytes": log.stat().st_size,
        "server_counters": {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int)},
        "attack": attack_counts,
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
    parser.add_argument(
        "--log-level", default="WARNING", help="server log level (INFO adds one access line per request)"
    )
    parser.add_argument(
        "--abuse", action="store_true", help="run the clients under attack (module docstring)"
    )
    parser.add_argument("--slow", type=int, default=1000, help="slow connections held open (default 1000)")
    parser.add_argument(
        "--slow-bodies",
        type=int,
        default=500,
        help="how many of the slow connections send whole headers with the token, then drip a 1 MB body (500)",
    )
    parser.add_argument("--bombers", type=int, default=2, help="decompression-bomb senders (default 2)")
    parser.add_argument(
        "--bomb-images", type=int, default=4, help="8192x8192 PNGs per bomb request (default 4)"
    )
    parser.add_argument(
        "--ramp-s", type=float, default=3.0, help="seconds the attack runs before the clients"
    )
    parser.add_argument(
        "--p99-goal-ms", type=float, default=1000.0, help="good-request p99 goal (default 1000)"
    )
    parser.add_argument(
        "--rss-budget-mb", type=float, default=2048.0, help="server peak RSS goal (default 2048)"
    )
    args = parser.parse_args(argv)
    result = run(args)
    if args.abuse:
        result["goals_met"] = {
            "p99": result["latency_p99_ms"] < args.p99_goal_ms,
            "rss": result["server_peak_rss_mb"] < args.rss_budget_mb,
            "nothing_lost": result["lost"] == result["duplicated"] == result["mismatched"] == 0,
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    ok = result["lost"] == result["duplicated"] == result["mismatched"] == 0
    if args.abuse:
        ok = all(result["goals_met"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
