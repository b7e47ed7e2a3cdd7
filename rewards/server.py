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
is set) and ``GET /health`` (no auth; status, reward name, whether it is ``batch_dependent``, request/batch/
rejection counters).

Dynamic batching: requests are queued; one batcher task takes the oldest, then keeps taking requests until
``max_batch_size`` samples are gathered or ``max_wait_ms`` has passed, calls the reward once on the
concatenated batch in a worker thread (the event loop keeps accepting requests meanwhile, so the queue fills
while the model runs) and splits the result back. Requests are merged only when they carry the same fields, and
never for a reward whose scores depend on the other samples of its batch (``Reward.batch_dependent``, e.g. the
pairwise judge's win rates): each request is then scored alone. If a merged call fails, each request is retried
alone, so one bad request cannot fail its neighbours. A reward that returns other than one score (component,
reason) per sample fails the request (500), as it could not be split back.

Limits against hostile or broken clients, each answered without a traceback:

* memory: a request's body is at most ``max_request_mb`` and its images at most ``max_request_pixels`` decoded
  pixels, read from the PNG headers before anything is decoded (413); all requests together hold at most
  ``max_mb_in_flight`` of bodies (counted as they arrive) and ``max_pixels_in_flight`` decoded pixels (503,
  retry later; a request's pixels count until the batcher has scored or dropped its images, also after the
  request timed out); besides these, aiohttp buffers at most 128 KiB of unread input per connection;
* slow clients: a connection must deliver a request's headers and body within ``read_timeout_s`` of its first
  byte (else 408 and the connection is closed); at most ``max_connections`` connections are open (beyond: 503
  and closed); idle keep-alive connections close after ``keepalive_timeout_s``;
* malformed requests: 4xx with a one-line reason (bad JSON or JSON nested too deep, a non-ASCII
  ``Authorization`` header, a non-PNG image, ...); a client that disconnects mid-request is counted, not
  logged as an error.

Every request gets one access-log line on the ``rewards.server.access`` logger (client, method, path, status,
request and response bytes, latency); the token is never logged. ``/health`` counts failed authentications,
rejections and closed connections.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rewards.base import Reward, RewardOutput
from rewards.registry import build
from rewards.wire import WireError, batch_length, decode_batch, decoded_pixels, encode_output

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
    max_request_pixels: int = Field(
        2**24,
        ge=1,
        description="most decoded pixels (width x height summed over a request's images and video frames); "
        "more: 413, read from the PNG headers before decoding. 2**24 is sixteen 1024x1024 images",
    )
    max_pixels_in_flight: int = Field(
        2**25,
        ge=1,
        description="most decoded pixels held at once by every request being decoded, queued or scored; a "
        "request that does not fit gets 503 (the client retries). Peak memory per pixel depends on the reward "
        "(measured: 10 bytes for jpeg_incompressibility, 37 for the shapes verifier), so the default bounds "
        "decoded images to 0.3-1.2 GB",
    )
    max_mb_in_flight: float = Field(
        256.0,
        gt=0,
        description="most request-body MiB held at once by every request being read, parsed, decoded or "
        "scored, counted as the bytes arrive (a slow body holds only what it has sent); beyond: 503",
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="most open connections; more are answered 503 and closed. Needs this many file "
        "descriptors (plus 128): the server raises its soft limit up to the hard one and refuses to start "
        "if that is not enough",
    )
    read_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a request's headers and body must arrive within this many seconds of its first byte "
        "(or of connecting); slower connections get 408 and are closed (slow-client protection)",
    )
    keepalive_timeout_s: float = Field(
        15.0, gt=0, description="an idle keep-alive connection is closed after this many seconds"
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="logging level of the server process; INFO shows one access-log line per request"
    )

    @model_validator(mode="after")
    def _check_limits(self) -> ServerConfig:
        if self.max_request_pixels > self.max_pixels_in_flight:
            raise ValueError(
                f"max_request_pixels ({self.max_request_pixels}) exceeds max_pixels_in_flight "
                f"({self.max_pixels_in_flight}): such a request could never be served"
            )
        if self.max_request_mb > self.max_mb_in_flight:
            raise ValueError(
                f"max_request_mb ({self.max_request_mb}) exceeds max_mb_in_flight ({self.max_mb_in_flight})"
            )
        return self

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


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8765``): unbracketed, its colons
    would read as the port's."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def load_config(path: str | Path, **overrides: Any) -> ServerConfig:
    """Read and validate a server YAML file; ``overrides`` replace its keys.

    Raises:
        ValueError: an unreadable file, not UTF-8 or not YAML, not a mapping, an unknown or ill-typed key or an
            unknown reward name (each named with the file), no token off loopback.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise ValueError(f"{path}: cannot read the server config: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}: {error.reason})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: invalid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of ServerConfig keys, got {type(data).__name__}")
    try:
        return ServerConfig(**{**data, **overrides})
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg'].removeprefix('Value error, ')}"
            for e in error.errors()
        )
        raise ValueError(f"{path}: {problems}") from None


@dataclass
class _Job:
    batch: dict[str, Any]
    size: int
    future: asyncio.Future[RewardOutput]
    #: called once the batcher is through with the batch (see :meth:`Batcher.enqueue`)
    on_done: Callable[[], None] | None = None
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.keys = tuple(sorted(self.batch))

    def finish(self) -> None:
        """The batcher holds the batch no longer: call ``on_done``, once."""
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done()


def merge_batches(batches: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate batches with the same fields, field by field."""
    return {key: [item for b in batches for item in b[key]] for key in batches[0]}


