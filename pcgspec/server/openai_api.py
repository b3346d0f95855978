"""``/v1/completions`` and ``/v1/chat/completions``: JSON bodies or server-sent events.

A request leaves the engine whichever way its handler ends: finished, failed, or cancelled
because the client went away (the ``finally`` aborts every unfinished sequence).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from pcgspec.server.async_engine import EngineDeadError, Generation
from pcgspec.server.protocol import (
    ApiError,
    GenerationRequest,
    bad,
    check_prompt_length,
    parse_chat,
    parse_completion,
)
from pcgspec.server.responses import (
    DONE,
    Choice,
    ResponseHeader,
    body_choice,
    chat_logprobs,
    chunk_choice,
    completion_logprobs,
    sse,
    usage,
)
from pcgspec.server.state import STATE, ServerState
from pcgspec.server.token_bytes import TextOffsets

DECODED = ("identity", "gzip", "x-gzip", "deflate", "br", "zstd")  # aiohttp decodes (or refuses)


async def read_body(request: web.Request) -> bytes:
    """The body: 413 over the size limit, 408 when it is slower than the read timeout, 400 when
    it does not decode."""
    settings = request.app[STATE].settings
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in DECODED:
        raise ApiError(
            415,
            f"Content-Encoding {encoding[:40]!r} is not supported (send gzip, deflate or none)",
            code="unsupported_content_encoding",
        )
    try:
        return await asyncio.wait_for(request.read(), settings.read_timeout)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413,
            f"the request body exceeds {settings.max_request_bytes} bytes",
            code="request_too_large",
        ) from None
    except asyncio.TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {settings.read_timeout} s",
            code="request_timeout",
        ) from None
    except web.RequestPayloadError:  # e.g. a Content-Encoding the body does not match
        raise ApiError(
            400,
            f"the body does not decode as its Content-Encoding {encoding!r}",
            code="invalid_body",
        ) from None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 400 when it is not one."""
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ApiError(
            400, f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise ApiError(
            400, f"the body must be a JSON object, got {type(body).__name__}", code="invalid_json"
        )
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    arrival = time.perf_counter()
    state = request.app[STATE]
    body = await read_json(request)
    req = (parse_chat if chat else parse_completion)(body, state.limits)
    prompt_ids = await state.encode(req)
    for ids in prompt_ids:
        check_prompt_length(len(ids), req.params.max_tokens, state.limits.max_model_len)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    header = ResponseHeader(rid, int(time.time()), req.model, chat)
    gen = Generation(state.engine, arrival)
    try:
        for i, ids in enumerate(prompt_ids):
            await _add(gen, f"{rid}-{i}", ids, req)
        if req.stream:
            return await _stream(request, state, req, header, gen)
        return web.json_response(await _collect(state, req, header, gen))
    finally:
        gen.abort()


async def _add(gen: Generation, request_id: str, ids: list[int], req: GenerationRequest) -> None:
    try:
        await gen.add(request_id, ids, req.params)
    except ValueError as e:
        raise bad("prompt", str(e)) from None
    except EngineDeadError as e:
        raise ApiError(503, str(e), type="service_unavailable") from None


async def _collect(
    state: ServerState, req: GenerationRequest, header: ResponseHeader, gen: Generation
) -> dict[str, Any]:
    choices: dict[int, Choice] = {}
    n = req.params.n
    try:
        async for batch in gen.updates():
            for stream, deltas in batch:
                for d in deltas:
                    c = choices.setdefault(stream.prompt_index * n + d.index, Choice())
                    c.text += d.text
                    c.num_tokens += len(d.token_ids)
                    c.logprobs += d.logprobs
                    c.finish_reason = d.finish_reason or c.finish_reason
    except EngineDeadError as e:
        raise ApiError(500, str(e), type="internal_error") from None
    want = req.params.logprobs is not None
    out = [body_choice(req.chat, i, choices[i], want, state.token_bytes) for i in sorted(choices)]
    num_prompt = sum(s.num_prompt_tokens for s in gen.streams)
    num_cached = sum(s.num_cached_tokens for s in gen.streams)
    return header.body(
        out, usage(num_prompt, sum(c.num_tokens for c in choices.values()), num_cached)
    )


async def _stream(
    request: web.Request,
    state: ServerState,
    req: GenerationRequest,
    header: ResponseHeader,
    gen: Generation,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    n, chat, with_usage = req.params.n, req.chat, req.include_usage
    if chat:
        roles = [
            chunk_choice(True, i, "", None, None, role=True) for i in range(n * len(gen.streams))
        ]
        await resp.write(b"".join(header.chunk_event(choice, with_usage) for choice in roles))
    offsets: dict[int, TextOffsets] = {}  # completions logprobs: text so far per choice
    num_tokens = 0
    # NOTE: one write per batch of deltas, the last one with the end of the stream: each write
    # is a system call (with its wake-up of the client), the dearest part of a served token
    tail: list[bytes] = []
    try:
        async for batch in gen.updates():
            events = []
            for stream, deltas in batch:
                for d in deltas:
                    num_tokens += len(d.token_ids)
                    index = stream.prompt_index * n + d.index
                    lps = _delta_logprobs(state, req, d.logprobs, offsets, index)
                    if not d.text and lps is None and d.finish_reason is None:
                        continue  # text held back (an incomplete character or a stop string)
                    if lps is None and d.finish_reason is None:  # text only: most tokens
                        events.append(header.text_event(index, d.text, with_usage))
                        continue
                    text = d.text if d.text or not chat else None
                    choice = chunk_choice(chat, index, text, lps, d.finish_reason)
                    events.append(header.chunk_event(choice, with_usage))
            if gen.done:
                tail = events
            elif events:
                await resp.write(b"".join(events))
    except EngineDeadError as e:
        tail.append(sse(ApiError(500, str(e), type="internal_error").body()))
    if with_usage:
        num_prompt = sum(s.num_prompt_tokens for s in gen.streams)
        num_cached = sum(s.num_cached_tokens for s in gen.streams)
        tail.append(sse(header.chunk([], usage(num_prompt, num_tokens, num_cached))))
    await resp.write_eof(b"".join([*tail, DONE]))
    return resp


def _delta_logprobs(
    state: ServerState,
    req: GenerationRequest,
    lps: tuple[Any, ...],
    offsets: dict[int, TextOffsets],
    index: int,
) -> dict[str, Any] | None:
    if req.params.logprobs is None or not lps:
        return None
    if req.chat:
        return chat_logprobs(lps, state.token_bytes)
    return completion_logprobs(lps, state.token_bytes, offsets.setdefault(index, TextOffsets()))
