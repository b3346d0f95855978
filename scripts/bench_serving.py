"""Load-test an OpenAI-compatible server, like ``vllm bench serve``.

Sends ``--num-prompts`` streaming requests at ``--request-rate`` (Poisson arrivals; ``inf``
sends all at once), at most ``--max-concurrency`` at a time, and reports TTFT, TPOT (per output
token after the first), ITL (between two token-bearing chunks), end-to-end latency (mean,
p50/p90/p99), request and token throughput, the speculative accept length over the run
(from ``/server_info``) and the server's own TTFT with its parts (from ``/metrics``: mean ms of
the hand-off to the engine, the engine's queue and prefill, and the first token's way back to
the server's event loop). Prompts: ``random`` token ids of ``--random-input-len`` (completions
only; exact lengths), the text datasets of ``serving_datasets.py`` (``builtin``, ``chat``,
``repetition``), or a file (one prompt per line, or JSONL with a "prompt" field). ``--launch``
starts ``pcgspec serve`` first (and stops it after). ``--max-tokens`` (alias
``--random-output-len``) caps each request's output.

Prefix-cache datasets (completions): ``shared-prefix`` sends ``--num-prompts`` requests of one
random system prompt of ``--shared-prefix-len`` token ids plus a distinct question of
``--question-len`` ids; ``multi-turn`` runs ``--num-chats`` chats of ``--num-turns`` turns, each
turn resending the whole history (earlier questions and the server's answers, as text) plus a
new question of ``--question-len`` words, at most ``--max-concurrency`` chats at a time. The
report adds the prompt tokens the cache served (``usage.prompt_tokens_details.cached_tokens``)
and the prefill tokens computed. With ``--launch`` the run repeats per ``--cache-modes``
(default: with the radix cache, then with ``--disable-radix-cache``) and prints both and
their ratios. ``--repeats N`` runs the load N times on one server, flushing the prefix cache
between runs (each finds it as the first did); the report pools them (TTFT percentiles over
every request, throughput over the whole time) and lists each run's TTFT p50 and requests/s.

Head-of-line blocking (chat endpoint, single run): ``mixed`` runs ``--max-concurrency`` short
streams (default 4) of ``chat`` messages in a closed loop (each sends its next request as its
last ends) for ``--mixed-seconds`` (default 20) alone, the baseline point, then again with long
prompts beside them, the mixed point: one every 1 / ``--long-rate`` s (default 1 per second),
each about ``--long-prompt-tokens`` tokens of shuffled words (default 8000; distinct, so the
prefix cache serves none of it) asking for ``--long-max-tokens`` tokens (default 4). Per point,
for the short streams only: ITL (between consecutive token-bearing chunks of a stream) p50, p99
and max (the longest gap of any short stream), TTFT p50 and p99 and their tokens/s; for the long
prompts: how many were sent and completed and their TTFT. Then mixed / baseline of the short
streams' ITL p99, ITL max and TTFT p99. A warm-up of one short and one long request comes first.
Requests whose phase ended are awaited, not cut, so a phase may run past its seconds.

``--compare-engine`` (with ``--launch``) also runs the same prompts with the same sampling
through ``LLM.generate`` in this process, with the server's engine flags (``--server-args``;
with ``--max-concurrency`` the engine runs at most that many requests at once), and prints the
served throughput against the engine's own and each side's steps by kind. The engine is built
before the server starts and both stay up (on CUDA the engine takes at most
``ENGINE_SIDE_MEM_FRACTION`` of the device, the server's share is counted after it), so each
served run is followed at once by the engine's run of the same load. With ``--repeats N`` both
sides run the load N times, in pairs, and the ratio of each pair is printed with their median:
one run's noise is of the order of the differences sought, and a pair seconds apart shares the
host's speed of the moment.

``--random-weights SHAPE`` (with ``--launch``) serves random weights of a named shape
(``pcgspec.models.random_weights.SHAPES``) with the default model's tokenizer and its
vocabulary, written once to ``--random-weights-dir`` and reused.

Closed-loop sweep (served speculative decoding): any of ``--compare``, ``--datasets``,
``--concurrencies``, ``--temperatures``, ``--duration``, ``--warmup-seconds``, ``--text-check``,
``--rounds`` runs it. ``--compare NAME=ARGS ...`` (with ``--launch``) names configurations; each
in turn gets its own ``pcgspec serve`` (``--server-args`` plus ARGS), runs everything below,
and is stopped; without ``--compare`` the one configuration is the server as launched or found.
Datasets (``--datasets``, default ``chat``) go through ``/v1/chat/completions`` as one user
message (the server applies the chat template): ``chat`` (everyday requests) and
``repetition`` (answers that quote or edit a given text or code); a spec such as
``repetition:concurrencies=1:temperatures=0:configs=plain,ngram`` narrows a dataset's points
and configurations. Per dataset and configuration: first the greedy text check
(``--text-check N``, default 16: the first N requests one at a time at temperature 0, outside
any window; each text compared with the first configuration's: how many
differ and where they begin to, reported, never failed), then each load point of
``--temperatures`` (default 0,0.7) x ``--concurrencies`` (default 1,4,16,64): exactly C
requests in flight (dataset order, cycling, request i seeded ``--seed`` + i so sampled runs
repeat), ``--warmup-seconds`` of load (default 5), then a window of ``--duration`` seconds
(default 30). Counted in the window: the output tokens whose chunks arrived in it (a request's
tokens shared over its chunks by their characters), and the requests that completed in it for
TPOT (p50/p99), TTFT (p50) and output lengths; ``--max-tokens`` defaults to 128 and EOS ends a
request (``--ignore-eos`` off). The server's counters read at the window's two ends give its
own token rate, its accept length (accepted drafts + 1 per verify step), the acceptance per
draft position and the share of decode steps the speculative policy ran plain; the client's
CPU share of the window flags a point it may have bound (printed above 0.8). Each point's
output tok/s is divided by the first configuration's at the same point. ``--rounds N``: the
configurations take turns N times, each turn a server of its own (two servers of one
configuration on one machine have served 20-30% apart), each ratio within its round, and a
second table gives each point's median ratio over the rounds with its range (the JSON's
``summary``). The JSON holds every point and text; a table closes the run;
``scripts/plot_serving.py RESULT.json`` draws the ratios; ``scripts/gpu_served_spec.sh`` runs
plain / EAGLE3 / NGRAM on a GPU in one call.

    python scripts/bench_serving.py --launch --server-args "--dtype float32" \\
        --num-prompts 32 --max-concurrency 8 --random-input-len 64 --random-output-len 32
    python scripts/bench_serving.py --launch --dataset shared-prefix --shared-prefix-len 2000 \\
        --question-len 32 --num-prompts 64 --random-output-len 32 --max-concurrency 16
    python scripts/bench_serving.py --launch --dataset multi-turn --num-chats 16 --num-turns 8
    python scripts/bench_serving.py --launch --dataset mixed --max-concurrency 8 \\
        --long-prompt-tokens 8000 --long-rate 1 --mixed-seconds 30 --max-tokens 256
    python scripts/bench_serving.py --launch --server-args "--dtype bfloat16" \\
        --compare "plain=" "eagle3=--speculative-algorithm EAGLE3" \\
                  "tree=--speculative-algorithm EAGLE3 --speculative-num-steps 3 \\
                  --speculative-eagle-topk 4 --speculative-num-draft-tokens 8" \\
                  "ngram=--speculative-algorithm NGRAM --speculative-num-steps 4" \\
        --datasets chat "repetition:concurrencies=1:configs=plain,ngram" --temperatures 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_compare  # noqa: E402
import serving_datasets  # noqa: E402
import serving_mixed  # noqa: E402
from serving_sweep import open_session, post_stream  # noqa: E402


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served by the prefix cache
    output_tokens: int = 0
    text: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


WORDS = (
    "apple river stone cloud paper green quiet seven window garden silver music north "
    "winter candle bridge orange forest letter engine market yellow ocean planet"
).split()


def load_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    rng = random.Random(args.seed)
    if args.dataset == "shared-prefix":
        lo, hi = args.random_token_range
        prefix = [rng.randrange(lo, hi) for _ in range(args.shared_prefix_len)]
        return [
            prefix + [rng.randrange(lo, hi) for _ in range(args.question_len)]
            for _ in range(args.num_prompts)
        ]
    if args.dataset == "random":
        lo, hi = args.random_token_range
        return [
            [rng.randrange(lo, hi) for _ in range(args.random_input_len)]
            for _ in range(args.num_prompts)
        ]
    if args.dataset in serving_datasets.DATASETS:
        pool = serving_datasets.load(args.dataset)
    else:
        lines = [ln for ln in Path(args.dataset).read_text().splitlines() if ln.strip()]
        pool = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    return [pool[i % len(pool)] for i in range(args.num_prompts)]


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    stream = await post_stream(session, url, body)
    if stream.error:
        return Result(ok=False, error=stream.error)
    times = [t for t, _ in stream.chunks]
    return Result(
        ok=stream.ok,
        prompt_tokens=stream.prompt_tokens,
        cached_tokens=stream.cached_tokens,
        output_tokens=stream.output_tokens,
        text=stream.text,
        ttft=times[0] - stream.start if times else 0.0,
        e2e=stream.end - stream.start,
        itls=[b - a for a, b in zip(times, times[1:])],
    )


def _warmup_prompt(args: argparse.Namespace, prompts: list[str | list[int]]) -> str | list[int]:
    """The first prompt; for the prefix-cache datasets one that shares nothing with them."""
    if args.dataset == "multi-turn":
        return "Warm up: " + " ".join(WORDS)
    if args.dataset == "shared-prefix":
        rng, (lo, hi) = random.Random(args.seed + 2), args.random_token_range
        return [rng.randrange(lo, hi) for _ in range(len(prompts[0]))]
    return prompts[0]


def _load_path(args: argparse.Namespace) -> str:
    """The endpoint the load's requests go to (multi-turn chats send their history as text)."""
    if args.endpoint == "chat" and args.dataset != "multi-turn":
        return "/v1/chat/completions"
    return "/v1/completions"


