"""A step that fails on one request's data fails that request only; the others go on. The
engine cases run on conftest's cut SmolLM2 (its first layers) and its drafts: they compare with
plain decoding of the same model, not with a text.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from oracle import PROMPTS, assert_all_pages_free, assert_greedy_match, greedy

import pcgspec.sampling.sampler as sampler
import pcgspec.server.engine_loop as engine_loop
import pcgspec.speculative.worker as spec_worker
from pcgspec import LLM, SamplingParams
from pcgspec.engine.isolation import run_isolated
from pcgspec.engine.request import Request
from pcgspec.engine.scheduler import ScheduledBatch
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.sampling.batch import SamplingBatch
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.server.app import build_app
from pcgspec.server.async_engine import AsyncEngine
from pcgspec.server.state import ServerSettings, ServerState

MARK = 4242  # the seed that makes a row fail
FAIL_AT = 2  # ... from this output position on, so the request streams a few tokens first
NEW_TOKENS = 5
LATE, LATE_TOKENS = 6, 16  # a fault after the commit hits from the 6th token (of 16) on
REPEATED = "a b c d e f g h a b c d e f g h a b"  # prompt lookup finds drafts here
K = 3  # speculative steps


# --- run_isolated on fake runs --------------------------------------------------------------


class _Detok:
    text = ""


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}-0", [1, 2], SamplingParams(), 0, _Detok(), 64) for i in range(n)]


def _batch(reqs: list[Request]) -> ScheduledBatch:
    return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), [True] * len(reqs))


class _Run:
    """Commits one token per request of a batch, unless the batch holds a bad request."""

    def __init__(self, bad: set[str], commit_first: bool = False) -> None:
        self.bad, self.commit_first, self.calls = bad, commit_first, 0

    def __call__(self, batch: ScheduledBatch) -> None:
        self.calls += 1
        fails = any(r.request_id in self.bad for r in batch.requests)
        if fails and not self.commit_first:
            raise RuntimeError("bad row")
        for req in batch.requests:
            req.token_ids.append(7)
            if req.request_id in self.bad:
                raise RuntimeError("bad row")


@pytest.mark.parametrize("bad", [{"r5-0"}, {"r0-0", "r7-0"}, {"r1-0", "r2-0", "r3-0"}])
def test_bisection_fails_the_bad_requests_and_commits_the_others_once(bad: set[str]) -> None:
    reqs, released = _requests(8), []
    run = _Run(bad)
    failed = run_isolated(_batch(reqs), run, released.append)
    assert {r.request_id for r in failed} == bad and released == failed
    for req in reqs:
        if req.request_id in bad:
            assert req.finish_reason == "error" and req.error == "RuntimeError: bad row"
            assert req.token_ids == [1, 2]
        else:
            assert not req.finished and req.token_ids == [1, 2, 7]
    assert run.calls <= 1 + 2 * len(bad) * 3  # halving: two runs per level per bad request


def test_a_failure_every_request_meets_is_raised() -> None:
    reqs = _requests(5)
    with pytest.raises(RuntimeError, match="bad row"):
        run_isolated(_batch(reqs), _Run({r.request_id for r in reqs}), lambda r: None)
    assert not any(r.finished for r in reqs)
    with pytest.raises(RuntimeError, match="bad row"):  # alone: nothing tells the blame
        run_isolated(_batch(reqs[:1]), _Run({"r0-0"}), lambda r: None)


def test_a_request_the_failed_run_advanced_is_not_run_again() -> None:
    reqs = _requests(4)
    failed = run_isolated(_batch(reqs), _Run({"r2-0"}, commit_first=True), lambda r: None)
    # the first run committed r0, r1, r2 before r2 raised: they cannot run twice
    assert [r.request_id for r in failed] == ["r0-0", "r1-0", "r2-0"]
    assert [len(r.token_ids) for r in reqs] == [3, 3, 3, 3]
    assert not reqs[3].finished


def test_a_device_error_is_raised_without_bisecting() -> None:
    """A sticky device error fails every later run too: no request is to blame."""
    reqs, sizes = _requests(8), []

    def run(batch: ScheduledBatch) -> None:
        sizes.append(len(batch.requests))
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_isolated(_batch(reqs), run, lambda r: None)
    assert sizes == [8] and not any(r.finished for r in reqs)


# --- the engine, with a fault injected into sampling ----------------------------------------


@pytest.fixture(scope="module")
def llm(cut_smollm2_path) -> LLM:
    return LLM(
        str(cut_smollm2_path), dtype="float32", device="cpu", disable_piecewise_cuda_graph=True
    )


@pytest.fixture(scope="module")
def refs(llm) -> dict[str, tuple[list[int], str]]:
    """Greedy tokens and text of the good prompts, generated without a fault."""
    outs = llm.generate(PROMPTS[:5], greedy(NEW_TOKENS), use_tqdm=False)
    return {p: (o.token_ids, o.text) for p, o in zip(PROMPTS, outs)}


@pytest.fixture
def faulty_sampling(monkeypatch):
    """Sampling (plain and speculative verify) raises for a batch holding a row of seed MARK at
    output position >= FAIL_AT."""
    process = sampler.process_logits

    def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        if bool(((sb.seed == MARK) & (sb.position >= FAIL_AT)).any()):
            raise RuntimeError("injected fault")
        return process(logits, sb)

    monkeypatch.setattr(sampler, "process_logits", process_logits)
    monkeypatch.setattr(spec_worker, "process_logits", process_logits)


def test_a_failing_request_ends_with_an_error_while_the_others_finish(
    llm, cut_hf_model, refs, faulty_sampling
):
    tok = llm.get_tokenizer()
    good = PROMPTS[:3]
    params = [greedy(NEW_TOKENS)] * 3
    params.insert(1, greedy(NEW_TOKENS, seed=MARK))
    outs = llm.generate([good[0], PROMPTS[7], *good[1:]], params, use_tqdm=False)
    bad = outs.pop(1)
    assert bad.finish_reason == "error" and len(bad.token_ids) == FAIL_AT
    for prompt, out in zip(good, outs):
        assert out.finish_reason == "length"
        assert_greedy_match(cut_hf_model, tok.encode(prompt), out.token_ids, refs[prompt][0])
    assert_all_pages_free(llm)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_a_failing_request_in_a_speculative_step_ends_alone(
    cut_smollm2_path, cut_hf_model, cut_drafts, refs, faulty_sampling, algorithm
):
    """Verify fails after the drafts were proposed: the retried halves propose again from the
    same draft state (EAGLE3: with the same target hidden states). Prompt lookup takes a plain
    step while no request matches, so there the failing step may be a plain one.
    """
    draft = {}
    if algorithm == "EAGLE3":
        draft = {"speculative_draft_model_path": cut_drafts[algorithm]}
    spec = LLM(
        str(cut_smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        speculative_policy="always",
        disable_piecewise_cuda_graph=True,
        **draft,
    )
    tok = spec.get_tokenizer()
    good = PROMPTS[:3]
    params = [greedy(NEW_TOKENS)] * 3 + [greedy(NEW_TOKENS, seed=MARK)]
    *outs, bad = spec.generate([*good, PROMPTS[7]], params, use_tqdm=False)
    assert bad.finish_reason == "error" and len(bad.token_ids) <= FAIL_AT
    for prompt, out in zip(good, outs):
        assert out.finish_reason == "length" and out.metrics.spec_verify_steps > 0
        assert_greedy_match(cut_hf_model, tok.encode(prompt), out.token_ids, refs[prompt][0])
    assert_all_pages_free(spec)


def _late_mark(reqs) -> bool:
    return any(r.seed == MARK and len(r.output_token_ids) >= LATE for r in reqs)


def _fault_after_commit(monkeypatch, site: str) -> None:
    """A speculative step of a batch holding a request of seed MARK that has LATE tokens
    raises after its commit moved the requests' positions on the device: right after
    ``SamplingSlots.commit`` (k+1 columns), or once the drafter also kept the step's verify
    rows (at the start of ``LaunchedSpecStep.start``, before any request's tokens are pending).
    """
    if site == "commit":
        commit = SamplingSlots.commit

        def commit_then_fail(self, reqs, tokens, num_emitted) -> None:
            commit(self, reqs, tokens, num_emitted)
            if tokens.shape[1] > 1 and _late_mark(reqs):
                raise RuntimeError("injected fault after the commit")

        monkeypatch.setattr(SamplingSlots, "commit", commit_then_fail)
        return
    start = spec_worker.LaunchedSpecStep.start.__func__

    def fail_then_start(cls, worker, reqs, *args):
        if _late_mark(reqs):
            raise RuntimeError("injected fault after the commit")
        return start(cls, worker, reqs, *args)

    monkeypatch.setattr(spec_worker.LaunchedSpecStep, "start", classmethod(fail_then_start))


LATE_PROMPTS = [PROMPTS[0], REPEATED, PROMPTS[2], PROMPTS[7]]
LATE_PARAMS = [
    greedy(LATE_TOKENS),
    greedy(LATE_TOKENS),
    SamplingParams(temperature=0.8, seed=7, max_tokens=LATE_TOKENS, ignore_eos=True),
    greedy(LATE_TOKENS, seed=MARK),
]


@pytest.fixture(scope="module")
def late_want(llm) -> list:
    """Plain decoding of the good requests of the cases below (the same in every case), by
    this module's eager engine: no piecewise trace is built for it; then greedy decoding of
    the sampled request's prompt (its sample differs)."""
    prompts, params = [*LATE_PROMPTS[:3], LATE_PROMPTS[2]], [*LATE_PARAMS[:3], LATE_PARAMS[0]]
    return llm.generate(prompts, params, use_tqdm=False)


CASES = [
    *((a, o, "commit") for a in ("NGRAM", "EAGLE3", "STANDALONE", "NEXTN") for o in (False, True)),
    *((a, True, "drafter") for a in ("EAGLE3", "STANDALONE", "NEXTN")),
]


@pytest.mark.parametrize(
    ("algorithm", "overlap", "site"),
    CASES,
    ids=["-".join((a, "overlap" if o else "sync", s)) for a, o, s in CASES],
)
def test_a_step_failing_after_its_commit_advances_the_others_once(
    cut_smollm2_path,
    late_want,
    cut_hf_model,
    cut_drafts,
    monkeypatch,
    algorithm,
    overlap,
    site,
):
    """The halves run again from the positions before the failed step (rolled back): the
    greedy requests equal plain decoding and the seeded one, whose random stream follows its
    position counter, samples exactly plain decoding's tokens; the drafts accepted are those of
    a run without the failing request (a drafter's state is rolled back too). Under the overlap
    schedule the previous speculative step is still unread: a model drafter catches up from its
    verify rows, those of the failed step forgotten (``site`` "drafter") and, after a half ran,
    those of the other half kept.
    """
    _fault_after_commit(monkeypatch, site)
    # NOTE: the target drafting for itself: every greedy draft is accepted, unless a catch-up
    # went wrong
    target = str(cut_smollm2_path)
    path = target if algorithm == "STANDALONE" else cut_drafts.get(algorithm)
    draft = {} if path is None else {"speculative_draft_model_path": path}
    spec = LLM(
        target,
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        speculative_policy="always",
        disable_piecewise_cuda_graph=True,
        disable_overlap_schedule=not overlap,
        **draft,
    )
    prompts, params = LATE_PROMPTS, LATE_PARAMS
    *outs, bad = spec.generate(prompts, params, use_tqdm=False)
    assert bad.finish_reason == "error" and LATE <= len(bad.token_ids) < LATE_TOKENS
    tok = spec.get_tokenizer()
    for prompt, w, got in zip(prompts[:2], late_want, outs):
        assert got.finish_reason == "length" and got.metrics.spec_verify_steps > 0
        assert_greedy_match(cut_hf_model, tok.encode(prompt), got.token_ids, w.token_ids)
    assert outs[2].token_ids == late_want[2].token_ids != late_want[3].token_ids  # sampled
    monkeypatch.undo()  # the same requests without the failing one: the same drafts accepted
    clean = spec.generate(prompts[:3], params[:3], use_tqdm=False)
    for got, ref in zip(outs, clean):
        assert got.metrics.spec_accepted_per_position == ref.metrics.spec_accepted_per_position
    if algorithm == "STANDALONE":
        assert all(
            ref.metrics.spec_accepted_per_position == (ref.metrics.spec_verify_steps,) * K
            for ref in clean[:2]
        )
    assert_all_pages_free(spec)


def test_a_failure_of_every_request_stops_generate(llm, faulty_sampling):
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            llm.generate(PROMPTS[:2], greedy(NEW_TOKENS, seed=MARK), use_tqdm=False)
    finally:
        sched = llm.engine.scheduler
        for req in [*sched.waiting, *sched.running]:
            llm.engine.abort(req.group_id)
    assert_all_pages_free(llm)


def test_extreme_sampling_values_are_refused_or_sample():
    """The issue's repro values are refused up front; the extremes that pass sample fine."""
    for value in [{"top_p": 1e-300}, {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e-39}]:
        with pytest.raises(ValueError, match=next(iter(value))):
            SamplingParams(**value)


def test_extreme_sampling_values_that_pass_sample_next_to_others(llm, cut_hf_model, refs):
    tok = llm.get_tokenizer()
    odd = [
        {"repetition_penalty": 1.2e-38, "top_p": 0.5},
        {"repetition_penalty": 1.2e-38, "top_k": 5, "temperature": 0.7},
        {"repetition_penalty": 3e38, "min_p": 0.5},
    ]
    params = [
        greedy(NEW_TOKENS),
        *(SamplingParams(max_tokens=NEW_TOKENS, seed=1, ignore_eos=True, **kw) for kw in odd),
    ]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    prompt_ids = tok.encode(PROMPTS[0])
    assert_greedy_match(cut_hf_model, prompt_ids, outs[0].token_ids, refs[PROMPTS[0]][0])
    assert all(o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS for o in outs)


# --- the server: the failing request's client gets an error, the others their text ---------


async def _complete(client: TestClient, prompt: str, stream: bool, **extra: object):
    body = {
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    resp = await client.post("/v1/completions", json=body)
    if not stream:
        return resp.status, await resp.json()
    events = [line[6:] for line in (await resp.text()).splitlines() if line.startswith("data: ")]
    return resp.status, [json.loads(e) for e in events if e != "[DONE]"]


def test_the_server_answers_the_failing_request_with_an_error(
    llm, refs, faulty_sampling, monkeypatch
):
    monkeypatch.setattr(engine_loop, "Engine", lambda config: llm.engine)
    good = PROMPTS[3:5]

    async def run() -> list[tuple[int, object]]:
        engine = AsyncEngine(in_process=True)  # the injected engine
        await engine.start(llm.config)
        state = ServerState.build(engine, llm.config, ServerSettings())
        try:
            async with TestClient(TestServer(build_app(state))) as client:
                return await asyncio.gather(
                    *(_complete(client, p, stream=True) for p in good),
                    _complete(client, PROMPTS[8], stream=True, seed=MARK),
                    _complete(client, PROMPTS[9], stream=False, seed=MARK),
                )
        finally:
            await engine.stop()
            state.encoder.shutdown()

    *streams, bad_stream, (status, body) = asyncio.run(run())
    for (code, events), prompt in zip(streams, good):
        assert code == 200 and "".join(e["choices"][0]["text"] for e in events) == refs[prompt][1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
    code, events = bad_stream
    assert code == 200 and events[-1]["error"]["type"] == "internal_error"
    assert "injected fault" in events[-1]["error"]["message"]
    assert status == 500 and body["error"]["type"] == "internal_error"
    assert "injected fault" in body["error"]["message"]
    assert_all_pages_free(llm)
