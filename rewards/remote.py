"""Client of the reward server: a :class:`Reward` whose ``score`` is a ``POST /score`` call.

    reward = rewards.build("remote", url="http://gpu-box:8765", token=os.environ["MMRL_REWARD_TOKEN"])
    scores = reward(images=images, prompts=prompts)

Usable anywhere a local reward is (it is one). Not differentiable: images travel as PNG.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from rewards.base import Reward, RewardOutput
from rewards.images import concat_outputs
from rewards.registry import register
from rewards.wire import FIELDS, WireError, batch_length, decode_output, encode_batch

logger = logging.getLogger(__name__)

T = TypeVar("T")

# answers worth retrying: the server is overloaded, restarting, or timed out on this request
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})

#: what a broken connection raises: resets, refusals, timeouts (OSError); garbage or a cut answer
#: (http.client.HTTPException: BadStatusLine, IncompleteRead, RemoteDisconnected, LineTooLong)
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (OSError, http.client.HTTPException)


class RemoteRewardError(RuntimeError):
    """The reward server refused the request or could not be reached after every retry."""


@register("remote")
class RemoteReward(Reward):
    """A reward served by ``python -m rewards.server``.

    Each call sends the batch (in chunks of at most ``batch_size`` samples when set) and returns the
    server's :class:`RewardOutput`, in batch order. Before chunking, the client asks the server
    (``GET /health``) whether its reward is batch-dependent (``Reward.batch_dependent``: the pairwise judge's
    win rates within a group); if so, every chunk holds whole groups (:func:`linked_groups`: samples sharing a
    prompt or a ``metadata["group"]``), since a group split over two requests would be scored as two smaller
    groups.

    Every transport failure (refused or reset connections, timeouts, a
    non-HTTP or cut-off answer, a body that is not the wire format) and 408/429/5xx answers are retried
    ``retries`` times with exponential backoff and jitter,
    ``sleep = min(max_backoff_s, backoff_s * 2**attempt) * U(1, 1.25)``; scoring is a pure function of the
    batch, so a retried request cannot be counted twice. 400/401/413 are not retried (the same request would
    fail again). Redirects are refused, not followed: the bearer token must not reach another address.

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8765``.
        token: bearer token; when ``None``, read from the environment variable ``token_env``.
        token_env: environment variable holding the token.
        timeout: seconds one attempt may take in all (connect, send, scoring, the whole answer), not per read:
            a server that drips its answer is cut off at this deadline.
        retries: retries after the first attempt (0 = fail on the first error).
        backoff_s, max_backoff_s: base and cap of the exponential backoff.
        batch_size: most samples per request (``None`` = the whole batch in one request); lower it if the
            server answers 413, but not below the largest group for a batch-dependent server reward.
        deadline: seconds a whole ``score`` call may take, every chunk, attempt and backoff included
            (``None``: bounded only by ``timeout`` and ``retries``).

    Raises (from ``score``):
        ValueError: the server rejected the batch (400) or it is too large (413), or ``batch_size`` would
            split a group for a batch-dependent server reward.
        PermissionError: missing or wrong token (401).
        RemoteRewardError: no valid answer after every retry or within ``deadline``, or a redirect.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        token_env: str = "MMRL_REWARD_TOKEN",
        timeout: float = 120.0,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        batch_size: int | None = None,
        deadline: float | None = None,
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if retries < 0 or timeout <= 0 or backoff_s < 0:
            raise ValueError(
                f"need retries >= 0, timeout > 0, backoff_s >= 0; got {retries}, {timeout}, {backoff_s}"
            )
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if deadline is not None and deadline <= 0:
            raise ValueError(f"deadline must be > 0 seconds or None, got {deadline}")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get(token_env) or None
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.batch_size = batch_size
        self.deadline = deadline

    def score(self, **batch: Any) -> RewardOutput:
        """Score ``batch`` (the fields of :data:`rewards.wire.FIELDS`) on the server."""
        batch = {k: v for k, v in batch.items() if v is not None}
        unknown = sorted(set(batch) - set(FIELDS))
        if unknown:
            raise ValueError(f"remote rewards take the batch fields {list(FIELDS)}; got also {unknown}")
        size = batch_length(batch)
        end = None if self.deadline is None else time.monotonic() + self.deadline
        chunks = self.chunks(batch, size, end)
        outputs = [
            self.request({k: take(v, chunk) for k, v in batch.items()}, chunk, end) for chunk in chunks
        ]
        return in_batch_order(concat_outputs(outputs), [i for chunk in chunks for i in chunk])

    def chunks(self, batch: dict[str, Any], size: int, end: float | None = None) -> list[list[int]]:
        """The sample indices of each request: the whole batch without ``batch_size``; else runs of
        ``batch_size`` samples, or for a batch-dependent server reward whole groups (:func:`linked_groups`)
        packed in order of first appearance into requests of at most ``batch_size`` samples.

        Raises:
            ValueError: a group of a batch-dependent reward is larger than ``batch_size``.
        """
        step = self.batch_size
        if step is None or size <= step:
            return [list(range(size))] if size else []  # (an empty batch needs no request)
        if not self.server_batch_dependent(end):
            return [list(range(start, min(start + step, size))) for start in range(0, size, step)]
        chunks: list[list[int]] = [[]]
        for group in linked_groups(batch.get("prompts"), batch.get("metadata"), size):
            if len(group) > step:
                raise ValueError(
                    f"reward server {self.url}: batch_size={step} would split a group of {len(group)} "
                    f"samples ({group[:8]}{'...' if len(group) > 8 else ''}: samples sharing a prompt or a "
                    "metadata['group'], or a batch without either), and the server's reward is "
                    "batch-dependent (it scores each sample against its group): set batch_size >= "
                    f"{len(group)} or None"
                )
            if len(chunks[-1]) + len(group) > step:
                chunks.append([])
            chunks[-1].extend(group)
        return [sorted(chunk) for chunk in chunks]

    def server_batch_dependent(self, end: float | None = None) -> bool:
        """Whether the server's reward is batch-dependent, from its ``GET /health`` (a server that does not
        say is taken to be: keeping groups whole costs nothing where they fit in a request)."""

        def accept(data: bytes) -> bool | None:
            try:
                health = json.loads(data)
            except (ValueError, RecursionError):
                return None
            if not isinstance(health, dict) or not isinstance(health.get("batch_dependent", True), bool):
                return None
            return health.get("batch_dependent", True)

        return self._call("/health", None, accept, end)

    def _call(
        self, path: str, body: bytes | None, accept: Callable[[bytes], T | None], end: float | None
    ) -> T:
        """:func:`post_json` to ``path`` of this server with this client's token, timeouts and retries."""
        return post_json(
            f"{self.url}{path}",
            body,
            token=self.token,
            timeout=self.timeout,
            retries=self.retries,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
            end=end,
            deadline=self.deadline,
            accept=accept,
            label=f"reward server {self.url}",
        )

    def request(self, batch: dict[str, Any], indices: list[int], end: float | None = None) -> RewardOutput:
        """One ``POST /score`` of the samples ``indices`` of the caller's batch (named in errors) with retries
        until ``end`` (a ``time.monotonic()`` value, ``None``: no end); checks that the answer belongs to this
        request."""
        request_id = uuid.uuid4().hex
        body = json.dumps(encode_batch(batch, request_id)).encode()
        size = batch_length(batch)
        try:
            return self._call("/score", body, lambda data: self._check(data, request_id, size), end)
        except ValueError as error:
            # (a chunk is never empty; one of whole groups may skip samples)
            contiguous = indices == list(range(indices[0], indices[-1] + 1))
            where = f"{indices[0]}..{indices[-1]}" if contiguous else str(indices)
            raise ValueError(f"{error} (samples {where})") from error

    @staticmethod
    def _check(data: bytes, request_id: str, size: int) -> RewardOutput | None:
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError):  # not JSON (or not UTF-8)
            return None
        if not isinstance(parsed, dict) or parsed.get("id") != request_id:
            return None
        try:
            output = decode_output(parsed)
        except WireError:
            return None
        return output if len(output.scores) == size else None


