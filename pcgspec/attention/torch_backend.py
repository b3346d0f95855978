"""Attention in plain PyTorch: SDPA over KV gathered from the paged cache.

It is the oracle in tests and the CPU serving path. Requests are batched by padding to
``[B, max_new, ...]`` queries and ``[B, max_seq, ...]`` keys; there is no per-request loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pcgspec.attention.base import AttentionBackend
from pcgspec.runners.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _Metadata:
    q_rows: torch.Tensor  # [B, L] flat row of each padded query; T_real for padding
    kv_slots: torch.Tensor  # [B, S] cache slot of each key; the scratch slot for padding
    masks: dict[int | None, torch.Tensor]  # sliding window -> [B, 1, L, S] bool, True = may attend
    out_rows: torch.Tensor  # [T_real] index into the flattened [B * L] result
    store_loc: torch.Tensor  # [T] slot to write each token's K/V (padding -> scratch)
    num_real: int


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        ext_cpu = batch.extend_lens_cpu
        self.metadata = self._metadata(batch, sum(ext_cpu), max(ext_cpu), max(batch.seq_lens_cpu))

    def init_capture_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """Keys padded to ``max_seq_len`` and masked; every row of ``batch`` is real."""
        self.metadata = self._metadata(
            batch, batch.num_tokens, max(batch.extend_lens_cpu), max_seq_len
        )

    def _metadata(
        self, batch: ForwardBatch, num_real: int, max_new: int, max_seq: int
    ) -> _Metadata:
        device = batch.device
        ext = batch.extend_lens.to(device=device, dtype=torch.int64)
        seq = batch.seq_lens.to(device=device, dtype=torch.int64)
        starts = torch.cumsum(ext, 0) - ext  # [B]

        i = torch.arange(max_new, device=device)[None, :]  # [1, L]
        q_valid = i < ext[:, None]
        q_rows = torch.where(q_valid, starts[:, None] + i, num_real)

        page = self.kv_cache.page_size
        j = torch.arange(max_seq, device=device)[None, :]  # [1, S]
        cols = (j // page).clamp(max=batch.page_table.shape[1] - 1)
        pages = torch.gather(batch.page_table.long(), 1, cols.expand(len(seq), -1))
        kv_valid = j < seq[:, None]
        kv_slots = torch.where(kv_valid, pages * page + j % page, self.kv_cache.scratch_slot)

        q_pos = ((seq - ext)[:, None] + i)[:, :, None]  # [B, L, 1]
        if batch.tree_mask is None:
            mask = (j[:, None, :] <= q_pos) & kv_valid[:, None, :]  # [B, L, S]
        else:
            mask = _tree_visible(batch.tree_mask, seq, j, max_new) & kv_valid[:, None, :]
        masks = {None: mask}
        windows = set(self.sliding_windows) - {None}
        if windows and batch.tree_mask is not None:
            raise ValueError("tree attention (tree_mask) does not support sliding-window layers")
        for window in windows:
            masks[window] = mask & (j[:, None, :] > q_pos - window)
        for m in masks.values():
            # NOTE: rows that see no key (padded queries, empty requests) see key 0, so SDPA
            # never softmaxes an all-masked row.
            m[:, :, 0] |= ~m.any(-1)
        b_of_t = torch.repeat_interleave(
            torch.arange(len(seq), device=device), ext, output_size=num_real
        )
        out_rows = b_of_t * max_new + torch.arange(num_real, device=device) - starts[b_of_t]
        loc = batch.out_cache_loc
        store_loc = torch.where(loc < 0, self.kv_cache.scratch_slot, loc)
        masks = {w: m[:, None] for w, m in masks.items()}
        return _Metadata(q_rows, kv_slots, masks, out_rows, store_loc, num_real)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        layer_id: int,
    ) -> None:
        md = self.metadata
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        k_cache.index_copy_(0, md.store_loc, k.to(k_cache.dtype))
        v_cache.index_copy_(0, md.store_loc, v.to(v_cache.dtype))

        q_pad = torch.cat([q[: md.num_real], q.new_zeros(1, *q.shape[1:])])
        qb = q_pad[md.q_rows].transpose(1, 2)  # [B, H, L, D]
        kb = k_cache[md.kv_slots].transpose(1, 2).to(q.dtype)  # [B, KV, S, D]
        vb = v_cache[md.kv_slots].transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(
            qb,
            kb,
            vb,
            attn_mask=md.masks[self.sliding_window(layer_id)],
            scale=self.scale,
            enable_gqa=True,
        )  # [B, H, L, D]
        o = o.transpose(1, 2).reshape(-1, *q.shape[1:])  # [B * L, H, D]
        out[: md.num_real] = o[md.out_rows]
        if out.shape[0] > md.num_real:
            out[md.num_real :] = 0


def _tree_visible(
    tree_mask: torch.Tensor, seq: torch.Tensor, j: torch.Tensor, max_new: int
) -> torch.Tensor:
    """``[B, L, S]``: query i sees every key before the last M and, of those, the ones
    ``tree_mask`` [B, L, M] marks (``ForwardBatch.tree_mask``)."""
    b, n, m = tree_mask.shape
    if n != max_new:
        raise ValueError(f"tree_mask must be [B, {max_new}, M], got {list(tree_mask.shape)}")
    col = j - (seq - m)[:, None]  # [B, S]: the key's column in the mask, < 0 before it
    bits = tree_mask.gather(2, col.clamp(0, m - 1)[:, None, :].expand(b, n, -1))
    return (col < 0)[:, None, :] | bits
