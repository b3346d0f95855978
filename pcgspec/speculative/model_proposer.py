"""Drafting with a model (EAGLE3, NEXTN/MTP, STANDALONE): catch up, then k greedy draft steps.

Rows. A standalone draft reads token ``T[p]`` at position ``p``, like the target. A head fed by
the target (EAGLE3, MTP) pairs the target's hidden state of position ``p`` with ``T[p+1]`` at
position ``p``, so it runs one position behind: its last catch-up row ``p = n-2`` already
predicts ``T[n]``, the first draft, for a request of ``n`` tokens.

Lazy catch-up. A propose step catches every request up over the positions the target computed
since the draft last did, then drafts (``DraftRunner.propose``): a catch-up padded to k+1 rows
per request (after a verify step a request is accept_len + 1 <= k+1 rows behind), greedy on
each request's last row, then k-1 one-token passes, all one graph replay
(``DraftGraphRunner``) where one is captured. The draft steps write K/V at positions the next
catch-up rewrites.

Two sources of catch-up rows. After a verify step a request catches up over that step's
emitted tokens (and hidden rows), which stay on the device (``VerifiedRows``): the next
speculative step builds the rows there, from the accepted counts and the lengths the device
holds, before the host has read the step (the overlap schedule). When every request of the
step has such rows, the verify step's k+1 rows per request are the catch-up's
(``_catch_up_from_verified``): as they are for the same requests in the same order (the steady
state), else gathered on the device (a request left the batch); rows past a request's emitted
tokens hold its rejected drafts, write no KV and are read by nothing. Otherwise (a new prompt,
plain decode steps, or a verify step the host read before the next speculative step) the host
state ``DraftState`` says how far the draft's K/V are valid (``computed``) and holds the target
hidden states of the positions after it (its pending chunks, from ``observe``); a request
further than k+1 rows behind first runs a DRAFT_EXTEND over all but its last k+1 rows (the
draft's piecewise graphs where it has them, else eagerly). Those rows' tokens come from the
host, but for the newest one, which a plain step still in flight may have sampled (the overlap
schedule): the device takes it from the sampling slots (``SamplingSlots.last_tokens``), so a
speculative step after a plain one waits for nothing. Reading a verify step turns its rows
into host state for the requests the next step did not take them for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pcgspec.engine.overlap import PENDING_TOKEN, resolve_pending
from pcgspec.runners.batch_builder import (
    SeqChunk,
    build_forward_batch,
    build_padded_batch,
    upload,
)
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.draft_runner import DraftRunner
from pcgspec.speculative.tree import TreeShape


@dataclass
class DraftState:
    computed: int = 0  # positions whose draft K/V are valid
    # target hidden states of positions computed.., per target pass a chunk: rows
    # ``rows[i] .. rows[i] + nums[i]`` of ``passes[i]``. NOTE: parallel lists, not a tuple per
    # chunk: a plain step adds a chunk to every request, and objects that outlive the step
    # drive the garbage collector's full collections (a catch-up gathers the rows:
    # ``pending_rows``)
    passes: list[torch.Tensor] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    nums: list[int] = field(default_factory=list)
    num_pending: int = 0  # NOTE: sum(nums), kept so a plain step's check is O(1)

    def add(self, hidden: torch.Tensor, row: int = 0, num: int | None = None) -> None:
        """Rows ``row .. row + num`` of ``hidden`` (all by default) are the next positions'."""
        num = len(hidden) - row if num is None else num
        self.passes.append(hidden)
        self.rows.append(row)
        self.nums.append(num)
        self.num_pending += num

    def advance(self, n: int) -> None:
        """The draft computed the next ``n`` positions (and consumed their pending rows)."""
        self.computed += n
        if not self.passes:  # NOTE: a draft that reads no target hidden states
            return
        self.num_pending -= n
        done = 0
        for i, num in enumerate(self.nums):
            if num > n:
                self.rows[i] += n
                self.nums[i] = num - n
                break
            n -= num
            done += 1
        del self.passes[:done], self.rows[:done], self.nums[:done]


