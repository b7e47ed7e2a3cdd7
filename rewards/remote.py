"""Client of the reward server: a :class:`Reward` whose ``score`` is a ``POST /score`` call.

    reward = rewards.build("remote", url="http://gpu-box:8765", token=os.environ["MMRL_REWARD_TOKEN"])
    scores = reward(images=images, prompts=prompts)

Usable anywhere a local reward is (it is one). Not differentiable: images travel as PNG.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

from rewards.base import Reward, RewardOutput
from rewards.images import concat_outputs
from rewards.registry import register
from rewards.wire import FIELDS, WireError, batch_length, decode_output, encode_batch

logger = logging.getLogger(__name__)

# answers worth retrying: the server is overloaded, restarting, or timed out on this request
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward server refused the request or could not be reached after every retry."""


@register("remote")
class RemoteReward(Reward):
    """A reward served by ``python -m rewards.server``.

    Each call sends the batch (in chunks of ``batch_size`` samples when set) and returns the server's
    :class:`RewardOutput`, in order. Connection errors, timeouts and 429/5xx answers are retried ``retries``
    times with exponential backoff and jitter, ``sleep = min(max_backoff_s, backoff_s * 2**attempt) * U(1, 1.25)``;
    scoring is a pure function of the batch, so a retried request cannot be counted twice. 400/401/413 are not
    retried (the same request would fail again).

    Args:
        url: server base URL, e.g. ``http://127.0.0.1:8765``.
        token: bearer token; when ``None``, read from the environment variable ``token_env``.
        token_env: environment variable holding the token.
        timeout: seconds to wait for one HTTP answer (connect + scoring).
        retries: retries after the first attempt (0 = fail on the first error).
        backoff_s, max_backoff_s: base and cap of the exponential backoff.
        batch_size: most samples per request (``None`` = the whole batch in one request); lower it if the
            server answers 413.

    Raises (from ``score``):
        ValueError: the server rejected the batch (400) or it is too large (413).
        PermissionError: missing or wrong token (401).
        RemoteRewardError: no valid answer after every retry.
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
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if retries < 0 or timeout <= 0 or backoff_s < 0:
            raise ValueError(
                f"need retries >= 0, timeout > 0, backoff_s >= 0; got {retries}, {timeout}, {backoff_s}"
            )
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get(token_env) or None
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.batch_size = batch_size

    def score(self, **batch: Any) -> RewardOutput:
        """Score ``batch`` (the fields of :data:`rewards.wire.FIELDS`) on the server."""
        batch = {k: v for k, v in batch.items() if v is not None}
        unknown = sorted(set(batch) - set(FIELDS))
        if unknown:
            raise ValueError(f"remote rewards take the batch fields {list(FIELDS)}; got also {unknown}")
        size = batch_length(batch)
        step = self.batch_size or max(size, 1)
        outputs = []
        for start in range(0, size, step):
            chunk = {k: v[start : start + step] for k, v in batch.items()}
            outputs.append(self.request(chunk, start))
        return concat_outputs(outputs)

    def request(self, batch: dict[str, Any], offset: int = 0) -> RewardOutput:
        """One ``POST /score`` with retries; checks that the answer belongs to this request."""
        request_id = uuid.uuid4().hex
        body = json.dumps(encode_batch(batch, request_id)).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        size = batch_length(batch)
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(
                    1.0, 1.25
                )
                logger.warning(
                    "reward server %s: %s; retry %d in %.2fs", self.url, last_error, attempt, delay
                )
                time.sleep(delay)
            http = urllib.request.Request(f"{self.url}/score", data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(http, timeout=self.timeout) as response:
                    data = json.loads(response.read())
            except urllib.error.HTTPError as error:
                message = _error_message(error)
                if error.code in RETRY_STATUS:
                    last_error = RemoteRewardError(f"HTTP {error.code}: {message}")
                    continue
                if error.code == 401:
                    raise PermissionError(f"reward server {self.url}: {message}") from None
                if error.code == 413:
                    raise ValueError(f"reward server {self.url}: {message}; lower batch_size") from None
                raise ValueError(f"reward server {self.url} rejected samples {offset}..: {message}") from None
            except (OSError, json.JSONDecodeError) as error:  # URLError, refused, reset, timeout
                last_error = error
                continue
            output = self._check(data, request_id, size)
            if output is not None:
                return output
            last_error = WireError(f"answer does not match request {request_id}")
        raise RemoteRewardError(
            f"reward server {self.url}: no valid answer after {self.retries + 1} attempts: {last_error}"
        )

    @staticmethod
    def _check(data: Any, request_id: str, size: int) -> RewardOutput | None:
        if not isinstance(data, dict) or data.get("id") != request_id:
            return None
        try:
            output = decode_output(data)
        except WireError:
            return None
        return output if len(output.scores) == size else None


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(error.read()).get("error", error.reason))
    except (ValueError, AttributeError, OSError):
        return str(error.reason)
