"""Server guards without a model: settings, quiet client-error logs, prompt
tokenization lanes and the character bound, token bytes and logprobs of partial UTF-8 tokens,
and a client hanging up inside a handler. A few seconds (the tokenizer loads once).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from pcgspec.engine.request import TokenLogprobs
from pcgspec.models.loader import load_tokenizer
from pcgspec.sampling_params import SamplingParams
from pcgspec.server import app as server_app
from pcgspec.server.admission import listen
from pcgspec.server.connections import QuietClientErrors, RateLimit
from pcgspec.server.protocol import ApiError, GenerationRequest
from pcgspec.server.responses import chat_logprobs, completion_logprobs
from pcgspec.server.state import ServerSettings
from pcgspec.server.token_bytes import TextOffsets, TokenBytes, token_string
from pcgspec.server.tokenize import INLINE_PROMPT_CHARS, LONG_PROMPT_CHARS, PromptEncoder

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


def _chat(messages: list[dict[str, str]]) -> GenerationRequest:
    return GenerationRequest(True, "m", SamplingParams(), False, False, messages=tuple(messages))


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


def test_short_prompts_tokenize_on_the_event_loop_and_longer_ones_on_workers():
    """Texts of INLINE_PROMPT_CHARS together at most take no trip to a worker thread; a request
    of many short prompts (or chat messages) that together pass it does."""

    class Where(_FakeTokenizer):
        def __init__(self) -> None:
            super().__init__()
            self.threads: list[str] = []

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            self.threads.append(threading.current_thread().name)
            return super().encode(text)

        def apply_chat_template(self, messages: list, **_: object) -> str:
            return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    tok = Where()
    encoder = PromptEncoder(tok, max_model_len=100_000)
    loop_thread = threading.current_thread().name
    try:
        asyncio.run(encoder.encode(_request("x" * INLINE_PROMPT_CHARS)))
        assert tok.threads == [loop_thread]
        asyncio.run(encoder.encode(_request("x" * (INLINE_PROMPT_CHARS + 1))))
        asyncio.run(encoder.encode(_request(*["y" * 8] * (INLINE_PROMPT_CHARS // 8 + 1))))
        assert len(tok.threads) == 2 + INLINE_PROMPT_CHARS // 8 + 1
        assert all(name.startswith("pcgspec-tokenize") for name in tok.threads[1:])
        tok.threads.clear()
        asyncio.run(encoder.encode(_chat([{"role": "user", "content": "hi"}])))
        # many empty messages are no short prompt: the template's text around each counts
        asyncio.run(encoder.encode(_chat([{"role": "user", "content": ""}] * 64)))
        assert tok.threads[0] == loop_thread and tok.threads[1].startswith("pcgspec-tokenize")
    finally:
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
