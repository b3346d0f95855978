"""Server pieces without a server: request validation, stop-string holdback in streamed deltas,
and ``Scheduler.abort``. Well under a second.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time

import pytest

from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.request import Request, RequestStatus
from pcgspec.engine.scheduler import Scheduler
from pcgspec.sampling_params import SamplingParams
from pcgspec.server.async_engine import AsyncEngine, Generation, exit_reason
from pcgspec.server.deltas import SeqDelta, SeqTracker, from_wire_form
from pcgspec.server.engine_loop import EngineDeadError
from pcgspec.server.protocol import (
    ApiError,
    Limits,
    check_prompt_length,
    parse_chat,
    parse_completion,
)
from pcgspec.server.tokenize import PromptEncoder

LIMITS = Limits("m", vocab_size=1000, max_model_len=128)
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "x", "model": "other"}, "model", 404),
        ({"prompt": "x", "model": 3}, "model", 400),
        ({"prompt": ""}, None, None),  # empty text is caught after tokenizing
        ({"prompt": []}, "prompt", 400),
        ({"prompt": [1, 1000]}, "prompt", 400),
        ({"prompt": [1, True]}, "prompt", 400),
        ({"prompt": [True]}, "prompt", 400),
        ({"prompt": [[1, -1]]}, "prompt", 400),
        ({"prompt": [[1, 2.0]]}, "prompt", 400),
        ({"prompt": [[1, 2], []]}, "prompt", 400),
        ({"prompt": "x", "n": 0}, "n", 400),
        ({"prompt": ["x"] * 200, "n": 2}, "n", 400),
        ({"prompt": "x", "temperature": float("nan")}, "temperature", 400),
        ({"prompt": "x", "temperature": 10**400}, "temperature", 400),
        ({"prompt": "x", "top_p": 0}, "top_p", 400),
        ({"prompt": "x", "top_k": 0}, "top_k", 400),
        ({"prompt": "x", "seed": 2**63}, "seed", 400),
        ({"prompt": "x", "max_tokens": 129}, "max_tokens", 400),
        ({"prompt": "x", "logprobs": 21}, "logprobs", 400),
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", 400),
        ({"prompt": "x", "stop_token_ids": [1, True]}, "stop_token_ids", 400),
        ({"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids", 400),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", 400),
        ({"prompt": "x", "echo": True}, "echo", 400),
        ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", 400),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos", 400),
        ({"prompt": "\ud800"}, "prompt", 400),
        ({"prompt": "x", "stop": ["\udfff"]}, "stop", 400),
    ],
)
def test_completion_validation_names_the_field(body, param, status):
    if status is None:
        assert parse_completion(body, LIMITS).prompts == ("",)
        return
    with pytest.raises(ApiError) as info:
        parse_completion(body, LIMITS)
    assert (info.value.status, info.value.param) == (status, param)
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_valid_requests_parse():
    req = parse_completion(
        {
            "prompt": [[1, 2], "a"],
            "n": 2,
            "seed": -5,
            "stop": "\n",
            "max_tokens": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        LIMITS,
    )
    assert req.prompts == ([1, 2], "a") and req.params.n == 2 and req.include_usage
    assert req.params.stop_strings == ("\n",) and req.params.max_tokens == 7
    chat = parse_chat(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "max_tokens": 3,
            "max_completion_tokens": 5,
            "logprobs": True,
            "top_logprobs": 2,
        },
        LIMITS,
    )
    assert chat.messages == ({"role": "user", "content": "ab"},)
    assert chat.params.max_tokens == 5 and chat.params.logprobs == 2
    assert parse_chat({"messages": USER}, LIMITS).params.max_tokens is None


def test_chat_validation_and_prompt_length():
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [3]}, "messages[0]"),
        ({"messages": USER, "top_logprobs": 1}, "top_logprobs"),
    ]:
        with pytest.raises(ApiError) as info:
            parse_chat(body, LIMITS)
        assert info.value.param == param
    check_prompt_length(100, 28, 128)
    for n, max_tokens, param in [(128, None, "prompt"), (100, 29, "max_tokens"), (0, 1, "prompt")]:
        with pytest.raises(ApiError) as info:
            check_prompt_length(n, max_tokens, 128)
        assert info.value.param == param and (n == 0 or "128" in info.value.message)


class _Tokenizer:
    """A chat template that refuses a conversation ending with the assistant; one id per byte."""

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bc": 1}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        if messages[-1]["role"] == "assistant":
            raise ValueError("the last message must come from the user")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * add_special_tokens + list(text.encode())


def test_prompt_encoder_templates_chats_and_passes_token_ids():
    encoder = PromptEncoder(_Tokenizer(), max_model_len=128)
    try:
        chat = parse_chat({"messages": USER}, LIMITS)
        assert asyncio.run(encoder.encode(chat)) == [list(b"<user>hi<assistant>")]
        ids = parse_completion({"prompt": [[5, 6], [7]]}, LIMITS)
        assert asyncio.run(encoder.encode(ids)) == [[5, 6], [7]]
        bad = parse_chat({"messages": [*USER, {"role": "assistant", "content": "x"}]}, LIMITS)
        with pytest.raises(ApiError) as info:
            asyncio.run(encoder.encode(bad))
        assert info.value.status == 400 and info.value.param == "messages"
        assert "must come from the user" in info.value.message
    finally:
        encoder.shutdown()


class _CharDetokenizer:
    """One character per token id."""

    def __init__(self) -> None:
        self.text = ""

    def add_token(self, token_id: int) -> str:
        self.text += chr(token_id)
        return chr(token_id)


def _request(group: str, index: int, params: SamplingParams) -> Request:
    return Request(
        f"{group}-{index}",
        [1, 2, 3],
        params,
        0,
        _CharDetokenizer(),
        100,
        group_id=group,
        index=index,
    )


def test_streamed_text_is_a_prefix_of_the_final_text_with_stop_strings():
    req = _request("r", 0, SamplingParams(stop=["xyz", "q"], max_tokens=50))
    tracker = SeqTracker(req)
    sent, held = "", []
    for ch in "abxy xyxyz!":
        req.append_token(ord(ch), frozenset())
        delta = tracker.delta()
        sent += from_wire_form([delta])[0].text if delta else ""
        held.append(len(req.text) - len(sent))
        assert req.text.startswith(sent)
        if req.finished:
            break
    assert req.finish_reason == "stop" and sent == req.text == "abxy xy"
    assert max(held) == 2 and tracker.delta() is None and tracker.done


def test_scheduler_abort_frees_pages_at_once():
    pool = PagePool(8)
    sched = Scheduler(pool, page_size=2, max_running_requests=8, prefill_token_budget=64)
    group = [_request("a", i, SamplingParams()) for i in range(2)]
    other = _request("b", 0, SamplingParams())
    for req in [*group, other]:
        sched.add(req)
    assert sched.schedule() is not None and pool.num_free == 2  # 3 requests x 2 pages
    aborted = sched.abort("a")
    assert aborted == group and pool.num_free == 6
    assert all(r.finish_reason == "abort" and r.pages == [] for r in group)
    assert all(r.status is RequestStatus.FINISHED for r in group)
    assert list(sched.waiting) == [other] and sched.abort("a") == []


@pytest.mark.parametrize("best_of", [float("nan"), -1, 0, 3, 2.0, True, "2"])
def test_best_of_other_than_n_is_refused(best_of):
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": USER})):
        with pytest.raises(ApiError) as info:
            parse({**body, "n": 2, "best_of": best_of}, LIMITS)
        assert info.value.status == 400 and info.value.param == "best_of"
    assert parse_completion({"prompt": "x", "n": 2, "best_of": 2}, LIMITS).params.n == 2
    assert parse_completion({"prompt": "x", "best_of": None}, LIMITS).params.n == 1


def test_unknown_fields_are_logged_once_per_name(caplog):
    with caplog.at_level(logging.WARNING, logger="pcgspec"):
        for _ in range(3):
            parse_completion({"prompt": "x", "unknown_knob": 1, "user": "u"}, LIMITS)
            parse_chat({"messages": USER, "unknown_knob": 1, "other_knob": 2}, LIMITS)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(lines) == [
        "request field 'other_knob' is not supported and was ignored",
        "request field 'unknown_knob' is not supported and was ignored",
    ]


def _exit_with(code: int) -> None:
    os._exit(code)


def test_the_engine_process_exit_is_named_with_its_code_or_signal():
    context = multiprocessing.get_context("fork")
    exited = context.Process(target=_exit_with, args=(3,))
    exited.start()
    assert exit_reason(exited, wait=30) == "the engine process exited with code 3"
    killed = context.Process(target=time.sleep, args=(60,))
    killed.start()
    killed.kill()
    assert exit_reason(killed, wait=30) == "the engine process was killed by SIGKILL"


def test_engine_death_is_an_error_line_but_a_stop_is_not(caplog):
    with caplog.at_level(logging.INFO, logger="pcgspec"):
        dead = AsyncEngine()
        dead._died("the engine process was killed by SIGKILL")
        stopped = AsyncEngine()
        stopped._stopping = True
        stopped._died("the engine process exited with code 0")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == ["the engine process was killed by SIGKILL"]
    assert not dead.alive and not stopped.alive


class _AcceptingEngine:
    """``AsyncEngine.submit`` that accepts at once; the test feeds the deltas itself."""

    def submit(self, stream, prompt_ids, params) -> None:
        stream.settle(None)

    def abort(self, request_id: str) -> None:
        pass


def _delta(token: int, text: str, finish: str | None = None) -> SeqDelta:
    return SeqDelta(0, text, (token,), (), finish)


def test_updates_take_what_piled_up_at_once_and_raise_after_it():
    """A consumer that fell behind takes every queued delta in one batch (the stream writes
    them at once); the batch with the last final delta sets ``done``; an engine error ends the
    updates after the deltas queued before it."""

    async def texts(updates) -> list[tuple[str, list[str]]]:
        return [(s.request_id, [d.text for d in ds]) for s, ds in await anext(updates)]

    async def run() -> None:
        params = SamplingParams(max_tokens=2)
        gen = Generation(_AcceptingEngine())
        await gen.add("a", [1], params)
        await gen.add("b", [1], params)
        a, b = gen.streams
        gen.queue.put_nowait((a, [_delta(1, "x")], False))
        gen.queue.put_nowait((b, [_delta(2, "y")], False))
        gen.queue.put_nowait((a, [_delta(3, "z", "length")], True))
        updates = gen.updates()
        assert await texts(updates) == [("a", ["x"]), ("b", ["y"]), ("a", ["z"])]
        assert not gen.done
        gen.queue.put_nowait((b, [_delta(4, "w", "length")], True))
        assert await texts(updates) == [("b", ["w"])]
        assert gen.done
        with pytest.raises(StopAsyncIteration):
            await anext(updates)

        failing = Generation(_AcceptingEngine())
        await failing.add("c", [1], params)
        await failing.add("d", [1], params)
        c, d = failing.streams
        failing.queue.put_nowait((c, [_delta(1, "x")], False))
        failing.queue.put_nowait((d, EngineDeadError("the engine failed"), True))
        updates = failing.updates()
        assert await texts(updates) == [("c", ["x"])]
        with pytest.raises(EngineDeadError, match="the engine failed"):
            await anext(updates)

    asyncio.run(run())


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("with_usage", [True, False])
def test_a_stream_chunk_is_the_generic_event_byte_for_byte(chat, with_usage):
    """A stream's per-token chunk, its constant part encoded once per response, is exactly the
    server-sent event of the whole chunk object (non-ASCII text and a finish reason too), and
    so is a text-only token's event written around its text."""
    from pcgspec.server.responses import ResponseHeader, chunk_choice, sse

    header = ResponseHeader("cmpl-ü1", 1764400000, "Smol\u00e9-\U0001f600", chat)
    for choice in (
        chunk_choice(chat, 0, " the", None, None),
        chunk_choice(chat, 3, 'naïve \u4e2d\n"q"', {"content": []}, "stop"),
        chunk_choice(chat, 1, None, None, "length"),
    ):
        want = sse(header.chunk([choice], with_usage_field=with_usage))
        assert header.chunk_event(choice, with_usage) == want
    for index, text in ((0, " the"), (12, 'naïve \u4e2d\n"q"\\')):  # a text-only choice
        want = sse(header.chunk([chunk_choice(chat, index, text, None, None)], None, with_usage))
        assert header.text_event(index, text, with_usage) == want


