"""Greedy speculative output against plain decoding, with every divergence's near-tie measured.

Runs the default model (or ``--model``) on the first ``--num-requests`` chat requests of the
``chat`` dataset through the chat template, plain and then with each speculative configuration
(the shipped EAGLE3 head as a chain and as a draft tree by default), greedy, ``--max-tokens``
each, in ``--dtype``. Where a configuration's tokens first differ from plain decoding's, the
model itself (transformers, same dtype) scores the plain prefix: the two tokens and the gap
between its top two logits say whether the divergence is a tie of that precision (a gap of zero
or one rounding step) rather than a fault.

With ``--served FILE`` (a ``bench_serving.py`` result) nothing is generated: the texts of its
text check are scored instead, each configuration's against the first configuration's, on the
requests' chat prompts, after re-tokenizing the texts.

    python scripts/check_spec_ties.py --dtype bfloat16 --out ties.json
    python scripts/check_spec_ties.py --served bench/results/served_x.json --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_datasets import load  # noqa: E402

CONFIGS = {
    "chain": {"speculative_num_steps": 3},
    "tree": {
        "speculative_num_steps": 5,
        "speculative_eagle_topk": 4,
        "speculative_num_draft_tokens": 16,
    },
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model folder (default: the default model)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--configs", default="chain,tree", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--served", default=None, help="score a bench_serving.py text check")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if args.served:
        return _report(args, argv, served_ties(args.served, args.model, args.dtype))
    from pcgspec import LLM, SamplingParams
    from pcgspec.llm import chat_prompt
    from pcgspec.models.default_model import default_model_path

    path = args.model or str(default_model_path())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts: list[list[int]] = []

    def generate(**kw: object) -> list[list[int]]:
        llm = LLM(path, dtype=args.dtype, device=args.device, **kw)
        tok = llm.get_tokenizer()
        if not prompts:
            for text in load("chat")[: args.num_requests]:
                prompts.append(chat_prompt(tok, [{"role": "user", "content": text}])[1])
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    want = generate()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    results = {}
    for name in args.configs.split(","):
        got = generate(speculative_algorithm="EAGLE3", speculative_policy="always", **CONFIGS[name])
        results[name] = [_compare(hf, q, w, g) for q, w, g in zip(prompts, want, got)]
        for i, row in enumerate(results[name]):
            print(name, i, row)
    return _report(args, argv, {"configs": {n: CONFIGS[n] for n in results}, "results": results})


def _report(args: argparse.Namespace, argv: list[str] | None, body: dict) -> dict:
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "device": f"{platform.machine()} CPU" if args.device == "cpu" else args.device,
        "torch": torch.__version__,
        "command": "scripts/check_spec_ties.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "dtype": args.dtype,
        **body,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


def served_ties(served: str, model: str | None, dtype: str) -> dict:
    """Where each configuration's text-check texts in a ``bench_serving.py`` result first depart
    from the first configuration's, scored by the model (transformers, ``dtype``) on the plain
    prefix; texts are re-tokenized, so a divergence is placed at the first differing token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pcgspec.llm import chat_prompt
    from pcgspec.models.default_model import default_model_path

    path = model or str(default_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    checks = json.loads(Path(served).read_text())["text_check"]
    results: dict[str, dict[str, list[dict]]] = {}
    for dataset, by_config in checks.items():
        base_name, *others = by_config
        base = by_config[base_name]["texts"]
        prompts = [
            chat_prompt(tok, [{"role": "user", "content": text}])[1]
            for text in load(dataset)[: len(base)]
        ]
        for name in others:
            rows = [
                _compare(hf, q, _ids(tok, w), _ids(tok, g))
                for q, w, g in zip(prompts, base, by_config[name]["texts"])
            ]
            results.setdefault(name, {})[dataset] = rows
            for i, row in enumerate(rows):
                print(f"{name} vs {base_name}", dataset, i, row)
    return {"served": served, "results": results}


def _ids(tok: object, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


@torch.inference_mode()
def _compare(hf: object, prompt: list[int], want: list[int], got: list[int]) -> dict:
    j = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if j is None:
        return {"equal": len(want) == len(got), "tokens": len(want)}
    logits = hf(torch.tensor([prompt + want[:j]])).logits[0, -1].float()  # type: ignore[operator]
    top = torch.topk(logits, 2)
    return {
        "equal": False,
        "at": j,
        "plain": want[j],
        "speculative": got[j],
        "top2": top.indices.tolist(),
        "top2_gap": float(top.values[0] - top.values[1]),
    }


if __name__ == "__main__":
    main()
