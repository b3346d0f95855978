"""Tensor parallelism against its targets, random weights (default: Qwen3-8B shape, bf16).

  startup  ModelRunner construction at TP=1 and TP=N: spawn, load, compile, capture (rank 0's
           wall clock; each TP size in a fresh process)      target: TP=N <= 1.3x TP=1
  decode   one decode step at batch 1, decode CUDA graph, rank 0 broadcasting the batch as the
           engine does                                         target: TP=2 <= 0.65x TP=1
                                                                       TP=4 <= 0.45x
  decode_bs32  the same at batch 32                            target: TP=2 <= 0.6x TP=1
  prefill  one prefill of --prefill-tokens tokens through the piecewise graphs
                                                               target: TP=2 <= 0.58x TP=1
                                                                       TP=4 <= 0.35x
  whole    at TP=N, piecewise vs the same step compiled whole (fullgraph, one CUDA graph), at
           --whole-tokens lengths; every rank runs the step itself (SPMD, no broadcast)
                                                               target: piecewise <= 1.25x whole
  decode_spmd  (diagnostic) the decode step of TP=N with every rank running it itself: against
           ``decode``, what rank 0's per-step broadcast costs; against TP=1, the collectives
The ratios of the engine parts are written to --out before the SPMD part starts (its whole-step
compiles are the slow part), so a run stopped there keeps them (``"complete": false``).
Timing is bench_ttft's: warm-up, then CUDA events around each step on rank 0, median and p90
(perf_counter on CPU, for smoke runs only). Caches: inductor's live under PCGSPEC_CACHE_DIR (one
per rank at TP>1), Triton's under TRITON_CACHE_DIR; point both at empty folders for cold starts.

    NCCL_NVLS_ENABLE=0 python scripts/bench_tp.py --tp-size 2 \\
        --out bench/results/tp_bench_qwen3-8b-shape_h200x2_$(date +%F).json
    NCCL_NVLS_ENABLE=0 python scripts/bench_tp.py --tp-size 2 --symm-mem-max-bytes 524288 \\
        --out bench/results/tp_bench_qwen3-8b-shape_h200x2_$(date +%F)_one_shot.json
    NCCL_NVLS_ENABLE=0 python scripts/bench_tp.py --tp-size 2 --whole-tokens ""  # no SPMD part
    python scripts/bench_tp.py --device cpu --shape tiny --prefill-tokens 64 \\
        --whole-tokens 16,32 --context 64 --warmup 1 --repeats 2       # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from datetime import datetime, timezone
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.multiprocessing as mp
from bench_decode import decode_batch
from bench_ttft import Timing, device_name, prefill_batch, time_bound, time_steps

from pcgspec.config import EngineConfig
from pcgspec.distributed.launcher import rank_device
from pcgspec.distributed.process_group import (
    Rendezvous,
    TPProcessGroups,
    disable_nvlink_multicast,
)
from pcgspec.models.random_weights import SHAPES, RandomWeights, shape_config
from pcgspec.runners.model_runner import ModelRunner

LARGE_BATCH = 32  # the second decode step's batch
TARGETS = {  # TP=N over TP=1 (piecewise_over_whole: at TP=N), by N
    2: {
        "startup": 1.3,
        "decode": 0.65,
        "decode_bs32": 0.6,
        "prefill": 0.58,
        "piecewise_over_whole": 1.25,
    },
    4: {"startup": 1.3, "decode": 0.45, "prefill": 0.35, "piecewise_over_whole": 1.25},
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-8b", choices=list(SHAPES))
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--context", type=int, default=1024, help="tokens before the decode step")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument(
        "--whole-tokens",
        default="16,128,512,2048",
        help="lengths compiled whole (each compile is slow); empty: no SPMD part",
    )
    p.add_argument(
        "--bound-backend",
        default=None,
        help="torch.compile backend of the whole step (default: inductor on CUDA, "
        "aot_eager on CPU)",
    )
    p.add_argument(
        "--symm-mem-max-bytes",
        type=int,
        default=0,
        help="all-reduces up to this many bytes take the one-shot path over symmetric memory "
        "(CUDA, one host; sets PCGSPEC_TP_SYMM_MEM_MAX_BYTES for every process; 0: NCCL only)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = p.parse_args(argv)
    args.whole_tokens = [int(x) for x in args.whole_tokens.split(",") if x]
    if args.tp_size < 2 or min(args.whole_tokens, default=2) < 2 or args.repeats < 1:
        p.error("--tp-size >= 2, --whole-tokens >= 2 and --repeats >= 1")
    args.command = " ".join(sys.argv)
    return args


def engine_config(
    args: argparse.Namespace, tp: int, max_tokens: int, decode_graphs: bool
) -> EngineConfig:
    """KV for one prompt of ``max_tokens`` or ``LARGE_BATCH`` decode requests of
    ``--context`` on pages of their own (the timed steps need the shapes, not cached values).
    """
    pages = max(-(-max_tokens // 16), LARGE_BATCH * -(-(args.context + 1) // 16))
    return EngineConfig(
        device=args.device,
        dtype=args.dtype,
        tp_size=tp,
        page_size=16,
        max_total_tokens=pages * 16,
        cuda_graph_max_bs=LARGE_BATCH,
        disable_cuda_graph=not decode_graphs,
        piecewise_cuda_graph_max_tokens=max_tokens,
    )


def tokens(args: argparse.Namespace, n: int) -> torch.Tensor:
    vocab = shape_config(args.shape).vocab_size
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(args.seed))


def time_decode(args: argparse.Namespace, runner: ModelRunner, bs: int) -> Timing:
    """One decode step of ``bs`` requests at ``--context``, timed."""
    batch = decode_batch(bs, args.context, runner)
    return time_steps(
        lambda b: runner.forward(b).logits, lambda: batch, runner.device, args.warmup, args.repeats
    )


def engine_part(args: argparse.Namespace, tp: int, results: mp.Queue) -> None:
    """Startup, decode and prefill through the engine's runner (rank 0 spawns the workers)."""
    disable_nvlink_multicast()
    start = time.perf_counter()
    runner = ModelRunner(
        engine_config(args, tp, args.prefill_tokens, True), RandomWeights(args.shape, args.seed)
    )
    startup = time.perf_counter() - start
    device, page = runner.device, runner.page_size
    decode = {bs: time_decode(args, runner, bs) for bs in (1, LARGE_BATCH)}
    prompt = tokens(args, args.prefill_tokens)
    prefill = time_steps(
        lambda b: runner.forward(b).logits,
        lambda: prefill_batch(prompt, page, device),
        device,
        args.warmup,
        args.repeats,
    )
    results.put(
        {
            "tp": tp,
            "startup_s": startup,
            "decode_bs1": decode[1].summary(),
            "decode_bs32": decode[LARGE_BATCH].summary(),
            "prefill": prefill.summary(),
            "device": device_name(device),
            "decode_graph_stats": runner.decode_graphs and runner.decode_graphs.stats(),
            "piecewise_stats": runner.piecewise and runner.piecewise.stats(),
        }
    )
    runner.shutdown()


