"""The scoped context the attention op reads: the current batch and attention backend."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pcgspec.attention.base import AttentionBackend
    from pcgspec.runners.forward_batch import ForwardBatch


@dataclass(frozen=True)
class ForwardContext:
    batch: ForwardBatch
    attn_backend: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(
    batch: ForwardBatch, attn_backend: AttentionBackend
) -> Iterator[ForwardContext]:
    """Make ``batch`` the one the attention op sees; nesting is a bug and raises."""
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active; nested forward passes are a bug")
    _current = ForwardContext(batch, attn_backend)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("pcgspec::attention called outside forward_context(...)")
    return _current
