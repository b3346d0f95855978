"""`pcgspec serve` under abuse: 50 clients hanging up mid-stream, a fuzz run of 600 random and
mutated bodies, then SIGTERM with requests in flight (the last test: it ends the server).
One server process for the module; about 60 s on the 2-core CI machine. Then a server of its
own whose engine process is killed mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from server_process import API_KEY, MODEL, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 5.0  # how long SIGTERM lets requests run
LONG = {
    "model": MODEL,
    "prompt": "Tell me a long story.",
    "max_tokens": 480,
    "ignore_eos": True,
    "temperature": 0.0,
    "stream": True,
}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(
        "--graceful-shutdown-timeout", str(GRACE_S), "--disable-piecewise-cuda-graph"
    )
    try:
        yield proc.wait_healthy()
    finally:
        proc.close()


async def _first_line_then_hang_up(session: aiohttp.ClientSession, url: str) -> bytes:
    async with session.post(url, json=LONG, headers=AUTH) as resp:
        assert resp.status == 200
        line = await resp.content.readline()
        resp.close()  # drop the connection mid-stream
        return line


def test_50_disconnects_abort_and_free_kv(server):
    before = server.internal_state()["num_aborted"]

    async def run() -> list[bytes]:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            url = server.base_url + "/v1/completions"
            return await asyncio.gather(
                *(_first_line_then_hang_up(session, url) for _ in range(50))
            )

    lines = asyncio.run(run())
    assert all(line.startswith(b"data: {") for line in lines)
    state = server.wait_idle(timeout=60)
    assert state["num_aborted"] - before == 50  # 480 tokens each: none could have finished
    assert state["kv"]["used_pages"] == 0 and state["num_open_requests"] == 0
    assert state["num_running"] == 0 and state["num_waiting"] == 0


WEIRD = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    3.5,
    -0.0,
    1e308,
    float("nan"),
    float("inf"),
    2**31,
    2**63,
    2**64,
    -(2**63) - 1,
    10**100,
    "",
    "x",
    "7",
    "\x00",
    "\ud800",
    "é" * 3,
    [],
    [1],
    [-1],
    [[]],
    [[1, 2]],
    ["a", 1],
    [1.5],
    [True],
    {},
    {"a": 1},
    [{}],
    [{"role": "user"}],
    {"type": "text"},
    {"include_usage": 1},
    "<|im_start|>",
    "a" * 3000,
    [2] * 600,
    [{"role": "user", "content": [{"type": "image_url"}]}],
]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "echo",
    "logit_bias",
    "response_format",
    "tools",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "suffix",
]
# NOTE: chat bases carry both length fields, so that one mutation cannot leave a chat request
# unbounded (it would run to the context length: a deadline in all but name).
BASES = [
    {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "max_completion_tokens": 2,
    },
    {"prompt": [[1, 2, 3], "Hi"], "max_tokens": 2, "n": 2, "stream": True, "logprobs": 1},
    {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Yo"}],
        "max_completion_tokens": 2,
        "max_tokens": 2,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 2,
    },
]


def _raw(rng: random.Random) -> bytes:
    valid = json.dumps(rng.choice(BASES)).encode()
    return rng.choice(
        [
            bytes(rng.getrandbits(8) for _ in range(rng.randrange(200))),
            valid[: rng.randrange(len(valid))],
            b"[" * 100_000 + b"]" * 100_000,
            b'{"prompt": ' + b"1" * 5000 + b"}",
            b'{"prompt": "\xff\xfe"}',
            json.dumps(rng.choice(BASES)).encode("utf-16"),
            json.dumps(rng.choice(WEIRD)).encode(),
        ]
    )


def _mutated(rng: random.Random) -> bytes:
    body = json.loads(json.dumps(rng.choice(BASES)))
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6:
            body[rng.choice(FIELDS)] = rng.choice(WEIRD)
        elif kind < 0.8 and body:
            del body[rng.choice(list(body))]
        elif "messages" in body and isinstance(body["messages"], list) and body["messages"]:
            body["messages"][0][rng.choice(["role", "content", "name"])] = rng.choice(WEIRD)
        else:
            body[rng.choice(["x", "stream_options", "prompt"])] = rng.choice(WEIRD)
    return json.dumps(body).encode()


async def _send(session: aiohttp.ClientSession, url: str, data: bytes) -> int:
    """The status, after reading the whole body."""
    headers = {**AUTH, "Content-Type": "application/json"}
    async with session.post(url, data=data, headers=headers) as resp:
        await resp.read()
        return resp.status


def test_fuzz_500_bodies_then_a_normal_request(server):
    rng = random.Random(0)
    paths = ["/v1/completions", "/v1/chat/completions"]
    cases = [
        (rng.choice(paths), _mutated(rng) if rng.random() < 0.75 else _raw(rng)) for _ in range(600)
    ]

    async def run() -> list[int]:
        limit = asyncio.Semaphore(16)
        # NOTE: every case ends on its own (valid ones generate at most 16 tokens): the client
        # waits for each outcome, however busy the machine; the timeout only guards a hang.
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def one(path: str, data: bytes) -> int:
                async with limit:
                    return await _send(session, server.base_url + path, data)

            return await asyncio.gather(*(one(p, d) for p, d in cases))

    statuses = asyncio.run(run())
    errors = [(s, d[:200]) for s, (_, d) in zip(statuses, cases) if s >= 500]
    assert not errors
    assert sum(400 <= s < 500 for s in statuses) > 300
    assert sum(s == 200 for s in statuses) > 20  # some mutations stay valid and run
    status, out = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
    assert status == 200 and out["usage"]["completion_tokens"] >= 1
    state = server.wait_idle(timeout=60)
    assert state["kv"]["used_pages"] == 0 and state["num_open_requests"] == 0
    assert state["num_step_errors"] == 0 and state["engine_alive"]
    steps = state["step_times"]
    assert steps["prefill"]["steps"] > 0 and steps["decode"]["seconds"] > 0


async def _stream_finish(
    session: aiohttp.ClientSession, url: str, body: dict, first: asyncio.Event
) -> tuple[str | None, bool]:
    """The finish reason of a streamed completion, and whether ``[DONE]`` closed it; ``first``
    is set when the first token arrived."""
    finish, done = None, False
    async with session.post(url, json=body, headers=AUTH) as resp:
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                first.set()
                for choice in json.loads(line[6:]).get("choices", []):
                    finish = choice["finish_reason"] or finish
    return finish, done


def test_sigterm_drains_aborts_and_exits(server):
    url = server.base_url + "/v1/completions"

    async def run() -> tuple[list[tuple[str | None, bool]], int, float]:
        async with aiohttp.ClientSession() as session:
            firsts = [asyncio.Event(), asyncio.Event()]
            bodies = (LONG, {**LONG, "max_tokens": 2})
            tasks = [
                asyncio.create_task(_stream_finish(session, url, body, first))
                for body, first in zip(bodies, firsts)
            ]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), timeout=120)
            server.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            await asyncio.sleep(0.3)
            async with session.post(url, json=LONG, headers=AUTH) as resp:
                refused = resp.status  # draining: new requests are refused
            results = await asyncio.gather(*tasks)
            return results, refused, time.monotonic() - start

    (long, short), refused, elapsed = asyncio.run(run())
    assert refused == 503
    assert short == ("length", True)  # one step from done: finished within the grace period
    assert long == ("abort", True)  # aborted when the grace period ran out
    assert GRACE_S - 0.5 < elapsed < GRACE_S + 30
    assert server.proc.wait(timeout=30) == 0


def _engine_pid(server_pid: int) -> int:
    """The engine process among the server's children (multiprocessing's resource tracker may
    be another)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [
        int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(engines) == 1, children
    return engines[0]


def test_engine_process_death_ends_open_streams_and_the_server():
    """SIGKILL to the engine process (the OOM killer, a crashed driver): the open stream ends
    with an OpenAI error event and [DONE], the log names the signal, and the server exits
    with 1."""
    proc = ServerProcess("--disable-piecewise-cuda-graph")
    try:
        proc.wait_healthy()
        url = proc.base_url + "/v1/completions"

        async def run() -> tuple[list[dict], bool]:
            events, done = [], False
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json=LONG, headers=AUTH) as resp:
                    async for line in resp.content:
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif line.startswith(b"data: "):
                            if not events:  # the first token arrived: kill the engine
                                os.kill(_engine_pid(proc.proc.pid), signal.SIGKILL)
                            events.append(json.loads(line[6:]))
            return events, done

        events, done = asyncio.run(asyncio.wait_for(run(), timeout=120))
        assert done and events[-1]["error"]["type"] == "internal_error"
        assert "engine" in events[-1]["error"]["message"]
        assert proc.proc.wait(timeout=30) == 1
        assert "ERROR pcgspec: the engine process was killed by SIGKILL" in proc.log.read_text()
    finally:
        proc.close()
