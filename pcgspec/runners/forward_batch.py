"""What one forward pass needs: ``ForwardMode``, ``CaptureHiddenMode`` and ``ForwardBatch``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pcgspec.sampling.batch import SamplingBatch


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()  # prefill, chunked prefill, extend after a cached prefix
    DECODE = enum.auto()  # one new token per request
    TARGET_VERIFY = enum.auto()  # the target scores k+1 tokens per request
    DRAFT_EXTEND = enum.auto()  # the draft model catches up on accepted tokens
    IDLE = enum.auto()

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        """Several new tokens per request, attending to a cached prefix."""
        return self in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY)


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0  # no hidden states
    LAST = 1  # the sampled rows only
    FULL = 2  # every token

    def need_capture(self) -> bool:
        return self is not CaptureHiddenMode.NULL


@dataclass(frozen=True)
class ForwardBatch:
    """One batch in flat token layout: request ``b`` owns ``extend_lens[b]`` consecutive rows.

    Device tensors are what kernels read; the ``*_cpu`` lists are the same numbers on the host,
    so backends can size things without a device sync.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    out_cache_loc: torch.Tensor  # [T] int64, KV slot per token; -1 = padding, written nowhere
    seq_lens: torch.Tensor  # [B] int32, tokens in the KV cache after this pass (prefix + new)
    extend_lens: torch.Tensor  # [B] int32, new tokens per request in this pass
    page_table: torch.Tensor  # [B, max_pages] int32, page ids per request (slot = page*P + off)
    page_size: int
    seq_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    logits_indices: torch.Tensor  # [R] int64, rows whose logits are computed (sampled rows)
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL
    sampling: SamplingBatch | None = None
    input_embeds: torch.Tensor | None = None  # [T, hidden]; replaces the embedding lookup
    return_input_logprobs: bool = False
    # k+1 in TARGET_VERIFY mode and in a DRAFT_EXTEND catch-up padded to k+1 rows per request
    spec_num_draft_tokens: int = 0
    # [B, n, M] bool, draft trees (n tokens per request): query i of request b sees the keys
    # before its last M and, of those M, key m iff tree_mask[b, i, m]; None: causal
    tree_mask: torch.Tensor | None = None
    # [B] int32, each request's first row (exclusive cumsum of extend_lens), where whoever built
    # the batch had it at hand; attention backends compute it otherwise
    extend_start: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def logits_every_row(self) -> bool:
        """Whether the logits rows are every row, in order (they ascend: as many as the tokens)."""
        return self.logits_indices.shape[0] == self.num_tokens
