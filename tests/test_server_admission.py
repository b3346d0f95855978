"""Who gets a connection: the cap and its reserve for /health and /metrics, the per-address cap,
the deadline for a request head, and OpenAI error bodies for requests aiohttp cannot parse. An
in-process server per test; a few seconds.
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import select
import socket
import time
from typing import Any

import pytest
from aiohttp import web

from pcgspec.server import app as server_app
from pcgspec.server.admission import admission, listen


def _open(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def _answers(socks: list[socket.socket], count: int, wait: float = 30.0) -> list[bytes | None]:
    """What each socket received once ``count`` of them are readable (None: nothing yet, still
    open); the loop is a guard against hanging, it ends as soon as the count is reached."""
    ready: list[socket.socket] = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        ready = select.select(socks, [], [], 0.02)[0]
        if len(ready) >= count:
            break
    return [s.recv(12) if s in ready else None for s in socks]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def _serve(body: Any, **limits: Any) -> Any:
    """Runs ``body(port)`` in a thread against a server of ``/``, ``/health`` and ``/v1/x``."""

    async def run() -> Any:
        app = web.Application(middlewares=[admission, server_app._errors])
        for path in ("/", "/health", "/v1/x"):
            app.router.add_get(path, _ok)
        runner = web.AppRunner(app, keepalive_timeout=60)
        await runner.setup()
        listener = await listen(runner, "127.0.0.1", 0, **limits)
        port = listener.sockets[0].getsockname()[1]
        try:
            return await asyncio.get_running_loop().run_in_executor(None, body, port)
        finally:
            listener.close()
            await runner.cleanup()

    return asyncio.run(run())


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_connections_over_the_cap_and_its_silent_reserve_get_503():
    def body(port: int) -> list[bytes | None]:
        socks = _open(port, 12)
        try:
            return _answers(socks, 5)
        finally:
            for s in socks:
                s.close()

    got = _serve(body, max_connections=5, reserve=2, header_timeout=30.0)
    assert sorted(got, key=str) == [None] * 7 + [b"HTTP/1.1 503"] * 5  # 2 silent ones evicted


def test_a_health_check_takes_the_place_of_a_silent_reserve_connection():
    def body(port: int) -> tuple[int, float, int]:
        socks = _open(port, 10)  # 4 normal, 2 reserve, 4 of them evicted in turn
        try:
            _answers(socks, 4)
            start = time.monotonic()
            status, _ = _get(port, "/health")
            took = time.monotonic() - start
            return status, took, sum(a is None for a in _answers(socks, 5, wait=0.5))
        finally:
            for s in socks:
                s.close()

    status, took, silent = _serve(body, max_connections=4, reserve=2, header_timeout=30.0)
    assert status == 200 and took < 2.0
    assert silent == 5  # 4 normal, 1 reserve: the health check took the other's place


def test_health_answers_in_time_while_idle_sockets_fill_the_cap():
    def body(port: int) -> tuple[int, float, list[bytes | None], int]:
        socks = _open(port, 12)
        try:
            start = time.monotonic()
            status, _ = _get(port, "/health")
            took = time.monotonic() - start
            refused, _ = _get(port, "/v1/x")  # a reserve slot: health and metrics only
            return status, took, _answers(socks, 12, wait=10.0), refused
        finally:
            for s in socks:
                s.close()

    status, took, closed, refused = _serve(body, max_connections=8, header_timeout=1.0)
    assert status == 200 and took < 2.0 and refused == 503
    assert closed == [b""] * 12  # the idle ones were closed by the header timeout


def test_a_slow_drip_head_is_closed_by_the_header_timeout():
    def body(port: int) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            start = time.monotonic()
            got = b""
            for piece in (b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"X-A: 1\r\n", b"X-B: 2\r\n"):
                try:
                    s.sendall(piece)
                except OSError:
                    break
                if select.select([s], [], [], 0.4)[0]:
                    got = s.recv(64)
                    break
            if not got:
                got = s.recv(64)
            return got, time.monotonic() - start

    got, took = _serve(body, max_connections=8, header_timeout=1.0)
    assert got == b"" and took < 3.0


def test_the_per_peer_cap_leaves_the_excess_only_health():
    def body(port: int) -> tuple[int, int, int]:
        socks = _open(port, 4)
        try:
            assert _answers(socks, 1, wait=0.3) == [None] * 4  # all four admitted
            return _get(port, "/v1/x")[0], _get(port, "/health")[0], _get(port, "/")[0]
        finally:
            for s in socks:
                s.close()

    over, health, after = _serve(body, max_connections=64, per_peer=4, header_timeout=30.0)
    assert (over, health) == (503, 200) and after == 503
    ok = _serve(lambda port: _get(port, "/v1/x")[0], max_connections=64, per_peer=4)
    assert ok == 200


def _raw(port: int, data: bytes) -> tuple[str, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(body)


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "malformed_request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, "malformed_request"),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400, "malformed_request"),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 400, "malformed_request"),
        (
            b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            415,
            "unsupported_content_encoding",
        ),
        (
            b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Encoding: deflate\r\n"
            b"Content-Length: 2\r\n\r\n{}",
            400,
            "invalid_body",
        ),
    ],
)
def test_requests_aiohttp_cannot_parse_get_openai_error_bodies(data, status, code):
    if status == 415 and any(importlib.util.find_spec(m) for m in ("brotli", "brotlicffi")):
        pytest.skip("br is decoded where Brotli is installed")
    line, body = _serve(lambda port: _raw(port, data), max_connections=8)
    assert line.split(" ", 2)[1] == str(status), line
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    message = body["error"]["message"]
    assert "install" not in message and "aiohttp" not in message and "Brotli" not in message
    if status == 415:
        assert "'br'" in message
