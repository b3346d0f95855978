"""The start-up kernel warm-up (``pcgspec/kernels/warmup.py``): it plans every extend variant a
head config can produce, runs under the interpreter, and covers what serving launches: every
serving launch below has a Triton specialization key (computed as the CUDA backend would, on
CPU) that a warm-up launch already had. The ``gpu`` test counts real compilations after start-up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from test_sampling_slots import _Req

from pcgspec.kernels.attention import decode_attention, decode_workspace, store_kv
from pcgspec.kernels.draft_levels import draft_levels
from pcgspec.kernels.extend_attention import extend_attention, plan_extend
from pcgspec.kernels.move_kv import move_accepted_kv
from pcgspec.kernels.ngram_propose import ngram_propose
from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch
from pcgspec.kernels.padded_rows import GraphRows, VerifyTokens, padded_rows, padded_rows_into
from pcgspec.kernels.sample_tokens import sample_tokens
from pcgspec.kernels.top_k import CHUNK
from pcgspec.kernels.verify_draft_tokens import VerifyStrategy, verify_draft_tokens
from pcgspec.kernels.warmup import (
    AttentionShape,
    KernelWarmup,
    extend_lengths,
    extend_variants,
    run_warmup,
)
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.sampling.batch import GREEDY_EPS
from pcgspec.sampling.rng import STREAM_TOKEN
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.sampling_params import SamplingParams
from pcgspec.speculative.tree import TreeExpansion, top_tokens

BF16, F32 = torch.bfloat16, torch.float32
TINY = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, dtype=F32, page_size=4)
K, VOCAB = 3, 64
NGRAM = (K, 2, 5)  # k, min window, max window


@pytest.mark.parametrize(
    ("shape", "block_ms", "lengths"),
    [
        (AttentionShape(9, 3, 64, BF16, 16), [16, 32, 64, 128], [1, 6, 11, 22]),  # SmolLM2
        (AttentionShape(32, 8, 64, BF16, 16), [16, 32, 64, 128], [1, 5, 9, 17]),  # Llama-3.2-1B
        (AttentionShape(32, 8, 128, BF16, 16), [16, 32, 64, 128], [1, 5, 9, 17]),  # Qwen3-8B
        (AttentionShape(8, 1, 256, BF16, 16), [16, 32, 64], [1, 3, 5]),  # head dim 256: M <= 64
        (AttentionShape(9, 3, 64, F32, 16), [16, 32, 64], [1, 6, 11]),  # fp32 tiles: M <= 64
        (TINY, [16, 32, 64], [1, 9, 17]),
    ],
)
def test_extend_variants_of_a_head_config(shape, block_ms, lengths) -> None:
    assert [v["BLOCK_M"] for v in extend_variants(shape)] == block_ms
    assert extend_lengths(shape) == lengths
    # Every plan of any batch (any lengths, padded or not) is one of these specializations.
    planned = {tuple(sorted(v.items())) for v in extend_variants(shape)}
    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.randrange(0, 600) for _ in range(rng.randrange(1, 9))]
        plan = plan_extend(
            lens,
            sum(lens) + rng.randrange(0, 64),
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
            shape.page_size,
            0.1,
        )
        assert plan.specialization in planned, lens


# Specialization keys ----------------------------------------------------------------------------


@functools.cache
def _cuda_backend():  # noqa: ANN202
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    return CUDABackend(GPUTarget("cuda", 90, 32))


def _key(fn, args: tuple, kwargs: dict) -> tuple:  # noqa: ANN001
    """Triton's specialization key of a launch of ``fn`` (JIT or interpreted): per argument
    ("constexpr", value) or the CUDA backend's (type, alignment / int class), plus the options.
    """
    from triton.runtime.jit import native_specialize_impl

    opts = getattr(fn, "kwargs", {})  # the interpreter keeps the decorator's arguments here
    dns = set(opts.get("do_not_specialize") or ())
    dnsa = set(opts.get("do_not_specialize_on_alignment") or ())
    params = inspect.signature(fn.fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    key = []
    for name, p in params.items():
        value = bound[name]
        if "constexpr" in str(p.annotation):
            key.append(("constexpr", value))
        else:
            key.append(
                native_specialize_impl(
                    _cuda_backend(), value, False, name not in dns, name not in dnsa
                )
            )
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return (*key, options)


@contextlib.contextmanager
def _recording() -> Iterator[Callable[..., dict[str, set[tuple]]]]:
    """``record()`` -> a context collecting each kernel launch's specialization key by name;
    ``record(run=False)`` keys the launches without running them (the serving side: a key is
    the arguments', and no launch's output is read, so the interpreter's minutes buy nothing).
    """
    from pcgspec.kernels import extend_attention

    kernel_type = type(extend_attention._extend_kernel)
    run = kernel_type.run
    current: list[tuple[dict[str, set[tuple]], bool]] = []

    def recording_run(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202
        if current:
            current[-1][0][self.fn.__name__].add(_key(self, args, kwargs))
            if not current[-1][1]:
                return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def start(*, run: bool = True) -> dict[str, set[tuple]]:
        current.append((collections.defaultdict(set), run))
        return current[-1][0]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_type, "run", recording_run)
        yield start


@pytest.fixture
def record() -> Iterator[Callable[..., dict[str, set[tuple]]]]:
    with _recording() as start:
        yield start


@pytest.fixture(scope="module")
def served_attention() -> dict[int | None, dict[str, set[tuple]]]:
    """The keys of ``_serve_attention_like`` per window (None: a full-attention layer), served
    once for every model below: the kernels see a layer's window, not the model's ``sliding``.
    """
    with _recording() as record:
        served = {}
        for window in (None, 6):
            served[window] = record(run=False)
            _serve_attention_like(TINY, window)
    return served


def _qkv(rows: int, shape: AttentionShape) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one fused projection (the model's split), and a fresh out."""
    h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    fused = torch.randn(rows, (h + 2 * kv) * d, dtype=shape.dtype)
    q, k, v = fused.split([h * d, kv * d, kv * d], dim=-1)
    return q.view(rows, h, d), k.view(rows, kv, d), v.view(rows, kv, d), torch.empty(rows, h, d)


def _serve_like(shape: AttentionShape) -> None:
    for window in shape.windows:
        _serve_attention_like(shape, window and 6)
    _serve_sampling_like(shape.page_size)


def _serve_attention_like(shape: AttentionShape, window: int | None) -> None:
    """What an engine step launches, over batches whose sizes give every index array every
    alignment: prefill batches (piecewise padding + extend), decode/verify passes, sampling
    rows and commits, verification, prompt lookup (as ``NgramProposer`` calls it on CUDA).
    """
    rng, page = random.Random(1), shape.page_size
    cache = [torch.zeros(65 * page + 1, shape.num_kv_heads, shape.head_dim) for _ in range(2)]
    for lens in ([1], [3, 2], [7, 1, 30], [12, 5, 9, 2], [40], [2, 2, 2, 2, 2]):
        chunks = [
            SeqChunk([1] * n, s, list(range(16)))
            for n, s in zip(lens, rng.choices([0, 3, 9], k=len(lens)))
        ]
        batch = build_forward_batch(ForwardMode.EXTEND, chunks, page, "cpu")
        rows = sum(lens) + rng.randrange(0, 5)
        ids, pos, loc = (torch.zeros(rows, dtype=torch.int64) for _ in range(3))
        start = torch.zeros(len(lens), dtype=torch.int32)
        graph_reqs = [torch.zeros(len(lens) + 2, dtype=torch.int32) for _ in range(3)]
        graph_table = torch.zeros(len(lens) + 2, 64, dtype=torch.int32)
        graph_rows = torch.zeros(len(lens) + 1, dtype=torch.int64)
        graph = PaddedRequests(
            batch.seq_lens,
            *graph_reqs[1:],
            batch.page_table,
            graph_table,
            batch.logits_indices,
            graph_rows,
        )
        for out_start, padded in (  # a piecewise pass; an extend graph's, its requests padded too
            (start, None),
            (graph_reqs[0], graph),
        ):
            pad_batch(
                batch.input_ids,
                batch.positions,
                batch.out_cache_loc,
                batch.extend_lens,
                ids,
                pos,
                loc,
                out_start,
                padded,
            )
        splits = rng.choice([1, 2, 5, 16])  # a long prefix's pieces
        plan = plan_extend(
            lens,
            rows,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.dtype,
            page,
            0.25,
            num_splits=splits,
        )
        workspace = (
            None
            if splits == 1
            else decode_workspace(sum(lens), shape.num_heads, shape.head_dim, splits, "cpu")
        )
        extend_attention(
            *_qkv(rows, shape),
            *cache,
            loc,
            batch.page_table,
            batch.seq_lens,
            batch.extend_lens,
            start,
            plan,
            window=window,
            workspace=workspace,
        )
        for n in (1, K + 1):  # decode, verify
            chunks = [SeqChunk([1] * n, s, list(range(16))) for s in lens]
            batch = build_forward_batch(
                ForwardMode.DECODE if n == 1 else ForwardMode.TARGET_VERIFY, chunks, page, "cpu"
            )
            out_rows = len(lens) * n
            pad_batch(
                batch.input_ids,
                batch.positions,
                batch.out_cache_loc,
                batch.extend_lens,
                *(torch.zeros(out_rows + 1, dtype=torch.int64) for _ in range(3)),
                None,
            )
            q, k, v, out = _qkv(out_rows, shape)
            store_kv(k, v, *cache, torch.full((out_rows,), -1))
            splits = rng.choice([1, 2, 3, 7, 32])
            decode_attention(
                q,
                *cache,
                out,
                batch.page_table,
                batch.seq_lens,
                page,
                0.25,
                splits,
                tokens_per_seq=n,
                window=window,
                workspace=decode_workspace(
                    out_rows, shape.num_heads, shape.head_dim, splits, "cpu"
                ),
            )


def _serve_sampling_like(page: int) -> None:
    # NOTE: 3 slots: misaligned table rows; 7 tokens of history: rows of odd stride
    slots = SamplingSlots(3, VOCAB, "cpu", triton=True, history_len=7)
    reqs = [_Req(SamplingParams(temperature=t, seed=7), 7, [1, 2]) for t in (0.0, 0.8, 0.5)]
    for req in reqs:
        slots.admit(req)
    for batch_reqs in (reqs, reqs[1:], reqs[2:]):
        b = len(batch_reqs)
        rows = slots.rows(batch_reqs, torch.zeros(b, K, dtype=torch.int64))  # k+1 rows each
        ones = torch.ones(b, dtype=torch.int64)
        slots.commit(batch_reqs, torch.zeros(b, 1, dtype=torch.int64), ones)  # a decode step
        slots.commit(batch_reqs, torch.zeros(b, K + 1, dtype=torch.int64), ones)  # a verify step
        for strategy in (VerifyStrategy.GREEDY, VerifyStrategy.TARGET_MATCH):
            verify_draft_tokens(
                torch.rand(b, K + 1, VOCAB),
                torch.randint(0, VOCAB, (b, K)),
                strategy,
                seed=rows.seed.view(b, K + 1),
                position=rows.position.view(b, K + 1),
                num_draft=torch.full((b,), K),
            )
        ngram_propose(
            slots.token_history, slots.slot_indices(batch_reqs), slots.seq_lens(batch_reqs), *NGRAM
        )
        sampled = slots.rows(batch_reqs)  # a decode step's rows, and their draw (as on CUDA)
        logits = torch.randn(b, VOCAB)
        sample_tokens(
            logits.softmax(-1),
            logits,
            sampled.temperature,
            sampled.seed,
            sampled.position,
            STREAM_TOKEN,
            GREEDY_EPS,
        )
    for b in (1, 2, 3, 5):  # verify passes and draft catch-ups (build_padded_batch)
        starts = torch.arange(b, dtype=torch.int64) * 3
        table = torch.arange(b * (b + 1), dtype=torch.int32).view(b, b + 1)
        tokens = VerifyTokens(
            torch.zeros(4, dtype=torch.int64),
            torch.arange(b) % 4,
            torch.zeros(b, K, dtype=torch.int64),
        )
        padded_rows(starts + 1, table, page, K + 1, start_offset=-1, tokens=tokens)  # verify
        bucket = b + 1  # a verify graph's bucket, built in place
        rows = GraphRows(
            *(torch.zeros(bucket * (K + 1), dtype=torch.int64) for _ in range(3)),
            torch.zeros(bucket, dtype=torch.int32),
            torch.full((bucket,), K + 1, dtype=torch.int32),
            torch.arange(bucket * (K + 1)),
        )
        padded_rows_into(rows, starts + 1, table, page, K + 1, start_offset=-1, tokens=tokens)
        padded_rows(starts, table, page, K + 1, num_valid=torch.ones(b, dtype=torch.int64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches on CPU tensors: interpreter only")
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_warmup_covers_every_serving_specialization(
    record, served_attention, sliding: bool
) -> None:
    """A model with sliding-window layers warms each attention kernel's windowed variant too."""
    shape, kinds = dataclasses.replace(TINY, sliding=sliding), 1 + sliding
    warmed = record()
    warmup = KernelWarmup(
        attention=(shape,),
        split_kv_tokens=(1, K + 1),
        vocab_size=VOCAB,
        verify=(K, VOCAB),
        ngram=NGRAM,
    )
    attention = 3 * 3 * kinds + 2 * (1 + 2 * kinds)
    assert run_warmup(warmup, torch.device("cpu")) == 3 + 4 + attention + 2 * 2 + 3 + 1
    served = record()
    _serve_sampling_like(shape.page_size)
    for window in shape.windows:  # what _serve_like(shape) launches
        for name, keys in served_attention[window and 6].items():
            served[name] |= keys
    assert (
        set(served)
        == set(warmed)
        == {
            "_pad_batch_kernel",
            "_build_kernel",
            "_advance_kernel",
            "_sample_kernel",
            "_extend_kernel",
            "_store_kv_kernel",
            "_split_kv_kernel",
            "_split_kv_reduce_kernel",
            "_merge_kernel",
            "_verify_rows_kernel",
            "_accept_kernel",
            "_ngram_kernel",
            "_padded_rows_kernel",
        }
    )
    for name, keys in served.items():
        missing = keys - warmed[name]
        assert not missing, f"{name}: {len(missing)} not warmed, e.g. {missing.pop()}"
    # One compiled kernel per family member (the sizes and index alignments are runtime values).
    assert {n: len(k) for n, k in warmed.items()} == {
        "_pad_batch_kernel": 3,
        "_build_kernel": 1,
        "_advance_kernel": 2,
        "_sample_kernel": 1,
        "_extend_kernel": 6 * kinds,
        "_store_kv_kernel": 1,
        "_split_kv_kernel": 2 * kinds,
        "_split_kv_reduce_kernel": 1,
        "_merge_kernel": 1,
        "_verify_rows_kernel": 2,
        "_accept_kernel": 1,
        "_ngram_kernel": 1,
        "_padded_rows_kernel": 3,
    }


def test_warmup_is_a_no_op_off_cuda() -> None:
    from pcgspec.kernels.warmup import warm_up_kernels

    assert warm_up_kernels(KernelWarmup(attention=(TINY,)), torch.device("cpu")) == 0


# GPU --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "speculative", [None, "NGRAM", "EAGLE3-tree"], ids=["plain", "ngram", "eagle3-tree"]
)
def test_first_concurrent_wave_compiles_nothing(smollm2_path, speculative, monkeypatch) -> None:
    from pcgspec import LLM

    spec = (
        {}
        if speculative is None
        else {"speculative_algorithm": speculative.split("-")[0], "speculative_num_steps": K}
    )
    if speculative == "EAGLE3-tree":  # the shipped head of the default model
        spec |= {"speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}
    llm = LLM(
        str(smollm2_path),
        dtype="bfloat16",
        max_total_tokens=32768,
        piecewise_cuda_graph_max_tokens=512,
        **spec,
    )
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)
    from triton.runtime.jit import JITFunction

    counts: collections.Counter[str] = collections.Counter()
    compile_ = JITFunction._do_compile

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        counts[self.fn.__name__] += 1
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", counting)
    rng = random.Random(0)
    lengths = [1, 2, 3, 5, 7, 9, 12, 17, 23, 33, 48, 64, 90, 130, 200, 300]
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(n)]} for n in lengths]
    params = [
        SamplingParams(
            max_tokens=24,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.8,
            seed=None if i % 2 else i,
        )
        for i in range(len(lengths))
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert not counts, f"Triton compiled after start-up: {dict(counts)}"


def _serve_draft_tree_like(
    depth: int, nodes: int, topk: int, draft_vocab: int, dtypes: tuple[torch.dtype, ...]
) -> None:
    """A tree's passes at every batch size: masked split-KV verify and drafting, the tree
    walk, KV moves, draft levels, and the drafting's top-k and expansion (as on CUDA)."""
    page = TINY.page_size
    cache = [torch.zeros(65 * page + 1, TINY.num_kv_heads, TINY.head_dim) for _ in range(2)]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 6])
    for b in (1, 2, 3, 5):
        table = torch.arange(b * 8, dtype=torch.int32).view(b, 8)
        seq_lens = torch.arange(b, dtype=torch.int32) * 5 + nodes + 1
        for n, width in ((nodes, nodes), (topk, topk), (topk, 2 * topk)):
            q, _, _, out = _qkv(b * n, TINY)
            splits = 1 + b % 3
            decode_attention(
                q,
                *cache,
                out,
                table,
                seq_lens,
                page,
                0.25,
                splits,
                tokens_per_seq=n,
                tree_mask=torch.ones(b, n, width, dtype=torch.bool),
                workspace=decode_workspace(b * n, TINY.num_heads, TINY.head_dim, splits, "cpu"),
            )
        for strategy in (VerifyStrategy.GREEDY, VerifyStrategy.TARGET_MATCH):
            verify_draft_tokens(
                torch.rand(b, nodes, VOCAB),
                torch.randint(0, VOCAB, (b, nodes - 1)),
                strategy,
                seed=torch.zeros(b, nodes, dtype=torch.int64),
                position=torch.zeros(b, nodes, dtype=torch.int64),
                num_draft=torch.full((b,), nodes - 1),
                parents=parents.expand(b, -1).contiguous(),
                max_depth=depth,
            )
        k_all = torch.zeros(3, 65 * page + 1, TINY.num_kv_heads, TINY.head_dim, dtype=TINY.dtype)
        path = torch.tensor([0, 2, 5, -1])[: depth + 1].expand(b, -1).contiguous()
        start = torch.arange(b) * 4 - 1  # the first request: a graph's padding
        move_accepted_kv(k_all, k_all.clone(), table, page, start, path)
        positions = torch.arange(b * (depth + 1))
        rows = torch.arange(b) * (depth + 1) + depth
        draft_levels(positions, rows, seq_lens, table, page, depth - 1, topk)
        for dtype in dtypes:  # a tree's drafting as on CUDA: each level's top-k, the tree's
            first = top_tokens(torch.randn(b, draft_vocab).to(dtype), topk)
            expansion = TreeExpansion(*first, depth)
            for _ in range(depth - 1):
                level = torch.randn(b * topk, draft_vocab).to(dtype)
                expansion.expand(*top_tokens(level, topk))
            expansion.select(nodes, depth)