async def warm_up(args: argparse.Namespace, model: str, prompts: list[str | list[int]]) -> None:
    """``--warmup`` requests one at a time (``_warmup_prompt`` of the load's ``prompts``),
    before the counters of the measured load are read."""
    url = args.base_url + _load_path(args)
    async with open_session(args.api_key) as s:
        for _ in range(args.warmup):
            await one_request(s, url, request_body(args, model, _warmup_prompt(args, prompts)))


async def run_load(
    args: argparse.Namespace, model: str, prompts: list[str | list[int]]
) -> tuple[list[Result], float]:
    url = args.base_url + _load_path(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed + 1)
    async with open_session(args.api_key) as s:

        async def limited(prompt: str | list[int]) -> Result:
            async with limit:
                return await one_request(s, url, request_body(args, model, prompt))

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def run_chats(args: argparse.Namespace, model: str) -> tuple[list[Result], float]:
    """``--num-chats`` chats of ``--num-turns`` turns; each turn resends the history (questions
    and the server's answers as text) plus a new question. Results of every turn."""
    url = args.base_url + "/v1/completions"
    rng = random.Random(args.seed)
    chats = [
        [
            f"Question {c}.{t}: "
            + " ".join(rng.choice(WORDS) for _ in range(args.question_len))
            + "?"
            for t in range(args.num_turns)
        ]
        for c in range(args.num_chats)
    ]
    limit = asyncio.Semaphore(args.max_concurrency or len(chats))
    async with open_session(args.api_key) as s:

        async def chat(questions: list[str]) -> list[Result]:
            history, results = "", []
            async with limit:
                for question in questions:
                    history += f"User: {question}\nAssistant:"
                    results.append(await one_request(s, url, request_body(args, model, history)))
                    history += results[-1].text + "\n"
            return results

        start = time.perf_counter()
        done = await asyncio.gather(*(chat(q) for q in chats))
        return [r for results in done for r in results], time.perf_counter() - start


