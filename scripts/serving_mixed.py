"""``bench_serving.py --dataset mixed``: does a long prompt stall everyone? C short chat streams
in a closed loop, first alone (the baseline phase), then with long prompts arriving beside them
(the mixed phase); the short streams' inter-token gaps and TTFT in each, and their ratios."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import time
from typing import Any

import aiohttp
from serving_datasets import load
from serving_sweep import CHAT_PATH, Stream, chat_body, open_session, post_stream

LONG_WORDS = (
    "apple river stone cloud paper green quiet seven window garden silver music north winter "
    "candle bridge orange forest letter engine market yellow ocean planet table summer valley "
    "thunder pencil mirror island copper velvet harbor meadow lantern basket marble"
).split()
RATIOS = (("itl", "p99_ms"), ("itl", "max_ms"), ("ttft", "p99_ms"))


def long_prompt(rng: random.Random, words: int) -> str:
    """About ``words`` tokens of shuffled common words, distinct per request (nothing for the
    prefix cache to serve), ending in a question the answer's few tokens can start on."""
    body = " ".join(rng.choice(LONG_WORDS) for _ in range(words))
    return f"{body}\nWhich word above comes first?"


def dist_ms(values: list[float]) -> dict[str, float]:
    """Median, 99th percentile and maximum in milliseconds (empty without values)."""
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def gaps(stream: Stream) -> list[float]:
    """Seconds between consecutive token-bearing chunks of ``stream``."""
    times = [t for t, _ in stream.chunks]
    return [b - a for a, b in zip(times, times[1:])]


def summarize_phase(shorts: list[Stream], longs: list[Stream], seconds: float) -> dict[str, Any]:
    """The short streams' gaps, TTFT and token rate; the long prompts' count and TTFT."""
    ok = [s for s in shorts if s.ok]
    long_ok = [s for s in longs if s.ok]
    return {
        "seconds": seconds,
        "short": {
            "requests": len(ok),
            "failed": len(shorts) - len(ok),
            "output_tok_s": sum(s.output_tokens for s in ok) / seconds,
            "itl": dist_ms([g for s in ok for g in gaps(s)]),
            "ttft": dist_ms([s.first - s.start for s in ok if s.first is not None]),
        },
        "long": {
            "sent": len(longs),
            "completed": len(long_ok),
            "failed": len(longs) - len(long_ok),
            "prompt_tokens_mean": statistics.fmean(s.prompt_tokens for s in long_ok)
            if long_ok
            else None,
            "ttft": dist_ms([s.first - s.start for s in long_ok if s.first is not None]),
        },
        "errors": sorted({s.error for s in [*shorts, *longs] if s.error})[:5],
    }


async def run_phase(
    session: aiohttp.ClientSession, args: argparse.Namespace, model: str, long_rate: float
) -> dict[str, Any]:
    """``--max-concurrency`` short streams, each sending its next chat message as its last
    ends, for ``--mixed-seconds``; with ``long_rate`` > 0 a long prompt every 1 / rate s
    (the first half an interval in) beside them. Streams still open at the end are awaited."""
    url, messages, order = args.base_url + CHAT_PATH, load("chat"), itertools.count()
    rng = random.Random(args.seed + 7)
    start = time.perf_counter()
    end = start + args.mixed_seconds
    shorts: list[Stream] = []

    async def short_worker() -> None:
        while time.perf_counter() < end:
            i = next(order)
            body = chat_body(
                model,
                messages[i % len(messages)],
                args.max_tokens,
                args.temperature,
                args.seed + i,
                args.ignore_eos,
            )
            shorts.append(await post_stream(session, url, body, i))
            if shorts[-1].error:  # NOTE: a refusing server must not be hammered in a tight loop
                await asyncio.sleep(0.05)

    async def long_sender() -> list[Stream]:
        tasks = []
        for k in itertools.count():
            at = start + (k + 0.5) / long_rate
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            body = chat_body(
                model,
                long_prompt(rng, args.long_prompt_tokens),
                args.long_max_tokens,
                args.temperature,
                args.seed + k,
                True,
            )
            tasks.append(asyncio.create_task(post_stream(session, url, body, k)))
        return list(await asyncio.gather(*tasks))

    workers = [asyncio.create_task(short_worker()) for _ in range(args.max_concurrency)]
    longs = await long_sender() if long_rate > 0 else []
    await asyncio.gather(*workers)
    return summarize_phase(shorts, longs, time.perf_counter() - start)


def ratios(baseline: dict[str, Any], mixed: dict[str, Any]) -> dict[str, float | None]:
    """Mixed over baseline of the short streams' ITL p99 and max and TTFT p99."""
    out: dict[str, float | None] = {}
    for metric, stat in RATIOS:
        a, b = (p["short"][metric].get(stat) for p in (mixed, baseline))
        out[f"{metric}_{stat.removesuffix('_ms')}"] = a / b if a and b else None
    return out


async def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    """A warm-up (one short and one long request), the baseline phase, then the mixed one."""
    async with open_session(args.api_key) as session:
        async with session.get(args.base_url + "/v1/models") as resp:
            model = args.model or (await resp.json())["data"][0]["id"]
        url, rng = args.base_url + CHAT_PATH, random.Random(args.seed + 3)
        for message, max_tokens in (
            (load("chat")[0], args.max_tokens),
            (long_prompt(rng, args.long_prompt_tokens), args.long_max_tokens),
        ):
            await post_stream(session, url, chat_body(model, message, max_tokens, 0.0, 0, True))
        baseline = await run_phase(session, args, model, 0.0)
        mixed = await run_phase(session, args, model, args.long_rate)
    return {
        "model": model,
        "mixed": {
            "concurrency": args.max_concurrency,
            "long_prompt_tokens": args.long_prompt_tokens,
            "long_rate": args.long_rate,
            "long_max_tokens": args.long_max_tokens,
            "points": {"baseline": baseline, "mixed": mixed},
            "ratios": ratios(baseline, mixed),
        },
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_mixed(report: dict[str, Any]) -> None:
    head = (
        f"{'point':<10}{'ITL p50':>9}{'ITL p99':>9}{'ITL max':>9}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'short':>7}{'long':>6}{'long TTFT p50':>15}"
    )
    print(f"{' Short streams beside long prompts (ms) ':=^{len(head)}}\n{head}")
    for name, p in report["points"].items():
        short, long = p["short"], p["long"]
        itl, ttft = short["itl"], short["ttft"]
        print(
            f"{name:<10}{_fmt(itl.get('p50_ms')):>9}{_fmt(itl.get('p99_ms')):>9}"
            f"{_fmt(itl.get('max_ms')):>9}{_fmt(ttft.get('p50_ms')):>10}"
            f"{_fmt(ttft.get('p99_ms')):>10}{short['requests']:>7}{long['sent']:>6}"
            f"{_fmt(long['ttft'].get('p50_ms')):>15}"
        )
    print("mixed / baseline: " + ", ".join(f"{k} {_fmt(v)}" for k, v in report["ratios"].items()))
    print("=" * len(head))
