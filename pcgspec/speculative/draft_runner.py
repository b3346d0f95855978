"""The draft model of a model-based proposer, with its own paged KV cache and attention backend.

The draft cache has as many pages as the target's and is indexed by the same page table: a
request's draft K/V live in the same page ids as its target K/V, in other tensors. So the
scheduler's page reservations cover the draft too and nothing is allocated per request.

A draft is anything with the ``DraftHead`` interface (``pcgspec/models/draft_head.py``): EAGLE3
and MTP heads fed by the target's hidden states, or ``StandaloneDraft``, a whole small causal LM
of the target's tokenizer that ignores them.
"""

from __future__ import annotations

import torch
from torch import nn

from pcgspec.attention import ATTENTION_BACKENDS
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.compile.forward_context import forward_context
from pcgspec.runners.forward_batch import ForwardBatch


class StandaloneDraft(nn.Module):
    """A whole causal LM as a draft (STANDALONE): its input is its own tokens, not hidden states."""

    uses_target_hidden = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "attn_scale",
                     "hidden_size", "vocab_size"):  # fmt: skip
            setattr(self, name, getattr(model, name))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def target_aux_layers(self, target_num_layers: int) -> None:
        return None  # reads no target hidden states

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.model.model(input_ids, positions)
        return h, h

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(logits_hidden)


def kv_spec(draft: nn.Module) -> KVCacheSpec:
    return KVCacheSpec(draft.num_layers, draft.num_kv_heads, draft.head_dim, draft.dtype)


class DraftRunner:
    """Runs ``draft`` over a ``ForwardBatch`` against the draft KV cache."""

    def __init__(
        self, draft: nn.Module, num_pages: int, page_size: int, backend: str,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.draft = draft
        self.device = device
        self.page_size = page_size
        self.kv_cache = KVCache(kv_spec(draft), num_pages, page_size, device)
        self.attn_backend = ATTENTION_BACKENDS.get(backend)(
            self.kv_cache, draft.num_heads, draft.head_dim, draft.attn_scale
        )

    @property
    def uses_target_hidden(self) -> bool:
        return self.draft.uses_target_hidden

    def forward(
        self, batch: ForwardBatch, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits_hidden, next_hidden)``, each ``[T, H]``, for every row of ``batch``."""
        self.attn_backend.init_forward_metadata(batch)
        with forward_context(batch, self.attn_backend):
            return self.draft(batch.input_ids, batch.positions, hidden)
