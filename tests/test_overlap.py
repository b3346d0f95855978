"""The overlap schedule on the real SmolLM2 (CPU, float32): outputs equal synchronous stepping
(greedy and seeded, chunked prefill, every stop kind, aborts mid-flight, preemption, n > 1,
logprobs, penalties, the prefix cache, the server), at most one step is wasted on a finished
request, and the pool and the sampling slots are whole afterwards.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from oracle import PROMPTS, assert_all_pages_free, greedy

import pcgspec.server.engine_loop as engine_loop
from pcgspec import LLM, SamplingParams
from pcgspec.config import EngineConfig
from pcgspec.engine.overlap import LaunchedStep
from pcgspec.server.app import build_app
from pcgspec.server.async_engine import AsyncEngine
from pcgspec.server.state import ServerSettings, ServerState

# A mixed batch: greedy and seeded rows, stop strings and tokens, EOS, max_tokens, n > 1,
# logprobs and penalties.
PARAMS = [
    greedy(14),
    SamplingParams(temperature=0.8, seed=3, max_tokens=11, logprobs=3, ignore_eos=True),
    greedy(24, stop=[" 8,"]),
    SamplingParams(
        temperature=0.7,
        top_k=20,
        seed=5,
        max_tokens=9,
        n=3,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        presence_penalty=0.1,
        ignore_eos=True,
    ),
    SamplingParams(temperature=0, max_tokens=40),  # EOS or max_tokens
    greedy(16, stop_token_ids=[28]),  # "," in SmolLM2's vocabulary
    SamplingParams(
        temperature=1.0, top_p=0.9, min_p=0.05, seed=9, max_tokens=13, ignore_eos=True, logprobs=1
    ),
]
BATCH = [PROMPTS[0], PROMPTS[1], PROMPTS[6], PROMPTS[2], PROMPTS[9], PROMPTS[6], PROMPTS[8]]


def _llm(path, overlap: bool, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", disable_overlap_schedule=not overlap, **kw)


def _outputs(outs) -> list[tuple]:
    """Per sequence: tokens, text, finish and stop reasons, and logprobs."""
    return [
        (o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs or [])
        for out in outs
        for o in out.outputs
    ]


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Equal but for the logprobs' float rounding: a step's batch holds a finished request
    more under the overlap schedule, which moves float32 results by ~1e-7."""
    assert [g[:4] for g in got] == [w[:4] for w in want]
    for g, w in zip(got, want):
        for entry_g, entry_w in zip(g[4], w[4], strict=True):
            assert entry_g.keys() == entry_w.keys()
            assert all(abs(entry_g[t].logprob - entry_w[t].logprob) < 1e-4 for t in entry_g)
            assert [e.rank for e in entry_g.values()] == [e.rank for e in entry_w.values()]


