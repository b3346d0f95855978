"""Shared oracle helpers: Hugging Face transformers as the reference, and the near-tie rule."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pcgspec import LLM, SamplingParams

NEAR_TIE = 1e-4  # a greedy divergence is allowed only where the top-2 logit gap is below this

# Varied prompts: prose, code, lists, arithmetic, other languages, markup.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three prime numbers:",
    "Translate to French: I like apples.",
    "The quick brown fox",
    "1, 2, 3, 4, 5,",
    "Explain gravity to a child.",
    "import torch\nimport torch.nn as nn\n\nclass MLP(nn.Module):",
    "Q: What is 12 times 12?\nA:",
    "Die Hauptstadt von Deutschland ist",
    "SELECT name FROM",
    "The three laws of motion are",
    "Write a haiku about the sea.",
    "<html>\n<head>",
    "In 1969, the first humans",
]


@torch.inference_mode()
def hf_greedy(
    hf_model, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None
) -> list[int]:
    ids = torch.tensor([list(prompt_ids)])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        top_p=None,
        top_k=None,
        temperature=None,
    )
    return out[0, ids.shape[1] :].tolist()


@torch.inference_mode()
def top2_gap(hf_model, ids: Sequence[int]) -> tuple[float, list[int]]:
    """Gap between the two largest next-token logits after ``ids``, and those two tokens."""
    logits = hf_model(torch.tensor([list(ids)])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return (top.values[0] - top.values[1]).item(), top.indices.tolist()


def assert_greedy_match(
    hf_model, prompt_ids: Sequence[int], ours: Sequence[int], ref: Sequence[int]
) -> None:
    """``ours`` equals ``ref`` token for token, except after a divergence at a measured
    near-tie (both tokens are the model's top two and their logit gap is < NEAR_TIE).
    """
    n = min(len(ours), len(ref))
    for j in range(n):
        if ours[j] != ref[j]:
            gap, top = top2_gap(hf_model, list(prompt_ids) + list(ref[:j]))
            assert gap < NEAR_TIE and {ours[j], ref[j]} == set(top), (
                f"divergence at output {j}: ours {ours[j]} vs ref {ref[j]}, "
                f"top-2 gap {gap:.3g} (allowed only below {NEAR_TIE})"
            )
            return
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}"


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_all_pages_free(llm: LLM) -> None:
    """No request left queued or running and every KV page back in the pool, but for the prefix
    cache's, each held by the cache alone."""
    engine = llm.engine
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert_pool_whole(engine)


def assert_pool_whole(engine: object) -> None:
    """No request holds a page: every page is free, or held once by the prefix cache; then
    flushing the cache frees them all."""
    pool, cache = engine.pages, engine.prefix_cache
    cached = [] if cache is None else cache.pages()
    assert len(set(cached)) == len(cached)
    assert all(pool.refcount(p) == 1 for p in cached)
    assert pool.num_free + len(cached) == pool.num_pages and pool.num_cache_only == len(cached)
    assert engine.stats()["kv_pages_used"] == 0
    engine.flush_cache()
    assert pool.num_free == pool.num_pages
    assert all(pool.refcount(p) == 0 for p in range(pool.num_pages))
