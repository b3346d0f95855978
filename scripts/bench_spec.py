"""Decode throughput with and without speculative decoding, side by side in one run.

For each batch size: output tokens/s of plain decoding and of each speculative method, with
the average accept length (accepted drafts + 1 bonus per verify step). Prompts ask the model
to repeat text, where prompt lookup (NGRAM) helps; ``--prompts general`` uses open questions.
Medians over repeats; writes JSON.

Drafts: EAGLE3 and NEXTN run untrained heads written in the published layouts (accept length
about 1: they measure the cost of drafting and verifying, not a trained head's gain), unless
``--eagle3-draft`` / ``--nextn-draft`` name checkpoints; STANDALONE runs ``--standalone-draft``,
by default the target itself (every draft accepted: the ceiling of the method).

    python scripts/bench_spec.py --methods NGRAM,STANDALONE,EAGLE3,NEXTN --batch-sizes 1,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

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
# The model copies the passage (code editing, quoting): where prompt lookup (NGRAM) helps.
REPEAT_PROMPTS = [f"Text: {p}\n\nThe same text, copied exactly:\nText: " for p in _PASSAGES]
GENERAL_PROMPTS = ["Explain gravity to a child.", "List three prime numbers:",
                   "Write a haiku about the sea.", "What is 12 times 12?"]


def _time_generate(llm, prompts: list[str], max_tokens: int, repeats: int) -> tuple[float, list]:
    from pcgspec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    rates, outs = [], []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return statistics.median(rates), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: the embedded model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default="NGRAM", help="comma-separated speculative algorithms")
    p.add_argument("--num-steps", type=int, default=4, help="--speculative-num-steps (k)")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", choices=("repeat", "general"), default="repeat")
    p.add_argument("--standalone-draft", default=None, help="default: the target itself")
    p.add_argument("--eagle3-draft", default=UNTRAINED)
    p.add_argument("--nextn-draft", default=UNTRAINED)
    p.add_argument("--out", default="bench/results/spec.json")
    args = p.parse_args()

    from pcgspec import LLM

    methods = [m for m in args.methods.split(",") if m]
    # NOTE: several engines share the device: cap each KV cache instead of letting the first
    # take mem_fraction_static of the whole GPU.
    base = {"dtype": args.dtype, "log_level": "warning", "max_total_tokens": 1 << 16}
    engines = {"none": LLM(args.model, **base)}
    drafts = _draft_paths(args, engines["none"].engine.model_dir, methods)
    for method in methods:
        engines[method] = LLM(args.model, speculative_algorithm=method,
                              speculative_num_steps=args.num_steps,
                              speculative_draft_model_path=drafts.get(method), **base)
    pool = REPEAT_PROMPTS if args.prompts == "repeat" else GENERAL_PROMPTS
    rows = []
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        prompts = (pool * (bs // len(pool) + 1))[:bs]
        plain = None
        for name, llm in engines.items():
            rate, outs = _time_generate(llm, prompts, args.max_tokens, args.repeats)
            plain = rate if name == "none" else plain
            accept = [o.metrics.avg_spec_accept_length for o in outs]
            accept = [a for a in accept if a is not None]
            rows.append({"batch": bs, "method": name, "tok_s": rate, "speedup": rate / plain,
                         "avg_accept_length": statistics.mean(accept) if accept else None})
    config = engines["none"].config
    device = torch.cuda.get_device_name() if config.torch_device.type == "cuda" else "CPU"
    model = engines["none"].engine.model_dir.name
    print(f"\ndecode tokens/s, {model}, {config.torch_dtype}, {device}, k={args.num_steps}, "
          f"{args.prompts} prompts")
    print(f"{'batch':>5} {'method':>8} {'tok/s':>9} {'speedup':>8} {'accept len':>11}")
    for r in rows:
        acc = f"{r['avg_accept_length']:.2f}" if r["avg_accept_length"] is not None else "-"
        print(f"{r['batch']:>5} {r['method']:>8} {r['tok_s']:>9.1f} {r['speedup']:>7.2f}x "
              f"{acc:>11}")
    result = {"date": datetime.now(timezone.utc).isoformat(), "device": device,
              "torch": torch.__version__, "model": model, "dtype": str(config.torch_dtype),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "num_steps": args.num_steps, "prompts": args.prompts, "drafts": drafts,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


def _draft_paths(args: argparse.Namespace, target_dir: Path, methods: list[str]) -> dict:
    """Draft folder per model-based method; untrained heads are written to a temp folder."""
    import tempfile

    from pcgspec.models.eagle3 import write_eagle3_checkpoint
    from pcgspec.models.loader import load_config
    from pcgspec.models.mtp import write_mtp_checkpoint

    config, root = load_config(target_dir), Path(tempfile.mkdtemp(prefix="pcgspec-drafts-"))
    paths = {"STANDALONE": args.standalone_draft or str(target_dir)}
    if args.eagle3_draft == UNTRAINED:
        paths["EAGLE3"] = str(write_eagle3_checkpoint(root / "eagle3", config, seed=0))
    else:
        paths["EAGLE3"] = args.eagle3_draft
    if args.nextn_draft == UNTRAINED:
        paths["NEXTN"] = str(write_mtp_checkpoint(root / "mtp", config, seed=0))
    else:
        paths["NEXTN"] = args.nextn_draft
    return {m: paths[m] for m in methods if m in paths}


if __name__ == "__main__":
    main()
