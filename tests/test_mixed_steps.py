"""Mixed steps on SmolLM2 cut to its first layers (CPU, float32; its own weights and tokenizer):
running requests decode beside every prefill chunk of a long prompt, a short prompt that arrives
behind it is prefilled at once, and every output equals the request's own run alone (plain and
speculative, synchronous and overlapped).
"""

from __future__ import annotations

import pytest
from oracle import PROMPTS, assert_all_pages_free, assert_greedy_match, greedy

from pcgspec import LLM
from pcgspec.engine.request import Request
from pcgspec.engine.scheduler import ScheduledBatch

LONG_PROMPT = "\n".join(PROMPTS)  # about 130 tokens: eight or more chunks of 16
CHUNK = 16


def _llm(path, overlap: bool, **kw) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        chunked_prefill_size=CHUNK,
        page_size=4,
        disable_overlap_schedule=not overlap,
        **kw,
    )


def _staggered(llm: LLM, monkeypatch) -> tuple[list[Request], list[ScheduledBatch]]:
    """A stream decodes; a long prompt arrives, and two steps later a short one. Returns the
    three requests (finished) and every batch scheduled.
    """
    engine, tok = llm.engine, llm.get_tokenizer()
    batches: list[ScheduledBatch] = []
    schedule = engine.scheduler.schedule

    def recorded() -> ScheduledBatch | None:
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    monkeypatch.setattr(engine.scheduler, "schedule", recorded)
    (stream,) = engine.add_request(tok.encode(PROMPTS[0]), greedy(32))
    while stream.num_output_tokens < 2:
        engine.step()
    (long,) = engine.add_request(tok.encode(LONG_PROMPT), greedy(8))
    for _ in range(2):
        engine.step()
    (short,) = engine.add_request(tok.encode(PROMPTS[3]), greedy(8))
    while engine.has_unfinished:
        engine.step()
    return [stream, long, short], batches


def _check(llm: LLM, reqs: list[Request], batches: list[ScheduledBatch], hf_model) -> None:
    stream, long, short = reqs
    chunks = [b for b in batches if long in b.requests[b.num_decode :]]
    assert len(chunks) >= 6, "the long prompt was not prefilled in chunks"
    for batch in chunks[:-1]:
        assert batch.num_new_tokens[batch.requests.index(long)] > 0
        assert stream in batch.requests[: batch.num_decode], "the stream waited for a chunk"
        assert sum(batch.num_new_tokens) <= CHUNK
    # the short prompt went in whole beside a chunk, and its first token came first
    first = next(b for b in batches if short in b.requests)
    assert long in first.requests and first.num_new_tokens[first.requests.index(short)] > 1
    assert short.first_token_time < long.first_token_time
    assert llm.engine.step_stats()["mixed"]["steps"] >= len(chunks) - 1
    tok = llm.get_tokenizer()
    for req, prompt in zip(reqs, (PROMPTS[0], LONG_PROMPT, PROMPTS[3])):
        (alone,) = llm.generate(prompt, req.params, use_tqdm=False)
        assert len(req.output_token_ids) == len(alone.outputs[0].token_ids)
        assert_greedy_match(
            hf_model, tok.encode(prompt), req.output_token_ids, alone.outputs[0].token_ids
        )
    assert_all_pages_free(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_runs_beside_every_chunk_and_outputs_equal_alone(
    cut_smollm2_path, cut_hf_model, monkeypatch, overlap
):
    llm = _llm(cut_smollm2_path, overlap)
    reqs, batches = _staggered(llm, monkeypatch)
    _check(llm, reqs, batches, cut_hf_model)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3", "EAGLE3-tree"])
def test_speculative_requests_decode_beside_chunks(
    cut_smollm2_path, cut_hf_model, cut_drafts, monkeypatch, algorithm
):
    """Speculating requests take plain decode rows in mixed steps, and the drafter catches up
    from them (EAGLE3: their hidden states; a tree drafter too) once speculative steps resume.
    """
    draft = {}
    if algorithm == "EAGLE3-tree":
        algorithm = "EAGLE3"
        draft = {"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
    if algorithm == "EAGLE3":
        draft["speculative_draft_model_path"] = cut_drafts["EAGLE3"]
    llm = _llm(
        cut_smollm2_path,
        True,
        speculative_algorithm=algorithm,
        speculative_num_steps=3,
        speculative_policy="always",
        disable_piecewise_cuda_graph=True,
        **draft,
    )
    reqs, batches = _staggered(llm, monkeypatch)
    _check(llm, reqs, batches, cut_hf_model)
    assert llm.engine.spec_worker.policy.speculative_steps > 0
