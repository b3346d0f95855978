"""Model-based speculative decoding (STANDALONE, EAGLE3, NEXTN) end to end on SmolLM2 (CPU,
float32): greedy output equals plain decoding on the real model; on SmolLM2 cut to its first
layers (conftest's ``cut_*``: the engine's mechanics, ~3x cheaper per token) greedy (also with a
repetition penalty) and seeded output equal plain decoding of the same model, stops inside
accepted runs, KV bookkeeping, draft graphs, the draft checks; test_spec_overlap runs them under
the overlap schedule.

Drafts: STANDALONE uses the target cut to its first 2 layers (cheap, and it disagrees often) and
the target itself (every draft accepted); EAGLE3 (reduced draft vocabulary) and NEXTN use
untrained heads written in the published layouts, which prove losslessness and plumbing, not
acceptance.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from oracle import assert_all_pages_free
from spec_setup import (
    ALGORITHMS,
    GPU_KW,
    GPU_NEW_TOKENS,
    PROMPTS,
    SPEC_KW,
    K,
    MemoizedPlain,
    plain_cpu_llm,
    spec_llm,
)
from spec_setup import assert_same_greedy as _assert_same_greedy
from spec_setup import greedy_params as _greedy
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.models.eagle3 import write_eagle3_checkpoint
from pcgspec.models.loader import load_config
from pcgspec.models.mtp import write_mtp_checkpoint
from pcgspec.runners.draft_graph_runner import DraftGraphRunner


@pytest.fixture(scope="module")
def llm(plain_llm) -> MemoizedPlain:
    return MemoizedPlain(plain_llm)  # conftest: one build for the session


@pytest.fixture(scope="module")
def cut_llm(cut_smollm2_path) -> MemoizedPlain:
    """Plain decoding of the cut target: the reference of the ``spec`` engines."""
    return MemoizedPlain(plain_cpu_llm(cut_smollm2_path))


@pytest.fixture(scope="module")
def cuda_plain(smollm2_path) -> LLM:
    return LLM(str(smollm2_path), **GPU_KW)


@pytest.fixture(scope="module", params=ALGORITHMS)
def full_spec(request, smollm2_path, drafts) -> LLM:
    """A speculative engine of the real SmolLM2 (prefill eager: ``spec`` covers piecewise)."""
    return spec_llm(smollm2_path, request.param, drafts[request.param])


@pytest.fixture(scope="module", params=ALGORITHMS)
def spec(request, cut_smollm2_path, cut_drafts) -> LLM:
    """A speculative engine of the cut target, behind piecewise prefill."""
    return spec_llm(
        cut_smollm2_path,
        request.param,
        cut_drafts[request.param],
        disable_piecewise_cuda_graph=False,
    )


def test_greedy_equals_plain(llm, full_spec, hf_model):
    """On the real SmolLM2, half the prompts (prose, a count, a text to copy: drafts both
    accepted and rejected); the cut target's engines check the mechanics at more sizes."""
    prompts = PROMPTS[::2]
    want = llm.generate(prompts, _greedy(), use_tqdm=False)
    outs = full_spec.generate(prompts, _greedy(), use_tqdm=False)
    _assert_same_greedy(llm, hf_model, prompts, want, outs)
    assert all(o.metrics.spec_verify_steps > 0 for o in outs)
    assert_all_pages_free(full_spec)


def test_greedy_with_repetition_penalty_and_seeded_sampling(cut_llm, spec, cut_hf_model):
    prompts, params = PROMPTS[-4:], _greedy(16, repetition_penalty=1.2)
    want = cut_llm.generate(prompts, params, use_tqdm=False)
    unpenalized = cut_llm.generate(prompts, _greedy(16), use_tqdm=False)
    assert all(w.token_ids != u.token_ids for w, u in zip(want, unpenalized))
    got = spec.generate(prompts, params, use_tqdm=False)
    _assert_same_greedy(cut_llm, cut_hf_model, prompts, want, got)
    assert all(o.metrics.spec_verify_steps > 0 for o in got)
    sampled = [
        SamplingParams(
            temperature=0.8,
            seed=100 + i,
            max_tokens=16,
            ignore_eos=True,
            **({"top_p": 0.9, "top_k": 40} if i % 2 else {}),
        )
        for i in range(3)
    ] + [_greedy(16)]  # a greedy request in a sampled batch
    want = cut_llm.generate(prompts, sampled, use_tqdm=False)
    for w, g in zip(want, spec.generate(prompts, sampled, use_tqdm=False)):
        assert g.token_ids == w.token_ids


