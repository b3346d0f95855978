"""The accepted path of a draft tree moved into place in the KV cache, in one launch.

A tree verify pass writes node i of request b at position ``start[b] + i``; acceptance picks a
path of nodes ``path[b]`` (node 0 the root, then strictly increasing node indices, -1 past its
end). The next passes read the accepted tokens at consecutive positions, so node ``path[b, j]``
moves to position ``start[b] + j`` in every layer, K and V. Nodes off the path stay where they
are, past the request's length (overwritten later).

One program per (request, layer, columns of a slot's row) looks up the path's slots at once,
then moves its nodes in order of j, each row read and written by the same lanes: node
``path[j] >= j`` is read before any later j' writes position ``start + j'`` (it may be
``path[j]``), and no later read meets an earlier write (``path[j'] >= j' > j``). The torch
reference gathers every source row before writing any.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.attention.kv_cache import page_slots
from pcgspec.kernels.launches import CompiledLaunches


@triton.jit(
    do_not_specialize=["stride_layer", "stride_table", "page_size", "path_len"],
    do_not_specialize_on_alignment=["PageTable", "Start", "Path"],
)
def _move_kv_kernel(
    K,
    V,
    PageTable,
    Start,
    Path,
    stride_layer,
    stride_table,
    page_size,
    path_len,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)  # this program's columns
    inside = e < ROW
    start = tl.load(Start + b)
    j = tl.arange(0, BLOCK_D)
    node = tl.load(Path + b * path_len + j, mask=j < path_len, other=-1)
    # NOTE: -1 past the path's end; node == j is in place; start < 0: a padding request
    moved = (node > j) & (start + j * 0 >= 0)  # NOTE: a vector mask (the interpreter wants one)
    src, dst = start + node, start + j
    src_page = tl.load(PageTable + b * stride_table + src // page_size, mask=moved, other=0)
    dst_page = tl.load(PageTable + b * stride_table + dst // page_size, mask=moved, other=0)
    src_row = src_page.to(tl.int64) * page_size + src % page_size
    dst_row = dst_page.to(tl.int64) * page_size + dst % page_size
    base = layer * stride_layer
    for i in tl.static_range(1, BLOCK_D):
        if tl.sum(tl.where(j == i, moved.to(tl.int32), 0), 0) > 0:
            s = base + tl.sum(tl.where(j == i, src_row, 0), 0) * ROW + e
            d = base + tl.sum(tl.where(j == i, dst_row, 0), 0) * ROW + e
            tl.store(K + d, tl.load(K + s, mask=inside), mask=inside)
            tl.store(V + d, tl.load(V + s, mask=inside), mask=inside)


# NOTE: one launch per tree verify step, inside the step graphs as a rule
_MOVE = CompiledLaunches(_move_kv_kernel)
_MAX_BLOCK_ROW = 1024  # elements of a slot's row (KV heads * head dim) per program


def _check(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    page_table: torch.Tensor,
    start: torch.Tensor,
    path: torch.Tensor,
) -> None:
    if k_all.shape != v_all.shape or k_all.dim() != 4 or k_all.dtype != v_all.dtype:
        raise ValueError(
            f"k_all and v_all must be one [L, slots, KV, D] shape and dtype, got "
            f"{list(k_all.shape)} {k_all.dtype} and {list(v_all.shape)} {v_all.dtype}"
        )
    b = path.shape[0]
    wants = {
        "page_table": (page_table, 2, torch.int32),
        "start": (start, 1, torch.int64),
        "path": (path, 2, torch.int64),
    }
    for name, (t, dims, dtype) in wants.items():
        if t.dim() != dims or t.shape[0] != b or t.dtype != dtype:
            raise ValueError(
                f"{name} must be {dims}-D {dtype} with {b} rows, got {list(t.shape)} {t.dtype}"
            )
    if len({t.device for t in (k_all, v_all, page_table, start, path)}) != 1:
        raise ValueError("the KV cache, page_table, start and path must be on one device")


def move_accepted_kv(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    start: torch.Tensor,
    path: torch.Tensor,
) -> None:
    """Move node ``path[b, j]`` of request b (written at position ``start[b] + path[b, j]``) to
    position ``start[b] + j`` in every layer of ``k_all``, ``v_all`` ([L, slots, KV, D]) through
    ``page_table`` [B, pages] int32; ``start`` [B] int64 (< 0: a padding request), ``path``
    [B, D+1] int64. One launch."""
    _check(k_all, v_all, page_table, start, path)
    if not (k_all.is_contiguous() and v_all.is_contiguous()):
        raise ValueError("k_all and v_all must be contiguous")
    if page_table.stride(1) != 1:
        raise ValueError("page_table rows must be contiguous")
    num_layers, row = k_all.shape[0], k_all.shape[2] * k_all.shape[3]
    b, path_len = path.shape
    block_row = min(triton.next_power_of_2(row), _MAX_BLOCK_ROW)
    tensors = (k_all, v_all, page_table, start.contiguous(), path.contiguous())
    scalars = (k_all.stride(0), page_table.stride(0), page_size, path_len)
    constants = {"ROW": row, "BLOCK_ROW": block_row, "BLOCK_D": triton.next_power_of_2(path_len)}
    _MOVE((b, num_layers, -(-row // block_row)), tensors, scalars, constants)


def move_accepted_kv_ref(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    start: torch.Tensor,
    path: torch.Tensor,
) -> None:
    """``move_accepted_kv`` in torch: every source row gathered, then written (moved rows only;
    the rest write the last slot onto itself)."""
    _check(k_all, v_all, page_table, start, path)
    steps = torch.arange(path.shape[1], device=path.device)
    moved = ((path > steps) & (start[:, None] >= 0)).view(-1)
    first = start.clamp_min(0)[:, None]
    last = k_all.shape[1] - 1
    src = torch.where(
        moved, page_slots(page_table, first + path.clamp_min(0), page_size).view(-1), last
    )
    dst = torch.where(moved, page_slots(page_table, first + steps, page_size).view(-1), last)
    for layers in (k_all, v_all):
        layers.index_copy_(1, dst, layers.index_select(1, src))