def test_the_engine_loops_pipe_channel_speaks_connection_bytes():
    """``PipeChannel`` (the engine process's end): ``poll`` false with nothing waiting, true
    for a message and for the other end's close; what it sends a plain ``Connection.recv``
    reads; ``poll(None)`` waits for a message."""
    import threading

    from pcgspec.server.engine_loop import EngineInfo, PipeChannel

    ours, theirs = multiprocessing.Pipe()
    channel = PipeChannel(ours)
    assert not channel.poll() and not channel.poll(0.01)
    theirs.send(("add", "r1", [1, 2], None))
    assert channel.poll() and channel.recv() == ("add", "r1", [1, 2], None)
    assert not channel.poll()
    message = ("ready", EngineInfo("/m", 10, 20, 30))
    channel.send(message)
    channel.send(("refused", "r1", ValueError("prompt too long")))
    assert theirs.recv() == message
    kind, request_id, error = theirs.recv()
    assert (kind, request_id, type(error), str(error)) == (
        "refused",
        "r1",
        ValueError,
        "prompt too long",
    )
    timer = threading.Timer(0.05, theirs.send, args=(("stop",),))
    timer.start()
    start = time.perf_counter()
    assert channel.poll(None) and time.perf_counter() - start >= 0.04
    assert channel.recv() == ("stop",)
    timer.join()
    theirs.close()
    assert channel.poll()  # the close reads as readable: recv then raises EOFError
    with pytest.raises(EOFError):
        channel.recv()


