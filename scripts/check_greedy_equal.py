"""Greedy output of a named model through pcgspec against transformers loading the same GGUF
file itself (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``, float32, CPU), on
chat prompts through the chat template (``--plain``: text prompts for a base model, one of them
longer than Gemma 3's 512-token sliding window), both stopping on the model's stop tokens.

    python scripts/check_greedy_equal.py qwen2.5-coder-0.5b-instruct --max-tokens 64 \\
        --out bench/results/greedy_equal_qwen2.5-coder-0.5b_cpu_2026-11-28.json
    python scripts/check_greedy_equal.py gemma-3-270m --plain --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Held out: none of these is in a test or in the catalog's sources.
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What does the `yield` keyword do in Python? Answer in two sentences.",
    "Write a SQL query that counts the orders per customer in a table orders(customer_id, id).",
    "Explain the difference between a list and a tuple in Python.",
)

# For base models: text to continue; the last is a long list, past a 512-token window.
PLAIN_PROMPTS = (
    "The three largest rivers in Europe are",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "A recipe for pancakes needs flour, eggs,",
    "Prime numbers below 1000: "
    + ", ".join(str(n) for n in range(2, 700) if all(n % d for d in range(2, n)))
    + ",",
)


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    from pcgspec.llm import chat_prompt

    return chat_prompt(tokenizer, [{"role": "user", "content": prompt}])[1]


def prompt_ids(tokenizer: Any, prompt: str, plain: bool) -> list[int]:
    return tokenizer.encode(prompt) if plain else chat_ids(tokenizer, prompt)


def hf_greedy(hf: Any, ids: list[int], max_tokens: int, stop_ids: list[int]) -> list[int]:
    """transformers' greedy continuation of ``ids``, ending with the stop token if one came."""
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=stop_ids,
        pad_token_id=stop_ids[0],
    )
    return out[0, len(ids) :].tolist()


def load_oracle(name: str, into: Path) -> tuple[Any, Any]:
    """transformers' model and tokenizer from the named model's GGUF file, joined into ``into``
    from the downloaded parts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pcgspec.models.catalog import find_model
    from pcgspec.models.fetch import join_parts

    source = find_model(name)
    if source is None:
        raise ValueError(f"unknown model name {name!r}")
    gguf = join_parts(source, into)
    hf = AutoModelForCausalLM.from_pretrained(into, gguf_file=gguf.name, dtype=torch.float32)
    return hf.eval(), AutoTokenizer.from_pretrained(into, gguf_file=gguf.name)


def compare(
    name: str, prompts: tuple[str, ...], max_tokens: int, plain: bool = False
) -> dict[str, Any]:
    """Each prompt's greedy tokens from pcgspec and from transformers, and where they differ."""
    from pcgspec import LLM, SamplingParams

    llm = LLM(name, dtype="float32", device="cpu")
    tokenizer = llm.engine.tokenizer
    stop_ids = sorted(llm.engine.eos_token_ids)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    if plain:
        ours = llm.generate(list(prompts), params, use_tqdm=False)
    else:
        chats = [[{"role": "user", "content": p}] for p in prompts]
        ours = llm.chat(chats, params, use_tqdm=False)
    with tempfile.TemporaryDirectory() as tmp:
        hf, hf_tokenizer = load_oracle(name, Path(tmp))
        rows = []
        for prompt, out in zip(prompts, ours):
            ids = prompt_ids(tokenizer, prompt, plain)
            theirs = hf_greedy(hf, ids, max_tokens, stop_ids)
            mine = list(out.outputs[0].token_ids)
            first_diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
            rows.append(
                {
                    "prompt": prompt,
                    "prompt_tokens": len(ids),
                    "prompt_ids_equal_gguf_tokenizer": ids
                    == prompt_ids(hf_tokenizer, prompt, plain),
                    "pcgspec_tokens": len(mine),
                    "transformers_tokens": len(theirs),
                    "equal": mine == theirs,
                    "first_difference": first_diff,
                    "pcgspec_finish_reason": out.outputs[0].finish_reason,
                    "ends_with_stop_token": bool(theirs) and theirs[-1] in stop_ids,
                    "text": out.outputs[0].text,
                }
            )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "model": name,
        "model_dir": str(llm.engine.model_dir),
        "stop_tokens": {str(i): tokenizer.convert_ids_to_tokens(i) for i in stop_ids},
        "prompts_through": "the tokenizer alone" if plain else "the chat template",
        "max_tokens": max_tokens,
        "dtype": "float32",
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "all_equal": all(r["equal"] for r in rows),
        "prompts_equal": sum(r["equal"] for r in rows),
        "tokens_compared": sum(min(r["pcgspec_tokens"], r["transformers_tokens"]) for r in rows),
        "prompts": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a name `pcgspec models` lists")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--plain", action="store_true", help="text prompts, no chat template")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = parser.parse_args()
    result = {"command": "python " + " ".join(sys.argv)} | compare(
        args.model, PLAIN_PROMPTS if args.plain else PROMPTS, args.max_tokens, args.plain
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
