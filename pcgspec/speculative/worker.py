"""The speculative step of a DECODE batch: propose -> verify -> accept -> commit/rollback.

The target scores ``[last token, d_0 .. d_{k-1}]`` per request in one ``TARGET_VERIFY`` pass
(a verify graph where one is captured). Row ``j`` of request ``b`` chooses output position
``num_output_tokens + j`` with the penalties as of that position, so a verify step emits
exactly the tokens that plain decoding would: greedy by argmax, seeded sampling by
``TARGET_MATCH`` (the target's own seeded draw must equal the deterministic draft).

A draft tree (``speculative_eagle_topk`` > 1, ``speculative/tree.py``) is verified the same way
over its N nodes: each at the position of its depth, under a tree attention mask, its row
drawing at its depth's output position; acceptance walks the tree, the accepted nodes' target
K/V move to the positions after the prefix, and the drafter catches up from the accepted path's
hidden rows. A chain is the tree of topk 1, with none of that.

The step runs on the device from what the device holds, so it is launched like a plain step
under the overlap schedule (engine/overlap.py) and its results are read one step late:

- the requests' lengths and last tokens come from their sampling slots (``seq_lens``,
  ``last_tokens``), which every step's commit advances on the device, so the verify batch's
  positions and KV slots are built there (``build_verify_batch``); only the page table, which
  the host reserves for the worst case, goes up, once for the draft's passes and the verify
  pass, and only when it changed (``_page_table``);
- the drafts stay on the device from propose to verify, and the rows' penalty counts take them
  in there (``SamplingSlots.rows``);
- after verification ``SamplingSlots.commit`` advances the slots by the accepted tokens, and a
  model drafter keeps the verified rows for the next step's catch-up (``Proposer.verified``);
- one device-to-host copy starts (``LaunchedSpecStep``): the accepted lengths, the number of
  drafts each request had and the tokens. Until it is read each request counts k+1 pending
  tokens, the most the step can emit, so that the scheduler reserves pages and stops
  scheduling at the length limit for the worst case; the read (``read``) appends what the step
  emitted up to the first stop, advances the requests' progress and frees the pages past their
  worst case.

Where its sampling allows (no penalties, filters or logprobs), a step is one replay of a whole
step graph (``SpecStepGraphs``): drafting, verify pass, acceptance, commit and the drafter's
rows for the next step, from the slots and page table and, for a model drafter, the catch-up
rows it keeps on the device (``Proposer.prepare_replay`` puts them there where the batch is not
the last step's). Other batches take the draft and verify graphs and accept eagerly.

A plain decode step (the caller's) runs instead when the policy (``SpecPolicy``) says
speculation does not pay, when a request wants logprobs (not computed for accepted drafts yet),
when a request would pass the context length, or when the KV pool cannot hold k more slots per
request. The choice comes before the tokens of the steps in flight are on the host, from
host state one step late. Model drafters see every target pass: plain ones through
``observe`` (the positions it computed and, for EAGLE3 / MTP, their hidden states; a plain
pass launched over a speculative step in flight once that step is read), verify passes through
``verified`` and ``read``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pcgspec.engine.request import Request, RequestStatus, SpecCounters
from pcgspec.engine.scheduler import ScheduledBatch, Scheduler
from pcgspec.kernels.padded_rows import VerifyTokens
from pcgspec.kernels.verify_draft_tokens import (
    VerifyOutput,
    VerifyStrategy,
    match_targets,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)
from pcgspec.runners.batch_builder import (
    build_verify_batch,
    device_page_table,
    padded_page_table,
)
from pcgspec.runners.decode_graph_runner import decode_batch_sizes
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.runners.model_runner import ForwardOutput, ModelRunner
from pcgspec.runners.spec_step_graphs import SpecStepGraphs, StepBatch
from pcgspec.sampling.batch import SamplingBatch
from pcgspec.sampling.sampler import process_logits
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.base import DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.draft_runner import DraftRunner
from pcgspec.speculative.model_proposer import ModelProposer
from pcgspec.speculative.ngram import NgramProposer
from pcgspec.speculative.policy import SpecPolicy
from pcgspec.speculative.tree import TreeShape, VerifyTree, path_rows


class SpecWorker:
    def __init__(
        self,
        config: SpeculativeConfig,
        runner: ModelRunner,
        scheduler: Scheduler,
        slots: SamplingSlots,
        eos_token_ids: frozenset[int],
        draft: DraftRunner | None = None,
    ) -> None:
        if (draft is None) != (config.algorithm == "NGRAM"):
            raise ValueError(f"{config.algorithm} needs a draft model exactly when it is not NGRAM")
        self.num_steps = config.num_steps
        self.shape = TreeShape(config.num_steps, config.topk, config.num_draft_tokens)
        self.slots_ahead = config.slots_ahead  # KV slots a step writes past a request's tokens
        self.runner = runner
        self.scheduler = scheduler
        self.slots = slots
        self.eos_token_ids = eos_token_ids
        if draft is not None:
            _check_topk(config.topk, draft)
        self.proposer: Proposer = (
            NgramProposer.from_config(config, slots)
            if draft is None
            else ModelProposer(draft, self.shape, slots)
        )
        self.policy = SpecPolicy(
            config.speculative_policy,
            config.num_steps,
            decode_batch_sizes(scheduler.max_running_requests),
        )
        self.stats = SpecCounters()  # summed over requests
        self.step_graphs: SpecStepGraphs | None = None  # whole steps as graphs (CUDA)
        self.num_fallbacks = 0  # plain steps for logprobs, the context length or KV space
        # the last step's padded page table and its upload (``_page_table``)
        self._last_pages: tuple[list[int], int] | None = None
        self._last_table: torch.Tensor | None = None
        self._unread = 0  # launched speculative steps not read yet
        # plain passes launched over them: (requests, tokens each, hidden states)
        self._observed: list[tuple[list[Request], list[int], torch.Tensor | None]] = []

    def observe(self, batch: ScheduledBatch, out: ForwardOutput) -> None:
        """A plain target pass ran ``batch`` (before ``Scheduler.launched``): tell the proposer
        which positions of each request it computed, with their hidden rows when captured.
        Over a speculative step in flight those positions follow its accepted tokens, which
        the host learns when it reads the step: the proposer hears of the pass then.
        """
        if self._unread:
            self._observed.append((batch.requests, batch.num_new_tokens, out.hidden_states))
            return
        starts = [r.num_computed_tokens for r in batch.requests]
        self.proposer.observe(batch.requests, starts, batch.num_new_tokens, out.hidden_states)

    def _observe_deferred(self) -> None:
        """The plain passes launched over speculative steps, now read: each request's pass
        started where its progress now ends, less the pass's own tokens (``launched`` counted
        them)."""
        observed, self._observed = self._observed, []
        for reqs, nums, hidden in observed:
            starts = [r.num_computed_tokens - n for r, n in zip(reqs, nums)]
            self.proposer.observe(reqs, starts, nums, hidden)

    def chooses(self, batch: ScheduledBatch | None) -> bool:
        """Whether ``batch`` takes a speculative step: a decode batch the policy chooses to
        speculate on, none of whose requests wants logprobs (not computed for accepted drafts
        yet) or would pass its context length, and whose pages can grow by the slots a step
        writes (``slots_ahead``) past their pending tokens (reserved here, so that a chosen
        step always launches).
        """
        if batch is None or not batch.mode.is_decode():
            return False
        reqs, ahead = batch.requests, self.slots_ahead
        if any(r.params.logprobs is not None or r.num_tokens + ahead > r.max_len for r in reqs):
            self.num_fallbacks += 1
            return False
        if not self.policy.choose(reqs):
            return False
        if not self.scheduler.reserve(list(reqs), [r.num_tokens + ahead for r in reqs]):
            self.num_fallbacks += 1  # the KV pool cannot hold k more slots per request
            return False
        return True

    def launch(self, batch: ScheduledBatch) -> LaunchedSpecStep:
        """Launch one speculative step of a batch ``chooses`` accepted; its tokens reach the
        requests when the returned step is read.
        """
        reqs = batch.requests
        page_table = self._page_table(reqs)
        graphs = self.step_graphs
        step = None if graphs is None else self._step_batch(reqs, page_table)
        if step is not None and graphs.can_run(step):
            self.proposer.prepare_replay(reqs)
            slots = self.slots.slot_indices(reqs)
            results = graphs.replay(slots, page_table, bool(step.flags["all_greedy"]))
            drafter_rows = self.proposer.replayed(reqs)
        else:
            results, drafter_rows = self._run(reqs, page_table)
        launched = LaunchedSpecStep.start(self, reqs, results, drafter_rows)
        self._unread += 1
        return launched

    def _step_batch(self, reqs: Sequence[Request], page_table: torch.Tensor) -> StepBatch:
        """What the step graphs' ``can_run`` asks of this batch."""
        bound = max(r.num_tokens for r in reqs) + self.slots_ahead + 1
        return StepBatch(len(reqs), self.slots.flags(reqs), page_table.shape[1], bound)

    def _run(
        self, reqs: Sequence[Request], page_table: torch.Tensor
    ) -> tuple[torch.Tensor, object]:
        """A step the step graphs do not serve: propose, verify (the draft and verify graphs
        where they serve it), accept and commit eagerly; its results and drafter rows."""
        seq_lens = self.slots.seq_lens(reqs)
        proposal = self.propose(ProposeInput(reqs, seq_lens, page_table))
        step = self.verify(reqs, seq_lens, page_table, proposal)
        # NOTE: a raise from here on is rolled back (run_isolated: slots and drafter rows)
        self.slots.commit(reqs, step.out.tokens, step.out.accept_len + 1)
        return step.results, self.proposer.verified(reqs, step.out, step.hidden)

    def _page_table(self, reqs: Sequence[Request]) -> torch.Tensor:
        """The requests' device page table, uploaded again only when it changed: a request
        gains a page every ``page_size`` tokens, so at small batches most steps reuse the last
        upload (the graphs and kernels only read it)."""
        pages = [r.pages for r in reqs]
        padded = padded_page_table(pages)
        if padded != self._last_pages:  # NOTE: both set after the upload (it may raise)
            table = device_page_table(pages, self.runner.device, padded)
            self._last_pages, self._last_table = padded, table
        return self._last_table  # type: ignore[return-value]

    # propose -----------------------------------------------------------------------------

    def propose(self, batch: ProposeInput) -> DraftProposal:
        return self.proposer.propose(batch)

    # verify ------------------------------------------------------------------------------

    def verify(
        self,
        reqs: Sequence[Request],
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        proposal: DraftProposal,
    ) -> VerifiedStep:
        """One TARGET_VERIFY pass over k+1 tokens per request (``seq_lens``, ``page_table``:
        their token counts and pages on the device; a verify graph replays it where one
        serves the batch), then acceptance, eagerly.
        """
        drafts = proposal.tokens.to(self.runner.device, non_blocking=True)  # [B, N-1]
        tree = None
        if proposal.parents is not None:
            tree = VerifyTree.of(
                proposal.parents, proposal.depths, self.num_steps, proposal.tree_mask
            )
        bounds = [r.num_tokens + self.slots_ahead for r in reqs]
        graphs = self.runner.verify_graphs
        rows = (
            None if graphs is None else graphs.rows_for(len(reqs), page_table.shape[1], max(bounds))
        )
        ancestors = None if tree is None else tree.mask
        sampling = self.slots.rows(reqs, drafts, ancestors)
        batch = build_verify_batch(
            VerifyTokens(self.slots.last_token, self.slots.slot_indices(reqs), drafts),
            seq_lens,
            page_table,
            self.runner.page_size,
            bounds,
            rows,
            row_offsets=None if tree is None else tree.row_offsets,
            sampling=sampling,
            capture_hidden_mode=self.runner.capture_hidden_mode(ForwardMode.TARGET_VERIFY),
            tree_mask=None if tree is None else tree.mask,
        )
        out = self.runner.forward(batch)
        verified = self._accept(out.logits, sampling, drafts, proposal.num_tokens, tree)
        results = torch.cat(
            [verified.accept_len[:, None], proposal.num_tokens[:, None], verified.tokens], 1
        )
        if tree is not None:
            self._keep_accepted(seq_lens, page_table, verified.path)
        hidden = _path_hidden(out.hidden_states, verified, drafts.shape[1] + 1)
        return VerifiedStep(verified, hidden, results)

    def _keep_accepted(
        self, seq_lens: torch.Tensor, page_table: torch.Tensor, path: torch.Tensor
    ) -> None:
        """Move the accepted tree nodes' target K/V to the positions after the prefix."""
        start = seq_lens.to(torch.int64) - 1  # the root's position (the last token's)
        self.runner.move_accepted_kv(page_table, start, path)

    def _accept(
        self,
        logits: torch.Tensor,
        sampling: SamplingBatch,
        drafts: torch.Tensor,
        num_drafts: torch.Tensor,
        tree: VerifyTree | None = None,
    ) -> VerifyOutput:
        """The verify kernel over a verify pass's logits [B * N, V] (N = k+1 for a chain),
        eagerly; a tree's rows draw at the output positions of their depths."""
        b, n = drafts.shape[0], drafts.shape[1] + 1
        with torch.inference_mode():
            processed = process_logits(logits, sampling)
            verify = (
                verify_draft_tokens if logits.device.type == "cuda" else verify_draft_tokens_ref
            )
            position = sampling.position.view(b, n)
            kw = {}
            if tree is not None:
                position = position + tree.row_offsets
                kw = dict(parents=tree.parents, max_depth=tree.max_depth)
            if sampling.all_greedy:
                target, strategy = processed, VerifyStrategy.GREEDY
            else:
                target = match_targets(processed, sampling.is_greedy)
                strategy = VerifyStrategy.TARGET_MATCH
                kw["is_greedy"] = sampling.is_greedy.view(b, n)[:, 0].contiguous()
            return verify(
                target.view(b, n, -1),
                drafts,
                strategy,
                seed=sampling.seed.view(b, n),
                position=position,
                num_draft=num_drafts,
                **kw,
            )

    # read: accept + commit / rollback on the host ----------------------------------------

    def read(self, step: LaunchedSpecStep) -> list[Request]:
        """The host side of a launched step: wait for its results (per request the accepted
        length, the drafts it had, then its k+1 tokens), append the accepted drafts
        and the next token, stopping at the first finish (EOS, stop token or string,
        max_tokens), advance the requests' progress, hand the drafter what it needs and keep
        only the pages of the committed tokens and of the steps still in flight. A request
        that finished meanwhile (its stop was read one step late, or it was aborted or
        failed) drops its results. Returns the requests that took tokens. Once no speculative
        step is left unread, the drafter hears of the plain passes launched over them.
        """
        self._unread -= 1
        try:
            step.wait()
            return self._commit(step, step.results.tolist())
        finally:
            if not self._unread:
                self._observe_deferred()

    def _commit(self, step: LaunchedSpecStep, rows: list[list[int]]) -> list[Request]:
        k1, took = self.num_steps + 1, []
        for b, (req, (accept_len, drafted, *tokens)) in enumerate(zip(step.requests, rows)):
            req.num_pending_tokens -= k1
            if req.finished:
                continue
            req.spec.record(accept_len, self.num_steps)
            self.stats.record(accept_len, self.num_steps)
            self.policy.record_drafted(req, drafted > 0)
            if drafted:
                self.policy.record_accept(req, accept_len + 1)
            start, n = len(req.token_ids), 0
            preempted = req.status is RequestStatus.WAITING  # meanwhile: its KV is gone
            for token in tokens[: accept_len + 1]:
                req.append_token(token, self.eos_token_ids)
                n += 1
                if req.finished:
                    break
            if not preempted:
                req.num_computed_tokens += n  # the K/V of the input token and accepted drafts
            if not (preempted or req.finished):
                # NOTE: rejected slots are overwritten by later steps.
                self.scheduler.trim(req, req.num_tokens)
                self.proposer.read(req, step.drafter_rows, b, start, n)
            took.append(req)
        return took


