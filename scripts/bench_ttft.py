"""Single-request prefill time (TTFT without the scheduler) over prompt lengths, modes side by side.

One timed step = the decoder over the whole prompt + the LM head on the last row:
  eager      ModelRunner.forward(batch), piecewise and decode graphs off
  piecewise  ModelRunner.forward(batch), piecewise CUDA graphs on (inductor pieces on CUDA)
  extend     the same runner with its whole-decoder extend graphs (what an engine on CUDA runs
             up to ``extend_cuda_graph_max_tokens``; longer prompts take the piecewise graphs)
  bound      the same step compiled whole (fullgraph, static length, inductor) and captured as
             one CUDA graph with the attention metadata of that fixed batch: what PCG could reach
  hf         transformers on the same weights, one forward with logits_to_keep=1
The pcgspec modes get a fresh one-request ForwardBatch (prefix 0) per step, built outside the
timed region; decode graphs stay off (no prefill runs through them). Timing: warm-up, then CUDA
events around each step, median and p90 (perf_counter on CPU, for smoke tests only). Each mode's
last-row logits are compared with eager's (relative L2 error) so a fast wrong mode shows.

Cold start: ``load_s`` builds our model (random fill or checkpoint load); ``piecewise_runner_s``
constructs the piecewise ModelRunner (KV cache, memory profile, trace, compile, capture), built
first so it pays every kernel compile. ``--cold-start`` adds a second construction in the same
process (warm caches); ``--compile-cache-dir`` with an empty folder makes the first truly cold.

    python scripts/bench_ttft.py --random-weights --shape llama-3.2-1b --peer hf
    python scripts/bench_ttft.py --random-weights --shape gemma-3-270m \\
        --lengths 16,32,64,128,256,512,1024,2048 --bound-lengths 16,128,512,2048
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from pcgspec import envs
from pcgspec.attention import ATTENTION_BACKENDS
from pcgspec.compile.forward_context import forward_context
from pcgspec.config import DEFAULT_EXTEND_GRAPH_MAX_TOKENS, EngineConfig
from pcgspec.models.loader import load_model, resolve_model_dir
from pcgspec.models.random_weights import SHAPES, random_model, shape_config
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.extend_graph_runner import ExtendGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.runners.model_runner import ModelRunner

DEFAULT_LENGTHS = "16,32,64,128,256,512,1024,2048,4096"
MODES = ("eager", "piecewise", "extend", "bound")
RATIOS = (
    ("piecewise", "bound"),
    ("extend", "bound"),
    ("piecewise", "eager"),
    ("hf", "piecewise"),
)
MAX_REL_ERR = 5e-2  # last-row logits vs eager; bf16 kernels differ by ~1e-2
MAX_BOUND_LENGTHS = 8  # each is one Dynamo compile of the same code (recompile limit 8)


@dataclass
class Timing:
    median_ms: float
    p90_ms: float
    logits: torch.Tensor  # [V] float32, the last step's last-row logits

    def summary(self) -> dict[str, float]:
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded model)")
    p.add_argument("--random-weights", action="store_true", help="random weights of --shape")
    p.add_argument(
        "--shape", default="llama-3.2-1b", choices=list(SHAPES), help="shape for --random-weights"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths (tokens)")
    p.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    p.add_argument(
        "--bound-lengths",
        default="16,128,512,2048",
        help="lengths the bound is compiled for (each compile is slow)",
    )
    p.add_argument("--bound-backend", default="inductor", help="torch.compile backend of bound")
    p.add_argument(
        "--peer",
        choices=("hf",),
        action="append",
        default=[],
        help="also time transformers on the same weights",
    )
    p.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=None,
        help="largest bucket (engine default: the chunked-prefill size); "
        "longer lengths are dropped",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cold-start",
        action="store_true",
        help="also time a second piecewise ModelRunner (warm compile cache)",
    )
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="PCGSPEC_CACHE_DIR for compiling (an empty dir = a truly cold start)",
    )
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ttft_<name>)")
    args = p.parse_args(argv)
    args.lengths = _ints(p, "--lengths", args.lengths)
    args.bound_lengths = _ints(p, "--bound-lengths", args.bound_lengths)
    requested = [m for m in args.modes.split(",") if m]
    if set(requested) - set(MODES) or not (requested or args.peer):
        p.error(f"--modes: a subset of {','.join(MODES)}, got {args.modes!r}")
    args.modes = [m for m in MODES if m in requested]
    if len(args.bound_lengths) > MAX_BOUND_LENGTHS:
        p.error(f"--bound-lengths: at most {MAX_BOUND_LENGTHS}")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def _ints(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        p.error(f"{flag}: comma-separated integers, got {text!r}")
    if not values or values[0] < 1:
        p.error(f"{flag}: positive integers, got {text!r}")
    return values


# Timing ----------------------------------------------------------------------------------------


def time_steps(
    step: Callable[[object], torch.Tensor],
    setup: Callable[[], object],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> Timing:
    """``setup()`` untimed, then ``step(setup())`` timed, ``repeats`` times after ``warmup``."""
    for _ in range(warmup):
        step(setup())
    times, logits = [], None
    for _ in range(repeats):
        arg = setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)  # an idle GPU: launch gaps count, as in a real TTFT
            start.record()
            logits = step(arg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            logits = step(arg)
            times.append((time.perf_counter() - t0) * 1e3)
    ordered = sorted(times)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return Timing(statistics.median(times), p90, logits.reshape(-1).float().clone())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Models and modes ------------------------------------------------------------------------------


def build_hf(
    args: argparse.Namespace, dtype: torch.dtype, device: torch.device, model_dir: Path | None
) -> torch.nn.Module:
    """The transformers model: from ``model_dir``, or of ``--shape`` with its own random init."""
    from transformers import AutoModelForCausalLM

    if args.random_weights:
        torch.manual_seed(args.seed)
        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(shape_config(args.shape), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return hf.to(device).requires_grad_(False).eval()


def build_model(
    args: argparse.Namespace,
    dtype: torch.dtype,
    device: torch.device,
    model_dir: Path | None,
    hf: torch.nn.Module | None,
) -> torch.nn.Module:
    """Our model; with random weights and a transformers peer, the peer's weights (loaded
    through our loader), so both compute the same function.
    """
    if not args.random_weights:
        return load_model(model_dir, dtype, device)
    model = random_model(args.shape, dtype, device, seed=args.seed)
    if hf is not None:
        model.load_weights(hf.state_dict().items())
    return model


def engine_config(args: argparse.Namespace, max_len: int, piecewise: bool) -> EngineConfig:
    """KV pool capped at one prompt, so several runners fit next to each other."""
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        disable_cuda_graph=True,
        disable_piecewise_cuda_graph=not piecewise,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        max_total_tokens=max_len,
    )


def prefill_batch(tokens: torch.Tensor, page_size: int, device: torch.device) -> ForwardBatch:
    """One request, prefix 0, on pages 0.. of the KV cache (reused by every step)."""
    pages = list(range(-(-len(tokens) // page_size)))
    chunk = SeqChunk(tokens.tolist(), 0, pages)
    return build_forward_batch(ForwardMode.EXTEND, [chunk], page_size, device)


def time_runner(runner: ModelRunner, tokens: torch.Tensor, args: argparse.Namespace) -> Timing:
    device = runner.device
    return time_steps(
        lambda batch: runner.forward(batch).logits,
        lambda: prefill_batch(tokens, runner.page_size, device),
        device,
        args.warmup,
        args.repeats,
    )


def time_bound(runner: ModelRunner, tokens: torch.Tensor, args: argparse.Namespace) -> Timing:
    """Compile the whole step for this length, capture it as one CUDA graph, time replays.

    NOTE: a backend of its own over ``runner``'s KV cache, so the metadata the graph captured
    (built once for this fixed batch) is never replaced by another forward.
    """
    model, device = runner.model, runner.device
    backend = ATTENTION_BACKENDS.get(runner.config.resolved_attention_backend)(
        runner.kv_cache, model.num_heads, model.head_dim, model.attn_scale, model.sliding_windows
    )
    batch = prefill_batch(tokens, runner.page_size, device)
    backend.init_forward_metadata(batch)

    def prefill(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, _ = model.model(input_ids, positions)
        return model.compute_logits(hidden[-1:])

    compiled = torch.compile(prefill, backend=args.bound_backend, fullgraph=True, dynamic=False)

    def step(_: object = None) -> torch.Tensor:
        with torch.inference_mode(), forward_context(batch, backend):
            return compiled(batch.input_ids, batch.positions)

    if device.type == "cuda":
        step = _capture(step, device)
    return time_steps(step, lambda: None, device, args.warmup, args.repeats)


def _capture(step: Callable[[], torch.Tensor], device: torch.device) -> Callable:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, then settle allocations before capture
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    def replay(_: object = None) -> torch.Tensor:
        graph.replay()
        return out

    return replay


def time_hf(hf: torch.nn.Module, tokens: torch.Tensor, args: argparse.Namespace) -> Timing:
    device = next(hf.parameters()).device
    ids = tokens.to(device)[None]

    @torch.inference_mode()
    def step(_: object) -> torch.Tensor:
        return hf(input_ids=ids, logits_to_keep=1).logits[0, -1]

    return time_steps(step, lambda: None, device, args.warmup, args.repeats)


# Main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = " ".join(["bench_ttft.py", *argv])
    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(name)s: %(message)s")
    model_dir = None if args.random_weights else resolve_model_dir(args.model)
    if args.compile_cache_dir:  # NOTE: after resolving the model, which may live in the cache
        cache = Path(args.compile_cache_dir).resolve()
        os.environ["PCGSPEC_CACHE_DIR"] = str(cache)
        os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    probe = engine_config(args, 1, piecewise=True)
    device, dtype = probe.torch_device, probe.torch_dtype
    lengths = timed_lengths(args.lengths, probe.resolved_piecewise_max_tokens)
    max_len = -(-max(lengths) // probe.page_size) * probe.page_size

    hf = build_hf(args, dtype, device, model_dir) if "hf" in args.peer else None
    t0 = time.perf_counter()
    model = build_model(args, dtype, device, model_dir, hf)
    _sync(device)
    cold = {"load_s": time.perf_counter() - t0}
    runners = build_runners(args, model, max_len, cold)
    prompt = torch.randint(
        model.vocab_size, (max(lengths),), generator=torch.Generator().manual_seed(args.seed)
    )
    results = run_modes(args, lengths, prompt, runners, hf)
    stats = _stats(runners.get("piecewise"))
    extend = getattr(runners.get("piecewise"), "extend_graphs", None)
    if args.cold_start and "piecewise" in runners:
        cold.update(second_construction(args, runners, max_len, model))

    result = {
        **describe(args, device, dtype, model_dir),
        "settings": settings(args, list(results), runners, device, hf),
        "cold_start": cold,
        "piecewise_stats": stats,
        "extend_stats": None if extend is None else extend.stats(),
        "rows": table_rows(lengths, results),
    }
    print_table(result)
    write(result, args.out)
    return result


def timed_lengths(lengths: list[int], max_bucket: int) -> list[int]:
    kept = [n for n in lengths if n <= max_bucket]
    if len(kept) < len(lengths):
        print(
            f"lengths {[n for n in lengths if n > max_bucket]} exceed the largest piecewise "
            f"bucket {max_bucket}: dropped (raise --piecewise-cuda-graph-max-tokens)"
        )
    if not kept:
        raise SystemExit("no length left to time")
    return kept


def build_runners(
    args: argparse.Namespace, model: torch.nn.Module, max_len: int, cold: dict[str, float]
) -> dict[str, ModelRunner]:
    """The piecewise runner first, so its cold start pays every kernel compile (attention's
    Triton kernels included); the eager runner serves eager and bound.
    """
    runners: dict[str, ModelRunner] = {}
    if {"piecewise", "extend"} & set(args.modes):
        t0 = time.perf_counter()
        runners["piecewise"] = ModelRunner(engine_config(args, max_len, True), model=model)
        _sync(model.device)
        cold["piecewise_runner_s"] = time.perf_counter() - t0
    if {"eager", "bound"} & set(args.modes):
        runners["eager"] = ModelRunner(engine_config(args, max_len, False), model=model)
    return runners


def run_modes(
    args: argparse.Namespace,
    lengths: list[int],
    prompt: torch.Tensor,
    runners: dict[str, ModelRunner],
    hf: torch.nn.Module | None,
) -> dict[str, dict[int, Timing]]:
    results: dict[str, dict[int, Timing]] = {}
    for mode in [*args.modes, *args.peer]:
        results[mode] = {}
        for n in lengths:
            tokens = prompt[:n]
            if mode == "bound":
                if n not in args.bound_lengths:
                    continue
                timing = time_bound(runners["eager"], tokens, args)
            elif mode == "hf":
                timing = time_hf(hf, tokens, args)
            elif mode == "extend":
                timing = time_runner(with_extend_graphs(runners["piecewise"]), tokens, args)
            else:
                timing = time_runner(runners[mode], tokens, args)
            results[mode][n] = timing
            print(
                f"{mode:>9} {n:>5} tokens: median {timing.median_ms:8.3f} ms, "
                f"p90 {timing.p90_ms:8.3f} ms",
                flush=True,
            )
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def with_extend_graphs(runner: ModelRunner) -> ModelRunner:
    """``runner`` with extend graphs captured over its compiled decoder (once; after the
    piecewise mode's timings, which must not see them).
    """
    if runner.extend_graphs is None:
        max_tokens = min(DEFAULT_EXTEND_GRAPH_MAX_TOKENS, runner.piecewise.max_tokens)
        runner.extend_graphs = ExtendGraphRunner(runner, max_tokens)
        runner.extend_graphs.capture()
    return runner


def second_construction(
    args: argparse.Namespace, runners: dict[str, ModelRunner], max_len: int, model: torch.nn.Module
) -> dict[str, float]:
    """Rebuild the piecewise runner in this process: on-disk and in-process caches are warm."""
    device = runners["piecewise"].device
    del runners["piecewise"]
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    runners["piecewise"] = ModelRunner(engine_config(args, max_len, True), model=model)
    _sync(device)
    return {"piecewise_runner_warm_cache_s": time.perf_counter() - t0}


# Report ----------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, NaN when either has a NaN."""
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def table_rows(lengths: list[int], results: dict[str, dict[int, Timing]]) -> list[dict]:
    rows = []
    for n in lengths:
        row: dict = {"length": n}
        ref = results.get("eager", {}).get(n)
        for mode, per_len in results.items():
            if n in per_len:
                row[mode] = per_len[n].summary()
                if ref is not None and mode != "eager":
                    row[mode]["rel_err_vs_eager"] = rel_err(per_len[n].logits, ref.logits)
        row["ratios"] = {
            f"{a}/{b}": row[a]["median_ms"] / row[b]["median_ms"]
            for a, b in RATIOS
            if a in row and b in row
        }
        rows.append(row)
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def describe(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, model_dir: Path | None
) -> dict:
    import transformers

    return {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": transformers.__version__,
        "command": args.command,
        "model": args.shape if args.random_weights else model_dir.name,
        "dtype": str(dtype),
    }


def settings(
    args: argparse.Namespace,
    modes: list[str],
    runners: dict[str, ModelRunner],
    device: torch.device,
    hf: torch.nn.Module | None,
) -> dict:
    out = {
        "modes": modes,
        "bound_lengths": args.bound_lengths,
        "bound_backend": args.bound_backend,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "seed": args.seed,
        "random_weights": args.random_weights,
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
    }
    if runners:
        cfg = next(iter(runners.values())).config
        out.update(
            page_size=cfg.page_size,
            attention_backend=cfg.resolved_attention_backend,
            piecewise_max_tokens=cfg.resolved_piecewise_max_tokens,
            piecewise_compiler=cfg.resolved_piecewise_compiler,
            decode_graphs=False,
        )
    if hf is not None:
        out["hf_attn_implementation"] = hf.config._attn_implementation
    return out


def write(result: dict, out: str | None) -> None:
    path = Path(out or f"bench/results/ttft_{result['model'].lower()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    plot(result, path.with_suffix(".png"))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _stats(model_runner: ModelRunner | None) -> dict[str, int] | None:
    piecewise = getattr(model_runner, "piecewise", None)
    return None if piecewise is None else piecewise.stats()


def print_table(result: dict) -> None:
    modes = result["settings"]["modes"]
    ratios = [f"{a}/{b}" for a, b in RATIOS if a in modes and b in modes]
    print(f"\nprefill TTFT (median ms), {result['model']}, {result['dtype']}, {result['device']}")
    print(
        f"{'tokens':>6} "
        + " ".join(f"{m:>9}" for m in modes)
        + " "
        + " ".join(f"{r:>15}" for r in ratios)
    )
    for row in result["rows"]:
        cells = [f"{row[m]['median_ms']:9.3f}" if m in row else f"{'-':>9}" for m in modes]
        ratio_cells = [
            f"{row['ratios'][r]:15.2f}" if r in row["ratios"] else f"{'-':>15}" for r in ratios
        ]
        print(f"{row['length']:>6} " + " ".join(cells) + " " + " ".join(ratio_cells))
    errs = {
        (row["length"], m): row[m]["rel_err_vs_eager"]
        for row in result["rows"]
        for m in modes
        if "rel_err_vs_eager" in row.get(m, {})
    }
    if errs:
        worst = max(errs.values(), key=lambda e: math.inf if math.isnan(e) else e)
        bad = sorted(k for k, e in errs.items() if not e <= MAX_REL_ERR)  # NaN is bad too
        print(
            f"last-row logits vs eager: worst relative error {worst:.1e}"
            + (f"; MISMATCH (> {MAX_REL_ERR}) at {bad}" if bad else "")
        )
    fallbacks = {
        k: v for k, v in (result["piecewise_stats"] or {}).get("fallbacks", {}).items() if v
    }
    if fallbacks:
        print(f"WARNING: piecewise steps that ran eagerly: {fallbacks}")
    for key, seconds in result["cold_start"].items():
        print(f"cold start {key}: {seconds:.1f} s")


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in result["settings"]["modes"]:
        pts = [(r["length"], r[mode]["median_ms"]) for r in result["rows"] if mode in r]
        ax.plot(*zip(*pts), marker="o", label=mode)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="median prefill ms",
        title=f"{result['model']} {result['dtype']}, {result['device']}",
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
