"""ExtendGraphRunner: whole-decoder graphs of EXTEND batches (prefills, chunks, mixed steps)
equal eager passes row for row, write KV for the real rows only, keep no state from one replay
to the next, and ``can_run`` refuses what they cannot serve. The capture plan of the fused
extend kernel (one request owning every row, a padding request, empty ones) is checked against
the torch oracle under the Triton interpreter. On CPU ``_EagerGraph`` stands in for the CUDA
graph; the ``gpu`` test captures real ones.
"""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch
from oracle import PROMPTS
from test_decode_graphs import (
    PAGE_SIZE,
    assert_only_slots_written,
    attend,
    kv_snapshot,
    random_kv,
    tiny_runner,
)
from test_decode_graphs import captured as decode_graphs_captured
from test_decode_graphs import check_against_eager as check_decode_against_eager
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.attention.triton_backend import TritonAttentionBackend
from pcgspec.compile import custom_ops  # noqa: F401  (registers torch.ops.pcgspec.attention)
from pcgspec.config import EngineConfig
from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch_ref
from pcgspec.runners import extend_graph_runner
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.extend_graph_runner import LONG_PREFIX, ExtendGraphRunner
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.runners.model_runner import ModelRunner

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_TOKENS = 32
# Steps of (request, new tokens): mixed steps (one-token rows beside chunks), a bucket filled
# exactly (no padding), a single token, one long chunk, the most requests a small bucket holds.
STEPS = [
    [(0, 5), (1, 1), (2, 9)],
    [(3, 12), (0, 1), (1, 1), (2, 1)],
    [(4, 32)],
    [(1, 1)],
    [(5, 3), (6, 2), (3, 1), (4, 1), (0, 2)],
    [(6, 1), (5, 1), (2, 4), (1, 1)],
]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama-extend")
    tiny_hf_model("LlamaConfig").save_pretrained(path)  # context length 128
    return path


def captured(runner: ModelRunner, warm_up: bool = True) -> ExtendGraphRunner:
    """The runner's extend graphs on CUDA; on CPU a runner with the eager stand-in, captured."""
    if runner.extend_graphs is not None:
        return runner.extend_graphs
    graphs = ExtendGraphRunner(runner, MAX_TOKENS)
    if not warm_up:
        graphs.num_warmup = 0
    graphs.capture()
    return graphs


