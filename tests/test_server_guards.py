"""Server guards without a model: the connection cap, quiet client-error logs, prompt
tokenization lanes and the character bound, token bytes and logprobs of partial UTF-8 tokens,
and a client hanging up inside a handler. A few seconds (the tokenizer loads once).
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import logging
import select
import socket
import threading
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from pcgspec.engine.request import TokenLogprobs
from pcgspec.models.loader import load_tokenizer
from pcgspec.sampling_params import SamplingParams
from pcgspec.server import app as server_app
from pcgspec.server.admission import admission, listen
from pcgspec.server.connections import QuietClientErrors, RateLimit
from pcgspec.server.protocol import ApiError, GenerationRequest
from pcgspec.server.responses import chat_logprobs, completion_logprobs
from pcgspec.server.state import ServerSettings
from pcgspec.server.token_bytes import TextOffsets, TokenBytes, token_string
from pcgspec.server.tokenize import LONG_PROMPT_CHARS, PromptEncoder

CJK = "我爱我的猫 🎉 naïve café"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("keep_alive_timeout", 0.0),
        ("read_timeout", -1.0),
        ("header_timeout", 0.0),
        ("max_connections", 0),
        ("max_connections_per_peer", 0),
    ],
)
def test_server_settings_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})


def test_rate_limit_lets_one_through_per_interval_and_counts_the_rest():
    now = [0.0]
    limit = RateLimit(interval=10.0, clock=lambda: now[0])
    assert [limit.allow() for _ in range(4)] == [0, None, None, None]
    now[0] = 10.0
    assert limit.allow() == 3 and limit.allow() is None


def _record(msg: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, None) if error else None
    return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, msg, (), exc_info)


def test_client_errors_log_once_as_a_warning_without_traceback():
    quiet = QuietClientErrors()
    malformed = [_record("Error handling request", BadHttpMessage("bad header")) for _ in range(50)]
    passed = [r for r in malformed if quiet.filter(r)]
    assert len(passed) == 1 and passed[0].levelno == logging.WARNING
    assert passed[0].exc_info is None and "bad header" in passed[0].getMessage()
    accept = [_record("socket.accept() out of system resource\nsocket: %s") for _ in range(50)]
    assert sum(map(quiet.filter, accept)) == 1
    other = _record("engine step failed", RuntimeError("boom"))
    assert quiet.filter(other) and other.levelno == logging.ERROR and other.exc_info


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


class _FakeTokenizer:
    """Tokens of at most 4 characters; encoding a long text waits for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def get_vocab(self) -> dict[str, int]:
        return {"abcd": 0, "a": 1}

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        if len(text) > LONG_PROMPT_CHARS:
            self.release.wait(60)
        return [1] * len(text)


def _request(*prompts: str) -> GenerationRequest:
    return GenerationRequest(False, "m", SamplingParams(), False, False, prompts=prompts)


def test_a_prompt_longer_than_the_context_can_hold_is_rejected_without_tokenizing():
    tok = _FakeTokenizer()
    encoder = PromptEncoder(tok, max_model_len=10_000)
    assert encoder.max_chars == 2 * 10_000 * 4
    with pytest.raises(ApiError) as info:
        asyncio.run(encoder.encode(_request("x", "y" * (encoder.max_chars + 1))))
    assert info.value.param == "prompt" and "characters" in info.value.message
    assert tok.calls == 0
    encoder.shutdown()


def test_short_prompts_tokenize_while_long_ones_are_busy():
    tok = _FakeTokenizer()
    encoder = PromptEncoder(tok, max_model_len=100_000)

    async def run() -> list[list[int]]:
        longs = [asyncio.ensure_future(encoder.encode(_request("z" * 40_000))) for _ in range(4)]
        short = await asyncio.wait_for(encoder.encode(_request("hi")), timeout=60)
        assert not any(f.done() for f in longs)  # still tokenizing: the short one did not wait
        tok.release.set()
        await asyncio.gather(*longs)
        return short

    try:
        assert asyncio.run(run()) == [[1, 1]]
    finally:
        tok.release.set()
        encoder.shutdown()


def test_token_bytes_join_back_into_the_text(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(CJK)
    raw = [token_bytes(i) for i in ids]
    assert b"".join(raw) == CJK.encode()
    partial = [b for b in raw if token_string(b).startswith("bytes:")]
    assert partial and all(b.decode("utf-8", "replace") != token_string(b) for b in partial)
    assert token_bytes(1) == b"<|im_start|>"
    offsets = TextOffsets()
    starts = [offsets.advance(b) for b in raw]
    assert starts[0] == 0 and offsets.chars == len(CJK) and starts == sorted(starts)


def test_logprobs_keep_every_partial_alternative(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(CJK)
    partial = [i for i in ids if token_string(token_bytes(i)).startswith("bytes:")]
    top = tuple((i, -float(k)) for k, i in enumerate(dict.fromkeys(partial)))
    lps = [TokenLogprobs(i, -0.5, top) for i in ids]
    out = completion_logprobs(lps, token_bytes)
    assert all(len(d) == len(top) for d in out["top_logprobs"])
    assert all(t in d for t, d in zip(out["tokens"], out["top_logprobs"]) if t.startswith("b"))
    chat = chat_logprobs(lps, token_bytes)["content"]
    assert bytes(b for entry in chat for b in entry["bytes"]).decode() == CJK
    assert all(len({e["token"] for e in c["top_logprobs"]}) == len(top) for c in chat)


def test_a_client_hanging_up_inside_a_handler_is_not_an_unhandled_error(caplog):
    async def hang_up(request: web.Request) -> web.StreamResponse:
        raise ConnectionResetError("Cannot write to closing transport")

    async def run() -> None:
        app = web.Application(middlewares=[server_app._errors])
        app.router.add_get("/", hang_up)
        runner = web.AppRunner(app)
        await runner.setup()
        listener = await listen(runner, "127.0.0.1", 0, max_connections=4)
        port = listener.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/") as resp:
                    assert resp.status == 499  # what a client still there would see
        finally:
            listener.close()
            await runner.cleanup()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
