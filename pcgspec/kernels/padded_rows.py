"""The metadata of a padded batch of k+1 rows per request, in one launch (a speculative step's
verify pass and its draft catch-up).

Request ``b`` of such a batch has rows ``j = 0..k`` at positions ``starts[b] + j``; its KV slots
come from its page-table row, and a catch-up's rows from ``num_valid[b]`` on write no KV (slot
-1). As torch ops that is a dozen small launches per pass, all before the GPU has work: a
speculative step at a small batch is host-bound, so they are one kernel here. A verify pass's
input ids (each request's last token, then its drafts) come from the same launch, and where a
verify graph will replay the pass, its rows go straight into the graph's static buffers
(``padded_rows_into``), padding requests included, so the replay copies only the page table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches


@dataclass(frozen=True)
class PaddedRows:
    positions: torch.Tensor  # [B * (k+1)] int64
    out_cache_loc: torch.Tensor  # [B * (k+1)] int64, -1 from num_valid on
    seq_lens: torch.Tensor  # [B] int32: starts + k+1
    extend_lens: torch.Tensor  # [B] int32: k+1
    extend_start: torch.Tensor  # [B] int32: b * (k+1)
    all_rows: torch.Tensor  # [B * (k+1)] int64: 0 .. B * (k+1) - 1
    last_rows: torch.Tensor  # [B] int64: each request's last valid row
    input_ids: torch.Tensor | None = None  # [B * (k+1)] int64, with ``tokens``


@dataclass(frozen=True)
class VerifyTokens:
    """A verify pass's input ids: request ``b``'s rows are ``[last[slots[b]], drafts[b]]``."""

    last: torch.Tensor  # [S] int64: each slot's last token (``SamplingSlots.last_token``)
    slots: torch.Tensor  # [B] int64
    drafts: torch.Tensor  # [B, k] int64, unit column stride


@dataclass(frozen=True)
class GraphRows:
    """Where a graph bucket of ``bs`` requests reads a pass's rows (its static buffers)."""

    input_ids: torch.Tensor  # [bs * (k+1)] int64
    positions: torch.Tensor  # [bs * (k+1)] int64
    out_cache_loc: torch.Tensor  # [bs * (k+1)] int64
    seq_lens: torch.Tensor  # [bs] int32
    extend_lens: torch.Tensor  # [bs] int32, all k+1 (never written here)
    all_rows: torch.Tensor  # [bs * (k+1)] int64, arange (never written here)


_POINTERS = [
    "Starts",
    "NumValid",
    "PageTable",
    "Positions",
    "Loc",
    "AllRows",
    "LastRows",
    "SeqLens",
    "ExtendLens",
    "ExtendStart",
    "Last",
    "Slots",
    "Drafts",
    "InputIds",
]