class Requests:
    """Seven requests with cached prefixes of 0..40 tokens (prefilled eagerly) on shuffled
    disjoint pages; ``step([(r, n), ...])`` builds one EXTEND batch of those requests' next tokens.
    """

    def __init__(self, runner: ModelRunner, hidden: CaptureHiddenMode, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.runner, self.hidden = runner, hidden
        self.lens = [rng.randrange(0, 41) for _ in range(7)]
        self.ids = [[rng.randrange(runner.vocab_size) for _ in range(88)] for _ in self.lens]
        free = rng.sample(range(runner.kv_cache.num_pages), 7 * 22)
        self.pages = [free[22 * i : 22 * (i + 1)] for i in range(7)]
        chunks = [SeqChunk(self.ids[r][:n], 0, self.pages[r]) for r, n in enumerate(self.lens) if n]
        runner.run_eager(self._batch(chunks))

    def _batch(self, chunks: list[SeqChunk]) -> ForwardBatch:
        device = self.runner.device
        return build_forward_batch(
            ForwardMode.EXTEND, chunks, PAGE_SIZE, device, capture_hidden_mode=self.hidden
        )

    def step(self, new: list[tuple[int, int]], unsampled: tuple[int, ...] = ()) -> ForwardBatch:
        """``unsampled``: requests whose chunk samples nothing (a prompt's middle chunk)."""
        chunks = []
        for r, n in new:
            start = self.lens[r]
            ids = self.ids[r][start : start + n]
            chunks.append(SeqChunk(ids, start, self.pages[r], r not in unsampled))
            self.lens[r] += n
        return self._batch(chunks)


@pytest.mark.parametrize(
    ("piecewise", "aux"),
    [(False, None), (True, None), (True, (0, 1))],
    ids=["plain-decoder", "compiled-decoder", "compiled-decoder-aux"],
)
def test_replays_match_eager_extend(tiny_path, piecewise: bool, aux: tuple | None) -> None:
    runner = tiny_runner(
        tiny_path, disable_piecewise_cuda_graph=not piecewise, aux_hidden_state_layers=aux
    )
    graphs = captured(runner)
    assert sorted(graphs.graphs) == [4, 8, 12, 16, 20, 24, 28, 32]
    assert graphs.decoder is (runner.piecewise.decoder if piecewise else runner.model.model)
    check_against_eager(runner, graphs, runner.extend_capture_hidden_mode, tol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only; gpu tests run Triton")
def test_replays_match_eager_extend_triton_interpreted(tiny_path) -> None:
    runner = tiny_runner(tiny_path, attention_backend="triton", disable_piecewise_cuda_graph=True)
    # NOTE: the interpreter compiles nothing: warm-ups would only rerun each bucket twice
    check_against_eager(runner, captured(runner, warm_up=False), CaptureHiddenMode.NULL, tol=1e-5)


@torch.inference_mode()
def check_against_eager(
    runner: ModelRunner, graphs: ExtendGraphRunner, hidden_mode: CaptureHiddenMode, tol: float
) -> None:
    """Every step of ``STEPS``: graph replay first (KV checked), then eager on the same batch,
    which rewrites the same slots with the same values."""
    reqs, kv = Requests(runner, hidden_mode), runner.kv_cache
    for new in STEPS:
        batch = reqs.step(new)
        assert graphs.can_run(batch)
        before = kv_snapshot(kv)
        hidden, aux, logits = graphs.replay(batch)
        assert hidden.shape == (batch.num_tokens, runner.model.hidden_size)
        assert logits.shape == (batch.batch_size, runner.vocab_size)  # every request samples
        assert (aux is None) == (hidden_mode is CaptureHiddenMode.NULL)
        hidden, aux, logits = hidden.clone(), None if aux is None else aux.clone(), logits.clone()
        assert_only_slots_written(kv, before, batch.out_cache_loc)
        written = kv_snapshot(kv)
        want, want_aux = runner.run_eager(batch)
        for got_kv, want_kv in zip(written, kv_snapshot(kv)):  # eager writes the same values
            torch.testing.assert_close(got_kv, want_kv, atol=tol, rtol=tol)
        torch.testing.assert_close(hidden, want, atol=tol, rtol=tol)
        want_logits = runner.model.compute_logits(want[batch.logits_indices])
        torch.testing.assert_close(logits, want_logits, atol=tol, rtol=tol)
        if aux is not None:
            torch.testing.assert_close(aux, want_aux, atol=tol, rtol=tol)
    stats = graphs.stats()
    buckets = [-(-sum(n for _, n in new) // 4) * 4 for new in STEPS]
    assert stats["runs"] == len(STEPS)
    assert stats["padded_rows"] == sum(b - sum(n for _, n in new) for b, new in zip(buckets, STEPS))
    assert not any(stats["fallbacks"].values())


def test_logits_of_the_sampled_rows_only(tiny_path) -> None:
    """A graph computes the logits of the batch's sampled rows: chunks that sample nothing
    have none, rows left in the buffer by a larger batch before are never read, and a batch
    that samples nothing gets none."""
    runner = tiny_runner(tiny_path)
    graphs = captured(runner)
    with torch.inference_mode():
        reqs = Requests(runner, CaptureHiddenMode.NULL)
        graphs.replay(reqs.step([(0, 3), (1, 5), (2, 7), (3, 4), (4, 9)]))  # rows up to 27
        for new, unsampled in [([(5, 2), (6, 1), (0, 1)], (6,)), ([(1, 3)], (1,))]:
            batch = reqs.step(new, unsampled)  # bucket 4: the rows left there lie past it
            got = graphs.replay(batch).logits.clone()
            hidden, _ = runner.run_eager(batch)
            want = runner.model.compute_logits(hidden[batch.logits_indices])
            assert got.shape == (len(new) - len(unsampled), runner.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def shares_logits(runner: ModelRunner, *graph_runners: object) -> bool:
    """Every captured key's logits are rows of the model runner's one buffer."""
    where = runner.graph_logits.untyped_storage().data_ptr()
    return all(
        out.logits.untyped_storage().data_ptr() == where
        for graphs in graph_runners
        for out in graphs.outputs.values()
    )


def test_decode_and_extend_graphs_write_one_logits_buffer(tiny_path) -> None:
    """The decode and extend graphs write their logits into the model runner's one buffer
    (as it builds them on CUDA), not into an output per captured key, and each replay's
    logits are its own batch's: the extend graphs' after the decode graphs' replays."""
    runner = tiny_runner(tiny_path)
    assert runner.graph_logits is None  # NOTE: the CPU builds neither kind of graph itself
    runner.graph_logits = torch.full((32, runner.vocab_size), float("nan"))
    extend = captured(runner)
    decode = decode_graphs_captured(runner)
    assert shares_logits(runner, extend, decode)
    check_decode_against_eager(runner, decode, tol=1e-5)
    for cache in (*runner.kv_cache.k, *runner.kv_cache.v):
        cache.zero_()  # NOTE: each check writes its requests' KV into empty slots
    check_against_eager(runner, extend, CaptureHiddenMode.NULL, tol=1e-5)


def test_padding_request_in_the_last_slot(tiny_path, monkeypatch) -> None:
    """A batch with as many requests as its bucket holds and padded rows: the padding request
    takes the graph's last request slot."""
    runner = tiny_runner(tiny_path)
    monkeypatch.setattr(extend_graph_runner, "MAX_REQUESTS", 4)
    graphs = ExtendGraphRunner(runner, MAX_TOKENS)  # a bucket then holds 4 requests, R = 5
    graphs.num_warmup = 0
    graphs.capture()
    with torch.inference_mode():
        reqs = Requests(runner, CaptureHiddenMode.NULL)
        batch = reqs.step([(0, 2), (1, 1), (2, 2), (3, 1)])  # 6 tokens: bucket 8, 2 padded rows
        got = graphs.replay(batch).hidden.clone()
        want, _ = runner.run_eager(batch)
    assert graphs.requests(8) == batch.batch_size and graphs.stats()["padded_rows"] == 2
    assert graphs.extend_lens[:5].tolist() == [2, 1, 2, 1, 2]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_model_runner_forward_replays_small_extend_batches(tiny_path) -> None:
    runner = tiny_runner(tiny_path)
    runner.extend_graphs = captured(runner)  # NOTE: ModelRunner builds them on CUDA only
    with torch.inference_mode():
        reqs = Requests(runner, CaptureHiddenMode.NULL)
        batch = reqs.step([(0, 3), (1, 1)])
        got = runner.forward(batch).logits
        want = runner.model.compute_logits(runner.run_eager(batch)[0][batch.logits_indices])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert runner.extend_graphs.stats()["runs"] == 1
    assert runner.graph_runners()["extend"] is runner.extend_graphs
    assert runner.piecewise.stats()["runs"] == 0  # never offered: the extend graph served it


def test_can_run_refusals(tiny_path) -> None:
    runner = tiny_runner(tiny_path)
    graphs = ExtendGraphRunner(runner, MAX_TOKENS)
    with torch.inference_mode():
        reqs = Requests(runner, CaptureHiddenMode.NULL)
    batch = reqs.step([(0, 2), (1, 1)])
    assert not graphs.can_run(batch)  # nothing captured yet
    graphs.num_warmup = 0
    graphs.capture()
    assert graphs.can_run(batch)
    many = [SeqChunk([1], 0, [0]) for _ in range(5)]
    long_prefix = SeqChunk([1], LONG_PREFIX, [0] * -(-(LONG_PREFIX + 1) // PAGE_SIZE))
    too_wide = SeqChunk([1], 0, [0] * (graphs.max_pages + 1))  # more pages than the context
    refused = {
        "mode": build_forward_batch(ForwardMode.DECODE, [SeqChunk([1], 3, [0])], PAGE_SIZE, "cpu"),
        "too_many_tokens": reqs.step([(2, MAX_TOKENS + 1)]),
        "too_many_requests": build_forward_batch(ForwardMode.EXTEND, many, PAGE_SIZE, "cpu"),
        "hidden_mode": dataclasses.replace(batch, capture_hidden_mode=CaptureHiddenMode.FULL),
        "input_embeds": dataclasses.replace(batch, input_embeds=torch.zeros(3, 64)),
        "input_logprobs": dataclasses.replace(batch, return_input_logprobs=True),
        "long_prefix": build_forward_batch(ForwardMode.EXTEND, [long_prefix], PAGE_SIZE, "cpu"),
        "seq_len": build_forward_batch(ForwardMode.EXTEND, [too_wide], PAGE_SIZE, "cpu"),
    }
    graphs.max_requests = 4  # NOTE: a bucket of 8 tokens then holds 4 requests, not 5
    for reason, bad in refused.items():
        assert not graphs.can_run(bad), reason
    assert graphs.stats()["fallbacks"] == {r: 1 for r in ("not_captured", *refused)}


def test_extend_graph_flag(monkeypatch) -> None:
    with pytest.raises(ValueError, match="extend_cuda_graph_max_tokens"):
        EngineConfig(device="cpu", extend_cuda_graph_max_tokens=-1)
    assert EngineConfig(device="cpu").resolved_extend_graph_max_tokens == 0  # CUDA only
    configs = {  # resolved on CUDA
        256: {},
        64: {"piecewise_cuda_graph_max_tokens": 64},
        32: {"extend_cuda_graph_max_tokens": 32},
        128: {"piecewise_cuda_graph_tokens": (16, 512), "extend_cuda_graph_max_tokens": 128},
        0: {"piecewise_cuda_graph_tokens": (512, 1024)},  # no bucket at or below 256
    }
    off = [
        {"extend_cuda_graph_max_tokens": 0},
        {"disable_cuda_graph": True},
        {"disable_piecewise_cuda_graph": True},
        {"tp_size": 2},
        {"attention_backend": "torch"},
    ]
    built = {k: EngineConfig(device="cpu", **kw) for k, kw in configs.items()}
    built_off = [EngineConfig(device="cpu", **kw) for kw in off]
    monkeypatch.setattr(EngineConfig, "torch_device", property(lambda _: torch.device("cuda")))
    assert {k: c.resolved_extend_graph_max_tokens for k, c in built.items()} == {
        k: k for k in configs
    }
    assert [c.resolved_extend_graph_max_tokens for c in built_off] == [0] * len(off)


def test_no_bucket_is_a_clear_error(tiny_path) -> None:
    runner = tiny_runner(tiny_path, piecewise_cuda_graph_tokens=(64,))
    with pytest.raises(ValueError, match="no bucket <= the extend graphs' 32 tokens"):
        ExtendGraphRunner(runner, MAX_TOKENS)


@pytest.mark.parametrize("window", [None, 5])
def test_triton_capture_plan_serves_any_split_of_the_rows(window: int | None) -> None:
    """``init_capture_metadata`` of an EXTEND batch in a graph's static buffers (the batch's
    requests, a padding request owning the padded rows, empty ones) gives the real rows what the
    torch oracle gives the batch itself, finite padded rows, and KV for the real rows only.
    """
    gen = torch.Generator().manual_seed(0)
    kv = random_kv(gen, num_pages=64)
    windows = (window,)
    backend = TritonAttentionBackend(kv, 4, 16, 0.25, windows)
    oracle = TorchAttentionBackend(kv, 4, 16, 0.25, windows)
    chunks = [  # a chunk over a prefix, a decode row, a prompt, another decode row
        SeqChunk(list(range(7)), 9, [4, 1, 7, 20]),
        SeqChunk([5], 22, [9, 0, 2, 11, 6, 13]),
        SeqChunk(list(range(11)), 0, [30, 31, 32]),
        SeqChunk([3], 3, [40]),
    ]
    real = build_forward_batch(ForwardMode.EXTEND, chunks, PAGE_SIZE, DEVICE)
    rows, reqs = 24, 6
    static = _static_batch(real, rows, reqs, max_pages=8)
    qkv = [torch.randn(rows, n, 16, generator=gen).to(DEVICE) for n in (4, 2, 2)]
    before = kv_snapshot(kv)
    backend.init_capture_metadata(static, max_seq_len=128)
    got = attend(backend, static, *qkv)
    assert_only_slots_written(kv, before, real.out_cache_loc)
    oracle.init_forward_metadata(real)
    want = attend(oracle, real, *qkv)
    n = real.num_tokens
    torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
    assert got[n:].isfinite().all(), "the padding request's rows must be finite"
    plan = backend.metadata.extend_plan
    assert plan.num_splits == 1 and plan.num_real == rows and plan.grid[0] == reqs


def _static_batch(real: ForwardBatch, rows: int, reqs: int, max_pages: int) -> ForwardBatch:
    """``real`` in an extend graph's static buffers of ``rows`` rows and ``reqs`` requests."""
    device = real.device
    i64 = dict(dtype=torch.int64, device=device)
    ids, positions, loc = (torch.zeros(rows, **i64) for _ in range(3))
    start, seq_lens, ext_lens = (
        torch.zeros(reqs, dtype=torch.int32, device=device) for _ in range(3)
    )
    table = torch.zeros(reqs, max_pages, dtype=torch.int32, device=device)
    sampled = torch.zeros(reqs, **i64)
    pad_batch_ref(
        real.input_ids,
        real.positions,
        real.out_cache_loc,
        real.extend_lens,
        ids,
        positions,
        loc,
        start,
        PaddedRequests(
            real.seq_lens, seq_lens, ext_lens, real.page_table, table, real.logits_indices, sampled
        ),
    )
    return dataclasses.replace(
        real,
        input_ids=ids,
        positions=positions,
        out_cache_loc=loc,
        seq_lens=seq_lens,
        extend_lens=ext_lens,
        page_table=table,
        seq_lens_cpu=(128,) * reqs,
        extend_lens_cpu=(rows,) * reqs,
        logits_indices=torch.arange(rows, device=device),
        extend_start=start,
    )


# GPU: real CUDA graphs, built by the ModelRunner -------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("aux", [None, (0, 1)], ids=["no-aux", "aux"])
def test_cuda_extend_graphs_match_eager(tiny_path, aux: tuple | None) -> None:
    runner = tiny_runner(tiny_path, device="cuda", aux_hidden_state_layers=aux)
    graphs = runner.extend_graphs
    assert graphs is not None and graphs.buckets[-1] == 64  # capped by the piecewise buckets
    assert shares_logits(runner, graphs, runner.decode_graphs)
    # NOTE: compiled (inductor) pieces and eager ops round float32 differently.
    check_against_eager(runner, graphs, runner.extend_capture_hidden_mode, tol=1e-4)


@pytest.mark.gpu
def test_smollm2_greedy_with_and_without_extend_graphs(smollm2_path) -> None:
    """Prefills of several prompts together, then (arrivals held back) mixed steps: the same
    greedy tokens with extend graphs as through the piecewise graphs alone.
    """
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens, stats = {}, {}
    for max_tokens in (0, 256):
        llm = LLM(
            str(smollm2_path),
            dtype="float32",
            max_total_tokens=16384,
            extend_cuda_graph_max_tokens=max_tokens,
        )
        tokens[max_tokens] = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        stats[max_tokens] = llm.engine.graph_stats()
        llm.shutdown()
        del llm
        torch._dynamo.reset()  # NOTE: the decoder's cache entry holds its piecewise graphs
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens[0] == tokens[256]
    assert "extend" not in stats[0] and stats[256]["extend"]["runs"] > 0, stats[256]
