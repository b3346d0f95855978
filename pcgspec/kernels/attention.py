"""Paged attention in Triton: KV store and split-KV decode (also TARGET_VERIFY's k+1 tokens),
each with a checking wrapper and a plain torch reference, plus the pieces the fused extend
kernel (``extend_attention.py``) shares: the online-softmax step, argument checks, the oracle.

Cache layout: ``k_cache``/``v_cache`` are ``[num_slots + 1, KV, D]``; position ``p`` of request
``b`` lives in slot ``page_table[b, p // page_size] * page_size + p % page_size``.
Every launch is sized from host ints only (no ``.item()``), so all of it is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# NOTE: the reduce's split tile never narrows below this (masked lanes are free), so every split
# count up to it shares one compiled kernel.
_MIN_BLOCK_S = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


# NOTE: index arrays may be views into one packed upload: their alignment is not specialized.
@triton.jit(do_not_specialize_on_alignment=["Loc"])
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Loc,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    loc = tl.load(Loc + t).to(tl.int64)
    if loc < 0:
        return
    h = tl.arange(0, BLOCK_KV)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV) & (d < HEAD_DIM)
    dst = loc * stride_cs + h * HEAD_DIM + d
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


@triton.jit
def _online_softmax(
    acc, m_i, l_i, q, k, v, keep, qk_scale, MASKED: tl.constexpr, DOT_PREC: tl.constexpr
):
    """Fold keys ``k``/``v`` [BLOCK_N, BLOCK_D] into the running output, max and sum (log2
    domain) of the rows ``q``; with ``MASKED``, keys where ``keep`` [ROWS, BLOCK_N] is False
    are left out.
    """
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [ROWS, BLOCK_N], log2
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _load_kv_tile(
    KCache,
    VCache,
    page_row,
    j,
    j_ok,
    kv_head,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_KV: tl.constexpr,
):
    """The K and V rows of keys ``j`` (``[BLOCK_N, BLOCK_D]``, cache dtype) through the page
    table; with ``MASK_KV``, keys past ``j_ok`` read as zeros."""
    d = tl.arange(0, BLOCK_D)
    if MASK_KV:
        page = tl.load(page_row + j // PAGE_SIZE, mask=j_ok, other=0)
    else:
        page = tl.load(page_row + j // PAGE_SIZE)
    slot = page.to(tl.int64) * PAGE_SIZE + j % PAGE_SIZE
    offs = slot[:, None] * stride_cs + kv_head * HEAD_DIM + d[None, :]
    mask = (d < HEAD_DIM)[None, :]
    if MASK_KV:
        mask = mask & j_ok[:, None]
    k = tl.load(KCache + offs, mask=mask, other=0.0)
    v = tl.load(VCache + offs, mask=mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    KCache,
    VCache,
    page_row,
    n0,
    kv_end,
    causal_lim,
    win_lo,
    kv_head,
    qk_scale,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASK_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One online-softmax step over keys ``n0 .. n0 + BLOCK_N`` read through the page table;
    with ``WINDOW``, each row sees no key below its ``win_lo``.
    """
    j = n0 + tl.arange(0, BLOCK_N)
    j_ok = j < kv_end
    k, v = _load_kv_tile(
        KCache, VCache, page_row, j, j_ok, kv_head, stride_cs, PAGE_SIZE, HEAD_DIM, BLOCK_D, MASK_KV
    )
    k, v = k.to(q.dtype), v.to(q.dtype)  # [BLOCK_N, BLOCK_D]
    keep = j_ok[None, :]
    if CAUSAL:
        keep = keep & (j[None, :] <= causal_lim[:, None])
    if WINDOW:
        keep = keep & (j[None, :] >= win_lo[:, None])
    return _online_softmax(
        acc, m_i, l_i, q, k, v, keep, qk_scale, MASK_KV or CAUSAL or WINDOW, DOT_PREC
    )


