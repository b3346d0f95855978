"""The paged KV cache tensors: one K and one V buffer per layer, indexed by slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class KVCache:
    """``k[layer]`` and ``v[layer]`` are ``[num_slots + 1, KV, D]``; slot = page * page_size + off.

    NOTE: the extra last row is a scratch slot. Backends that cannot skip padded tokens
    (``out_cache_loc == -1``) without a host sync write them there; nothing ever reads it.
    """

    def __init__(
        self, spec: KVCacheSpec, num_pages: int, page_size: int, device: torch.device
    ) -> None:
        self.spec = spec
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        shape = (spec.num_layers, self.num_slots + 1, spec.num_kv_heads, spec.head_dim)
        # [L, slots + 1, KV, D]: every layer's K (V), one tensor, so that a slot moves in all
        # layers at once (the accepted nodes of a draft tree); ``k``/``v`` are its layers
        self.k_all = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))

    @property
    def scratch_slot(self) -> int:
        return self.num_slots


def page_slots(page_table: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B, n]`` int64 KV slots of positions ``positions[b, :]`` of request ``b``, looked up
    through its page-table row on the device (no host sync; graph-capturable).
    """
    pages = page_table.gather(1, positions // page_size)
    return pages.to(torch.int64) * page_size + positions % page_size