def _dist(values: list[float]) -> dict[str, float]:
    """Mean and percentiles in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "mean_ms": statistics.fmean(values) * 1e3,
        "p50_ms": statistics.median(values) * 1e3,
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
    }


def summarize(results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "total_cached_tokens": cached,
        "prefill_tokens_computed": in_tokens - cached,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": _dist([r.ttft for r in ok]),
        "tpot": _dist(tpots),
        "itl": _dist([x for r in ok for x in r.itls]),
        "e2e": _dist([r.e2e for r in ok]),
    }


def _get_json(base_url: str, path: str, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(base_url + path, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def server_step_times(base_url: str, api_key: str | None = None) -> dict[str, dict[str, float]]:
    """The engine's steps so far, per kind (``Engine.step_stats`` through /server_info); empty
    without it."""
    try:
        return _get_json(base_url, "/server_info", api_key)["internal_states"][0]["step_times"]
    except (OSError, KeyError, IndexError, ValueError):
        return {}


def step_times_between(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per kind of step that ran between two ``step_stats`` readings: how many, and their mean
    time in ``Engine.step`` (ms)."""
    if not before:  # NOTE: the first reading failed: the steps would count the warm-up's too
        return {}
    out = {}
    for kind, now in after.items():
        was = before.get(kind, {"steps": 0, "seconds": 0.0})
        steps = now["steps"] - was["steps"]
        if steps > 0:
            out[kind] = {"steps": steps, "ms_mean": 1e3 * (now["seconds"] - was["seconds"]) / steps}
    return out


