"""Where the host time of one prefill step goes: cProfile over repeated piecewise steps.

    python scripts/profile_step.py --shape smollm2-135m --tokens 16 --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ttft import engine_config, prefill_batch  # noqa: E402

from pcgspec.models.random_weights import random_model  # noqa: E402
from pcgspec.runners.model_runner import ModelRunner  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eager", action="store_true", help="profile the eager path instead")
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, dtype, device)
    ns = argparse.Namespace(device=str(device), dtype=str(dtype).split(".")[-1],
                            piecewise_cuda_graph_max_tokens=None)
    runner = ModelRunner(engine_config(ns, args.tokens + 16, not args.eager), model=model)
    tokens = torch.randint(0, model.vocab_size, (args.tokens,), device=device)

    def step() -> None:
        runner.forward(prefill_batch(tokens, runner.page_size, device))

    for _ in range(10):
        step()
    torch.cuda.synchronize() if device.type == "cuda" else None
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize() if device.type == "cuda" else None
    print(f"{(time.perf_counter() - start) / args.steps * 1e3:.3f} ms per step (host loop)")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
