"""Where the host time of one prefill step goes: the GPU-only time of the step (the host runs
ahead behind a sleep kernel), inclusive host time per component, cProfile over repeated
piecewise steps, and the Triton launches each decoder layer makes.

    python scripts/profile_step.py --shape smollm2-135m --tokens 16 --steps 200
    python scripts/profile_step.py --attention-backend triton --steps 2   # CPU: interpreted
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # NOTE: before any kernel module is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import engine_config, prefill_batch, time_bound  # noqa: E402

from pcgspec.kernels.launches import count_triton_launches  # noqa: E402
from pcgspec.models.random_weights import random_model  # noqa: E402
from pcgspec.runners.forward_batch import ForwardBatch  # noqa: E402
from pcgspec.runners.model_runner import ModelRunner  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eager", action="store_true", help="profile the eager path instead")
    p.add_argument(
        "--attention-backend",
        choices=("torch", "triton"),
        default=None,
        help="default: triton on CUDA, torch elsewhere",
    )
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--bound", action="store_true", help="also time the whole-graph bound (CUDA)")
    p.add_argument(
        "--trace",
        default=None,
        help="CUDA: write the GPU timeline of idle-start steps to this text file",
    )
    return p.parse_args()


def report_launches(step: Callable[[], None], num_layers: int) -> None:
    with count_triton_launches() as counts:
        step()
    total = sum(counts.values())
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"
    print(f"Triton launches per step: {total} ({kernels}); per layer: {total / num_layers:.2f}")


def gpu_only_ms(step: Callable[[], None], repeats: int = 20) -> float:
    """Median GPU time of ``step`` with its launches queued behind a sleep kernel, so no launch
    gap counts: what the step would take with a free host.
    """
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time: the host enqueues the step meanwhile
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def idle_step_ms(
    step: Callable[..., None], setup: Callable[[], tuple] = tuple, repeats: int = 50
) -> tuple[float, float]:
    """Median time of ``step(*setup())`` from an idle GPU (as bench_ttft times it; ``setup``
    untimed), and the median host time until ``step`` returns.
    """
    times, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        arg = setup()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        step(*arg)
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2], sorted(host)[repeats // 2]


def gpu_timeline(step: Callable[..., None], setup: Callable[[], tuple], path: Path) -> None:
    """The GPU activities of one idle-start step (torch.profiler): start and duration of each,
    and when the host called its launch, relative to the step's start; a summary of the gaps
    between activities (host-starved: launched after the previous activity ended).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            arg = setup()
            torch.cuda.synchronize()
            with torch.profiler.record_function("step"):
                step(*arg)
            torch.cuda.synchronize()
    trace = path.with_suffix(".json")
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    trace.unlink()
    t0 = max(e["ts"] for e in events if e.get("name") == "step" and e.get("ph") == "X")
    launches = {
        e["args"]["correlation"]: e["ts"] - t0
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    gpu = sorted(
        (
            e["ts"] - t0,
            e["dur"],
            e["name"],
            launches.get(e["args"].get("correlation"), float("nan")),
        )
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e["ts"] >= t0
    )
    lines, starved, latency, end = [], 0.0, 0.0, None
    for start, dur, name, launched in gpu:
        gap = 0.0 if end is None else max(0.0, start - end)
        if end is not None and launched > end:
            starved += gap
        else:
            latency += gap
        lines.append(
            f"{start:9.1f} {dur:7.1f} gap {gap:6.1f} launched {launched:9.1f}  {name[:60]}"
        )
        end = start + dur if end is None else max(end, start + dur)
    path.write_text("start_us dur_us gap_us launched_us name\n" + "\n".join(lines) + "\n")
    busy = sum(dur for _, dur, _, _ in gpu)
    print(
        f"GPU timeline ({len(gpu)} activities, {path}): first starts {gpu[0][0]:.1f} us after "
        f"the step begins, busy {busy:.1f} us, gaps {starved:.1f} us host-starved + "
        f"{latency:.1f} us with the launch already made, last ends {end:.1f} us"
    )


def host_breakdown(
    step: Callable[[], None], targets: dict[str, tuple[type, str]], steps: int
) -> None:
    """Inclusive host microseconds per step of each ``targets`` method (class, name)."""
    spent: dict[str, float] = dict.fromkeys(targets, 0.0)
    calls: dict[str, int] = dict.fromkeys(targets, 0)
    originals = {label: getattr(cls, name) for label, (cls, name) in targets.items()}

    def timed(label: str, fn: Callable) -> Callable:
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1

        return wrapper

    for label, (cls, name) in targets.items():
        setattr(cls, name, timed(label, originals[label]))
    try:
        for _ in range(steps):
            step()
    finally:
        for label, (cls, name) in targets.items():
            setattr(cls, name, originals[label])
    print("host time per step, inclusive (timer overhead included):")
    for label in targets:
        per_step = spent[label] / steps * 1e6
        print(f"  {label:>24}: {per_step:8.1f} us in {calls[label] / steps:5.1f} calls")


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, dtype, device)
    ns = argparse.Namespace(
        device=str(device), dtype=str(dtype).split(".")[-1], piecewise_cuda_graph_max_tokens=None
    )
    config = engine_config(ns, args.tokens + 16, not args.eager)
    config = dataclasses.replace(config, attention_backend=args.attention_backend)
    runner = ModelRunner(config, model=model)
    tokens = torch.randint(0, model.vocab_size, (args.tokens,))
    # NOTE: built once, outside every timed region, as bench_ttft builds it before each step:
    # building copies host memory to the GPU, which would wait for the GPU-only sleep.
    batch = prefill_batch(tokens, runner.page_size, device)

    def step() -> None:
        runner.forward(batch)

    def steps(n: int) -> None:
        for _ in range(n):
            step()
        torch.cuda.synchronize() if device.type == "cuda" else None

    steps(min(10, args.steps))
    report_launches(step, runner.model.num_layers)
    if device.type == "cuda":
        idle, host = idle_step_ms(step)
        print(
            f"step from an idle GPU: {idle:.3f} ms (host returns after {host:.3f} ms); "
            f"GPU-only: {gpu_only_ms(step):.3f} ms"
        )

        def fresh() -> tuple[ForwardBatch]:
            return (prefill_batch(tokens, runner.page_size, device),)

        idle, host = idle_step_ms(runner.forward, fresh)
        print(f"... with a fresh batch per step, as bench_ttft: {idle:.3f} ms (host {host:.3f} ms)")
        if args.trace:
            gpu_timeline(runner.forward, fresh, Path(args.trace))
        if args.bound:
            eager = ModelRunner(
                dataclasses.replace(config, disable_piecewise_cuda_graph=True), model=model
            )
            bound_args = argparse.Namespace(warmup=10, repeats=50, bound_backend="inductor")
            print(f"whole-graph bound: {time_bound(eager, tokens, bound_args).median_ms:.3f} ms")
    host_breakdown(step, breakdown_targets(runner), args.steps)
    start = time.perf_counter()
    steps(args.steps)
    print(f"{(time.perf_counter() - start) / args.steps * 1e3:.3f} ms per step (host loop)")
    profile = cProfile.Profile()
    profile.enable()
    steps(args.steps)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


def breakdown_targets(runner: ModelRunner) -> dict[str, tuple[type, str]]:
    from pcgspec.compile.backend import CompiledDecoder
    from pcgspec.compile.piecewise import PiecewiseGraphs
    from pcgspec.runners.piecewise_runner import PiecewiseRunner

    targets = {
        "ModelRunner.forward": (ModelRunner, "forward"),
        "init_forward_metadata": (type(runner.attn_backend), "init_forward_metadata"),
        "PiecewiseRunner._pad": (PiecewiseRunner, "_pad"),
        "CompiledDecoder.__call__": (CompiledDecoder, "__call__"),
        "CompiledDecoder.replay": (CompiledDecoder, "replay"),
        "PiecewiseGraphs.replay": (PiecewiseGraphs, "replay"),
        "attention backend.forward": (type(runner.attn_backend), "forward"),
        "compute_logits": (type(runner.model), "compute_logits"),
    }
    if torch.cuda.is_available():
        targets["CUDAGraph.replay"] = (torch.cuda.CUDAGraph, "replay")
    return targets


if __name__ == "__main__":
    main()
