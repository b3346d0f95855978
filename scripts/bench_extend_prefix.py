"""The extend attention kernel over a cached prefix: the prefix whole against cut into pieces.

A prefix-cache hit or a chat's next turn extends a few new tokens over a long cached prefix.
Per case (model heads, requests, prefix and new lengths) it times one layer's
``extend_attention`` as ``plan_extend`` plans it from the prefix and the GPU's SM count
(``auto``), with the prefix whole (``whole``), and with each ``--splits`` count; prints each
against ``whole`` and the largest difference of any variant's output from ``whole``'s.

Timing: ``--repeats`` groups of ``--launches`` back-to-back launches after a warm-up; on CUDA
the GPU time per launch from CUDA events, the host queuing all of a group behind a sleep
kernel first (so the time is the kernels', not the host's), and the host's time per launch;
medians over the groups. On CPU (the Triton interpreter) the wall time, for smoke tests only.

    python scripts/bench_extend_prefix.py \
        --out bench/results/extend_prefix_splits_h100_$(date +%F).json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from pcgspec.kernels.attention import decode_workspace
from pcgspec.kernels.extend_attention import extend_attention, plan_extend

HEADS = {  # query heads, KV heads, head dim
    "smollm2-135m": (9, 3, 64),
    "llama-3.2-1b": (32, 8, 64),
    "tiny": (4, 2, 16),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    p.add_argument(
        "--shapes", default="smollm2-135m,llama-3.2-1b", help=f"comma-separated, of {sorted(HEADS)}"
    )
    p.add_argument("--requests", default="1,16", help="requests per pass")
    p.add_argument("--prefix", default="2000,500", help="cached tokens per request")
    p.add_argument("--new", type=int, default=32, help="new tokens per request")
    p.add_argument("--splits", default="2,4,8,16", help="forced piece counts, also timed")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--launches", type=int, default=100, help="per timed group")
    p.add_argument("--out", default=None, help="write the JSON summary here")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in HEADS]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {sorted(HEADS)}")
    args.requests, args.prefix, args.splits = (
        _ints(args.requests),
        _ints(args.prefix),
        _ints(args.splits),
    )
    if min(args.requests + [args.new, args.repeats, args.launches]) < 1 or min(args.prefix) < 0:
        p.error("requests, --new, --repeats and --launches must be >= 1, prefixes >= 0")
    return args


def _time(
    fn: Callable[[], None], device: torch.device, args: argparse.Namespace
) -> dict[str, float]:
    """Median microseconds per launch: device (CUDA events) and host."""
    for _ in range(args.warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    device_us, host_us = [], []
    for _ in range(args.repeats):
        if cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda._sleep(20_000_000)  # NOTE: the launches queue up behind it
            start.record()
        t = time.perf_counter()
        for _ in range(args.launches):
            fn()
        host_us.append((time.perf_counter() - t) * 1e6 / args.launches)
        if cuda:
            end.record()
            end.synchronize()
            device_us.append(start.elapsed_time(end) * 1e3 / args.launches)
    out = {"host_us": statistics.median(host_us)}
    if cuda:
        out["device_us"] = statistics.median(device_us)
    return out


def run_case(
    shape: str, requests: int, prefix: int, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """One case: every variant's timing, its piece count and its output's distance to whole."""
    h, kv, d = HEADS[shape]
    dtype, page, new = getattr(torch, args.dtype), args.page_size, args.new
    seq = prefix + new
    per_req = -(-seq // page)
    gen = torch.Generator().manual_seed(requests * 7919 + prefix)
    table = torch.randperm(requests * per_req, generator=gen).to(device, torch.int32)
    table = table.view(requests, per_req)
    k_cache = torch.randn(requests * per_req * page + 1, kv, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(device, dtype)
    rows = requests * new
    q, k, v = (torch.randn(rows, n, d, generator=gen).to(device, dtype) for n in (h, kv, kv))
    pos = torch.arange(prefix, seq, device=device)
    loc = (table[:, pos // page].long() * page + pos % page).reshape(-1)
    seq_lens, ext_lens = (
        torch.full((requests,), x, dtype=torch.int32, device=device) for x in (seq, new)
    )
    start = torch.arange(requests, dtype=torch.int32, device=device) * new
    num_sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 8
    )
    variants = {"auto": None, "whole": 1, **{f"splits_{n}": n for n in args.splits}}
    row: dict[str, Any] = {"shape": shape, "requests": requests, "prefix": prefix, "new": new}
    outs = {}
    for name, forced in variants.items():
        plan = plan_extend(
            [new] * requests,
            rows,
            h,
            kv,
            d,
            dtype,
            page,
            d**-0.5,
            max_prefix=prefix,
            num_sms=num_sms,
            num_splits=forced,
        )
        workspace = (
            decode_workspace(rows, h, d, plan.num_splits, device) if plan.num_splits > 1 else None
        )
        out = torch.empty_like(q)
        launch = functools.partial(
            extend_attention,
            q,
            k,
            v,
            out,
            k_cache,
            v_cache,
            loc,
            table,
            seq_lens,
            ext_lens,
            start,
            plan,
            workspace=workspace,
            check=False,
        )
        row[name] = {"splits": plan.num_splits, **_time(launch, device, args)}
        outs[name] = out.float()
    key = "device_us" if device.type == "cuda" else "host_us"
    for name in variants:
        row[name]["vs_whole"] = row["whole"][key] / row[name][key]
    row["max_abs_diff_vs_whole"] = max(
        (o - outs["whole"]).abs().max().item() for o in outs.values()
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = []
    for shape in args.shapes:
        for requests in args.requests:
            for prefix in args.prefix:
                row = run_case(shape, requests, prefix, args, device)
                rows.append(row)
                timings = ", ".join(
                    f"{name} {row[name].get('device_us', row[name]['host_us']):.1f} us "
                    f"({row[name]['splits']}, {row[name]['vs_whole']:.2f}x)"
                    for name in row
                    if isinstance(row[name], dict)
                )
                print(f"{shape} {requests} x ({prefix} + {args.new}): {timings}", flush=True)
    record = {
        "date": datetime.now(timezone.utc).isoformat(),
        "device": (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else f"cpu ({platform.machine()})"
        ),
        "torch": torch.__version__,
        "command": shlex.join(["scripts/bench_extend_prefix.py", *(argv or sys.argv[1:])]),
        "args": vars(args),
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
