"""End-to-end generation on the real SmolLM2 against transformers, plus engine behaviour."""

from __future__ import annotations

import pytest
import torch
from oracle import PROMPTS as ALL_PROMPTS
from oracle import assert_greedy_match, assert_pool_whole, hf_greedy

from pcgspec import LLM, SamplingParams

PROMPTS = ALL_PROMPTS[:11]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(plain_llm) -> LLM:
    return plain_llm  # conftest: one build for the modules


@pytest.fixture(scope="module")
def cut_llm(cut_smollm2_path) -> LLM:
    """The plain engine of SmolLM2 cut to its first layers (conftest), piecewise prefill as
    ``llm``'s: the target of the tests of mechanics (batching, preemption, seeded sampling),
    which compare the engine with itself or with the cut model's oracle, not with a text."""
    return LLM(str(cut_smollm2_path), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def greedy_refs(llm, hf_model):
    tok = llm.get_tokenizer()
    return {p: hf_greedy(hf_model, tok.encode(p), NEW_TOKENS) for p in PROMPTS}


def _greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_matches_transformers(llm, hf_model, greedy_refs):
    outs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == NEW_TOKENS
        assert_greedy_match(hf_model, tok.encode(prompt), out.token_ids, greedy_refs[prompt])
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_batch_invariance_alone_vs_batch_of_16(cut_llm, cut_hf_model):
    tok = cut_llm.get_tokenizer()
    target = PROMPTS[2]
    alone = cut_llm.generate(target, _greedy(), use_tqdm=False)[0].token_ids
    others = [p * (1 + i % 3) for i, p in enumerate(ALL_PROMPTS) if p != target]
    assert len(others) == 15
    batch = cut_llm.generate(others[:7] + [target] + others[7:], _greedy(), use_tqdm=False)
    ids = tok.encode(target)
    assert_greedy_match(cut_hf_model, ids, batch[7].token_ids, alone)
    assert_greedy_match(cut_hf_model, ids, alone, hf_greedy(cut_hf_model, ids, NEW_TOKENS))


def test_preempted_request_finishes_with_same_tokens(cut_smollm2_path, cut_llm, cut_hf_model):
    tok = cut_llm.get_tokenizer()
    prompts = PROMPTS[:4]
    ref = [o.token_ids for o in cut_llm.generate(prompts, _greedy(40), use_tqdm=False)]
    # 4 pages of 16 tokens per request cannot hold 4 requests growing to ~50 tokens each.
    small = LLM(
        str(cut_smollm2_path),
        dtype="float32",
        device="cpu",
        max_total_tokens=160,
        disable_piecewise_cuda_graph=True,
    )
    outs = small.generate(prompts, _greedy(40), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, out, want in zip(prompts, outs, ref):
        assert_greedy_match(cut_hf_model, tok.encode(prompt), out.token_ids, want)
    assert_pool_whole(small.engine)


def test_seeded_sampling_reproduces_alone_and_in_batch(cut_llm):
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    alone = cut_llm.generate(PROMPTS[0], params, use_tqdm=False)[0].token_ids
    mixed = [SamplingParams(temperature=1.0, max_tokens=8 + i, ignore_eos=True) for i in range(5)]
    batch = cut_llm.generate(PROMPTS[1:6] + [PROMPTS[0]], mixed + [params], use_tqdm=False)
    assert batch[-1].token_ids == alone
    other = cut_llm.generate(
        PROMPTS[0],
        SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=4321, max_tokens=24, ignore_eos=True
        ),
        use_tqdm=False,
    )[0].token_ids
    assert other != alone


def test_stop_string_and_stop_token(llm):
    base = llm.generate("1, 2, 3, 4, 5,", _greedy(24), use_tqdm=False)[0]
    assert " 8," in base.text
    out = llm.generate("1, 2, 3, 4, 5,", _greedy(24, stop=[" 8,"]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == " 8,"
    assert out.text == base.text[: base.text.index(" 8,")]
    stop_id = base.token_ids[3]
    out = llm.generate("1, 2, 3, 4, 5,", _greedy(24, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop"


def test_eos_and_max_tokens(llm):
    out = llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(temperature=0, max_tokens=200),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids
    out = llm.generate("Hello", _greedy(5), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_logprobs_are_raw_log_softmax(llm, hf_model):
    tok = llm.get_tokenizer()
    prompt = PROMPTS[0]
    out = llm.generate(prompt, _greedy(3, logprobs=5), use_tqdm=False)[0]
    ids = tok.encode(prompt)
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)
    for j, entry in enumerate(out.logprobs):
        token = out.token_ids[j]
        assert abs(entry[token].logprob - ref[j, token].item()) < 1e-4
        top = torch.topk(ref[j], 5)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for rank, t in enumerate(top.indices.tolist(), start=1):  # vLLM's Logprob shape
            assert entry[t].rank == rank and entry[t].decoded_token == tok.decode([t])


def test_n_sequences_and_metrics(llm):
    out = llm.generate(
        PROMPTS[0],
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert out.metrics.ttft is not None and out.metrics.ttft > 0
    assert out.metrics.tokens_per_s is not None and out.metrics.num_output_tokens == 24


def test_bad_input(llm, smollm2_path, tmp_path):
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens but the context length is 64"):
        LLM(
            str(smollm2_path), dtype="float32", context_length=64, disable_piecewise_cuda_graph=True
        ).generate("hi " * 100)
    with pytest.raises(ValueError, match="bogus"):
        LLM(str(smollm2_path), bogus=1)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("hi", SamplingParams(temperature=-1))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"))


def test_llm_leaves_the_callers_collector_as_it_found_it(smollm2_path):
    """``LLM`` freezes nothing in the caller's process (``gc.freeze`` is process-wide); a
    dropped engine is freed, cycles and all, by the next start-up's collection at the latest.
    """
    import gc
    import weakref

    frozen = gc.get_freeze_count()
    small = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        max_total_tokens=256,
        disable_piecewise_cuda_graph=True,
    )
    assert gc.get_freeze_count() == frozen
    assert small.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    small.shutdown()
    gone = weakref.ref(small.engine)
    del small
    LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        max_total_tokens=256,
        disable_piecewise_cuda_graph=True,
    )
    assert gone() is None
    assert gc.get_freeze_count() == frozen


def test_the_engine_process_freezes_what_start_up_built(plain_llm, monkeypatch):
    """The server's engine process is pcgspec's own: once the engine is built, what start-up
    built leaves the collector (H200: 280 -> 72 ms per full collection in bench_spec).
    """
    import gc

    import pcgspec.server.engine_loop as engine_loop

    monkeypatch.setattr(engine_loop, "Engine", lambda config: plain_llm.engine)
    if gc.get_freeze_count():  # NOTE: whatever froze this process before: start from none
        gc.unfreeze()
    counts = []

    def deliver(message) -> None:
        if message[0] == "ready":
            counts.append((gc.get_freeze_count(), gc.get_count()[2]))
            channel.inbox.put(("stop",))

    channel = engine_loop.ThreadChannel(deliver)
    try:
        engine_loop.run_engine(plain_llm.config, channel)
        engine_loop.run_engine(plain_llm.config, channel, freeze=True)
    finally:
        gc.unfreeze()
    (before, _), (frozen, oldest) = counts
    assert before == 0 and frozen > 10_000  # the model's modules and tensors among them
    assert oldest == 0  # nothing left in the oldest generation to scan
