"""Reward server: any registered reward over HTTP, with dynamic batching.

    python -m rewards.server --config reward_server.yaml        (or: mmrl serve-reward reward_server.yaml)

The config (YAML, every key of :class:`ServerConfig`)::

    reward: pickscore                   # registry name
    options: {device: cuda, dtype: float16}   # the reward's options
    host: 0.0.0.0                       # a non-loopback host requires a token
    port: 8765
    token_env: MMRL_REWARD_TOKEN        # bearer token read from this environment variable
    max_batch_size: 64                  # samples per reward call
    max_wait_ms: 10                     # how long a batch waits for more requests
    max_request_mb: 64
    request_timeout_s: 120

Endpoints: ``POST /score`` (wire format in :mod:`rewards.wire`; ``Authorization: Bearer <token>`` when a token
is set) and ``GET /health`` (no auth; status, reward name, request/batch counters).

Dynamic batching: requests are queued; one batcher task takes the oldest, then keeps taking requests until
``max_batch_size`` samples are gathered or ``max_wait_ms`` has passed, calls the reward once on the
concatenated batch in a worker thread (the event loop keeps accepting requests meanwhile, so the queue fills
while the model runs) and splits the result back. Requests are merged only when they carry the same fields. If
a merged call fails, each request is retried alone, so one bad request cannot fail its neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import json
import logging
import os
import signal
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rewards.base import Reward, RewardOutput
from rewards.registry import build
from rewards.wire import batch_length, decode_batch, encode_output

logger = logging.getLogger(__name__)


class ServerConfig(BaseModel):
    """Configuration of a reward server (the YAML file's keys)."""

    model_config = ConfigDict(extra="forbid")

    reward: str = Field(description="registry name of the reward to serve (rewards.list_rewards())")
    options: dict[str, Any] = Field(default_factory=dict, description="keyword options of the reward")
    host: str = Field("127.0.0.1", description="bind address; anything but loopback requires a token")
    port: int = Field(8765, ge=0, le=65535, description="TCP port; 0 picks a free one")
    token: str | None = Field(
        None, description="bearer token; prefer token_env so the secret is not in the file"
    )
    token_env: str | None = Field(
        "MMRL_REWARD_TOKEN",
        description="environment variable holding the bearer token (used when token is unset)",
    )
    max_batch_size: int = Field(32, ge=1, description="most samples per reward call")
    max_wait_ms: float = Field(
        5.0, ge=0, description="how long the oldest queued request waits for others to fill a batch"
    )
    max_request_mb: float = Field(32.0, gt=0, description="largest accepted request body, MiB (larger: 413)")
    request_timeout_s: float = Field(
        120.0, gt=0, description="a request not scored within this time gets 504"
    )
    log_level: str = Field("INFO", description="logging level of the server process")

    @model_validator(mode="after")
    def _resolve_token(self) -> ServerConfig:
        if self.token is None and self.token_env:
            self.token = os.environ.get(self.token_env) or None
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on non-loopback host {self.host!r} without a bearer token: set 'token' or "
                f"the environment variable named by token_env ({self.token_env!r}), or bind to 127.0.0.1"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve to anything
        return False


def load_config(path: str | Path, **overrides: Any) -> ServerConfig:
    """Read and validate a server YAML file; ``overrides`` replace its keys.

    Raises:
        ValueError: not a mapping, an unknown or ill-typed key (pydantic names it), no token off loopback.
    """
    with open(path) as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of ServerConfig keys, got {type(data).__name__}")
    return ServerConfig(**{**data, **overrides})


@dataclass
class _Job:
    batch: dict[str, Any]
    size: int
    future: asyncio.Future[RewardOutput]
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = tuple(sorted(self.batch))


def merge_batches(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate batches with the same fields, field by field."""
    return {key: [item for b in batches for item in b[key]] for key in batches[0]}


def split_output(output: RewardOutput, sizes: Sequence[int]) -> list[RewardOutput]:
    """Split a merged :class:`RewardOutput` back into one output per request."""
    outs, start = [], 0
    for size in sizes:
        stop = start + size
        outs.append(
            RewardOutput(
                scores=output.scores[start:stop],
                components={k: v[start:stop] for k, v in output.components.items()},
                reasons=None if output.reasons is None else output.reasons[start:stop],
            )
        )
        start = stop
    return outs


@dataclass
class Stats:
    requests: int = 0
    samples: int = 0
    batches: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, float]:
        mean = self.samples / self.batches if self.batches else 0.0
        return {**self.__dict__, "mean_batch_size": mean}


class Batcher:
    """Queue of scoring jobs and the task that batches them (see the module docstring)."""

    def __init__(self, reward: Reward, max_batch_size: int, max_wait_s: float):
        self.reward = reward
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.stats = Stats()
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._carry: _Job | None = None
        # one worker thread: reward models are not assumed thread-safe, and calls are already batched
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._executor.shutdown(wait=True)

    async def submit(self, batch: dict[str, Any]) -> RewardOutput:
        job = _Job(batch, batch_length(batch), asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.future

    async def _collect(self) -> list[_Job]:
        loop = asyncio.get_running_loop()
        first = self._carry or await self.queue.get()
        self._carry = None
        jobs, size = [first], first.size
        deadline = loop.time() + self.max_wait_s
        while size < self.max_batch_size:
            try:
                job = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                # not wait_for(queue.get()): before Python 3.12 it can time out after the get has taken an
                # item, which would lose that request. A cancelled Queue.get leaves its item in the queue.
                getter = asyncio.ensure_future(self.queue.get())
                try:
                    await asyncio.wait({getter}, timeout=remaining)
                finally:  # also when the batcher itself is cancelled at shutdown
                    if not getter.done():
                        getter.cancel()
                        await asyncio.gather(getter, return_exceptions=True)
                if getter.cancelled():
                    break
                job = getter.result()
            if job.keys != first.keys or size + job.size > self.max_batch_size:
                self._carry = job  # starts the next batch
                break
            jobs.append(job)
            size += job.size
        return jobs

    def _score(self, batches: list[dict[str, Any]]) -> RewardOutput:
        return self.reward.score(**merge_batches(batches))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # requests that timed out while queued are dropped here
            jobs = [job for job in await self._collect() if not job.future.done()]
            if not jobs:
                continue
            self.stats.batches += 1
            self.stats.samples += sum(job.size for job in jobs)
            try:
                output = await loop.run_in_executor(self._executor, self._score, [j.batch for j in jobs])
                for job, part in zip(jobs, split_output(output, [j.size for j in jobs]), strict=True):
                    if not job.future.done():
                        job.future.set_result(part)
            except Exception as error:
                if len(jobs) == 1:
                    if not jobs[0].future.done():
                        jobs[0].future.set_exception(error)
                    continue
                # isolate the failing request: score each alone
                for job in jobs:
                    try:
                        part = await loop.run_in_executor(self._executor, self._score, [job.batch])
                        if not job.future.done():
                            job.future.set_result(part)
                    except Exception as single_error:
                        if not job.future.done():
                            job.future.set_exception(single_error)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class RewardServer:
    """The aiohttp application around one reward and its :class:`Batcher`."""

    def __init__(self, reward: Reward, config: ServerConfig):
        self.reward = reward
        self.config = config
        self.max_bytes = int(config.max_request_mb * 2**20)
        self.batcher: Batcher | None = None
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    def make_app(self) -> web.Application:
        # client_max_size makes aiohttp answer 413 itself when a body without Content-Length grows too big
        app = web.Application(client_max_size=self.max_bytes)
        app.router.add_post("/score", self.handle_score)
        app.router.add_get("/health", self.handle_health)
        return app

    def authorized(self, request: web.Request) -> bool:
        if self.config.token is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        # constant-time comparison: the token must not leak through response timing
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.config.token.encode())

    async def handle_health(self, request: web.Request) -> web.Response:
        stats = self.batcher.stats.as_dict() if self.batcher else {}
        return web.json_response({"status": "ok", "reward": self.config.reward, **stats})

    async def handle_score(self, request: web.Request) -> web.Response:
        assert self.batcher is not None  # set by start(), before the site accepts connections
        if not self.authorized(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        if request.content_length is not None and request.content_length > self.max_bytes:
            return _error(
                413, f"request body {request.content_length} bytes exceeds the limit of {self.max_bytes}"
            )
        body = await request.read()  # raises HTTPRequestEntityTooLarge (413) past client_max_size
        self.batcher.stats.requests += 1
        loop = asyncio.get_running_loop()
        try:
            payload = json.loads(body)
            # PNG decoding is CPU work: keep it off the event loop
            request_id, batch = await loop.run_in_executor(None, decode_batch, payload)
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError and WireError are ValueErrors
            self.batcher.stats.errors += 1
            return _error(400, f"malformed request: {error}")
        try:
            output = await asyncio.wait_for(self.batcher.submit(batch), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            self.batcher.stats.errors += 1
            return _error(504, f"not scored within request_timeout_s={self.config.request_timeout_s}")
        except (ValueError, TypeError, KeyError) as error:  # the reward rejected the input
            self.batcher.stats.errors += 1
            return _error(400, f"{type(error).__name__}: {error}")
        except Exception as error:
            self.batcher.stats.errors += 1
            logger.exception("reward %s failed", self.config.reward)
            return _error(500, f"reward failed: {type(error).__name__}: {error}")
        return web.json_response(encode_output(output, request_id))

    async def start(self) -> int:
        """Start serving; returns the bound port."""
        self.batcher = Batcher(self.reward, self.config.max_batch_size, self.config.max_wait_ms / 1000)
        self.batcher.start()
        self.runner = web.AppRunner(self.make_app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        logger.info("serving reward %r on http://%s:%d", self.config.reward, self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.batcher is not None:
            await self.batcher.stop()


class ServerThread:
    """A reward server on its own event loop in a background thread of this process (tests, notebooks, a
    reward served beside a trainer)::

        with ServerThread(reward, ServerConfig(reward="jpeg_compressibility", port=0)) as server:
            remote = rewards.build("remote", url=server.url)
    """

    def __init__(self, reward: Reward, config: ServerConfig):
        self.server = RewardServer(reward, config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reward-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.server.port}"

    def start(self) -> ServerThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=60)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def serve(config: ServerConfig, reward: Reward | None = None) -> None:
    """Serve until SIGINT / SIGTERM."""
    server = RewardServer(reward or build(config.reward, **config.options), config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # machine-readable line for scripts that start the server and wait for it
    print(f"reward server ready on http://{config.host}:{server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m rewards.server --config FILE.yaml [--host H] [--port P]``."""
    parser = argparse.ArgumentParser(prog="python -m rewards.server", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="server YAML file (keys of rewards.server.ServerConfig)"
    )
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    try:
        config = load_config(args.config, **overrides)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