def linked_groups(
    prompts: Sequence[str] | None, metadata: Sequence[dict[str, Any] | None] | None, size: int
) -> list[list[int]]:
    """The samples a batch-dependent reward may compare, as lists of indices in order of first appearance:
    samples sharing a prompt or a ``metadata["group"]``, transitively (the pairwise judge groups by
    ``metadata["group"]``, else by prompt; its ``video_frames`` form by prompt only, so both links count).
    Without prompts, samples without a group are all one group: nothing tells their groups apart."""
    parent = list(range(size))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]  # path halving
            i = parent[i]
        return i

    first: dict[tuple[str, Any], int] = {}
    for i in range(size):
        meta = metadata[i] if metadata is not None else None
        keys = [("prompt", prompts[i])] if prompts is not None else []
        if isinstance(meta, dict) and meta.get("group") is not None:
            keys.append(("group", meta["group"]))
        for key in keys or [("unknown", None)]:
            parent[root(i)] = root(first.setdefault(key, i))
    groups: dict[int, list[int]] = {}
    for i in range(size):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def take(values: Any, indices: list[int]) -> Any:
    """The entries ``indices`` of one batch field (a list, or a tensor along its first dimension)."""
    if isinstance(values, torch.Tensor):
        return values[indices]
    return [values[i] for i in indices]


def in_batch_order(output: RewardOutput, order: list[int]) -> RewardOutput:
    """``output`` of the samples ``order`` (a permutation of the batch indices), put back in batch order."""
    if order == sorted(order):
        return output
    position = [0] * len(order)  # position[i]: where sample i is in output
    for k, i in enumerate(order):
        position[i] = k
    return RewardOutput(
        scores=output.scores[position],
        components={name: value[position] for name, value in output.components.items()},
        reasons=None if output.reasons is None else [output.reasons[k] for k in position],
    )


