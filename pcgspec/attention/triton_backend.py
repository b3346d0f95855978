"""Paged attention on Triton kernels: the fused store + extend kernel, or store K/V then
split-KV decode / verify."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pcgspec.attention.base import AttentionBackend
from pcgspec.kernels.attention import decode_attention, decode_workspace, store_kv
from pcgspec.kernels.extend_attention import ExtendPlan, extend_attention, plan_extend
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """What every layer of one pass shares: device tensors the kernels read, host ints that
    size the grids.

    NOTE: in a CUDA graph (``init_capture_metadata``) the tensors are the runner's static
    buffers (padded requests: ``seq_len`` 0, slot -1), every row counts as real, and
    ``num_kv_splits`` is fixed per captured batch size for the longest context (an extend
    graph's plan splits no prefix); the workspace is allocated inside the captured region, so
    it is graph memory.
    """

    tokens_per_seq: int  # > 0: split-KV path (DECODE: 1, TARGET_VERIFY: k+1); 0: extend path
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    # [B] int32, first row of each request (exclusive cumsum); the extend path's only
    extend_start: torch.Tensor | None
    out_cache_loc: torch.Tensor  # [T] int64, -1 = padding
    num_real_tokens: int  # sum(extend_lens); rows past it are padding, zeroed
    num_kv_splits: int  # split-KV path; the extend path's prefix splits are its plan's
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # splits: [rows, H, S, D], [rows, H, S]
    extend_plan: ExtendPlan | None  # extend path: grid and constants of the fused kernel
    tree_mask: torch.Tensor | None = None  # split-KV path: [B, tokens_per_seq, M] draft trees


class TritonAttentionBackend(AttentionBackend):
    """Paged attention on Triton kernels. EXTEND, chunked prefill and DRAFT_EXTEND make one
    launch per layer: the fused kernel stores the new K/V, attends causally (prefix from the
    cache, new keys from ``k``/``v``) and zeroes the padded rows; a few new tokens over a long
    prefix split it, with a second launch to merge the pieces. DECODE and TARGET_VERIFY (k+1
    tokens per request) store K/V first, then run flash-decoding over KV splits, which fills
    the GPU at small batch. A sliding-window layer's launches skip the key blocks left of
    its window.
    """

    name = "triton"
    max_kv_splits: int = 32
    min_kv_split_len: int = 256  # keys; shorter splits cost more in the reduce than they save

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        mode, ext_cpu = batch.forward_mode, batch.extend_lens_cpu
        if mode.is_decode() and any(n != 1 for n in ext_cpu):
            raise ValueError(f"DECODE needs one new token per request, got {ext_cpu}")
        num_splits = self._num_kv_splits(batch.batch_size, max(batch.seq_lens_cpu, default=0))
        self.metadata = self._metadata(batch, _tokens_per_seq(batch), sum(ext_cpu), num_splits)

    def init_capture_metadata(self, batch: ForwardBatch, max_seq_len: int) -> None:
        """DECODE, TARGET_VERIFY and padded draft catch-ups: split-KV over every row of
        ``batch`` (padded requests: ``seq_len`` 0, zero output) with a ``num_kv_splits`` fixed
        for ``max_seq_len``. EXTEND (extend graphs): the fused kernel planned for the worst case
        of the batch's rows and requests, one request owning every row; every row belongs to a
        request (an extend graph's padding request owns the padded ones), so none is zeroed,
        and the prefix is not split.
        """
        tokens_per_seq = _tokens_per_seq(batch)
        if tokens_per_seq:
            num_splits = self._num_kv_splits(batch.batch_size, max_seq_len)
            self.metadata = self._metadata(batch, tokens_per_seq, batch.num_tokens, num_splits)
        elif batch.forward_mode is ForwardMode.EXTEND and batch.tree_mask is None:
            rows = batch.num_tokens
            plan = self._plan((rows,) + (0,) * (batch.batch_size - 1), rows, max_prefix=0)
            self.metadata = self._metadata(batch, 0, rows, 1, plan)
        else:
            raise ValueError(
                f"graph capture needs EXTEND, or DECODE / TARGET_VERIFY with the same number of "
                f"tokens per request, got {batch.forward_mode.name} with {batch.extend_lens_cpu}"
            )

    def _plan(self, extend_lens: tuple[int, ...], num_rows: int, max_prefix: int) -> ExtendPlan:
        return plan_extend(
            extend_lens,
            num_rows,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.kv_cache.spec.dtype,
            self.kv_cache.page_size,
            self.scale,
            max_prefix=max_prefix,
            num_sms=_num_sms(self.kv_cache.k[0].device),
        )

    def _metadata(
        self,
        batch: ForwardBatch,
        tokens_per_seq: int,
        num_real: int,
        num_splits: int,
        plan: ExtendPlan | None = None,
    ) -> TritonAttentionMetadata:
        if batch.tree_mask is not None and not tokens_per_seq:
            raise ValueError("a tree_mask needs the same number of tokens per request")
        if not tokens_per_seq and plan is None:
            ext = batch.extend_lens_cpu
            prefixes = (s - n for s, n in zip(batch.seq_lens_cpu, ext))
            plan = self._plan(ext, batch.num_tokens, max(prefixes, default=0))
        if plan is not None:
            num_splits = plan.num_splits
        workspace = None
        if tokens_per_seq or num_splits > 1:
            shape = (num_real, self.num_heads, self.head_dim, num_splits)
            workspace = decode_workspace(*shape, batch.device)
        return TritonAttentionMetadata(
            tokens_per_seq=tokens_per_seq,
            page_table=batch.page_table,
            seq_lens=batch.seq_lens,
            extend_lens=batch.extend_lens,
            extend_start=None if plan is None else _extend_start(batch),
            out_cache_loc=batch.out_cache_loc,
            num_real_tokens=num_real,
            num_kv_splits=num_splits,
            workspace=workspace,
            extend_plan=plan,
            tree_mask=batch.tree_mask,
        )

    def _num_kv_splits(self, batch_size: int, max_seq_len: int) -> int:
        """Enough splits for about two waves of programs, none shorter than the minimum."""
        programs = max(1, batch_size * self.num_kv_heads)
        by_occupancy = -(-2 * _num_sms(self.kv_cache.k[0].device) // programs)
        by_length = -(-max_seq_len // self.min_kv_split_len)
        return max(1, min(self.max_kv_splits, by_occupancy, by_length))

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KV, D]
        v: torch.Tensor,  # [T, KV, D]
        out: torch.Tensor,  # [T, H, D]
        layer_id: int,
    ) -> None:
        md = self.metadata
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        window = self.sliding_window(layer_id)
        # NOTE: every layer of a pass has the same shapes and dtypes: check the first only.
        if md.extend_plan is not None:
            extend_attention(
                q,
                k,
                v,
                out,
                k_cache,
                v_cache,
                md.out_cache_loc,
                md.page_table,
                md.seq_lens,
                md.extend_lens,
                md.extend_start,
                md.extend_plan,
                window=window,
                workspace=md.workspace,
                check=layer_id == 0,
            )
            return
        check = layer_id == 0
        store_kv(k, v, k_cache, v_cache, md.out_cache_loc, check=check)
        n = md.num_real_tokens
        decode_attention(
            q[:n],
            k_cache,
            v_cache,
            out[:n],
            md.page_table,
            md.seq_lens,
            self.kv_cache.page_size,
            self.scale,
            md.num_kv_splits,
            tokens_per_seq=md.tokens_per_seq,
            window=window,
            workspace=md.workspace,
            tree_mask=md.tree_mask,
            check=check,
        )
        if out.shape[0] > n:
            out[n:].zero_()


def _extend_start(batch: ForwardBatch) -> torch.Tensor:
    if batch.extend_start is not None:
        return batch.extend_start
    return torch.cumsum(batch.extend_lens, 0, dtype=torch.int32) - batch.extend_lens


def _tokens_per_seq(batch: ForwardBatch) -> int:
    """Tokens per request on the split-KV path (DECODE: 1; TARGET_VERIFY and a draft catch-up
    padded to k+1 rows per request: k+1), else 0.
    """
    ext_cpu, mode = batch.extend_lens_cpu, batch.forward_mode
    split_kv = (
        mode.is_decode()
        or mode is ForwardMode.TARGET_VERIFY
        or (mode is ForwardMode.DRAFT_EXTEND and batch.spec_num_draft_tokens > 0)
    )
    return ext_cpu[0] if split_kv and len(set(ext_cpu)) == 1 else 0


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter runs: enough to exercise the split path
