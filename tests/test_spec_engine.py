"""NGRAM speculative decoding end to end (CPU, eager verify): lossless against plain decoding
and stop handling on the real SmolLM2; on SmolLM2 cut to its first layers (conftest's ``cut_*``:
the engine's mechanics, ~3x cheaper per token; its degenerate text repeats, so prompt lookup's
drafts are accepted) seeded sampling, KV bookkeeping, fallbacks, metrics, the policy's timing;
config validation.
"""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace

import pytest
import torch
from oracle import PROMPTS as ALL_PROMPTS
from oracle import assert_all_pages_free, assert_greedy_match, greedy
from spec_setup import plain_cpu_llm

from pcgspec import LLM, SamplingParams
from pcgspec.config import EngineConfig
from pcgspec.engine import overlap as overlap_module
from pcgspec.engine.engine import Engine
from pcgspec.speculative import worker as worker_module
from pcgspec.speculative.worker import SpecWorker

NEW_TOKENS = 32
SENTENCE = "The old lighthouse keeper climbed the stairs every night to light the lamp."
# Continuations that repeat the prompt, so NGRAM drafts get accepted.
REPEAT_PROMPTS = [
    f"Repeat exactly: {SENTENCE}\n{SENTENCE}\n{SENTENCE}\n",
    "a b c d e f g h a b c d e f g h a b c d e f g h a b",
]
PROMPTS = ALL_PROMPTS[:8] + REPEAT_PROMPTS


@pytest.fixture(scope="module")
def llm(plain_llm) -> LLM:
    return plain_llm  # conftest: one build for the session


@pytest.fixture(scope="module")
def spec_llm(smollm2_path) -> LLM:
    """Prompt lookup on the real SmolLM2 (prefill eager: ``cut_spec`` covers piecewise)."""
    return _ngram(smollm2_path)


@pytest.fixture(scope="module")
def cut_llm(cut_smollm2_path) -> LLM:
    """Plain decoding of the cut target: the reference of ``cut_spec``."""
    return plain_cpu_llm(cut_smollm2_path)


@pytest.fixture(scope="module")
def cut_spec(cut_smollm2_path) -> LLM:
    """Prompt lookup on the cut target, behind piecewise prefill."""
    return _ngram(cut_smollm2_path, disable_piecewise_cuda_graph=False)


def _ngram(path, **kw) -> LLM:
    """A prompt-lookup engine (4 draft tokens, always speculating; prefill eager by default)."""
    kw.setdefault("disable_piecewise_cuda_graph", True)
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        speculative_algorithm="NGRAM",
        speculative_num_steps=4,
        speculative_policy="always",
        **kw,
    )


def _greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return greedy(max_tokens, **kw)


def _overlapped_ngram(path, num_steps: int) -> LLM:
    """A prompt-lookup engine under the overlap schedule, with the default (auto) policy."""
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        speculative_algorithm="NGRAM",
        speculative_num_steps=num_steps,
        disable_overlap_schedule=False,
        disable_piecewise_cuda_graph=True,
    )