@triton.jit
def _attend_tree_tile(
    acc,
    m_i,
    l_i,
    q,
    KCache,
    VCache,
    page_row,
    n0,
    kv_end,
    tree_row,
    tree_lo,
    tree_width,
    stride_mt,
    tok,
    kv_head,
    qk_scale,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``_attend_tile`` under a tree mask: key ``j`` is seen by every row before ``tree_lo``,
    from there by the rows whose mask row (``tree_row + tok * stride_mt``) marks it."""
    j = n0 + tl.arange(0, BLOCK_N)
    j_ok = j < kv_end
    k, v = _load_kv_tile(
        KCache, VCache, page_row, j, j_ok, kv_head, stride_cs, PAGE_SIZE, HEAD_DIM, BLOCK_D, True
    )
    k, v = k.to(q.dtype), v.to(q.dtype)  # [BLOCK_N, BLOCK_D]
    col = j - tree_lo
    in_tree = (col >= 0) & (col < tree_width) & j_ok
    bits = tl.load(
        tree_row + tok[:, None] * stride_mt + col[None, :], mask=in_tree[None, :], other=0
    )
    keep = j_ok[None, :] & ((col < 0)[None, :] | (bits != 0))
    return _online_softmax(acc, m_i, l_i, q, k, v, keep, qk_scale, True, DOT_PREC)


@triton.jit(  # vary per batch, as in extend
    do_not_specialize=["num_splits", "window", "stride_pt", "stride_mb", "stride_mt", "tree_width"],
    do_not_specialize_on_alignment=["PageTable", "SeqLens", "TreeMask"],
)
def _split_kv_kernel(
    Q,
    KCache,
    VCache,
    MidO,
    MidLse,
    PageTable,
    SeqLens,
    TreeMask,
    qk_scale,
    window,
    num_heads,
    num_splits,
    stride_qt,
    stride_qh,
    stride_pt,
    stride_cs,
    stride_mb,
    stride_mt,
    tree_width,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TREE: tl.constexpr,
):
    # One program: the TOKENS last positions x GROUP query heads of one kv head of one
    # request, over one split of its keys (with WINDOW, of those the first token's window
    # holds). Rows are (token, head-in-group) pairs.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    first = seq_len * 0
    if WINDOW:
        first = tl.maximum(seq_len - TOKENS - window + 1, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    rows = tl.arange(0, BLOCK_M)
    t = b.to(tl.int64) * TOKENS + rows // GROUP  # [BLOCK_M] flat token row
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    mask = (rows < TOKENS * GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_offs = t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_offs, mask=mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    page_row = PageTable + b.to(tl.int64) * stride_pt
    causal_lim = seq_len - TOKENS + rows // GROUP
    win_lo = causal_lim - window + 1
    tok = tl.minimum(rows // GROUP, TOKENS - 1)
    tree_row = TreeMask + b.to(tl.int64) * stride_mb
    for n0 in range(lo, hi, BLOCK_N):
        if TREE:
            acc, m_i, l_i = _attend_tree_tile(
                acc,
                m_i,
                l_i,
                q,
                KCache,
                VCache,
                page_row,
                n0,
                hi,
                tree_row,
                seq_len - tree_width,
                tree_width,
                stride_mt,
                tok,
                kv_head,
                qk_scale,
                stride_cs,
                PAGE_SIZE,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                DOT_PREC,
            )
        else:
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
                causal_lim,
                win_lo,
                kv_head,
                qk_scale,
                stride_cs,
                PAGE_SIZE,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_D,
                True,
                TOKENS > 1,
                WINDOW,
                DOT_PREC,
            )
    # NOTE: a row that sees no key of this split stores o = 0, lse = -inf: the reduce weighs it 0.
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    mid = (t * num_heads + head) * num_splits + split  # [BLOCK_M] row of MidO / MidLse
    tl.store(MidO + mid[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
    tl.store(MidLse + mid, lse, mask=rows < TOKENS * GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _split_kv_reduce_kernel(
    MidO,
    MidLse,
    Out,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    mid = (t * num_heads + head) * num_splits + s  # [BLOCK_S]
    lse = tl.load(MidLse + mid, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.maximum(tl.max(lse, 0), -1e30))  # [BLOCK_S]
    mask = (s < num_splits)[:, None] & (d < HEAD_DIM)[None, :]
    o = tl.load(MidO + mid[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        Out + t * stride_ot + head * stride_oh + d, o.to(Out.dtype.element_ty), mask=d < HEAD_DIM
    )


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


# NOTE: the checks run once per pass on the host's critical path: every message is formatted
# on failure only.


def _check_rows(name: str, x: torch.Tensor, cache: torch.Tensor, heads: int | None) -> None:
    """``x`` is ``[rows, heads, D]`` with unit stride along D (a view of a fused qkv is fine)."""
    if not (x.dim() == 3 and x.shape[2] == cache.shape[2] and heads in (None, x.shape[1])):
        raise ValueError(
            f"{name} must be [rows, {heads or 'H'}, {cache.shape[2]}], got {tuple(x.shape)}"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} dtype must be one of {_DTYPES}, got {x.dtype}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have unit stride along the head dim")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")


def _check_index(name: str, x: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    if not (x.dim() == len(shape) and all(n in (None, m) for n, m in zip(shape, x.shape))):
        raise ValueError(f"{name} must have shape {shape} (None = any), got {tuple(x.shape)}")
    if x.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 3:
        raise ValueError(f"k_cache must be [slots, KV, D], got {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, "v_cache shape must equal k_cache shape")
    if k_cache.dtype not in _DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"caches must share a dtype in {_DTYPES}, got {k_cache.dtype}/{v_cache.dtype}"
        )
    _require(k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous")


def _check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    _check_cache(k_cache, v_cache)
    _check_rows("q", q, k_cache, None)
    _check_rows("out", out, k_cache, q.shape[1])
    _require(out.shape == q.shape and out.dtype == q.dtype, "out must match q in shape and dtype")
    num_heads, num_kv = q.shape[1], k_cache.shape[1]
    if num_heads % num_kv:
        raise ValueError(f"query heads {num_heads} must be a multiple of kv heads {num_kv}")
    if k_cache.shape[2] > 256:
        raise ValueError(f"head dim {k_cache.shape[2]} > 256 is not supported")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    _check_index("seq_lens", seq_lens, (None,))
    _check_index("page_table", page_table, (len(seq_lens), None))


def _check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_kv_splits: int,
    tokens_per_seq: int,
    workspace: tuple[torch.Tensor, torch.Tensor],
) -> None:
    _check_attention(q, k_cache, v_cache, out, page_table, seq_lens, page_size)
    num_rows, num_heads, head_dim = q.shape
    if tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be >= 1, got {tokens_per_seq}")
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if num_rows != len(seq_lens) * tokens_per_seq:
        raise ValueError(f"q must have {len(seq_lens)} x {tokens_per_seq} rows, got {num_rows}")
    mid_o, mid_lse = workspace
    ok = mid_o.shape[0] >= num_rows and mid_o.shape[1:] == (num_heads, num_kv_splits, head_dim)
    ok &= mid_lse.shape == mid_o.shape[:3] and mid_o.is_contiguous() and mid_lse.is_contiguous()
    ok &= mid_o.dtype == mid_lse.dtype == torch.float32
    if not ok:
        raise ValueError(
            f"workspace must be decode_workspace(>={num_rows}, {num_heads}, "
            f"{head_dim}, {num_kv_splits})"
        )


def _check_window(window: int | None) -> None:
    if window is not None and not (type(window) is int and window >= 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


def _check_tree_mask(mask: torch.Tensor, b: int, n: int, device: torch.device) -> None:
    ok = mask.dim() == 3 and tuple(mask.shape[:2]) == (b, n) and mask.dtype == torch.bool
    if not (ok and mask.stride(2) == 1 and mask.device == device):
        raise ValueError(
            f"tree_mask must be [{b}, {n}, M] bool on {device} with unit stride along M, got "
            f"{list(mask.shape)} {mask.dtype} on {mask.device}"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # NOTE: fp32 inputs would otherwise run on tf32 tensor cores, ~1e-3 off the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def store_kv(
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    k_cache: torch.Tensor,  # [slots, KV, D]
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,  # [T] slot per token, -1 = write nothing
    *,
    check: bool = True,
) -> None:
    """Scatter the new tokens' K/V into the cache, skipping rows whose slot is -1.
    ``check=False`` skips the argument checks (a caller that already checked this pass).
    """
    num_kv, head_dim = k_cache.shape[1:]
    if check:
        _check_cache(k_cache, v_cache)
        _check_rows("k", k, k_cache, num_kv)
        _check_rows("v", v, k_cache, num_kv)
        _require(v.shape == k.shape, "k and v must have the same shape")
        _check_index("out_cache_loc", out_cache_loc, (k.shape[0],))
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        out_cache_loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        NUM_KV=num_kv,
        HEAD_DIM=head_dim,
        BLOCK_KV=triton.next_power_of_2(num_kv),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def decode_workspace(
    num_rows: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs ``[rows, H, S, D]`` and their log2-sum-exp ``[rows, H, S]``."""
    shape = (num_rows, num_heads, num_kv_splits)
    mid_o = torch.empty(*shape, head_dim, dtype=torch.float32, device=device)
    return mid_o, torch.empty(shape, dtype=torch.float32, device=device)


def decode_attention(
    q: torch.Tensor,  # [B * N, H, D], the last N positions of each request
    k_cache: torch.Tensor,  # [slots, KV, D], already holding this pass's new tokens
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [B * N, H, D]
    page_table: torch.Tensor,  # [B, max_pages]
    seq_lens: torch.Tensor,  # [B]
    page_size: int,
    scale: float,
    num_kv_splits: int,
    *,
    tokens_per_seq: int = 1,
    window: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    tree_mask: torch.Tensor | None = None,  # [B, tokens_per_seq, M] bool
    block_n: int = 64,
    check: bool = True,
) -> None:
    """Flash-decoding: each request's keys are cut into ``num_kv_splits`` pieces attended in
    parallel (per kv head, all its query heads at once), then merged by their softmax mass.
    ``tokens_per_seq`` > 1 (TARGET_VERIFY: k+1) attends that many last positions causally, or
    with ``tree_mask`` as a draft tree: query i sees the keys before the last M and, of those,
    key m iff ``tree_mask[b, i, m]``. A sliding ``window`` (not with a tree) lets position
    ``p`` see keys ``p - window < j <= p`` only.
    """
    num_rows, num_heads, head_dim = q.shape
    if workspace is None:
        workspace = decode_workspace(num_rows, num_heads, head_dim, num_kv_splits, q.device)
    mid_o, mid_lse = workspace
    if check:
        _check_decode(
            q,
            k_cache,
            v_cache,
            out,
            page_table,
            seq_lens,
            page_size,
            num_kv_splits,
            tokens_per_seq,
            workspace,
        )
        _check_window(window)
        if tree_mask is not None:
            _check_tree_mask(tree_mask, len(seq_lens), tokens_per_seq, q.device)
            _require(window is None, "a tree_mask cannot be combined with a sliding window")
    if num_rows == 0:
        return
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    tree = tree_mask is not None
    bits = tree_mask.view(torch.uint8) if tree else seq_lens  # NOTE: never read without a tree
    block_d = max(16, triton.next_power_of_2(head_dim))
    _split_kv_kernel[(len(seq_lens), num_kv, num_kv_splits)](
        q,
        k_cache,
        v_cache,
        mid_o,
        mid_lse,
        page_table,
        seq_lens,
        bits,
        scale * _LOG2E,
        window or 0,
        num_heads,
        num_kv_splits,
        q.stride(0),
        q.stride(1),
        page_table.stride(0),
        k_cache.stride(0),
        bits.stride(0) if tree else 0,
        bits.stride(1) if tree else 0,
        bits.shape[2] if tree else 0,
        PAGE_SIZE=page_size,
        GROUP=group,
        TOKENS=tokens_per_seq,
        HEAD_DIM=head_dim,
        BLOCK_M=max(16, triton.next_power_of_2(tokens_per_seq * group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        WINDOW=window is not None,
        DOT_PREC=_dot_precision(q.dtype),
        TREE=tree,
        num_warps=4,
        num_stages=2,
    )
    _split_kv_reduce_kernel[(num_rows, num_heads)](
        mid_o,
        mid_lse,
        out,
        num_heads,
        num_kv_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(_MIN_BLOCK_S, triton.next_power_of_2(num_kv_splits)),
        BLOCK_D=block_d,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    keep = out_cache_loc >= 0
    k_cache[out_cache_loc[keep]] = k[keep].to(k_cache.dtype)
    v_cache[out_cache_loc[keep]] = v[keep].to(v_cache.dtype)


def _attend_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    seq_len: int,
    page_size: int,
    scale: float,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The last ``len(q)`` positions of one sequence of ``seq_len`` attending causally (within
    ``window`` keys, themselves included), or under ``tree_mask`` [len(q), M]
    (``decode_attention``)."""
    pos = torch.arange(seq_len, device=q.device)
    slots = pages.long()[pos // page_size] * page_size + pos % page_size
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(group, 1)  # [S, H, D]
    v = v_cache[slots].float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = pos[seq_len - len(q) :]
    if tree_mask is None:
        hidden = pos[None, :] > q_pos[:, None]  # [L, S]
    else:
        hidden = torch.zeros(len(q), seq_len, dtype=torch.bool, device=q.device)
        hidden[:, seq_len - tree_mask.shape[1] :] = ~tree_mask
    if window is not None:
        hidden |= pos[None, :] <= q_pos[:, None] - window
    scores.masked_fill_(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [L, H, D]


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    scale: float,
    tokens_per_seq: int = 1,
    window: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> None:
    n = tokens_per_seq
    for b, seq in enumerate(seq_lens.tolist()):
        rows = slice(b * n, (b + 1) * n)
        mask = None if tree_mask is None else tree_mask[b]
        out[rows] = _attend_ref(
            q[rows], k_cache, v_cache, page_table[b], seq, page_size, scale, window, mask
        )
