"""Decode speed, two benchmarks.

Step (CUDA, or any device with --random-weights): one decode step of B requests, each with
--context tokens in the KV cache; step = decoder + LM head over the B rows. Modes:
  eager   ModelRunner.forward with decode and piecewise graphs off
  graphs  ModelRunner.forward with decode CUDA graphs (the engine default; CUDA only)
  bound   the same step compiled whole (torch.compile fullgraph, static shapes; the attention
          op stays opaque) and captured as one CUDA graph for this fixed batch and context,
          inputs already in place: what decode graphs could reach
Timing: warm-up, then per step an idle GPU (the engine syncs every step) and CUDA events around
it (perf_counter on CPU); median and p90. Weight GB/s = bytes of the weights one step reads /
median step: at batch 1 decode is bound by it. Logits are compared with eager's.

vs transformers (CPU without --random-weights, the original benchmark): decode tokens/s =
B * (N - 1) / (t(N new tokens) - t(1 new token)) for pcgspec and transformers ``generate``.

    python scripts/bench_decode.py --random-weights --shape llama-3.2-1b --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

from pcgspec.models.random_weights import SHAPES

PROMPTS = [
    "The capital of France is",
    "def quicksort(xs):",
    "Once upon a time",
    "List the planets:",
    "The quick brown fox",
    "Explain gravity simply.",
    "1, 2, 3,",
    "import numpy as np",
]
MODES = ("eager", "graphs", "bound")
MAX_BOUND_BATCHES = 8  # each is a recompile of the same code; Dynamo's recompile limit is 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    p.add_argument("--random-weights", action="store_true", help="random weights of --shape")
    p.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--context", type=int, default=1024, help="step: KV tokens per request")
    p.add_argument("--modes", default=",".join(MODES), help="step: subset of eager,graphs,bound")
    p.add_argument("--bound-backend", default="inductor", help="step: torch.compile backend")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps (default 50); vs transformers: generate calls (default 3)",
    )
    p.add_argument("--new-tokens", type=int, default=64, help="vs transformers: N")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/decode*.json)")
    args = p.parse_args(argv)
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    if not args.modes or args.batch_sizes[0] < 1 or args.context < 1 or args.repeats == 0:
        p.error("need a mode, positive batch sizes, --context >= 1 and --repeats >= 1")
    if "bound" in args.modes and len(args.batch_sizes) > MAX_BOUND_BATCHES:
        p.error(f"bound: at most {MAX_BOUND_BATCHES} batch sizes (one Dynamo compile each)")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.command = " ".join(["bench_decode.py", *argv])
    from pcgspec.config import EngineConfig

    probe = EngineConfig(device=args.device, dtype=args.dtype)
    if probe.torch_device.type == "cpu" and not args.random_weights:
        args.repeats = args.repeats or 3
        result = bench_vs_transformers(args)
        default_out = "bench/results/decode.json"
    else:
        args.repeats = args.repeats or 50
        result = bench_steps(args, probe.torch_device, probe.torch_dtype)
        default_out = f"bench/results/decode_steps_{result['model'].lower()}.json"
    path = Path(args.out or default_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return result


def header(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, name: str) -> dict:
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)"
    )
    return {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": where,
        "torch": torch.__version__,
        "model": name,
        "dtype": str(dtype),
        "command": args.command,
    }


# Step benchmark --------------------------------------------------------------------------------


def bench_steps(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict:
    model, name = build_model(args, dtype, device)
    modes = [m for m in args.modes if device.type == "cuda" or m != "graphs"]
    if modes != args.modes:
        print("decode graphs need CUDA: mode 'graphs' skipped")
    runners = {
        mode: make_runner(args, model, graphs=mode == "graphs")
        for mode in dict.fromkeys(("eager", *modes))
        if mode != "bound"
    }
    nbytes = weight_bytes(model)
    steps = []
    for bs in args.batch_sizes:
        batch = decode_batch(bs, args.context, runners["eager"])
        ref = None
        for mode in modes:
            if mode == "bound":
                step = bound_step(runners["eager"], batch, args.bound_backend)
            else:
                step = forward_step(runners[mode], batch)
            median, p90, logits = time_step(step, device, args.warmup, args.repeats)
            ref = logits if mode == "eager" else ref
            err = None if ref is None else float((logits - ref).norm() / ref.norm())
            steps.append(
                {
                    "batch": bs,
                    "mode": mode,
                    "median_ms": median,
                    "p90_ms": p90,
                    "tok_s": bs / median * 1e3,
                    "weight_gb_s": nbytes / median / 1e6,
                    "rel_err_vs_eager": err,
                }
            )
            print(
                f"{mode:>6} batch {bs:>3}: {median:8.3f} ms (p90 {p90:.3f}), "
                f"{nbytes / median / 1e6:7.1f} GB/s of weights",
                flush=True,
            )
    graphs = runners.get("graphs")
    copy = device_copy_gb_s(device) if device.type == "cuda" else None
    for step in steps:
        step["copy_fraction"] = None if copy is None else step["weight_gb_s"] / copy
    result = {
        **header(args, device, dtype, name),
        "context": args.context,
        "weight_bytes": nbytes,
        "device_copy_gb_s": copy,
        "steps": steps,
        "decode_graph_stats": graphs.decode_graphs.stats() if graphs else None,
    }
    print_steps(result)
    return result


def build_model(
    args: argparse.Namespace, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, str]:
    from pcgspec.models.loader import load_model, resolve_model_dir
    from pcgspec.models.random_weights import random_model

    if args.random_weights:
        return random_model(args.shape, dtype, device), args.shape
    path = resolve_model_dir(args.model)
    return load_model(path, dtype, device), path.name


def make_runner(args: argparse.Namespace, model: torch.nn.Module, graphs: bool):
    """Eager: every graph off. Graphs: the engine default (piecewise pieces captured in decode
    graphs); small piecewise buckets, since no prefill is timed. KV for the largest batch only.
    """
    from pcgspec.config import EngineConfig
    from pcgspec.runners.model_runner import ModelRunner

    max_bs, page = max(args.batch_sizes), 16
    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        page_size=page,
        disable_cuda_graph=not graphs,
        disable_piecewise_cuda_graph=not graphs,
        piecewise_cuda_graph_max_tokens=64,
        cuda_graph_max_bs=max_bs,
        max_total_tokens=max_bs * -(-args.context // page) * page,
    )
    return ModelRunner(config, model=model)


def decode_batch(bs: int, context: int, runner):
    """``bs`` requests on disjoint pages, each decoding its token number ``context``."""
    from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
    from pcgspec.runners.forward_batch import ForwardMode

    per_req = -(-context // runner.page_size)
    chunks = [SeqChunk([1], context - 1, range(b * per_req, (b + 1) * per_req)) for b in range(bs)]
    return build_forward_batch(ForwardMode.DECODE, chunks, runner.page_size, runner.device)


def forward_step(runner, batch) -> Callable[[], torch.Tensor]:
    return lambda: runner.forward(batch).logits


def bound_step(runner, batch, compile_backend: str) -> Callable[[], torch.Tensor]:
    """Decoder + LM head compiled whole for this batch, captured as one CUDA graph (CUDA).

    NOTE: an attention backend of its own, so the metadata built once for this batch is never
    replaced by another forward.
    """
    from pcgspec.attention import ATTENTION_BACKENDS
    from pcgspec.compile.forward_context import forward_context

    model = runner.model
    backend = ATTENTION_BACKENDS.get(runner.config.resolved_attention_backend)(
        runner.kv_cache, model.num_heads, model.head_dim, model.attn_scale
    )
    backend.init_forward_metadata(batch)

    def decode_step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, _ = model.model(input_ids, positions)
        return model.compute_logits(hidden)

    compiled = torch.compile(decode_step, backend=compile_backend, fullgraph=True, dynamic=False)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        with forward_context(batch, backend):
            return compiled(batch.input_ids, batch.positions)

    if runner.device.type != "cuda":
        return step
    stream = torch.cuda.Stream(runner.device)
    stream.wait_stream(torch.cuda.current_stream(runner.device))
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, then settle allocations before the capture
            step()
    torch.cuda.current_stream(runner.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def time_step(
    step: Callable[[], torch.Tensor], device: torch.device, warmup: int, repeats: int
) -> tuple[float, float, torch.Tensor]:
    """Median and p90 ms of ``step`` on an idle device, and its last output (float32 copy)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    times, out = [], None
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            out = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
    p90 = sorted(times)[max(0, math.ceil(0.9 * len(times)) - 1)]
    return statistics.median(times), p90, out.float().clone()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights one step reads: every parameter once, except an untied embedding
    table, of which a step reads B rows only.
    """
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return total - (0 if tied else embed.numel() * embed.element_size())


def device_copy_gb_s(device: torch.device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median over CUDA
    events: what the weight bandwidth of a decode step is measured against, in the same run.
    """
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return 2 * nbytes / statistics.median(times[3:]) / 1e6


