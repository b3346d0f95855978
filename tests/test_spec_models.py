"""Model-based speculative decoding (STANDALONE, EAGLE3, NEXTN) end to end on the real SmolLM2
(CPU, float32): greedy (also with a repetition penalty) and seeded output equal plain decoding,
stops inside accepted runs, KV bookkeeping with preemption, draft graphs, the draft checks.

Drafts: STANDALONE uses SmolLM2 cut to its first 2 layers (cheap, and it disagrees often) and
SmolLM2 itself (every draft accepted); EAGLE3 (reduced draft vocabulary) and NEXTN use untrained
heads written in the published layouts, which prove losslessness and plumbing, not acceptance.
"""

from __future__ import annotations

import itertools
import shutil
import warnings
from collections import Counter, defaultdict

import pytest
import torch
from oracle import PROMPTS as ALL_PROMPTS
from oracle import assert_all_pages_free, assert_greedy_match, greedy
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.models.eagle3 import write_eagle3_checkpoint
from pcgspec.models.loader import load_config
from pcgspec.models.mtp import write_mtp_checkpoint
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.speculative.model_proposer import ModelProposer

K = 3
NEW_TOKENS = 64
PROMPTS = ALL_PROMPTS[:8] + [
    "Repeat exactly: the old lighthouse keeper climbed the stairs every night to light the "
    "lamp. The old lighthouse keeper",
    "a b c d e f g h a b c d e f g h a b",
]
ALGORITHMS = ("STANDALONE", "EAGLE3", "NEXTN")