def pending_rows(states: Sequence[DraftState], counts: Sequence[int]) -> torch.Tensor:
    """The first ``counts[i]`` pending rows of each of ``states``, concatenated in order
    ``[sum(counts), Hh]``: one gather from the passes' tensors. (After a run of plain steps a
    request holds one row of each pass: slicing them out one by one cost a launch each, 38 ms
    for 64 requests 60 steps behind.)
    """
    base: dict[int, int] = {}  # id of a pass's tensor -> its first row in ``passes``
    passes: list[torch.Tensor] = []
    index: list[int] = []
    total = 0  # rows in ``passes``
    for state, count in zip(states, counts):
        for hidden, row, num in zip(state.passes, state.rows, state.nums):
            if count <= 0:
                break
            first = base.get(id(hidden))
            if first is None:
                first = base[id(hidden)] = total
                passes.append(hidden)
                total += len(hidden)
            take = min(num, count)
            index += range(first + row, first + row + take)
            count -= take
    (rows,) = upload(passes[0].device, int64=(index,))
    source = passes[0] if len(passes) == 1 else torch.cat(passes)
    return source.index_select(0, rows)


@dataclass(frozen=True)
class VerifiedRows:
    """A verify step's emitted tokens, on the device, kept for the next catch-up."""

    tokens: torch.Tensor  # [B, k+1] int64: the step's emitted tokens, then FILLER_TOKEN
    num: torch.Tensor  # [B] int64: how many (accepted drafts + 1)
    hidden: torch.Tensor | None  # [B * (k+1), Hh] the verify pass's target states (a copy)
    # the requests that catch up from these rows (row in the step), until read or taken.
    # NOTE: a plain dict: the rows live a step or two (weak keys cost several times as much per
    # lookup); a request that finishes meanwhile is not carried into the next step's rows
    rows: dict[object, int]