def check_output_length(output: RewardOutput, size: int, reward: str) -> None:
    """Refuse an output that is not one score (component, reason) per sample of the batch it scored: split back
    over the merged requests, it would shift or cut every later request's scores.

    Raises:
        RuntimeError: a length other than ``size``, named with the reward and the field (the server answers 500).
    """
    lengths = {"scores": len(output.scores)}
    lengths.update({f"values of component {name!r}": len(v) for name, v in output.components.items()})
    if output.reasons is not None:
        lengths["reasons"] = len(output.reasons)
    for what, length in lengths.items():
        if length != size:
            raise RuntimeError(
                f"reward {reward!r} returned {length} {what} for a batch of {size} samples; a reward must "
                "return one per sample, in order"
            )


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
    """Counters served by ``/health``."""

    requests: int = 0
    samples: int = 0
    batches: int = 0
    errors: int = 0
    auth_failures: int = 0
    too_large: int = 0  # 413: body or decoded pixels over the per-request limit
    busy: int = 0  # 503: the in-flight budget was full
    client_disconnects: int = 0
    read_timeouts: int = 0  # connections closed with 408
    refused_connections: int = 0  # connections over max_connections
    open_connections: int = 0

    def as_dict(self) -> dict[str, float]:
        mean = self.samples / self.batches if self.batches else 0.0
        return {**self.__dict__, "mean_batch_size": mean}