def spmd_part(
    args: argparse.Namespace, rendezvous: Rendezvous, rank: int, results: mp.Queue
) -> None:
    """Every rank: piecewise and whole-graph steps at each length, then the decode step, in
    the same order.
    """
    config = engine_config(args, args.tp_size, max(args.whole_tokens), True)
    groups = TPProcessGroups(rendezvous, rank, rank_device(config, rank))
    runner = ModelRunner(config, RandomWeights(args.shape, args.seed), tp_groups=groups)
    device, page = runner.device, runner.page_size
    prompt, rows = tokens(args, max(args.whole_tokens)), []
    for n in args.whole_tokens:
        piecewise = time_steps(
            lambda b: runner.forward(b).logits,
            lambda n=n: prefill_batch(prompt[:n], page, device),
            device,
            args.warmup,
            args.repeats,
        )
        whole = time_bound(runner, prompt[:n], args)
        rows.append(
            {
                "tokens": n,
                "piecewise": piecewise.summary(),
                "whole": whole.summary(),
                "piecewise_over_whole": piecewise.median_ms / whole.median_ms,
            }
        )
    decode = time_decode(args, runner, 1)
    if rank == 0:
        results.put(
            {"tp": args.tp_size, "whole_vs_piecewise": rows, "decode_bs1_spmd": decode.summary()}
        )
    groups.destroy()