@pytest.fixture(scope="module")
def drafts(smollm2_path, tmp_path_factory) -> dict[str, str]:
    """A draft folder per algorithm."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("drafts")
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(root / "standalone")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_path / name).is_file():
            shutil.copy(smollm2_path / name, root / "standalone" / name)
    config = load_config(smollm2_path)
    write_eagle3_checkpoint(root / "eagle3", config, seed=0, draft_vocab_size=4096)
    write_mtp_checkpoint(root / "mtp", config, seed=0, layout="deepseek")
    return {
        "STANDALONE": str(root / "standalone"),
        "EAGLE3": str(root / "eagle3"),
        "NEXTN": str(root / "mtp"),
    }


def spec_llm(smollm2_path, algorithm: str, draft, **kw) -> LLM:
    """A speculative engine; prefill runs eagerly unless ``disable_piecewise_cuda_graph=False``
    (NOTE: the piecewise trace of the 30-layer target costs ~8 s on the CI machine; the
    ``spec`` fixture's engines cover speculation behind piecewise prefill).
    """
    kw.setdefault("disable_piecewise_cuda_graph", True)
    return LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_draft_model_path=str(draft),
        speculative_num_steps=K,
        speculative_policy="always",
        **kw,
    )


class MemoizedPlain:
    """A plain engine whose ``generate`` is memoized by prompts and sampling parameters where
    its output is deterministic (greedy, or sampled with a seed): several tests, and each
    algorithm's run of one, compare with the same plain outputs.
    """

    def __init__(self, llm: LLM) -> None:
        self.llm, self.outputs = llm, {}

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def generate(self, prompts, params, use_tqdm: bool = False) -> list:
        many = params if isinstance(params, list) else [params]
        if any(p.temperature > 0 and p.seed is None for p in many):
            return self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        key = repr((prompts, params))
        if key not in self.outputs:
            self.outputs[key] = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        return self.outputs[key]


@pytest.fixture(scope="module")
def llm(plain_llm) -> MemoizedPlain:
    return MemoizedPlain(plain_llm)  # conftest: one build for the session


@pytest.fixture(scope="module")
def plain_outputs(llm) -> list:
    return llm.generate(PROMPTS, _greedy(), use_tqdm=False)


@pytest.fixture(scope="module", params=ALGORITHMS)
def spec(request, smollm2_path, drafts) -> LLM:
    return spec_llm(
        smollm2_path, request.param, drafts[request.param], disable_piecewise_cuda_graph=False
    )


def _greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return greedy(max_tokens, **kw)


def _assert_same_greedy(llm, hf_model, prompts, want, got) -> None:
    tok = llm.get_tokenizer()
    for prompt, w, g in zip(prompts, want, got):
        assert len(g.token_ids) == len(w.token_ids)
        assert_greedy_match(hf_model, tok.encode(prompt), g.token_ids, w.token_ids)


def test_greedy_equals_plain(llm, spec, plain_outputs, hf_model):
    outs = spec.generate(PROMPTS, _greedy(), use_tqdm=False)
    _assert_same_greedy(llm, hf_model, PROMPTS, plain_outputs, outs)
    assert all(o.metrics.spec_verify_steps > 0 for o in outs)
    assert_all_pages_free(spec)


def test_greedy_with_repetition_penalty_and_seeded_sampling(llm, spec, hf_model):
    prompts, params = PROMPTS[-4:], _greedy(24, repetition_penalty=1.2)
    want = llm.generate(prompts, params, use_tqdm=False)
    _assert_same_greedy(
        llm, hf_model, prompts, want, spec.generate(prompts, params, use_tqdm=False)
    )
    sampled = [
        SamplingParams(
            temperature=0.8,
            seed=100 + i,
            max_tokens=24,
            ignore_eos=True,
            **({"top_p": 0.9, "top_k": 40} if i % 2 else {}),
        )
        for i in range(3)
    ] + [_greedy(24)]  # a greedy request in a sampled batch
    want = llm.generate(prompts, sampled, use_tqdm=False)
    for w, g in zip(want, spec.generate(prompts, sampled, use_tqdm=False)):
        assert g.token_ids == w.token_ids


def test_self_draft_accepts_everything_and_stops_inside_runs(smollm2_path, llm):
    """The target as its own draft: every draft is accepted, so stops land inside accepted
    runs and max_tokens cuts runs short.
    """
    spec = spec_llm(smollm2_path, "STANDALONE", smollm2_path)
    prompt = "1, 2, 3, 4, 5,"
    base = llm.generate(prompt, _greedy(24), use_tqdm=False)[0]
    out = spec.generate(prompt, _greedy(24), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids and out.metrics.avg_spec_accept_length == K + 1
    out = spec.generate(prompt, _greedy(24, stop=[" 8,"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.index(" 8,")]
    for max_tokens in (1, K, K + 1, K + 2, 2 * K + 1):
        out = spec.generate(prompt, _greedy(max_tokens), use_tqdm=False)[0]
        assert out.token_ids == base.token_ids[:max_tokens] and out.finish_reason == "length"
    assert_all_pages_free(spec)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["EAGLE3"])
def test_preemption_restarts_the_draft(smollm2_path, drafts, llm, hf_model, algorithm, overlap):
    """10 pages of 16 tokens for 4 requests: steps fall back or preempt, and a preempted
    request's draft starts over from its new prefill (EAGLE3: with fresh hidden states). Under
    the overlap schedule a request is preempted with a speculative step in flight.
    """
    small = spec_llm(
        smollm2_path,
        algorithm,
        drafts[algorithm],
        max_total_tokens=160,
        disable_overlap_schedule=not overlap,
    )
    prompts = PROMPTS[-4:]
    want = llm.generate(prompts, _greedy(40), use_tqdm=False)
    outs = small.generate(prompts, _greedy(40), use_tqdm=False)
    _assert_same_greedy(llm, hf_model, prompts, want, outs)
    assert small.engine.scheduler.num_preemptions > 0
    assert_all_pages_free(small)


def test_draft_graphs_replay_like_eager_drafting(spec, plain_outputs):
    """The propose phase (padded catch-up + k-1 draft steps) from per-batch-size graphs (eager
    stand-in on CPU) gives the same drafts, hence the same accept counts, as eager drafting;
    batch 3 replays the bucket of 4 (a padded request).
    """
    proposer = spec.engine.spec_worker.proposer
    prompts, params = PROMPTS[:3], _greedy(16)
    eager = spec.generate(prompts, params, use_tqdm=False)
    proposer.graphs = DraftGraphRunner(proposer.runner, proposer.shape, max_bs=4, max_seq_len=2048)
    try:
        proposer.graphs.capture()
        graphed = spec.generate(prompts, params, use_tqdm=False)
        assert sorted(proposer.graphs.graphs) == [1, 2, 4]
        stats = spec.engine.graph_stats()["draft"]
        assert stats["runs"] > 0 and stats["padded_rows"] > 0
        assert not any(stats["fallbacks"].values())
        spec.generate(PROMPTS[:5], _greedy(2), use_tqdm=False)  # 5 > 4: drafted eagerly, counted
        assert spec.engine.graph_stats()["draft"]["fallbacks"]["batch_size"] > 0
    finally:
        proposer.graphs = None
    for e, g, want in zip(eager, graphed, plain_outputs):
        assert g.token_ids == e.token_ids == want.token_ids[:16]
        assert g.metrics.spec_accepted_per_position == e.metrics.spec_accepted_per_position


def test_every_page_free_after_mixed_requests(spec):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    params = [
        _greedy(1 + i % 6) if i % 2 else SamplingParams(temperature=0.8, max_tokens=6)
        for i in range(24)
    ]
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert all(o.finished and len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params))
    assert_all_pages_free(spec)


def test_logprobs_requests_fall_back_and_the_draft_keeps_up(llm, spec):
    """While a request in the batch wants logprobs, the batch takes plain decode steps; EAGLE3 /
    NEXTN still see the hidden state of every position, so once it finishes the other request
    speculates from where the plain steps left it.
    """
    prompts = PROMPTS[-2:]
    params = [_greedy(4, logprobs=2), _greedy(16)]
    want = llm.generate(prompts, params, use_tqdm=False)
    before = spec.engine.spec_stats()["fallback_steps"]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len(got[0].logprobs) == 4 and got[1].metrics.spec_verify_steps > 0
    assert spec.engine.spec_stats()["fallback_steps"] > before
    assert_all_pages_free(spec)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE", "NGRAM"])
def test_overlapped_plain_steps_between_speculative_ones_equal_plain(
    smollm2_path, drafts, llm, hf_model, algorithm
):
    """Under the overlap schedule the policy's plain steps are launched ahead of their tokens,
    and a speculative step after one is launched before the host read it (a drafter catches
    up with the newest tokens from the device).
    """
    draft = {} if algorithm == "NGRAM" else {"speculative_draft_model_path": drafts[algorithm]}
    spec = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        disable_overlap_schedule=False,
        disable_piecewise_cuda_graph=True,
        max_running_requests=4,
        **draft,
    )
    _assert_mixed_steps_equal_plain(spec, llm, hf_model)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_overlapped_speculative_steps_draft_and_emit_like_synchronous_ones(
    smollm2_path, drafts, llm, algorithm
):
    """Under the overlap schedule a speculative step is launched before the host read the one
    before it: its verify batch comes from the lengths on the device, and the draft catches up
    from the previous verify step's rows on the device. Every request gets the same drafts,
    step by step, as under synchronous steps (a wrong catch-up row would change them, though
    verification keeps the output right), and greedy (with a stop string and a repetition
    penalty) and seeded output equal plain decoding; nothing is left held.
    """

    prompts = PROMPTS[-4:] + PROMPTS[:2]
    params = [
        _greedy(32),
        _greedy(20, stop=[" the"]),
        _greedy(24, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=30, ignore_eos=True),
        _greedy(K + 1),
    ]
    want = llm.generate(prompts, params, use_tqdm=False)
    drafted, from_device = {}, {}
    for overlap in (False, True):
        spec = spec_llm(
            smollm2_path, algorithm, drafts[algorithm], disable_overlap_schedule=not overlap
        )
        engine, proposer = spec.engine, spec.engine.spec_worker.proposer
        drafted[overlap], from_device[overlap] = defaultdict(list), 0
        propose, catch_up = proposer.propose, proposer._catch_up_batch
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

        proposer.propose, proposer._catch_up_batch = recorded, counted
        proposer._catch_up_from_verified = counted_steady
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [g.text for g in got] == [w.text for w in want]
        assert not engine.in_flight and engine.slots.num_free == engine.slots.num_slots
        assert_all_pages_free(spec)
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


def _assert_mixed_steps_equal_plain(spec: LLM, plain: LLM, hf_model) -> None:
    """A fixed pattern of the policy's choices covers every switch (plain after speculative,
    speculative after a run of launched plain steps, after a prefill), with stops and
    max_tokens landing on pending tokens, and requests joining (``spec`` runs 4 at a time):
    output equals plain decoding, nothing is left held. Decode and mixed steps are launched
    over a speculative step the host has not read (their decode rows' lengths come from the
    device). A model drafter's catch-up rows through the host hold the requests' tokens, the
    newest taken from the device while the plain step that sampled it is in flight.
    """
    engine, pattern = spec.engine, itertools.cycle([True, False, False, True, True, False, False])
    assert engine.overlap and engine.config.max_running_requests == 4
    engine.spec_worker.policy.choose = lambda reqs: next(pattern)
    over_spec = _count_plain_steps_over_spec(engine)
    params = [_greedy(NEW_TOKENS), _greedy(9), _greedy(NEW_TOKENS, stop=[" the"])] * 3
    prompts = PROMPTS[: len(params)]
    proposer, rows, pending = engine.spec_worker.proposer, [], []
    if isinstance(proposer, ModelProposer):
        catch_up = proposer._catch_up_batch

        def recorded(batch, states):
            pending.append(sum(r.num_pending_tokens for r, s in zip(batch.requests, states) if s))
            out = catch_up(batch, states)
            k1 = out[0].spec_num_draft_tokens
            ids, pos, kv = (
                t.view(-1, k1).tolist()
                for t in (out[0].input_ids, out[0].positions, out[0].out_cache_loc)
            )
            for req, *row in zip(batch.requests, ids, pos, kv):
                rows.extend((req, t, p) for t, p, slot in zip(*row) if slot >= 0)  # valid rows
            return out

        proposer._catch_up_batch = recorded
    outs = spec.generate(prompts, params, use_tqdm=False)
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


def test_standalone_vocabulary_must_match(smollm2_path, tmp_path):
    tiny_hf_model("LlamaConfig").save_pretrained(tmp_path)  # vocabulary 256
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the target has 49152"):
        spec_llm(smollm2_path, "STANDALONE", tmp_path)


# GPU -------------------------------------------------------------------------------------------

# several engines on one device: each caps its KV cache
GPU_KW = {"dtype": "float32", "device": "cuda", "max_total_tokens": 1 << 15}
SPEC_KW = {"speculative_num_steps": K, "speculative_policy": "always"}


@pytest.fixture(scope="module")
def cuda_plain(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), **GPU_KW)


TREE_KW = {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 7}


def _algorithm_kw(algorithm: str) -> dict:
    """``EAGLE3-tree``: EAGLE3 drafting trees (topk 3, 7 nodes)."""
    name, _, tree = algorithm.partition("-")
    return {"speculative_algorithm": name, **(TREE_KW if tree else {})}


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN", "STANDALONE", "EAGLE3-tree"])
def test_cuda_graphs_greedy_equals_plain(smollm2_path, drafts, cuda_plain, hf_model, algorithm):
    """Verify and draft graphs on, 16 the largest captured batch: greedy output equals plain
    decoding at batch sizes 1, 3, 16 (the graphs replay buckets 1, 4 and 16) and 17 (eager).
    """
    name = algorithm.split("-")[0]
    draft = smollm2_path if name == "STANDALONE" else drafts[name]  # self-draft
    spec = LLM(
        str(smollm2_path),
        cuda_graph_max_bs=16,
        speculative_draft_model_path=str(draft),
        **_algorithm_kw(algorithm),
        **SPEC_KW,
        **GPU_KW,
    )
    runner, proposer = spec.engine.runner, spec.engine.spec_worker.proposer
    assert runner.verify_graphs is not None and proposer.graphs is not None
    for bs in (1, 3, 16, 17):
        prompts = (PROMPTS * 2)[:bs]
        want = cuda_plain.generate(prompts, _greedy(), use_tqdm=False)
        got = spec.generate(prompts, _greedy(), use_tqdm=False)
        _assert_same_greedy(cuda_plain, hf_model, prompts, want, got)
    graphs = spec.engine.graph_stats()
    stats = graphs["verify"]
    assert stats["runs"] > 0 and stats["fallbacks"]["batch_size"] > 0
    assert {k for k, v in stats["fallbacks"].items() if v} == {"batch_size"}
    assert graphs["draft"]["runs"] > 0 and graphs["draft"]["fallbacks"]["batch_size"] > 0
    if algorithm == "STANDALONE":
        assert spec.engine.spec_stats()["avg_spec_accept_length"] > K  # near-ties aside: K + 1
    assert_all_pages_free(spec)


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
    _assert_mixed_steps_equal_plain(spec, cuda_plain, hf_model)


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3", "NGRAM", "EAGLE3-tree"])
def test_cuda_speculative_step_never_synchronizes(smollm2_path, drafts, algorithm):
    """A speculative step (propose, verify, accept, commit) makes no synchronizing CUDA call
    (counted by torch's sync debug mode): its accepted lengths and tokens go to the host by a
    non-blocking copy, which the host waits for, behind an event, one step later.
    """
    draft = {"STANDALONE": str(smollm2_path), "EAGLE3": drafts["EAGLE3"], "NGRAM": None}
    spec = LLM(
        str(smollm2_path),
        speculative_draft_model_path=draft[algorithm.split("-")[0]],
        **_algorithm_kw(algorithm),
        **SPEC_KW,
        **GPU_KW,
    )
    engine = spec.engine
    ids = spec.get_tokenizer().encode(PROMPTS[-2])
    for _ in range(3):
        engine.add_request(ids, _greedy(64))
    for _ in range(4):  # the prefill, then speculative steps (kernels compiled)
        engine.step()
    speculative = 0
    for _ in range(12):  # NOTE: prompt lookup takes a plain step where no request matches
        before = engine.spec_stats()["verify_steps"]
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        if engine.spec_stats()["verify_steps"] == before + 3:
            speculative += 1
            assert not syncs, syncs
    assert speculative >= 3


@pytest.mark.gpu
def test_cuda_memory_flat_over_1000_steps(smollm2_path, drafts):
    from pcgspec.engine.engine import Engine

    spec = LLM(
        str(smollm2_path),
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=drafts["EAGLE3"],
        **SPEC_KW,
        **GPU_KW,
    )
    engine: Engine = spec.engine
    ids = spec.get_tokenizer().encode(PROMPTS[0])
    for _ in range(4):
        engine.add_request(ids, _greedy(1200))
    allocated = []
    for step in range(1000):
        engine.step()
        if step in (100, 999):
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
    assert engine.spec_stats()["verify_steps"] >= 4 * 800
    assert allocated[1] - allocated[0] < 1 << 20, f"memory grew by {allocated[1] - allocated[0]}"


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN", "STANDALONE", "NGRAM"])
def test_tiny_targets_greedy_equal_plain(smollm2_path, tmp_path, algorithm):
    """Tiny random targets: a MiMo checkpoint whose own MTP layer drafts (NEXTN, no draft path),
    and a Llama with an EAGLE3 head, another tiny Llama (STANDALONE) or prompt lookup; greedy
    output, also with a repetition penalty, equals plain decoding. The SmolLM2 tokenizer stands
    in (prompt ids stay below the tiny vocabulary).
    """
    from pcgspec.models.random_weights import shape_config

    target, draft = tmp_path / "llama", {}
    if algorithm == "NEXTN":
        target = write_mtp_checkpoint(
            tmp_path / "mimo", shape_config("tiny"), seed=1, layout="mimo"
        )
    else:
        tiny_hf_model("LlamaConfig").save_pretrained(target)  # context 128
    if algorithm == "EAGLE3":
        path = write_eagle3_checkpoint(tmp_path / "eagle3", load_config(target), seed=1)
        draft = {"speculative_draft_model_path": str(path)}
    if algorithm == "STANDALONE":
        small = tiny_hf_model("LlamaConfig")  # the target's first layer only
        small.model.layers, small.config.num_hidden_layers = small.model.layers[:1], 1
        small.save_pretrained(tmp_path / "small")
        draft = {"speculative_draft_model_path": str(tmp_path / "small")}
    kw = {"dtype": "float32", "device": "cpu", "tokenizer": str(smollm2_path)}
    plain = LLM(str(target), **kw)
    spec = LLM(str(target), speculative_algorithm=algorithm, **SPEC_KW, **draft, **kw)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 9)]
    for penalty in (1.0, 1.3):
        params = _greedy(32, repetition_penalty=penalty)
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.spec_stats()["verify_steps"] > 0
    assert_all_pages_free(spec)


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_overlapped_requests_join_finish_and_abort_mid_run(smollm2_path, drafts, llm, algorithm):
    """Under the overlap schedule requests join, finish and are aborted while speculative steps
    are in flight (an abort drops the results of its step in flight): the others' greedy
    output equals plain decoding, and at the end every sampling slot and page is free. A
    joining prompt's prefill runs in a mixed step launched over the speculative step in flight
    (the decode rows' lengths come from the device).
    """
    draft = {} if algorithm == "NGRAM" else {"speculative_draft_model_path": drafts[algorithm]}
    spec = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_num_steps=K,
        speculative_policy="always",
        disable_overlap_schedule=False,
        max_running_requests=4,
        disable_piecewise_cuda_graph=True,
        **draft,
    )
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
