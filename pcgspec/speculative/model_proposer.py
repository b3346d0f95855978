"""Drafting with a model (EAGLE3, NEXTN/MTP, STANDALONE): catch up, then k greedy draft steps.

Rows. A standalone draft reads token ``T[p]`` at position ``p``, like the target. A head fed by
the target (EAGLE3, MTP) pairs the target's hidden state of position ``p`` with ``T[p+1]`` at
position ``p``, so it runs one position behind: its last catch-up row ``p = n-2`` already
predicts ``T[n]``, the first draft, for a request of ``n`` tokens.

Lazy catch-up. The draft's K/V are valid for positions below ``DraftState.computed``. A propose
step first runs one DRAFT_EXTEND pass over every position from there (a whole prompt the first
time; after a verify step, the accepted run), then k-1 one-token DECODE passes, each feeding
back the previous draft token and the head's own ``next_hidden``. The decode passes write draft
K/V at positions the next catch-up rewrites, so ``computed`` ends at the catch-up's end.

The target's hidden states reach the proposer through ``observe`` after every target pass that
computed positions of a request (prefill chunks, fallback decode steps, verify's accepted rows);
they wait in ``DraftState.pending`` until the next catch-up consumes them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch, page_slots
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.speculative.base import DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.draft_runner import DraftRunner


@dataclass
class DraftState:
    computed: int = 0  # positions whose draft K/V are valid
    pending: torch.Tensor | None = None  # [m, Hh] target hidden of positions computed..+m-1


class ModelProposer(Proposer):
    def __init__(self, runner: DraftRunner, num_steps: int) -> None:
        self.runner = runner
        self.num_steps = num_steps
        self.uses_target_hidden = runner.uses_target_hidden
        self.graphs: DraftGraphRunner | None = None  # the k-1 draft steps, captured (CUDA)
        # NOTE: keyed by the Request object: a finished or aborted request's state goes with it.
        self._states: weakref.WeakKeyDictionary[object, DraftState] = weakref.WeakKeyDictionary()

    # target passes ---------------------------------------------------------------------------

    def observe(self, request: object, start: int, hidden: torch.Tensor | None) -> None:
        """The target computed positions ``start ..`` of ``request``; ``hidden`` are their
        captured states (``[m, Hh]``; None when this draft does not read them). A pass from
        position 0 (a prefill, also after preemption) starts the draft over.
        """
        state = self._states.get(request)
        if state is None or start == 0:
            state = self._states[request] = DraftState()
        if not self.uses_target_hidden:
            return
        if hidden is None:
            raise ValueError("this draft needs the target's hidden states (CaptureHiddenMode.FULL)")
        have = state.computed + (0 if state.pending is None else len(state.pending))
        if have != start:
            raise RuntimeError(f"target hidden states of positions {have}.. are missing: the "
                               f"next pass starts at {start}")  # fmt: skip
        state.pending = hidden if state.pending is None else torch.cat([state.pending, hidden])

    # propose ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: ProposeInput) -> DraftProposal:
        reqs = batch.requests
        states = [self._states.setdefault(r, DraftState()) for r in reqs]
        extend, hidden = self._catch_up_batch(reqs, states)
        logits_hidden, next_hidden = self.runner.forward(extend, hidden)
        rows = extend.logits_indices
        first = self._greedy(logits_hidden[rows])
        drafts = first[:, None]
        if self.num_steps > 1:
            decode = self._first_decode_batch(reqs, extend)
            rest = self._draft_steps(decode, first, next_hidden[rows])
            drafts = torch.cat([drafts, rest], dim=1)  # [B, k]
        for state, seq_len in zip(states, extend.seq_lens_cpu):
            state.computed, state.pending = seq_len, None
        return DraftProposal(drafts, torch.full_like(first, self.num_steps))

    def _draft_steps(
        self, decode: ForwardBatch, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The k-1 one-token draft steps after the catch-up: ``[B, k-1]`` (a graph replay when
        one is captured for the batch size).
        """
        graphs = self.graphs
        if graphs is not None and graphs.can_run(decode.batch_size, max(decode.seq_lens_cpu)):
            return graphs.run(tokens, hidden, decode.positions, decode.page_table)
        out = []
        for step in range(self.num_steps - 1):
            decode = dataclasses.replace(_advance(decode) if step else decode, input_ids=tokens)
            logits_hidden, hidden = self.runner.forward(decode, hidden)
            tokens = self._greedy(logits_hidden)
            out.append(tokens)
        return torch.stack(out, dim=1)

    def _greedy(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.draft.compute_logits(logits_hidden).argmax(dim=-1)

    def _catch_up_batch(
        self, reqs: Sequence[object], states: Sequence[DraftState]
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """One DRAFT_EXTEND over positions ``computed ..`` of each request; last rows sample."""
        lag = 1 if self.uses_target_hidden else 0
        chunks = []
        for req, state in zip(reqs, states):
            tokens = req.token_ids[state.computed + lag :]
            if self.uses_target_hidden and (state.pending is None
                                            or len(state.pending) != len(tokens)):  # fmt: skip
                have = 0 if state.pending is None else len(state.pending)
                raise RuntimeError(f"request {req.request_id}: {len(tokens)} draft rows to catch "
                                   f"up but {have} target hidden states")  # fmt: skip
            chunks.append(SeqChunk(tokens, state.computed, req.pages))
        batch = build_forward_batch(ForwardMode.DRAFT_EXTEND, chunks, self.runner.page_size,
                                    self.runner.device)  # fmt: skip
        hidden = torch.cat([s.pending for s in states]) if self.uses_target_hidden else None
        return batch, hidden

    def _first_decode_batch(self, reqs: Sequence[object], extend: ForwardBatch) -> ForwardBatch:
        """The first draft DECODE pass: one token per request right after its catch-up rows."""
        chunks = [SeqChunk([0], seq_len, r.pages) for r, seq_len in zip(reqs, extend.seq_lens_cpu)]
        return build_forward_batch(ForwardMode.DECODE, chunks, self.runner.page_size,
                                   self.runner.device)  # fmt: skip


def _advance(batch: ForwardBatch) -> ForwardBatch:
    """The next one-token pass of every request: one position further, same pages."""
    positions = batch.positions + 1
    return dataclasses.replace(
        batch,
        positions=positions,
        out_cache_loc=page_slots(batch.page_table, positions, batch.page_size),
        seq_lens=batch.seq_lens + 1,
        seq_lens_cpu=tuple(n + 1 for n in batch.seq_lens_cpu),
    )
