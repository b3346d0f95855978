"""The metadata of a padded batch of k+1 rows per request, in one launch (a speculative step's
verify pass and its draft catch-up).

Request ``b`` of such a batch has rows ``j = 0..k`` at positions ``starts[b] + j``; its KV slots
come from its page-table row, and a catch-up's rows from ``num_valid[b]`` on write no KV (slot
-1). As torch ops that is a dozen small launches per pass, all before the GPU has work: a
speculative step at a small batch is host-bound, so they are one kernel here.
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


# NOTE: the inputs may be views into a packed upload, the outputs are views into two buffers
# at offsets that follow the batch size: no alignment or value specialization, so nothing
# compiles at serving.
@triton.jit(
    do_not_specialize=["table_stride", "num_pages", "page_size"],
    do_not_specialize_on_alignment=["Starts", "NumValid", "PageTable", "Positions", "Loc",
                                    "AllRows", "LastRows", "SeqLens", "ExtendLens",
                                    "ExtendStart"],
)
def _padded_rows_kernel(
    Starts, NumValid, PageTable, Positions, Loc, AllRows, LastRows, SeqLens, ExtendLens,
    ExtendStart, table_stride, num_pages, page_size,
    K1: tl.constexpr, BLOCK: tl.constexpr, HAS_VALID: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_row = j < K1
    start = tl.load(Starts + b).to(tl.int64)
    pos = start + j
    page_index = pos // page_size
    page = tl.load(PageTable + b * table_stride + page_index,
                   mask=in_row & (page_index < num_pages), other=0)  # fmt: skip
    loc = page.to(tl.int64) * page_size + pos % page_size
    loc = tl.where(page_index < num_pages, loc, -1)  # past the table: no page, no KV write
    num = K1
    if HAS_VALID:
        num = tl.load(NumValid + b).to(tl.int64)
        loc = tl.where(j < num, loc, -1)
    row = b * K1 + j
    tl.store(Positions + row, pos, mask=in_row)
    tl.store(Loc + row, loc, mask=in_row)
    tl.store(AllRows + row, row, mask=in_row)
    tl.store(LastRows + b, b * K1 + num - 1)
    tl.store(SeqLens + b, (start + K1).to(tl.int32))
    tl.store(ExtendLens + b, tl.full([], K1, tl.int32))
    tl.store(ExtendStart + b, (b * K1).to(tl.int32))


_PADDED_ROWS = CompiledLaunches(_padded_rows_kernel)


def _check(starts: torch.Tensor, page_table: torch.Tensor, num_valid: torch.Tensor | None
           ) -> None:  # fmt: skip
    tables = (starts,) if num_valid is None else (starts, num_valid)
    if any(t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous() for t in tables):
        raise ValueError("starts and num_valid must be contiguous [B] int64")
    if num_valid is not None and num_valid.shape != starts.shape:
        raise ValueError(f"num_valid has {len(num_valid)} requests, starts {len(starts)}")
    if (page_table.dim() != 2 or page_table.shape[0] != len(starts)
            or page_table.stride(1) != 1 or page_table.dtype != torch.int32):  # fmt: skip
        raise ValueError(f"page_table must be [{len(starts)}, P] int32 with unit column stride")


def _allocate(b: int, k1: int, device: torch.device) -> PaddedRows:
    n = b * k1
    wide = torch.empty(3 * n + b, dtype=torch.int64, device=device)
    narrow = torch.empty(3 * b, dtype=torch.int32, device=device)
    return PaddedRows(wide[:n], wide[n : 2 * n], narrow[:b], narrow[b : 2 * b], narrow[2 * b :],
                      wide[2 * n : 3 * n], wide[3 * n :])  # fmt: skip


def padded_rows(
    starts: torch.Tensor,  # [B] int64: the position of each request's first row
    page_table: torch.Tensor,  # [B, P] int32
    page_size: int,
    k1: int,  # rows per request
    num_valid: torch.Tensor | None = None,  # [B] int64: rows that write KV (None: all)
) -> PaddedRows:
    """The rows' positions, KV slots, lengths and row indices: one launch."""
    _check(starts, page_table, num_valid)
    b = len(starts)
    out = _allocate(b, k1, starts.device)
    if b == 0:
        return out
    has_valid = num_valid is not None
    tensors = (starts, num_valid if has_valid else starts, page_table, out.positions,
               out.out_cache_loc, out.all_rows, out.last_rows, out.seq_lens, out.extend_lens,
               out.extend_start)  # fmt: skip
    scalars = (page_table.stride(0), page_table.shape[1], page_size)
    block = triton.next_power_of_2(k1)
    constants = {"K1": k1, "BLOCK": block, "HAS_VALID": has_valid}
    _PADDED_ROWS((b, 1, 1), tensors, scalars, constants, key=(k1, block, has_valid))
    return out


def padded_rows_ref(
    starts: torch.Tensor, page_table: torch.Tensor, page_size: int, k1: int,
    num_valid: torch.Tensor | None = None,
) -> PaddedRows:  # fmt: skip
    """``padded_rows`` in torch ops (off CUDA, and the tests' reference)."""
    _check(starts, page_table, num_valid)
    b, device = len(starts), starts.device
    steps = torch.arange(k1, device=device)
    positions = starts[:, None] + steps  # [B, k+1]
    pages = page_table.gather(1, positions // page_size)
    slots = pages.to(torch.int64) * page_size + positions % page_size
    num = torch.full_like(starts, k1) if num_valid is None else num_valid
    slots = torch.where(steps < num[:, None], slots, -1)
    first = torch.arange(0, b * k1, k1, device=device)
    return PaddedRows(
        positions.view(-1), slots.view(-1), (starts + k1).to(torch.int32),
        torch.full((b,), k1, dtype=torch.int32, device=device), first.to(torch.int32),
        torch.arange(b * k1, device=device), first + num - 1,
    )  # fmt: skip
