"""A whole speculative step as one CUDA graph per batch-size bucket: drafting, the verify pass,
acceptance and commit, with no host work between them.

A speculative step at a small batch is bound by the host: the GPU has about 1.2 ms of work in a
SmolLM2 EAGLE3 step, and launching the draft, verify and tail graphs with the eager work between
them (the catch-up and verify batches, copies into static buffers, checks) took the host longer.
Here one replay runs, per bucket of ``bs`` requests (those past the batch padding):

1. the requests' lengths from their sampling slots (``SamplingSlots.lengths``);
2. the proposer's drafting from device state (``Proposer.propose_captured``): a model drafter
   catches up from the rows the last step left in its buffers and drafts its levels; prompt
   lookup searches the slots' token history;
3. the verify pass: its rows (``[last token, drafts]`` per request; a draft tree's nodes at
   their depths, under its ancestor mask) built on the device, then the verify graph's
   decoder step (``DecodeGraphRunner.decoder_step``);
4. the LM head over every row, the target rows (GREEDY: the logits; SAMPLED: the eager
   path's ``match_targets`` of the temperature-scaled logits), ``verify_draft_tokens``, for a
   tree the accepted nodes' K/V moved into place, the commit of the emitted tokens into the
   sampling slots
   (``advance_positions``) and the step's results row ``[accept_len, num_drafts, tokens]``;
5. what the next step's drafting reads (``Proposer.keep_captured``: the emitted tokens and
   their hidden rows).

The host copies the requests' slots and page table into static buffers when they changed and,
where the last step did not leave this batch's catch-up rows in place (another batch, plain
steps in between), the proposer's rows (``Proposer.prepare_replay``); then one graph launch.

A batch takes it where its sampling needs no penalties, no top-k/top-p/min-p filters and no
logprobs (these run the draft and verify graphs and accept eagerly: ``can_run`` refuses and
counts why) and its lengths stay within the graphs' bound. The sampling parameters of each row
come from the slot tables inside the graph, so a greedy request and a sampled one share a
bucket. Padding requests have slot -1: their rows write no KV and read none, the commit skips
them and their results are never read. Off CUDA the eager stand-in reruns the captured step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.compile.piecewise import _CudaGraph, _EagerGraph
from pcgspec.kernels.build_sampling_params import advance_positions, advance_positions_ref
from pcgspec.kernels.padded_rows import VerifyTokens
from pcgspec.kernels.verify_draft_tokens import (
    VerifyOutput,
    VerifyStrategy,
    match_targets,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)
from pcgspec.progress import progress
from pcgspec.runners.batch_builder import build_verify_batch
from pcgspec.runners.forward_batch import ForwardBatch
from pcgspec.runners.refusals import GuardedRunner
from pcgspec.runners.whole_graphs import capture_stream
from pcgspec.sampling.batch import GREEDY_EPS
from pcgspec.sampling.sampler import scale_by_temperature
from pcgspec.speculative.base import CapturedStep, DraftProposal
from pcgspec.speculative.tree import VerifyTree, move_accepted_kv, path_rows

if TYPE_CHECKING:
    from pcgspec.runners.decode_graph_runner import DecodeGraphRunner
    from pcgspec.sampling.slots import SamplingSlots
    from pcgspec.speculative.base import Proposer

logger = logging.getLogger(__name__)
GREEDY, SAMPLED = "greedy", "sampled"


class StepBatch(NamedTuple):
    """What ``can_run`` asks of a speculative step: its size, its sampling's host flags
    (``SamplingSlots.flags``), its page table's width and a bound of every length in it."""

    batch_size: int
    flags: dict[str, bool | int | None]
    max_pages: int
    max_seq_len: int