class ModelProposer(Proposer):
    def __init__(self, runner: DraftRunner, shape: TreeShape, slots: SamplingSlots) -> None:
        self.runner = runner
        self.slots = slots  # the requests' last tokens, as of the device
        self.shape = shape
        self.num_steps = shape.depth
        self.uses_target_hidden = runner.uses_target_hidden
        self.lag = 1 if self.uses_target_hidden else 0  # catch-up rows trail the tokens by this
        self.graphs: DraftGraphRunner | None = None  # the propose phase, captured (CUDA)
        self._verified: VerifiedRows | None = None  # the newest verify step's rows

    # target passes ---------------------------------------------------------------------------

    def observe(
        self,
        requests: Sequence[object],
        starts: Sequence[int],
        nums: Sequence[int],
        hidden: torch.Tensor | None,
    ) -> None:
        """A plain target pass computed ``nums[i]`` positions of each of ``requests`` from
        position ``starts[i]``; their rows of ``hidden`` (the pass's captured states; None when
        this draft does not read them) are consecutive, in that order. A pass from position 0
        (a prefill, also after preemption) starts the draft over; a finished request is
        skipped (a speculative step read before this call may have finished it). Runs every
        plain step of every request, so the loop is kept to a lookup and an append per request.
        """
        self._forget_verified(*requests)
        if not self.uses_target_hidden:
            for request, start in zip(requests, starts):
                if start == 0 or request.draft_state is None:
                    request.draft_state = DraftState()
            return
        if hidden is None:
            raise ValueError("this draft needs the target's hidden states (CaptureHiddenMode.FULL)")
        row = 0
        for request, start, num in zip(requests, starts, nums):
            if request.finished:
                row += num
                continue
            state = request.draft_state
            if state is None or start == 0:
                state = request.draft_state = DraftState()
            if state.computed + state.num_pending != start:
                raise RuntimeError(
                    f"target hidden states of positions {state.computed + state.num_pending}.. "
                    f"are missing: the next pass starts at {start}"
                )
            state.add(hidden, row, num)
            row += num

    def verified(
        self, requests: Sequence[object], out: object, hidden: torch.Tensor | None
    ) -> VerifiedRows:
        """Keep the verify step's emitted tokens (and hidden rows) on the device: the next
        speculative step catches its requests up from them.
        """
        if self.uses_target_hidden and hidden is None:
            raise ValueError("this draft needs the target's hidden states of verify passes")
        # NOTE: ``hidden`` is the runner's copy of the graph's rows (FULL capture), kept as is
        rows = {r: b for b, r in enumerate(requests)}
        tokens = torch.where(out.tokens < 0, FILLER_TOKEN, out.tokens)  # catch-up input ids
        new = VerifiedRows(tokens, out.accept_len + 1, hidden, rows)
        self._verified = self._carried(new, self._verified)
        return self._verified

    def _carried(self, new: VerifiedRows, old: VerifiedRows | None) -> VerifiedRows:
        """``new`` and, after its rows, ``old``'s rows of the requests it lacks that may run
        again: no step caught those up yet (the step ran only some of the last one's requests,
        as fault isolation's reruns of halves do), so their next catch-up still reads them. A
        request whose launched tokens reach its length (``length_reached``) runs no further
        step: under continuous batching a request gets there every few steps, and carrying its
        rows would cost a gather for nothing.
        """
        left = (
            []
            if old is None
            else [
                (r, b)
                for r, b in old.rows.items()
                if r not in new.rows and not r.finished and not r.length_reached
            ]
        )
        if not left:
            return new
        k1, n, device = self.num_steps + 1, len(new.num), new.num.device
        (index,) = upload(
            device, int64=([b for _, b in left],)
        )  # NOTE: no sync, unlike torch.tensor
        hidden = new.hidden
        if hidden is not None:
            rows = (index[:, None] * k1 + torch.arange(k1, device=device)).view(-1)
            hidden = torch.cat([hidden, old.hidden[rows]])
        new.rows.update((r, n + i) for i, (r, _) in enumerate(left))
        return VerifiedRows(
            torch.cat([new.tokens, old.tokens[index]]),
            torch.cat([new.num, old.num[index]]),
            hidden,
            new.rows,
        )

    def checkpoint(self) -> object:
        return self._verified

    def rollback(self, checkpoint: object) -> None:
        """The newest verify rows are those before the failed step again (its catch-up rewrote
        draft K/V that a rerun rewrites the same).
        """
        self._verified = checkpoint  # type: ignore[assignment]

    def read(self, request: object, rows: object, row: int, start: int, num: int) -> None:
        """The host read verify rows ``rows`` (``VerifiedRows``): ``request`` (row ``row``)
        committed ``num`` tokens from position ``start``. A step launched since took them for
        its catch-up: the draft is valid up to the new length once it ran. Else they become
        host state, for a catch-up through the host.
        """
        assert isinstance(rows, VerifiedRows)
        newest = self._verified
        if newest is not rows and newest is not None and request in newest.rows:
            request.draft_state = DraftState(computed=start + num - self.lag)
            return
        rows.rows.pop(request, None)
        state = request.draft_state = DraftState(computed=start - self.lag)
        if rows.hidden is not None:
            k1 = self.num_steps + 1
            state.add(rows.hidden, row * k1, num)

    def _forget_verified(self, *requests: object) -> None:
        """The requests catch up through the host from now on, not from the newest verify
        step's rows."""
        verified = self._verified
        if verified is not None and len(verified.rows):  # NOTE: empty after the first plain step
            for request in requests:
                verified.rows.pop(request, None)

    # prefix cache ----------------------------------------------------------------------------

    def draft_computed(self, request: object) -> int:
        """Positions of ``request`` whose draft K/V are valid in its pages (as far as the host
        knows: a step in flight may have computed more).
        """
        state = request.draft_state
        return 0 if state is None else state.computed

    def adopt_prefix(self, request: object, num_tokens: int) -> None:
        """A prefix-cache hit: the cached pages of positions < ``num_tokens`` hold valid draft
        K/V (see ``engine/radix_cache.py``), so the draft starts there, like the target.
        """
        self._forget_verified(request)
        request.draft_state = DraftState(computed=num_tokens)

    # propose ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: ProposeInput) -> DraftProposal:
        if batch.page_table is None:
            raise ValueError("a model drafter writes its KV through the batch's page table")
        reqs = batch.requests
        verified = self._verified
        on_device = [verified is not None and r in verified.rows for r in reqs]
        for r, d in zip(reqs, on_device):
            if not d and r.draft_state is None:
                r.draft_state = DraftState()
        states = [None if d else r.draft_state for r, d in zip(reqs, on_device)]
        host = [(r, s) for r, s in zip(reqs, states) if s is not None]
        self._check_pending(host)
        self._catch_up_far_behind(host)
        if all(on_device):
            catch_up, hidden = self._catch_up_from_verified(batch)
        else:
            catch_up, hidden = self._catch_up_batch(batch, states)
        graphs = self.graphs
        if graphs is not None and graphs.can_run(catch_up):
            tree = graphs.run(catch_up, hidden)
        else:
            tree = self.runner.propose(catch_up, hidden, self.shape)
        drafts = tree.tokens
        num = torch.full((len(reqs),), drafts.shape[1], dtype=torch.int64, device=drafts.device)
        if self.shape.is_chain:
            return DraftProposal(drafts, num)
        return DraftProposal(
            drafts, num, parents=tree.parents, depths=tree.depths, tree_mask=tree.mask
        )

    def _behind(self, req: object, state: DraftState) -> int:
        """Catch-up rows of ``req``: positions ``computed .. num_tokens - 1 - lag`` (its tokens
        sampled by a step in flight included)."""
        return req.num_tokens - self.lag - state.computed

    def _check_pending(self, host: Sequence[tuple[object, DraftState]]) -> None:
        """Every request is >= 1 row behind (its newest token is new to the draft), and a head
        fed by the target holds exactly one target hidden state per catch-up row.
        """
        for req, state in host:
            behind = self._behind(req, state)
            have = behind
            if self.uses_target_hidden:
                have = state.num_pending
            if behind < 1 or have != behind:
                raise RuntimeError(
                    f"request {req.request_id}: {behind} draft rows to catch up, "
                    f"{have} target hidden states"
                )

    def _catch_up_far_behind(self, host: Sequence[tuple[object, DraftState]]) -> None:
        """One DRAFT_EXTEND (``DraftRunner.extend``) over all but the last k+1 catch-up rows of
        the requests more than k+1 rows behind, so that every request fits the padded catch-up.
        """
        k1 = self.num_steps + 1
        far = [(r, s, self._behind(r, s) - k1) for r, s in host if self._behind(r, s) > k1]
        self.caught_up = bool(far)
        if not far:
            return
        chunks = [
            SeqChunk(
                r.token_ids[s.computed + self.lag : s.computed + self.lag + n],
                s.computed,
                r.pages,
                sample=False,
            )
            for r, s, n in far
        ]
        batch = build_forward_batch(
            ForwardMode.DRAFT_EXTEND, chunks, self.runner.page_size, self.runner.device
        )
        hidden = None
        if self.uses_target_hidden:
            hidden = pending_rows([s for _, s, _ in far], [n for _, _, n in far])
        self.runner.extend(batch, hidden)
        for _, state, n in far:
            state.advance(n)

    def _catch_up_from_verified(
        self, batch: ProposeInput
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """``_catch_up_batch`` where every request catches up from the newest verify step's
        rows: row ``j`` of request ``b`` is row ``j`` of its verify row, its emitted tokens
        with their hidden states; rows from ``num[b]`` on (its rejected drafts) write no KV and
        are read by nothing. In the steady state (the verify step's requests in its order) the
        rows serve as they are; else (a request left the batch) they are gathered on the device.
        """
        v, k1 = self._verified, self.num_steps + 1
        tokens, num, hidden = v.tokens, v.num, v.hidden
        order = [v.rows[r] for r in batch.requests]
        if order != list(range(len(num))):
            (index,) = upload(tokens.device, int64=(order,))
            tokens, num = tokens.index_select(0, index), num.index_select(0, index)
            if hidden is not None:
                hidden = hidden.view(-1, k1, hidden.shape[-1]).index_select(0, index).flatten(0, 1)
        catch_up = build_padded_batch(
            ForwardMode.DRAFT_EXTEND,
            tokens,
            batch.seq_lens - num - self.lag,
            batch.page_table,
            self.runner.page_size,
            [r.num_tokens + k1 for r in batch.requests],
            num_valid=num,
        )
        return catch_up, hidden if self.uses_target_hidden else None

    def _catch_up_batch(
        self, batch: ProposeInput, states: Sequence[DraftState | None]
    ) -> tuple[ForwardBatch, torch.Tensor | None]:
        """The padded catch-up: k+1 rows per request (``spec_num_draft_tokens``), the first
        ``behind`` real, the rest writing no KV; ``logits_indices`` = each request's last real
        row. A request with host state (``states[b]``) takes its rows from the host; the others
        from the newest verify step's rows, on the device, starting ``num`` tokens before their
        length there (``batch.seq_lens``). Returns it with the target hidden rows in the same
        layout (None: not read).
        """
        reqs, seq_lens = batch.requests, batch.seq_lens
        k1, page, device = self.num_steps + 1, self.runner.page_size, self.runner.device
        ids, starts, nums, src, on_device, verified_rows, bounds = [], [], [], [], [], [], []
        have = 0  # host hidden rows so far
        pending = False  # a row's token is still on the device (sampled by a step in flight)
        for b, (req, state) in enumerate(zip(reqs, states)):
            if state is None:  # placeholders, replaced on the device
                ids += [FILLER_TOKEN] * k1
                starts.append(0)
                nums.append(1)
                src += [0] * k1
                on_device.append(b)
                verified_rows.append(self._verified.rows[req])
                bounds.append(req.num_tokens + k1)  # NOTE: start <= the worst-case length
                continue
            n, start = self._behind(req, state), state.computed
            known = req.token_ids[start + self.lag : start + self.lag + n]
            if len(known) < n - 1:
                raise RuntimeError(
                    f"request {req.request_id}: {n - len(known)} catch-up tokens still on the "
                    "device; only the newest may be"
                )
            pending = pending or len(known) < n
            ids += [*known, *[PENDING_TOKEN] * (n - len(known)), *[FILLER_TOKEN] * (k1 - n)]
            starts.append(start)
            nums.append(n)
            src += [have + min(j, n - 1) for j in range(k1)]
            bounds.append(start + k1)
            have += n
        input_ids, start, num, src_rows, device_b, device_rows = upload(
            device, int64=(ids, starts, nums, src, on_device, verified_rows)
        )
        b = len(reqs)
        input_ids, src_rows = input_ids.view(b, k1), src_rows.view(b, k1)
        if pending:
            input_ids = resolve_pending(input_ids, self.slots.last_tokens(reqs)[:, None])
        if on_device:
            v = self._verified
            n = v.num.index_select(0, device_rows)
            input_ids.index_copy_(0, device_b, v.tokens.index_select(0, device_rows))
            start.index_copy_(0, device_b, seq_lens.index_select(0, device_b) - n - self.lag)
            num.index_copy_(0, device_b, n)
            steps = torch.arange(k1, device=device)
            rows = have + device_rows[:, None] * k1 + torch.minimum(steps, n[:, None] - 1)
            src_rows.index_copy_(0, device_b, rows)
        catch_up = build_padded_batch(
            ForwardMode.DRAFT_EXTEND,
            input_ids,
            start,
            batch.page_table,
            page,
            bounds,
            num_valid=num,
        )
        if not self.uses_target_hidden:
            return catch_up, None
        host = [s for s in states if s is not None]
        sources = [pending_rows(host, [s.num_pending for s in host])] if host else []
        if on_device:
            sources.append(self._verified.hidden)
        return catch_up, torch.cat(sources)[src_rows.view(-1)]