class Batcher:
    """Queue of scoring jobs and the task that batches them (see the module docstring)."""

    def __init__(self, reward: Reward, max_batch_size: int, max_wait_s: float, stats: Stats | None = None):
        self.reward = reward
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.stats = stats if stats is not None else Stats()
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

    def enqueue(
        self, batch: dict[str, Any], on_done: Callable[[], None] | None = None
    ) -> asyncio.Future[RewardOutput]:
        """Queue ``batch``; its output (or the reward's error) arrives in the returned future. Cancel the future
        to withdraw the request. ``on_done`` is called once the batcher is through with the batch: scored (or
        failed), or dropped because the future was cancelled before its turn."""
        job = _Job(batch, batch_length(batch), asyncio.get_running_loop().create_future(), on_done)
        self.queue.put_nowait(job)  # (the queue is unbounded: the server's in-flight budgets bound it)
        return job.future

    async def _collect(self) -> list[_Job]:
        loop = asyncio.get_running_loop()
        first = self._carry or await self.queue.get()
        self._carry = None
        if self.reward.batch_dependent:  # merged, one client's samples would be scored against another's
            return [first]
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
        merged = merge_batches(batches)
        output = self.reward.score(**merged)
        check_output_length(output, batch_length(merged), self.reward.name or type(self.reward).__name__)
        return output

    async def _run(self) -> None:
        while True:
            jobs = []
            for job in await self._collect():
                if job.future.done():  # the request timed out or its client left while queued: dropped
                    job.finish()
                else:
                    jobs.append(job)
            if not jobs:
                continue
            self.stats.batches += 1
            self.stats.samples += sum(job.size for job in jobs)
            try:
                await self._score_jobs(jobs)
            finally:  # (also when the batcher is cancelled at shutdown)
                for job in jobs:
                    job.finish()

    async def _score_jobs(self, jobs: list[_Job]) -> None:
        """Score ``jobs`` in one reward call and set each one's future (if still wanted)."""
        loop = asyncio.get_running_loop()
        try:
            output = await loop.run_in_executor(self._executor, self._score, [j.batch for j in jobs])
            for job, part in zip(jobs, split_output(output, [j.size for j in jobs]), strict=True):
                if not job.future.done():
                    job.future.set_result(part)
        except Exception as error:
            if len(jobs) == 1:
                if not jobs[0].future.done():
                    jobs[0].future.set_exception(error)
                return
            # isolate the failing request: score each alone
            for job in jobs:
                try:
                    part = await loop.run_in_executor(self._executor, self._score, [job.batch])
                    if not job.future.done():
                        job.future.set_result(part)
                except Exception as single_error:
                    if not job.future.done():
                        job.future.set_exception(single_error)