class SpecStepGraphs(GuardedRunner):
    """Speculative steps of ``proposer`` over ``verify_graphs``' buckets (a TARGET_VERIFY
    ``DecodeGraphRunner``, whose decoder step and memory pool they share), committing into
    ``slots``; ``compute_logits`` is the target's LM head (hidden [R, H] -> [R, V] f32);
    ``depth``: the drafts' depth k (N rows per request verify a tree of that depth; k+1 rows
    a chain of k).
    """

    reasons = ("not_captured", "batch_size", "seq_len", "penalties", "filters", "logprobs")

    def __init__(
        self,
        verify_graphs: DecodeGraphRunner,
        proposer: Proposer,
        slots: SamplingSlots,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        depth: int,
    ) -> None:
        super().__init__()
        self.verify_graphs, self.proposer, self.slots = verify_graphs, proposer, slots
        self.compute_logits = compute_logits
        self.n = verify_graphs.tokens_per_seq  # rows per request
        self.depth = depth
        self.batch_sizes = verify_graphs.batch_sizes
        self.max_bs, self.max_pages = verify_graphs.max_bs, verify_graphs.max_pages
        self.max_seq_len, self.page_size = verify_graphs.max_seq_len, verify_graphs.page_size
        self.device = device = verify_graphs.device
        self.req_slots = torch.full((self.max_bs,), -1, dtype=torch.int64, device=device)
        self.page_table = torch.zeros(self.max_bs, self.max_pages, dtype=torch.int32, device=device)
        self.results = torch.zeros(self.max_bs, 3 + depth, dtype=torch.int64, device=device)
        self.chain_depths = torch.arange(self.n, device=device).repeat(self.max_bs, 1)
        self.graphs: dict[tuple[str, int], _CudaGraph | _EagerGraph] = {}
        # the slot indices and page table (host-side tensors) the buffers hold, and for how
        # many requests: the next replay of the same copies nothing
        self._loaded: tuple[torch.Tensor | None, torch.Tensor | None, int] = (None, None, 0)
        cuda = device.type == "cuda"
        self._verify = verify_draft_tokens if cuda else verify_draft_tokens_ref
        self._advance = advance_positions if cuda else advance_positions_ref
        proposer.reserve_step_rows(self.max_bs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Both variants of every bucket, into the verify graphs' pool."""
        start = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        self.req_slots.fill_(-1)  # NOTE: warm-ups and captures must write and commit nothing
        self._loaded = (None, None, 0)
        keys = [(v, bs) for bs in self.batch_sizes[::-1] for v in (GREEDY, SAMPLED)]
        with capture_stream(self.device):
            for variant, bs in progress(keys, desc="Capturing speculative steps", unit="graph"):
                self._step(variant, bs)  # compiles what the step's kernels need, uncaptured
                graph = _CudaGraph(self.verify_graphs.pool) if on_cuda else _EagerGraph()
                graph.capture(self._step, (variant, bs))
                self.graphs[(variant, bs)] = graph
        logger.info(
            "Captured %d speculative step graphs in %.1f s", len(keys), time.perf_counter() - start
        )

    def _step(self, variant: str, bs: int) -> torch.Tensor:
        """The captured region of bucket ``bs``."""
        req_slots = self.req_slots[:bs]
        valid = req_slots >= 0
        slot = req_slots.clamp_min(0)
        step = CapturedStep(
            slot, valid, self.slots.lengths(slot), self.page_table[:bs], self.max_seq_len
        )
        proposal = self.proposer.propose_captured(step)
        tree = None
        if proposal.parents is not None:
            tree = VerifyTree.of(proposal.parents, proposal.depths, self.depth, proposal.tree_mask)
        batch = self._verify_batch(step, proposal, tree)
        hidden, aux, _ = self.verify_graphs.decoder_step(batch)
        out = self._accept_and_commit(variant, step, batch, hidden, proposal, tree)
        captured = aux if aux is not None else hidden
        if out.path is not None:
            captured = path_rows(captured, out.path, self.n)
        self.proposer.keep_captured(step, out, captured)
        return self.results[:bs]

    def _verify_batch(
        self, step: CapturedStep, proposal: DraftProposal, tree: VerifyTree | None
    ) -> ForwardBatch:
        """``[last token, drafts]`` per request from position ``seq_len - 1`` (a tree's nodes
        at their depths); padding requests write no KV and read none."""
        bs = step.valid.shape[0]
        return build_verify_batch(
            VerifyTokens(self.slots.last_token, step.slots, proposal.tokens.contiguous()),
            step.seq_lens,
            step.page_table,
            self.page_size,
            (self.max_seq_len,) * bs,
            row_offsets=None if tree is None else tree.row_offsets,
            valid=step.valid,
            capture_hidden_mode=self.verify_graphs.capture_hidden_mode,
            tree_mask=None if tree is None else tree.mask,
        )

    def _accept_and_commit(
        self,
        variant: str,
        step: CapturedStep,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        proposal: DraftProposal,
        tree: VerifyTree | None,
    ) -> VerifyOutput:
        """LM head, acceptance, the accepted nodes' K/V (a tree), commit and results."""
        bs, n, slots = step.valid.shape[0], self.n, self.slots
        logits = self.compute_logits(hidden)  # [bs * n, V]
        drafts, num = proposal.tokens, proposal.num_tokens
        out = VerifyOutput(self.results[:bs, 0], self.results[:bs, 2:])
        tree_kw = {} if tree is None else {"parents": tree.parents, "max_depth": self.depth}
        if variant == GREEDY:
            verified = self._verify(
                logits.view(bs, n, -1), drafts, VerifyStrategy.GREEDY, num_draft=num, **tree_kw
            )
        else:
            table = slots.table
            rows = step.slots.repeat_interleave(n)  # [bs * n] each row's slot
            temperature = table.temperature[rows]
            greedy = temperature < GREEDY_EPS
            target = match_targets(scale_by_temperature(logits, temperature), greedy)
            depths = self.chain_depths[:bs] if tree is None else tree.depths
            position = table.position[rows] + depths.reshape(-1)
            verified = self._verify(
                target.view(bs, n, -1),
                drafts,
                VerifyStrategy.TARGET_MATCH,
                seed=table.seed[rows].view(bs, n),
                position=position.view(bs, n),
                num_draft=num,
                is_greedy=greedy.view(bs, n)[:, 0].contiguous(),
                **tree_kw,
            )
        out.accept_len.copy_(verified.accept_len)
        out.tokens.copy_(verified.tokens)
        if tree is not None:  # the pass's rows started at seq_len - n (padding: < 0, moved nowhere)
            start = batch.seq_lens.to(torch.int64) - n
            move_accepted_kv(
                self.verify_graphs.attn_backend.kv_cache, step.page_table, start, verified.path
            )
        self.results[:bs, 1].copy_(num)
        slots.save_before_commit()
        self._advance(
            slots.table.position,
            out.accept_len + 1,
            self.req_slots[:bs],
            tokens=out.tokens,
            **slots.commit_tables(),
        )
        return VerifyOutput(out.accept_len, out.tokens, verified.path)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def _refusal(self, batch: StepBatch) -> str | None:
        flags = batch.flags
        if not self.graphs:
            return "not_captured"
        if pad_to_bucket(batch.batch_size, self.batch_sizes) is None:
            return "batch_size"
        if batch.max_pages > self.max_pages or batch.max_seq_len > self.max_seq_len:
            return "seq_len"
        if flags["needs_penalties"]:
            return "penalties"
        if flags["needs_filters"]:
            return "filters"
        if flags["max_logprobs"] is not None:
            return "logprobs"
        return None

    @torch.inference_mode()
    def replay(
        self, req_slots: torch.Tensor, page_table: torch.Tensor, all_greedy: bool
    ) -> torch.Tensor:
        """One speculative step of the requests in ``req_slots`` [B] (their pages:
        ``page_table`` [B, P]; ``can_run`` held; the proposer prepared): its results
        ``[B, 2 + k+1]``, graph memory that the next replay overwrites.
        """
        n = req_slots.shape[0]
        bs = pad_to_bucket(n, self.batch_sizes)
        loaded_slots, loaded_table, loaded_n = self._loaded
        if req_slots is not loaded_slots or n != loaded_n:
            self.req_slots[:n].copy_(req_slots)
            if bs > n:
                self.req_slots[n:bs].fill_(-1)
        if page_table is not loaded_table or n != loaded_n:
            self.page_table[:n, : page_table.shape[1]].copy_(page_table)
        self._loaded = (req_slots, page_table, n)
        self.graphs[(GREEDY if all_greedy else SAMPLED, bs)].replay()
        self.slots.mark_commit(req_slots)
        self._count_run(padded_rows=(bs - n) * self.n)
        return self.results[:n]