def run(target, *args: object) -> dict:  # noqa: ANN001
    """``target(*args, queue)`` in a fresh process; its result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    return collect([ctx.Process(target=target, args=(*args, results))], results)


def run_spmd(args: argparse.Namespace) -> dict:
    """``spmd_part`` in one fresh process per rank; rank 0's result."""
    ctx = mp.get_context("spawn")
    results, rendezvous = ctx.Queue(), Rendezvous.local(args.tp_size)
    return collect(
        [
            ctx.Process(target=spmd_part, args=(args, rendezvous, r, results))
            for r in range(args.tp_size)
        ],
        results,
    )


def collect(procs: list[BaseProcess], results: mp.Queue) -> dict:
    """Start ``procs`` and wait for the one result; any of them failing stops them all."""
    for proc in procs:
        proc.start()
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a benchmark process failed: exit codes {failed}") from None
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    disable_nvlink_multicast()  # NOTE: before any spawn: the children inherit it
    os.environ["PCGSPEC_TP_SYMM_MEM_MAX_BYTES"] = str(args.symm_mem_max_bytes)
    if args.bound_backend is None:
        cuda = EngineConfig(device=args.device).torch_device.type == "cuda"
        args.bound_backend = "inductor" if cuda else "aot_eager"
    single = run(engine_part, args, 1)
    split = run(engine_part, args, args.tp_size)
    result = report(args, single, split)
    if args.whole_tokens:
        result = report(args, single, split, run_spmd(args))
    return result


def report(args: argparse.Namespace, single: dict, split: dict, whole: dict | None = None) -> dict:
    """The ratios of the parts run so far, printed and written to ``--out`` (after the engine
    parts, before the slow SPMD part: a run stopped there still leaves its numbers).
    """
    ratios = {
        "startup": split["startup_s"] / single["startup_s"],
        "decode": split["decode_bs1"]["median_ms"] / single["decode_bs1"]["median_ms"],
        "decode_bs32": split["decode_bs32"]["median_ms"] / single["decode_bs32"]["median_ms"],
        "prefill": split["prefill"]["median_ms"] / single["prefill"]["median_ms"],
    }
    diagnostics = {}
    if whole is not None:
        rows = whole["whole_vs_piecewise"]
        ratios["piecewise_over_whole"] = max(r["piecewise_over_whole"] for r in rows)
        spmd = whole["decode_bs1_spmd"]["median_ms"]
        diagnostics = {  # where the decode step's time goes: the broadcast, the collectives
            "decode_spmd": spmd / single["decode_bs1"]["median_ms"],
            "decode_over_spmd": split["decode_bs1"]["median_ms"] / spmd,
        }
    targets = {k: v for k, v in TARGETS.get(args.tp_size, {}).items() if k in ratios}
    result = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": single["device"],
        "torch": torch.__version__,
        "command": args.command,
        "model": args.shape,
        "dtype": args.dtype,
        "tp_size": args.tp_size,
        "symm_mem_max_bytes": args.symm_mem_max_bytes,
        "context": args.context,
        "prefill_tokens": args.prefill_tokens,
        "runs": [single, split],
        **(whole or {}),
        "complete": whole is not None or not args.whole_tokens,
        "ratios": ratios,
        "diagnostics": diagnostics,
        "targets": targets,
        "met": {k: ratios[k] <= targets[k] for k in targets},
    }
    for key, ratio in ratios.items():
        print(f"{key:>22}: {ratio:6.3f} (target <= {targets.get(key, '-')})")
    if diagnostics:
        print(
            f"{'decode_spmd':>22}: {diagnostics['decode_spmd']:6.3f} (TP={args.tp_size} decode "
            f"without the broadcast, over TP=1)"
        )
        print(
            f"{'decode_over_spmd':>22}: {diagnostics['decode_over_spmd']:6.3f} (the engine's "
            f"TP={args.tp_size} decode over the SPMD one)"
        )
    elif args.whole_tokens:
        print(f"the SPMD part (whole graphs at {args.whole_tokens} tokens) follows")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