def print_steps(result: dict) -> None:
    print(
        f"\ndecode step (decoder + LM head), {result['model']}, {result['dtype']}, "
        f"{result['context']} tokens of context, {result['device']}; "
        f"weights {result['weight_bytes'] / 1e9:.3g} GB"
    )
    print(
        f"{'batch':>5} {'mode':>6} {'median ms':>10} {'p90 ms':>8} {'tok/s':>9} "
        f"{'weight GB/s':>12} {'rel err':>8}"
    )
    for r in result["steps"]:
        err = "-" if r["rel_err_vs_eager"] is None else f"{r['rel_err_vs_eager']:.1e}"
        print(
            f"{r['batch']:>5} {r['mode']:>6} {r['median_ms']:>10.3f} {r['p90_ms']:>8.3f} "
            f"{r['tok_s']:>9.1f} {r['weight_gb_s']:>12.1f} {err:>8}"
        )
    copy = result.get("device_copy_gb_s")
    if copy:
        print(
            f"device copy {copy:.1f} GB/s in this run; weight bandwidth as a fraction of it: "
            + ", ".join(
                f"{r['mode']} batch {r['batch']} {r['copy_fraction']:.1%}"
                for r in result["steps"]
                if r["mode"] != "eager"
            )
        )


# vs transformers -------------------------------------------------------------------------------


