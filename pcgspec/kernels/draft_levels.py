"""The inputs of a propose phase's draft levels after its catch-up, for every level at once, in
one launch (``speculative.draft_runner.DraftLevels``).

Request b's catch-up ends at row ``rows[b]`` (its last real row) at position ``p``; a request
of ``seq_len`` 0 is padding (its row may be -1). Its drafts start at ``start = p + 1``
(padding: 0). Level ``d`` (0-based, of ``L``) holds ``topk`` beams at position ``start + d``,
writing their K/V to the slots of positions ``start + d * topk ..`` (padding: slot -1), and its
sequence ends after them (``start + (d + 1) * topk``; padding: 0). Every level shares
``extend_lens`` (topk each) and ``logits_indices`` (every row).

Each output row of ``[L, ...]`` starts 16 bytes apart, as a tensor of its own would: the
attention kernels specialize pointers on that alignment. Eager torch took about twenty small
kernels for the same.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pcgspec.attention.kv_cache import page_slots
from pcgspec.kernels.launches import CompiledLaunches


class LevelInputs(NamedTuple):
    """Per level (rows): ``out_cache_loc``, ``positions`` [L, B * topk] int64, ``seq_lens``
    [L, B] int32; shared: ``extend_lens`` [B] int32 (topk), ``logits_indices`` [B * topk]."""

    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    logits_indices: torch.Tensor


@triton.jit(
    do_not_specialize=[
        "stride_table",
        "stride_rows",
        "stride_lens",
        "page_size",
        "topk",
    ],
    do_not_specialize_on_alignment=[
        "Positions",
        "Rows",
        "SeqLens",
        "PageTable",
        "OutCacheLoc",
        "OutPositions",
        "OutSeqLens",
        "OutExtendLens",
        "OutLogitsIndices",
    ],
)
def _draft_levels_kernel(
    Positions,
    Rows,
    SeqLens,
    PageTable,
    OutCacheLoc,
    OutPositions,
    OutSeqLens,
    OutExtendLens,
    OutLogitsIndices,
    stride_table,
    stride_rows,
    stride_lens,
    page_size,
    topk,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    level = tl.program_id(1).to(tl.int64)
    valid = tl.load(SeqLens + b) > 0
    last = tl.load(Rows + b)
    # NOTE: a padding request's last row may be -1 (no real rows): not read
    start = tl.where(valid, tl.load(Positions + last, mask=valid, other=-1) + 1, 0).to(tl.int64)
    r = tl.arange(0, BLOCK_K)
    beams = r < topk
    pos = start + level * topk + r
    page = tl.load(PageTable + b * stride_table + pos // page_size, mask=beams, other=0)
    slot = tl.where(valid, page.to(tl.int64) * page_size + pos % page_size, -1)
    row = level * stride_rows + b * topk + r
    tl.store(OutCacheLoc + row, slot, mask=beams)
    tl.store(OutPositions + row, start + level + r * 0, mask=beams)
    seq_len = tl.where(valid, start + (level + 1) * topk, 0)
    tl.store(OutSeqLens + level * stride_lens + b, seq_len.to(tl.int32))
    if level == 0:
        tl.store(OutExtendLens + b, topk.to(tl.int32))
        tl.store(OutLogitsIndices + b * topk + r, b * topk + r, mask=beams)


_LEVELS = CompiledLaunches(_draft_levels_kernel)


def _aligned(levels: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[levels, n]`` as a view whose rows start 16 bytes apart."""
    per = 16 // torch.empty((), dtype=dtype).element_size()
    return torch.empty(levels, -(-n // per) * per, dtype=dtype, device=device)[:, :n]


def _outputs(levels: int, b: int, topk: int, device: torch.device) -> LevelInputs:
    n = b * topk
    return LevelInputs(
        _aligned(levels, n, torch.int64, device),
        _aligned(levels, n, torch.int64, device),
        _aligned(levels, b, torch.int32, device),
        torch.empty(b, dtype=torch.int32, device=device),
        torch.empty(n, dtype=torch.int64, device=device),
    )


def _check(positions: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, table) -> int:
    b = rows.shape[0]
    wants = {
        "positions": (positions, 1, torch.int64),
        "rows": (rows, 1, torch.int64),
        "seq_lens": (seq_lens, 1, torch.int32),
        "page_table": (table, 2, torch.int32),
    }
    for name, (t, dims, dtype) in wants.items():
        if t.dim() != dims or t.dtype != dtype:
            raise ValueError(f"{name} must be {dims}-D {dtype}, got {list(t.shape)} {t.dtype}")
    if seq_lens.shape[0] != b or table.shape[0] != b:
        raise ValueError(
            f"rows, seq_lens and page_table must have one row per request, got {b}, "
            f"{seq_lens.shape[0]} and {table.shape[0]}"
        )
    return b


def draft_levels(
    positions: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    num_levels: int,
    topk: int,
) -> LevelInputs:
    """The ``num_levels`` levels' inputs after a catch-up of ``positions`` [T] int64 whose
    requests' last rows are ``rows`` [B] int64, of ``seq_lens`` [B] int32 (0: padding), pages
    ``page_table`` [B, P] int32. One launch."""
    b = _check(positions, rows, seq_lens, page_table)
    if b == 0 or num_levels == 0:  # NOTE: no level rows to write: the reference fills the rest
        return draft_levels_ref(positions, rows, seq_lens, page_table, page_size, num_levels, topk)
    out = _outputs(num_levels, b, topk, positions.device)
    tensors = (positions, rows, seq_lens, page_table, *out)
    scalars = (
        page_table.stride(0),
        out.out_cache_loc.stride(0),
        out.seq_lens.stride(0),
        page_size,
        topk,
    )
    if page_table.stride(1) != 1 or any(t.stride(-1) != 1 for t in tensors[:3]):
        raise ValueError("positions, rows, seq_lens and page_table rows must be contiguous")
    block = triton.next_power_of_2(topk)
    _LEVELS((b, num_levels, 1), tensors, scalars, {"BLOCK_K": block})
    return out


def draft_levels_ref(
    positions: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    num_levels: int,
    topk: int,
) -> LevelInputs:
    """``draft_levels`` in torch."""
    b = _check(positions, rows, seq_lens, page_table)
    device = positions.device
    valid = seq_lens > 0
    start = torch.where(valid, positions[rows.clamp_min(0)] + 1, 0)
    level = torch.arange(num_levels, device=device)[:, None]  # [L, 1]
    beams = start[:, None] + torch.arange(num_levels * topk, device=device)  # [B, L * topk]
    slots = torch.where(valid[:, None], page_slots(page_table, beams, page_size), -1)
    out = _outputs(num_levels, b, topk, device)
    out.out_cache_loc.copy_(
        slots.view(b, num_levels, topk).transpose(0, 1).reshape(num_levels, b * topk)
    )
    out.positions.copy_((start + level).repeat_interleave(topk, dim=1))
    out.seq_lens.copy_(torch.where(valid, start + (level + 1) * topk, 0))
    out.extend_lens.fill_(topk)
    out.logits_indices.copy_(torch.arange(b * topk, device=device))
    return out
