"""`pcgspec serve` through the official openai client: completions, chat, streaming, sampling
fields, 32 concurrent streams, bad inputs, /metrics and /server_info. One server process for
the module (SmolLM2, float32 on CPU); about 60 s on the 2-core CI machine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest
from oracle import PROMPTS
from prometheus_client.parser import text_string_to_metric_families
from server_process import API_KEY, DEFAULT_ARGS, MODEL, ServerProcess

from pcgspec.engine.engine import STEP_KINDS

openai = pytest.importorskip("openai")  # NOTE: a test extra; absent where only GPU tests run

GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess()
    try:
        yield proc.wait_healthy()
    finally:
        proc.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def _stream_text(stream, chat: bool) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if chat else choice.text
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert server.get("/health")[0] == 200
    assert server.get("/health_generate")[0] == 200


def test_completion_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, **GREEDY)
    full = client.completions.create(**kw)
    assert full.choices[0].text.strip() and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == 5 and 1 <= full.usage.completion_tokens <= 10
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    text, finish, usage = _stream_text(stream, chat=False)
    assert text == full.choices[0].text and finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens


def test_chat_stream_equals_non_stream(client):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=12,
        **GREEDY,
    )
    full = client.chat.completions.create(**kw)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content.strip()
    assert full.usage.prompt_tokens > 20  # the chat template's system turn is in there
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = _stream_text(stream, chat=True)
    assert text == message.content and finish == full.choices[0].finish_reason
    assert usage.total_tokens == full.usage.total_tokens


def _stream_all(server, prompts: list[str], kw: dict) -> list[tuple[str, object]]:
    """Stream every prompt at once; per prompt the streamed text and the final usage."""
    aclient = openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )

    async def one(prompt: str) -> tuple[str, object]:
        stream = await aclient.completions.create(
            prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def run_all() -> list[tuple[str, object]]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    return asyncio.run(run_all())


def test_32_concurrent_streams_equal_each_alone(server, client):
    unique = PROMPTS[:10]  # NOTE: 10 requests alone, each sent 3 or 4 times at once
    prompts = [unique[i % len(unique)] for i in range(32)]
    kw = dict(model=MODEL, max_tokens=8, extra_body=IGNORE_EOS, **GREEDY)
    alone = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in unique}
    outs = [(text, usage.completion_tokens) for text, usage in _stream_all(server, prompts, kw)]
    for prompt, (text, tokens) in zip(prompts, outs):
        assert tokens == 8, prompt
        assert text == alone[prompt], prompt
    assert server.wait_idle()["kv"]["used_pages"] == 0


def test_shared_prefix_streams_equal_each_alone_with_cached_tokens(server, client):
    """Concurrent requests sharing a system prompt hit the prefix cache and stream what each
    streams alone; usage, /server_info and /metrics report the cached tokens."""
    system = "You are a terse assistant. Answer with one word or a number, nothing else. " * 3
    prompts = [
        system + q
        for q in ("Capital of Italy?", "Two plus two?", "Color of grass?", "Largest planet?")
    ]
    kw = dict(model=MODEL, max_tokens=6, extra_body=IGNORE_EOS, **GREEDY)
    before = _scrape(server)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    assert alone[0].usage.prompt_tokens_details.cached_tokens == 0
    assert all(r.usage.prompt_tokens_details.cached_tokens >= 32 for r in alone[1:])
    outs = _stream_all(server, prompts * 2, kw)
    for (text, usage), want in zip(outs, alone * 2):
        assert text == want.choices[0].text
        assert usage.prompt_tokens_details.cached_tokens >= 32
    state = server.wait_idle()
    cache = state["prefix_cache"]
    assert cache["cached_tokens"] > 0 and 0 < cache["hit_rate"] <= 1 and cache["tree_pages"] > 0
    assert state["kv"]["used_pages"] == 0 and state["kv"]["cached_pages"] == cache["tree_pages"]
    after = _scrape(server)
    key = f"pcgspec:prefix_cache_hit_tokens_total{[('model_name', MODEL)]}"
    assert after[key] - before.get(key, 0.0) >= 32 * 11


def test_flush_cache_while_streaming(server, client):
    """POST /flush_cache (keyed) drops every cached prefix, also while shared-prefix requests
    stream: they stream what each streams alone, and afterwards nothing is cached."""
    system = "You are a patient tutor. Explain every answer in plain words for a beginner. " * 3
    prompts = [system + q for q in ("Why is the sky blue?", "What is a prime number?")]
    kw = dict(model=MODEL, max_tokens=6, extra_body=IGNORE_EOS, **GREEDY)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert server.post("/flush_cache", {}, key=None)[0] == 401
    statuses, stop = [], threading.Event()

    def flush_until_stopped() -> None:
        while not stop.is_set():
            statuses.append(server.post("/flush_cache", {})[0])

    flusher = threading.Thread(target=flush_until_stopped)
    flusher.start()
    try:
        outs = _stream_all(server, prompts * 3, kw)
    finally:
        stop.set()
        flusher.join()
    assert statuses and set(statuses) == {200}
    assert [text for text, _ in outs] == alone * 3
    assert server.post("/flush_cache", {}) == (200, {"status": "ok"})
    state = server.wait_idle()
    assert state["prefix_cache"]["tree_pages"] == 0 and state["kv"]["cached_pages"] == 0
    again = client.completions.create(prompt=prompts[0], **kw)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == alone[0]


def _text(client, **kw) -> str:
    return client.completions.create(model=MODEL, **kw).choices[0].text


def test_stop_penalties_and_seeded_n(client):
    count = dict(prompt="1, 2, 3, 4, 5,", max_tokens=12, **GREEDY)
    base = _text(client, **count, extra_body=IGNORE_EOS)
    assert "7" in base, base
    stopped = client.completions.create(model=MODEL, stop=["7"], **count).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == base[: base.index("7")]
    penalized = _text(client, **count, frequency_penalty=2.0, extra_body=IGNORE_EOS)
    assert penalized != base  # ", " repeats in the count: the penalty must change the text
    kw = dict(prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=1234)
    first = client.completions.create(model=MODEL, **kw, extra_body=IGNORE_EOS)
    again = client.completions.create(model=MODEL, **kw, extra_body=IGNORE_EOS)
    assert len(first.choices) == 2 and first.usage.completion_tokens == 16
    assert first.choices[0].text != first.choices[1].text
    assert [c.text for c in first.choices] == [c.text for c in again.choices]


def test_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, logprobs=2, extra_body=IGNORE_EOS, **GREEDY
    ).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and "".join(lp.tokens) == out.text
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))  # greedy: the top-1
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=3,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert chat.usage.completion_tokens <= 3 and len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


@pytest.mark.parametrize(
    ("body", "key", "status", "param", "needle"),
    [
        (b'{"prompt": "hi", ', API_KEY, 400, None, "not valid JSON"),
        (b"[1, 2]", API_KEY, 400, None, "JSON object"),
        ({"prompt": "hi", "temperature": "hot"}, API_KEY, 400, "temperature", "number"),
        ({"prompt": "hi", "max_tokens": 2.5}, API_KEY, 400, "max_tokens", "integer"),
        ({"prompt": "hi", "stop": [1]}, API_KEY, 400, "stop", "string"),
        ({"prompt": "hi", "model": "gpt-9"}, API_KEY, 404, "model", "does not exist"),
        ({"prompt": "hi " * 600}, API_KEY, 400, "prompt", "512"),
        ({"prompt": "hi " * 10, "max_tokens": 510}, API_KEY, 400, "max_tokens", "512"),
        ({"prompt": "hi"}, None, 401, None, "API key"),
        ({"prompt": "hi"}, "sk-wrong", 401, None, "API key"),
        (b'{"prompt": "' + b"x" * (5 << 20) + b'"}', API_KEY, 413, None, "exceeds"),
    ],
    ids=[
        "malformed",
        "not-object",
        "wrong-type",
        "float-int",
        "stop-type",
        "unknown-model",
        "prompt-too-long",
        "max-tokens-too-long",
        "no-key",
        "wrong-key",
        "too-large",
    ],
)
def test_bad_input_status_and_error_body(server, body, key, status, param, needle):
    got, payload = server.post("/v1/completions", body, key=key)
    assert got == status, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and needle in error["message"], error
    if param == "prompt":
        assert "601" in error["message"] or "600" in error["message"]  # the prompt's length


def test_bad_chat_messages_name_the_field(server):
    cases = [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "cat", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ]
    for body, param in cases:
        status, payload = server.post("/v1/chat/completions", body)
        assert status == 400 and payload["error"]["param"] == param, payload
    status, payload = server.request(
        "GET", "/v1/nowhere", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert status == 404 and payload["error"]["code"] == "not_found"


def _scrape(server) -> dict[str, float]:
    status, text = server.get("/metrics")
    assert status == 200
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_parse_and_move(server, client):
    before = _scrape(server)
    client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=5, extra_body=IGNORE_EOS, **GREEDY
    )
    after = _scrape(server)
    label = [("model_name", MODEL)]

    def moved(name: str, labels: list[tuple[str, str]] = label) -> float:
        key = f"pcgspec:{name}{sorted(labels)}"
        return after[key] - before.get(key, 0.0)

    assert moved("generation_tokens_total") == 5
    assert moved("prompt_tokens_total") == 2
    assert moved("request_success_total", [*label, ("finished_reason", "length")]) == 1
    assert moved("time_to_first_token_seconds_count") == 1
    assert moved("inter_token_latency_seconds_count") == 4
    assert moved("e2e_request_latency_seconds_count") == 1
    parts = ("dispatch", "queue", "prefill", "return")
    for part in parts:
        assert moved(f"request_{part}_time_seconds_count") == 1
        assert moved(f"request_{part}_time_seconds_sum") > 0
    # The parts of TTFT after the hand-off to the engine, each stamped on its own clock read.
    engine_side = sum(moved(f"request_{part}_time_seconds_sum") for part in parts)
    assert engine_side <= moved("time_to_first_token_seconds_sum")
    piecewise = [*label, ("runner", "piecewise")]
    assert moved("graph_runs_total", piecewise) >= 5
    assert 0 < after[f"pcgspec:graph_hit_ratio{sorted(piecewise)}"] <= 1
    too_many = sorted([*piecewise, ("reason", "too_many_tokens")])
    assert f"pcgspec:graph_fallbacks_total{too_many}" in after
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "spec_accept_length",
    ):
        assert f"pcgspec:{name}{label}" in after


def test_server_info(server):
    status, info = server.get("/server_info")
    assert status == 200 and info["served_model_name"] == MODEL
    assert info["config"]["context_length"] == 512 and info["context_length"] == 512
    assert "api_key" not in info["server_args"] and info["server_args"]["api_key_set"]
    state = info["internal_states"][0]
    assert {"avg_spec_accept_length", "graphs", "kv", "num_running", "num_waiting"} <= set(state)
    piecewise = state["graphs"]["piecewise"]
    assert piecewise["runs"] > 0 and "too_many_tokens" in piecewise["fallbacks"]
    assert 0 < piecewise["hit_ratio"] <= 1
    assert state["kv"]["total_pages"] > 0 and state["engine_alive"]


def test_bench_serving_smoke(server, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPTS / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench)  # NOTE: dataclasses look it up
    spec.loader.exec_module(bench)
    out = tmp_path / "serving.json"
    record = bench.main(
        [
            "--base-url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "16",
            "--random-output-len",
            "4",
            "--warmup",
            "0",
            "--out",
            str(out),
        ]
    )
    assert record["successful_requests"] == 4 and record["total_output_tokens"] == 16
    assert record["total_input_tokens"] == 64 and json.loads(out.read_text())["model"] == MODEL
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert set(record[name]) == {"mean_ms", "p50_ms", "p90_ms", "p99_ms"}
    assert record["ttft"]["p50_ms"] > 0 and record["output_token_throughput"] > 0
    parts = [
        record[k]
        for k in (
            "dispatch_ms_mean",
            "engine_queue_ms_mean",
            "engine_prefill_ms_mean",
            "return_ms_mean",
        )
    ]
    assert all(p >= 0 for p in parts) and parts[2] > 0
    assert sum(parts) <= record["server_ttft_ms_mean"] < record["ttft"]["mean_ms"]


def test_bench_serving_prefix_datasets_with_and_without_cache(server, monkeypatch):
    """shared-prefix and multi-turn against the module's server; --launch runs both cache
    modes (the launch itself faked: both runs go to the module's server)."""
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPTS / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench)
    spec.loader.exec_module(bench)
    launched = []

    class FakeServer:
        def send_signal(self, sig: int) -> None: ...

        def wait(self, timeout: float) -> None: ...

    monkeypatch.setattr(bench, "launch", lambda args, extra: launched.append(extra) or FakeServer())
    common = [
        "--base-url",
        server.base_url,
        "--api-key",
        API_KEY,
        "--random-output-len",
        "3",
        "--warmup",
        "1",
        "--max-concurrency",
        "2",
    ]
    record = bench.main(
        [
            *common,
            "--dataset",
            "shared-prefix",
            "--shared-prefix-len",
            "32",
            "--question-len",
            "4",
            "--num-prompts",
            "3",
        ]
    )
    assert record["successful_requests"] == 3 and record["total_input_tokens"] == 3 * 36
    # the warm-up shares nothing with them; the first two run together, the third hits
    assert record["total_cached_tokens"] >= 32
    assert record["prefill_tokens_computed"] == 3 * 36 - record["total_cached_tokens"]
    # --repeats: runs pooled, the cache flushed between them (else all 3 would hit the prefix)
    record = bench.main(
        [
            *common,
            "--dataset",
            "shared-prefix",
            "--shared-prefix-len",
            "32",
            "--question-len",
            "4",
            "--num-prompts",
            "3",
            "--repeats",
            "2",
        ]
    )
    repeats = record["repeats"]
    assert record["successful_requests"] == 6 and len(repeats) == 2
    assert 32 <= repeats[1]["cached_tokens"] < 3 * 32
    assert record["total_cached_tokens"] == sum(r["cached_tokens"] for r in repeats)
    assert record["duration_s"] == pytest.approx(sum(r["duration_s"] for r in repeats))
    record = bench.main(
        [
            *common,
            "--dataset",
            "multi-turn",
            "--num-chats",
            "2",
            "--num-turns",
            "2",
            "--question-len",
            "4",
            "--launch",
        ]
    )
    assert launched == [[], ["--disable-radix-cache"]]
    runs = record["runs"]
    assert set(runs) == {"radix_cache_on", "radix_cache_off"}
    assert all(r["successful_requests"] == 4 for r in runs.values())
    assert runs["radix_cache_on"]["total_cached_tokens"] > 0
    ratio = record["cache_comparison"]["prefill_tokens_computed"]["ratio"]
    assert ratio is not None and ratio > 0  # both runs hit the one (cached) server here


