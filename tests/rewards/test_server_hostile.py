"""The reward server and client against hostile or broken peers, over loopback with bounded loops.

Server: decompression bombs refused from their PNG headers (413), the in-flight pixel budget (503), slow
headers and slow bodies closed with 408, the connection cap, a non-ASCII ``Authorization`` header, a client
that disconnects mid-body (no error logged), one access-log line per request without the token, config errors
named at start-up. Client: redirects refused without forwarding the token, non-HTTP and cut-off answers
retried and then :class:`RemoteRewardError`, a dripping server cut off at the call's deadline.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from PIL import Image

import rewards
from mmrl.cli import main as cli_main
from rewards.base import Reward, RewardOutput
from rewards.remote import RemoteRewardError
from rewards.server import ServerConfig, ServerThread, main
from rewards.wire import decoded_pixels, encode_batch, png_size

TOKEN = "s3cret-token"
JPEG = rewards.build("jpeg_incompressibility")


def bomb_b64(side: int = 8192) -> str:
    buffer = io.BytesIO()
    Image.new("1", (side, side)).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode()


def config(**overrides: Any) -> ServerConfig:
    base = {"reward": "jpeg_incompressibility", "port": 0, "token": TOKEN, "max_wait_ms": 1.0}
    return ServerConfig(**{**base, **overrides})


def exchange(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send raw bytes, then read until the server closes the connection or ``wait_s`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def request_bytes(body: bytes, token: str | bytes = TOKEN, length: int | None = None) -> bytes:
    auth = token if isinstance(token, bytes) else token.encode()
    head = (
        b"POST /score HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Authorization: Bearer "
        + auth
        + b"\r\nContent-Length: "
        + str(length or len(body)).encode()
        + b"\r\n\r\n"
    )
    return head + body


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else -1


def json_of(answer: bytes) -> dict[str, Any]:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def health(server: ServerThread) -> dict[str, Any]:
    answer = exchange(server.server.port, b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    return json_of(answer)


def good_body(seed: int = 0) -> tuple[bytes, list[float]]:
    image = Image.new("RGB", (32, 32), (seed * 40 % 256, 90, 200))
    image.paste((255, 255, 255), (0, 0, 4 + seed, 4 + seed))
    return json.dumps(encode_batch({"images": [image]}, f"g{seed}")).encode(), JPEG(images=[image]).tolist()


def test_png_size_reads_the_header_only() -> None:
    bomb = bomb_b64()
    assert png_size(bomb, "x") == (8192, 8192)
    assert decoded_pixels({"images": [bomb, bomb], "videos": [[bomb]]}) == 3 * 8192**2
    with pytest.raises(ValueError, match="not a base64-encoded PNG"):
        png_size(base64.b64encode(b"GIF89a" + bytes(40)).decode(), "images[0]")


def test_a_png_with_a_broken_chunk_is_a_400_naming_the_image() -> None:
    """Pillow raises SyntaxError ("broken PNG file") for a PNG whose image-data chunk length is wrong: a 400
    naming the image, not a 500 the client would retry."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 200, 30)).save(buffer, format="PNG")
    good = buffer.getvalue()
    broken = bytearray(good)
    broken[36] = 0x13  # the IDAT chunk's length field: 19 bytes instead of 25
    body = json.dumps({"images": [base64.b64encode(png).decode() for png in (good, bytes(broken))]}).encode()
    with ServerThread(JPEG, config()) as server:
        answer = exchange(server.server.port, request_bytes(body))
        assert status_of(answer) == 400, answer
        assert json_of(answer)["error"].startswith("malformed request: images[1]: not a base64-encoded PNG")


def test_decompression_bombs_are_413_before_decoding() -> None:
    with ServerThread(
        JPEG, config(max_request_pixels=64 * 64 * 4, max_pixels_in_flight=64 * 64 * 8)
    ) as server:
        bomb = bomb_b64()
        body = json.dumps({"images": [bomb] * 4}).encode()
        assert len(body) < 60_000  # four 67-Mpixel images in a small request
        start = time.monotonic()
        answer = exchange(server.server.port, request_bytes(body))
        elapsed = time.monotonic() - start
        assert status_of(answer) == 413, answer
        assert (
            f"{4 * 8192**2} pixels" in json_of(answer)["error"]
            and "max_request_pixels" in json_of(answer)["error"]
        )
        assert elapsed < 2.0  # refused from the headers: decoding 268 M pixels takes tens of seconds
        # four 64x64 images are exactly at the limit: accepted
        small, _ = good_body()
        assert status_of(exchange(server.server.port, request_bytes(small))) == 200
        assert health(server)["too_large"] == 1


