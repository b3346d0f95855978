"""The client side of ``bench_serving.py``'s closed-loop sweep: one streaming request with the
arrival time of each chunk, one load point (exactly C requests in flight, a warm-up, then a
timed window, with the server's counters read at both ends) and the greedy text check."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Stream:
    """One streamed request: times are ``time.perf_counter`` values."""

    index: int  # its dataset index
    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, characters)
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served by the prefix cache
    output_tokens: int = 0  # usage.completion_tokens
    finish_reason: str | None = None
    end: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens > 0

    @property
    def first(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None


def open_session(api_key: str | None) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return aiohttp.ClientSession(
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=None),
        connector=aiohttp.TCPConnector(limit=0),
    )


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def post_stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], index: int = 0
) -> Stream:
    """Send ``body`` (with ``stream`` on) and read its server-sent events to the end."""
    res = Stream(index, time.perf_counter())
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk, now = json.loads(line[6:]), time.perf_counter()
                if usage := chunk.get("usage"):
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
                for choice in chunk.get("choices", []):
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
                text = "".join(_chunk_text(c) for c in chunk.get("choices", []))
                if text:
                    res.text += text
                    res.chunks.append((now, len(text)))
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = repr(e)
    res.end = time.perf_counter()
    return res


def chat_body(
    model: str, message: str, max_tokens: int, temperature: float, seed: int, ignore_eos: bool
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True)
class Load:
    """What every request of a point shares."""

    base_url: str
    model: str
    messages: list[str]
    max_tokens: int
    seed: int  # request i of the dataset sends seed + i
    ignore_eos: bool = False

    def body(self, index: int, temperature: float) -> dict[str, Any]:
        return chat_body(
            self.model,
            self.messages[index],
            self.max_tokens,
            temperature,
            self.seed + index,
            self.ignore_eos,
        )


async def text_check(session: aiohttp.ClientSession, load: Load, n: int) -> list[str]:
    """The greedy texts of the first ``n`` messages, one request at a time."""
    url, texts = load.base_url + CHAT_PATH, []
    for index in range(min(n, len(load.messages))):
        res = await post_stream(session, url, load.body(index, 0.0), index)
        texts.append(res.text if not res.error else f"<error: {res.error}>")
    return texts


async def run_point(
    session: aiohttp.ClientSession,
    load: Load,
    concurrency: int,
    temperature: float,
    warmup_s: float,
    duration_s: float,
) -> dict[str, Any]:
    """``concurrency`` workers, each sending its next request (dataset order, cycling) as its
    last one ends, until the window closes; the window's summary once the last ones end."""
    url, order, streams = load.base_url + CHAT_PATH, itertools.count(), []
    start = time.perf_counter()
    window = (start + warmup_s, start + warmup_s + duration_s)

    async def worker() -> None:
        while time.perf_counter() < window[1]:
            index = next(order) % len(load.messages)
            res = await post_stream(session, url, load.body(index, temperature), index)
            streams.append(res)
            if res.error:  # NOTE: a refusing server must not be hammered in a tight loop
                await asyncio.sleep(0.05)

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, window[0] - time.perf_counter()))
    before, cpu = await read_counters(session, load.base_url), time.process_time()
    await asyncio.sleep(max(0.0, window[1] - time.perf_counter()))
    after, cpu = await read_counters(session, load.base_url), time.process_time() - cpu
    await asyncio.gather(*workers)
    # NOTE: a client near 1.0 reads its streams late: the server may be faster than it shows
    return {
        **summarize_window(streams, window, before, after),
        "client_cpu_busy": cpu / (after["time"] - before["time"]),
    }


async def _get(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url) as resp:
        return await resp.text() if resp.status == 200 else ""


