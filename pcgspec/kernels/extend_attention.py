"""Fused paged extend attention (prefill, chunked prefill, DRAFT_EXTEND): one launch per layer
stores the new tokens' K/V in the cache, attends each new token causally over its request's
cached prefix and the new tokens, and zeroes the padded rows.

Organised as SGLang's extend kernel: stage 1 reads the prefix (positions below
``seq_len - extend_len``) through the page table, stage 2 reads the new keys from the
contiguous ``k``/``v`` rows under the causal mask, so no program reads a slot that another
program of the same launch writes. The host side is split as in FlashInfer: ``plan_extend``
once per pass (grid, block sizes, constants, from host ints only: graph-capturable),
``extend_attention`` once per layer.

A few new tokens over a long cached prefix (a prefix-cache hit, a chat's next turn) make few
programs, each reading the whole prefix: on an H100 one request of 32 tokens over 2,000 cached
ones took 46 us a layer, a 2,032-token prefill 50 us. So where the programs would not fill the GPU,
stage 1 is split over the prefix as in flash-decoding: each program attends one piece of it
(the last piece's program also the new keys) and writes its partial output and log-sum-exp,
and a second launch per layer merges them (``_merge_kernel``: blocks of rows per program, where
the split-KV decode's reduce takes one row per program).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from pcgspec.kernels.attention import (
    _DTYPES,
    _LOG2E,
    _attend_ref,
    _attend_tile,
    _check_attention,
    _check_index,
    _check_rows,
    _check_window,
    _dot_precision,
    _online_softmax,
    _require,
)
from pcgspec.kernels.launches import CompiledLaunches


@triton.jit
def _store_new_kv(
    K,
    V,
    KCache,
    VCache,
    Loc,
    row,
    writer,
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The ``writer`` rows store the K/V of ``kv_head`` of their token ``row`` at its slot."""
    loc = tl.load(Loc + row, mask=writer, other=-1).to(tl.int64)  # -1: write nothing
    d = tl.arange(0, BLOCK_D)
    mask = (loc >= 0)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(K + row[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=mask)
    v = tl.load(V + row[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=mask)
    dst = loc[:, None] * (NUM_KV * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


@triton.jit
def _attend_prefix(
    acc,
    m_i,
    l_i,
    q,
    KCache,
    VCache,
    page_row,
    lo,
    hi,
    win_lo,
    kv_head,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Stage 1: every row sees the cached keys ``lo .. hi`` (``lo <= hi``), read through the
    page table (no causal mask, so the tile's ``causal_lim`` argument is unused); with
    ``WINDOW``, none below its ``win_lo``.
    """
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
    for n0 in range(lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            KCache,
            VCache,
            page_row,
            n0,
            hi,
            hi,
            win_lo,
            kv_head,
            qk_scale,
            NUM_KV * HEAD_DIM,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            False,
            False,
            WINDOW,
            DOT_PREC,
        )
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            KCache,
            VCache,
            page_row,
            n0,
            hi,
            hi,
            win_lo,
            kv_head,
            qk_scale,
            NUM_KV * HEAD_DIM,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            True,
            False,
            WINDOW,
            DOT_PREC,
        )
    return acc, m_i, l_i


@triton.jit
def _attend_new_tile(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    KCache,
    start,
    n0,
    kv_end,
    tok,
    win_lo,
    kv_head,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """New keys ``n0 .. n0 + BLOCK_N`` from the k/v rows; ``MASKED``: causal and ``< kv_end``;
    ``WINDOW``: none below the row's ``win_lo``."""
    j = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    row = start + j
    mask = (d < HEAD_DIM)[None, :]
    if MASKED:
        mask = mask & (j < kv_end)[:, None]
    k = tl.load(K + row[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=mask, other=0)
    v = tl.load(V + row[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=mask, other=0)
    # NOTE: rounded through the cache dtype, so they equal the keys read back from the cache.
    k = k.to(KCache.dtype.element_ty).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    v = v.to(KCache.dtype.element_ty).to(q.dtype)
    keep = j[None, :] <= tok[:, None]
    if WINDOW:
        keep = keep & (j[None, :] >= win_lo[:, None])
    return _online_softmax(acc, m_i, l_i, q, k, v, keep, qk_scale, MASKED or WINDOW, DOT_PREC)


@triton.jit
def _attend_new(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    KCache,
    start,
    tok,
    r0,
    ext_len,
    window,
    kv_head,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Stage 2: the new keys up to the tile's last token, causally; with ``WINDOW``, from the
    tile of the first token's window on.

    NOTE: keys up to the tile's first token ``r0 // GROUP`` are visible to every row.
    """
    full_end = (r0 // GROUP + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum((r0 + BLOCK_M - 1) // GROUP, ext_len - 1) + 1
    n_lo = r0 * 0
    if WINDOW:
        n_lo = tl.maximum(r0 // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
    win_lo = tok - window + 1
    for n0 in range(n_lo, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_new_tile(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            KCache,
            start,
            n0,
            kv_end,
            tok,
            win_lo,
            kv_head,
            qk_scale,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            False,
            WINDOW,
            DOT_PREC,
        )
    for n0 in range(tl.maximum(full_end, n_lo), kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_new_tile(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            KCache,
            start,
            n0,
            kv_end,
            tok,
            win_lo,
            kv_head,
            qk_scale,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            True,
            WINDOW,
            DOT_PREC,
        )
    return acc, m_i, l_i


@triton.jit
def _zero_rows(
    Out, row, keep, head, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    d = tl.arange(0, BLOCK_D)
    offs = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    mask = keep[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(Out + offs, tl.zeros_like(offs).to(Out.dtype.element_ty), mask=mask)


# NOTE: ints that change from batch to batch are not specialized (Triton would compile a variant
# per value class: == 1, multiple of 16, other), nor is the alignment of the small index arrays
# (views into one packed upload), so a server's first batches compile nothing.
@triton.jit(
    do_not_specialize=["window", "num_real", "num_rows", "num_splits", "stride_pt"],
    do_not_specialize_on_alignment=["Loc", "PageTable", "SeqLens", "ExtendLens", "ExtendStart"],
)
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    KCache,
    VCache,
    Loc,
    PageTable,
    SeqLens,
    ExtendLens,
    ExtendStart,
    MidO,
    MidLse,
    qk_scale,
    window,
    num_real,
    num_rows,
    num_splits,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
):
    # Rows of a tile are (token, head-in-group) pairs, so one K/V read serves the whole group.
    # With SPLIT, axis 2 is (row tile, prefix piece): the piece's partial output goes to MidO /
    # MidLse ([rows, heads, num_splits, (HEAD_DIM)]) for the merge.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:
        split = tl.program_id(2) % num_splits
        r0 = tl.program_id(2) // num_splits * BLOCK_M
    else:
        split = 0
        r0 = tl.program_id(2) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    # NOTE: a runtime test, not a constexpr: padded and unpadded passes share one compiled kernel.
    if (num_real < num_rows) & (b == tl.num_programs(0) - 1):  # the padding program
        if split == 0:
            pad = (num_real + rows // GROUP).to(tl.int64)  # zero rows num_real .. num_rows
            _zero_rows(Out, pad, pad < num_rows, head, stride_ot, stride_oh, HEAD_DIM, BLOCK_D)
        return
    ext_len = tl.load(ExtendLens + b)
    if r0 >= ext_len * GROUP:
        return
    tok = rows // GROUP  # [BLOCK_M] token of each row within its request
    start = tl.load(ExtendStart + b).to(tl.int64)
    row = start + tok  # [BLOCK_M] row in q/k/v/out
    if SPLIT:  # the first piece's programs store the new K/V
        writer = (rows % GROUP == 0) & (tok < tl.where(split == 0, ext_len, 0))
    else:
        writer = (rows % GROUP == 0) & (tok < ext_len)
    _store_new_kv(
        K,
        V,
        KCache,
        VCache,
        Loc,
        row,
        writer,
        kv_head,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        NUM_KV,
        HEAD_DIM,
        BLOCK_D,
    )
    mask = (tok < ext_len)[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_offs, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    prefix = tl.load(SeqLens + b) - ext_len
    first = prefix * 0
    if WINDOW:  # the prefix keys the tile's first token's window holds
        first = tl.minimum(tl.maximum(prefix + r0 // GROUP - window + 1, 0), prefix)
    if SPLIT:  # pieces of whole tiles; those past the prefix are empty
        split_len = tl.cdiv(tl.cdiv(prefix - first, num_splits), BLOCK_N) * BLOCK_N
        hi = tl.minimum(first + (split + 1) * split_len, prefix)
        lo = tl.minimum(first + split * split_len, hi)
    else:
        lo = first
        hi = prefix
    acc, m_i, l_i = _attend_prefix(
        acc,
        m_i,
        l_i,
        q,
        KCache,
        VCache,
        PageTable + b.to(tl.int64) * stride_pt,
        lo,
        hi,
        prefix + tok - window + 1,
        kv_head,
        qk_scale,
        PAGE_SIZE,
        NUM_KV,
        HEAD_DIM,
        BLOCK_N,
        BLOCK_D,
        WINDOW,
        DOT_PREC,
    )
    if split == num_splits - 1:
        acc, m_i, l_i = _attend_new(
            acc,
            m_i,
            l_i,
            q,
            K,
            V,
            KCache,
            start,
            tok,
            r0,
            ext_len,
            window,
            kv_head,
            qk_scale,
            stride_kt,
            stride_kh,
            stride_vt,
            stride_vh,
            GROUP,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_N,
            BLOCK_D,
            WINDOW,
            DOT_PREC,
        )
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SPLIT:  # NOTE: a row that saw no key of its piece stores o = 0, lse = -inf (weight 0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        mid = (row * (NUM_KV * GROUP) + head) * num_splits + split  # [BLOCK_M]
        tl.store(MidO + mid[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        tl.store(MidLse + mid, lse, mask=tok < ext_len)
    else:
        o_offs = row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(Out + o_offs, o.to(Out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_real", "num_splits"])
def _merge_kernel(
    MidO,
    MidLse,
    Out,
    num_real,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """``Out`` rows of one head, ``BLOCK_R`` at a time: the pieces' outputs weighed by their
    softmax mass (log2 domain), folded piece by piece.
    """
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = r < num_real
    mask = ok[:, None] & (d < HEAD_DIM)[None, :]
    base = (r.to(tl.int64) * NUM_HEADS + head) * num_splits  # [BLOCK_R] piece 0 of each row
    m_i = tl.full([BLOCK_R], -1e30, dtype=tl.float32)
    w_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(0, num_splits):
        lse = tl.load(MidLse + base + s, mask=ok, other=float("-inf"))
        o = tl.load(MidO + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + p[:, None] * o
        w_i = w_i * alpha + p
        m_i = m_new
    o = acc / tl.where(w_i > 0, w_i, 1.0)[:, None]
    offs = r.to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(Out + offs, o.to(Out.dtype.element_ty), mask=mask)


_MERGE_ROWS = 16


@dataclass(frozen=True)
class ExtendPlan:
    """The host side of one extend pass, shared by all its layers: what the checks compare,
    the grid, and the kernel's scalars and compile-time constants.
    """

    num_rows: int  # rows of q/k/v/out; rows past num_real are padding, zeroed
    num_real: int  # sum(extend_lens)
    num_reqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of q and out
    page_size: int
    qk_scale: float  # softmax scale * log2(e)
    num_splits: int  # pieces of the prefix attended in parallel (> 1: partials, then a merge)
    grid: tuple[int, int, int]
    constants: dict[str, Any]  # constexprs, num_warps, num_stages
    empty: bool  # nothing to launch
    specialization: tuple[tuple[str, Any], ...]  # the constants, hashable
    merge_grid: tuple[int, int, int]  # prefix splits: the merge's grid and constants
    merge_constants: dict[str, Any]
    window_constants: dict[str, Any]  # the constants of a sliding-window layer
    # NOTE: the lean launches of this pass by kernel, window flag and the strides they were
    # specialized for (all pointers 16-byte aligned); filled at the first layer of each kind.
    launches: dict[tuple[object, ...], Callable[..., None] | None] = field(default_factory=dict)


def _tiles(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """The largest BLOCK_M and BLOCK_N that compile for sm_90 without register spills."""
    if dtype == torch.float32:
        return (64 if block_d <= 64 else 32), 32
    return (128, 64) if block_d <= 128 else (64, 32)


def _num_warps(dtype: torch.dtype, block_m: int, block_d: int) -> int:
    # NOTE: fp32 runs its dots on CUDA cores (``ieee``): 8 warps' registers at any tile size.
    return 8 if dtype == torch.float32 or (block_m >= 64 and block_d > 64) else 4


MAX_PREFIX_SPLITS = 16
# NOTE: at 500 cached keys, pieces gained at most 1.26x and lost up to 0.87x (H100)
MIN_PREFIX_SPLIT = 256  # keys per piece at least


def plan_extend(
    extend_lens: Sequence[int],
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
    scale: float,
    *,
    max_prefix: int = 0,
    num_sms: int = 0,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> ExtendPlan:
    """Plan the launches of a pass whose requests extend by ``extend_lens`` (host ints) tokens,
    packed in that order into the first ``sum(extend_lens)`` of ``num_rows`` rows, over cached
    prefixes of at most ``max_prefix`` keys. The prefix is split (``prefix_splits``) so the
    programs fill about one wave of ``num_sms``; ``num_splits`` sets the count instead.
    """
    _check_plan(extend_lens, num_rows, num_heads, num_kv_heads, head_dim, dtype, page_size)
    num_real, max_len, group = (
        sum(extend_lens),
        max(extend_lens, default=0),
        num_heads // num_kv_heads,
    )
    block_d = max(16, _pow2(head_dim))
    tile_m, tile_n = _tiles(dtype, block_d)
    block_m = block_m or min(tile_m, max(16, _pow2(max_len * group)))
    block_n = block_n or tile_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} must be a power of 2 >= 16, got {size}")
    pad = num_rows - num_real
    grid = (len(extend_lens) + (pad > 0), num_kv_heads, -(-max(max_len, pad) * group // block_m))
    if num_splits is None:
        num_splits = prefix_splits(math.prod(grid), max_prefix, num_sms)
    if not 1 <= num_splits <= MAX_PREFIX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_PREFIX_SPLITS}, got {num_splits}")
    grid = (*grid[:2], grid[2] * num_splits)
    constants = dict(
        PAGE_SIZE=page_size,
        GROUP=group,
        NUM_KV=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PREC=_dot_precision(dtype),
        SPLIT=num_splits > 1,
        WINDOW=False,
        num_warps=_num_warps(dtype, block_m, block_d),
        num_stages=2,
    )
    merge_constants = dict(
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_R=_MERGE_ROWS, BLOCK_D=block_d
    )
    return ExtendPlan(
        num_rows,
        num_real,
        len(extend_lens),
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        page_size,
        scale * _LOG2E,
        num_splits,
        grid,
        constants,
        math.prod(grid) == 0,
        tuple(sorted(constants.items())),
        (-(-num_real // _MERGE_ROWS), num_heads, 1),
        merge_constants,
        {**constants, "WINDOW": True},
    )


def prefix_splits(programs: int, max_prefix: int, num_sms: int) -> int:
    """Pieces to cut the prefix into: enough for ``programs`` to fill about one wave of
    ``num_sms``, none shorter than ``MIN_PREFIX_SPLIT`` keys (1: no split). One wave, not two:
    on an H100, 16 requests of 32 tokens over 2,000 cached ones with the 1B's heads (128
    programs) took 66 us whole, 54 us in 2 pieces, 62 in 4 and 80 in 8.
    """
    by_length = max_prefix // MIN_PREFIX_SPLIT
    if programs == 0 or by_length < 2:
        return 1
    by_occupancy = -(-num_sms // programs)
    return max(1, min(MAX_PREFIX_SPLITS, by_occupancy, by_length))


def _check_plan(
    extend_lens: Sequence[int],
    num_rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page_size: int,
) -> None:
    # NOTE: runs once per pass: the messages are formatted on failure only.
    if min(extend_lens, default=0) < 0:
        raise ValueError(f"extend_lens must be >= 0, got {extend_lens}")
    if num_rows < sum(extend_lens):
        raise ValueError(f"num_rows {num_rows} < sum(extend_lens) {sum(extend_lens)}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of kv heads {num_kv_heads}")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in 1..256, got {head_dim}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")


def _pow2(n: int) -> int:
    """The smallest power of 2 >= ``n`` (``triton.next_power_of_2`` without its call overhead)."""
    return 1 << max(n - 1, 0).bit_length()


def _check_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    plan: ExtendPlan,
    workspace: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    _check_attention(q, k_cache, v_cache, out, page_table, seq_lens, plan.page_size)
    _check_rows("k", k, k_cache, k_cache.shape[1])
    _check_rows("v", v, k_cache, k_cache.shape[1])
    _require(k.shape == v.shape and len(k) == len(q), "k and v must have q's rows")
    _check_index("out_cache_loc", out_cache_loc, (len(q),))
    _check_index("extend_lens", extend_lens, seq_lens.shape)
    _check_index("extend_start", extend_start, seq_lens.shape)
    got = (len(q), len(seq_lens), q.shape[1], *k_cache.shape[1:], q.dtype)
    want = (
        plan.num_rows,
        plan.num_reqs,
        plan.num_heads,
        plan.num_kv_heads,
        plan.head_dim,
        plan.dtype,
    )
    if got != want:
        raise ValueError(
            f"(rows, requests, heads, kv heads, head dim, dtype) {got} differ from "
            f"the plan's {want}"
        )
    if plan.num_splits > 1:
        mid = (plan.num_heads, plan.num_splits, plan.head_dim)
        ok = workspace is not None and all(
            w.dtype == torch.float32 and w.is_contiguous() and w.device == q.device
            for w in workspace
        )
        ok = ok and workspace[0].shape[0] >= plan.num_real and workspace[0].shape[1:] == mid
        ok = ok and workspace[1].shape == workspace[0].shape[:3]
        _require(
            ok,
            f"a plan of {plan.num_splits} prefix splits needs a float32 workspace "
            f"on q's device ([>= {plan.num_real}, {mid[0]}, {mid[1]}, {mid[2]}] and its "
            "first 3 dims; decode_workspace)",
        )


def extend_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D], this pass's new keys
    v: torch.Tensor,  # [T, KV, D]
    out: torch.Tensor,  # [T, H, D]; rows past plan.num_real are zeroed
    k_cache: torch.Tensor,  # [slots, KV, D]
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] slot per token, -1 = write nothing
    page_table: torch.Tensor,  # [B, max_pages]
    seq_lens: torch.Tensor,  # [B] prefix + new
    extend_lens: torch.Tensor,  # [B] new tokens, as planned
    extend_start: torch.Tensor,  # [B] first row of each request (exclusive cumsum)
    plan: ExtendPlan,
    *,
    window: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,  # split plans: decode_workspace
    check: bool = True,
) -> None:
    """Store the new K/V (skipping slot -1) and attend each request's new tokens causally
    over its cached prefix and themselves: one launch, or with prefix splits a second one
    that merges the pieces (``workspace`` holds them: ``decode_workspace(>= plan.num_real,
    heads, head_dim, plan.num_splits)``, shared by a pass's layers). A sliding ``window`` lets
    position ``p`` see keys ``p - window < j <= p`` only. ``check=False`` skips the argument
    checks (a caller that already checked this pass).
    """
    if check:
        _check_extend(
            q,
            k,
            v,
            out,
            k_cache,
            v_cache,
            out_cache_loc,
            page_table,
            seq_lens,
            extend_lens,
            extend_start,
            plan,
            workspace,
        )
        _check_window(window)
    if plan.empty:
        return
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    mid_o, mid_lse = workspace if plan.num_splits > 1 else (out, out)  # type: ignore[misc]
    tensors = (
        q,
        k,
        v,
        out,
        k_cache,
        v_cache,
        out_cache_loc,
        page_table,
        seq_lens,
        extend_lens,
        extend_start,
        mid_o,
        mid_lse,
    )
    strides = (sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0], so[1])
    scalars = (
        plan.qk_scale,
        window or 0,
        plan.num_real,
        plan.num_rows,
        plan.num_splits,
        *strides,
        page_table.stride(0),
    )
    constants = plan.constants if window is None else plan.window_constants
    _launch(_EXTEND, plan, plan.grid, tensors, scalars, (window is None, *strides), constants)
    if plan.num_splits > 1 and plan.num_real:
        _launch(
            _MERGE,
            plan,
            plan.merge_grid,
            (mid_o, mid_lse, out),
            (plan.num_real, plan.num_splits, so[0], so[1]),
            (so[0], so[1]),
            plan.merge_constants,
        )


def _launch(
    kernel: CompiledLaunches,
    plan: ExtendPlan,
    grid: tuple[int, int, int],
    tensors: tuple[torch.Tensor, ...],
    scalars: tuple[object, ...],
    key: tuple[object, ...],
    constants: dict[str, Any],
) -> None:
    # NOTE: layers after the first of their kind reuse its lean launches (every layer of a pass
    # has the same dtypes): ``key`` (the specialized ints: strides, and what selects
    # ``constants``) and pointer alignment decide whether the same compiled kernel applies.
    ptrs = [t.data_ptr() for t in tensors]
    launch = plan.launches.get((kernel, *key))
    if launch is not None and kernel.aligned(ptrs):
        launch(grid, *ptrs, *scalars)
        return
    launch = kernel(grid, tensors, scalars, constants)
    if launch is not None:
        plan.launches[(kernel, *key)] = launch


_EXTEND = CompiledLaunches(_extend_kernel)
_MERGE = CompiledLaunches(_merge_kernel)


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
) -> None:
    """Attention over a cache that already holds the new tokens (``store_kv_ref`` first)."""
    for b, (seq, n, start) in enumerate(
        zip(seq_lens.tolist(), extend_lens.tolist(), extend_start.tolist())
    ):
        rows = slice(start, start + n)
        o = _attend_ref(q[rows], k_cache, v_cache, page_table[b], seq, page_size, scale, window)
        out[start : start + n] = o.to(out.dtype)