class SlowImageReward(Reward):
    """Holds a batch for ``hold_s`` seconds (a stand-in for a heavy model) and scores 1 per image."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s

    def score(self, *, images: list[Any], **_: Any) -> RewardOutput:
        time.sleep(self.hold_s)
        return RewardOutput(scores=torch.ones(len(images)))


def test_in_flight_pixel_budget_is_503_and_frees_after_scoring() -> None:
    # one 32x32 image per request; the budget holds exactly one request's pixels
    with ServerThread(
        SlowImageReward(1.0), config(max_request_pixels=1024, max_pixels_in_flight=1024)
    ) as server:
        body, _ = good_body()
        results: list[bytes] = []
        first = threading.Thread(
            target=lambda: results.append(exchange(server.server.port, request_bytes(body)))
        )
        first.start()
        time.sleep(0.4)  # the first request holds its pixels while the reward runs
        second = exchange(server.server.port, request_bytes(body))
        first.join(timeout=10)
        assert status_of(second) == 503 and "retry later" in json_of(second)["error"]
        assert b"Retry-After: 1" in second
        assert status_of(results[0]) == 200
        assert status_of(exchange(server.server.port, request_bytes(body))) == 200  # the budget was released
        assert health(server)["busy"] == 1


@pytest.fixture(scope="module")
def quick() -> Iterator[ServerThread]:
    with ServerThread(JPEG, config(read_timeout_s=0.5, max_connections=6)) as server:
        yield server


@pytest.mark.parametrize(
    "partial",
    [
        b"POST /score HTTP/1.1\r\nHost: t\r\n",  # headers never finished
        request_bytes(b'{"images": [', length=1000),  # body never finished
    ],
    ids=["slow-headers", "slow-body"],
)
def test_slow_clients_get_408_and_are_closed(quick, partial: bytes) -> None:
    before = health(quick)["read_timeouts"]
    start = time.monotonic()
    answer = exchange(quick.server.port, partial, wait_s=5.0)  # returns when the server closes
    elapsed = time.monotonic() - start
    assert status_of(answer) == 408 and "read_timeout_s=0.5" in json_of(answer)["error"]
    assert 0.4 < elapsed < 2.0
    assert health(quick)["read_timeouts"] == before + 1


def test_dripping_headers_do_not_extend_the_deadline(quick) -> None:
    with socket.create_connection(("127.0.0.1", quick.server.port), timeout=5) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nX-Slow: ")
        start = time.monotonic()
        answer = b""
        for _ in range(40):  # one byte per 0.1 s: at most 4 s
            try:
                sock.sendall(b"a")
            except OSError:
                break
            sock.settimeout(0.1)
            try:
                answer = sock.recv(4096)
                break
            except TimeoutError:
                continue
    assert status_of(answer) == 408
    assert time.monotonic() - start < 1.5


def test_connection_cap_refuses_with_503_then_recovers(quick) -> None:
    idle = [socket.create_connection(("127.0.0.1", quick.server.port)) for _ in range(6)]
    try:
        time.sleep(0.1)
        answer = exchange(quick.server.port, b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert status_of(answer) == 503 and "too many open connections" in json_of(answer)["error"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    body, expected = good_body(1)
    answer = exchange(quick.server.port, request_bytes(body))
    assert status_of(answer) == 200 and json_of(answer)["scores"] == expected
    assert health(quick)["refused_connections"] >= 1


def test_non_ascii_authorization_is_401(quick) -> None:
    body, _ = good_body()
    answer = exchange(quick.server.port, request_bytes(body, token=b"\xff\xfe\xfd"))
    assert status_of(answer) == 401 and "bearer token" in json_of(answer)["error"]


def test_disconnect_mid_body_is_counted_not_logged_as_error(quick, caplog) -> None:
    before = health(quick)["client_disconnects"]
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection(("127.0.0.1", quick.server.port)) as sock:
            sock.sendall(request_bytes(b'{"images": [', length=10_000))
            time.sleep(0.1)
        for _ in range(50):  # bounded wait for the server to notice
            if health(quick)["client_disconnects"] > before:
                break
            time.sleep(0.02)
    assert health(quick)["client_disconnects"] == before + 1
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any(" 499 " in r.getMessage() for r in caplog.records if r.name == "rewards.server.access")


def test_access_log_has_one_line_per_request_and_never_the_token(quick, caplog) -> None:
    body, _ = good_body()
    with caplog.at_level(logging.INFO, logger="rewards.server.access"):
        exchange(quick.server.port, request_bytes(body))
        exchange(quick.server.port, request_bytes(body, token="wrong-token"))
        time.sleep(0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "rewards.server.access"]
    assert len(lines) == 2
    ok, denied = (line.split() for line in lines)
    assert ok[1:4] == ["POST", "/score", "200"] and int(ok[4]) == len(body) and ok[6].endswith("ms")
    assert denied[3] == "401"
    assert all(TOKEN not in line and "wrong-token" not in line for line in lines)
    assert health(quick)["auth_failures"] >= 1


def test_start_up_config_errors_name_the_key(tmp_path, capsys) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("reward: no_such_reward\n")
    with pytest.raises(SystemExit) as error:
        main(["--config", str(path)])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert "no_such_reward" in err and "Available" in err and "Traceback" not in err
    path.write_bytes(b"reward: jpeg\xff\n")
    with pytest.raises(SystemExit):
        main(["--config", str(path)])
    assert f"{path}: not UTF-8" in capsys.readouterr().err
    path.write_text("reward: jpeg_incompressibility\nmax_request_pixels: 100\nmax_pixels_in_flight: 10\n")
    with pytest.raises(SystemExit):
        main(["--config", str(path)])
    assert "max_request_pixels (100) exceeds max_pixels_in_flight (10)" in capsys.readouterr().err
    path.write_text("reward: jpeg_incompressibility\noptions: {qualty: 80}\n")
    with pytest.raises(SystemExit) as error:
        cli_main(["serve-reward", str(path)])
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"mmrl serve-reward: error: {path}: reward: cannot build reward 'jpeg_incompressibility' with options"
        in err
    )
    assert "usage: mmrl serve-reward CONFIG [--host HOST] [--port PORT]" in err
    assert "qualty" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- the client
class RawServer:
    """A TCP server on loopback that answers every connection with ``handler(socket)``; counts connections."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        outer = self
        self.connections = 0
        self.seen: list[bytes] = []

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer.connections += 1
                self.request.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = self.request.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                outer.seen.append(data)
                handler(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RawServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_client_refuses_redirects_and_never_forwards_the_token() -> None:
    with RawServer(lambda sock: sock.sendall(b"unused")) as elsewhere:

        def redirect(sock: socket.socket) -> None:
            sock.sendall(
                f"HTTP/1.1 302 Found\r\nLocation: {elsewhere.url}/score\r\nContent-Length: 0\r\n\r\n".encode()
            )

        with RawServer(redirect) as origin:
            client = rewards.build("remote", url=origin.url, token=TOKEN, retries=3, backoff_s=0.01)
            with pytest.raises(RemoteRewardError, match="redirects are not followed"):
                client(completions=["a"], ground_truths=["a"])
            assert origin.connections == 1  # not retried
            assert TOKEN.encode() in origin.seen[0]
        assert elsewhere.connections == 0  # the token never went there


@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",  # not HTTP: BadStatusLine
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"id": ',  # cut short: IncompleteRead
        b"",  # closed without an answer: RemoteDisconnected
        b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!",  # not the wire format
    ],
    ids=["bad-status-line", "incomplete-read", "disconnect", "not-json"],
)
def test_client_retries_every_transport_failure_then_remote_reward_error(answer: bytes) -> None:
    with RawServer(lambda sock: sock.sendall(answer)) as server:
        client = rewards.build("remote", url=server.url, retries=2, backoff_s=0.01, timeout=5)
        with pytest.raises(RemoteRewardError, match="after 3 attempts"):
            client(completions=["a"], ground_truths=["a"])
        assert server.connections == 3