def post_json(
    url: str,
    body: bytes | None,
    *,
    accept: Callable[[bytes], T | None],
    token: str | None = None,
    timeout: float = 120.0,
    retries: int = 5,
    backoff_s: float = 0.5,
    max_backoff_s: float = 10.0,
    end: float | None = None,
    deadline: float | None = None,
    label: str = "server",
) -> T:
    """POST the JSON ``body`` to ``url`` (GET when ``body`` is ``None``) with retries; return ``accept(answer
    body)`` of the first 200 answer it accepts (``accept`` returns ``None`` for an answer that is not a valid
    one: retried like a transport error).

    Retried: every transport failure and 408/429/5xx answers, ``retries`` times after the first attempt, with
    ``sleep = min(max_backoff_s, backoff_s * 2**attempt) * U(1, 1.25)``, until ``end`` (a ``time.monotonic()``
    value; ``None``: no end; ``deadline``, the seconds that ``end`` allowed in all, is named in the error). Each
    attempt takes at most ``timeout`` seconds in all. Redirects are refused: the
    bearer ``token`` must not reach another address.

    Raises:
        ValueError: a 4xx answer other than 401 and 408/429 (413 says to lower the batch size).
        PermissionError: missing or wrong token (401).
        RemoteRewardError: no accepted answer after every retry or before ``end``, or a redirect.
    """
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last_error: Exception | None = None
    attempts = 0
    for attempt in range(retries + 1):
        if attempt:
            delay = min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) * random.uniform(1.0, 1.25)
            if end is not None and time.monotonic() + delay >= end:
                break  # no time left for another attempt
            logger.warning("%s: %s; retry %d in %.2fs", label, last_error, attempt, delay)
            time.sleep(delay)
        attempt_timeout = timeout if end is None else min(timeout, end - time.monotonic())
        if attempt_timeout <= 0:
            break
        attempts += 1
        try:
            status, data, location = post_once(url, body, headers, attempt_timeout)
        except TRANSPORT_ERRORS as error:
            last_error = error
            continue
        if 300 <= status < 400:
            raise RemoteRewardError(
                f"{label} answered {status} redirecting to {location!r}; redirects are not followed (the "
                "bearer token would be sent to another address): set the url to the server's own address"
            )
        if status != 200:
            message = _error_message(data, status)
            if status in RETRY_STATUS:
                last_error = RemoteRewardError(f"HTTP {status}: {message}")
                continue
            if status == 401:
                raise PermissionError(f"{label}: {message}")
            if status == 413:
                raise ValueError(f"{label}: {message}; lower batch_size")
            if 400 <= status < 500:
                raise ValueError(f"{label} rejected the request: {message}")
            last_error = RemoteRewardError(f"unexpected HTTP {status}: {message}")
            continue
        output = accept(data)
        if output is not None:
            return output
        last_error = WireError(f"answer is not a valid one: {data[:200]!r}")
    within = "" if end is None else f" within deadline={deadline}s"
    raise RemoteRewardError(
        f"{label}: no valid answer after {attempts} attempts{within}: {type(last_error).__name__}: {last_error}"
    )


def post_once(
    url: str, body: bytes | None, headers: dict[str, str], timeout: float
) -> tuple[int, bytes, str | None]:
    """``(status, body, Location header)`` of one POST of ``body`` to ``url`` (a GET when ``body`` is
    ``None``), all of it within ``timeout`` seconds.

    A socket timeout bounds each read only, so a watchdog shuts the socket down at the deadline; the
    blocked read then fails and the attempt ends with :class:`TimeoutError`.

    Raises:
        OSError, http.client.HTTPException: see :data:`TRANSPORT_ERRORS`.
    """
    parts = urllib.parse.urlsplit(url)
    factory = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = factory(parts.hostname or "", parts.port, timeout=timeout)
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET" if body is None else "POST", path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        if expired.is_set():  # the watchdog cut the answer short
            raise TimeoutError(f"no complete answer within timeout={timeout:.3g}s")
        return response.status, data, response.getheader("Location")
    except TRANSPORT_ERRORS:
        if expired.is_set():
            raise TimeoutError(f"no complete answer within timeout={timeout:.3g}s") from None
        raise
    finally:
        watchdog.cancel()
        connection.close()


def _error_message(data: bytes, status: int) -> str:
    """The server's one-line ``error`` field (or its ``message``), else the start of the body."""
    try:
        error = json.loads(data).get("error", status)
        if isinstance(error, dict) and "message" in error:  # the OpenAI form {"error": {"message": ...}}
            error = error["message"]
        return str(error)
    except (ValueError, AttributeError, RecursionError):
        return " ".join(data[:200].decode("utf-8", "replace").split()) or f"HTTP {status}"