def _assert_greedy_equals_plain(llm, spec_llm, hf_model, prompts, params) -> list:
    plain = llm.generate(prompts, params, use_tqdm=False)
    spec = spec_llm.generate(prompts, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, want, got in zip(prompts, plain, spec):
        assert len(got.token_ids) == NEW_TOKENS
        assert_greedy_match(hf_model, tok.encode(prompt), got.token_ids, want.token_ids)
        assert got.metrics.spec_verify_steps > 0
    assert_all_pages_free(spec_llm)
    return spec


def test_greedy_equals_plain_decoding(llm, spec_llm, hf_model):
    """On the real SmolLM2: half the varied prompts (prose, code, a translation, a count) and
    both texts to copy, which the model copies: their drafts are accepted."""
    prompts = ALL_PROMPTS[:8:2] + REPEAT_PROMPTS
    spec = _assert_greedy_equals_plain(llm, spec_llm, hf_model, prompts, _greedy())
    for out in spec[-len(REPEAT_PROMPTS) :]:
        assert out.metrics.avg_spec_accept_length > 1.0, out.text


def test_penalized_greedy_equals_plain_decoding(cut_llm, cut_spec, cut_hf_model):
    """With a repetition penalty, on the cut target (every prompt), whose penalized text varies:
    drafts both accepted and rejected."""
    params = _greedy(repetition_penalty=1.2)
    spec = _assert_greedy_equals_plain(cut_llm, cut_spec, cut_hf_model, PROMPTS, params)
    assert any(o.metrics.spec_accepted_draft_tokens for o in spec)
    assert any(o.metrics.spec_verify_steps > o.metrics.spec_accepted_draft_tokens for o in spec)


def test_accept_metrics(cut_spec):
    out = cut_spec.generate(REPEAT_PROMPTS[1], _greedy(32), use_tqdm=False)[0]
    m = out.metrics
    assert m.avg_spec_accept_length == pytest.approx(
        (m.spec_accepted_draft_tokens + m.spec_verify_steps) / m.spec_verify_steps
    )
    assert len(m.spec_accepted_per_position) == 4
    assert sum(m.spec_accepted_per_position) == m.spec_accepted_draft_tokens > 0
    assert list(m.spec_accepted_per_position) == sorted(m.spec_accepted_per_position, reverse=True)
    stats = cut_spec.engine.spec_stats()
    assert stats["verify_steps"] >= m.spec_verify_steps and stats["avg_spec_accept_length"] > 1


def test_seeded_sampling_equals_plain(cut_llm, cut_spec):
    prompts = [ALL_PROMPTS[0], REPEAT_PROMPTS[0], REPEAT_PROMPTS[1], ALL_PROMPTS[6]]
    params = [
        SamplingParams(
            temperature=0.8,
            seed=100 + i,
            max_tokens=40,
            ignore_eos=True,
            **({"top_p": 0.9, "top_k": 40} if i % 2 else {}),
        )
        for i in range(3)
    ] + [_greedy(40)]  # a greedy request in a sampled batch
    plain = cut_llm.generate(prompts, params, use_tqdm=False)
    spec = cut_spec.generate(prompts, params, use_tqdm=False)
    for want, got in zip(plain, spec):
        assert got.token_ids == want.token_ids
    assert spec[2].metrics.spec_accepted_draft_tokens > 0


def test_stop_string_and_max_tokens_inside_accepted_runs(llm, spec_llm):
    prompt = "1, 2, 3, 4, 5,"
    base = llm.generate(prompt, _greedy(24), use_tqdm=False)[0]
    out = spec_llm.generate(prompt, _greedy(24, stop=[" 8,"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == " 8,"
    assert out.text == base.text[: base.text.index(" 8,")]
    stop_id = base.token_ids[5]
    out = spec_llm.generate(prompt, _greedy(24, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    for max_tokens in range(1, 10):
        out = spec_llm.generate(REPEAT_PROMPTS[1], _greedy(max_tokens), use_tqdm=False)[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert_all_pages_free(spec_llm)


def test_every_page_free_after_200_requests(cut_spec):
    prompts = [REPEAT_PROMPTS[i % 2] if i % 3 else ALL_PROMPTS[i % 16] for i in range(200)]
    params = [
        _greedy(1 + i % 8) if i % 2 else SamplingParams(temperature=0.8, max_tokens=8)
        for i in range(200)
    ]
    outs = cut_spec.generate(prompts, params, use_tqdm=False)
    assert all(o.finished and len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params))
    assert_all_pages_free(cut_spec)


def test_fallbacks_logprobs_and_small_kv_pool(cut_smollm2_path, cut_llm, cut_spec, cut_hf_model):
    before = cut_spec.engine.spec_stats()["fallback_steps"]
    params = _greedy(6, logprobs=2)
    want = cut_llm.generate(ALL_PROMPTS[0], params, use_tqdm=False)[0]
    got = cut_spec.generate(ALL_PROMPTS[0], params, use_tqdm=False)[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == 6
    assert cut_spec.engine.spec_stats()["fallback_steps"] > before
    # 10 pages of 16 tokens: verify slots often do not fit, so steps fall back or preempt.
    small = _ngram(cut_smollm2_path, max_total_tokens=160)
    prompts = PROMPTS[-4:]
    ref = cut_llm.generate(prompts, _greedy(40), use_tqdm=False)
    outs = small.generate(prompts, _greedy(40), use_tqdm=False)
    tok = cut_llm.get_tokenizer()
    for prompt, want, got in zip(prompts, ref, outs):
        assert_greedy_match(cut_hf_model, tok.encode(prompt), got.token_ids, want.token_ids)
    assert small.engine.spec_stats()["fallback_steps"] > 0
    assert_all_pages_free(small)


def test_config_validation(cut_smollm2_path):
    with pytest.raises(ValueError, match="speculative_algorithm must be one of"):
        EngineConfig(speculative_algorithm="MEDUSA")
    with pytest.raises(ValueError, match="set without speculative_algorithm"):
        EngineConfig(speculative_num_steps=4)
    with pytest.raises(ValueError, match="speculative_num_steps"):
        EngineConfig(speculative_algorithm="NGRAM", speculative_num_steps=0)
    for algorithm in ("EAGLE3", "NEXTN", "STANDALONE"):
        config = EngineConfig(
            model=str(cut_smollm2_path),
            speculative_algorithm=algorithm,
            speculative_draft_model_path="/no/such/draft",
        )
        with pytest.raises(FileNotFoundError, match="/no/such/draft"):
            Engine(config)


def test_the_policy_times_every_step_but_switches(cut_smollm2_path):
    """The policy's cost model learns from every decode step, whatever batch ran before it or
    finished in it, but for a switch: a plain step launched over a speculative one pays for
    the rest of it when reading it (not steady); a speculative step after plain ones waits
    for nothing (prompt lookup reads the device's history). A step's time is its whole cycle:
    the caller's work before the next step counts.
    """
    llm = _overlapped_ngram(cut_smollm2_path, num_steps=4)
    engine, records = llm.engine, []
    policy = engine.spec_worker.policy
    record = policy.record_step
    pattern = itertools.cycle([True, True, True, False, False, False])

    def spy(speculative, batch_size, seconds, steady=True, switched=False, steps=1):
        records.append((speculative, batch_size, steady, switched, seconds, steps))
        record(speculative, batch_size, seconds, steady, switched, steps)

    policy.choose, policy.record_step = (lambda reqs: next(pattern)), spy
    for prompt, n in zip(PROMPTS[:4], (8, 16, 24, 40)):
        engine.add_request(engine.tokenizer.encode(prompt), _greedy(n))
    gap, own = 0.02, []
    while engine.has_unfinished:
        start = time.perf_counter()
        engine.step()
        own.append(time.perf_counter() - start)
        time.sleep(gap)  # the caller's work between steps
    pairs = list(zip(records, records[1:]))
    resized = [now for last, now in pairs if now[1] != last[1]]
    to_plain = [now for last, now in pairs if last[0] and not now[0]]
    to_spec = [now for last, now in pairs if not last[0] and now[0]]
    assert any(steady for _, _, steady, *_ in resized)  # timed in its own bucket
    # a switch to plain steps is timed with the plain step after it, which reads it
    assert to_plain and all(
        switched and not steady and steps == 2 for _, _, steady, switched, _, steps in to_plain
    )
    assert to_spec and all(steady and switched for _, _, steady, switched, *_ in to_spec)
    assert all(steady or switched for _, _, steady, switched, *_ in records)
    assert all(r[4] >= gap for r in records[:-1])  # cycles, not the steps alone
    assert policy.speculative_steps == sum(r[0] * r[5] for r in records)
    assert engine.step_counts["speculative"] == policy.speculative_steps
    assert engine.step_counts["decode"] == sum(r[5] for r in records if not r[0])
    assert engine.step_counts["first_tokens"] > 0 and engine.step_seconds["prefill"] > 0
    assert policy.step_times()


@pytest.mark.parametrize("speculate", [True, False], ids=["speculative", "plain"])
def test_a_mixed_step_s_launch_is_in_neither_kind_of_step(
    cut_smollm2_path, cut_llm, monkeypatch, speculate
):
    """A step with prefill work launched over a decode step of either kind ends that step's
    time when it was ready, later by its read of it (the wait for the device, here only in
    the mixed step's read), but not by its own launch, host work while the device ran it."""
    launch, wait = 2.0, 0.5  # NOTE: well above a CPU step's time, on a loaded machine too
    spec = _overlapped_ngram(cut_smollm2_path, num_steps=3)
    engine, prompt = spec.engine, spec.get_tokenizer().encode(PROMPTS[0])
    assert engine.scheduler.hold_arrivals and not cut_llm.engine.scheduler.hold_arrivals
    engine.spec_worker.policy.choose = lambda reqs: speculate
    step_class = worker_module.LaunchedSpecStep if speculate else overlap_module.LaunchedStep
    read, mixing = step_class.read, [False]

    def slow_read(step, eos_token_ids):
        if mixing[0]:
            time.sleep(wait)  # the rest of the step on the device, read by the mixed step
        return read(step, eos_token_ids)

    monkeypatch.setattr(step_class, "read", slow_read)
    forward_and_sample, timer = engine._forward_and_sample, engine.step_timer
    prefill_step, closed = timer.prefill_step, []

    def slow_launch(batch, after_spec):
        if not batch.mode.is_decode() and batch.num_decode:  # a mixed step
            mixing[0] = True
            time.sleep(launch)
        forward_and_sample(batch, after_spec)

    def spy(ready):
        if timer._open is not None:
            closed.append((timer._open.speculative, ready - timer._open.start))
        prefill_step(ready)

    engine._forward_and_sample, timer.prefill_step = slow_launch, spy

    def step():
        mixing[0] = False
        engine.step()

    engine.add_request(prompt, _greedy(12))
    for _ in range(4):
        step()
    engine.add_request(prompt, _greedy(4))
    while engine.has_unfinished:
        step()
    assert closed and all(kind is speculate and wait <= t < launch for kind, t in closed)


def test_a_plain_step_over_a_speculative_step_it_shares_no_request_with(cut_smollm2_path, cut_llm):
    """A plain step launched over a speculative step in flight whose decode rows are all of
    requests that step did not run (their tokens all read: here R, left out of A's
    speculative step at its worst-case length, then decoding alone once A's worst case
    reaches its limit) takes its input tokens from the device like the others: output equals
    plain decoding."""
    spec = _overlapped_ngram(cut_smollm2_path, num_steps=3)
    engine, prompt = spec.engine, spec.get_tokenizer().encode(PROMPTS[0])
    (a,) = engine.add_request(prompt, _greedy(6))
    (r,) = engine.add_request(prompt, _greedy(3))
    engine.spec_worker.policy.choose = lambda reqs: a in reqs
    alone, forward_and_sample = [], engine._forward_and_sample

    def plain_step(batch, after_spec):
        decoding = batch.requests[: batch.num_decode]
        alone.append(after_spec and decoding and not any(r.num_pending_tokens for r in decoding))
        forward_and_sample(batch, after_spec)

    engine._forward_and_sample = plain_step
    while engine.has_unfinished:
        engine.step()
    assert any(alone)
    want = cut_llm.generate([PROMPTS[0]] * 2, [_greedy(6), _greedy(3)], use_tqdm=False)
    assert [a.output_token_ids, r.output_token_ids] == [w.outputs[0].token_ids for w in want]
    assert (a.finish_reason, r.finish_reason) == ("length", "length")


def test_the_page_table_is_uploaded_again_only_when_it_changed():
    """A speculative step reuses the last step's device page table while every request's pages
    are the same, and uploads a new one when one gained a page or the batch changed."""
    worker = SpecWorker.__new__(SpecWorker)  # NOTE: only what _page_table reads
    worker.runner = SimpleNamespace(device=torch.device("cpu"))
    worker._last_pages = worker._last_table = None
    a, b = SimpleNamespace(pages=[3, 4]), SimpleNamespace(pages=[7])
    first = worker._page_table([a, b])
    assert first.tolist() == [[3, 4], [7, 0]]
    assert worker._page_table([a, b]) is first
    b.pages.append(9)
    second = worker._page_table([a, b])
    assert second is not first and second.tolist() == [[3, 4], [7, 9]]
    assert worker._page_table([b, a]).tolist() == [[7, 9], [3, 4]]
    assert worker._page_table([a]).tolist() == [[3, 4]]


def test_a_failed_page_table_upload_leaves_no_stale_table(monkeypatch):
    """An upload that raises (e.g. out of memory; the step is rerun) must not leave the new
    pages' key beside the old table."""
    worker = SpecWorker.__new__(SpecWorker)  # NOTE: only what _page_table reads
    worker.runner = SimpleNamespace(device=torch.device("cpu"))
    worker._last_pages = worker._last_table = None
    a = SimpleNamespace(pages=[3, 4])
    assert worker._page_table([a]).tolist() == [[3, 4]]
    a.pages.append(5)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room")

    with monkeypatch.context() as m:
        m.setattr(worker_module, "device_page_table", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            worker._page_table([a])
    assert worker._page_table([a]).tolist() == [[3, 4, 5]]
