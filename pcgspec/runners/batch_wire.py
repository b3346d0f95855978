"""A ``ForwardBatch`` as a ``StepMessage``: what a tensor-parallel worker gets each step.

Why a header and not the same scheduler on every rank: the scheduler's inputs include the
tokens rank 0 samples (stops, accept lengths, detokenized stop strings), so a replicated
scheduler would still need them every step, and would run the engine's host work on every
rank. The batch itself is a few small tensors: sending it is one broadcast, and the workers run
exactly rank 0's batch by construction.

A draft tree's accepted K/V moved into place (``kv_move_message``) is the other message a worker
gets: a header ``MOVE_KV``, the page table's and the path's shapes; the payload the page table,
the roots' positions and the paths.

The header holds one record per ``ForwardBatch`` field, in field order: ``NONE``; ``INT``
value (ints, bools, the two enums); ``INTS`` length, values (the ``*_cpu`` tuples); ``TENSOR``
dtype, ndim, shape (its values in the payload, in order); ``FLOAT`` index of the floating
tensor. ``sampling`` stays on rank 0, the only rank that samples.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from pcgspec.distributed.broadcast import DTYPES, StepMessage
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode

NONE, INT, INTS, TENSOR, FLOAT = range(5)
# NOTE: a batch's header opens with its first field's tag (INT): this first word marks a K/V move
MOVE_KV = 5
_RANK0_ONLY = frozenset({"sampling"})
_ENUMS: dict[str, type[enum.IntEnum]] = {
    "forward_mode": ForwardMode,
    "capture_hidden_mode": CaptureHiddenMode,
}
_FIELDS = tuple(f.name for f in dataclasses.fields(ForwardBatch))
_BOOLS = frozenset(f.name for f in dataclasses.fields(ForwardBatch) if isinstance(f.default, bool))


def to_message(batch: ForwardBatch) -> StepMessage:
    """Rank 0: ``batch`` as a header and its tensors (nothing leaves the device)."""
    header: list[int] = []
    ints: list[torch.Tensor] = []
    floats: list[torch.Tensor] = []
    for name in _FIELDS:
        value = getattr(batch, name)
        if value is None or name in _RANK0_ONLY:
            header.append(NONE)
        elif isinstance(value, torch.Tensor) and value.is_floating_point():
            header += [FLOAT, len(floats)]
            floats.append(value)
        elif isinstance(value, torch.Tensor):
            header += [TENSOR, DTYPES.index(value.dtype), value.dim(), *value.shape]
            ints.append(value)
        elif isinstance(value, enum.Enum) and name not in _ENUMS:
            raise TypeError(f"ForwardBatch.{name}: no wire form for enum {type(value).__name__}")
        elif isinstance(value, int):  # bool and IntEnum included
            header += [INT, int(value)]
        elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            header += [INTS, len(value), *value]
        else:
            raise TypeError(f"ForwardBatch.{name}: no wire form for {type(value).__name__}")
    return StepMessage(header, ints, floats)


def from_message(message: StepMessage) -> ForwardBatch:
    """A worker: the batch rank 0 sent (tensors on the payload's device)."""
    header, floats = message.header, message.floats
    payload = message.ints[0] if message.ints else None
    fields: dict[str, object] = {}
    i = offset = 0
    for name in _FIELDS:
        tag = header[i]
        if tag == NONE:
            fields[name], i = None, i + 1
        elif tag == INT:
            fields[name], i = _int_field(name, header[i + 1]), i + 2
        elif tag == INTS:
            n = header[i + 1]
            fields[name], i = tuple(header[i + 2 : i + 2 + n]), i + 2 + n
        elif tag == TENSOR:
            dtype, ndim = DTYPES[header[i + 1]], header[i + 2]
            shape = header[i + 3 : i + 3 + ndim]
            n = math.prod(shape)
            fields[name] = payload[offset : offset + n].view(shape).to(dtype)
            i, offset = i + 3 + ndim, offset + n
        elif tag == FLOAT:
            fields[name], i = floats[header[i + 1]], i + 2
        else:
            raise ValueError(f"ForwardBatch.{name}: unknown wire tag {tag}")
    return ForwardBatch(**fields)


def _int_field(name: str, value: int) -> int | bool | enum.IntEnum:
    if name in _ENUMS:
        return _ENUMS[name](value)
    if name in _BOOLS:
        return bool(value)
    return value


def kv_move_message(
    page_table: torch.Tensor, start: torch.Tensor, path: torch.Tensor
) -> StepMessage:
    """Rank 0: a tree verify pass's accepted nodes to move (``speculative.tree.move_accepted_kv``:
    ``page_table`` [B, P] int32, ``start`` [B] int64, ``path`` [B, D+1] int64)."""
    return StepMessage([MOVE_KV, *page_table.shape, path.shape[1]], [page_table, start, path], [])


def is_kv_move(message: StepMessage) -> bool:
    return message.header[0] == MOVE_KV


def kv_move_from_message(message: StepMessage) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A worker: ``(page_table, start, path)`` of a ``kv_move_message``."""
    _, b, pages, width = message.header
    payload = message.ints[0]
    table = payload[: b * pages].view(b, pages).to(torch.int32)
    start = payload[b * pages : b * pages + b]
    path = payload[b * pages + b : b * pages + b + b * width].view(b, width)
    return table, start, path
