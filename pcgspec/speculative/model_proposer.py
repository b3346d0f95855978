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
holds, before the host has read the step (the overlap schedule). A captured step
(``SpecStepGraphs``) writes them into the catch-up buffers (``CatchUpRows``) that the next
captured step reads: in the steady state nothing is copied; otherwise the rows are made as
below and copied in (``prepare_replay``), and rows still needed past the next captured step
are copied out before it overwrites them (``_leaving``, ``read``). When every request of the
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
from typing import NamedTuple

import torch

from pcgspec.engine.overlap import PENDING_TOKEN, resolve_pending
from pcgspec.runners.batch_builder import (
    SeqChunk,
    build_forward_batch,
    build_padded_batch,
    upload,
)
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.base import (
    FILLER_TOKEN,
    CapturedStep,
    DraftProposal,
    ProposeInput,
    Proposer,
)
from pcgspec.speculative.draft_runner import DraftRunner
from pcgspec.speculative.tree import DraftTree, TreeShape


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
    # rows ``0 .. own`` are the step's own requests', the rest carried from the step before
    # (``_newest``)
    own: int = 0
    # the tensors are the step graphs' catch-up buffers (``CatchUpRows``), which the next
    # captured step overwrites: rows still needed after it are copied out first (``_leaving``)
    in_buffers: bool = False


