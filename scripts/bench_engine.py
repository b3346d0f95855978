"""The engine's decode step against the decode graph alone, with and without the overlap schedule.

Per model and batch size B (steady-state decode only: B requests of --context prompt tokens,
ignore_eos, every request decoding through the timed window):
  graph    one replay of the decode CUDA graph of B's bucket (the decoder and the LM head),
           inputs in place: CUDA events, warm-up, --graph-repeats replays, median (CPU: an
           eager ``ModelRunner.forward``)
  device   the step's device work alone (copy into the graph buffers, replay, sampling)
           back to back, the same way
  overlap  ``Engine.step`` wall time per decode step under the overlap schedule, median of
           --repeats windows of --steps steps
  sync     the same with synchronous stepping (``disable_overlap_schedule``)
and the ratio graph ms / engine ms (the engine's rate as a fraction of what the graph allows).
One more window per schedule runs with timers on the step's parts (schedule, build, forward
launch, sampling launch, read-back wait, read-back postprocess, other); host ms = step - wait.

Models: ``default`` (the embedded SmolLM2-135M-Instruct) or a shape of
``pcgspec.models.random_weights`` with random weights (``llama-3.2-1b``; ``tiny`` for a CPU
smoke run). One engine per model serves both schedules (the schedule is switched between
windows, with nothing in flight).

    python scripts/bench_engine.py --models default,llama-3.2-1b --batch-sizes 1,16,64
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import decode_batch, header, time_step  # noqa: E402

from pcgspec import LLM, SamplingParams  # noqa: E402
from pcgspec.engine.overlap import LaunchedStep  # noqa: E402

SCHEDULES = ("overlap", "sync")
PARTS = ("schedule", "build", "forward", "sample", "wait", "postprocess", "other")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models",
        default="default,llama-3.2-1b",
        help="comma-separated: default and/or random-weight shapes",
    )
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=5, help="timed windows per schedule")
    p.add_argument("--graph-repeats", type=int, default=200)
    p.add_argument("--warmup", type=int, default=8, help="decode steps before the windows")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", default="bench/results/engine.json")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    if args.batch_sizes[0] < 1 or min(args.context, args.steps, args.repeats) < 1:
        p.error("batch sizes, --context, --steps and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = " ".join(["bench_engine.py", *argv])
    rows, first = [], None
    for model in args.models:
        llm = build_llm(args, model)
        first = first or header(args, llm.config.torch_device, llm.config.torch_dtype, model)
        for bs in args.batch_sizes:
            rows.append({"model": model, "batch": bs, **bench_batch(llm, bs, args)})
            print_row(rows[-1])
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {
        **first,
        "model": ",".join(args.models),
        "context": args.context,
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
    }
    print_table(result)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


def build_llm(args: argparse.Namespace, model: str) -> LLM:
    """An engine whose decode graphs cover the largest batch, with a KV pool sized for it."""
    import tempfile

    from pcgspec.models.default_model import default_model_path
    from pcgspec.models.draft_checkpoint import write_random_checkpoint

    max_bs = max(args.batch_sizes)
    tokens = args.context + args.warmup + (args.repeats + 1) * args.steps * len(SCHEDULES) + 16
    kw = {
        "dtype": args.dtype,
        "device": args.device,
        "log_level": "warning",
        "cuda_graph_max_bs": max_bs,
        "max_total_tokens": max_bs * (tokens + 16),
    }
    if model == "default":
        return LLM(None, **kw)
    folder = write_random_checkpoint(model, tempfile.mkdtemp(prefix=f"pcgspec-{model}-"))
    return LLM(str(folder), tokenizer=str(default_model_path()), **kw)


def bench_batch(llm: LLM, bs: int, args: argparse.Namespace) -> dict:
    llm.engine.flush_cache()  # NOTE: graph_times writes K/V into free pages, cached ones too
    graph_ms, device_ms = graph_times(llm, bs, args.context, args.graph_repeats)
    engine = llm.engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1 << 20)
    vocab = min(1000, engine.runner.vocab_size)
    prompt = [(7 * i + 11) % vocab for i in range(args.context)]
    reqs = [r for _ in range(bs) for r in engine.add_request(prompt, params)]
    while engine.scheduler.waiting:  # prefill (in chunks) until every request decodes
        engine.step()
    step_ms, parts = {}, {}
    for schedule in SCHEDULES:
        set_schedule(engine, schedule == "overlap")
        steps(engine, args.warmup)
        step_ms[schedule] = statistics.median(
            timed_window(engine, args.steps) for _ in range(args.repeats)
        )
        with part_timers(engine) as totals:
            steps(engine, args.steps)
        parts[schedule] = {k: totals[k] / args.steps for k in (*PARTS, "step")}
        parts[schedule]["host"] = parts[schedule]["step"] - parts[schedule]["wait"]
    for req in reqs:
        engine.abort(req.group_id)
    set_schedule(engine, llm.config.use_overlap_schedule)
    return {
        "graph_ms": graph_ms,
        "device_step_ms": device_ms,
        **{f"{s}_ms": step_ms[s] for s in SCHEDULES},
        **{f"{s}_vs_graph": graph_ms / step_ms[s] for s in SCHEDULES},
        "parts_ms": parts,
        "decode_graph_stats": graph_stats(llm),
    }


def graph_times(llm: LLM, bs: int, context: int, repeats: int) -> tuple[float, float]:
    """Median ms of the bucket's graph replay alone, and of the step's device work (load,
    replay with the LM head, greedy sampling), for ``bs`` requests at ``context`` tokens; CPU:
    an eager forward for both."""
    runner = llm.engine.runner
    batch = decode_batch(bs, context, runner)  # on free pages: the engine is idle
    graphs = runner.decode_graphs
    device = runner.device

    def forward_and_sample() -> torch.Tensor:
        logits = runner.forward(batch).logits
        return torch.argmax(logits, dim=-1, keepdim=True).float()

    device_ms = time_step(forward_and_sample, device, 5, repeats)[0]
    if graphs is None or not graphs.can_run(batch):
        return device_ms, device_ms
    bucket = min(b for b in graphs.batch_sizes if b >= bs)
    with torch.inference_mode():
        graphs.buffers.load(batch, bucket)

    @torch.inference_mode()
    def replay() -> torch.Tensor:
        graphs.graphs[bucket].replay()
        return graphs.outputs[bucket][0][:1]

    return time_step(replay, device, 5, repeats)[0], device_ms


def set_schedule(engine, overlap: bool) -> None:
    """Switch between the schedules with nothing in flight."""
    engine.drain()
    engine.overlap = overlap


def steps(engine, n: int) -> None:
    for _ in range(n):
        engine.step()


def timed_window(engine, n: int) -> float:
    """Wall ms per ``Engine.step`` over ``n`` decode steps."""
    device = engine.runner.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    steps(engine, n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3 / n


@contextmanager
def part_timers(engine) -> Iterator[dict[str, float]]:
    """Host ms per part of the step, summed over the steps run inside."""
    totals: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Callable) -> Callable:
        def run(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += (time.perf_counter() - start) * 1e3

        return run

    patches = [
        (engine.scheduler, "schedule"),
        (engine, "_build_forward_batch"),
        (engine.runner, "forward"),
        (engine.runner, "sample"),
        (engine, "step"),
    ]
    names = {"_build_forward_batch": "build", "step": "step"}
    for obj, attr in patches:
        setattr(obj, attr, timed(names.get(attr, attr), getattr(obj, attr)))
    wait, read = LaunchedStep.wait, LaunchedStep.read
    LaunchedStep.wait = timed("wait", wait)
    LaunchedStep.read = timed("read", read)
    try:
        yield totals
    finally:
        LaunchedStep.wait, LaunchedStep.read = wait, read
        for obj, attr in patches:
            delattr(obj, attr)
    totals["postprocess"] = totals["read"] - totals["wait"]
    known = sum(totals[p] for p in ("schedule", "build", "forward", "sample", "read"))
    totals["other"] = totals["step"] - known


def graph_stats(llm: LLM) -> dict | None:
    graphs = llm.engine.runner.decode_graphs
    return None if graphs is None else graphs.stats()


def print_row(r: dict) -> None:
    print(
        f"{r['model']} batch {r['batch']}: graph {r['graph_ms']:.3f} ms, device step "
        f"{r['device_step_ms']:.3f} ms, engine overlap {r['overlap_ms']:.3f} ms "
        f"({r['overlap_vs_graph']:.2f}x of graph rate), sync {r['sync_ms']:.3f} ms "
        f"({r['sync_vs_graph']:.2f}x)",
        flush=True,
    )


def print_table(result: dict) -> None:
    print(
        f"\nsteady-state decode step, {result['device']}, {result['dtype']}, "
        f"{result['context']}-token prompts; ms per step (median of {result['repeats']} "
        f"windows of {result['steps']} steps)"
    )
    print(
        f"{'model':>14} {'batch':>5} {'graph':>7} {'device':>7} {'overlap':>8} {'sync':>7} "
        f"{'ov/graph':>9} {'sync/graph':>10}"
    )
    for r in result["rows"]:
        print(
            f"{r['model']:>14} {r['batch']:>5} {r['graph_ms']:>7.3f} {r['device_step_ms']:>7.3f} "
            f"{r['overlap_ms']:>8.3f} {r['sync_ms']:>7.3f} {r['overlap_vs_graph']:>8.2f}x "
            f"{r['sync_vs_graph']:>9.2f}x"
        )
    print(f"\nhost parts, ms per step: {', '.join(PARTS)}; host = step - wait")
    for r in result["rows"]:
        for s in SCHEDULES:
            p = r["parts_ms"][s]
            cells = " ".join(f"{p[k]:.3f}" for k in PARTS)
            print(
                f"{r['model']:>14} {r['batch']:>5} {s:>7}: {cells} | step {p['step']:.3f} "
                f"host {p['host']:.3f}"
            )


if __name__ == "__main__":
    main()
