"""Prefix caching end to end on SmolLM2 cut to its first layers (CPU, float32; its own weights
and tokenizer): greedy output with the cache equals output without it (shared system prompts,
multi-turn histories, prefixes ending mid-page, a prefix evicted between turns, hits during
chunked prefill, ``n`` > 1, NGRAM and model drafters), hits are counted, and the pool is whole
afterwards.
"""

from __future__ import annotations

import pytest
from oracle import assert_all_pages_free, assert_greedy_match, greedy

from pcgspec import LLM, SamplingParams

PAGE = 16
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, with facts only, and "
    "never repeat the question. "
)
QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number.",
    "What color is the sky?",
    "Who wrote Hamlet?",
]


def _llm(path, **kw) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", page_size=PAGE, **kw)


@pytest.fixture(scope="module")
def plain(cut_smollm2_path) -> LLM:
    return _llm(cut_smollm2_path, disable_radix_cache=True)


@pytest.fixture(scope="module")
def cached(cut_smollm2_path) -> LLM:
    return _llm(cut_smollm2_path)


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


def _gen(llm: LLM, prompts: list[list[int]], max_tokens: int = 12, **kw) -> list:
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(max_tokens, **kw), use_tqdm=False
    )


def _same(cut_hf_model, prompts, want, got) -> None:
    for prompt, w, g in zip(prompts, want, got):
        assert len(g.token_ids) == len(w.token_ids)
        assert_greedy_match(cut_hf_model, prompt, g.token_ids, w.token_ids)


def _turns(llm: LLM, first: list[int], num_turns: int, max_tokens: int = 8) -> list:
    """A chat that resends its history: each turn's prompt is the last prompt, its output and
    a new question. Returns (prompt, output ids) per turn."""
    prompt, turns = first, []
    for t in range(num_turns):
        out = _gen(llm, [prompt], max_tokens)[0].token_ids
        turns.append((prompt, out))
        prompt = prompt + out + _ids(llm, f" Question {t + 2}: {QUESTIONS[t % 4]}")
    return turns


def _same_turns(cut_hf_model, want: list, got: list) -> None:
    """Turn by turn, up to the first (near-tie) divergence, after which the histories differ."""
    for (prompt, w), (_, g) in zip(want, got):
        assert_greedy_match(cut_hf_model, prompt, g, w)
        if g != w:
            return


def test_shared_system_prompt_hits_whole_pages(plain, cached, cut_hf_model):
    prompts = [_ids(cached, SYSTEM + q) for q in QUESTIONS]
    shared = len(_ids(cached, SYSTEM))
    assert shared % PAGE and shared > PAGE  # the shared prefix ends mid-page
    want = _gen(plain, prompts)
    first = _gen(cached, prompts[:1])
    got = _gen(cached, prompts[1:])
    _same(cut_hf_model, prompts, want, first + got)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == shared // PAGE * PAGE for o in got)
    again = _gen(cached, prompts[:1])[0]  # its own whole prompt is cached: a page recomputed
    assert again.num_cached_tokens == (len(prompts[0]) - 1) // PAGE * PAGE
    assert again.token_ids == first[0].token_ids
    stats = cached.engine.cache_stats()
    assert stats["cached_tokens"] > 0 and 0 < stats["hit_rate"] < 1
    assert_all_pages_free(cached)


def test_multi_turn_history_and_n_sequences(plain, cached, cut_hf_model):
    first = _ids(cached, SYSTEM + QUESTIONS[0])
    want = _turns(plain, first, 3)
    before = cached.engine.cache_stats()["cached_tokens"]
    got = _turns(cached, first, 3)
    _same_turns(cut_hf_model, want, got)
    assert cached.engine.cache_stats()["cached_tokens"] - before >= 2 * PAGE * 2
    prompt = _ids(cached, SYSTEM + QUESTIONS[3] + " Think about it.")
    alone = _gen(plain, [prompt])[0].token_ids
    out = cached.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3),
        use_tqdm=False,
    )[0]
    assert all(o.token_ids == alone for o in out.outputs)
    assert_all_pages_free(cached)


def test_prefix_evicted_between_turns_and_chunked_hits(cut_smollm2_path, plain, cut_hf_model):
    """A pool of 12 pages: unrelated prompts evict the chat's pages between its turns. A
    chunked prefill of 16 tokens continues after a hit."""
    small = _llm(cut_smollm2_path, max_total_tokens=12 * PAGE, chunked_prefill_size=PAGE)
    first = _ids(small, SYSTEM + QUESTIONS[1])
    turn1 = _gen(small, [first], 8)[0]
    assert turn1.token_ids == _gen(plain, [first], 8)[0].token_ids
    story = " ".join(f"robot {i} counted the stars of the night sky" for i in range(6))
    for i in range(3):  # one after the other: the chat's pages are the least recently used
        _gen(small, [_ids(small, f"Story {i}: {story}")], 4)
    assert small.engine.cache_stats()["evicted_tokens"] > 0
    second = first + turn1.token_ids + _ids(small, " And why is that so?")
    got = _gen(small, [second], 8)[0]
    assert got.num_cached_tokens < len(first) // PAGE * PAGE  # part of the history was evicted
    long = _ids(small, SYSTEM + QUESTIONS[1] + " Explain it at length, in three parts.")
    chunked = _gen(small, [long], 8)[0]
    assert chunked.num_cached_tokens >= PAGE and len(long) - chunked.num_cached_tokens > PAGE
    _same(cut_hf_model, [second, long], _gen(plain, [second, long], 8), [got, chunked])
    assert_all_pages_free(small)


def test_ngram_speculation_with_hits(cut_smollm2_path, plain, cut_hf_model):
    spec = _llm(
        cut_smollm2_path,
        speculative_algorithm="NGRAM",
        speculative_num_steps=3,
        speculative_policy="always",
        disable_piecewise_cuda_graph=True,
    )
    first = _ids(
        spec,
        SYSTEM + "Repeat exactly: the old lighthouse keeper climbed the stairs. "
        "The old lighthouse keeper",
    )
    _same_turns(cut_hf_model, _turns(plain, first, 3), _turns(spec, first, 3))
    assert spec.engine.cache_stats()["cached_tokens"] > 0
    assert spec.engine.spec_stats()["verify_steps"] > 0
    assert_all_pages_free(spec)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3"])
def test_model_drafter_hits_pages_with_its_draft_kv(
    cut_smollm2_path,
    cut_drafts,
    plain,
    cut_hf_model,
    algorithm,
    overlap,
):
    """A model drafter hits only pages whose draft K/V its writer computed; the draft then
    starts at the hit (STANDALONE: its own tokens; EAGLE3: one position behind, fed by the
    target's hidden states of the new positions only). Under the overlap schedule a writer
    finishes with a speculative step in flight on its pages, which writes past what is cached.
    """
    spec = _llm(
        cut_smollm2_path,
        speculative_algorithm=algorithm,
        speculative_num_steps=3,
        speculative_draft_model_path=cut_drafts[algorithm],
        speculative_policy="always",
        disable_overlap_schedule=not overlap,
        disable_piecewise_cuda_graph=True,
    )
    prompts = [_ids(spec, SYSTEM + q) for q in QUESTIONS[:3]]
    want = _gen(plain, prompts, 10)
    got = _gen(spec, prompts[:1], 10) + _gen(spec, prompts[1:], 10)
    _same(cut_hf_model, prompts, want, got)
    assert all(o.num_cached_tokens > 0 for o in got[1:])
    assert all(o.metrics.spec_verify_steps > 0 for o in got)
    assert_all_pages_free(spec)
