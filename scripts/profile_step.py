"""Where the host time of one prefill step goes: cProfile over repeated piecewise steps, and
the Triton launches each decoder layer makes.

    python scripts/profile_step.py --shape smollm2-135m --tokens 16 --steps 200
    python scripts/profile_step.py --attention-backend triton --steps 2   # CPU: interpreted
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
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
from bench_ttft import engine_config, prefill_batch  # noqa: E402

from pcgspec.kernels.launches import count_triton_launches  # noqa: E402
from pcgspec.models.random_weights import random_model  # noqa: E402
from pcgspec.runners.model_runner import ModelRunner  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eager", action="store_true", help="profile the eager path instead")
    p.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                   help="default: triton on CUDA, torch elsewhere")  # fmt: skip
    p.add_argument("--top", type=int, default=35)
    return p.parse_args()


def report_launches(step: Callable[[], None], num_layers: int) -> None:
    with count_triton_launches() as counts:
        step()
    total = sum(counts.values())
    kernels = ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())) or "none"
    print(f"Triton launches per step: {total} ({kernels}); per layer: {total / num_layers:.2f}")


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, dtype, device)
    ns = argparse.Namespace(device=str(device), dtype=str(dtype).split(".")[-1],
                            piecewise_cuda_graph_max_tokens=None)  # fmt: skip
    config = engine_config(ns, args.tokens + 16, not args.eager)
    config = dataclasses.replace(config, attention_backend=args.attention_backend)
    runner = ModelRunner(config, model=model)
    tokens = torch.randint(0, model.vocab_size, (args.tokens,), device=device)

    def step() -> None:
        runner.forward(prefill_batch(tokens, runner.page_size, device))

    def steps(n: int) -> None:
        for _ in range(n):
            step()
        torch.cuda.synchronize() if device.type == "cuda" else None

    steps(min(10, args.steps))
    report_launches(step, runner.model.num_layers)
    start = time.perf_counter()
    steps(args.steps)
    print(f"{(time.perf_counter() - start) / args.steps * 1e3:.3f} ms per step (host loop)")
    profile = cProfile.Profile()
    profile.enable()
    steps(args.steps)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