def test_self_draft_accepts_everything_and_stops_inside_runs(cut_smollm2_path, cut_llm):
    """The target as its own draft: every draft is accepted, so stops land inside accepted
    runs and max_tokens cuts runs short.
    """
    spec = spec_llm(cut_smollm2_path, "STANDALONE", cut_smollm2_path)
    prompt = "1, 2, 3, 4, 5,"
    base = cut_llm.generate(prompt, _greedy(12), use_tqdm=False)[0]
    out = spec.generate(prompt, _greedy(12), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids and out.metrics.avg_spec_accept_length == K + 1
    # NOTE: outputs 1-4, 5-8, 9-12 are the runs; the stop's first match ends inside 5-8
    tok = spec.get_tokenizer()
    stop = tok.decode(base.token_ids[4:7])
    assert base.text.index(stop) + len(stop) == len(tok.decode(base.token_ids[:7]))
    out = spec.generate(prompt, _greedy(12, stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.index(stop)]
    for max_tokens in (1, K, K + 1, K + 2, 2 * K + 1):
        out = spec.generate(prompt, _greedy(max_tokens), use_tqdm=False)[0]
        assert out.token_ids == base.token_ids[:max_tokens] and out.finish_reason == "length"
    assert_all_pages_free(spec)


def test_draft_graphs_replay_like_eager_drafting(cut_llm, spec):
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
    for e, g, want in zip(eager, graphed, cut_llm.generate(prompts, params, use_tqdm=False)):
        assert g.token_ids == e.token_ids == want.token_ids
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


def test_logprobs_requests_fall_back_and_the_draft_keeps_up(cut_llm, spec):
    """While a request in the batch wants logprobs, the batch takes plain decode steps; EAGLE3 /
    NEXTN still see the hidden state of every position, so once it finishes the other request
    speculates from where the plain steps left it.
    """
    prompts = PROMPTS[-2:]
    params = [_greedy(4, logprobs=2), _greedy(16)]
    want = cut_llm.generate(prompts, params, use_tqdm=False)
    before = spec.engine.spec_stats()["fallback_steps"]
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert len(got[0].logprobs) == 4 and got[1].metrics.spec_verify_steps > 0
    assert spec.engine.spec_stats()["fallback_steps"] > before
    assert_all_pages_free(spec)


def test_standalone_vocabulary_must_match(cut_smollm2_path, tmp_path):
    tiny_hf_model("LlamaConfig").save_pretrained(tmp_path)  # vocabulary 256
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the target has 49152"):
        spec_llm(cut_smollm2_path, "STANDALONE", tmp_path)


# GPU -------------------------------------------------------------------------------------------

# several engines on one device: each caps its KV cache
TREE_KW = {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 7}


def _algorithm_kw(algorithm: str) -> dict:
    """``EAGLE3-tree``: EAGLE3 drafting trees (topk 3, 7 nodes)."""
    name, _, tree = algorithm.partition("-")
    return {"speculative_algorithm": name, **(TREE_KW if tree else {})}


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN", "STANDALONE", "EAGLE3-tree"])
def test_cuda_graphs_greedy_equals_plain(smollm2_path, drafts, cuda_plain, hf_model, algorithm):
    """Speculative step graphs on, 16 the largest captured batch: greedy output equals plain
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
        want = cuda_plain.generate(prompts, _greedy(GPU_NEW_TOKENS), use_tqdm=False)
        got = spec.generate(prompts, _greedy(GPU_NEW_TOKENS), use_tqdm=False)
        _assert_same_greedy(cuda_plain, hf_model, prompts, want, got)
    graphs = spec.engine.graph_stats()
    steps = graphs["spec_step"]  # every step of up to 16 requests: one replay
    assert steps["runs"] > 0 and steps["fallbacks"]["batch_size"] > 0
    for name in ("spec_step", "verify", "draft"):
        assert {k for k, v in graphs[name]["fallbacks"].items() if v} == {"batch_size"}
    if algorithm == "STANDALONE":
        assert spec.engine.spec_stats()["avg_spec_accept_length"] > K  # near-ties aside: K + 1
    assert_all_pages_free(spec)


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
