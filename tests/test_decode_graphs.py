"""DecodeGraphRunner: decode steps replayed from per-batch-size graphs equal eager decode, padding
rows write no KV, no state leaks from one replay into the next, and ``can_run`` refuses what the
graphs cannot serve. On CPU the piecewise ``_EagerGraph`` stands in for CUDA graphs (replay reruns
the captured step on the static buffers); the ``gpu`` tests capture real CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import gc
import random
from collections.abc import Sequence

import pytest
import torch
from oracle import PROMPTS, assert_greedy_match
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.attention.triton_backend import TritonAttentionBackend
from pcgspec.compile import custom_ops  # noqa: F401  (registers torch.ops.pcgspec.attention)
from pcgspec.compile.forward_context import forward_context
from pcgspec.config import EngineConfig
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.decode_graph_runner import DecodeGraphRunner, decode_batch_sizes
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.runners.model_runner import ModelRunner

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE_SIZE, MAX_BS, MAX_NEW = 4, 16, 8
# Request subsets decoded one after the other: buckets 16, 1, 4, 16 (rows reversed), 1, 4, 2.
STEPS = [list(range(16)), [5], [0, 7, 12], list(range(15, -1, -1)), [3], [9, 1, 14], [2, 4]]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("tiny-llama-decode")
    tiny_hf_model("LlamaConfig").save_pretrained(path)  # context length 128: 32 pages of 4
    return path


def tiny_runner(path, device: str = "cpu", **kw: object) -> ModelRunner:
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        device=device,
        page_size=PAGE_SIZE,
        max_total_tokens=2048,
        cuda_graph_max_bs=MAX_BS,
        piecewise_cuda_graph_max_tokens=64,
        **kw,
    )
    return ModelRunner(config, path)


def captured(runner: ModelRunner, warm_up: bool = True) -> DecodeGraphRunner:
    """The runner's decode graphs on CUDA; on CPU a runner with the eager stand-in, captured
    (``warm_up`` False: without the eager runs before each capture, which only compile kernels).
    """
    if runner.decode_graphs is not None:
        return runner.decode_graphs
    graphs = DecodeGraphRunner(runner)
    if not warm_up:
        graphs.num_warmup = 0
    graphs.capture()
    return graphs


class Requests:
    """``num`` requests with prompts of 1..61 tokens on shuffled disjoint pages (up to 18, room
    for MAX_NEW more tokens), prefilled eagerly; ``decode(rows)`` builds those rows' next step.
    """

    def __init__(self, runner: ModelRunner, num: int = MAX_BS, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.runner = runner
        self.lens = [rng.randrange(1, 62) for _ in range(num)]
        self.ids = [
            [rng.randrange(runner.vocab_size) for _ in range(n + MAX_NEW)] for n in self.lens
        ]
        need = [-(-(n + MAX_NEW) // PAGE_SIZE) for n in self.lens]
        free = rng.sample(range(runner.kv_cache.num_pages), sum(need))
        self.pages = [free[sum(need[:i]) : sum(need[: i + 1])] for i in range(num)]
        chunks = [SeqChunk(ids[:n], 0, p) for ids, n, p in zip(self.ids, self.lens, self.pages)]
        runner.run_eager(build_forward_batch(ForwardMode.EXTEND, chunks, PAGE_SIZE, runner.device))

    def decode(self, rows: Sequence[int], **kw: object) -> ForwardBatch:
        chunks = [SeqChunk([self.ids[r][self.lens[r]]], self.lens[r], self.pages[r]) for r in rows]
        return build_forward_batch(ForwardMode.DECODE, chunks, PAGE_SIZE, self.runner.device, **kw)

    def advance(self, rows: Sequence[int]) -> None:
        for r in rows:
            self.lens[r] += 1


def random_kv(gen: torch.Generator, num_pages: int) -> KVCache:
    """A one-layer KV cache (2 KV heads of 16) filled with noise from ``gen``."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    kv = KVCache(spec, num_pages=num_pages, page_size=PAGE_SIZE, device=DEVICE)
    for cache in (kv.k[0], kv.v[0]):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return kv