def spec_counters(base_url: str, api_key: str | None = None) -> tuple[int, int]:
    """(verify steps, accepted drafts) so far; zeros without speculation or /server_info."""
    try:
        info = _get_json(base_url, "/server_info", api_key)
        spec = info["internal_states"][0]["speculative"]
    except (OSError, KeyError, IndexError, ValueError):
        return 0, 0
    return spec.get("verify_steps", 0), spec.get("accepted_draft_tokens", 0)


# The server's measure of TTFT and its parts, in order (their sum is the first).
SERVER_TIMES = {
    "server_ttft_ms_mean": "time_to_first_token_seconds",  # HTTP arrival to the token's return
    "dispatch_ms_mean": "request_dispatch_time_seconds",  # hand-off to the engine's arrival
    "engine_queue_ms_mean": "request_queue_time_seconds",
    "engine_prefill_ms_mean": "request_prefill_time_seconds",
    "return_ms_mean": "request_return_time_seconds",  # token read back to the event loop
}


def server_histograms(base_url: str) -> dict[str, float]:
    """The ``_sum`` and ``_count`` of the server's TTFT histograms (``/metrics``); empty when
    the server has none."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        name = line.partition("{")[0]
        metric = name.removeprefix("pcgspec:").removesuffix("_sum").removesuffix("_count")
        if metric in SERVER_TIMES.values():
            out[name] = float(line.rpartition(" ")[2])
    return out


def server_times(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean ms per sequence of this run of the server's TTFT and its parts: the hand-off to the
    engine (dispatch), its arrival there to its first prefill step (queue), that step to its
    first token read back (prefill), and the token's way back to the event loop (return). The
    rest of the server's TTFT is its work before the hand-off; of the client's, the response's
    way out."""
    out: dict[str, float | None] = {}
    for key, metric in SERVER_TIMES.items():
        total, count = (f"pcgspec:{metric}_sum", f"pcgspec:{metric}_count")
        n = after.get(count, 0.0) - before.get(count, 0.0)
        out[key] = 1e3 * (after[total] - before.get(total, 0.0)) / n if n else None
    return out


