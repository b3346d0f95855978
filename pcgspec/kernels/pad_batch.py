"""Padding a batch into a graph runner's static buffers, in one launch (piecewise prefill and
decode / verify graphs).

Before a piecewise replay the token ids, positions and KV slots of a batch go into the static
buffers the graphs were captured with, padded to the bucket (slot -1: no KV write), and the
extend kernel needs each request's first row (the exclusive cumsum of ``extend_lens``). As
torch ops that is five or six small launches before the GPU has any work; a short prefill is
host-bound, so they are one kernel here. Padded ids and positions are left as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches

_BLOCK = 1024  # tokens per program; also requests per scan step


# NOTE: the sizes, and the alignment of the inputs (views into one packed upload), change from
# batch to batch: not specialized, so nothing compiles at serving.
@triton.jit(
    do_not_specialize=["num_tokens", "num_rows", "num_reqs"],
    do_not_specialize_on_alignment=["InputIds", "Positions", "Loc", "ExtendLens"],
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
    num_tokens,
    num_rows,
    num_reqs,
    BLOCK: tl.constexpr,
    HAS_START: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    real = offs < num_tokens
    tl.store(OutIds + offs, tl.load(InputIds + offs, mask=real), mask=real)
    tl.store(OutPositions + offs, tl.load(Positions + offs, mask=real), mask=real)
    loc = tl.load(Loc + offs, mask=real, other=-1)
    tl.store(OutLoc + offs, loc, mask=offs < num_rows)
    if HAS_START and pid == 0:  # the exclusive cumsum of extend_lens, BLOCK requests at a time
        carry = tl.zeros([], dtype=tl.int32)
        for r0 in range(0, num_reqs, BLOCK):
            r = r0 + tl.arange(0, BLOCK)
            lens = tl.load(ExtendLens + r, mask=r < num_reqs, other=0).to(tl.int32)
            inclusive = tl.cumsum(lens, 0)
            tl.store(OutStart + r, carry + inclusive - lens, mask=r < num_reqs)
            carry += tl.sum(lens, 0)


_PAD_BATCH = CompiledLaunches(_pad_batch_kernel)


def _check(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    extend_lens: torch.Tensor,
    out_ids: torch.Tensor,
    out_positions: torch.Tensor,
    out_loc: torch.Tensor,
    out_start: torch.Tensor | None,
) -> None:
    n, rows = len(input_ids), len(out_ids)
    tensors = (input_ids, positions, out_cache_loc, out_ids, out_positions, out_loc)
    if any(t.dim() != 1 or t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise ValueError("token ids, positions and slots must be contiguous [T] int64")
    if not len(positions) == len(out_cache_loc) == n <= rows == len(out_positions) == len(out_loc):
        raise ValueError(f"{n} tokens (ids, positions, slots) do not pad to {rows} rows")
    if out_start is not None and (
        extend_lens.shape != out_start.shape or out_start.dtype != torch.int32
    ):
        raise ValueError("out_start must be int32 with extend_lens' shape")


def pad_batch(
    input_ids: torch.Tensor,  # [n] int64
    positions: torch.Tensor,  # [n] int64
    out_cache_loc: torch.Tensor,  # [n] int64
    extend_lens: torch.Tensor,  # [B] int32
    out_ids: torch.Tensor,  # [rows >= n] int64; rows past n keep their values
    out_positions: torch.Tensor,  # [rows] int64; rows past n keep their values
    out_loc: torch.Tensor,  # [rows] int64; rows past n get -1
    out_start: torch.Tensor | None,  # [B] int32: the first row of each request; None: not wanted
) -> None:
    """Copy a batch's ``n`` tokens into ``rows``-row buffers (padded slots -1) and write each
    request's first row: one launch.
    """
    _check(
        input_ids, positions, out_cache_loc, extend_lens, out_ids, out_positions, out_loc, out_start
    )
    has_start = out_start is not None
    tensors = (
        input_ids,
        positions,
        out_cache_loc,
        extend_lens,
        out_ids,
        out_positions,
        out_loc,
        out_start if has_start else out_ids,
    )
    scalars = (len(input_ids), len(out_ids), len(extend_lens))
    grid = (max(1, triton.cdiv(len(out_ids), _BLOCK)), 1, 1)
    constants = {"BLOCK": _BLOCK, "HAS_START": has_start}
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
) -> None:
    """``pad_batch`` in torch ops (off CUDA, and the tests' reference)."""
    _check(
        input_ids, positions, out_cache_loc, extend_lens, out_ids, out_positions, out_loc, out_start
    )
    n = len(input_ids)
    out_ids[:n] = input_ids
    out_positions[:n] = positions
    out_loc[:n] = out_cache_loc
    out_loc[n:] = -1
    if out_start is not None:
        out_start.copy_(torch.cumsum(extend_lens, 0) - extend_lens)