@dataclass(frozen=True)
class CatchUpRows:
    """Where a captured speculative step reads its catch-up rows (``VerifiedRows``' layout, for
    up to ``max_bs`` requests) and writes the next step's."""

    tokens: torch.Tensor  # [max_bs, k+1] int64
    start: torch.Tensor  # [max_bs] int64 the first row's position
    num: torch.Tensor  # [max_bs] int64
    hidden: torch.Tensor | None  # [max_bs * (k+1), Hh]

    def view(self, n: int, rows: dict[object, int]) -> VerifiedRows:
        """The first ``n`` requests' rows as ``VerifiedRows`` (in the buffers)."""
        k1 = self.tokens.shape[1]
        hidden = None if self.hidden is None else self.hidden[: n * k1]
        return VerifiedRows(self.tokens[:n], self.num[:n], hidden, rows, n, in_buffers=True)


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
        # rows of the newest step's requests that the next step leaves out (``_leaving``)
        self._left: VerifiedRows | None = None
        self.step_rows: CatchUpRows | None = None  # a captured step's (``reserve_step_rows``)

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
        return self._newest(VerifiedRows(tokens, out.accept_len + 1, hidden, rows, len(rows)))

    def replayed(self, requests: Sequence[object]) -> VerifiedRows:
        """``verified`` for a captured step: its rows are in the catch-up buffers."""
        rows = {r: b for b, r in enumerate(requests)}
        return self._newest(self.step_rows.view(len(requests), rows))

    def _newest(self, new: VerifiedRows) -> VerifiedRows:
        """``new`` and, after its rows, those ``_leaving`` kept of the step before."""
        left, self._left = self._left, None
        if left is None:
            self._verified = new
            return new
        n = len(new.num)
        new.rows.update((r, n + i) for r, i in left.rows.items())
        hidden = None if new.hidden is None else torch.cat([new.hidden, left.hidden])
        self._verified = VerifiedRows(
            torch.cat([new.tokens, left.tokens]),
            torch.cat([new.num, left.num]),
            hidden,
            new.rows,
            n,
        )
        return self._verified

    def _leaving(self, requests: Sequence[object]) -> None:
        """Before a speculative step of ``requests``: copy out the newest verify rows of the
        requests it leaves out that may run again (its rows may be overwritten by the step:
        ``in_buffers``); no step caught those up yet (the step runs only some of the last
        one's requests, as fault isolation's reruns of halves do), so their next catch-up
        still reads them. A request whose launched tokens reach its length
        (``length_reached``) runs no further step if it emits them all, which its read tells:
        under continuous batching a request gets there every few steps, so its rows are kept
        only where the step may overwrite them.
        """
        old, self._left = self._verified, None
        if old is None or not old.rows:
            return
        taken, aliased = set(requests), old.in_buffers
        left = [
            (r, b)
            for r, b in old.rows.items()
            if r not in taken and not r.finished and (aliased or not r.length_reached)
        ]
        if not left:
            return
        (index,) = upload(old.num.device, int64=([b for _, b in left],))  # NOTE: no sync
        k1, hidden = self.num_steps + 1, old.hidden
        if hidden is not None:
            rows = (index[:, None] * k1 + torch.arange(k1, device=index.device)).view(-1)
            hidden = hidden[rows]
        self._left = VerifiedRows(
            old.tokens[index], old.num[index], hidden, {r: i for i, (r, _) in enumerate(left)}
        )

    def checkpoint(self) -> object:
        return self._verified

    def rollback(self, checkpoint: object) -> None:
        """The newest verify rows are those before the failed step again (its catch-up rewrote
        draft K/V that a rerun rewrites the same).
        """
        self._verified, self._left = checkpoint, None  # type: ignore[assignment]

    def read(self, request: object, rows: object, row: int, start: int, num: int) -> None:
        """The host read verify rows ``rows`` (``VerifiedRows``): ``request`` (row ``row``)
        committed ``num`` tokens from position ``start``. A step launched since took them for
        its catch-up: the draft is valid up to the new length once it ran. Else they become
        host state, for a catch-up through the host.
        """
        assert isinstance(rows, VerifiedRows)
        newest, k1 = self._verified, self.num_steps + 1
        state = DraftState(computed=start - self.lag)
        if newest is not rows and newest is not None and request in newest.rows:
            carried = newest.rows[request]
            if carried < newest.own:  # taken: the draft is valid once that step ran
                request.draft_state = DraftState(computed=start + num - self.lag)
                return
            # carried: the next speculative step catches up from that copy, a plain one from
            # the host state, which reads the same copy
            rows, row = newest, carried
        else:
            rows.rows.pop(request, None)
        request.draft_state = state
        if rows.hidden is not None:
            if rows.in_buffers:  # NOTE: the next captured step overwrites them
                state.add(rows.hidden[row * k1 : row * k1 + num].clone())
            else:
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
        self._leaving(batch.requests)
        rows = self._catch_up_rows(batch)
        catch_up = build_padded_batch(
            ForwardMode.DRAFT_EXTEND,
            rows.tokens,
            rows.start,
            batch.page_table,
            self.runner.page_size,
            rows.bounds,
            num_valid=rows.num,
        )
        graphs = self.graphs
        if graphs is not None and graphs.can_run(catch_up):
            tree = graphs.run(catch_up, rows.hidden)
        else:
            tree = self.runner.propose(catch_up, rows.hidden, self.shape)
        return self._proposal(tree)

    def _proposal(self, tree: DraftTree) -> DraftProposal:
        drafts = tree.tokens
        num = torch.full(
            (drafts.shape[0],), drafts.shape[1], dtype=torch.int64, device=drafts.device
        )
        if self.shape.is_chain:
            return DraftProposal(drafts, num)
        return DraftProposal(
            drafts, num, parents=tree.parents, depths=tree.depths, tree_mask=tree.mask
        )

    def _catch_up_rows(self, batch: ProposeInput) -> _CatchUp:
        """Each request's catch-up rows: from the newest verify step's rows where it has them,
        else from its host state (after a DRAFT_EXTEND over all but its last k+1 rows where it
        is further behind).
        """
        reqs, verified = batch.requests, self._verified
        on_device = [verified is not None and r in verified.rows for r in reqs]
        for r, d in zip(reqs, on_device):
            if not d and r.draft_state is None:
                r.draft_state = DraftState()
        states = [None if d else r.draft_state for r, d in zip(reqs, on_device)]
        host = [(r, s) for r, s in zip(reqs, states) if s is not None]
        self._check_pending(host)
        self._catch_up_far_behind(host)
        if all(on_device):
            return self._catch_up_from_verified(batch)
        return self._catch_up_mixed(batch, states)

    # a captured speculative step (``SpecStepGraphs``) --------------------------------------

    def reserve_step_rows(self, max_bs: int) -> None:
        k1, device, head = self.num_steps + 1, self.runner.device, self.runner.draft
        hidden = None
        if self.uses_target_hidden:
            width = head.target_hidden_size
            hidden = torch.zeros(max_bs * k1, width, dtype=head.dtype, device=device)
        self.step_rows = CatchUpRows(
            torch.zeros(max_bs, k1, dtype=torch.int64, device=device),
            torch.zeros(max_bs, dtype=torch.int64, device=device),
            torch.ones(max_bs, dtype=torch.int64, device=device),
            hidden,
        )

    @torch.inference_mode()
    def prepare_replay(self, requests: Sequence[object]) -> None:
        """Unless the catch-up buffers hold the batch's rows already (the newest step replayed
        the same requests in the same order: the steady state), its catch-up rows go there
        (``_catch_up_rows``; requests far behind catch up first)."""
        self._leaving(requests)
        v = self._verified
        if (
            v is not None
            and v.in_buffers
            and len(v.rows) == len(requests)
            and all(a is b for a, b in zip(v.rows, requests))
        ):
            return
        batch = ProposeInput(requests, self.slots.seq_lens(requests))
        rows, buf, n = self._catch_up_rows(batch), self.step_rows, len(requests)
        buf.tokens[:n].copy_(rows.tokens)
        buf.start[:n].copy_(rows.start)
        buf.num[:n].copy_(rows.num)
        if buf.hidden is not None:
            buf.hidden[: rows.hidden.shape[0]].copy_(rows.hidden)

    def propose_captured(self, step: CapturedStep) -> DraftProposal:
        """The catch-up from the buffers (padding requests write and read no KV), then the
        draft levels: ``DraftRunner.propose`` at the step's length bound."""
        buf, k1, bs = self.step_rows, self.num_steps + 1, step.valid.shape[0]
        catch_up = build_padded_batch(
            ForwardMode.DRAFT_EXTEND,
            buf.tokens[:bs],
            buf.start[:bs],
            step.page_table,
            self.runner.page_size,
            (step.max_seq_len,) * bs,
            num_valid=buf.num[:bs],
            valid=step.valid,
        )
        hidden = None if buf.hidden is None else buf.hidden[: bs * k1]
        tree = self.runner.propose(catch_up, hidden, self.shape, capture_len=step.max_seq_len)
        return self._proposal(tree)

    def keep_captured(self, step: CapturedStep, out: object, hidden: torch.Tensor | None) -> None:
        """The next catch-up's rows into the buffers: this step's emitted tokens, their count
        and hidden rows, from its first emitted position (less the lag)."""
        buf, bs = self.step_rows, step.valid.shape[0]
        buf.tokens[:bs].copy_(torch.where(out.tokens < 0, FILLER_TOKEN, out.tokens))
        buf.num[:bs].copy_(out.accept_len + 1)
        buf.start[:bs].copy_(step.seq_lens - self.lag)
        if buf.hidden is not None:
            buf.hidden[: hidden.shape[0]].copy_(hidden)

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

    def _catch_up_from_verified(self, batch: ProposeInput) -> _CatchUp:
        """``_catch_up_mixed`` where every request catches up from the newest verify step's
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
        return _CatchUp(
            tokens,
            batch.seq_lens - num - self.lag,
            num,
            [r.num_tokens + k1 for r in batch.requests],
            hidden if self.uses_target_hidden else None,
        )

    def _catch_up_mixed(self, batch: ProposeInput, states: Sequence[DraftState | None]) -> _CatchUp:
        """The padded catch-up's rows: k+1 per request, the first ``behind`` real, the rest
        writing no KV (in the batch, ``logits_indices`` = each request's last real row). A
        request with host state (``states[b]``) takes its rows from the host; the others from
        the newest verify step's rows, on the device, starting ``num`` tokens before their
        length there (``batch.seq_lens``). The target hidden rows come in the same layout
        (None: not read).
        """
        reqs, seq_lens = batch.requests, batch.seq_lens
        k1, device = self.num_steps + 1, self.runner.device
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
        if not self.uses_target_hidden:
            return _CatchUp(input_ids, start, num, bounds, None)
        host = [s for s in states if s is not None]
        sources = [pending_rows(host, [s.num_pending for s in host])] if host else []
        if on_device:
            sources.append(self._verified.hidden)
        return _CatchUp(input_ids, start, num, bounds, torch.cat(sources)[src_rows.view(-1)])


class _CatchUp(NamedTuple):
    """A padded catch-up's rows (k+1 per request), before they become a batch."""

    tokens: torch.Tensor  # [B, k+1] int64 input ids
    start: torch.Tensor  # [B] int64 the first row's position
    num: torch.Tensor  # [B] int64 rows that write KV
    bounds: list[int]  # host bounds of start + k+1
    hidden: torch.Tensor | None  # [B * (k+1), Hh] target hidden rows
