"""The draft model of a model-based proposer, with its own paged KV cache and attention backend.

The draft cache has as many pages as the target's and is indexed by the same page table: a
request's draft K/V live in the same page ids as its target K/V, in other tensors. So the
scheduler's page reservations cover the draft too and nothing is allocated per request.

A draft is anything with the ``DraftHead`` interface (``pcgspec/models/draft_head.py``): EAGLE3
and MTP heads fed by the target's hidden states, or ``StandaloneDraft``, a whole small causal LM
of the target's tokenizer that ignores them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pcgspec.attention import ATTENTION_BACKENDS
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.compile.backend import CompiledDecoder, PiecewiseBackend
from pcgspec.compile.forward_context import forward_context
from pcgspec.config import EngineConfig
from pcgspec.distributed.group import SINGLE
from pcgspec.kernels.draft_levels import draft_levels, draft_levels_ref
from pcgspec.models.eagle3 import Eagle3Head
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch, without_kv_writes
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.speculative.tree import DraftTree, TreeExpansion, TreeShape, top_tokens

if TYPE_CHECKING:
    from pcgspec.runners.piecewise_runner import PiecewiseRunner


class StandaloneDraft(nn.Module):
    """A whole causal LM as a draft (STANDALONE): its input is its own tokens, not hidden states.
    Its decoder stack runs as ``compiled_decoder`` (its piecewise runner's) when one is set.
    """

    uses_target_hidden = False

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.compiled_decoder: Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None = None
        for name in (
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "attn_scale",
            "sliding_windows",
            "hidden_size",
            "vocab_size",
        ):
            setattr(self, name, getattr(model, name))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def target_aux_layers(self, target_num_layers: int) -> None:
        return None  # reads no target hidden states

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = (self.compiled_decoder or self.model.model)(input_ids, positions)
        return h, h

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(logits_hidden)

    def top_tokens(self, logits_hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_tokens(self.compute_logits(logits_hidden), k)


def kv_spec(draft: nn.Module) -> KVCacheSpec:
    return KVCacheSpec(draft.num_layers, draft.num_kv_heads, draft.head_dim, draft.dtype)


class DraftRunner:
    """Runs ``draft`` over a ``ForwardBatch`` against the draft KV cache.

    Where the target runs piecewise (``config.use_piecewise``) the draft's layers are compiled
    too, into pieces around attention, which every pass runs (the captured propose phase
    included): a STANDALONE draft (a whole decoder stack) gets its own piecewise runner, whose
    graphs long catch-ups (a new prompt) replay; an EAGLE3 head compiles its layer past the fc
    (``Eagle3Head.decode``), traced here once.
    """

    extend_capture_hidden_mode = CaptureHiddenMode.NULL  # what a piecewise runner captures
    tp = SINGLE  # NOTE: drafts run unsharded, on rank 0 alone under tensor parallelism

    def __init__(
        self,
        draft: nn.Module,
        num_pages: int,
        page_size: int,
        config: EngineConfig,
    ) -> None:
        self.draft = draft
        self.config = config
        self.device = config.torch_device
        self.page_size = page_size
        self.kv_cache = KVCache(kv_spec(draft), num_pages, page_size, self.device)
        self.attn_backend = ATTENTION_BACKENDS.get(config.resolved_attention_backend)(
            self.kv_cache,
            draft.num_heads,
            draft.head_dim,
            draft.attn_scale,
            getattr(draft, "sliding_windows", ()),
        )
        self.piecewise: PiecewiseRunner | None = None
        if isinstance(draft, StandaloneDraft) and config.use_piecewise:
            from pcgspec.runners.piecewise_runner import PiecewiseRunner

            self.model = draft.model  # what the piecewise runner compiles: model.model
            self.piecewise = PiecewiseRunner(self)
            self.piecewise.capture()
            draft.compiled_decoder = self.piecewise.decoder
        elif isinstance(draft, Eagle3Head) and config.use_piecewise:
            backend = PiecewiseBackend(config.resolved_piecewise_compiler)
            draft.compiled_decoder = CompiledDecoder(draft.decode, backend)
            self._trace()

    @torch.inference_mode()
    def _trace(self) -> None:
        """One pass over two dummy tokens that writes no KV: the compiled head traces there."""
        chunk = SeqChunk([0, 0], 0, [0, 0], sample=False)  # NOTE: two pages: page_size may be 1
        batch = without_kv_writes(
            build_forward_batch(ForwardMode.DRAFT_EXTEND, [chunk], self.page_size, self.device)
        )
        width = getattr(self.draft, "target_hidden_size", self.draft.hidden_size)
        self.forward(batch, torch.zeros(2, width, dtype=self.draft.dtype, device=self.device))

    @property
    def uses_target_hidden(self) -> bool:
        return self.draft.uses_target_hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.draft.dtype

    @property
    def scored_vocab_size(self) -> int:
        """The tokens the head ranks for a tree level (an EAGLE3 head's draft vocabulary)."""
        return getattr(self.draft, "draft_vocab_size", None) or self.draft.vocab_size

    def forward(
        self, batch: ForwardBatch, hidden: torch.Tensor | None, capture_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits_hidden, next_hidden)``, each ``[T, H]``, for every row of ``batch``.
        ``capture_len``: the batch is a graph runner's static one, keys bounded by it.
        """
        if capture_len is None:
            self.attn_backend.init_forward_metadata(batch)
        else:
            self.attn_backend.init_capture_metadata(batch, capture_len)
        with forward_context(batch, self.attn_backend):
            return self.draft(batch.input_ids, batch.positions, hidden)

    def extend(self, batch: ForwardBatch, hidden: torch.Tensor | None) -> None:
        """A DRAFT_EXTEND pass for its K/V only (a long catch-up): piecewise graphs when they
        serve it.
        """
        if self.piecewise is not None and self.piecewise.can_run(batch):
            self.piecewise.run(batch)
        else:
            self.forward(batch, hidden)

    def propose(
        self,
        catch_up: ForwardBatch,
        hidden: torch.Tensor | None,
        shape: TreeShape,
        capture_len: int | None = None,
    ) -> DraftTree:
        """The propose phase on the device: a ``DraftTree`` of ``shape.num_nodes`` nodes per
        request (a chain of ``shape.depth`` drafts with topk 1).

        ``catch_up`` is a padded DRAFT_EXTEND batch, ``spec_num_draft_tokens`` rows per request
        (padded rows write no KV; a request with ``seq_len`` 0 is padding); each request's last
        real row (``logits_indices``) gives the depth-1 candidates. Then ``depth - 1`` passes,
        each over the topk beams of a level at once (``TreeExpansion``): level ``d``'s beams sit
        at position ``P + d - 1`` (``P``: the first position past the catch-up) and write their
        K/V to slots ``P + (d - 1) * topk ..``, each seeing the prefix and its ancestors (a tree
        mask; a chain needs none). Eager, or captured whole by ``DraftGraphRunner``
        (``capture_len`` set).
        """
        topk = shape.topk
        logits_hidden, next_hidden = self.forward(catch_up, hidden, capture_len)
        rows = catch_up.logits_indices  # [B]
        # NOTE: host bounds of each pass's sequence lengths (sizing only, e.g. KV splits).
        bound = max(catch_up.seq_lens_cpu) + topk
        levels = DraftLevels(catch_up, shape, self.page_size)
        if shape.is_chain:
            return self._chain(
                logits_hidden[rows], next_hidden[rows], levels, bound, shape.depth, capture_len
            )
        tree = TreeExpansion(*self.draft.top_tokens(logits_hidden[rows], topk), shape.depth)
        hidden = next_hidden[rows].repeat_interleave(topk, dim=0)  # [B * topk, H]
        for level in range(1, shape.depth):
            step = levels.batch(level, tree.beam_tokens, tree.beam_mask, bound)
            logits_hidden, next_hidden = self.forward(step, hidden, capture_len)
            parent_beam = tree.expand(*self.draft.top_tokens(logits_hidden, topk))
            width = next_hidden.shape[-1]
            hidden = (
                next_hidden.view(-1, topk, width)
                .gather(1, parent_beam[..., None].expand(-1, -1, width))
                .view(-1, width)
            )
            bound += topk
        return tree.select(shape.num_nodes, shape.depth)

    def _chain(
        self,
        logits_hidden: torch.Tensor,
        hidden: torch.Tensor,
        levels: DraftLevels,
        bound: int,
        depth: int,
        capture_len: int | None,
    ) -> DraftTree:
        """A chain of ``depth`` drafts from the catch-up's last rows: each pass's argmax is the
        next one's token, with none of a tree's scores, beams and masks (a few dozen kernels a
        step less)."""
        token = self.draft.top_tokens(logits_hidden, 1)[1]  # [B, 1]
        tokens = [token]
        for level in range(1, depth):
            step = levels.batch(level, token, None, bound)
            logits_hidden, hidden = self.forward(step, hidden, capture_len)
            token = self.draft.top_tokens(logits_hidden, 1)[1]
            tokens.append(token)
            bound += 1
        return DraftTree(torch.cat(tokens, dim=1))


class DraftLevels:
    """The batches of a propose phase's draft levels after the catch-up (``depth - 1`` of
    ``topk`` beams per request), their tensors built once for every level
    (``kernels.draft_levels``: one launch a step, not a set of kernels per level).

    Level ``d`` (1-based) of request ``b`` sits at position ``start[b] + d - 1`` (``start``: the
    first position past its catch-up) and writes its beams' K/V to slots
    ``start[b] + (d - 1) * topk ..``; its sequence ends after them.
    """

    def __init__(self, catch_up: ForwardBatch, shape: TreeShape, page_size: int) -> None:
        self.catch_up, self.topk, self.page_size = catch_up, shape.topk, page_size
        levels = draft_levels if catch_up.positions.is_cuda else draft_levels_ref
        inputs = levels(
            catch_up.positions,
            catch_up.logits_indices,
            catch_up.seq_lens,
            catch_up.page_table,
            page_size,
            shape.depth - 1,
            shape.topk,
        )
        self.out_cache_loc, self.positions, self.seq_lens = inputs[:3]
        self.extend_lens, self.logits_indices = inputs[3:]

    def batch(
        self, level: int, beam_tokens: torch.Tensor, beam_mask: torch.Tensor | None, bound: int
    ) -> ForwardBatch:
        """Level ``level``'s pass over ``beam_tokens`` [B, topk] (``beam_mask``: what each sees
        of the levels' slots, None for a chain: one DECODE token per request)."""
        chain, row, bs = beam_mask is None, level - 1, len(self.extend_lens)
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE if chain else ForwardMode.DRAFT_EXTEND,
            input_ids=beam_tokens.reshape(-1),
            positions=self.positions[row],
            out_cache_loc=self.out_cache_loc[row],
            seq_lens=self.seq_lens[row],
            extend_lens=self.extend_lens,
            page_table=self.catch_up.page_table,
            page_size=self.page_size,
            seq_lens_cpu=(bound,) * bs,
            extend_lens_cpu=(self.topk,) * bs,
            logits_indices=self.logits_indices,
            spec_num_draft_tokens=0 if chain else self.topk,
            tree_mask=None if chain else beam_mask.contiguous(),
        )