async def read_counters(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """The server's step counters now: the speculative ones of ``/server_info`` (none without
    speculation), its engine steps and the tokens it generated (``/metrics``)."""
    out: dict[str, Any] = {"time": time.perf_counter()}
    text = await _get(session, base_url + "/server_info")
    state = json.loads(text)["internal_states"][0] if text else {}
    spec = state.get("speculative") or {}
    for key, value in spec.items():
        if key == "accepted_per_position" or (
            isinstance(value, int) and not isinstance(value, bool)
        ):
            out[key] = value
    if spec:  # what the policy prices steps at now (not a counter)
        out["policy"] = spec.get("step_costs_ms")
    out["num_steps"] = state.get("num_steps", 0)
    for kind, times in (state.get("step_times") or {}).items():  # where the engine's time goes
        out[f"steps_{kind}"] = times["steps"]
        out[f"step_s_{kind}"] = times["seconds"]
    for line in (await _get(session, base_url + "/metrics")).splitlines():
        if line.startswith("pcgspec:generation_tokens_total"):
            out["generation_tokens"] = float(line.rpartition(" ")[2])
    return out


def _dist_ms(values: list[float]) -> dict[str, float]:
    """Mean, median and 99th percentile in milliseconds (empty without values)."""
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "p50_ms": statistics.median(values) * 1e3,
        "p99_ms": p99 * 1e3,
    }


def tokens_in_window(stream: Stream, window: tuple[float, float]) -> float:
    """The output tokens of ``stream`` whose chunks arrived inside ``window``: its tokens
    shared out over its chunks by their characters (exact for a stream wholly inside)."""
    total = sum(n for _, n in stream.chunks)
    if not stream.ok or not total:
        return 0.0
    inside = sum(n for t, n in stream.chunks if window[0] <= t < window[1])
    return stream.output_tokens * inside / total


def summarize_window(
    streams: list[Stream],
    window: tuple[float, float],
    before: dict[str, Any],
    after: dict[str, Any],
) -> dict[str, Any]:
    """Output tokens whose chunks arrived in the window; latency and lengths of the requests
    that completed in it; the server's counters over it."""
    span = window[1] - window[0]
    tokens = sum(tokens_in_window(s, window) for s in streams)
    done = [s for s in streams if s.ok and window[0] <= s.end < window[1]]
    tpots = [
        (s.chunks[-1][0] - s.chunks[0][0]) / (s.output_tokens - 1)
        for s in done
        if s.output_tokens > 1 and s.chunks
    ]
    lengths = [s.output_tokens for s in done]
    return {
        "window_s": span,
        "output_tokens": tokens,
        "output_tok_s": tokens / span,
        "requests_completed": len(done),
        "requests_started": sum(window[0] <= s.start < window[1] for s in streams),
        "requests_failed": sum(bool(s.error) for s in streams),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "tpot": _dist_ms(tpots),
        "ttft": _dist_ms([s.first - s.start for s in done if s.first is not None]),
        "output_len": {
            "mean": statistics.fmean(lengths),
            "p50": statistics.median(lengths),
            "min": min(lengths),
            "max": max(lengths),
        }
        if lengths
        else {},
        "finished_by_length": sum(s.finish_reason == "length" for s in done),
        "server": server_window(before, after),
    }


def server_window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The differences of the server's counters over the window, the accept length from them
    (accepted drafts + 1 per verify step), each draft position's acceptance rate, the share
    of decode steps the speculative policy ran plain (None without speculation) and the shares
    of the window in each kind of step and outside them."""
    delta = {
        k: v - before.get(k, 0)
        for k, v in after.items()
        if k not in ("time", "accepted_per_position", "policy")
    }
    verify = delta.get("verify_steps", 0)
    accepted = [
        a - b
        for a, b in itertools.zip_longest(
            after.get("accepted_per_position", []),
            before.get("accepted_per_position", []),
            fillvalue=0,
        )
    ]
    steps = delta.get("speculative_steps", 0) + delta.get("policy_plain_steps", 0)
    span = after["time"] - before["time"]
    shares = {
        key.removeprefix("step_s_"): value / span
        for key, value in delta.items()
        if key.startswith("step_s_")
    }
    return {
        "counters": delta,
        "accept_length": (delta["accepted_draft_tokens"] + verify) / verify if verify else None,
        "accept_rate_per_position": [n / verify for n in accepted] if verify else None,
        "plain_step_share": delta["policy_plain_steps"] / steps if steps else None,
        "output_tok_s": delta["generation_tokens"] / span if "generation_tokens" in delta else None,
        "policy": after.get("policy"),  # its step prices at the window's end
        # the share of the window the engine spent in each kind of step, and outside any (idle
        # between requests, applying commands, publishing deltas): per-request work that
        # speculation does not shorten
        "step_time_share": shares,
        "outside_steps_share": 1.0 - sum(shares.values()) if shares else None,
    }