def _post(base_url: str, path: str, api_key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(base_url + path, data=b"", headers=headers, method="POST")
    with urllib.request.urlopen(req, timeout=60):
        pass


def _repeat_row(summary: dict[str, Any]) -> dict[str, float]:
    """What a repeat's line in the JSON keeps: its spread shows the run-to-run noise."""
    return {
        "ttft_p50_ms": summary["ttft"].get("p50_ms"),
        "duration_s": summary["duration_s"],
        "request_throughput": summary["request_throughput"],
        "output_token_throughput": summary["output_token_throughput"],
        "cached_tokens": summary["total_cached_tokens"],
    }


def print_report(summary: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    for key in (
        "successful_requests",
        "failed_requests",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "total_cached_tokens",
        "prefill_tokens_computed",
        "request_throughput",
        "output_token_throughput",
        "total_token_throughput",
        "avg_spec_accept_length",
        "client_cpu_busy",
        *SERVER_TIMES,
    ):
        value = summary.get(key)
        print(f"{key:<44}{value:>16.2f}" if isinstance(value, float) else f"{key:<44}{value!s:>16}")
    for i, row in enumerate(summary.get("repeats", [])):
        print(
            f"repeat {i}: TTFT p50 {row['ttft_p50_ms']:.2f} ms, "
            f"{row['request_throughput']:.2f} requests/s"
        )
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{' ' + name.upper() + ' ':-^60}")
        for stat, value in summary[name].items():
            print(f"{name} {stat:<39}{value:>16.2f}")
    print("=" * 60)


def launch(args: argparse.Namespace, extra: list[str] | None = None) -> subprocess.Popen:
    port = args.base_url.rsplit(":", 1)[-1].split("/")[0]
    cmd = [
        sys.executable,
        "-m",
        "pcgspec",
        "serve",
        "--port",
        port,
        *shlex.split(args.server_args),
        *(extra or []),
    ]
    if args.random_weights:
        cmd += ["--model-path", str(random_weights_dir(args))]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = open(args.server_log, "ab") if args.server_log else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    finally:
        if args.server_log:
            log.close()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _get_json(args.base_url, "/health")
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up (log: {args.server_log}): {shlex.join(cmd)}")


def random_weights_dir(args: argparse.Namespace) -> Path:
    """The folder of ``--random-weights``, written on first use (into a temporary sibling
    renamed when complete, so an interrupted write is never reused)."""
    from pcgspec import envs

    folder = Path(
        args.random_weights_dir or envs.cache_dir() / "models" / f"random-{args.random_weights}"
    )
    if not (folder / "config.json").is_file():
        from pcgspec.models.default_model import default_model_path
        from pcgspec.models.draft_checkpoint import write_random_checkpoint

        partial = folder.with_name(folder.name + ".partial")
        write_random_checkpoint(args.random_weights, partial, default_model_path())
        partial.rename(folder)
    return folder


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--dataset",
        default="random",
        help="random | builtin | chat | repetition | shared-prefix | multi-turn | mixed | "
        "a prompt file",
    )
    _mixed_args(p)
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=2000,
        help="shared-prefix: token ids of the system prompt all requests share",
    )
    p.add_argument(
        "--question-len",
        type=int,
        default=32,
        help="shared-prefix: token ids per question; multi-turn: words per question",
    )
    p.add_argument("--num-chats", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--num-turns", type=int, default=8, help="multi-turn: turns per chat")
    p.add_argument(
        "--cache-modes",
        default="on,off",
        help="with --launch: run once per mode, on = radix cache, off = "
        "--disable-radix-cache (the default dataset runs once, as launched)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument(
        "--max-tokens",
        "--random-output-len",
        dest="max_tokens",
        type=int,
        default=None,
        help="max_tokens per request (default: 32; sweep: 128)",
    )
    p.add_argument("--random-token-range", type=int, nargs=2, default=(1000, 20000))
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="default: on; off in the sweep (answers of their own length)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="requests sent one at a time before the measured load (default: 1)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per server (cache flushed between them); reported pooled",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launch", action="store_true", help="start `pcgspec serve` first")
    p.add_argument("--server-args", default="", help="flags for the launched server")
    p.add_argument(
        "--server-log",
        default=None,
        help="with --launch: append the server's output here (default: discarded)",
    )
    p.add_argument(
        "--random-weights",
        metavar="SHAPE",
        default=None,
        help="with --launch: serve random weights of this shape (see the top)",
    )
    p.add_argument(
        "--random-weights-dir",
        default=None,
        help="its folder (default: $PCGSPEC_CACHE_DIR/models/random-SHAPE)",
    )
    p.add_argument(
        "--compare-engine",
        action="store_true",
        help="with --launch: also run the prompts through LLM.generate with the "
        "server's engine flags, after the server stopped, and compare",
    )
    _sweep_args(p)
    p.add_argument(
        "--device-label",
        default=None,
        help="what the JSON calls the device when nvidia-smi names none",
    )
    p.add_argument("--out", default=None, help="write the JSON summary here")
    args = p.parse_args(argv)
    args.sweep = any(getattr(args, k) is not None for k in SWEEP_DEFAULTS)
    if args.sweep:
        _check_sweep(p, args)
    if args.max_tokens is None:
        args.max_tokens = 128 if args.sweep else 32
    args.ignore_eos = (not args.sweep) if args.ignore_eos is None else args.ignore_eos
    if args.dataset == "mixed":
        _check_mixed(p, args)
    if args.dataset in ("random", "shared-prefix", "multi-turn") and args.endpoint == "chat":
        p.error(f"--dataset {args.dataset} uses the completions endpoint")
    if args.random_weights and not args.launch:
        p.error("--random-weights needs --launch")
    if args.compare_engine and (
        not args.launch or args.endpoint != "completions" or args.dataset == "multi-turn"
    ):
        p.error(
            "--compare-engine needs --launch, the completions endpoint and a dataset "
            "of single prompts"
        )
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.cache_modes = [m.strip() for m in args.cache_modes.split(",")]
    if not set(args.cache_modes) <= {"on", "off"} or not args.cache_modes:
        p.error(f"--cache-modes takes on and/or off, got {args.cache_modes}")
    return args