@dataclass(frozen=True)
class VerifiedStep:
    """A verify pass and its acceptance, launched: ``out`` and ``results`` (``[B, 2 + k+1]``:
    accepted length, drafts had, tokens) on the device and the pass's captured hidden states
    (``[B * (k+1), Hh]`` or None)."""

    out: VerifyOutput
    hidden: torch.Tensor | None
    results: torch.Tensor


class LaunchedSpecStep:
    """A launched speculative step: its requests and its results on their way to the host
    (``[B, 2 + k+1]``: accepted length, drafts had, tokens), like ``LaunchedStep``;
    ``drafter_rows``: what the proposer kept of its verify pass (``Proposer.verified``).
    """

    def __init__(
        self,
        worker: SpecWorker,
        requests: list[Request],
        results: torch.Tensor,
        ready: torch.cuda.Event | None,
        drafter_rows: object,
    ) -> None:
        self.worker, self.requests, self.results, self.ready = worker, requests, results, ready
        self.drafter_rows = drafter_rows

    @classmethod
    def start(
        cls,
        worker: SpecWorker,
        reqs: Sequence[Request],
        results: torch.Tensor,
        drafter_rows: object,
    ) -> LaunchedSpecStep:
        """Start copying ``results`` (``[B, 2 + k+1]`` on the device) to the host."""
        cuda = results.is_cuda
        # NOTE: the step's one copy back (a copy on CPU too: results may be graph memory)
        results = results.to("cpu", non_blocking=True, copy=True)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        for req in reqs:
            req.num_pending_tokens += worker.num_steps + 1
        return cls(worker, list(reqs), results, ready, drafter_rows)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def read(self, eos_token_ids: frozenset[int]) -> list[Request]:
        """Wait for the results and commit them (``SpecWorker.read``)."""
        return self.worker.read(self)


def _path_hidden(
    hidden: torch.Tensor | None, verified: VerifyOutput, num_nodes: int
) -> torch.Tensor | None:
    """A verify pass's hidden rows (N per request) along the accepted paths, ``[B * (k+1),
    Hh]``; a chain's as they are."""
    if hidden is None or verified.path is None:
        return hidden
    return path_rows(hidden, verified.path, num_nodes)


def _check_topk(topk: int, draft: DraftRunner) -> None:
    """Each tree level takes the topk best tokens of the draft's vocabulary."""
    vocab = draft.scored_vocab_size
    if topk > vocab:
        raise ValueError(
            f"speculative_eagle_topk {topk} exceeds the draft vocabulary of {vocab} tokens"
        )