def test_client_deadline_bounds_a_dripping_server() -> None:
    def drip(sock: socket.socket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(200):  # one byte per 0.25 s, at most 50 s
            try:
                sock.sendall(b" ")
            except OSError:
                return
            time.sleep(0.25)

    with RawServer(drip) as server:
        client = rewards.build("remote", url=server.url, retries=0, timeout=1)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match="within timeout=1s"):
            client(completions=["a"], ground_truths=["a"])
        assert time.monotonic() - start < 2.0
        client = rewards.build("remote", url=server.url, retries=10, backoff_s=0.01, timeout=1, deadline=2.5)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"within deadline=2\.5s"):
            client(completions=["a"], ground_truths=["a"])
        assert time.monotonic() - start < 3.5


def test_body_bytes_are_budgeted_as_they_arrive() -> None:
    budget = config(max_request_mb=10_000 / 2**20, max_mb_in_flight=15_000 / 2**20, read_timeout_s=3.0)
    with ServerThread(JPEG, budget) as server:
        port = server.server.port
        stalled = socket.create_connection(("127.0.0.1", port))
        try:
            stalled.sendall(request_bytes(b"x" * 8_000, length=10_000))  # 8 kB sent of 10 kB, then silence
            time.sleep(0.3)
            body, expected = good_body(2)
            assert len(body) < 15_000 - 8_000
            answer = exchange(port, request_bytes(body))  # fits beside the 8 kB held
            assert status_of(answer) == 200 and json_of(answer)["scores"] == expected
            second = exchange(port, request_bytes(b"y" * 9_000))  # 8 + 9 kB do not fit
            assert status_of(second) == 503 and "request bytes in flight" in json_of(second)["error"]
        finally:
            stalled.close()
        time.sleep(0.2)
        assert status_of(exchange(port, request_bytes(body))) == 200  # the stalled bytes were given back
        assert health(server)["busy"] == 1