@pytest.mark.skipif(torch.cuda.is_available(), reason="launches on CPU tensors: interpreter only")
def test_warmup_covers_draft_tree_passes(record, monkeypatch) -> None:
    """With draft trees: the masked split-KV passes (N nodes per request in verify, topk beams
    over growing levels in drafting), the tree walk and the drafting's top-k, at every batch
    size."""
    from pcgspec.speculative import tree

    monkeypatch.setattr(tree, "_use_kernels", lambda x: True)  # as on CUDA
    depth, nodes, topk = 3, 8, 3
    draft_vocab, dtypes = CHUNK + 300, (torch.float32, torch.bfloat16)  # two chunks: a merge
    tree_warmup = KernelWarmup(
        attention=(TINY,),
        split_kv_tokens=(1, K + 1),
        verify=(K, VOCAB),
        tree=(depth, nodes, topk),
        tree_vocab=(draft_vocab, dtypes),
        draft_levels=(depth - 1, topk),
    )
    warmed = record()
    run_warmup(tree_warmup, torch.device("cpu"))
    served = record(run=False)
    _serve_draft_tree_like(depth, nodes, topk, draft_vocab, dtypes)
    names = (
        "_split_kv_kernel",
        "_split_kv_reduce_kernel",
        "_accept_tree_kernel",
        "_move_kv_kernel",
        "_draft_levels_kernel",
    )
    tree_kernels = (
        "_chunk_top_k_kernel",
        "_merge_top_k_kernel",
        "_expand_kernel",
        "_select_kernel",
    )
    for name in (*names, *tree_kernels):
        missing = served[name] - warmed[name]
        assert served[name] and not missing, f"{name}: {len(missing)} not warmed"
