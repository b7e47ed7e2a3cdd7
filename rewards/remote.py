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
from collections.abc import Callable
from typing import Any, TypeVar

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

    Each call sends the batch (in chunks of ``batch_size`` samples when set) and returns the server's
    :class:`RewardOutput`, in order. Every transport failure (refused or reset connections, timeouts, a
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
            server answers 413.
        deadline: seconds a whole ``score`` call may take, every chunk, attempt and backoff included
            (``None``: bounded only by ``timeout`` and ``retries``).

    Raises (from ``score``):
        ValueError: the server rejected the batch (400) or it is too large (413).
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
        step = self.batch_size or max(size, 1)
        end = None if self.deadline is None else time.monotonic() + self.deadline
        outputs = []
        for start in range(0, size, step):
            chunk = {k: v[start : start + step] for k, v in batch.items()}
            outputs.append(self.request(chunk, start, end))
        return concat_outputs(outputs)

    def request(self, batch: dict[str, Any], offset: int = 0, end: float | None = None) -> RewardOutput:
        """One ``POST /score`` with retries until ``end`` (a ``time.monotonic()`` value, ``None``: no end);
        checks that the answer belongs to this request."""
        request_id = uuid.uuid4().hex
        body = json.dumps(encode_batch(batch, request_id)).encode()
        size = batch_length(batch)
        try:
            return post_json(
                f"{self.url}/score",
                body,
                token=self.token,
                timeout=self.timeout,
                retries=self.retries,
                backoff_s=self.backoff_s,
                max_backoff_s=self.max_backoff_s,
                end=end,
                deadline=self.deadline,
                accept=lambda data: self._check(data, request_id, size),
                label=f"reward server {self.url}",
            )
        except ValueError as error:
            raise ValueError(f"{error} (samples {offset}..{offset + size - 1})") from error

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


def post_json(
    url: str,
    body: bytes,
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
    """POST the JSON ``body`` to ``url`` with retries; return ``accept(answer body)`` of the first 200 answer it
    accepts (``accept`` returns ``None`` for an answer that is not a valid one: retried like a transport error).

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
    url: str, body: bytes, headers: dict[str, str], timeout: float
) -> tuple[int, bytes, str | None]:
    """``(status, body, Location header)`` of one POST to ``url``, all of it within ``timeout`` seconds.

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
        connection.request("POST", path, body=body, headers=headers)
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