def attend(attn, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The attention op over ``batch``'s rows of ``q``, ``k``, ``v`` through ``attn`` (NaN where
    it writes nothing)."""
    n = batch.num_tokens
    out = torch.full_like(q[:n], float("nan"))
    with forward_context(batch, attn):
        torch.ops.pcgspec.attention(q[:n], k[:n], v[:n], out, 0)
    return out


def kv_snapshot(kv: KVCache) -> list[torch.Tensor]:
    return [t[: kv.num_slots].clone() for t in (*kv.k, *kv.v)]


def assert_only_slots_written(kv: KVCache, before: list[torch.Tensor], slots: torch.Tensor) -> None:
    """The real tokens' slots changed (they were empty), every other real slot did not.

    NOTE: the scratch slot past ``num_slots`` is excluded: the torch backend stores padding there.
    """
    written = torch.zeros(kv.num_slots, dtype=torch.bool, device=slots.device)
    written[slots] = True
    for old, new in zip(before, (*kv.k, *kv.v)):
        new = new[: kv.num_slots]
        assert torch.equal(new[~written], old[~written]), "a padding row wrote the KV cache"
        assert (new[written] != old[written]).flatten(1).any(1).all(), "a real row wrote no KV"


@torch.inference_mode()
def check_against_eager(runner: ModelRunner, graphs: DecodeGraphRunner, tol: float) -> None:
    """Every step of ``STEPS``: graph replay first (KV checked), then eager on the same batch."""
    reqs = Requests(runner)
    kv = runner.kv_cache
    for rows in STEPS:
        batch = reqs.decode(rows)
        assert graphs.can_run(batch)
        before = kv_snapshot(kv)
        hidden, aux, logits = graphs.replay(batch)
        assert aux is None and hidden.shape == (len(rows), runner.model.hidden_size)
        hidden, logits = hidden.clone(), logits.clone()
        assert_only_slots_written(kv, before, batch.out_cache_loc)
        want, _ = runner.run_eager(batch)
        torch.testing.assert_close(hidden, want, atol=tol, rtol=tol)
        # the LM head inside the graph: every row's logits
        torch.testing.assert_close(
            logits, runner.model.compute_logits(want), atol=10 * tol, rtol=tol
        )
        reqs.advance(rows)
    buckets = [next(bs for bs in graphs.batch_sizes if bs >= len(rows)) for rows in STEPS]
    stats = graphs.stats()
    assert stats["runs"] == len(STEPS)
    assert stats["padded_rows"] == sum(bs - len(rows) for bs, rows in zip(buckets, STEPS))
    assert not any(stats["fallbacks"].values())


def test_decode_batch_sizes() -> None:
    assert decode_batch_sizes(1) == [1]
    assert decode_batch_sizes(6) == [1, 2, 4, 6]
    assert decode_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert decode_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_bs"):
        decode_batch_sizes(0)


@pytest.mark.parametrize("piecewise", [False, True], ids=["plain-decoder", "compiled-decoder"])
def test_replays_match_eager_decode(tiny_path, piecewise: bool) -> None:
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=not piecewise)
    graphs = captured(runner)
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    assert graphs.decoder is (runner.piecewise.decoder if piecewise else runner.model.model)
    check_against_eager(runner, graphs, tol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only; gpu tests run Triton")
def test_replays_match_eager_decode_triton_interpreted(tiny_path) -> None:
    runner = tiny_runner(tiny_path, attention_backend="triton", disable_piecewise_cuda_graph=True)
    # NOTE: the interpreter compiles nothing: warm-ups would only rerun each bucket twice
    check_against_eager(runner, captured(runner, warm_up=False), tol=1e-5)


def test_model_runner_forward_replays_decode_batches_only(tiny_path) -> None:
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    runner.decode_graphs = captured(runner)  # NOTE: ModelRunner builds them on CUDA only
    reqs = Requests(runner)
    batch = reqs.decode([4, 2, 9])
    with torch.inference_mode():
        want = runner.model.compute_logits(runner.run_eager(batch)[0])
        got = runner.forward(batch).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    extend = build_forward_batch(ForwardMode.EXTEND, [SeqChunk([1, 2], 0, [0])], PAGE_SIZE, "cpu")
    runner.forward(extend)  # never offered to the decode graphs: no refusal
    no_fallbacks = dict.fromkeys(DecodeGraphRunner.reasons, 0)
    assert runner.decode_graphs.stats() == {
        "graphs": 5,
        "runs": 1,
        "padded_rows": 1,
        "fallbacks": no_fallbacks,
    }


def test_can_run_refusals(tiny_path) -> None:
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    graphs = DecodeGraphRunner(runner)
    with torch.inference_mode():
        reqs = Requests(runner, num=MAX_BS + 1)
    batch = reqs.decode([0, 1])
    assert not graphs.can_run(batch)  # nothing captured yet
    graphs.capture()
    assert graphs.can_run(batch)
    too_wide = SeqChunk([1], 0, [0] * (graphs.max_pages + 1))  # more pages than the context
    refused = {
        "mode": build_forward_batch(
            ForwardMode.EXTEND, [SeqChunk([1, 2], 0, [0])], PAGE_SIZE, "cpu"
        ),
        "batch_size": reqs.decode(range(MAX_BS + 1)),
        "hidden_mode": reqs.decode([0], capture_hidden_mode=CaptureHiddenMode.LAST),
        "input_embeds": dataclasses.replace(batch, input_embeds=torch.zeros(2, 64)),
        "seq_len": build_forward_batch(ForwardMode.DECODE, [too_wide], PAGE_SIZE, "cpu"),
        "tree": dataclasses.replace(batch, tree_mask=torch.ones(2, 1, 1, dtype=torch.bool)),
    }
    for reason, bad in refused.items():
        assert not graphs.can_run(bad), reason
    assert graphs.can_run(reqs.decode(range(MAX_BS)))
    assert graphs.stats()["fallbacks"] == {r: 1 for r in ("not_captured", *refused)}


def test_triton_capture_metadata_pads_with_empty_requests() -> None:
    """``init_capture_metadata`` over static rows (2 real, 2 padded: seq_len 0, slot -1) gives the
    real rows what ``init_forward_metadata`` gives them, zeros for the padded rows, no padded
    KV write, and a split count fixed by the bound.
    """
    gen = torch.Generator().manual_seed(0)
    kv = random_kv(gen, num_pages=16)
    backend = TritonAttentionBackend(kv, 4, 16, 0.25)
    oracle = TorchAttentionBackend(kv, 4, 16, 0.25)
    chunks = [SeqChunk([3], 9, [4, 1, 7]), SeqChunk([5], 22, [9, 0, 2, 11, 6, 13])]
    real = build_forward_batch(ForwardMode.DECODE, chunks, PAGE_SIZE, DEVICE)
    static = _padded_static_batch(real, bs=4, max_pages=8)
    qkv = [torch.randn(4, n, 16, generator=gen).to(DEVICE) for n in (4, 2, 2)]
    oracle.init_forward_metadata(real)
    want = attend(oracle, real, *qkv)
    written = kv.k[0].clone(), kv.v[0].clone()
    backend.init_capture_metadata(static, max_seq_len=1024)
    got = attend(backend, static, *qkv)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    assert not got[2:].any(), "padded requests must come out as zeros"
    assert torch.equal(kv.k[0], written[0]) and torch.equal(kv.v[0], written[1])
    assert backend.metadata.num_kv_splits == backend._num_kv_splits(4, 1024) > 1
    assert backend.metadata.num_real_tokens == 4


def _padded_static_batch(real: ForwardBatch, bs: int, max_pages: int) -> ForwardBatch:
    n, width, device = real.batch_size, real.page_table.shape[1], real.device
    table = torch.zeros(bs, max_pages, dtype=torch.int32, device=device)
    table[:n, :width] = real.page_table

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, t.new_full((bs - n,), value)])

    return dataclasses.replace(
        real,
        input_ids=pad(real.input_ids, 0),
        positions=pad(real.positions, 0),
        out_cache_loc=pad(real.out_cache_loc, -1),
        seq_lens=pad(real.seq_lens, 0),
        extend_lens=pad(real.extend_lens, 1),
        page_table=table,
        seq_lens_cpu=(max_pages * PAGE_SIZE,) * bs,
        extend_lens_cpu=(1,) * bs,
        logits_indices=torch.arange(bs, device=device),
    )


# GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("piecewise", [False, True], ids=["plain-decoder", "compiled-decoder"])
def test_cuda_graphs_match_eager_decode(tiny_path, piecewise: bool) -> None:
    runner = tiny_runner(tiny_path, device="cuda", disable_piecewise_cuda_graph=not piecewise)
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    # NOTE: compiled (inductor) pieces and eager ops round float32 differently.
    check_against_eager(runner, graphs, tol=1e-5 if not piecewise else 1e-4)


@pytest.mark.gpu
def test_smollm2_greedy_with_and_without_decode_graphs(smollm2_path) -> None:
    from transformers import AutoModelForCausalLM

    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    tokens, stats = {}, {}
    for disable in (True, False):
        llm = LLM(
            str(smollm2_path),
            dtype="float32",
            disable_cuda_graph=disable,
            max_total_tokens=16384,
            piecewise_cuda_graph_max_tokens=512,
        )
        tokens[disable] = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        if not disable:
            stats = llm.engine.runner.decode_graphs.stats()
        del llm
        torch._dynamo.reset()  # NOTE: the decoder's cache entry holds its piecewise graphs
        gc.collect()
        torch.cuda.empty_cache()
    assert stats["runs"] >= 63
    assert not any(stats["fallbacks"].values()), stats
    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for ids, with_graphs, without in zip(prompt_ids, tokens[False], tokens[True]):
        assert len(with_graphs) == 64
        assert_greedy_match(hf, ids, with_graphs, without)


@pytest.mark.gpu
def test_replays_keep_gpu_memory_flat(tiny_path) -> None:
    runner = tiny_runner(tiny_path, device="cuda")
    graphs = runner.decode_graphs
    with torch.inference_mode():
        reqs = Requests(runner)
        batches = [reqs.decode(rows) for rows in STEPS]
        for batch in batches:  # first touch of every bucket
            graphs.replay(batch)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(50):
            for batch in batches:
                graphs.replay(batch)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
    assert graphs.stats()["runs"] == 51 * len(STEPS)