def test_bench_serving_compares_with_the_engine(server, monkeypatch):
    """--compare-engine: the same prompts through LLM.generate with the server's engine flags,
    beside the (faked) launch's load, and served / engine throughput."""
    # NOTE: the engine side starts sooner (the running server's flags are what it takes)
    monkeypatch.setenv("PCGSPEC_CPU_PIECEWISE", "0")
    spec = importlib.util.spec_from_file_location("bench_serving", SCRIPTS / "bench_serving.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serving", bench)
    spec.loader.exec_module(bench)

    class FakeServer:
        def send_signal(self, sig: int) -> None: ...

        def wait(self, timeout: float) -> None: ...

    monkeypatch.setattr(bench, "launch", lambda args, extra: FakeServer())
    with pytest.raises(SystemExit):
        bench.parse_args(["--compare-engine"])  # needs --launch
    args = [
        "--base-url",
        server.base_url,
        "--api-key",
        API_KEY,
        "--launch",
        "--compare-engine",
        "--server-args",
        " ".join(DEFAULT_ARGS),
        "--num-prompts",
        "3",
        "--max-concurrency",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--warmup",
        "1",
    ]
    record = bench.main(args)
    engine = record["engine"]
    assert engine["successful_requests"] == 3 and engine["total_output_tokens"] == 9
    assert record["total_output_tokens"] == 9
    for row in record["engine_comparison"].values():
        assert row["served"] > 0 and row["engine"] > 0
        assert row["ratio"] == pytest.approx(row["served"] / row["engine"])
    # each side's steps of the measured load alone, by kind: a prefill, then decode steps
    # (tokens 2 and 3 of each request); the warm-up's steps are in neither
    for steps in (record["step_times"], engine["step_times"]):
        assert set(steps) <= set(STEP_KINDS) and steps["decode"]["steps"] >= 2
        assert all(v["steps"] > 0 and v["ms_mean"] > 0 for v in steps.values())
        assert 1 <= sum(steps[k]["steps"] for k in ("prefill", "mixed") if k in steps) <= 3
    # the engine admits two prompts in one step, the third when they finish (the warm-up's
    # prefill would make it three)
    assert (
        sum(
            engine["step_times"][k]["steps"]
            for k in ("prefill", "mixed")
            if k in engine["step_times"]
        )
        == 2
    )
    # --repeats: both sides run the load twice, in pairs (the engine built before the server
    # starts, each served run followed by the engine's); the ratio of each pair and their median
    order: list[str] = []
    run_load, engine_init, engine_run = (
        bench.run_load,
        bench.EngineSide.__init__,
        bench.EngineSide.run,
    )

    async def served(*a):
        order.append("served")
        return await run_load(*a)

    def built(self, a):
        engine_init(self, a)
        order.append("engine built")

    def ran(self):
        order.append("engine")
        engine_run(self)

    monkeypatch.setattr(bench, "launch", lambda args, extra: order.append("launch") or FakeServer())
    monkeypatch.setattr(bench, "run_load", served)
    monkeypatch.setattr(bench.EngineSide, "__init__", built)
    monkeypatch.setattr(bench.EngineSide, "run", ran)
    record = bench.main([*args, "--repeats", "2"])
    assert order == ["engine built", "launch", "served", "engine", "served", "engine"]
    row = record["engine_comparison"]["output_token_throughput"]
    engine_runs, served_runs = record["engine"]["repeats"], record["repeats"]
    assert (
        len(engine_runs) == len(served_runs) == 2 and record["engine"]["total_output_tokens"] == 18
    )
    want = [
        a["output_token_throughput"] / b["output_token_throughput"]
        for a, b in zip(served_runs, engine_runs)
    ]
    assert row["repeat_ratios"] == pytest.approx(want)
    assert row["median_ratio"] == pytest.approx(sum(want) / 2)