# NOTE: the inputs may be views into a packed upload, the outputs are views into two buffers
# at offsets that follow the batch size: no alignment or value specialization, so nothing
# compiles at serving.
@triton.jit(
    do_not_specialize=[
        "table_stride",
        "num_pages",
        "page_size",
        "start_offset",
        "num_requests",
        "draft_stride",
    ],
    do_not_specialize_on_alignment=_POINTERS,
)
def _padded_rows_kernel(
    Starts,
    NumValid,
    PageTable,
    Positions,
    Loc,
    AllRows,
    LastRows,
    SeqLens,
    ExtendLens,
    ExtendStart,
    Last,
    Slots,
    Drafts,
    InputIds,
    table_stride,
    num_pages,
    page_size,
    start_offset,
    num_requests,
    draft_stride,
    K1: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_IDS: tl.constexpr,
    HAS_META: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_row = j < K1
    row = b * K1 + j
    if b >= num_requests:  # a graph bucket's padding request: no KV written, none read
        tl.store(Loc + row, tl.full([BLOCK], -1, tl.int64), mask=in_row)
        tl.store(SeqLens + b, tl.full([], 0, tl.int32))
        return
    start = tl.load(Starts + b).to(tl.int64) + start_offset
    pos = start + j
    page_index = pos // page_size
    page = tl.load(
        PageTable + b * table_stride + page_index, mask=in_row & (page_index < num_pages), other=0
    )
    loc = page.to(tl.int64) * page_size + pos % page_size
    loc = tl.where(page_index < num_pages, loc, -1)  # past the table: no page, no KV write
    num = K1
    if HAS_VALID:
        num = tl.load(NumValid + b).to(tl.int64)
        loc = tl.where(j < num, loc, -1)
    tl.store(Positions + row, pos, mask=in_row)
    tl.store(Loc + row, loc, mask=in_row)
    tl.store(SeqLens + b, (start + K1).to(tl.int32))
    if HAS_IDS:
        first = tl.load(Last + tl.load(Slots + b))
        draft = tl.load(Drafts + b * draft_stride + j - 1, mask=in_row & (j > 0), other=0)
        tl.store(InputIds + row, tl.where(j == 0, first, draft), mask=in_row)
    if HAS_META:
        tl.store(AllRows + row, row, mask=in_row)
        tl.store(LastRows + b, b * K1 + num - 1)
        tl.store(ExtendLens + b, tl.full([], K1, tl.int32))
        tl.store(ExtendStart + b, (b * K1).to(tl.int32))


_PADDED_ROWS = CompiledLaunches(_padded_rows_kernel)


def _check(
    starts: torch.Tensor,
    page_table: torch.Tensor,
    num_valid: torch.Tensor | None,
    tokens: VerifyTokens | None = None,
    k1: int = 1,
) -> None:
    tables = (starts,) if num_valid is None else (starts, num_valid)
    if any(t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous() for t in tables):
        raise ValueError("starts and num_valid must be contiguous [B] int64")
    if num_valid is not None and num_valid.shape != starts.shape:
        raise ValueError(f"num_valid has {len(num_valid)} requests, starts {len(starts)}")
    if (
        page_table.dim() != 2
        or page_table.shape[0] != len(starts)
        or page_table.stride(1) != 1
        or page_table.dtype != torch.int32
    ):
        raise ValueError(f"page_table must be [{len(starts)}, P] int32 with unit column stride")
    if tokens is None:
        return
    b, t = len(starts), tokens
    ok = (
        t.last.dim() == 1
        and t.last.dtype == torch.int64
        and t.slots.shape == (b,)
        and t.slots.dtype == torch.int64
        and t.slots.is_contiguous()
        and t.drafts.shape == (b, k1 - 1)
        and t.drafts.dtype == torch.int64
        and (t.drafts.stride(1) == 1 or k1 == 2)
    )
    if not ok:
        raise ValueError(
            f"tokens must be last [S] int64, slots [{b}] int64 and drafts "
            f"[{b}, {k1 - 1}] int64 with unit column stride"
        )


def _allocate(b: int, k1: int, device: torch.device, ids: bool) -> PaddedRows:
    n = b * k1
    wide = torch.empty((4 if ids else 3) * n + b, dtype=torch.int64, device=device)
    narrow = torch.empty(3 * b, dtype=torch.int32, device=device)
    return PaddedRows(
        wide[:n],
        wide[n : 2 * n],
        narrow[:b],
        narrow[b : 2 * b],
        narrow[2 * b :],
        wide[2 * n : 3 * n],
        wide[3 * n : 3 * n + b],
        wide[3 * n + b :] if ids else None,
    )


def padded_rows(
    starts: torch.Tensor,  # [B] int64: the position of each request's first row, less the offset
    page_table: torch.Tensor,  # [B, P] int32
    page_size: int,
    k1: int,  # rows per request
    num_valid: torch.Tensor | None = None,  # [B] int64: rows that write KV (None: all)
    *,
    start_offset: int = 0,  # added to every start
    tokens: VerifyTokens | None = None,  # the rows' input ids, of a verify pass
) -> PaddedRows:
    """The rows' positions, KV slots, lengths, row indices and (with ``tokens``) input ids:
    one launch.
    """
    _check(starts, page_table, num_valid, tokens, k1)
    b = len(starts)
    out = _allocate(b, k1, starts.device, tokens is not None)
    if b:
        _launch(
            b,
            b,
            starts,
            page_table,
            page_size,
            k1,
            num_valid,
            start_offset,
            tokens,
            out.positions,
            out.out_cache_loc,
            out.seq_lens,
            out.input_ids,
            out,
        )
    return out


def padded_rows_into(
    rows: GraphRows,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k1: int,
    *,
    start_offset: int = 0,
    tokens: VerifyTokens,
) -> None:
    """A verify pass's rows (``padded_rows`` with ``tokens``) written straight into a graph
    bucket's static buffers ``rows``: its requests past ``len(starts)`` become padding (slots
    -1, length 0), so the replay copies nothing but the page table.
    """
    _check(starts, page_table, None, tokens, k1)
    bucket = rows.seq_lens.shape[0]
    if len(starts) > bucket or any(
        t.shape[0] != bucket * k1 for t in (rows.input_ids, rows.positions, rows.out_cache_loc)
    ):
        raise ValueError(f"rows must hold a bucket of >= {len(starts)} requests of {k1} rows")
    _launch(
        bucket,
        len(starts),
        starts,
        page_table,
        page_size,
        k1,
        None,
        start_offset,
        tokens,
        rows.positions,
        rows.out_cache_loc,
        rows.seq_lens,
        rows.input_ids,
        None,
    )


def _launch(
    grid: int,
    num_requests: int,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k1: int,
    num_valid: torch.Tensor | None,
    start_offset: int,
    tokens: VerifyTokens | None,
    positions: torch.Tensor,
    loc: torch.Tensor,
    seq_lens: torch.Tensor,
    input_ids: torch.Tensor | None,
    meta: PaddedRows | None,
) -> None:
    has_valid, has_ids, has_meta = num_valid is not None, tokens is not None, meta is not None
    unused = starts  # stands in for absent pointers; never read
    tensors = (
        starts,
        num_valid if has_valid else unused,
        page_table,
        positions,
        loc,
        meta.all_rows if has_meta else unused,
        meta.last_rows if has_meta else unused,
        seq_lens,
        meta.extend_lens if has_meta else seq_lens,
        meta.extend_start if has_meta else seq_lens,
        *((tokens.last, tokens.slots, tokens.drafts, input_ids) if has_ids else (unused,) * 4),
    )
    scalars = (
        page_table.stride(0),
        page_table.shape[1],
        page_size,
        start_offset,
        num_requests,
        tokens.drafts.stride(0) if has_ids else 0,
    )
    constants = {
        "K1": k1,
        "BLOCK": triton.next_power_of_2(k1),
        "HAS_VALID": has_valid,
        "HAS_IDS": has_ids,
        "HAS_META": has_meta,
    }
    _PADDED_ROWS((grid, 1, 1), tensors, scalars, constants)


def padded_rows_ref(
    starts: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k1: int,
    num_valid: torch.Tensor | None = None,
    *,
    start_offset: int = 0,
    tokens: VerifyTokens | None = None,
) -> PaddedRows:
    """``padded_rows`` in torch ops (off CUDA, and the tests' reference)."""
    _check(starts, page_table, num_valid, tokens, k1)
    b, device = len(starts), starts.device
    starts = starts + start_offset
    steps = torch.arange(k1, device=device)
    positions = starts[:, None] + steps  # [B, k+1]
    pages = page_table.gather(1, (positions // page_size).clamp_max(page_table.shape[1] - 1))
    slots = pages.to(torch.int64) * page_size + positions % page_size
    slots = torch.where(positions // page_size < page_table.shape[1], slots, -1)
    num = torch.full_like(starts, k1) if num_valid is None else num_valid
    slots = torch.where(steps < num[:, None], slots, -1)
    first = torch.arange(0, b * k1, k1, device=device)
    ids = None
    if tokens is not None:
        ids = torch.cat([tokens.last[tokens.slots][:, None], tokens.drafts], 1).view(-1)
    return PaddedRows(
        positions.view(-1),
        slots.view(-1),
        (starts + k1).to(torch.int32),
        torch.full((b,), k1, dtype=torch.int32, device=device),
        first.to(torch.int32),
        torch.arange(b * k1, device=device),
        first + num - 1,
        ids,
    )


def padded_rows_into_ref(
    rows: GraphRows,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    k1: int,
    *,
    start_offset: int = 0,
    tokens: VerifyTokens,
) -> None:
    """``padded_rows_into`` in torch ops."""
    b, n = len(starts), len(starts) * k1
    built = padded_rows_ref(
        starts, page_table, page_size, k1, start_offset=start_offset, tokens=tokens
    )
    for dst, src in (
        (rows.input_ids, built.input_ids),
        (rows.positions, built.positions),
        (rows.out_cache_loc, built.out_cache_loc),
        (rows.seq_lens, built.seq_lens),
    ):
        dst[: src.shape[0]].copy_(src)
    rows.out_cache_loc[n:].fill_(-1)
    rows.seq_lens[b:].zero_()