def _one_line(message: str, limit: int = 500) -> str:
    """A client-facing message on one line, at most ``limit`` characters (it may quote client input)."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": _one_line(message)}, status=status, headers=headers or None)


def _busy(what: str) -> web.Response:
    return _error(503, f"server busy: too many {what} in flight; retry later", **{"Retry-After": "1"})


@dataclass
class _Held:
    """What one request holds of the in-flight budgets."""

    bytes: int = 0
    pixels: int = 0


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers given outside a request handler."""
    body = json.dumps({"error": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Connection(asyncio.Protocol):
    """One accepted connection: the cap on open connections and the read deadline around aiohttp's handler.

    The deadline is armed when the connection opens and when the first byte of a new request arrives; it is
    disarmed once the request's body has been read (:meth:`RewardServer.request_read`). A connection still
    armed after ``read_timeout_s`` is closed, with 408 if nothing was answered to its request yet: this is what
    ends slow-header and slow-body clients.
    """

    def __init__(self, server: RewardServer) -> None:
        self.server = server
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.reading = True  # a request has begun and nothing has been answered to it
        self.busy = False  # a request handler runs
        self.timed_out = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        stats = self.server.stats
        if stats.open_connections >= self.server.config.max_connections:
            stats.refused_connections += 1
            self.server.warn_rate_limited("refused", "connections refused: max_connections reached")
            transport.write(_raw_response(503, "Service Unavailable", "too many open connections"))  # type: ignore[attr-defined]
            transport.close()
            return
        stats.open_connections += 1
        assert self.server.runner is not None
        self.inner = self.server.runner.server()  # aiohttp's protocol for this connection
        self.server.connections[self.inner] = self
        self.arm()
        self.inner.connection_made(transport)

    def arm(self) -> None:
        if self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.server.config.read_timeout_s, self.expire)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def expire(self) -> None:
        self.timer = None
        if self.transport is None or self.transport.is_closing():
            return
        self.timed_out = True
        self.server.stats.read_timeouts += 1
        self.server.warn_rate_limited(
            "timeout",
            f"connections closed: no complete request within read_timeout_s={self.server.config.read_timeout_s}",
        )
        if self.reading:  # nothing has been answered to this request yet
            message = f"request not received within read_timeout_s={self.server.config.read_timeout_s}"
            self.transport.write(_raw_response(408, "Request Timeout", message))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:  # refused: closing
            return
        if self.timer is None and not self.busy:  # the first byte of a new request starts its deadline
            self.reading = True
            self.arm()
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.inner is None:
            return
        self.server.stats.open_connections -= 1
        self.server.connections.pop(self.inner, None)
        self.inner.connection_lost(exc)


class _AccessLogger(web.AbstractAccessLogger):
    """``client method path status request-bytes response-bytes latency-ms`` (never the headers)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "%s %s %s %d %d %d %.1fms",
            request.remote,
            request.method,
            request.path,
            response.status,
            request.content_length or 0,
            response.body_length,
            time * 1000,
        )


#: the disconnects of a client that goes away mid-request (aiohttp surfaces them in these types)
_DISCONNECTS: tuple[type[BaseException], ...] = (ConnectionError, asyncio.IncompleteReadError)


class RewardServer:
    """The aiohttp application around one reward and its :class:`Batcher`."""

    def __init__(self, reward: Reward, config: ServerConfig):
        self.reward = reward
        self.config = config
        self.max_bytes = int(config.max_request_mb * 2**20)
        self.max_bytes_in_flight = int(config.max_mb_in_flight * 2**20)
        self.stats = Stats()
        self.bytes_in_flight = 0
        self.pixels_in_flight = 0
        self.connections: dict[asyncio.Protocol, _Connection] = {}
        self.batcher: Batcher | None = None
        self.runner: web.AppRunner | None = None
        self.site: asyncio.Server | None = None
        self.port: int | None = None
        self._warned: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn_rate_limited(self, key: str, message: str, every_s: float = 10.0) -> None:
        """Log ``message`` at most once per ``every_s`` per ``key``, with how many events it stands for."""
        now = time.monotonic()
        self._suppressed[key] = self._suppressed.get(key, 0) + 1
        if now - self._warned.get(key, -math.inf) >= every_s:
            logger.warning("%s: %d since the last such line", message, self._suppressed[key])
            self._warned[key] = now
            self._suppressed[key] = 0

    def make_app(self) -> web.Application:
        # client_max_size makes aiohttp answer 413 itself when a body without Content-Length grows too big
        app = web.Application(client_max_size=self.max_bytes, middlewares=[self._middleware])
        app.router.add_post("/score", self.handle_score)
        app.router.add_get("/health", self.handle_health)
        return app

    def request_read(self, request: web.BaseRequest) -> None:
        """The request's headers and body are in: stop its connection's read deadline."""
        connection = self.connections.get(request.protocol)
        if connection is not None:
            connection.disarm()
            connection.reading = False

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        connection = self.connections.get(request.protocol)
        if connection is not None:
            connection.busy = True
            if not request.body_exists:
                self.request_read(request)
        try:
            return await handler(request)
        except _DISCONNECTS:
            # Nothing can be sent back; the status only marks the access-log line: 408 when the read deadline
            # closed the connection (already counted), else 499, "client closed request", as nginx logs it.
            if connection is not None and connection.timed_out:
                return web.Response(status=408)
            self.stats.client_disconnects += 1
            return web.Response(status=499)
        finally:
            if connection is not None:
                connection.busy = False
                connection.reading = False  # answered; a body still arriving is not a new request

    def authorized(self, request: web.Request) -> bool:
        """Whether the request carries the bearer token (constant-time compare; a non-ASCII header is wrong)."""
        if self.config.token is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        try:
            given = token.encode("ascii")
        except UnicodeEncodeError:  # aiohttp decodes header bytes leniently; a token is ASCII
            return False
        # constant-time comparison: the token must not leak through response timing
        return scheme.lower() == "bearer" and hmac.compare_digest(given, self.config.token.encode())

    async def handle_health(self, request: web.Request) -> web.Response:
        stats = self.stats.as_dict()
        # batch_dependent: the client then keeps a batch's groups whole (rewards.remote.RemoteReward.chunks)
        return web.json_response(
            {
                "status": "ok",
                "reward": self.config.reward,
                "batch_dependent": self.reward.batch_dependent,
                **stats,
            }
        )

    def _reserve(self, nbytes: int, pixels: int) -> bool:
        """Take ``nbytes`` of body and ``pixels`` of decoded images from the in-flight budgets, if they fit
        (a lone request always fits: the per-request limits are not above the budgets)."""
        over_bytes = self.bytes_in_flight and self.bytes_in_flight + nbytes > self.max_bytes_in_flight
        over_pixels = (
            self.pixels_in_flight and self.pixels_in_flight + pixels > self.config.max_pixels_in_flight
        )
        if over_bytes or over_pixels:
            self.stats.busy += 1
            return False
        self.bytes_in_flight += nbytes
        self.pixels_in_flight += pixels
        return True

    def _release(self, nbytes: int, pixels: int) -> None:
        self.bytes_in_flight -= nbytes
        self.pixels_in_flight -= pixels

    async def handle_score(self, request: web.Request) -> web.Response:
        assert self.batcher is not None  # set by start(), before the site accepts connections
        if not self.authorized(request):
            self.stats.auth_failures += 1
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        if request.content_length is not None and request.content_length > self.max_bytes:
            self.stats.too_large += 1
            return _error(
                413, f"request body {request.content_length} bytes exceeds the limit of {self.max_bytes}"
            )
        held = _Held()
        try:
            return await self._score(request, held)
        finally:
            self._release(held.bytes, held.pixels)

    async def _read_body(self, request: web.Request, held: _Held) -> bytes | web.Response:
        """The body, taken from the in-flight byte budget as it arrives (a slow body holds only what it has
        sent), or the 413 / 503 answer that stops reading it."""
        chunks = []
        async for chunk in request.content.iter_any():
            if held.bytes + len(chunk) > self.max_bytes:  # a body without Content-Length grew too big
                self.stats.too_large += 1
                return _error(413, f"request body exceeds the limit of {self.max_bytes} bytes")
            if not self._reserve(len(chunk), 0):
                return _busy("request bytes")
            held.bytes += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _score(self, request: web.Request, held: _Held) -> web.Response:
        body = await self._read_body(request, held)
        if isinstance(body, web.Response):
            return body
        self.request_read(request)
        self.stats.requests += 1
        loop = asyncio.get_running_loop()
        try:
            # parsing and header reading are CPU work: keep them off the event loop
            payload, pixels = await loop.run_in_executor(None, _parse, body)
        except WireError as error:
            self.stats.errors += 1
            return _error(400, f"malformed request: {error}")
        del body  # the parsed payload holds its own copy of the images
        if pixels > self.config.max_request_pixels:
            self.stats.too_large += 1
            return _error(
                413,
                f"the request's images decode to {pixels} pixels, over the limit of "
                f"{self.config.max_request_pixels} (max_request_pixels); send fewer or smaller images",
            )
        if not self._reserve(0, pixels):
            return _busy("decoded pixels")
        held.pixels = pixels
        return await self._decode_and_submit(payload, held)

    async def _decode_and_submit(self, payload: dict[str, Any], held: _Held) -> web.Response:
        assert self.batcher is not None
        loop = asyncio.get_running_loop()
        try:
            request_id, batch = await loop.run_in_executor(None, decode_batch, payload)
        except WireError as error:
            self.stats.errors += 1
            return _error(400, f"malformed request: {error}")
        # The decoded images now live as long as the batcher holds them, which a timed-out request (504) does
        # not end: a queued job is dropped at its turn, a running model call runs on. So the batcher gives their
        # pixels back, when it is through with them; this handler no longer does.
        pixels, held.pixels = held.pixels, 0
        future = self.batcher.enqueue(batch, functools.partial(self._release, 0, pixels))
        try:
            # on timeout (or the client leaving) wait_for cancels the future: the batcher drops the job
            output = await asyncio.wait_for(future, self.config.request_timeout_s)
        except asyncio.TimeoutError:
            self.stats.errors += 1
            return _error(504, f"not scored within request_timeout_s={self.config.request_timeout_s}")
        except (ValueError, TypeError, KeyError) as error:  # the reward rejected the input
            self.stats.errors += 1
            return _error(400, f"{type(error).__name__}: {error}")
        except Exception as error:
            self.stats.errors += 1
            logger.exception("reward %s failed", self.config.reward)
            return _error(500, f"reward failed: {type(error).__name__}: {error}")
        return web.json_response(encode_output(output, request_id))

    async def start(self) -> int:
        """Start serving; returns the bound port.

        Raises:
            ValueError: the file-descriptor limit cannot hold ``max_connections``.
        """
        _raise_fd_limit(self.config.max_connections + 128)
        self.batcher = Batcher(
            self.reward, self.config.max_batch_size, self.config.max_wait_ms / 1000, self.stats
        )
        self.batcher.start()
        self.runner = web.AppRunner(
            self.make_app(),
            access_log_class=_AccessLogger,
            access_log=logging.getLogger("rewards.server.access"),  # (not __name__: __main__ under -m)
            keepalive_timeout=self.config.keepalive_timeout_s,
        )
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        self.site = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.port, reuse_address=True, backlog=1024
        )
        self.port = self.site.sockets[0].getsockname()[1]
        logger.info("serving reward %r on %s", self.config.reward, http_url(self.config.host, self.port))
        return self.port

    async def stop(self) -> None:
        if self.site is not None:
            self.site.close()
            for connection in list(self.connections.values()):
                if connection.transport is not None:
                    connection.transport.close()
            await self.site.wait_closed()
        if self.runner is not None:
            await self.runner.cleanup()
        if self.batcher is not None:
            await self.batcher.stop()


def _parse(body: bytes) -> tuple[Any, int]:
    """``(parsed JSON, decoded pixels of its images)``, with every parse failure a :class:`WireError`."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise WireError("JSON nested too deeply") from None
    except UnicodeDecodeError as error:
        raise WireError(f"body is not UTF-8 JSON (byte {error.start})") from None
    except ValueError as error:  # JSONDecodeError
        raise WireError(f"invalid JSON: {error}") from None
    return payload, decoded_pixels(payload)


def _raise_fd_limit(needed: int) -> None:
    """Raise the soft limit on open files to ``needed`` (up to the hard limit), or say why it cannot be."""
    try:
        import resource
    except ImportError:  # not POSIX: nothing to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise ValueError(
            f"max_connections needs {needed} file descriptors but this process may open only {soft} "
            f"(hard limit {hard}); lower max_connections or raise the limit (ulimit -n)"
        )


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
        assert self.server.port is not None, "the server is not started"
        return http_url(self.server.config.host, self.server.port)

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