def _assert_whole(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.in_flight and not engine.has_unfinished
    assert engine.slots.num_free == engine.slots.num_slots
    assert all(r.num_pending_tokens == 0 for r in engine.scheduler.running)
    assert_all_pages_free(llm)


def _count_forwards(llm: LLM, monkeypatch) -> list[str]:
    modes: list[str] = []
    forward = llm.engine.runner.forward

    def counted(batch):
        modes.append(batch.forward_mode.name)
        return forward(batch)

    monkeypatch.setattr(llm.engine.runner, "forward", counted)
    return modes


@pytest.fixture(scope="module")
def engines(smollm2_path) -> dict[bool, LLM]:
    """Chunked prefill of 8 tokens, pages of 4: long prompts take several chunks."""
    return {ov: _llm(smollm2_path, ov, chunked_prefill_size=8, page_size=4) for ov in (True, False)}


def test_config_resolves_and_validates():
    assert not EngineConfig(device="cpu").use_overlap_schedule
    assert EngineConfig(device="cpu", disable_overlap_schedule=False).use_overlap_schedule
    assert EngineConfig(
        device="cpu", disable_overlap_schedule=False, speculative_algorithm="NGRAM"
    ).use_overlap_schedule
    with pytest.raises(ValueError, match="disable_overlap_schedule must be a bool"):
        EngineConfig(device="cpu", disable_overlap_schedule="yes")


def test_debug_log_lists_each_step(engines, caplog):
    """``--log-level debug`` logs each step: its kind, requests, new tokens and wall time."""
    with caplog.at_level(logging.DEBUG, logger="pcgspec"):
        engines[True].generate(
            ["A prompt of its own for the step log: one two three four"], greedy(4), use_tqdm=False
        )
    steps = [r.getMessage() for r in caplog.records if " step: " in r.getMessage()]
    assert re.fullmatch(r"prefill step: 1 requests, 8 new tokens, [\d.]+ ms", steps[0]), steps
    assert sum(m.startswith("decode step: 1 requests, 1 new tokens, ") for m in steps) >= 2


def test_mixed_batch_equals_synchronous(engines, monkeypatch):
    results, forwards = {}, {}
    for overlap, llm in engines.items():
        assert llm.engine.overlap is overlap
        forwards[overlap] = _count_forwards(llm, monkeypatch)
        results[overlap] = _outputs(llm.generate(BATCH, PARAMS, use_tqdm=False))
        _assert_whole(llm)
    _assert_same(results[True], results[False])
    reasons = {r[2] for r in results[True]}
    assert reasons == {"stop", "length"} and any(r[3] == 28 for r in results[True])
    # finished requests ride along one more step at most: never more steps than requests
    assert len(forwards[False]) <= len(forwards[True]) <= len(forwards[False]) + len(PARAMS)
    assert forwards[True].count("EXTEND") == forwards[False].count("EXTEND")


def test_max_tokens_wastes_no_step(engines, monkeypatch):
    """A request whose pending token reaches max_tokens is not scheduled again."""
    steps = {}
    for overlap, llm in engines.items():
        forwards = _count_forwards(llm, monkeypatch)
        llm.generate(PROMPTS[3], greedy(7), use_tqdm=False)
        steps[overlap] = forwards
    assert steps[True] == steps[False] == ["EXTEND"] + ["DECODE"] * 6


def test_each_step_launches_before_the_previous_one_is_read(engines, monkeypatch):
    """A decode step launches before the previous one is read; a prefill step that sampled
    (first tokens) is read before anything else is launched."""
    engine, events = engines[True].engine, []
    forward, read = engine.runner.forward, LaunchedStep.read

    def launch(batch):
        events.append("launch")
        return forward(batch)

    def read_back(step, eos_token_ids):
        events.append("read")
        return read(step, eos_token_ids)

    monkeypatch.setattr(engine.runner, "forward", launch)
    monkeypatch.setattr(LaunchedStep, "read", read_back)
    engines[True].generate(PROMPTS[0], greedy(4), use_tqdm=False)
    assert events == ["launch", "read", "launch", "launch", "read", "launch", "read", "read"]
    # chunks of a long prompt (8 tokens each) sample nothing: they overlap like decode steps
    events.clear()
    prompt = "Count with me, slowly and one at a time: one, two, three, four, five, six, seven"
    chunks = -(-len(engines[True].get_tokenizer().encode(prompt)) // 8)
    assert chunks >= 3
    engines[True].generate(prompt, greedy(2), use_tqdm=False)
    assert events == ["launch"] + ["launch", "read"] * (chunks - 1) + ["read", "launch", "read"]


def test_first_tokens_are_read_early_where_they_are_a_good_share(smollm2_path):
    """A wave of new requests is read before the next launch (a step of its own that only
    reads); a few requests joining many running ones (a quarter of the sampled rows) are read
    one step late, like decode rows, so the device does not idle while the next step is built
    (``FIRST_TOKEN_SHARE``). Their tokens equal a run of their own."""
    llm = _llm(smollm2_path, True)
    engine, tok = llm.engine, llm.get_tokenizer()
    for p in PROMPTS[:9]:
        engine.add_request(tok.encode(p), greedy(40))
    engine.step()  # the nine prompts' prefill, one step
    assert engine.step_counts["prefill"] == 1 and len(engine.scheduler.running) == 9
    engine.step()  # reads the wave's first tokens, launches nothing
    assert engine.step_counts["first_tokens"] == 1 and not engine.in_flight
    for _ in range(3):
        engine.step()
    (late,) = engine.add_request(tok.encode(PROMPTS[9]), greedy(6))
    for p in PROMPTS[:2]:
        engine.add_request(tok.encode(p), greedy(6))
    while late.num_output_tokens == 0:
        engine.step()
    assert engine.step_counts["mixed"] == 1  # nine decode rows and the three new prompts
    assert engine.step_counts["first_tokens"] == 1  # 3 of 12 sampled rows: read one step late
    while engine.has_unfinished:
        engine.step()
    alone = llm.generate(PROMPTS[9], greedy(6), use_tqdm=False)[0].outputs[0].token_ids
    assert late.output_token_ids == alone


def test_abort_mid_flight(engines):
    """Aborting a request while its step runs: it ends at once with "abort", the others come
    out as without the abort."""
    want = {}
    for overlap, llm in engines.items():
        engine, tok = llm.engine, llm.get_tokenizer()
        reqs = [engine.add_request(tok.encode(p), greedy(12)) for p in PROMPTS[:3]]
        (gone,) = engine.add_request(tok.encode(PROMPTS[4]), greedy(30), request_id="gone")
        steps, aborted = 0, False
        while engine.has_unfinished:
            engine.step()
            steps += 1
            # from the fourth step on, once a step that samples it is in flight
            running = any(gone in s.requests for s in engine.in_flight)
            if not aborted and steps >= 4 and (running or not overlap):
                assert engine.abort("gone") == [gone] and gone.finish_reason == "abort"
                aborted = True
        assert aborted and gone.num_output_tokens < 30
        want[overlap] = [r[0].output_token_ids for r in reqs]
        _assert_whole(llm)
    assert want[True] == want[False]


def test_preemption_in_a_tiny_pool(smollm2_path):
    results = {}
    for overlap in (True, False):
        llm = _llm(
            smollm2_path,
            overlap,
            page_size=4,
            max_total_tokens=64,
            chunked_prefill_size=8,
            disable_piecewise_cuda_graph=True,
        )
        params = [greedy(20), PARAMS[1], greedy(18, logprobs=2), PARAMS[3]]
        results[overlap] = _outputs(llm.generate(PROMPTS[4:8], params, use_tqdm=False))
        assert llm.engine.scheduler.num_preemptions > 0
        _assert_whole(llm)
    _assert_same(results[True], results[False])


def test_prefix_cache_multi_turn(engines):
    """Each turn resends the history: later turns hit the pages the earlier ones inserted."""
    outs = {}
    for overlap, llm in engines.items():
        llm.engine.flush_cache()
        tok = llm.get_tokenizer()
        prompt, turns = tok.encode(PROMPTS[7]), []
        for t in range(3):
            out = llm.generate({"prompt_token_ids": prompt}, greedy(6), use_tqdm=False)[0]
            turns.append((out.token_ids, out.num_cached_tokens))
            prompt = prompt + out.token_ids + tok.encode(f" And {PROMPTS[t]}")
        outs[overlap] = turns
        _assert_whole(llm)
    assert outs[True] == outs[False]
    assert outs[True][-1][1] > 0


async def _complete(client: TestClient, prompt: str, **extra: object) -> str:
    body = {
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    resp = await client.post("/v1/completions", json=body)
    events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]")


def test_server_streams_equal_generate(engines, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pcgspec")
    llm = engines[True]
    want = [o.text for o in engines[False].generate(PROMPTS[:6], greedy(10), use_tqdm=False)]
    monkeypatch.setattr(engine_loop, "Engine", lambda config: llm.engine)

    async def run() -> list[str]:
        engine = AsyncEngine(in_process=True)  # the injected engine
        await engine.start(llm.config)
        state = ServerState.build(engine, llm.config, ServerSettings())
        try:
            async with TestClient(TestServer(build_app(state))) as client:
                return await asyncio.gather(*(_complete(client, p) for p in PROMPTS[:6]))
        finally:
            await engine.stop()
            state.encoder.shutdown()

    assert asyncio.run(run()) == want
    _assert_whole(llm)
    finished = [
        m
        for m in caplog.messages
        if re.fullmatch(
            r"request \S+ finished \(length\): \d+ prompt tokens, 10 output tokens, \d+ ms", m
        )
    ]
    assert len(finished) == 6, caplog.messages


@pytest.mark.gpu
def test_cuda_overlap_equals_synchronous():
    """The CUDA path (decode graphs, piecewise prefill, pinned read-back behind events) on the
    default model: greedy and seeded outputs equal with and without the overlap schedule. Only
    max_tokens ends them, so both schedules run the same batches (bfloat16 is not batch
    invariant)."""
    params = [PARAMS[i] for i in (0, 1, 3, 6)]
    results = {}
    for overlap in (True, False):
        llm = LLM(
            disable_overlap_schedule=not overlap,
            chunked_prefill_size=64,
            cuda_graph_max_bs=64,
            max_total_tokens=1 << 15,
        )
        assert llm.engine.overlap is overlap and llm.engine.runner.decode_graphs is not None
        outs = llm.generate(PROMPTS * 2, [params[i % 4] for i in range(32)], use_tqdm=False)
        results[overlap] = [(o.token_ids, o.finish_reason) for out in outs for o in out.outputs]
        _assert_whole(llm)
        del llm
        torch.cuda.empty_cache()
    assert results[True] == results[False]
