"""Padding a batch into a graph runner's static buffers, in one launch (piecewise prefill,
extend graphs, decode / verify graphs).

Before a piecewise replay the token ids, positions and KV slots of a batch go into the static
buffers the graphs were captured with, padded to the bucket (slot -1: no KV write), and the
extend kernel needs each request's first row (the exclusive cumsum of ``extend_lens``). As
torch ops that is five or six small launches before the GPU has any work; a short prefill is
host-bound, so they are one kernel here. Padded ids and positions are left as they are.

An extend graph also pads the requests (``PaddedRequests``): a graph of ``R`` requests sees the
batch's ``B``, then one padding request that owns the padded rows (as many new tokens as padded
rows and no prefix: it attends over its own rows only, so every row of the graph gets a finite
output and the kernel's grid need not know the real token count), then empty requests (no new
token, no prefix) up to ``R``. The same launch copies the batch's page table into the graph's
and its sampled rows into the graph's row list (as two ``copy_`` they were two more launches
before the graph's, on a short prefill's critical path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches

_BLOCK = 1024  # tokens per program; also requests per scan step


# NOTE: the sizes, and the alignment of the inputs (views into one packed upload), change from
# batch to batch: not specialized, so nothing compiles at serving.
@triton.jit(
    do_not_specialize=[
        "num_tokens",
        "num_rows",
        "num_reqs",
        "num_out_reqs",
        "table_cols",
        "table_stride",
        "out_table_stride",
        "num_sampled",
    ],
    do_not_specialize_on_alignment=[
        "InputIds",
        "Positions",
        "Loc",
        "ExtendLens",
        "SeqLens",
        "PageTable",
        "Sampled",
    ],
)
def _pad_batch_kernel(
    InputIds,
    Positions,
    Loc,
    ExtendLens,
    OutIds,
    OutPositions,
    OutLoc,
    OutStart,
    SeqLens,
    OutSeqLens,
    OutExtendLens,
    PageTable,
    OutPageTable,
    Sampled,
    OutSampled,
    num_tokens,
    num_rows,
    num_reqs,
    num_out_reqs,
    table_cols,
    table_stride,
    out_table_stride,
    num_sampled,
    BLOCK: tl.constexpr,
    HAS_START: tl.constexpr,
    PAD_REQS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if PAD_REQS:  # the page table's [B, P] entries, a block per program; the sampled rows
        entry = offs.to(tl.int64)
        in_table = entry < num_reqs * table_cols
        cols = tl.maximum(table_cols, 1)  # NOTE: no division by zero for a table of no pages
        req, col = entry // cols, entry % cols
        page = tl.load(PageTable + req * table_stride + col, mask=in_table)
        tl.store(OutPageTable + req * out_table_stride + col, page, mask=in_table)
        if pid == 0:
            for r0 in range(0, num_sampled, BLOCK):
                r = r0 + tl.arange(0, BLOCK)
                row = tl.load(Sampled + r, mask=r < num_sampled)
                tl.store(OutSampled + r, row, mask=r < num_sampled)
    real = offs < num_tokens
    tl.store(OutIds + offs, tl.load(InputIds + offs, mask=real), mask=real)
    tl.store(OutPositions + offs, tl.load(Positions + offs, mask=real), mask=real)
    loc = tl.load(Loc + offs, mask=real, other=-1)
    tl.store(OutLoc + offs, loc, mask=offs < num_rows)
    if HAS_START and pid == 0:  # the exclusive cumsum of extend_lens, BLOCK requests at a time
        carry = tl.zeros([], dtype=tl.int32)
        for r0 in range(0, num_out_reqs, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            real = r < num_reqs
            lens = tl.load(ExtendLens + r, mask=real, other=0).to(tl.int32)
            if PAD_REQS:  # request num_reqs owns the padded rows; those after it are empty
                pad = tl.where(r == num_reqs, num_rows - num_tokens, 0).to(tl.int32)
                seq = tl.load(SeqLens + r, mask=real, other=0).to(tl.int32)
                lens = tl.where(real, lens, pad)
                tl.store(OutExtendLens + r, lens, mask=r < num_out_reqs)
                tl.store(OutSeqLens + r, tl.where(real, seq, pad), mask=r < num_out_reqs)
            inclusive = tl.cumsum(lens, 0)
            tl.store(OutStart + r, carry + inclusive - lens, mask=r < num_out_reqs)
            carry += tl.sum(lens, 0)


_PAD_BATCH = CompiledLaunches(_pad_batch_kernel)


@dataclass(frozen=True)
class PaddedRequests:
    """An extend graph's per-request buffers: the batch's ``B`` requests, the padding request,
    then empty ones up to ``R`` (module docstring).
    """

    seq_lens: torch.Tensor  # [B] int32, the batch's
    out_seq_lens: torch.Tensor  # [R > B] int32
    out_extend_lens: torch.Tensor  # [R] int32
    page_table: torch.Tensor  # [B, P] int32, the batch's
    out_page_table: torch.Tensor  # [R, >= P] int32: its first B rows and P columns written
    sampled: torch.Tensor  # [S] int64: the batch's sampled rows
    out_sampled: torch.Tensor  # [>= S] int64: its first S entries written


def _check(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    out_ids: torch.Tensor,
    out_positions: torch.Tensor,
    out_loc: torch.Tensor,
    out_start: torch.Tensor | None,
    requests: PaddedRequests | None,
) -> None:
    # NOTE: checked every replay of a graph (a short prefill's host path): ``shape[0]``, not
    # ``len()``, which is a Python function of torch.Tensor
    n, rows = input_ids.shape[0], out_ids.shape[0]
    tensors = (input_ids, positions, out_cache_loc, out_ids, out_positions, out_loc)
    if any(t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise ValueError("token ids, positions and slots must be contiguous [T] int64")
    if not (
        positions.shape[0] == out_cache_loc.shape[0] == n <= rows
        and out_positions.shape[0] == out_loc.shape[0] == rows
    ):
        raise ValueError(f"{n} tokens (ids, positions, slots) do not pad to {rows} rows")
    if requests is not None:
        _check_requests(extend_lens, out_start, requests)
    elif out_start is not None and (
        extend_lens.shape != out_start.shape or out_start.dtype != torch.int32
    ):
        raise ValueError("out_start must be int32 with extend_lens' shape")


def _check_requests(
    extend_lens: torch.Tensor, out_start: torch.Tensor | None, requests: PaddedRequests
) -> None:
    num_reqs, r = extend_lens.shape[0], requests
    outs = (out_start, r.out_seq_lens, r.out_extend_lens)
    if any(t is None or t.dtype != torch.int32 or t.shape != outs[1].shape for t in outs):
        raise ValueError("padded requests need int32 out_start, out_seq_lens, out_extend_lens [R]")
    if r.seq_lens.shape != extend_lens.shape or r.out_seq_lens.shape[0] <= num_reqs:
        raise ValueError(
            f"{len(r.out_seq_lens)} padded requests do not hold {num_reqs} requests and the "
            "padding one"
        )
    # NOTE: checked every replay of an extend graph (a short prefill's host path): each
    # attribute read once, chained comparisons
    table, out_table = r.page_table, r.out_page_table
    sampled, out_sampled = r.sampled, r.out_sampled
    if not (
        table.dim() == out_table.dim() == 2
        and table.dtype is out_table.dtype is torch.int32
        and table.stride(1) == out_table.stride(1) == 1
    ):
        raise ValueError("page tables must be [B, P] int32 with contiguous rows")
    (rows, cols), (out_rows, out_cols) = table.shape, out_table.shape
    if rows != num_reqs or out_rows < num_reqs or out_cols < cols:
        raise ValueError(
            f"a page table {tuple(table.shape)} of {num_reqs} requests does not fit "
            f"{tuple(out_table.shape)}"
        )
    device = extend_lens.device
    if not table.device == out_table.device == sampled.device == out_sampled.device == device:
        raise ValueError("page tables and sampled rows must be on the batch's device")
    if not (
        sampled.dim() == out_sampled.dim() == 1
        and sampled.dtype is out_sampled.dtype is torch.int64
        and sampled.is_contiguous()
        and out_sampled.is_contiguous()
    ):
        raise ValueError("sampled rows must be contiguous [S] int64")
    if out_sampled.shape[0] < sampled.shape[0]:
        raise ValueError(f"{sampled.shape[0]} sampled rows do not fit {out_sampled.shape[0]}")


def pad_batch(
    input_ids: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    out_cache_loc: torch.Tensor,  # [n] int64
    extend_lens: torch.Tensor,  # [B] int32
    out_ids: torch.Tensor,  # [rows >= n] int64; rows past n keep their values
    out_positions: torch.Tensor,  # [rows] int64; rows past n keep their values
    out_loc: torch.Tensor,  # [rows] int64; rows past n get -1
    out_start: torch.Tensor | None,  # [B] (or [R]) int32: each request's first row; None: no
    requests: PaddedRequests | None = None,  # an extend graph's requests, padded to R
) -> None:
    """Copy a batch's ``n`` tokens into ``rows``-row buffers (padded slots -1) and write each
    request's first row (with ``requests``, also the padded requests' lengths, the page table
    and the sampled rows): one launch.
    """
    _check(
        input_ids,
        positions,
        out_cache_loc,
        extend_lens,
        out_ids,
        out_positions,
        out_loc,
        out_start,
        requests,
    )
    has_start, r = out_start is not None, requests
    tensors = (
        input_ids,
        positions,
        out_cache_loc,
        extend_lens,
        out_ids,
        out_positions,
        out_loc,
        out_start if has_start else out_ids,
        *((extend_lens,) * 3 if r is None else (r.seq_lens, r.out_seq_lens, r.out_extend_lens)),
        *(
            (out_ids,) * 4
            if r is None
            else (r.page_table, r.out_page_table, r.sampled, r.out_sampled)
        ),
    )
    n, rows, num_reqs = input_ids.shape[0], out_ids.shape[0], extend_lens.shape[0]
    num_out_reqs = num_reqs if r is None else r.out_seq_lens.shape[0]
    table = (0, 0, 0, 0)
    programs = -(-rows // _BLOCK)
    if r is not None:
        cols = r.page_table.shape[1]
        table = (cols, r.page_table.stride(0), r.out_page_table.stride(0), r.sampled.shape[0])
        programs = max(programs, -(-num_reqs * cols // _BLOCK))
    scalars = (n, rows, num_reqs, num_out_reqs, *table)
    grid = (max(1, programs), 1, 1)
    constants = {"BLOCK": _BLOCK, "HAS_START": has_start, "PAD_REQS": r is not None}
    _PAD_BATCH(grid, tensors, scalars, constants)


def pad_batch_ref(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    out_ids: torch.Tensor,
    out_positions: torch.Tensor,
    out_loc: torch.Tensor,
    out_start: torch.Tensor | None,
    requests: PaddedRequests | None = None,
) -> None:
    """``pad_batch`` in torch ops (off CUDA, and the tests' reference)."""
    _check(
        input_ids,
        positions,
        out_cache_loc,
        extend_lens,
        out_ids,
        out_positions,
        out_loc,
        out_start,
        requests,
    )
    n, rows, num_reqs = len(input_ids), len(out_ids), len(extend_lens)
    out_ids[:n] = input_ids
    out_positions[:n] = positions
    out_loc[:n] = out_cache_loc
    out_loc[n:] = -1
    if requests is not None:
        for out, real in (
            (requests.out_extend_lens, extend_lens),
            (requests.out_seq_lens, requests.seq_lens),
        ):
            out[:num_reqs] = real
            out[num_reqs:] = 0
            out[num_reqs] = rows - n
        extend_lens = requests.out_extend_lens
        table = requests.page_table
        requests.out_page_table[:num_reqs, : table.shape[1]] = table
        requests.out_sampled[: len(requests.sampled)] = requests.sampled
    if out_start is not None:
        out_start.copy_(torch.cumsum(extend_lens, 0) - extend_lens)
