"""Triton paged attention == its torch references, and the Triton backend == the torch backend.

On CPU the kernels run in the Triton interpreter (tests/conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from pcgspec.attention import triton_backend as triton_backend_module
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.attention.triton_backend import TritonAttentionBackend
from pcgspec.compile import custom_ops  # noqa: F401  (registers torch.ops.pcgspec.attention)
from pcgspec.compile.forward_context import forward_context
from pcgspec.kernels import extend_attention as extend_module
from pcgspec.kernels.attention import (
    decode_attention,
    decode_attention_ref,
    decode_workspace,
    store_kv,
    store_kv_ref,
)
from pcgspec.kernels.extend_attention import (
    extend_attention,
    extend_attention_ref,
    plan_extend,
    prefix_splits,
)
from pcgspec.kernels.launches import count_triton_launches
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
ATOL = RTOL = 1e-5


def _page_table(seq_lens: list[int], page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Disjoint pages per request, in shuffled order; unused entries point at real pages too."""
    need = [-(-s // page_size) for s in seq_lens]
    width = max(need)
    pages = torch.randperm(len(seq_lens) * width, generator=gen).view(len(seq_lens), width)
    return pages.to(DEVICE, torch.int32)


def _cache(num_slots: int, kv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random everywhere, so reading a slot beyond a sequence's length shows up in the output."""
    shape = (num_slots + 1, kv, d)
    return tuple(torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))


def _lens(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEVICE)


def _poison_left_of_windows(
    caches: tuple[torch.Tensor, ...], page_table: torch.Tensor, firsts: list[int], page_size: int
) -> None:
    """NaN in the keys and values before position ``firsts[b]`` of each request ``b``: the
    keys left of all its windows, which a kernel that skips them never reads (one NaN value
    read, even under a mask, makes its row NaN).
    """
    for b, first in enumerate(firsts):
        pos = torch.arange(max(first, 0), device=DEVICE)
        slots = page_table[b].long()[pos // page_size] * page_size + pos % page_size
        for cache in caches:
            cache[slots] = float("nan")


def test_store_kv_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    kv, d, num_slots = 3, 24, 40
    k_cache, v_cache = _cache(num_slots, kv, d, gen)
    qkv = torch.randn(7, 5 * kv, d, generator=gen).to(DEVICE)
    k, v = qkv[:, kv : 2 * kv], qkv[:, 3 * kv : 4 * kv]  # strided views, as from a fused qkv
    loc = torch.tensor([5, 0, 39, 17, 2, -1, -1], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, loc)
    store_kv_ref(k, v, ref_k, ref_v, loc)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[loc[:5]], k[:5])


NEW_1_TO_40 = [(0, 1), (3, 2), (17, 3), (40, 8), (0, 15), (9, 16), (64, 33), (5, 40)]
FUSED_CASES = {  # page_size, heads, kv_heads, head_dim, [(prefix, new), ...], padded rows, block
    "gqa1_page1_pad_gt_new": (1, 2, 2, 16, [(0, 5), (7, 1), (0, 1)], 9, 16),
    "gqa4_prefix_pages": (4, 8, 2, 64, [(0, 19), (9, 4), (30, 1), (3, 36)], 0, 16),
    "gqa2_page16": (16, 4, 2, 16, [(21, 4), (0, 33), (16, 16), (40, 40)], 5, 16),
    "gqa3_dim24_default_blocks": (4, 6, 2, 24, [(5, 11), (0, 2)], 2, None),
    "new_1_to_40_default_blocks": (8, 8, 2, 16, NEW_1_TO_40, 4, None),
}


def _extend_problem(
    case: tuple, dtype: torch.dtype, cache_dtype: torch.dtype, gen: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``(q, k, v)``, the caches and ``(out_cache_loc, page_table, seq_lens, extend_lens,
    extend_start)`` of one extend pass; padded rows have slot -1.
    """
    page_size, h, kv, d, reqs, pad, _ = case
    ext = [new for _, new in reqs]
    page_table = _page_table([p + n for p, n in reqs], page_size, gen)
    caches = _cache(page_table.numel() * page_size, kv, d, gen)
    qkv = torch.randn(sum(ext) + pad, h + 2 * kv, d, generator=gen).to(DEVICE, dtype)
    table = page_table.tolist()
    positions = [
        (b, i) for b, (prefix, new) in enumerate(reqs) for i in range(prefix, prefix + new)
    ]
    loc = [table[b][i // page_size] * page_size + i % page_size for b, i in positions]
    index = (
        torch.tensor(loc + [-1] * pad, device=DEVICE),
        page_table,
        _lens([p + n for p, n in reqs]),
        _lens(ext),
        _lens([sum(ext[:i]) for i in range(len(ext))]),
    )
    # strided views of one fused qkv tensor, as the model passes them
    return qkv.split([h, kv, kv], dim=1), tuple(c.to(cache_dtype) for c in caches), index


def _check_fused(
    case: tuple,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    tol: float,
    cache_tol: float,
    num_splits: int = 1,
    window: int | None = None,
) -> None:
    """The fused kernel == ``store_kv_ref`` then ``extend_attention_ref``: real rows within
    ``tol``, padded rows zero, written slots within ``cache_tol``, every other slot untouched.
    """
    page_size, h, kv, d, reqs, pad, block = case
    gen = torch.Generator().manual_seed(h * d + pad)
    (q, k, v), caches, index = _extend_problem(case, dtype, cache_dtype, gen)
    ext, scale = [new for _, new in reqs], d**-0.5
    plan = plan_extend(
        ext,
        len(q),
        h,
        kv,
        d,
        dtype,
        page_size,
        scale,
        num_splits=num_splits,
        block_m=block,
        block_n=block,
    )
    ref = [c.clone() for c in caches]
    if window is not None:
        firsts = [prefix - window + 1 for prefix, _ in reqs]
        _poison_left_of_windows(caches, index[1], firsts, page_size)
    fused = [c.clone() for c in caches]
    out, expected = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    workspace = None
    if num_splits > 1:  # NaN-filled: a piece the reduce reads but no program wrote shows up
        workspace = tuple(
            w.fill_(float("nan")) for w in decode_workspace(len(q), h, d, num_splits, DEVICE)
        )
    extend_attention(q, k, v, out, *fused, *index, plan, window=window, workspace=workspace)
    store_kv_ref(k, v, *ref, index[0])
    extend_attention_ref(q, *ref, expected, *index[1:], page_size, scale, window)
    n = sum(ext)
    torch.testing.assert_close(out[:n], expected[:n], atol=tol, rtol=tol)
    assert (out[n:] == 0).all(), "padded rows must be zero"
    written = index[0][index[0] >= 0]
    untouched = torch.ones(len(caches[0]), dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    for got, want, before in zip(fused, ref, caches):
        same = got[untouched].nan_to_num(7.0) == before[untouched].nan_to_num(7.0)
        assert same.all(), "only the new tokens' slots change"
        torch.testing.assert_close(got[written], want[written], atol=0, rtol=cache_tol)


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_extend_matches_store_then_attend(case: str) -> None:
    _check_fused(FUSED_CASES[case], torch.float32, torch.float32, ATOL, 0)


SPLIT_CASES = {  # FUSED_CASES' fields, then the prefix splits
    # no prefix (every piece empty), prefixes shorter than the pieces, a padded row
    "mixed_prefixes_padded": ((4, 8, 2, 16, [(0, 5), (70, 3), (33, 1), (129, 16)], 3, 16), 3),
    "more_pieces_than_tiles": ((16, 4, 4, 16, [(200, 2), (17, 40)], 0, 16), 16),
    "gqa3_dim24_default_blocks": ((1, 6, 2, 24, [(45, 7), (300, 20)], 2, None), 2),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_fused_extend_with_prefix_splits(case: str) -> None:
    """Pieces of the prefix attended in parallel, merged by the split-KV reduce: the same
    output and cache as one pass over it."""
    fused_case, num_splits = SPLIT_CASES[case]
    _check_fused(fused_case, torch.float32, torch.float32, ATOL, 0, num_splits)


WINDOW_CASES = {  # FUSED_CASES' fields, the sliding window, the prefix splits
    # prefixes longer than the window (chunked prefill), new tokens longer than it, GQA 1 and 4
    "prefix_past_window": ((4, 8, 2, 16, [(40, 9), (0, 37), (13, 6), (3, 1)], 3, 16), 7, 1),
    "window_1": ((1, 2, 2, 16, [(9, 5), (0, 20)], 2, 16), 1, 1),
    "window_in_tile_gqa3": ((4, 6, 2, 24, [(5, 11), (30, 40)], 2, None), 19, 1),
    "window_past_sequence": ((16, 4, 2, 16, [(21, 4), (0, 33)], 0, 16), 200, 1),
    "split_prefix": ((4, 8, 2, 16, [(0, 5), (70, 3), (129, 16), (33, 1)], 3, 16), 50, 3),
    "split_more_pieces": ((16, 4, 4, 16, [(200, 2), (17, 40)], 0, 16), 33, 16),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_fused_extend_with_sliding_window(case: str) -> None:
    """Each new token at position ``p`` sees keys ``p - window < j <= p`` only."""
    fused_case, window, num_splits = WINDOW_CASES[case]
    _check_fused(fused_case, torch.float32, torch.float32, ATOL, 0, num_splits, window)


def test_prefix_splits_fill_the_gpu_only_where_needed() -> None:
    """Few programs over a long prefix split it (at most 16 pieces, none under 256 keys); a
    short prefix or a grid that fills a wave does not."""
    assert prefix_splits(programs=3, max_prefix=2000, num_sms=132) == 7  # by length
    assert prefix_splits(programs=48, max_prefix=2000, num_sms=132) == 3  # by occupancy
    assert prefix_splits(programs=1, max_prefix=100_000, num_sms=132) == 16
    assert prefix_splits(programs=3, max_prefix=511, num_sms=132) == 1
    assert prefix_splits(programs=132, max_prefix=8000, num_sms=132) == 1
    plan = plan_extend(
        [32] * 16, 512, 9, 3, 64, torch.bfloat16, 16, 1.0, max_prefix=2000, num_sms=132
    )
    assert plan.num_splits == 3 and plan.grid == (16, 3, 3)
    with pytest.raises(ValueError, match="num_splits must be in 1..16"):
        plan_extend([2], 2, 4, 2, 16, torch.float32, 4, 1.0, num_splits=17)
    gen = torch.Generator().manual_seed(3)
    (q, k, v), caches, index = _extend_problem(
        SPLIT_CASES["more_pieces_than_tiles"][0], torch.float32, torch.float32, gen
    )
    plan = plan_extend([2, 40], len(q), 4, 4, 16, torch.float32, 16, 1.0, num_splits=4)
    with pytest.raises(ValueError, match="needs a float32 workspace"):
        extend_attention(q, k, v, torch.empty_like(q), *caches, *index, plan)


LOW_PRECISION = [  # q/k/v dtype, cache dtype, output tolerance, cache tolerance
    (torch.float32, torch.float16, ATOL, 0),  # the new keys must be rounded through the cache
    (torch.float16, torch.float16, 3e-3, 0),
    # NOTE: the interpreter's fp32 -> bf16 cast truncates where torch rounds to nearest.
    (torch.float32, torch.bfloat16, ATOL if ON_GPU else 2e-2, 0 if ON_GPU else 1e-2),
    # NOTE: the interpreter's tl.dot mishandles bf16, so bf16 inputs are checked on a GPU only.
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 0, marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("dtype", "cache_dtype", "tol", "cache_tol"), LOW_PRECISION)
def test_fused_extend_low_precision(
    dtype: torch.dtype, cache_dtype: torch.dtype, tol: float, cache_tol: float
) -> None:
    _check_fused(FUSED_CASES["gqa4_prefix_pages"], dtype, cache_dtype, tol, cache_tol)


DECODE_CASES = [  # page_size, heads, kv_heads, head_dim, seq_lens, num_kv_splits, tokens/seq
    (1, 2, 2, 16, [1, 37, 70], 1, 1),
    (4, 6, 2, 64, [150, 1, 64, 33], 3, 1),
    (16, 6, 2, 16, [200, 17], 8, 1),
    (4, 3, 1, 24, [45, 2, 96], 5, 1),
    (1, 6, 2, 16, [4, 40, 77], 3, 4),
    (16, 2, 2, 64, [130, 9], 4, 4),
]
WINDOWED_DECODE_CASES = [  # DECODE_CASES' fields, then the sliding window
    (1, 2, 2, 16, [1, 37, 70], 1, 1, 20),
    (4, 6, 2, 64, [150, 1, 64, 33], 3, 1, 33),
    (16, 6, 2, 16, [200, 17], 8, 1, 1),
    (1, 6, 2, 16, [4, 40, 77], 3, 4, 2),
    (16, 2, 2, 64, [130, 9], 4, 4, 50),
    (4, 4, 2, 16, [90, 7], 2, 5, 300),
]


@pytest.mark.parametrize(
    ("page_size", "h", "kv", "d", "seq", "splits", "n", "window"),
    [(*case, None) for case in DECODE_CASES] + WINDOWED_DECODE_CASES,
)
def test_decode_attention_matches_reference(
    page_size: int,
    h: int,
    kv: int,
    d: int,
    seq: list[int],
    splits: int,
    n: int,
    window: int | None,
) -> None:
    """Decode (1 token per request) and verify (``n``) passes, with and without a window."""
    gen = torch.Generator().manual_seed(page_size * 100 + h + d + splits + n + (window or 0))
    page_table = _page_table(seq, page_size, gen)
    k_cache, v_cache = _cache(page_table.numel() * page_size, kv, d, gen)
    q = torch.randn(len(seq) * n, h, d, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    ref = torch.full_like(q, float("nan"))
    args = (page_table, _lens(seq), page_size, d**-0.5)
    decode_attention_ref(q, k_cache, v_cache, ref, *args, tokens_per_seq=n, window=window)
    if window is not None:
        firsts = [s - n - window + 1 for s in seq]
        _poison_left_of_windows((k_cache, v_cache), page_table, firsts, page_size)
    decode_attention(
        q, k_cache, v_cache, out, *args, splits, tokens_per_seq=n, window=window, block_n=16
    )
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("dtype", "tol"),
    # NOTE: the interpreter's tl.dot mishandles bf16, so bf16 is checked on a GPU only.
    [(torch.float16, 3e-3), pytest.param(torch.bfloat16, 3e-2, marks=pytest.mark.gpu)],
)
def test_low_precision_decode_matches_reference(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(7)
    page_size, seq = 4, [45, 9]
    page_table = _page_table(seq, page_size, gen)
    k_cache, v_cache = (c.to(dtype) for c in _cache(page_table.numel() * page_size, 2, 64, gen))
    q = torch.randn(len(seq), 6, 64, generator=gen).to(DEVICE, dtype)
    out, ref = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, out, page_table, _lens(seq), page_size, 0.125, 3)
    decode_attention_ref(q, k_cache, v_cache, ref, page_table, _lens(seq), page_size, 0.125)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [None, 3])
def test_empty_decode_request_gives_zeros(window: int | None) -> None:
    """A padded request (seq_len 0, as in a captured decode graph) must come out finite."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(16, 2, 16, gen)
    q = torch.randn(2, 4, 16, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    table, seq = _lens([[0], [1]]), _lens([0, 0])
    decode_attention(q, k_cache, v_cache, out, table, seq, 16, 1.0, 4, window=window)
    assert not out.any()


def test_wrappers_reject_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _cache(8, 2, 16, gen)
    q = torch.randn(2, 3, 16, generator=gen).to(DEVICE)
    table, seq = _lens([[0, 1], [2, 3]]), _lens([3, 4])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q, k_cache, v_cache, torch.empty_like(q), table, seq, 4, 1.0, 1)
    with pytest.raises(ValueError, match="out_cache_loc"):
        k = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
        store_kv(k, k, k_cache, v_cache, torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="caches must share a dtype"):
        q = q[:, :2]
        decode_attention(q, k_cache, v_cache.half(), torch.empty_like(q), table, seq, 4, 1.0, 1)
    with pytest.raises(ValueError, match="num_rows 3 < sum"):
        plan_extend([2, 2], 3, 4, 2, 16, torch.float32, 4, 1.0)
    with pytest.raises(ValueError, match="block_m must be a power of 2"):
        plan_extend([2], 2, 4, 2, 16, torch.float32, 4, 1.0, block_m=24)
    plan = plan_extend([1, 1], 2, 2, 2, 16, torch.float32, 4, 1.0)
    q = torch.randn(3, 2, 16, generator=gen).to(DEVICE)  # one row more than planned
    index = (torch.zeros(3, dtype=torch.int64, device=DEVICE), table, seq, _lens([1, 1]), seq)
    with pytest.raises(ValueError, match="differ from the plan"):
        extend_attention(q, q[:, :2], q[:, :2], q.clone(), k_cache, v_cache, *index, plan)


# --- the full backend through torch.ops.pcgspec.attention, against the torch oracle ---

NUM_LAYERS, H, KV, D, PAGE = 2, 6, 2, 32, 4


def _backends(
    gen: torch.Generator, windows: tuple[int | None, ...] = ()
) -> tuple[TorchAttentionBackend, TritonAttentionBackend]:
    spec = KVCacheSpec(num_layers=NUM_LAYERS, num_kv_heads=KV, head_dim=D, dtype=torch.float32)
    caches = [KVCache(spec, num_pages=64, page_size=PAGE, device=DEVICE) for _ in range(2)]
    for layer in range(NUM_LAYERS):  # identical random history in both caches
        for name in ("k", "v"):
            data = torch.randn(getattr(caches[0], name)[layer].shape, generator=gen).to(DEVICE)
            for cache in caches:
                getattr(cache, name)[layer].copy_(data)
    oracle, triton_backend = (
        cls(cache, num_heads=H, head_dim=D, scale=D**-0.5, sliding_windows=windows)
        for cls, cache in zip((TorchAttentionBackend, TritonAttentionBackend), caches)
    )
    triton_backend.min_kv_split_len = 32  # a few splits even at these tiny lengths
    return oracle, triton_backend


def _batch(mode: ForwardMode, reqs: list[tuple[int, int]], pad: int, gen: torch.Generator):
    """Requests ``(prefix, new)`` on shuffled pages, plus ``pad`` padding rows at the end."""
    perm = torch.randperm(64, generator=gen).tolist()
    chunks, used = [], 0
    for prefix, new in reqs:
        n_pages = -(-(prefix + new) // PAGE)
        ids = torch.randint(0, 100, (new,), generator=gen).tolist()
        chunks.append(SeqChunk(ids, start=prefix, pages=perm[used : used + n_pages]))
        used += n_pages
    batch = build_forward_batch(mode, chunks, PAGE, DEVICE)
    if pad == 0:
        return batch
    fill = torch.full((pad,), -1, dtype=torch.int64, device=DEVICE)
    return dataclasses.replace(
        batch,
        input_ids=torch.cat([batch.input_ids, fill.clamp(min=0)]),
        positions=torch.cat([batch.positions, fill.clamp(min=0)]),
        out_cache_loc=torch.cat([batch.out_cache_loc, fill]),
    )


def _run(backend, batch: ForwardBatch, qkv: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    backend.init_forward_metadata(batch)
    outs = []
    with forward_context(batch, backend):
        for layer, (q, k, v) in enumerate(qkv):
            out = torch.full_like(q, float("nan"))
            torch.ops.pcgspec.attention(q, k, v, out, layer)
            outs.append(out)
    return outs


BACKEND_CASES = {
    "extend_with_prefix": (ForwardMode.EXTEND, [(0, 9), (13, 6), (5, 1), (30, 21)], 3),
    "decode": (ForwardMode.DECODE, [(0, 1), (40, 1), (97, 1), (6, 1)], 0),
    "decode_padded": (ForwardMode.DECODE, [(70, 1), (11, 1)], 2),
    "target_verify": (ForwardMode.TARGET_VERIFY, [(12, 4), (1, 4), (50, 4)], 0),
    "target_verify_padded": (ForwardMode.TARGET_VERIFY, [(70, 4), (33, 4)], 3),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, [(12, 2), (40, 1), (7, 3)], 1),
}


SPLIT_KV_LAUNCHES = {"_store_kv_kernel": 1, "_split_kv_kernel": 1, "_split_kv_reduce_kernel": 1}
LAUNCHES_PER_LAYER = {  # NOTE: the extend path is one fused launch per layer
    ForwardMode.EXTEND: {"_extend_kernel": 1},
    ForwardMode.DRAFT_EXTEND: {"_extend_kernel": 1},
    ForwardMode.DECODE: SPLIT_KV_LAUNCHES,
    ForwardMode.TARGET_VERIFY: SPLIT_KV_LAUNCHES,
}


@pytest.fixture
def triton_launches() -> Iterator[collections.Counter[str]]:
    """Triton kernel launches by kernel name (compiled or interpreted), while the test runs."""
    with count_triton_launches() as counts:
        yield counts


WINDOWS = {"full": (), "sliding_5_then_full": (5, None)}  # per layer


@pytest.mark.parametrize("windows", list(WINDOWS))
@pytest.mark.parametrize("case", list(BACKEND_CASES))
def test_triton_backend_matches_torch_backend(
    case: str, windows: str, triton_launches: collections.Counter[str]
) -> None:
    mode, reqs, pad = BACKEND_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    oracle, triton_backend = _backends(gen, WINDOWS[windows])
    batch = _batch(mode, reqs, pad, gen)
    t, num_real = batch.num_tokens, sum(batch.extend_lens_cpu)
    qkv = [
        tuple(torch.randn(t, n, D, generator=gen).to(DEVICE) for n in (H, KV, KV))
        for _ in range(NUM_LAYERS)
    ]
    expected = _run(oracle, batch, qkv)
    triton_launches.clear()
    actual = _run(triton_backend, batch, qkv)
    per_layer = LAUNCHES_PER_LAYER[mode]
    assert triton_launches == {name: n * NUM_LAYERS for name, n in per_layer.items()}
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(actual[layer], expected[layer], atol=ATOL, rtol=RTOL)
        assert not actual[layer][num_real:].any(), "padding rows must be zero"
        real_slots = slice(0, oracle.kv_cache.num_slots)  # the oracle's scratch slot differs
        for name in ("k", "v"):
            got = getattr(triton_backend.kv_cache, name)[layer][real_slots]
            assert torch.equal(got, getattr(oracle.kv_cache, name)[layer][real_slots])
    if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        assert triton_backend.metadata.tokens_per_seq == reqs[0][1]
        assert triton_backend.metadata.num_kv_splits > 1


@pytest.mark.parametrize("windows", list(WINDOWS))
def test_triton_backend_splits_a_long_prefix(
    windows: str, monkeypatch: pytest.MonkeyPatch, triton_launches: collections.Counter[str]
) -> None:
    """A few new tokens over a long prefix: the backend plans prefix splits (the minimum piece
    lowered to these sizes, a GPU's SM count) and matches the torch oracle, with one merge
    launch per layer."""
    monkeypatch.setattr(extend_module, "MIN_PREFIX_SPLIT", 32)
    monkeypatch.setattr(triton_backend_module, "_num_sms", lambda device: 64)
    gen = torch.Generator().manual_seed(11)
    oracle, triton_backend = _backends(gen, WINDOWS[windows])
    batch = _batch(ForwardMode.EXTEND, [(100, 3), (0, 5), (57, 1)], 2, gen)
    t, num_real = batch.num_tokens, sum(batch.extend_lens_cpu)
    qkv = [
        tuple(torch.randn(t, n, D, generator=gen).to(DEVICE) for n in (H, KV, KV))
        for _ in range(NUM_LAYERS)
    ]
    expected = _run(oracle, batch, qkv)
    triton_launches.clear()
    actual = _run(triton_backend, batch, qkv)
    assert triton_backend.metadata.extend_plan.num_splits > 1
    assert triton_launches == {"_extend_kernel": NUM_LAYERS, "_merge_kernel": NUM_LAYERS}
    for layer in range(NUM_LAYERS):
        torch.testing.assert_close(actual[layer], expected[layer], atol=ATOL, rtol=RTOL)
        assert not actual[layer][num_real:].any(), "padding rows must be zero"
