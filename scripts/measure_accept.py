"""Accept length of a STANDALONE pair (a small model drafting for a larger one with the same
tokenizer) on the requests of ``serving_datasets.py``, and a lossless check, on the CPU.

Each dataset's first ``--num-requests`` requests go through the chat template in one greedy
batch with every step speculative (``speculative_policy="always"``), k drafts per step. It
reports the mean accept length (accepted drafts + 1 bonus token, per verify step) and, per draft
position j, how often draft j was accepted per verify step and given draft j-1 was. Then the
first ``--lossless-requests`` of each dataset run again on the target alone (same dtype, same
engine), and each output must equal the speculative one token for token; a difference is given
with its position and both tokens, and the plain target's log probabilities of the two tokens
there, in ``--dtype`` and in float32 (in bfloat16 a near-tie between two logits may flip a
token). ``--explain FILE`` adds only those log probabilities to an earlier result.

    OMP_NUM_THREADS=2 python scripts/measure_accept.py --datasets code,chat --num-requests 16 \\
        --out bench/results/accept_standalone_qwen2.5-coder-0.5b-1.5b_cpu_2026-11-28.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_datasets import load  # noqa: E402


def per_position(accepted: list[int], steps: int) -> dict[str, list[float]]:
    """Draft j accepted per verify step, and given draft j-1 was accepted."""
    given = [steps, *accepted[:-1]]
    return {
        "per_step": [round(a / steps, 4) for a in accepted],
        "given_previous": [round(a / g, 4) if g else 0.0 for a, g in zip(accepted, given)],
    }


def spec_run(llm: Any, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """One greedy batch of ``prompts``; the accept counters summed over its requests."""
    from pcgspec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = sum(o.metrics.spec_verify_steps for o in outs)
    accepted = [sum(col) for col in zip(*(o.metrics.spec_accepted_per_position for o in outs))]
    return {
        "requests": len(prompts),
        "verify_steps": steps,
        "accepted_draft_tokens": sum(accepted),
        "accept_length": round((sum(accepted) + steps) / steps, 4),
        "accepted_per_position": accepted,
        "acceptance_per_position": per_position(accepted, steps),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": round(seconds, 1),
        "per_request_accept_length": [round(o.metrics.avg_spec_accept_length, 3) for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
    }


def first_difference(spec: list[int], plain: list[int]) -> dict[str, Any] | None:
    """Where two outputs part, with both tokens there; None when they are equal."""
    if spec == plain:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain))
    )
    return {
        "position": at,
        "speculative_token": spec[at] if at < len(spec) else None,
        "plain_token": plain[at] if at < len(plain) else None,
        "speculative_tokens": len(spec),
        "plain_tokens": len(plain),
    }


def next_token_logprobs(llm: Any, ids: list[int], tokens: list[int]) -> dict[str, float | None]:
    """The target's log probability of each of ``tokens`` right after ``ids`` (None: outside
    its top 20)."""
    from pcgspec import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    top = out.logprobs[0]
    return {str(t): round(top[t].logprob, 4) if t in top else None for t in tokens}


def explain_differences(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Adds to each difference the plain target's log probabilities of both tokens where the
    outputs part, in ``--dtype`` and in float32: a near-tie shows as two close values."""
    from pcgspec.llm import chat_prompt

    differences = result["lossless"]["differences"]
    if not differences:
        return
    for dtype in dict.fromkeys([args.dtype, "float32"]):
        llm = build(argparse.Namespace(**vars(args) | {"dtype": dtype}), None, max_running=1)
        for row in differences:
            message = [{"role": "user", "content": load(row["dataset"])[row["request"]]}]
            diff = row["difference"]
            spec = result["datasets"][row["dataset"]]["token_ids"][row["request"]]
            ids = chat_prompt(llm.engine.tokenizer, message)[1] + spec[: diff["position"]]
            tokens = [diff["speculative_token"], diff["plain_token"]]
            row.setdefault("logprobs", {})[dtype] = next_token_logprobs(llm, ids, tokens)
        del llm
        gc.collect()


def build(args: argparse.Namespace, draft_dir: str | None, max_running: int) -> Any:
    """The target on the CPU; speculating with the model in ``draft_dir`` unless it is None."""
    from pcgspec import LLM

    spec = {}
    if draft_dir is not None:
        spec = {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": draft_dir,
            "speculative_num_steps": args.k,
            "speculative_policy": "always",
        }
    return LLM(
        args.target,
        dtype=args.dtype,
        device="cpu",
        cpu_threads=args.cpu_threads,
        max_running_requests=max_running,
        **spec,
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pcgspec.models.loader import resolve_model_dir

    draft_dir = str(resolve_model_dir(args.draft))
    prompts = {d: load(d)[: args.num_requests] for d in args.datasets}
    llm = build(args, draft_dir, max_running=args.num_requests)
    runs = {d: spec_run(llm, p, args.max_tokens) for d, p in prompts.items()}
    del llm
    gc.collect()
    checked = [(d, i) for d in args.datasets for i in range(args.lossless_requests)]
    plain = build(args, None, max_running=len(checked))
    from pcgspec import SamplingParams

    outs = plain.chat(
        [[{"role": "user", "content": prompts[d][i]}] for d, i in checked],
        SamplingParams(temperature=0, max_tokens=args.max_tokens),
        use_tqdm=False,
    )
    rows = [
        {"dataset": d, "request": i, "difference": first_difference(runs[d]["token_ids"][i], ids)}
        for (d, i), ids in zip(checked, (list(o.outputs[0].token_ids) for o in outs))
    ]
    result = {
        "draft_model_dir": draft_dir,
        "datasets": runs,
        "lossless": {
            "requests": len(rows),
            "equal": sum(r["difference"] is None for r in rows),
            "tokens_compared": sum(len(runs[d]["token_ids"][i]) for d, i in checked),
            "differences": [r for r in rows if r["difference"] is not None],
        },
    }
    del plain
    gc.collect()
    explain_differences(args, result)
    return result


def command(argv: list[str] | None) -> str:
    """How this script was called: its path and ``argv`` (else the process's arguments)."""
    return "python " + " ".join(sys.argv[:1] + (sys.argv[1:] if argv is None else argv))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a name or a path")
    parser.add_argument("--datasets", type=lambda s: s.split(","), default=["code", "chat"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--lossless-requests", type=int, default=4, help="per dataset")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="drafts per step")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cpu-threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument(
        "--explain",
        type=Path,
        default=None,
        help="only add the log probabilities at each difference to this result file",
    )
    args = parser.parse_args(argv)
    if args.explain is not None:
        result = json.loads(args.explain.read_text())
        explain_differences(args, result)
        result["explain_command"] = command(argv)
        args.explain.write_text(json.dumps(result, indent=2) + "\n")
        return result
    start = time.perf_counter()
    result = measure(args)
    header = {
        "command": command(argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": f"CPU, {args.cpu_threads} threads",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "target": args.target,
        "draft": args.draft,
        "k": args.k,
        "max_tokens": args.max_tokens,
        "policy": "always (every decode step speculates)",
        "wall_s": round(time.perf_counter() - start, 1),
    }
    text = json.dumps(header | result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return header | result


if __name__ == "__main__":
    main()