def build_reward(config: ServerConfig) -> Reward:
    """The reward a config names, built with its options.

    Raises:
        ValueError: the reward cannot be built with these options (names the reward and the cause).
    """
    try:
        return build(config.reward, **config.options)
    except (TypeError, ValueError, KeyError, ImportError, OSError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ValueError(
            f"cannot build reward {config.reward!r} with options {config.options}: {type(error).__name__}: {message}"
        ) from error


async def serve(config: ServerConfig, reward: Reward | None = None) -> None:
    """Serve until SIGINT / SIGTERM."""
    server = RewardServer(reward or build_reward(config), config)
    port = await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # machine-readable line for scripts that start the server and wait for it
    print(f"reward server ready on {http_url(config.host, port)}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def main(
    argv: list[str] | None = None, prog: str = "python -m rewards.server", usage: str | None = None
) -> int:
    """``python -m rewards.server --config FILE.yaml [--host H] [--port P]``; a config or start-up error is one
    line on stderr naming the file or key (exit status 2); ``prog`` names the command in it, ``usage`` replaces
    the usage line (``mmrl serve-reward`` takes the file positionally)."""
    parser = argparse.ArgumentParser(prog=prog, usage=usage, description=__doc__.split("\n")[0])
    parser.add_argument(
        "--config", required=True, help="server YAML file (keys of rewards.server.ServerConfig)"
    )
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    try:
        config = load_config(args.config, **overrides)
        logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            reward = build_reward(config)
        except ValueError as error:
            raise ValueError(f"{args.config}: reward: {error}") from error
        asyncio.run(serve(config, reward))
    except (OSError, ValueError) as error:
        parser.error(_one_line(str(error), 2000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