def test_deltas_cross_as_plain_tuples_and_come_back_equal():
    """A tracker's deltas are plain tuples (they pickle without their class); the server's
    ``from_wire_form`` makes them ``SeqDelta``s again: the first carries the first-token times,
    each the tokens since the one before, the last the finish reason."""
    import pickle

    from pcgspec.engine.request import TokenLogprobs
    from pcgspec.server.deltas import FirstTokenTimes, SeqDelta

    req = _request("r", 1, SamplingParams(max_tokens=3))
    req.num_cached_tokens, req.scheduled_time, req.first_token_time = 2, 2.0, 3.5
    tracker, sent = SeqTracker(req), []
    req.append_token(ord("P"), frozenset())
    sent.append(tracker.delta())
    req.logprobs.append(TokenLogprobs(ord("a"), -0.25, ((ord("a"), -0.25),)))
    for ch in "ab":
        req.append_token(ord(ch), frozenset())
    sent.append(tracker.delta())
    assert all(type(d) is tuple for d in sent) and tracker.done and tracker.delta() is None
    back = from_wire_form(pickle.loads(pickle.dumps(sent, pickle.HIGHEST_PROTOCOL)))
    first = FirstTokenTimes(req.arrival_time, 2.0, 3.5)
    assert back == [
        SeqDelta(1, "P", (ord("P"),), (), None, 2, first),
        SeqDelta(1, "ab", (ord("a"), ord("b")), tuple(req.logprobs), "length", 2),
    ]
    assert all(type(d) is SeqDelta for d in back) and back[0].first_token.prefill_s == 1.5


