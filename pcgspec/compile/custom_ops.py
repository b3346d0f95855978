"""``pcgspec::attention``, the one opaque op the decoder graph is split at, and the
tensor-parallel collectives ``pcgspec::all_reduce`` / ``pcgspec::all_gather``, which stay inside
whatever is compiled around them (a piece, a whole step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from pcgspec.compile.forward_context import get_forward_context
from pcgspec.distributed import symm_mem

ATTENTION_OP_NAME = "pcgspec::attention"
ALL_REDUCE_OP_NAME = "pcgspec::all_reduce"
ALL_GATHER_OP_NAME = "pcgspec::all_gather"


def attention_impl(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    output: torch.Tensor,  # [T, H, D], written in place
    layer_id: int,
) -> None:
    """Store ``k``/``v`` in the paged cache and write attention over the sequence to ``output``.

    The body of ``pcgspec::attention``; the piecewise split module calls it directly between
    its pieces, skipping the op dispatcher (tens of microseconds per layer).
    """
    get_forward_context().attn_backend.forward(q, k, v, output, layer_id)


@torch.library.custom_op(ATTENTION_OP_NAME, mutates_args=("output",))
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, output: torch.Tensor, layer_id: int
) -> None:
    attention_impl(q, k, v, output, layer_id)


@attention.register_fake
def _attention_fake(q, k, v, output, layer_id) -> None:  # noqa: ANN001
    return None


@torch.library.custom_op(ALL_REDUCE_OP_NAME, mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of process group ``group_name``, as a new tensor.

    NOTE: opaque to Dynamo and not a split op, so it lands inside a compiled piece; under CUDA
    graph capture ``dist.all_reduce`` on NCCL records into the graph like any kernel. Small CUDA
    messages take the one-shot path over peer memory when it is on (``distributed/symm_mem.py``).
    """
    symm = symm_mem.buffer_for(x, group_name)
    if symm is not None:
        return symm_mem.one_shot_all_reduce(x, symm)
    out = x.clone()
    dist.all_reduce(out, group=_resolve_process_group(group_name))
    return out


@all_reduce.register_fake
def _all_reduce_fake(x, group_name) -> torch.Tensor:  # noqa: ANN001
    return torch.empty_like(x)


@torch.library.custom_op(ALL_GATHER_OP_NAME, mutates_args=())
def all_gather(x: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order: ``[world_size, *x.shape]``."""
    out = x.new_empty((world_size, *x.shape))
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=_resolve_process_group(group_name))
    return out


@all_gather.register_fake
def _all_gather_fake(x, group_name, world_size) -> torch.Tensor:  # noqa: ANN001
    return x.new_empty((world_size, *x.shape))


def split_ops() -> list[object]:
    """The ops the piecewise splitter cuts at."""
    return [torch.ops.pcgspec.attention.default]


def direct_impls() -> dict[object, object]:
    """Split op (overload or packet) -> the Python function behind it. Between pieces the
    split module runs eagerly, so it may call these directly instead of dispatching the op.
    """
    op = torch.ops.pcgspec.attention
    return {op: attention_impl, op.default: attention_impl}