def _mixed_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("mixed: short streams beside long prompts (see the top)")
    m.add_argument("--long-prompt-tokens", type=int, default=8000, help="words per long prompt")
    m.add_argument("--long-rate", type=float, default=1.0, help="long prompts per second")
    m.add_argument("--long-max-tokens", type=int, default=4, help="max_tokens of a long prompt")
    m.add_argument("--mixed-seconds", type=float, default=20.0, help="seconds per point")


def _check_mixed(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.sweep or args.repeats > 1 or args.compare_engine:
        p.error("--dataset mixed is a single run: no sweep options, --repeats or --compare-engine")
    args.max_concurrency = args.max_concurrency or 4
    for name in ("long_prompt_tokens", "long_max_tokens", "max_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("long_rate", "mixed_seconds"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")


# The closed-loop sweep's options: any of them given runs it; these are their defaults.
SWEEP_DEFAULTS = {
    "compare": None,
    "datasets": ["chat"],
    "concurrencies": "1,4,16,64",
    "temperatures": "0,0.7",
    "duration": 30.0,
    "warmup_seconds": 5.0,
    "text_check": 16,
    "rounds": 1,
}


def _sweep_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("closed-loop sweep (see the top)")
    s.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=ARGS",
        help="with --launch: configurations, each its own server of --server-args "
        "plus ARGS; ratios against the first",
    )
    s.add_argument(
        "--datasets",
        nargs="+",
        metavar="SPEC",
        help="NAME[:concurrencies=..][:temperatures=..][:configs=a,b] each; NAME "
        f"one of {', '.join(serving_datasets.DATASETS)} (default: chat)",
    )
    s.add_argument("--concurrencies", help="requests in flight per point (default: 1,4,16,64)")
    s.add_argument("--temperatures", help="default: 0,0.7")
    s.add_argument("--duration", type=float, help="seconds of each point's window (default: 30)")
    s.add_argument(
        "--warmup-seconds", type=float, help="seconds of load before each window (default: 5)"
    )
    s.add_argument(
        "--text-check",
        type=int,
        metavar="N",
        help="greedy texts of the first N requests per dataset, one at a time, "
        "compared with the first configuration's (default: 16; 0: none)",
    )
    s.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="the configurations take turns N times, each turn its own server; ratios "
        "within a round, and their median over the rounds (default: 1)",
    )


