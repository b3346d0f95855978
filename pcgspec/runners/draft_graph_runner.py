"""Draft CUDA graphs: the draft's k-1 one-token steps of a propose phase as one graph per batch
size (the catch-up pass before them has a varying number of tokens and runs eagerly).

A captured step reads the previous draft token and hidden state, writes the draft's K/V at its
position (slot from the page table, on the device) and appends its greedy token. Inputs are
copied into static buffers (``copy_``, never a new tensor); requests ``B..bs`` of a padded bucket
are marked invalid: slot -1 (no KV write) and ``seq_len`` 0 (no KV read). The outputs are the
first ``B`` rows of graph memory, overwritten by the next replay. Off CUDA the piecewise
``_EagerGraph`` stands in for ``torch.cuda.CUDAGraph``, so capture and replay are tested on CPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.compile.forward_context import forward_context
from pcgspec.compile.piecewise import _CudaGraph, _EagerGraph
from pcgspec.runners.batch_builder import page_slots
from pcgspec.runners.decode_graph_runner import capture_stream, decode_batch_sizes
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from pcgspec.speculative.draft_runner import DraftRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _DraftInputs:
    """``max_bs`` requests' inputs to the first captured step."""

    tokens: torch.Tensor  # [max_bs] int64, the catch-up's draft token
    hidden: torch.Tensor  # [max_bs, H], the catch-up's next_hidden
    positions: torch.Tensor  # [max_bs] int64, the first step's position
    valid: torch.Tensor  # [max_bs] bool, False = padding
    page_table: torch.Tensor  # [max_bs, max_pages] int32


class DraftGraphRunner:
    num_warmup: int = 2

    def __init__(self, draft: DraftRunner, num_steps: int, max_bs: int, max_seq_len: int) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.draft = draft
        self.num_steps = num_steps
        self.device = draft.device
        self.page_size = draft.page_size
        self.max_seq_len = max_seq_len
        self.max_pages = -(-max_seq_len // self.page_size)
        self.batch_sizes = decode_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.inputs = self._allocate()
        self.graphs: dict[int, _CudaGraph | _EagerGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: tuple[int, int] | None = None
        self.num_replays = 0

    def _allocate(self) -> _DraftInputs:
        n, device = self.max_bs, self.device
        return _DraftInputs(
            tokens=torch.zeros(n, dtype=torch.int64, device=device),
            hidden=torch.zeros(n, self.draft.draft.hidden_size, dtype=self.draft.draft.dtype,
                               device=device),  # fmt: skip
            positions=torch.zeros(n, dtype=torch.int64, device=device),
            valid=torch.zeros(n, dtype=torch.bool, device=device),
            page_table=torch.zeros(n, self.max_pages, dtype=torch.int32, device=device),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            self.pool = torch.cuda.graph_pool_handle()
        start = time.perf_counter()
        with capture_stream(self.device):
            for bs in tqdm(self.batch_sizes[::-1], desc="Capturing draft graphs", unit="bucket"):
                for _ in range(self.num_warmup):
                    self._steps(bs)
                graph = _CudaGraph(self.pool) if on_cuda else _EagerGraph()
                self.outputs[bs] = graph.capture(self._steps, (bs,))
                self.graphs[bs] = graph
        logger.info("Captured %d draft graphs (%d steps, batch 1..%d) in %.1f s",
                    len(self.graphs), self.num_steps, self.max_bs,
                    time.perf_counter() - start)  # fmt: skip

    def _steps(self, bs: int) -> torch.Tensor:
        """The captured region: ``num_steps`` greedy draft steps; returns ``[bs, num_steps]``."""
        inp, page = self.inputs, self.page_size
        tokens, hidden, positions = inp.tokens[:bs], inp.hidden[:bs], inp.positions[:bs]
        valid, table = inp.valid[:bs], inp.page_table[:bs]
        drafts = []
        for _ in range(self.num_steps):
            batch = ForwardBatch(
                forward_mode=ForwardMode.DECODE,
                input_ids=tokens,
                positions=positions,
                out_cache_loc=torch.where(valid, page_slots(table, positions, page), -1),
                seq_lens=torch.where(valid, positions + 1, 0).to(torch.int32),
                extend_lens=torch.ones(bs, dtype=torch.int32, device=self.device),
                page_table=table,
                page_size=page,
                seq_lens_cpu=(self.max_seq_len,) * bs,  # bounds, not contents
                extend_lens_cpu=(1,) * bs,
                logits_indices=torch.arange(bs, device=self.device),
            )
            backend = self.draft.attn_backend
            backend.init_capture_metadata(batch, self.max_seq_len)
            with forward_context(batch, backend):
                logits_hidden, hidden = self.draft.draft(tokens, positions, hidden)
            tokens = self.draft.draft.compute_logits(logits_hidden).argmax(dim=-1)
            drafts.append(tokens)
            positions = positions + 1
        return torch.stack(drafts, dim=1)

    def can_run(self, batch_size: int, max_position: int) -> bool:
        return bool(self.graphs) and batch_size <= self.max_bs and (
            max_position + self.num_steps <= self.max_seq_len)  # fmt: skip

    @torch.inference_mode()
    def run(
        self,
        tokens: torch.Tensor,  # [B] int64
        hidden: torch.Tensor,  # [B, H]
        positions: torch.Tensor,  # [B] int64, the first step's positions
        page_table: torch.Tensor,  # [B, pages] int32
    ) -> torch.Tensor:
        """The next ``num_steps`` greedy draft tokens per request: ``[B, num_steps]``."""
        n = tokens.shape[0]
        bs = pad_to_bucket(n, self.batch_sizes)
        if bs is None:
            raise ValueError(f"no draft graph for batch size {n} (max {self.max_bs})")
        inp = self.inputs
        inp.tokens[:n].copy_(tokens)
        inp.hidden[:n].copy_(hidden)
        inp.positions[:n].copy_(positions)
        inp.valid[:n].fill_(True)
        inp.valid[n:bs].fill_(False)
        inp.positions[n:bs].zero_()
        inp.page_table[:n, : page_table.shape[1]].copy_(page_table)
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:n]