def _time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_pcgspec(llm, prompts: list[str], new_tokens: int, repeats: int) -> float:
    from pcgspec import SamplingParams

    def run(n: int):
        return lambda: llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False
        )

    t_n, t_1 = _time(run(new_tokens), repeats), _time(run(1), repeats)
    return len(prompts) * (new_tokens - 1) / (t_n - t_1)


def bench_hf(model, tok, prompts: list[str], new_tokens: int, repeats: int) -> float:
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)

    def run(n: int):
        def go():
            with torch.inference_mode():
                model.generate(
                    **enc,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=tok.pad_token_id,
                )

        return go

    t_n, t_1 = _time(run(new_tokens), repeats), _time(run(1), repeats)
    return len(prompts) * (new_tokens - 1) / (t_n - t_1)


def bench_vs_transformers(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from pcgspec import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    cfg = llm.config
    model_dir = llm.engine.model_dir
    hf = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=cfg.torch_dtype)
        .to(cfg.torch_device)
        .eval()
    )
    rows = []
    for bs in args.batch_sizes:
        prompts = (PROMPTS * (bs // len(PROMPTS) + 1))[:bs]
        ours = bench_pcgspec(llm, prompts, args.new_tokens, args.repeats)
        theirs = bench_hf(hf, llm.get_tokenizer(), prompts, args.new_tokens, args.repeats)
        rows.append(
            {"batch": bs, "pcgspec_tok_s": ours, "hf_tok_s": theirs, "ratio": ours / theirs}
        )
    result = {
        **header(args, cfg.torch_device, cfg.torch_dtype, model_dir.name),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": rows,
    }
    print(f"\ndecode tokens/s, {model_dir.name}, {cfg.torch_dtype}, {result['device']}")
    print(f"{'batch':>5} {'pcgspec':>10} {'transformers':>13} {'ratio':>7}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['pcgspec_tok_s']:>10.1f} {r['hf_tok_s']:>13.1f} "
            f"{r['ratio']:>6.2f}x"
        )
    return result


if __name__ == "__main__":
    main()