def _check_sweep(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the sweep's defaults and parse its configurations and datasets."""
    for key, default in SWEEP_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if args.compare and not args.launch:
        p.error("--compare needs --launch (each configuration is its own server)")
    if args.compare_engine or args.repeats > 1:
        p.error("--compare-engine and --repeats belong to the single run, not the sweep")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.duration <= 0 or args.warmup_seconds < 0 or args.text_check < 0:
        p.error(
            f"--duration must be > 0, --warmup-seconds and --text-check >= 0; got "
            f"{args.duration}, {args.warmup_seconds}, {args.text_check}"
        )
    try:
        args.configs = serving_compare.parse_configs(args.compare)
        args.plans = serving_compare.parse_plans(
            args.datasets, args.concurrencies, args.temperatures, args.configs
        )
    except ValueError as e:
        p.error(str(e))


CACHE_DATASETS = ("shared-prefix", "multi-turn")
COMPARED = ("ttft_p50_ms", "request_throughput", "prefill_tokens_computed", "duration_s")


def run_once(
    args: argparse.Namespace,
    extra_server_args: list[str],
    after_each: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One load run (launching the server first with --launch), ``after_each`` called after
    every repeat (the engine's run of the same load); the summary."""
    server = launch(args, extra_server_args) if args.launch else None
    try:
        model = args.model or _get_json(args.base_url, "/v1/models", args.api_key)["data"][0]["id"]
        prompts = [] if args.dataset == "multi-turn" else load_prompts(args)
        if args.warmup:
            asyncio.run(warm_up(args, model, prompts))
            # NOTE: every repeat finds the cache as the first does: holding none of its prompts
            _post(args.base_url, "/flush_cache", args.api_key)
        steps0, accepted0 = spec_counters(args.base_url, args.api_key)
        histograms = server_histograms(args.base_url)
        step_times0 = server_step_times(args.base_url, args.api_key)
        wall = cpu = 0.0  # NOTE: of the served repeats only, not of ``after_each``
        repeats = []
        for i in range(args.repeats):
            if i:
                _post(args.base_url, "/flush_cache", args.api_key)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            if args.dataset == "multi-turn":
                repeats.append(asyncio.run(run_chats(args, model)))
            else:
                repeats.append(asyncio.run(run_load(args, model, prompts)))
            wall, cpu = wall + time.perf_counter() - wall0, cpu + time.process_time() - cpu0
            if after_each is not None:
                after_each()
        # NOTE: a client near 1.0 delays its own sends and reads: its TTFT is not the server's.
        client_busy = cpu / wall
        counters = spec_counters(args.base_url, args.api_key)
        steps, accepted = (a - b for a, b in zip(counters, (steps0, accepted0)))
        times = server_times(histograms, server_histograms(args.base_url))
        step_times = step_times_between(step_times0, server_step_times(args.base_url, args.api_key))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    summary = summarize(
        [r for results, _ in repeats for r in results], sum(duration for _, duration in repeats)
    )
    if args.repeats > 1:
        summary["repeats"] = [_repeat_row(summarize(*run)) for run in repeats]
    summary["model"] = model
    summary["avg_spec_accept_length"] = (accepted + steps) / steps if steps else None
    summary.update(times)
    summary["step_times"] = step_times
    summary["client_cpu_busy"] = client_busy
    summary["medians_ms"] = {k: summary[k].get("p50_ms") for k in ("ttft", "tpot", "itl", "e2e")}
    print_report(summary)
    return summary


ENGINE_SIDE_MEM_FRACTION = 0.4  # CUDA: the in-process engine's share, taken before the server's


class EngineSide:
    """The load's prompts through ``LLM.generate`` in this process, with the launched server's
    engine flags and the requests' sampling: the engine's own throughput (``--compare-engine``).
    Built and warmed before the server starts; ``run`` runs the load once, ``record`` sums the
    runs. At 16 streams the KV pool of either side holds every request many times over, so the
    engine's smaller share of the device changes none of its steps.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from pcgspec import LLM, SamplingParams
        from pcgspec.cli import serve_engine_config
        from pcgspec.engine.collector import freeze_start_up

        model = ["--model-path", str(random_weights_dir(args))] if args.random_weights else []
        config = serve_engine_config([*shlex.split(args.server_args), *model])
        if args.max_concurrency:  # NOTE: the server had at most this many requests in flight
            config = replace(
                config, max_running_requests=min(args.max_concurrency, config.max_running_requests)
            )
        if config.torch_device.type == "cuda":  # NOTE: the server starts after this engine
            share = min(config.mem_fraction_static, ENGINE_SIDE_MEM_FRACTION)
            config = replace(config, mem_fraction_static=share)
        self.llm = LLM(**vars(config))
        freeze_start_up()  # NOTE: as the server's processes do theirs
        self.params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos
        )
        raw = load_prompts(args)
        self.prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in raw]
        warm = _warmup_prompt(args, raw)
        for _ in range(args.warmup):  # NOTE: as the served side warms up: one at a time
            one = {"prompt_token_ids": warm} if isinstance(warm, list) else warm
            self.llm.generate(one, self.params, use_tqdm=False)
        self.steps0 = self.llm.engine.step_stats()
        self.runs: list[tuple[float, int, int]] = []  # seconds, requests, output tokens

    def run(self) -> None:
        """The load once, from an empty prefix cache (as each served repeat starts)."""
        self.llm.engine.flush_cache()
        start = time.perf_counter()
        outs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        took = time.perf_counter() - start
        self.runs.append((took, len(outs), sum(len(o.token_ids) for o in outs)))

    def record(self) -> dict[str, Any]:
        duration, requests, tokens = (sum(column) for column in zip(*self.runs))
        record = {
            "duration_s": duration,
            "successful_requests": requests,
            "total_output_tokens": tokens,
            "request_throughput": requests / duration,
            "output_token_throughput": tokens / duration,
            "step_times": step_times_between(self.steps0, self.llm.engine.step_stats()),
        }
        if len(self.runs) > 1:
            record["repeats"] = [
                {"duration_s": t, "request_throughput": n / t, "output_token_throughput": k / t}
                for t, n, k in self.runs
            ]
        return record


def compare_engine(served: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Served throughput against the engine's own: each value and served / engine."""
    out = {}
    print(f"{' Served vs LLM.generate ':=^60}")
    for key in ("request_throughput", "output_token_throughput"):
        a, b = served[key], engine[key]
        out[key] = {"served": a, "engine": b, "ratio": a / b if b else None}
        print(f"{key:<28}{a:>12.2f}{b:>12.2f}{a / b if b else float('nan'):>7.3f}x")
    pairs = zip(served.get("repeats", []), engine.get("repeats", []))
    ratios = [a["output_token_throughput"] / b["output_token_throughput"] for a, b in pairs]
    if ratios:  # NOTE: each pair ran back to back: served, then the engine
        out["output_token_throughput"]["repeat_ratios"] = ratios
        out["output_token_throughput"]["median_ratio"] = statistics.median(ratios)
        shown = " ".join(f"{r:.3f}" for r in ratios)
        print(f"{'per repeat':<28}{shown}  (median {statistics.median(ratios):.3f}x)")
    # NOTE: where the difference goes: each kind of step's count and mean time, both sides
    served_steps, engine_steps = served.get("step_times", {}), engine.get("step_times", {})
    for kind in sorted(set(served_steps) | set(engine_steps)):
        cells = [served_steps.get(kind), engine_steps.get(kind)]
        shown = [f"{c['steps']:>6d} x {c['ms_mean']:5.2f} ms" if c else f"{'-':>16}" for c in cells]
        print(f"{kind + ' steps':<28}{shown[0]:>16}{shown[1]:>16}")
    print("=" * 60)
    return out


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Cache on vs off: each value and on / off."""
    out = {}
    for key in COMPARED:
        a, b = (s["ttft"].get("p50_ms") if key == "ttft_p50_ms" else s[key] for s in (on, off))
        out[key] = {"radix_cache": a, "no_radix_cache": b, "ratio": a / b if a and b else None}
    print(f"{' Radix cache on vs off ':=^60}")
    for key, row in out.items():
        ratio = row["ratio"]
        print(
            f"{key:<28}{row['radix_cache']:>12.2f}{row['no_radix_cache']:>12.2f}"
            f"{'' if ratio is None else f'{ratio:>7.3f}x'}"
        )
    print("=" * 60)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_before = os.getloadavg()
    body = serving_compare.sweep(args, launch) if args.sweep else single_run(args)
    record = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": _device_name() or args.device_label or _served_device(body),
        "device_label": args.device_label,
        "host": f"{platform.machine()}, {os.cpu_count()} cpus",
        "load_average_before_after": [load_before, os.getloadavg()],
        "torch": _torch_version(),
        "command": shlex.join(["scripts/bench_serving.py", *(argv or sys.argv[1:])]),
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key", "configs", "plans")},
        **body,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def single_run(args: argparse.Namespace) -> dict[str, Any]:
    """The load once (with --launch per cache mode of a prefix-cache dataset), and the
    comparisons asked for."""
    if args.dataset == "mixed":
        return mixed_run(args)
    modes = args.cache_modes if args.launch and args.dataset in CACHE_DATASETS else [None]
    engine = EngineSide(args) if args.compare_engine else None
    runs = {}
    for mode in modes:
        if mode is not None:
            print(f"--- radix cache {mode} ---")
        pair = engine.run if engine is not None and mode == modes[0] else None
        runs[mode] = run_once(args, ["--disable-radix-cache"] if mode == "off" else [], pair)
    record = dict(runs[modes[0]])
    if len(runs) > 1:
        record["runs"] = {f"radix_cache_{m}": s for m, s in runs.items()}
    if {"on", "off"} <= set(runs):
        record["cache_comparison"] = compare(runs["on"], runs["off"])
    if engine is not None:
        record["engine"] = engine.record()
        record["engine_comparison"] = compare_engine(runs[modes[0]], record["engine"])
    return record


def mixed_run(args: argparse.Namespace) -> dict[str, Any]:
    """Short streams alone, then beside long prompts (with --launch on its own server)."""
    server = launch(args) if args.launch else None
    try:
        record = asyncio.run(serving_mixed.run_mixed(args))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
    serving_mixed.print_mixed(record["mixed"])
    return record


def _device_name() -> str | None:
    """The first GPU's name from nvidia-smi, None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def _served_device(body: dict[str, Any]) -> str | None:
    """The sweep's first server's device (``cpu``, ``cuda``) from its /server_info."""
    config = (body.get("configs") or [{}])[0].get("engine_config") or {}
    return config.get("device")


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


if __name__ == "__main__":
    main()