def test_speculative_server_matches_and_reports_accept_length(server, client):
    """A second server with NGRAM: the same greedy text as the plain server, and the accept
    length and speculative steps in /server_info and /metrics.
    """
    prompt = "a b c d e f g h a b c d e f g h a b"
    params = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "extra_body": IGNORE_EOS}
    want = client.completions.create(**params, **GREEDY).choices[0].text
    spec = ServerProcess(
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "4",
        "--speculative-policy",
        "always",
    )
    try:
        spec.wait_healthy()
        spec_client = openai.OpenAI(
            base_url=spec.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        assert spec_client.completions.create(**params, **GREEDY).choices[0].text == want
        accept = spec.internal_state()["avg_spec_accept_length"]
        assert accept is not None and accept > 1
        metrics = _scrape(spec)
        assert metrics[f"pcgspec:spec_accept_length[('model_name', '{MODEL}')]"] == accept
        steps = f"pcgspec:spec_decode_steps_total[('kind', '%s'), ('model_name', '{MODEL}')]"
        assert metrics[steps % "speculative"] > 0 and metrics[steps % "plain"] == 0
        # CPU: verify passes have no graphs; the piecewise runner refuses them, counted
        refused = spec.internal_state()["graphs"]["piecewise"]["fallbacks"]["target_verify"]
        labels = sorted(
            [("model_name", MODEL), ("runner", "piecewise"), ("reason", "target_verify")]
        )
        assert refused > 0 and metrics[f"pcgspec:graph_fallbacks_total{labels}"] == refused
    finally:
        spec.close()
