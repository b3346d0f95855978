"""Decode throughput of pcgspec next to transformers ``generate``: same model, dtype, batch.

Decode tokens/s = B * (N - 1) / (t(N new tokens) - t(1 new token)), for both engines, so the
prefill cancels out. Medians over repeats. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

PROMPTS = ["The capital of France is", "def quicksort(xs):", "Once upon a time",
           "List the planets:", "The quick brown fox", "Explain gravity simply.",
           "1, 2, 3,", "import numpy as np"]


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_pcgspec(llm, prompts: list[str], new_tokens: int, repeats: int) -> float:
    from pcgspec import SamplingParams

    def run(n: int):
        return lambda: llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n,
                                                            ignore_eos=True), use_tqdm=False)
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
                model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.pad_token_id)
        return go
    t_n, t_1 = _time(run(new_tokens), repeats), _time(run(1), repeats)
    return len(prompts) * (new_tokens - 1) / (t_n - t_1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/decode.json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from pcgspec import LLM

    llm = LLM(args.model, dtype=args.dtype)
    cfg = llm.config
    model_dir = llm.engine.model_dir
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=cfg.torch_dtype).to(
        cfg.torch_device).eval()
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = (PROMPTS * (bs // len(PROMPTS) + 1))[:bs]
        ours = bench_pcgspec(llm, prompts, args.new_tokens, args.repeats)
        theirs = bench_hf(hf, llm.get_tokenizer(), prompts, args.new_tokens, args.repeats)
        rows.append({"batch": bs, "pcgspec_tok_s": ours, "hf_tok_s": theirs,
                     "ratio": ours / theirs})
    device = (torch.cuda.get_device_name() if cfg.torch_device.type == "cuda"
              else f"CPU ({platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads)")
    print(f"\ndecode tokens/s, {model_dir.name}, {cfg.torch_dtype}, {device}")
    print(f"{'batch':>5} {'pcgspec':>10} {'transformers':>13} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['pcgspec_tok_s']:>10.1f} {r['hf_tok_s']:>13.1f} "
              f"{r['ratio']:>6.2f}x")
    result = {"date": datetime.now(timezone.utc).isoformat(), "device": device,
              "torch": torch.__version__, "model": model_dir.name, "dtype": str(cfg.torch_dtype),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