class _StepEngine:
    """What ``EngineLoop`` asks of an engine: each step appends one token to every request."""

    def __init__(self) -> None:
        self.running: dict[str, Request] = {}

    def add_request(self, prompt_ids, params, request_id):
        req = _request(request_id, 0, params)
        self.running[request_id] = req
        return [req]

    def abort(self, request_id: str) -> bool:
        req = self.running.pop(request_id, None)
        if req is not None:
            req.finish("abort")
        return req is not None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self) -> None:
        for request_id, req in list(self.running.items()):
            req.append_token(ord("a"), frozenset())
            if req.finished:
                del self.running[request_id]

    def stats(self) -> dict:
        return {"num_running": len(self.running)}

    def spec_stats(self) -> dict:
        return {}

    cache_stats = graph_stats = step_stats = spec_stats


def test_the_engine_loop_publishes_after_steps_and_aborts_with_snapshots_by_time(monkeypatch):
    """An add publishes nothing until a step, whose message accepts it; a step publishes every
    stream's delta, with the counters on the first step of a busy spell and then only every
    ``SNAPSHOT_INTERVAL`` (a finish among running streams brings none); an abort publishes at
    once, with the counters, and so does the step that leaves the engine idle."""
    from pcgspec.server import engine_loop
    from pcgspec.server.engine_loop import EngineLoop, ThreadChannel

    monkeypatch.setattr(engine_loop, "SNAPSHOT_INTERVAL", 30.0)  # NOTE: no step waits for it
    sent: list[tuple] = []
    channel = ThreadChannel(sent.append)
    loop = EngineLoop(_StepEngine(), channel)
    for request_id, max_tokens in (("short", 2), ("long", 50), ("other", 50)):
        channel.inbox.put(("add", request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens)))
    loop._apply_commands(wait=False)
    assert sent == []

    loop._step()  # the first step of a busy spell: counters
    loop._step()  # "short" ends, two streams run on: no counters
    (accepted, first, snapshot), (none_accepted, second, none) = [m[1:] for m in sent]
    assert accepted == ["short", "long", "other"] and none_accepted == []
    assert [i[0] for i in first] == ["short", "long", "other"] and snapshot is not None
    assert ("short", True) in [(i[0], i[2]) for i in second] and none is None
    sent.clear()

    channel.inbox.put(("abort", "long"))
    loop._apply_commands(wait=False)
    ((kind, _, items, snapshot),) = sent
    assert kind == "deltas" and snapshot is not None
    assert [(i[0], i[1][-1][4], i[2]) for i in items] == [("long", "abort", True)]
    sent.clear()

    loop.engine.abort("other")
    loop._step()  # nothing left to run: the engine goes idle, counters go out
    ((kind, _, items, snapshot),) = sent
    assert [i[0] for i in items] == ["other"] and snapshot.stats == {"num_running": 0}


