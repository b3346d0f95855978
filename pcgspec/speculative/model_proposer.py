"""Drafting with a model (EAGLE3, NEXTN/MTP, STANDALONE): catch up, then k greedy draft steps.

Rows. A standalone draft reads token ``T[p]`` at position ``p``, like the target. A head fed by
the target (EAGLE3, MTP) pairs the target's hidden state of position ``p`` with ``T[p+1]`` at
position ``p``, so it runs one position behind: its last catch-up row ``p = n-2`` already
predicts ``T[n]``, the first draft, for a request of ``n`` tokens.

Lazy catch-up. The draft's K/V are valid for positions below ``DraftState.computed``. A propose
step catches every request up from there, then drafts (``DraftRunner.propose``): a catch-up
padded to k+1 rows per request (after a verify step a request is accept_len + 1 <= k+1 rows
behind), greedy on each request's last row, then k-1 one-token passes, all one graph replay
(``DraftGraphRunner``) where one is captured. A request further behind (a new prompt, or plain
decode steps) first runs a DRAFT_EXTEND over all but its last k+1 rows (the draft's piecewise
graphs where it has them, else eagerly). The draft steps
write K/V at positions the next catch-up rewrites, so ``computed`` ends at the catch-up's end
(once the target's next pass is observed: a step that fails after proposing runs again from the
same state).

The target's hidden states reach the proposer through ``observe`` after every target pass that
computed positions of a request (prefill chunks, plain decode steps, verify's accepted rows);
they wait in ``DraftState.pending`` until the next catch-up consumes them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pcgspec.runners.batch_builder import (
    SeqChunk,
    build_forward_batch,
    padded_page_table,
    upload,
)
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.draft_runner import DraftRunner


@dataclass
class DraftState:
    computed: int = 0  # positions whose draft K/V are valid
    # target hidden states of positions computed.., one [m_i, Hh] chunk per target pass
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0  # NOTE: rows in ``pending``, kept so a plain step's check is O(1)

    def add(self, hidden: torch.Tensor) -> None:
        self.pending.append(hidden)
        self.num_pending += len(hidden)

    def rows(self) -> torch.Tensor:
        """The pending rows as one tensor ``[num_pending, Hh]`` (kept as the one chunk)."""
        if len(self.pending) > 1:
            self.pending = [torch.cat(self.pending)]
        return self.pending[0]

    def advance(self, n: int) -> None:
        """The draft computed the next ``n`` positions (and consumed their pending rows)."""
        self.computed += n
        if self.pending:
            self.pending = [self.rows()[n:]]
            self.num_pending -= n

    def restart(self, computed: int) -> None:
        self.computed, self.pending, self.num_pending = computed, [], 0


class ModelProposer(Proposer):
    def __init__(self, runner: DraftRunner, num_steps: int) -> None:
        self.runner = runner
        self.num_steps = num_steps
        self.uses_target_hidden = runner.uses_target_hidden
        self.lag = 1 if self.uses_target_hidden else 0  # catch-up rows trail the tokens by this
        self.graphs: DraftGraphRunner | None = None  # the propose phase, captured (CUDA)
        # NOTE: keyed by the Request object: a finished or aborted request's state goes with it.
        self._states: weakref.WeakKeyDictionary[object, DraftState] = weakref.WeakKeyDictionary()
        # Where a propose phase left each request's draft: applied when the target's next pass
        # is observed, so a step that fails after proposing can run again from the same state.
        self._proposed: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

    # target passes ---------------------------------------------------------------------------

    def observe(self, request: object, start: int, hidden: torch.Tensor | None) -> None:
        """The target computed positions ``start ..`` of ``request``; ``hidden`` are their
        captured states (``[m, Hh]``; None when this draft does not read them). A pass from
        position 0 (a prefill, also after preemption) starts the draft over.
        """
        state = self._states.get(request)
        computed = self._proposed.pop(request, None)
        if state is None or start == 0:
            state = self._states[request] = DraftState()
        elif computed is not None:
            state.restart(computed)
        if not self.uses_target_hidden:
            return
        if hidden is None:
            raise ValueError("this draft needs the target's hidden states (CaptureHiddenMode.FULL)")
        have = state.computed + state.num_pending
        if have != start:
            raise RuntimeError(f"target hidden states of positions {have}.. are missing: the "
                               f"next pass starts at {start}")  # fmt: skip
        state.add(hidden)

    # prefix cache ----------------------------------------------------------------------------

    def draft_computed(self, request: object) -> int:
        """Positions of ``request`` whose draft K/V are valid in its pages."""
        state = self._states.get(request)
        return 0 if state is None else state.computed

    def adopt_prefix(self, request: object, num_tokens: int) -> None:
        """A prefix-cache hit: the cached pages of positions < ``num_tokens`` hold valid draft
        K/V (see ``engine/radix_cache.py``), so the draft starts there, like the target.
        """
        self._states[request] = DraftState(computed=num_tokens)
        self._proposed.pop(request, None)

    # propose ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: ProposeInput) -> DraftProposal:
        reqs = batch.requests
        states = [self._states.setdefault(r, DraftState()) for r in reqs]
        self._check_pending(reqs, states)
        self._catch_up_far_behind(reqs, states)
        catch_up, hidden = self._catch_up_batch(reqs, states)
        graphs = self.graphs
        if graphs is not None and graphs.can_run(catch_up):
            drafts = graphs.run(catch_up, hidden)
        else:
            drafts = self.runner.propose(catch_up, hidden, self.num_steps)
        for req in reqs:
            self._proposed[req] = len(req.token_ids) - self.lag  # the catch-up's end
        num = torch.full((len(reqs),), self.num_steps, dtype=torch.int64, device=drafts.device)
        return DraftProposal(drafts, num)

    def _behind(self, req: object, state: DraftState) -> int:
        """Catch-up rows of ``req``: positions ``computed .. len(tokens) - 1 - lag``."""
        return len(req.token_ids) - self.lag - state.computed

    def _check_pending(self, reqs: Sequence[object], states: Sequence[DraftState]) -> None:
        """Every request is >= 1 row behind (its newest token is new to the draft), and a head
        fed by the target holds exactly one target hidden state per catch-up row.
        """
        for req, state in zip(reqs, states):
            behind = self._behind(req, state)
            have = behind
            if self.uses_target_hidden:
                have = state.num_pending
            if behind < 1 or have != behind:
                raise RuntimeError(f"request {req.request_id}: {behind} draft rows to catch up, "
                                   f"{have} target hidden states")  # fmt: skip

    def _catch_up_far_behind(self, reqs: Sequence[object], states: Sequence[DraftState]) -> None:
        """One DRAFT_EXTEND (``DraftRunner.extend``) over all but the last k+1 catch-up rows of
        the requests more than k+1 rows behind, so that every request fits the padded catch-up.
        """
        k1 = self.num_steps + 1
        far = [(r, s, self._behind(r, s) - k1) for r, s in zip(reqs, states)
               if self._behind(r, s) > k1]  # fmt: skip
        self.caught_up = bool(far)
        if not far:
            return
        chunks = [SeqChunk(r.token_ids[s.computed + self.lag : s.computed + self.lag + n],
                           s.computed, r.pages, sample=False) for r, s, n in far]  # fmt: skip
        batch = build_forward_batch(ForwardMode.DRAFT_EXTEND, chunks, self.runner.page_size,
                                    self.runner.device)  # fmt: skip
        hidden = None
        if self.uses_target_hidden:
            hidden = torch.cat([s.rows()[:n] for _, s, n in far])
        self.runner.extend(batch, hidden)
        for _, state, n in far:
            state.advance(n)

    def _catch_up_batch(
        self, reqs: Sequence[object], states: Sequence[DraftState]
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The padded catch-up: k+1 rows per request (``spec_num_draft_tokens``), the first
        ``behind`` real, the rest writing no KV; ``logits_indices`` = each request's last real
        row. Returns it with the target hidden rows in the same layout (None: not read).
        """
        k1, page = self.num_steps + 1, self.runner.page_size
        ids, positions, slots, last_rows, src_rows = [], [], [], [], []
        have = 0
        for b, (req, state) in enumerate(zip(reqs, states)):
            n, start = self._behind(req, state), state.computed
            tokens = req.token_ids[start + self.lag : start + self.lag + n]
            ids += [*tokens, *[FILLER_TOKEN] * (k1 - n)]
            positions += range(start, start + k1)
            slots += [req.pages[p // page] * page + p % page for p in range(start, start + n)]
            slots += [-1] * (k1 - n)
            last_rows.append(b * k1 + n - 1)
            src_rows += [have + min(j, n - 1) for j in range(k1)]
            have += n
        seq_lens = tuple(s.computed + k1 for s in states)
        table, max_pages = padded_page_table([r.pages for r in reqs])
        starts = range(0, len(reqs) * k1, k1)
        input_ids, pos, locs, rows, src, lens, ext, first, pages = upload(
            self.runner.device,
            int64=(ids, positions, slots, last_rows, src_rows),
            int32=(seq_lens, (k1,) * len(reqs), starts, table),
        )
        batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND,
            input_ids=input_ids,
            positions=pos,
            out_cache_loc=locs,
            seq_lens=lens,
            extend_lens=ext,
            page_table=pages.view(len(reqs), max_pages),
            page_size=page,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=(k1,) * len(reqs),
            logits_indices=rows,
            spec_num_draft_tokens=k1,
            extend_start=first,
        )
        if not self.uses_target_hidden:
            return batch, None
        pending = torch.cat([s.rows() for s in states])  # [sum(behind), Hh]
        return batch, pending[src]
