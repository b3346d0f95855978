"""Draft CUDA graphs: a model drafter's whole propose phase as one graph per batch size.

A propose phase is ``DraftRunner.propose``: the catch-up pass over the tokens the target
accepted since the last one, padded to k+1 rows per request (k: the draft depth; k+1 tokens
per request on the split-KV path; padded rows write no KV), then k-1 passes over a level's
topk beams per request (one token for a chain) and the tree's selection. So one replay drafts a
tree (a chain: k tokens) per request, and nothing in it depends on host values.

Inputs are copied into static buffers (``copy_`` and ``pad_batch``, never new tensors);
requests ``B..bs`` of a padded bucket are invalid: ``seq_len`` 0 (no KV read), slots -1 (no KV
write). The drafts are the first ``B`` rows of graph memory, overwritten by the next replay.
Off CUDA the piecewise ``_EagerGraph`` stands in for ``torch.cuda.CUDAGraph``, so capture and
replay are tested on CPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.compile.piecewise import _CudaGraph, _EagerGraph
from pcgspec.progress import progress
from pcgspec.runners.decode_graph_runner import StaticBuffers, decode_batch_sizes
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.runners.refusals import GuardedRunner
from pcgspec.runners.whole_graphs import capture_stream
from pcgspec.speculative.tree import DraftTree, TreeShape

if TYPE_CHECKING:
    from pcgspec.speculative.draft_runner import DraftRunner

logger = logging.getLogger(__name__)


class DraftGraphRunner(GuardedRunner):
    """Where it refuses a catch-up (``can_run``), the proposer drafts eagerly."""

    num_warmup: int = 2
    reasons = ("not_captured", "batch_size", "seq_len")

    def __init__(self, draft: DraftRunner, shape: TreeShape, max_bs: int, max_seq_len: int) -> None:
        super().__init__()
        self.draft = draft
        self.shape = shape
        num_steps = self.num_steps = shape.depth  # k: the catch-up has k+1 rows
        self.device = draft.device
        self.page_size = draft.page_size
        self.max_seq_len = max_seq_len
        self.batch_sizes = decode_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        rows = self.max_bs * (num_steps + 1)
        self.buffers = StaticBuffers.allocate(
            self.max_bs, num_steps + 1, -(-max_seq_len // self.page_size), self.device
        )
        self.last_rows = torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)
        self.hidden = (
            torch.zeros(
                rows, draft.draft.target_hidden_size, dtype=draft.draft.dtype, device=self.device
            )
            if draft.uses_target_hidden
            else None
        )
        self.graphs: dict[int, _CudaGraph | _EagerGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool: tuple[int, int] | None = None

    @torch.inference_mode()
    def capture(self) -> None:
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            self.pool = torch.cuda.graph_pool_handle()
        self.buffers.out_cache_loc.fill_(-1)  # NOTE: warm-ups and captures must write no KV
        self.buffers.seq_lens.zero_()
        start = time.perf_counter()
        with capture_stream(self.device):
            for bs in progress(
                self.batch_sizes[::-1], desc="Capturing draft graphs", unit="bucket"
            ):
                for _ in range(self.num_warmup):
                    self._propose(bs)
                graph = _CudaGraph(self.pool) if on_cuda else _EagerGraph()
                self.outputs[bs] = graph.capture(self._propose, (bs,))
                self.graphs[bs] = graph
        logger.info(
            "Captured %d draft graphs (catch-up + %d levels of %d, batch 1..%d) in %.1f s",
            len(self.graphs),
            self.num_steps - 1,
            self.shape.topk,
            self.max_bs,
            time.perf_counter() - start,
        )

    def _propose(self, bs: int) -> tuple[torch.Tensor, ...]:
        """The captured region: the trees' tokens, parents, depths (and ancestor masks) from
        the static buffers."""
        batch = self.buffers.batch(
            ForwardMode.DRAFT_EXTEND,
            bs,
            self.page_size,
            self.max_seq_len,
            logits_indices=self.last_rows[:bs],
            spec_num_draft_tokens=self.num_steps + 1,
        )
        hidden = None if self.hidden is None else self.hidden[: bs * (self.num_steps + 1)]
        tree = self.draft.propose(batch, hidden, self.shape, capture_len=self.max_seq_len)
        # NOTE: a chain's tree is its tokens alone (``DraftTree`` fields in order)
        return tuple(
            t for t in (tree.tokens, tree.parents, tree.depths, tree.mask) if t is not None
        )

    def _refusal(self, catch_up: ForwardBatch) -> str | None:
        """Why a replay cannot serve ``catch_up`` (k+1 rows per request, bounded lengths)."""
        if not self.graphs:
            return "not_captured"
        if catch_up.batch_size > self.max_bs:
            return "batch_size"
        ahead = (self.num_steps - 1) * self.shape.topk + 1
        if max(catch_up.seq_lens_cpu) + ahead > self.max_seq_len:
            return "seq_len"
        return None

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    @torch.inference_mode()
    def run(self, catch_up: ForwardBatch, hidden: torch.Tensor | None) -> DraftTree:
        """``DraftRunner.propose(catch_up, hidden, shape)`` by replay: graph memory."""
        n = catch_up.batch_size
        bs = pad_to_bucket(n, self.batch_sizes)
        if bs is None:
            raise ValueError(f"no draft graph for batch size {n} (max {self.max_bs})")
        self.buffers.load(catch_up, bs)
        self.last_rows[:n].copy_(catch_up.logits_indices)
        if self.hidden is not None:
            self.hidden[: hidden.shape[0]].copy_(hidden)
        self.graphs[bs].replay()
        self._count_run((bs - n) * (self.num_steps + 1))
        return DraftTree(*(out[:n] for out in self.outputs[bs]))
