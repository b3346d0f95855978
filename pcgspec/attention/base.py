"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pcgspec.attention.kv_cache import KVCache
    from pcgspec.runners.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Paged attention for one model. ``init_forward_metadata`` runs once per forward pass,
    before the model; ``forward`` runs once per layer inside ``pcgspec::attention``.
    """

    name: str  # as in ATTENTION_BACKENDS

    def __init__(
        self,
        kv_cache: KVCache,
        num_heads: int,
        head_dim: int,
        scale: float,
        sliding_windows: Sequence[int | None] = (),
    ) -> None:
        """``sliding_windows[layer]``: how many keys a query of that layer sees, itself
        included (None, or a layer past the sequence: all of them).
        """
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = kv_cache.spec.num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_windows = tuple(sliding_windows)
        bad = [w for w in self.sliding_windows if w is not None and w < 1]
        if bad:
            raise ValueError(f"sliding_windows must be None or positive, got {bad}")

    def sliding_window(self, layer_id: int) -> int | None:
        windows = self.sliding_windows
        return windows[layer_id] if layer_id < len(windows) else None

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Precompute whatever every layer of this pass shares (index maps, masks, ...)."""

    def init_capture_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """``init_forward_metadata`` for a batch that a CUDA-graph runner captures and replays.

        ``batch``'s device tensors are the runner's static buffers: fixed shapes, contents that
        change between replays. Padded requests have ``seq_len`` 0 and write no KV; their output
        rows may hold anything finite. Host ints come from shapes, ``extend_lens_cpu`` (fixed for
        the graph) and ``max_seq_len`` (a bound of every ``seq_len``) only, never from the
        contents. The runner calls this inside the captured region, so the device work must be
        capturable (no host sync); every replay re-runs it on the new contents.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support graph capture")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        out: torch.Tensor,  # [T, H, D]
        layer_id: int,
    ) -> None:
        """Write ``k``/``v`` to the slots ``batch.out_cache_loc`` (skipping -1), then attend:
        token ``t`` of request ``b`` sees the first ``prefix_len[b] + i_t + 1`` cache entries,
        the last ``sliding_window(layer_id)`` of them on a sliding-window layer.
        """
