"""The tail of a speculative step as CUDA graphs: LM head, acceptance and commit, captured per
batch-size bucket behind the verify graphs.

A verify graph replays the decoder over k+1 rows per request and leaves the hidden states in its
static buffer. The tail graph of the same bucket reads them there and runs, with no host work
between the launches: the LM head over every row, the target rows (GREEDY: the logits; SAMPLED:
``softmax(logits / temperature)`` for sampled rows and the logits for greedy ones, whose
requests take the argmax), ``verify_draft_tokens``, the commit of the emitted tokens into the
sampling slots (``advance_positions``: counters, last tokens, token history) and the step's
results row ``[accept_len, num_drafts, tokens]`` that the host copies back. A speculative step
then costs the host a few copies into static buffers and two graph launches instead of a dozen
launches and their checks.

A batch takes the tail only where its verify pass replayed a graph and its sampling needs no
penalties, no top-k/top-p/min-p filters and no logprobs; otherwise the caller runs the same
steps eagerly (``can_run`` refuses and counts why). The sampling parameters of each row come
from the slot tables inside the graph, so a greedy request and a sampled one share a bucket.

Draft trees (verify graphs captured with a tree mask) take the same tail with their parents and
depths in static buffers: rows draw at the output positions of their depths, acceptance walks
the trees, and the accepted nodes' target K/V move into place (``move_accepted_kv``) inside
the graph, through the verify graph's page table and lengths.

Requests past a batch in its bucket are padding: slot -1, which the commit skips; their rows'
results are never read. Off CUDA the eager stand-in reruns the captured step (tests).
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
from pcgspec.kernels.verify_draft_tokens import (
    VerifyOutput,
    VerifyStrategy,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)
from pcgspec.progress import progress
from pcgspec.runners.decode_graph_runner import capture_stream
from pcgspec.runners.refusals import GuardedRunner
from pcgspec.sampling.batch import GREEDY_EPS
from pcgspec.speculative.tree import VerifyTree, move_accepted_kv

if TYPE_CHECKING:
    from pcgspec.runners.decode_graph_runner import DecodeGraphRunner
    from pcgspec.sampling.slots import SamplingSlots

logger = logging.getLogger(__name__)
GREEDY, SAMPLED = "greedy", "sampled"


class TailBatch(NamedTuple):
    """What ``can_run`` asks of a verify pass: its size, its sampling's host flags
    (``SamplingSlots.flags``) and whether a verify graph replays its decoder
    (``DecodeGraphRunner.rows_for`` gave its rows)."""

    batch_size: int
    flags: dict[str, bool | int | None]
    graph_replays: bool
    tree: bool = False  # draft trees


class VerifyTailGraphs(GuardedRunner):
    """Tail graphs for ``verify_graphs`` (a TARGET_VERIFY ``DecodeGraphRunner``), committing
    into ``slots``; ``compute_logits`` is the target's LM head (hidden [R, H] -> [R, V] f32);
    ``depth``: the draft trees' depth k where the verify graphs are tree graphs (N rows per
    request), else k+1 rows per request make a chain of k.
    """

    reasons = ("no_verify_graph", "tree", "penalties", "filters", "logprobs")

    def __init__(
        self,
        verify_graphs: DecodeGraphRunner,
        slots: SamplingSlots,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        depth: int | None = None,
    ) -> None:
        super().__init__()
        self.verify_graphs, self.slots, self.compute_logits = verify_graphs, slots, compute_logits
        self.k1 = verify_graphs.tokens_per_seq  # rows per request (N for trees)
        self.tree = verify_graphs.tree_mask is not None
        if self.tree and depth is None:
            raise ValueError("tree verify graphs need the trees' depth")
        self.depth = depth if self.tree else self.k1 - 1
        self.batch_sizes = sorted(verify_graphs.graphs)
        self.device = verify_graphs.device
        max_bs, k1, device = verify_graphs.max_bs, self.k1, self.device

        def full(value: int, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=torch.int64, device=device)

        self.req_slots = full(-1, max_bs)  # -1: padding, committed nowhere
        self.drafts = full(0, max_bs, k1 - 1)
        self.num_drafts = full(0, max_bs)
        self.results = full(0, max_bs, 3 + self.depth)  # accept_len, num_drafts, k+1 tokens
        # each row's output position past the request's: j (a chain), its depth (a tree)
        self.depths = torch.arange(k1, device=device).repeat(max_bs, 1)  # [max_bs, k1]
        self.parents = (self.depths - 1).contiguous()  # a chain until a tree is copied in
        self.path = full(-1, max_bs, self.depth + 1)
        self.graphs: dict[tuple[str, int], _CudaGraph | _EagerGraph] = {}
        cuda = device.type == "cuda"
        self._verify = verify_draft_tokens if cuda else verify_draft_tokens_ref
        self._advance = advance_positions if cuda else advance_positions_ref

    @torch.inference_mode()
    def capture(self) -> None:
        """Both variants of every bucket that has a verify graph, into the verify graphs' pool."""
        start = time.perf_counter()
        on_cuda = self.device.type == "cuda"
        self.req_slots.fill_(-1)  # NOTE: warm-ups and captures must commit nothing
        keys = [(v, bs) for bs in self.batch_sizes[::-1] for v in (GREEDY, SAMPLED)]
        with capture_stream(self.device):
            for variant, bs in progress(keys, desc="Capturing verify tail graphs", unit="graph"):
                self._step(variant, bs)  # compiles the Triton kernels outside the capture
                graph = _CudaGraph(self.verify_graphs.pool) if on_cuda else _EagerGraph()
                graph.capture(self._step, (variant, bs))
                self.graphs[(variant, bs)] = graph
        logger.info(
            "Captured %d verify tail graphs in %.1f s", len(keys), time.perf_counter() - start
        )

    def _step(self, variant: str, bs: int) -> torch.Tensor:
        """The captured region of bucket ``bs``: LM head, acceptance, commit, results."""
        k1, slots = self.k1, self.slots
        logits = self.compute_logits(self.verify_graphs.outputs[bs].hidden)  # [bs * k1, V]
        req_slots, drafts, num = self.req_slots[:bs], self.drafts[:bs], self.num_drafts[:bs]
        out = VerifyOutput(self.results[:bs, 0], self.results[:bs, 2:])
        tree = {}
        if self.tree:
            tree = {"parents": self.parents[:bs], "max_depth": self.depth}
        if variant == GREEDY:
            verified = self._verify(
                logits.view(bs, k1, -1), drafts, VerifyStrategy.GREEDY, num_draft=num, **tree
            )
        else:
            table = slots.table
            rows = req_slots.clamp_min(0).repeat_interleave(k1)  # [bs * k1] each row's slot
            temperature = table.temperature[rows]
            greedy = temperature < GREEDY_EPS
            probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], -1)
            target = torch.where(greedy[:, None], logits, probs)  # greedy rows: argmax
            position = table.position[rows] + self.depths[:bs].reshape(-1)
            verified = self._verify(
                target.view(bs, k1, -1),
                drafts,
                VerifyStrategy.TARGET_MATCH,
                seed=table.seed[rows].view(bs, k1),
                position=position.view(bs, k1),
                num_draft=num,
                is_greedy=greedy.view(bs, k1)[:, 0].contiguous(),
                **tree,
            )
        out.accept_len.copy_(verified.accept_len)
        out.tokens.copy_(verified.tokens)
        if self.tree:
            self.path[:bs].copy_(verified.path)
            self._move_accepted_kv(bs)
        self.results[:bs, 1].copy_(num)
        slots.save_before_commit()
        self._advance(
            slots.table.position,
            out.accept_len + 1,
            req_slots,
            tokens=out.tokens,
            **slots.commit_tables(),
        )
        return self.results[:bs]

    def _move_accepted_kv(self, bs: int) -> None:
        """The accepted nodes' K/V to the positions after the prefix: the verify graph's rows
        started at ``seq_len - N`` (padding requests: seq_len 0, moved nowhere)."""
        graphs = self.verify_graphs
        buffers = graphs.buffers
        start = buffers.seq_lens[:bs].to(torch.int64) - self.k1
        move_accepted_kv(
            graphs.attn_backend.kv_cache, buffers.page_table[:bs], start, self.path[:bs]
        )

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def _refusal(self, batch: TailBatch) -> str | None:
        flags = batch.flags
        if not batch.graph_replays or pad_to_bucket(batch.batch_size, self.batch_sizes) is None:
            return "no_verify_graph"
        if batch.tree != self.tree:
            return "tree"
        if flags["needs_penalties"]:
            return "penalties"
        if flags["needs_filters"]:
            return "filters"
        if flags["max_logprobs"] is not None:
            return "logprobs"
        return None

    @torch.inference_mode()
    def replay(
        self,
        req_slots: torch.Tensor,
        drafts: torch.Tensor,
        num_drafts: torch.Tensor,
        all_greedy: bool,
        tree: VerifyTree | None = None,
    ) -> tuple[torch.Tensor, VerifyOutput]:
        """Accept and commit the verify pass just replayed for the requests in ``req_slots``
        [B] with ``drafts`` [B, k] (``num_drafts`` [B] real; ``tree``: their draft trees):
        the step's results ``[B, 2 + k+1]`` and its ``VerifyOutput``, graph memory that the
        next replay overwrites.
        """
        n = req_slots.shape[0]
        bs = pad_to_bucket(n, self.batch_sizes)
        self.req_slots[:n].copy_(req_slots)
        if bs > n:
            self.req_slots[n:bs].fill_(-1)
        self.drafts[:n].copy_(drafts)
        self.num_drafts[:n].copy_(num_drafts)
        if tree is not None:
            self.parents[:n].copy_(tree.parents)
            self.depths[:n].copy_(tree.depths)
        self.graphs[(GREEDY if all_greedy else SAMPLED, bs)].replay()
        self.slots.mark_commit(req_slots)
        self._count_run(padded_rows=(bs - n) * self.k1)
        path = self.path[:n] if self.tree else None
        return self.results[:n], VerifyOutput(self.results[:n, 0], self.results[:n, 2:], path)
