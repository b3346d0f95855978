"""PiecewiseRunner through ModelRunner: one trace for every token count, outputs equal to eager
for mixed batches around bucket boundaries, padding that changes no real row and writes no KV,
the ``can_run`` guard and its counters, FULL hidden capture, inductor pieces; CUDA graphs in the
``gpu`` tests.

Float32 tolerances are relative to the tensor's scale (hidden states reach ~50 here): padding
changes the matmul row count, and with it MKL's / cuBLAS's blocking, by an ulp or so.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
import torch
from oracle import PROMPTS
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.config import EngineConfig
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.runners.model_runner import ModelRunner

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
NULL, FULL = CaptureHiddenMode.NULL, CaptureHiddenMode.FULL
TOKEN_COUNTS = [7, 1, 2, 3, 4, 5, 6, 8, 9, 12, 13, 15, 16, 17, 20, 24, 31, 33, 40, 48]
AUX_LAYERS = (0, 1, 3)  # the tiny model has 3 layers; 3 = the final pre-norm residual stream


@pytest.fixture(scope="module")
def smollm2_runner(smollm2_path) -> ModelRunner:
    llm = LLM(str(smollm2_path), dtype="float32", device="cpu", piecewise_cuda_graph_max_tokens=256)
    return llm.engine.runner


@pytest.fixture
def runner(smollm2_runner, monkeypatch) -> ModelRunner:
    """The SmolLM2 runner padding to buckets as on CUDA (off CUDA it does not by default)."""
    monkeypatch.setattr(smollm2_runner.piecewise, "pad_without_graphs", True)
    return smollm2_runner


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("LlamaConfig").save_pretrained(path)
    return path


def tiny_runner(path, **kw: object) -> ModelRunner:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device="cpu",
        page_size=4,
        cpu_kv_cache_bytes=1 << 22,
        piecewise_cuda_graph_max_tokens=64,
        **kw,
    )
    runner = ModelRunner(config, path)
    runner.piecewise.pad_without_graphs = True
    return runner


@pytest.fixture(scope="module")
def full_runner(tiny_path) -> ModelRunner:
    return tiny_runner(tiny_path, aux_hidden_state_layers=AUX_LAYERS)


def split(num_tokens: int, parts: int, rng: random.Random) -> list[int]:
    """``num_tokens`` as ``parts`` positive lengths (fewer when there are too few tokens)."""
    parts = min(parts, num_tokens)
    cuts = sorted(rng.sample(range(1, num_tokens), parts - 1))
    return [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]


@torch.inference_mode()
def make_batch(
    runner: ModelRunner,
    new_lens: Sequence[int],
    prefix_lens: Sequence[int] | None = None,
    mode: ForwardMode = EXTEND,
    hidden: CaptureHiddenMode = NULL,
    seed: int = 0,
) -> ForwardBatch:
    """Requests on disjoint pages; their prefixes are written to the KV cache first (eagerly)."""
    rng, page_size = random.Random(seed), runner.page_size
    prefix_lens = prefix_lens or [0] * len(new_lens)
    chunks, prefixes, page = [], [], 0
    for new, prefix in zip(new_lens, prefix_lens, strict=True):
        pages = list(range(page, page + -(-(prefix + new) // page_size)))
        page += len(pages)
        ids = [rng.randrange(runner.vocab_size) for _ in range(prefix + new)]
        chunks.append(SeqChunk(ids[prefix:], prefix, pages))
        if prefix:
            prefixes.append(SeqChunk(ids[:prefix], 0, pages))
    if prefixes:
        runner.run_eager(build_forward_batch(EXTEND, prefixes, page_size, runner.device))
    return build_forward_batch(mode, chunks, page_size, runner.device, capture_hidden_mode=hidden)


def mixed_batch(runner: ModelRunner, num_tokens: int, seed: int = 0) -> ForwardBatch:
    """Up to 4 requests with ``num_tokens`` new tokens in all, some after a cached prefix."""
    rng = random.Random(seed)
    lens = split(num_tokens, 4, rng)
    return make_batch(runner, lens, [rng.choice([0, 0, 5, 37]) for _ in lens], seed=seed)


@torch.inference_mode()
def eager_and_piecewise(runner: ModelRunner, batch: ForwardBatch) -> tuple[tuple, tuple]:
    def copy(out: tuple) -> tuple:
        return tuple(None if t is None else t.clone() for t in out)

    assert runner.piecewise.can_run(batch)
    return copy(runner.run_eager(batch)), copy(runner.piecewise.run(batch))


def assert_near(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Max abs difference within ``rel`` times the largest magnitude of ``want``."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rel * scale, f"max abs diff {err:.3g} > {rel:g} x {scale:.3g}"


def check_bf16_logits(runner: ModelRunner, token_counts: Sequence[int]) -> None:
    """bf16 piecewise logits against bf16 eager ones on mixed batches, row by row: a row's
    error is its mean absolute difference over its mean |logit|. The median row must be within
    2% and at most one row in eight past 5%, and the argmax must agree where eager's top two
    are clear (> 0.5 apart) among the rows within 5%. A wrong stride, position or mask moves
    most rows; one row apart is bf16's: on random tokens the real model has ill-conditioned
    rows where an ulp moves the logits wholesale (SmolLM2, the 16-token batch, pieces compiled
    by Inductor on CPU: one row's eager bf16 logits lie 27 from float32's, mean |logit| 7, the
    pieces' 2.4; in float32 pieces and eager agree exactly).
    """
    for n in token_counts:
        batch = mixed_batch(runner, n, seed=n)
        (want, _), (got, _) = eager_and_piecewise(runner, batch)
        with torch.inference_mode():
            want = runner.model.compute_logits(want).float()
            got = runner.model.compute_logits(got).float()
        rows = (got - want).abs().mean(-1) / want.abs().mean(-1)
        assert rows.median() < 0.02, (n, rows.median().item())
        apart = rows > 0.05
        assert 8 * int(apart.sum()) <= n, (n, rows[apart].tolist())
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1] > 0.5) & ~apart
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), n


RUNS = "runs"


def counts(runner: ModelRunner) -> dict[str, int]:
    """The piecewise runner's runs and fallbacks by reason, flat."""
    stats = runner.piecewise.stats()
    return {RUNS: stats["runs"], **stats["fallbacks"]}


def stats_delta(runner: ModelRunner, before: dict[str, int]) -> dict[str, int]:
    after = counts(runner)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def check_boundary_batches(runner: ModelRunner, rel: float) -> None:
    """Mixed extend batches at a bucket boundary (48) and one token past it (padded to 64);
    decode batches of 16 and 17 requests likewise.
    """
    assert {16, 20, 48, 64} <= set(runner.piecewise.buckets)
    for n in (48, 49, 16, 17):
        if n > 20:
            batch = mixed_batch(runner, n, seed=n)
        else:
            batch = make_batch(runner, [1] * n, [3 + 2 * i for i in range(n)], DECODE, seed=n)
        (want, want_aux), (got, got_aux) = eager_and_piecewise(runner, batch)
        assert got.shape[0] == n and want_aux is None and got_aux is None
        assert_near(got, want, rel)


def test_one_trace_for_20_token_counts_padded_or_not(runner):
    piecewise = runner.piecewise
    before = counts(runner)
    for i, n in enumerate(TOKEN_COUNTS):
        batch = mixed_batch(runner, n, seed=i)
        piecewise.pad_without_graphs = i % 2 == 0
        with torch.inference_mode():
            want = runner.model.compute_logits(runner.run_eager(batch)[0][batch.logits_indices])
        assert_near(runner.forward(batch).logits, want, 1e-5)
    assert piecewise.backend.num_traces == 1
    assert stats_delta(runner, before) == {RUNS: len(TOKEN_COUNTS)}


def test_piecewise_equals_eager_at_bucket_boundary_and_one_past(runner):
    check_boundary_batches(runner, 1e-5)


def test_padding_changes_no_real_row_and_writes_no_kv(runner, monkeypatch):
    piecewise, kv = runner.piecewise, runner.kv_cache
    batch = mixed_batch(runner, 13, seed=3)
    slots = batch.out_cache_loc
    with torch.inference_mode():
        want = runner.run_eager(batch)[0].clone()
    for buckets in ([13], [14], [4, 64]):
        monkeypatch.setattr(piecewise, "buckets", buckets)
        before = [kv.k[0].clone(), kv.v[-1].clone()]
        with torch.inference_mode():
            got = piecewise.run(batch)[0].clone()
        padded_rows = runner.attn_backend.metadata.store_loc.shape[0]  # torch backend
        assert padded_rows == pad_to_bucket(13, buckets) and got.shape[0] == 13
        assert_near(got, want, 1e-5)
        for cache, old in zip((kv.k[0], kv.v[-1]), before):
            changed = (cache != old).flatten(1).any(1).nonzero().flatten()
            assert set(changed.tolist()) <= set(slots.tolist()) | {kv.scratch_slot}


def test_can_run_rejects_each_reason_and_counts_it(runner):
    base = make_batch(runner, [5, 3], [0, 4])
    hidden = runner.model.model.embed_tokens(base.input_ids).detach()
    cases = {  # NOTE: too_many_tokens last: it overwrites the pages of base's prefix
        RUNS: base,
        "target_verify": dataclasses.replace(base, forward_mode=ForwardMode.TARGET_VERIFY),
        "hidden_mode": dataclasses.replace(base, capture_hidden_mode=FULL),
        "input_embeds": dataclasses.replace(base, input_embeds=hidden),
        "input_logprobs": dataclasses.replace(base, return_input_logprobs=True),
        "too_many_tokens": make_batch(runner, [runner.piecewise.max_tokens + 1]),
    }
    with torch.inference_mode():
        want = runner.model.compute_logits(runner.run_eager(base)[0][base.logits_indices])
    for reason, batch in cases.items():
        before = counts(runner)
        logits = runner.forward(batch).logits
        assert stats_delta(runner, before) == {reason: 1}
        if batch is not cases["too_many_tokens"]:
            assert_near(logits, want, 1e-5)
    idle = dataclasses.replace(base, forward_mode=ForwardMode.IDLE, input_ids=base.input_ids[:0])
    before = counts(runner)
    assert not runner.piecewise.can_run(idle)
    assert stats_delta(runner, before) == {"empty": 1}


def test_full_hidden_mode_keeps_prefill_on_piecewise(full_runner):
    runner = full_runner
    assert runner.capture_hidden_mode(EXTEND) is FULL
    assert runner.capture_hidden_mode(DECODE) is NULL
    for n in (4, 5, 13):
        batch = make_batch(runner, split(n, 3, random.Random(n)), [0, 6, 2], hidden=FULL, seed=n)
        with torch.inference_mode():
            want_hidden, want_aux = (t.clone() for t in runner.run_eager(batch))
        before = counts(runner)
        out = runner.forward(batch)
        assert stats_delta(runner, before) == {RUNS: 1}
        assert out.hidden_states.shape == (n, len(AUX_LAYERS) * runner.model.hidden_size)
        assert_near(out.hidden_states, want_aux, 1e-5)
        assert_near(
            out.logits, runner.model.compute_logits(want_hidden[batch.logits_indices]), 1e-5
        )
    null = make_batch(runner, [3, 2])
    before = counts(runner)
    runner.forward(null)
    assert stats_delta(runner, before) == {"hidden_mode": 1}
    with pytest.raises(RuntimeError, match="aux_hidden_state_layers"):
        runner.set_aux_hidden_layers([1])


def test_captured_buckets_replay_their_tapes_through_the_runner(tiny_path):
    """The runner's CUDA path on CPU: capture every bucket (``_EagerGraph`` standing in for CUDA
    graphs), then replay the tapes for mixed batches, FULL hidden states included.
    """
    runner = tiny_runner(
        tiny_path, piecewise_cuda_graph_tokens="4,8,16,64", aux_hidden_state_layers=AUX_LAYERS
    )
    piecewise = runner.piecewise
    piecewise.use_graphs = True
    piecewise.capture()
    assert piecewise.graphs.captured == {4, 8, 16, 64}
    assert piecewise.graphs.num_graphs == 4 * (runner.model.num_layers + 1)
    for i, n in enumerate((1, 3, 8, 9, 16, 40, 64, 5)):
        lens = split(n, 3, random.Random(i))
        batch = make_batch(runner, lens, [i % 2 * 7] * len(lens), hidden=FULL, seed=i)
        (want, want_aux), (got, got_aux) = eager_and_piecewise(runner, batch)
        assert_near(got, want, 1e-5)
        assert_near(got_aux, want_aux, 1e-5)
    assert piecewise.backend.num_traces == 1


@pytest.mark.slow
def test_inductor_pieces_through_the_runner(tiny_path):
    runner = tiny_runner(
        tiny_path, piecewise_cuda_graph_compiler="inductor", aux_hidden_state_layers=AUX_LAYERS
    )
    for i, n in enumerate((1, 3, 16, 17, 40, 64)):
        lens = split(n, 3, random.Random(i))
        batch = make_batch(runner, lens, [i % 2 * 7] * len(lens), hidden=FULL, seed=i)
        (want, want_aux), (got, got_aux) = eager_and_piecewise(runner, batch)
        assert_near(got, want, 1e-5)
        assert_near(got_aux, want_aux, 1e-5)
    assert runner.piecewise.backend.num_traces == 1


def test_bf16_inductor_pieces_logits_within_bf16_tolerance(smollm2_path):
    """The GPU check on CPU: SmolLM2 in bf16, its pieces compiled by Inductor as on CUDA."""
    llm = LLM(
        str(smollm2_path),
        dtype="bfloat16",
        device="cpu",
        piecewise_cuda_graph_max_tokens=256,
        piecewise_cuda_graph_compiler="inductor",
    )
    runner = llm.engine.runner
    runner.piecewise.pad_without_graphs = True
    check_bf16_logits(runner, (16, 200))


# GPU: CUDA graphs per bucket, replayed by the engine ------------------------------------------


def gpu_llm(path, dtype: str) -> LLM:
    # NOTE: decode CUDA graphs off, so every step (prefill and decode) exercises the piecewise
    # runner; a capped KV pool leaves room for the other module fixtures on the device.
    return LLM(
        str(path), dtype=dtype, device="cuda", disable_cuda_graph=True, max_total_tokens=1 << 15
    )


@pytest.fixture(scope="module")
def gpu_fp32(smollm2_path) -> LLM:
    return gpu_llm(smollm2_path, "float32")


@pytest.fixture(scope="module")
def gpu_bf16(smollm2_path) -> LLM:
    return gpu_llm(smollm2_path, "bfloat16")


@pytest.mark.gpu
def test_gpu_float32_greedy_tokens_equal_eager(gpu_fp32, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runner = gpu_fp32.engine.runner
    before = counts(runner)
    graphs = [o.token_ids for o in gpu_fp32.generate(PROMPTS, params, use_tqdm=False)]
    assert stats_delta(runner, before)[RUNS] >= 64  # the prefill and every decode step
    monkeypatch.setattr(runner, "piecewise", None)
    eager = [o.token_ids for o in gpu_fp32.generate(PROMPTS, params, use_tqdm=False)]
    assert graphs == eager


@pytest.mark.gpu
def test_gpu_float32_mixed_batches_at_bucket_boundaries(gpu_fp32):
    runner = gpu_fp32.engine.runner
    assert runner.piecewise.graphs.captured == set(runner.piecewise.buckets)
    check_boundary_batches(runner, 1e-4)  # inductor pieces vs eager kernels


@pytest.mark.gpu
def test_gpu_bf16_logits_within_bf16_tolerance(gpu_bf16):
    check_bf16_logits(gpu_bf16.engine.runner, (16, 17, 200, 1000))