class _RefusingEngine(_StepEngine):
    """``_StepEngine`` that refuses an empty prompt and ends a request of ``max_tokens=1`` at
    its add, as an engine may finish a request no step needs to run."""

    def add_request(self, prompt_ids, params, request_id):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if params.max_tokens == 1:
            req = _request(request_id, 0, params)
            req.finish("length")
            return [req]
        return super().add_request(prompt_ids, params, request_id)


def test_an_add_is_refused_at_once_and_one_no_step_follows_is_accepted_at_once():
    """A refused add answers with its error before any step; an add that leaves the engine
    without work (no step follows) is accepted, and its final delta sent, right away: its
    client is never left waiting for a step that does not come."""
    from pcgspec.server.engine_loop import EngineLoop, ThreadChannel

    sent: list[tuple] = []
    channel = ThreadChannel(sent.append)
    loop = EngineLoop(_RefusingEngine(), channel)
    channel.inbox.put(("add", "empty", [], SamplingParams()))
    loop._apply_commands(wait=False)
    ((kind, request_id, error),) = sent
    assert (kind, request_id, str(error)) == ("refused", "empty", "the prompt is empty")
    sent.clear()

    channel.inbox.put(("add", "done", [1, 2], SamplingParams(max_tokens=1)))
    loop._apply_commands(wait=False)
    ((kind, accepted, items, snapshot),) = sent
    assert (kind, accepted, snapshot is not None) == ("deltas", ["done"], True)
    ((request_id, deltas, final),) = items
    assert (request_id, final, deltas[-1][4]) == ("done", True, "length")


class _GroupEngine(_StepEngine):
    """``_StepEngine`` whose adds are groups of ``n`` sequences (``params.n``), each with its
    first-token times once it has a token; an abort ends a group's unfinished sequences."""

    def add_request(self, prompt_ids, params, request_id):
        reqs = [_request(request_id, i, params) for i in range(params.n)]
        for req in reqs:
            req.scheduled_time = req.first_token_time = req.arrival_time
            self.running[req.request_id] = req
        return reqs

    def abort(self, request_id: str) -> bool:
        group = [k for k, r in self.running.items() if r.group_id == request_id]
        for key in group:
            req = self.running.pop(key)
            if not req.finished:  # NOTE: as the scheduler, which holds unfinished ones only
                req.finish("abort")
        return bool(group)


def test_a_publish_sends_one_error_for_a_group_one_sequence_of_which_failed():
    """A group of three: the first publish carries every sequence's first token (each counts
    its prompt once); when a sequence fails while a sibling finishes and another gets a token,
    the group gets its one error (final, with counters), its running sequence is aborted, and
    none of that publish's tokens count."""
    from pcgspec.server.engine_loop import EngineLoop, RequestFailedError, ThreadChannel

    sent: list[tuple] = []
    engine = _GroupEngine()
    loop = EngineLoop(engine, ThreadChannel(sent.append))
    counted: list[tuple[int, int]] = []
    loop._throughput.count = lambda prompt, generated: counted.append((prompt, generated))
    loop._add("g", [1, 2, 3], SamplingParams(n=3, max_tokens=5))
    sent.clear()

    loop._step()
    ((kind, accepted, items, _),) = sent
    assert accepted == ["g"]
    ((request_id, deltas, final),) = items
    assert (kind, request_id, final, len(deltas)) == ("deltas", "g", False, 3)
    assert counted == [(3 * 3, 3)]  # three prompts of 3 tokens, a token each
    sent.clear()

    first, failing, running = (engine.running[f"g-{i}"] for i in range(3))
    first.finish("stop")
    failing.fail("ValueError: boom")
    running.append_token(ord("b"), frozenset())
    loop._publish(snapshot=False)
    ((kind, _, items, snapshot),) = sent
    ((request_id, error, final),) = items
    assert (kind, request_id, final) == ("deltas", "g", True) and snapshot is not None
    assert isinstance(error, RequestFailedError) and "boom" in str(error)
    assert running.finish_reason == "abort" and not loop._live and not engine.running
    assert counted[-1] == (0, 0)
