"""Decode throughput with and without speculative decoding, side by side in one run.

For each prompt set and batch size: output tokens/s of plain decoding and of each speculative
method (the repeats of all engines interleaved), the average accept length (accepted drafts + 1
bonus per verify step), the median wall time of a decode step (under the policy: of its
speculative and of its plain steps apart), the median wall time of a speculative step from a
pass in which every step speculates (``spec_step_ms``, against the plain engine's step), and
the split of a speculative step into draft (propose), verify and host (everything else: batch
building, commit, stop checks, scheduling) from another such pass that synchronizes around
each phase (which slows it: ``synced_step_ms``), and from the first pass, unsynchronized,
the host's time per step launching it, waiting for the step in flight and reading it
(``launch_ms``, ``wait_ms``, ``read_ms``: a wait near 0 means the host is the floor), the same
for the plain engine's decode steps from a pass of its own, and their ratio
(``host_step_vs_plain``: launch and read, speculative over plain). Prompts
ask the model to repeat text ("repeat": where prompt lookup helps) or open questions
("general"). A batch smaller than its prompt set runs batch after batch over the whole set
(batch 1: every prompt once), so every row sees every prompt. With ``--in-flight`` a batch
size B is a load instead: ``--load-requests`` prompts given at once to engines that run at
most B requests (the engine's closed loop, as a server's with B clients: a request starts as
another finishes); rows then also count each kind of step (``step_kinds``: prefill, mixed,
decode, speculative) and time decode steps on the device by kind. Speculative rows count the
policy's choices per batch-size bucket over the timed repeats (``policy_choices``). Medians;
writes JSON.

Drafts: EAGLE3 runs the shipped head of the default model (``--eagle3-draft`` names another);
``EAGLE3:untrained`` and NEXTN (and EAGLE3 on another target) run untrained heads written in
the published layouts (accept length about 1: they measure the cost of drafting and
verifying, not a head's gain; EAGLE3's with a reduced draft vocabulary, as published heads
have), unless ``--nextn-draft`` names a checkpoint; STANDALONE runs ``--standalone-draft``, by
default the target itself (every draft accepted: the ceiling of the method). Prompts: "chat"
goes through the model's chat template.

    python scripts/bench_spec.py --methods NGRAM,STANDALONE,EAGLE3,EAGLE3:untrained \\
        --batch-sizes 1,4,16,32

A method ``EAGLE3:D/K/N`` drafts a tree of depth D, topk K and N nodes (beside the chain of
``EAGLE3`` in the same run):

    python scripts/bench_spec.py --methods EAGLE3,EAGLE3:5/4/16,EAGLE3:6/4/24 --num-steps 3 \\
        --prompts served-chat --batch-sizes 1 --max-tokens 128

The served benchmark's chat requests in process, 1 to 64 in flight (the shipped head):

    python scripts/bench_spec.py --methods EAGLE3 --num-steps 3 --prompts served-chat \\
        --in-flight --batch-sizes 1,4,16,64 --max-tokens 128 --repeats 3

With ``--random-weights`` and ``--standalone-draft-shape`` the STANDALONE pair runs with random
weights of real shapes; ``--accept-lengths`` adds the speedup estimate of ``spec_estimate.py``:

    python scripts/bench_spec.py --random-weights qwen2.5-coder-1.5b \\
        --standalone-draft-shape qwen2.5-coder-0.5b --methods STANDALONE --policy always \\
        --batch-sizes 1 --prompts general --cuda-graph-max-bs 4 --accept-lengths \\
        bench/results/accept_standalone_qwen2.5-coder-0.5b-1.5b_cpu_2026-11-28.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_estimate import print_estimate, speed_estimate  # noqa: E402

UNTRAINED = "untrained"
_PASSAGES = [
    "The quick brown fox jumps over the lazy dog near the river bank, while the old farmer "
    "watches from his porch and drinks his morning coffee.",
    "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
    "def sub(a, b):\n    return a - b\n",
    "Knowledge is power, and power is responsibility. Those who learn must also teach, and "
    "those who teach must never stop learning from their students.",
    "Paris is the capital of France and its largest city. It sits on the Seine river, in the "
    "north of the country, and is known for its museums and cafes.",
]
PROMPT_SETS = {
    # The model copies the passage (code editing, quoting): where prompt lookup (NGRAM) helps.
    "repeat": [f"Text: {p}\n\nThe same text, copied exactly:\nText: " for p in _PASSAGES],
    "general": [
        "Explain gravity to a child.",
        "List three prime numbers:",
        "Write a haiku about the sea.",
        "What is 12 times 12?",
    ],
    # Chat turns through the model's chat template, written for this benchmark (none is in the
    # EAGLE3 trainer's topics or templates): what a chat server sees.
    "chat": [
        "How do I keep basil alive on a windowsill?",
        "Why do cats purr?",
        "Give me three tips for a first job interview.",
        "What is the difference between weather and climate?",
        "Write a short poem about a lighthouse keeper.",
        "How does a refrigerator keep food cold?",
        "Suggest a name for a bakery that sells only bread.",
        "Explain what an API is to someone who does not program.",
        "What should I pack for a two-day hike?",
        "Summarize the story of Cinderella in three sentences.",
        "Write a Python function that checks whether a word is a palindrome.",
        "Why is the ocean salty?",
        "How can I get better at remembering names?",
        "What are the planets of the solar system, in order?",
        "Describe a sunset to someone who has never seen one.",
        "If a train travels 60 km in 45 minutes, what is its average speed?",
    ],
}
CHAT_SETS = {"chat", "served-chat"}
PHASES = ("propose", "verify")


def prompt_pool(prompt_set: str, tokenizer: Any) -> list[str]:
    """The prompts of ``PROMPT_SETS[prompt_set]`` (``served-chat``: the chat requests of the
    served benchmark, ``serving_datasets.py``), a chat set's through the chat template."""
    if prompt_set == "served-chat":
        from serving_datasets import load

        pool = load("chat")
    else:
        pool = PROMPT_SETS[prompt_set]
    if prompt_set not in CHAT_SETS:
        return pool
    from pcgspec.llm import chat_text

    return [chat_text(tokenizer, [{"role": "user", "content": q}]) for q in pool]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _recorded_event() -> torch.cuda.Event | None:
    """A timing event recorded on the current CUDA stream now (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepTimes:
    """While open: the wall time of every decode and prefill step of ``engine``; with
    ``phases``, also of each speculative phase, synchronized before and after (which slows the
    step: a separate pass); with ``parts``, unsynchronized, the host's time in each decode
    step's launch (a speculative step's, or a plain engine's forward and sampling), waiting for
    its results (``wait``: the device was behind) and reading them (``read``, without the
    wait). Patches the engine's instance attributes (and ``LaunchedSpecStep``'s or
    ``LaunchedStep``'s methods) and removes the patches on exit.
    """

    def __init__(self, engine, phases: bool = False, parts: bool = False) -> None:
        self.engine, self.phases, self.parts = engine, phases, parts
        self.times: dict[str, list[float]] = defaultdict(list)
        self._saved: tuple[Callable, Callable] | None = None
        self._starts: list[tuple[torch.cuda.Event, str] | None] = []  # per step, CUDA only

    def __enter__(self) -> StepTimes:
        from pcgspec.runners.forward_batch import ForwardMode

        engine, mode = self.engine, {}
        schedule, step = engine.scheduler.schedule, engine.step

        def scheduled():
            batch = schedule()
            mode["decode"] = batch is not None and batch.mode is ForwardMode.DECODE
            mode["prefill"] = batch is not None and not mode["decode"]
            return batch

        worker = engine.spec_worker
        chooses = None if worker is None else worker.chooses

        def chosen(batch):
            mode["speculated"] = speculate = chooses(batch)
            return speculate

        def timed_step():
            mode["speculated"] = False
            event = _recorded_event()
            start = time.perf_counter()
            out = step()
            kind = "spec_step" if mode["speculated"] else "plain_step"
            self._starts.append(event and (event, kind) if mode["decode"] else None)
            if mode["decode"]:
                seconds = time.perf_counter() - start
                self.times["step"].append(seconds)
                speculated = mode["speculated"]
                self.times[kind].append(seconds)
                if mode.get("last") is (not speculated):  # the first step after a switch
                    self.times["switch_to_spec" if speculated else "switch_to_plain"].append(
                        seconds
                    )
                mode["last"] = speculated
            else:
                if mode["prefill"]:
                    self.times["prefill"].append(time.perf_counter() - start)
                mode["last"] = None
            return out

        engine.scheduler.schedule, engine.step = scheduled, timed_step
        if worker is not None:
            worker.chooses = chosen
        if self.phases:
            for name in PHASES:
                setattr(
                    engine.spec_worker, name, self._timed(name, getattr(engine.spec_worker, name))
                )
        if self.parts:
            self._time_parts()
        return self

    def _time_parts(self) -> None:
        from pcgspec.engine.overlap import LaunchedStep
        from pcgspec.speculative.worker import LaunchedSpecStep

        engine, times = self.engine, self.times
        if engine.spec_worker is None:  # a plain decode step launches in its forward and sample
            owner, name, launched = engine, "_forward_and_sample", LaunchedStep
        else:
            owner, name, launched = engine.spec_worker, "launch", LaunchedSpecStep
        launch, (wait, read) = getattr(owner, name), (launched.wait, launched.read)
        self._saved = (owner, name, launched, wait, read)

        def timed(name: str, fn: Callable) -> Callable:
            def run(*args):
                start = time.perf_counter()
                out = fn(*args)
                times[name].append(time.perf_counter() - start)
                return out

            return run

        def timed_launch(batch, *args):
            if not batch.mode.is_decode():  # NOTE: a plain engine's prefill steps launch here too
                return launch(batch, *args)
            return timed("launch", launch)(batch, *args)

        def timed_read(step, eos):
            waited = len(times["wait"])
            out = timed("read", read)(step, eos)
            times["read"][-1] -= sum(times["wait"][waited:])  # the host's part only
            return out

        setattr(owner, name, timed_launch)
        launched.wait, launched.read = timed("wait", wait), timed_read

    def __exit__(self, *exc: object) -> None:
        self._periods()
        del self.engine.scheduler.schedule, self.engine.step  # the class's methods again
        if self.engine.spec_worker is not None:
            del self.engine.spec_worker.chooses
        if self.phases:
            for name in PHASES:
                delattr(self.engine.spec_worker, name)
        if self._saved is not None:
            owner, name, launched, wait, read = self._saved
            launched.wait, launched.read = wait, read
            delattr(owner, name)  # the class's method again
            self._saved = None

    def _periods(self) -> None:
        """On CUDA: the GPU's time from the start of each decode step to the start of the
        next (events recorded as each step begins, so launch gaps count), by the first's kind,
        as ``<kind>_period`` and ``step_period``."""
        starts, self._starts = self._starts, []
        if not any(starts):
            return
        _sync()
        for a, b in zip(starts, starts[1:]):
            if a is not None and b is not None:
                seconds = a[0].elapsed_time(b[0]) / 1e3
                self.times[f"{a[1]}_period"].append(seconds)
                self.times["step_period"].append(seconds)

    def _timed(self, name: str, fn: Callable) -> Callable:
        def run(*args):
            _sync()
            start = time.perf_counter()
            out = fn(*args)
            _sync()
            self.times[name].append(time.perf_counter() - start)
            return out

        return run

    def median_ms(self, name: str) -> float | None:
        values = self.times.get(name)
        return 1e3 * statistics.median(values) if values else None


def _params(args: argparse.Namespace):
    """Greedy, or sampled at ``--temperature`` with a fixed seed (the same draws every repeat)."""
    from pcgspec import SamplingParams

    seed = None if args.temperature == 0 else 0
    return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=args.max_tokens)


class GcPauses:
    """While open: the wall time of each pass of the garbage collector (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


class PolicyChoices:
    """While open: the speculation policy's choices for ``engine``'s decode batches, counted
    per batch-size bucket of its cost model (none without a policy)."""

    def __init__(self, engine) -> None:
        worker = engine.spec_worker
        self.policy = None if worker is None else worker.policy
        self.counts: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # speculative, plain

    def __enter__(self) -> PolicyChoices:
        policy = self.policy
        if policy is None:
            return self
        choose = policy.choose

        def counted(requests) -> bool:
            chosen = choose(requests)
            self.counts[policy.bucket(len(requests))][0 if chosen else 1] += 1
            return chosen

        policy.choose = counted
        return self

    def __exit__(self, *exc: object) -> None:
        if self.policy is not None:
            del self.policy.choose

    def summary(self) -> dict[int, dict[str, float]]:
        """Per bucket: speculative and plain choices, and the plain ones' share."""
        return {
            bucket: {"speculative": spec, "plain": plain, "plain_share": plain / (spec + plain)}
            for bucket, (spec, plain) in sorted(self.counts.items())
        }


@contextlib.contextmanager
def running_at_most(engines: dict, n: int) -> Iterator[None]:
    """Every engine's scheduler runs at most ``n`` requests at once inside the block (admitting
    from its queue as ``Scheduler`` does under that limit), as a server with a closed loop of
    ``n`` clients does."""
    saved = []
    for llm in engines.values():
        scheduler = llm.engine.scheduler
        saved.append((scheduler, scheduler.max_running_requests))
        scheduler.max_running_requests = n
    try:
        yield
    finally:
        for scheduler, limit in saved:
            scheduler.max_running_requests = limit


def add_in_flight_args(p: argparse.ArgumentParser) -> None:
    """``--in-flight`` and ``--load-requests`` (``running_at_most``)."""
    p.add_argument(
        "--in-flight",
        action="store_true",
        help="each batch size B is a load with B requests in flight instead: --load-requests "
        "prompts at once, at most B running (the engine's closed loop, as a server's)",
    )
    p.add_argument("--load-requests", type=int, default=256, help="prompts of an --in-flight load")


def cycled(pool: list[str], n: int) -> list[str]:
    """The first ``n`` prompts of ``pool`` repeated."""
    return (pool * (n // len(pool) + 1))[:n]


def _batches(pool: list[str], size: int) -> list[list[str]]:
    """Batches of ``size`` prompts, one after another, that cover the pool (the pool repeated
    to fill one batch when it is smaller; a partial last batch is left out): a batch of 1 is
    measured on every prompt, not on the first one alone.
    """
    if size >= len(pool):
        return [cycled(pool, size)]
    return [pool[i : i + size] for i in range(0, len(pool) - size + 1, size)]


def _generate(llm, batches: list[list[str]], params) -> list:
    """The outputs of ``batches``, generated one batch after another."""
    return [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]


def _time_generate(engines: dict, batches: list[list[str]], params, repeats: int) -> dict:
    """Per engine: output tok/s and the collector's pauses (ms) of each of ``repeats``
    generations (of all ``batches``), the last outputs, and the step times (``StepTimes``).
    The repeats of all engines are interleaved, each round in a new order (A B C, C A B, ...:
    clock and thermal drift, and whatever recurs with the round, such as a collection triggered
    by the same allocations, hit every engine alike).
    """
    for llm in engines.values():
        _generate(llm, batches, params)  # warm-up
    before = {name: llm.engine.step_stats() for name, llm in engines.items()}
    rates: dict[str, list[float]] = defaultdict(list)
    pauses: dict[str, list[float]] = defaultdict(list)
    outs, times = {}, {name: StepTimes(llm.engine) for name, llm in engines.items()}
    choices = {name: PolicyChoices(llm.engine) for name, llm in engines.items()}
    order, shuffle = list(engines), random.Random(len(batches[0])).shuffle
    for _ in range(repeats):
        for name in order:
            with times[name], choices[name], GcPauses() as collector:
                _sync()
                start = time.perf_counter()
                outs[name] = _generate(engines[name], batches, params)
                _sync()
                seconds = time.perf_counter() - start
            rates[name].append(sum(len(o.token_ids) for o in outs[name]) / seconds)
            pauses[name].append(1e3 * collector.seconds)
        shuffle(order)
    kinds = {
        name: _step_kinds(before[name], llm.engine.step_stats()) for name, llm in engines.items()
    }
    return {
        name: (rates[name], pauses[name], outs[name], times[name], kinds[name], choices[name])
        for name in engines
    }


def _step_kinds(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """The engine's steps of each kind between two ``Engine.step_stats``: their number and the
    mean wall time of their ``step()`` calls (a call launches its step and reads the one
    before it, so a kind's mean holds some of its neighbours' GPU time)."""
    out = {}
    for kind, now in after.items():
        steps = now["steps"] - before[kind]["steps"]
        if steps:
            ms = 1e3 * (now["seconds"] - before[kind]["seconds"]) / steps
            out[kind] = {"steps": steps, "ms_per_call": ms}
    return out


def _always(llm, batches: list[list[str]], params, phases: bool) -> StepTimes:
    """Step times of a pass in which every decode step speculates; ``phases``: also the time
    of each phase, synchronized around it (which slows the step), else the host's parts of
    each step (``StepTimes(parts=True)``)."""
    policy = llm.engine.spec_worker.policy
    mode, policy.mode = policy.mode, "always"
    try:  # NOTE: aside: these steps must not become the step times the policy decides by
        with policy.aside(), StepTimes(llm.engine, phases=phases, parts=not phases) as times:
            _generate(llm, batches, params)
    finally:
        policy.mode = mode
    return times


HOST_PARTS = ("launch", "wait", "read")


def _host_parts(times: StepTimes) -> dict[str, float | None]:
    """Per decode step, unsynchronized: the host launching it, waiting for the previous one's
    results (0: the device is ahead, the host is the floor) and reading them; ``host_step_ms``
    is the host's own part (launch and read)."""
    parts = {f"{part}_ms": times.median_ms(part) for part in HOST_PARTS}
    launch, read = parts["launch_ms"], parts["read_ms"]
    return {**parts, "host_step_ms": None if None in (launch, read) else launch + read}


def _plain_host(llm, batches: list[list[str]], params) -> dict[str, float | None]:
    """``_host_parts`` of the plain engine's decode steps, from a pass of their own."""
    with StepTimes(llm.engine, parts=True) as times:
        _generate(llm, batches, params)
    return _host_parts(times)


def _spec_step(llm, batches: list[list[str]], params) -> dict[str, float | None]:
    """Median ms of a speculative step as it runs (no phase syncs), and its split into draft,
    verify and host from a separate pass that synchronizes around each phase.
    """
    overlapped = _always(llm, batches, params, phases=False)
    split = _always(llm, batches, params, phases=True)
    synced, draft, verify = (split.median_ms(n) for n in ("step", "propose", "verify"))
    host = None if None in (synced, draft, verify) else synced - draft - verify
    return {
        "spec_step_ms": overlapped.median_ms("spec_step"),
        "spec_step_gpu_ms": overlapped.median_ms("spec_step_period"),
        "synced_step_ms": synced,
        "draft_ms": draft,
        "verify_ms": verify,
        "host_ms": host,
        **_host_parts(overlapped),
    }


def _run_batch(
    engines: dict, batches: list[list[str]], args: argparse.Namespace, batch: int | None = None
) -> list[dict]:
    """One point: every engine on ``batches``; ``batch``: the requests in flight of a load
    (default: the batches' size)."""
    rows: list[dict] = []
    params = _params(args)
    timed = _time_generate(engines, batches, params, args.repeats)
    for name, llm in engines.items():
        rates, pauses, outs, times, kinds, choices = timed[name]
        rate = statistics.median(rates)
        accept = [o.metrics.avg_spec_accept_length for o in outs]
        accept = [a for a in accept if a is not None]
        row = {
            "batch": batch or len(batches[0]),
            "batches": len(batches),
            "requests": sum(len(b) for b in batches),
            "method": name,
            "tok_s": rate,
            "speedup": rate / (rows[0]["tok_s"] if rows else rate),
            "avg_accept_length": statistics.mean(accept) if accept else None,
            "tok_s_repeats": rates,
            "gc_ms_repeats": pauses,
            "prefill_ms": sum(times.times["prefill"]) * 1e3 / len(rates),  # per generation
            "decode_step_ms": times.median_ms("step"),
            "decode_step_gpu_ms": times.median_ms("step_period"),
            "policy_spec_step_ms": times.median_ms("spec_step"),
            "policy_plain_step_ms": times.median_ms("plain_step"),
            # the device's time from a decode step's start to the next step's (CUDA events)
            "policy_spec_step_gpu_ms": times.median_ms("spec_step_period"),
            "policy_plain_step_gpu_ms": times.median_ms("plain_step_period"),
            "step_kinds": kinds,
            "switch_to_spec_ms": times.median_ms("switch_to_spec"),
            "switch_to_plain_ms": times.median_ms("switch_to_plain"),
            "switches": len(times.times.get("switch_to_spec", [])),
            "graphs": llm.engine.graph_stats(),
        }
        if name == "none":
            row.update(_plain_host(llm, batches, params))
        else:
            shape = llm.engine.spec_worker.shape
            row["draft_shape"] = f"{shape.depth}/{shape.topk}/{shape.num_nodes}"  # D/K/N
            row.update(llm.engine.spec_stats())
            row["policy_times"] = llm.engine.spec_worker.policy.step_times()
            row["policy_choices"] = choices.summary()  # over the timed repeats
            row.update(_spec_step(llm, batches, params))
            row["spec_step_vs_plain_step"] = row["spec_step_ms"] / rows[0]["decode_step_ms"]
            plain_host = rows[0]["host_step_ms"]
            row["host_step_vs_plain"] = (
                None
                if None in (plain_host, row["host_step_ms"])
                else row["host_step_ms"] / plain_host
            )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--methods",
        default="NGRAM",
        help="comma-separated speculative algorithms; EAGLE3:D/K/N (or NEXTN:D/K/N) drafts a "
        "tree of depth D, topk K and N nodes",
    )
    p.add_argument("--num-steps", type=int, default=4, help="--speculative-num-steps (k)")
    p.add_argument(
        "--eagle-topk",
        type=int,
        default=1,
        help="--speculative-eagle-topk of the EAGLE3 / NEXTN engines (> 1: tree drafting)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="--speculative-num-draft-tokens of the EAGLE3 / NEXTN engines (default: k+1)",
    )
    p.add_argument(
        "--policy",
        choices=("auto", "always"),
        default="auto",
        help="--speculative-policy of the speculative engines",
    )
    p.add_argument("--batch-sizes", default="1,4,16,32")
    add_in_flight_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy; else sampled with a fixed seed per request",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=7,
        help="generations per engine and batch, interleaved (the median counts)",
    )
    p.add_argument(
        "--prompts",
        default="repeat,general,chat",
        help="comma-separated: repeat, general, chat, served-chat (the served benchmark's chat "
        "requests; both through the chat template)",
    )
    p.add_argument("--standalone-draft", default=None, help="default: the target itself")
    p.add_argument(
        "--eagle3-draft",
        default=UNTRAINED,
        help="EAGLE3's head (default: the shipped head of the default model, else an "
        "untrained one); method EAGLE3:untrained always runs an untrained head",
    )
    p.add_argument(
        "--eagle3-draft-vocab",
        type=int,
        default=16384,
        help="draft vocabulary of the untrained EAGLE3 head",
    )
    p.add_argument("--nextn-draft", default=UNTRAINED)
    p.add_argument(
        "--random-weights",
        metavar="SHAPE",
        default=None,
        help="a target of this shape (pcgspec.models.random_weights) with random "
        "weights; STANDALONE drafts with it",
    )
    p.add_argument(
        "--tokenizer", default=None, help="with --random-weights (default: the default model's)"
    )
    p.add_argument(
        "--standalone-draft-shape",
        default=None,
        help="with --random-weights: STANDALONE drafts with random weights of this shape",
    )
    p.add_argument(
        "--accept-lengths",
        default=None,
        help="a measure_accept.py JSON: estimate each dataset's speedup from its accept length "
        "and this run's plain and speculative step times",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest captured batch",
    )
    p.add_argument("--out", default="bench/results/spec.json")
    args = p.parse_args(argv)
    if args.standalone_draft_shape and not args.random_weights:
        p.error("--standalone-draft-shape needs --random-weights")

    methods = [m for m in args.methods.split(",") if m]
    check_trees(p, (m.partition(":")[2] for m in methods if "/" in m))
    engines = _engines(args, methods)
    rows = []
    tokenizer = engines["none"].engine.tokenizer
    for prompt_set in args.prompts.split(","):
        pool = prompt_pool(prompt_set, tokenizer)
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            if args.in_flight:
                load = [cycled(pool, args.load_requests)]
                with running_at_most(engines, bs):
                    point = _run_batch(engines, load, args, batch=bs)
            else:
                point = _run_batch(engines, _batches(pool, bs), args)
            rows += [{"prompts": prompt_set, **r} for r in point]
    config = engines["none"].config
    device = torch.cuda.get_device_name() if config.torch_device.type == "cuda" else "CPU"
    model = args.random_weights or engines["none"].engine.model_dir.name
    _print(
        rows,
        f"{model}, {config.torch_dtype}, {device}, k={args.num_steps}, "
        f"topk={args.eagle_topk}, N={args.num_draft_tokens or args.num_steps + 1}, "
        f"policy {args.policy}, temperature {args.temperature}",
    )
    result = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": device,
        "torch": torch.__version__,
        "model": model,
        "dtype": str(config.torch_dtype),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "num_steps": args.num_steps,
        "eagle_topk": args.eagle_topk,
        "num_draft_tokens": args.num_draft_tokens,
        "policy": args.policy,
        "temperature": args.temperature,
        "load": f"{args.load_requests} requests, batch = in flight"
        if args.in_flight
        else "batches",
        "rows": rows,
    }
    if args.standalone_draft_shape:
        result["standalone_draft"] = f"{args.standalone_draft_shape} (random weights)"
    if args.accept_lengths:
        result["estimate"] = speed_estimate(rows, args.accept_lengths)
        print_estimate(result["estimate"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


def _print(rows: list[dict], title: str) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    print(f"\ndecode tokens/s, {title}")
    print(
        f"{'prompts':>8} {'batch':>5} {'method':>10} {'tok/s':>9} {'speedup':>8} "
        f"{'accept':>7} {'step ms':>8} {'spec step':>9} {'draft':>6} {'verify':>6} "
        f"{'host':>6} {'host/plain':>10} {'plain by policy':>15} {'prefill':>7} {'gc ms':>6} "
        f"{'spread':>6}"
    )
    for r in rows:
        acc = f"{r['avg_accept_length']:.2f}" if r["avg_accept_length"] is not None else "-"
        chosen = f"{r.get('policy_plain_steps', 0)}/{r.get('speculative_steps', 0)}"
        print(
            f"{r['prompts']:>8} {r['batch']:>5} {r['method']:>10} {r['tok_s']:>9.1f} "
            f"{r['speedup']:>7.2f}x {acc:>7} {ms(r['decode_step_ms']):>8} "
            f"{ms(r.get('spec_step_ms')):>9} {ms(r.get('draft_ms')):>6} "
            f"{ms(r.get('verify_ms')):>6} {ms(r.get('host_ms')):>6} "
            f"{ms(r.get('host_step_vs_plain')):>10} "
            f"{chosen if 'speculative_steps' in r else '-':>15} {ms(r['prefill_ms']):>7} "
            f"{ms(statistics.median(r['gc_ms_repeats'])):>6} "
            f"{_spread(r['tok_s_repeats']):>6}"
        )


def _spread(rates: list[float]) -> str:
    """(max - min) / median of the repeats' tok/s."""
    return f"{(max(rates) - min(rates)) / statistics.median(rates):.0%}"


def _engines(args: argparse.Namespace, methods: list[str]) -> dict:
    """The plain engine ("none") and one per method, each with a capped KV cache (several
    engines share the device: the first would take mem_fraction_static of the whole GPU).
    """
    from pcgspec import LLM
    from pcgspec.engine.collector import freeze_start_up

    base = {"dtype": args.dtype, "log_level": "warning", "max_total_tokens": 1 << 16}
    if args.cuda_graph_max_bs is not None:  # NOTE: fewer graphs to capture: a faster start
        base["cuda_graph_max_bs"] = args.cuda_graph_max_bs
    if args.random_weights:
        from pcgspec.models.default_model import default_model_path

        base["tokenizer"] = args.tokenizer or str(default_model_path())
        args.model = _random_checkpoint(args.random_weights, base["tokenizer"], seed=0)
        if args.standalone_draft_shape:
            draft = _random_checkpoint(args.standalone_draft_shape, base["tokenizer"], seed=1)
            args.standalone_draft = draft
    engines = {"none": LLM(args.model, **base)}
    drafts = _draft_paths(args, engines["none"].engine.model_dir, methods)
    for method in methods:
        algorithm, _, variant = method.partition(":")
        shape = {"speculative_num_steps": args.num_steps}
        if "/" in variant:
            shape = tree_kwargs(variant)
        elif algorithm in ("EAGLE3", "NEXTN"):
            shape["speculative_eagle_topk"] = args.eagle_topk
            shape["speculative_num_draft_tokens"] = args.num_draft_tokens
        engines[method] = LLM(
            args.model,
            speculative_algorithm=algorithm,
            speculative_draft_model_path=drafts.get(_draft_key(method)),
            speculative_policy=args.policy,
            **shape,
            **base,
        )
    freeze_start_up()  # NOTE: this script owns its process, as the server does its own
    return engines


def tree_kwargs(tree: str) -> dict:
    """``D/K/N`` -> the engine keywords of a draft tree of depth D, topk K, N nodes."""
    try:
        depth, topk, nodes = (int(v) for v in tree.split("/"))
    except ValueError:
        raise ValueError(f"--methods: a tree is EAGLE3:DEPTH/TOPK/NODES, got {tree!r}") from None
    return {
        "speculative_num_steps": depth,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": nodes,
    }


def check_trees(parser: argparse.ArgumentParser, trees: Iterable[str]) -> None:
    """``parser``'s error for the first of ``trees`` (methods' ``D/K/N`` suffixes) that is not
    one."""
    for tree in trees:
        try:
            tree_kwargs(tree)
        except ValueError as e:
            parser.error(str(e))


def _draft_key(method: str) -> str:
    """The draft a method runs: a tree (``EAGLE3:5/4/16``) drafts with its algorithm's."""
    algorithm, _, variant = method.partition(":")
    return algorithm if "/" in variant else method


def _random_checkpoint(shape: str, tokenizer: str, seed: int) -> str:
    """A folder of random weights of ``shape`` in its own vocabulary (as measured before),
    unless that is too small for ``tokenizer``'s ids (the tiny test shapes): then the
    tokenizer's.
    """
    import tempfile

    from pcgspec.models.draft_checkpoint import write_random_checkpoint
    from pcgspec.models.loader import load_tokenizer
    from pcgspec.models.random_weights import shape_config

    small = shape_config(shape).vocab_size < len(load_tokenizer(tokenizer))
    out = tempfile.mkdtemp(prefix=f"pcgspec-{shape}-")
    return str(write_random_checkpoint(shape, out, tokenizer if small else None, seed=seed))


def _draft_paths(args: argparse.Namespace, target_dir: Path, methods: list[str]) -> dict:
    """Draft folder per model-based method; untrained heads are written to a temp folder."""
    import tempfile

    from pcgspec.models.eagle3 import write_eagle3_checkpoint
    from pcgspec.models.loader import load_config
    from pcgspec.models.mtp import write_mtp_checkpoint

    config, root = load_config(target_dir), Path(tempfile.mkdtemp(prefix="pcgspec-drafts-"))
    paths = {"STANDALONE": args.standalone_draft or str(target_dir)}
    if any(m.startswith("EAGLE3") for m in methods):
        untrained_eagle3 = str(
            write_eagle3_checkpoint(
                root / "eagle3", config, seed=0, draft_vocab_size=args.eagle3_draft_vocab
            )
        )
        paths["EAGLE3:untrained"] = untrained_eagle3
        if args.eagle3_draft != UNTRAINED:
            paths["EAGLE3"] = args.eagle3_draft
        elif args.model is None:  # the default model: its shipped head
            paths["EAGLE3"] = None
        else:
            paths["EAGLE3"] = untrained_eagle3
    if any(m.startswith("NEXTN") for m in methods):
        paths["NEXTN"] = (
            args.nextn_draft
            if args.nextn_draft != UNTRAINED
            else str(write_mtp_checkpoint(root / "mtp", config, seed=0))
        )
    return {key: paths[key] for key in map(_draft_key, methods) if key in paths}


if __name__ == "__main__":
    main()
