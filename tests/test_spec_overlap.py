"""Model drafters (STANDALONE, EAGLE3, NEXTN) and prompt lookup under the overlap schedule on
conftest's cut SmolLM2 (its first layers, real weights; CPU, float32): speculative steps
launched before the host read the one before, the policy's plain steps between them, requests
joining, finishing, aborted and preempted mid-run; output equals plain decoding of the same
model and the drafts equal those of synchronous steps. The drafts are conftest's
``cut_drafts``; the GPU tests run the whole SmolLM2 with ``drafts``.
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import pytest
import torch
from oracle import assert_all_pages_free
from spec_setup import (
    ALGORITHMS,
    GPU_KW,
    NEW_TOKENS,
    PROMPTS,
    SPEC_KW,
    K,
    MemoizedPlain,
    plain_cpu_llm,
    spec_llm,
)
from spec_setup import assert_same_greedy as _assert_same_greedy
from spec_setup import greedy_params as _greedy

from pcgspec import LLM, SamplingParams
from pcgspec.speculative.model_proposer import ModelProposer

# NOTE: a stop string the cut model's greedy text holds mid-run (SmolLM2's holds " the")
CUT_STOP = "  and"


@pytest.fixture(scope="module")
def llm(cut_smollm2_path) -> MemoizedPlain:
    return MemoizedPlain(plain_cpu_llm(cut_smollm2_path))


@pytest.fixture(scope="module")
def cuda_plain(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), **GPU_KW)


def _overlapped(target, drafts, algorithm: str, **kw) -> LLM:
    """A speculative engine of ``algorithm`` (conftest's draft for a model drafter) under the
    overlap schedule, 4 requests at a time, prefilling eagerly."""
    draft = {} if algorithm == "NGRAM" else {"speculative_draft_model_path": drafts[algorithm]}
    return LLM(
        str(target),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        disable_overlap_schedule=False,
        disable_piecewise_cuda_graph=True,
        max_running_requests=4,
        **draft,
        **kw,
    )


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["EAGLE3"])
def test_preemption_restarts_the_draft(
    cut_smollm2_path, cut_drafts, llm, cut_hf_model, algorithm, overlap
):
    """10 pages of 16 tokens for 4 requests: steps fall back or preempt, and a preempted
    request's draft starts over from its new prefill (EAGLE3: with fresh hidden states). Under
    the overlap schedule a request is preempted with a speculative step in flight.
    """
    small = spec_llm(
        cut_smollm2_path,
        algorithm,
        cut_drafts[algorithm],
        max_total_tokens=160,
        disable_overlap_schedule=not overlap,
    )
    prompts = PROMPTS[-4:]
    want = llm.generate(prompts, _greedy(32), use_tqdm=False)
    outs = small.generate(prompts, _greedy(32), use_tqdm=False)
    _assert_same_greedy(llm, cut_hf_model, prompts, want, outs)
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_pages_free(small)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE", "NGRAM"])
def test_overlapped_plain_steps_between_speculative_ones_equal_plain(
    cut_smollm2_path, cut_drafts, llm, cut_hf_model, algorithm
):
    """Under the overlap schedule the policy's plain steps are launched ahead of their tokens,
    and a speculative step after one is launched before the host read it (a drafter catches
    up with the newest tokens from the device).
    """
    spec = _overlapped(cut_smollm2_path, cut_drafts, algorithm)  # the policy's plain steps too
    _assert_mixed_steps_equal_plain(spec, llm, cut_hf_model, CUT_STOP)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_overlapped_speculative_steps_draft_and_emit_like_synchronous_ones(
    cut_smollm2_path, cut_drafts, llm, algorithm
):
    """Under the overlap schedule a speculative step is launched before the host read the one
    before it: its verify batch comes from the lengths on the device, and the draft catches up
    from the previous verify step's rows on the device. Every request gets the same drafts,
    step by step, as under synchronous steps (a wrong catch-up row would change them, though
    verification keeps the output right), and greedy (with a stop string and a repetition
    penalty) and seeded output equal plain decoding; nothing is left held. STANDALONE's drafts
    are accepted and rejected.
    """

    prompts = PROMPTS[-4:] + PROMPTS[:2]
    params = [
        _greedy(16),
        _greedy(12, stop=[CUT_STOP]),
        _greedy(16, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=14, ignore_eos=True),
        _greedy(K + 1),
    ]
    want = llm.generate(prompts, params, use_tqdm=False)
    greedy_want = llm.generate(prompts[3:5], [_greedy(16), _greedy(14)], use_tqdm=False)
    assert want[1].finish_reason == "stop"
    assert all(w.token_ids != g.token_ids for w, g in zip(want[3:5], greedy_want))  # sampled
    drafted, from_device = {}, {}
    for overlap in (False, True):
        spec = spec_llm(
            cut_smollm2_path, algorithm, cut_drafts[algorithm], disable_overlap_schedule=not overlap
        )
        engine, proposer = spec.engine, spec.engine.spec_worker.proposer
        drafted[overlap], from_device[overlap] = defaultdict(list), 0
        propose, catch_up = proposer.propose, proposer._catch_up_mixed
        steady = proposer._catch_up_from_verified

        def recorded(batch, propose=propose, seen=drafted[overlap]):
            proposal = propose(batch)
            for req, row in zip(batch.requests, proposal.tokens.tolist()):
                seen[req.request_id].append(row)
            return proposal

        def counted(batch, states, catch_up=catch_up, overlap=overlap):
            from_device[overlap] += sum(s is None for s in states)  # some requests
            return catch_up(batch, states)

        def counted_steady(batch, steady=steady, overlap=overlap):
            from_device[overlap] += len(batch.requests)  # every request
            return steady(batch)

        proposer.propose, proposer._catch_up_mixed = recorded, counted
        proposer._catch_up_from_verified = counted_steady
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.text for g in got] == [w.text for w in want]
        assert not engine.in_flight and engine.slots.num_free == engine.slots.num_slots
        assert_all_pages_free(spec)
        if algorithm == "STANDALONE":
            accepted = sum(sum(g.metrics.spec_accepted_per_position) for g in got)
            assert 0 < accepted < K * sum(g.metrics.spec_verify_steps for g in got)
    assert from_device == {False: 0, True: from_device[True]} and from_device[True] > 0
    for request_id, rows in drafted[False].items():
        # NOTE: overlapped, a request takes part in one more step once it finished (dropped)
        assert drafted[True][request_id][: len(rows)] == rows, request_id


def test_pending_rows_gather_each_request_s_rows_from_its_passes():
    """A catch-up through the host reads each request's pending target rows, one chunk per
    pass (a plain step's rows, a read verify step's), in one gather; a DRAFT_EXTEND over the
    first rows advances past them, within a chunk or across chunks."""
    from pcgspec.speculative.model_proposer import DraftState, pending_rows

    passes = [torch.arange(i * 100, i * 100 + 8).float()[:, None] for i in range(3)]
    a, b = DraftState(), DraftState()
    a.add(passes[0], 2, 3)  # rows 2..4 of a verify pass
    for step in (1, 2):  # two plain steps, one row each
        a.add(passes[step], 0, 1)
        b.add(passes[step], 1, 1)
    got = pending_rows([a, b], [a.num_pending, 1])
    assert got[:, 0].tolist() == [2, 3, 4, 100, 200, 101]
    a.advance(2)  # within the first chunk: its rest stays
    assert (a.computed, a.num_pending, a.rows, a.nums) == (2, 3, [4, 0, 0], [1, 1, 1])
    a.advance(2)  # across chunks
    assert (a.computed, a.num_pending, a.rows, a.nums) == (4, 1, [0], [1])
    assert pending_rows([a, b], [1, 2])[:, 0].tolist() == [200, 101, 201]


def test_verify_rows_carry_only_requests_that_run_again():
    """A verify step that ran some of the last one's requests keeps the others' rows for their
    next catch-up, except a request finished or whose launched tokens reach its length (no
    step runs it again): under continuous batching one does at most steps."""
    from types import SimpleNamespace

    from pcgspec.engine.request import Request
    from pcgspec.speculative.model_proposer import ModelProposer
    from pcgspec.speculative.tree import TreeShape

    k1, hidden_size = 3, 4
    draft = SimpleNamespace(uses_target_hidden=True)
    proposer = ModelProposer(draft, TreeShape(depth=k1 - 1), slots=None)

    def request(name: str, max_tokens: int) -> Request:
        params = SamplingParams(max_tokens=max_tokens)
        return Request(name, [1, 2, 3], params, 0, SimpleNamespace(text=""), 1 << 10)

    def verify(reqs: list[Request], first: int) -> object:
        b = len(reqs)
        out = SimpleNamespace(
            tokens=torch.arange(first, first + b * k1).view(b, k1),
            accept_len=torch.arange(b) % k1,
        )
        hidden = torch.arange(first, first + b * k1).repeat_interleave(hidden_size)
        proposer._leaving(reqs)  # NOTE: what propose does first
        return proposer.verified(reqs, out, hidden.view(b * k1, hidden_size).float())

    running, paused, done, at_length = (request(n, 8) for n in "abcd")
    verify([running, paused, done, at_length], first=0)
    done.finish("stop")
    at_length.num_pending_tokens = 8  # its launched step emits its last tokens
    new = verify([running], first=100)
    assert dict(new.rows) == {running: 0, paused: 1}
    assert new.tokens.tolist() == [[100, 101, 102], [3, 4, 5]]
    assert new.num.tolist() == [1, 2]
    assert new.hidden[:, 0].tolist() == [100, 101, 102, 3, 4, 5]


def _assert_mixed_steps_equal_plain(spec: LLM, plain: LLM, hf_model, stop: str) -> None:
    """A fixed pattern of the policy's choices covers every switch (plain after speculative,
    speculative after a run of launched plain steps, after a prefill), with stops (``stop``, in
    the model's greedy text mid-run) and max_tokens landing on pending tokens, and requests
    joining (``spec`` runs 4 at a time): output equals plain decoding, nothing is left held.
    Decode and mixed steps are launched over a speculative step the host has not read (their
    decode rows' lengths come from the device). A model drafter's catch-up rows through the
    host hold the requests' tokens, the newest taken from the device while the plain step that
    sampled it is in flight.
    """
    engine, pattern = spec.engine, itertools.cycle([True, False, False, True, True, False, False])
    assert engine.overlap and engine.config.max_running_requests == 4
    engine.spec_worker.policy.choose = lambda reqs: next(pattern)
    over_spec = _count_plain_steps_over_spec(engine)
    params = [_greedy(NEW_TOKENS), _greedy(9), _greedy(NEW_TOKENS, stop=[stop])] * 2
    prompts = PROMPTS[: len(params)]
    proposer, rows, pending = engine.spec_worker.proposer, [], []
    if isinstance(proposer, ModelProposer):
        catch_up = proposer._catch_up_mixed

        def recorded(batch, states):
            pending.append(sum(r.num_pending_tokens for r, s in zip(batch.requests, states) if s))
            out = catch_up(batch, states)
            ids, starts, nums = out.tokens.tolist(), out.start.tolist(), out.num.tolist()
            for req, row, start, num in zip(batch.requests, ids, starts, nums):
                rows.extend((req, t, start + j) for j, t in enumerate(row[:num]))  # valid rows
            return out

        proposer._catch_up_mixed = recorded
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    if isinstance(proposer, ModelProposer):
        assert sum(pending) > 0  # catch-ups with a plain step in flight
        assert all(token == r.token_ids[p + proposer.lag] for r, token, p in rows)
    assert over_spec["decode"] > 0, over_spec
    want = plain.generate(prompts, params, use_tqdm=False)
    _assert_same_greedy(plain, hf_model, prompts, want, outs)
    assert [o.text for o in outs] == [w.text for w in want]
    assert engine.spec_worker.policy.speculative_steps > 0 and not engine.in_flight
    assert engine.slots.num_free == engine.slots.num_slots
    assert_all_pages_free(spec)


def _count_plain_steps_over_spec(engine) -> Counter:
    """Counts, by kind (decode, mixed), the plain steps ``engine`` launches while a speculative
    step is launched and not read."""
    worker, over_spec, forward_and_sample = (
        engine.spec_worker,
        Counter(),
        engine._forward_and_sample,
    )

    def plain_step(batch, after_spec):
        if worker._unread:
            over_spec["decode" if batch.mode.is_decode() else "mixed"] += 1
        forward_and_sample(batch, after_spec)

    engine._forward_and_sample = plain_step
    return over_spec


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_cuda_overlapped_plain_steps_between_speculative_ones_equal_plain(
    smollm2_path, drafts, cuda_plain, hf_model, algorithm
):
    """The CPU test above through decode, verify and draft graphs (overlap on by default)."""
    draft = None if algorithm == "NGRAM" else drafts[algorithm]
    spec = LLM(
        str(smollm2_path),
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        max_running_requests=4,
        **SPEC_KW,
        **GPU_KW,
    )
    _assert_mixed_steps_equal_plain(spec, cuda_plain, hf_model, " the")


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_overlapped_requests_join_finish_and_abort_mid_run(
    cut_smollm2_path, cut_drafts, llm, algorithm
):
    """Under the overlap schedule requests join, finish and are aborted while speculative steps
    are in flight (an abort drops the results of its step in flight): the others' greedy
    output equals plain decoding, and at the end every sampling slot and page is free. A
    joining prompt's prefill runs in a mixed step launched over the speculative step in flight
    (the decode rows' lengths come from the device).
    """
    spec = _overlapped(cut_smollm2_path, cut_drafts, algorithm, speculative_policy="always")
    engine, tok = spec.engine, spec.get_tokenizer()
    over_spec = _count_plain_steps_over_spec(engine)
    prompts = PROMPTS[:8]
    params = [_greedy(12 + 4 * (i % 3)) for i in range(len(prompts))]
    want = {p: w.token_ids for p, w in zip(prompts, llm.generate(prompts, params, use_tqdm=False))}
    added, aborted, in_flight_aborts = {}, set(), 0
    for step in range(400):
        if step % 3 == 0 and len(added) < len(prompts):  # joins mid-run
            i = len(added)
            added[engine.add_request(tok.encode(prompts[i]), params[i], f"r{i}")[0]] = prompts[i]
        running = [r for r in engine.scheduler.running if r.output_token_ids]
        if step in (6, 11, 17) and running:
            victim = running[-1]
            in_flight_aborts += victim.num_pending_tokens > 0
            aborted.update(engine.abort(victim.group_id))
        if not engine.has_unfinished and len(added) == len(prompts):
            break
        engine.step()
    assert len(aborted) == 3 and in_flight_aborts > 0
    assert engine.spec_stats()["speculative_steps"] > 0 and over_spec["mixed"] > 0, over_spec
    for req, prompt in added.items():
        assert req.finished
        if req not in aborted:
            assert req.output_token_ids == want[prompt], req.request_id
    assert not engine.in_flight and engine.slots.num_free == engine.slots.num_slots
    assert_all_pages_free(spec)
