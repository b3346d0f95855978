"""Extend graphs: the whole decoder, attention included, as one CUDA graph per token bucket, for
EXTEND batches up to ``extend_cuda_graph_max_tokens`` tokens (short prefills, chunks, and the
mixed steps that admit a request beside the running ones).

A piecewise replay launches each layer's attention from the host between its pieces; at a few
dozen tokens that host work, not the GPU, sets the pass's time (a served arrival's mixed step at
16 in flight: 30 eager attention launches of about 1 ms on the host, against 0.2 ms of piece
replays). An extend graph captures the attention too, which needs a launch that does not depend
on the batch's composition: a bucket of ``T`` tokens holds up to ``R - 1`` requests, and its
static buffers hold the batch's requests, then one padding request that owns the padded rows
(no prefix and no KV write: the Triton kernel, which reads a pass's new keys from its rows,
attends it over its own rows, so every row is finite), then empty requests up to ``R``
(``pad_batch``'s ``PaddedRequests``, one launch). The fused extend kernel is planned for one
request owning all ``T`` rows: that grid covers any split of the rows among the ``R`` requests,
and empty requests' programs return at once. The prefix is never split in a graph, so batches
whose longest prefix the piecewise plan may split go there instead.

A replay fills the static buffers (one launch: ``pad_batch``, with the page table and the
sampled rows) and replays the bucket's graph, which computes the sampled rows' logits too; the
outputs are graph memory, overwritten by the next replay (consume or copy them first). What
the piecewise runner refuses, more requests than the bucket holds and long prefixes go to the
piecewise runner (or run eagerly), counted by reason.
Off CUDA ``_EagerGraph`` stands in for the CUDA graph, so capture and replay are tested on CPU.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pcgspec.compile.buckets import capture_buckets, pad_to_bucket
from pcgspec.kernels.extend_attention import MIN_PREFIX_SPLIT
from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch, pad_batch_ref
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.runners.refusals import prefill_input_refusal
from pcgspec.runners.whole_graphs import GraphOutput, WholeGraphRunner

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig
    from pcgspec.runners.model_runner import ModelRunner

logger = logging.getLogger(__name__)

MAX_REQUESTS = 32  # requests a bucket holds at most: the grid grows with it, mostly idle
LONG_PREFIX = 2 * MIN_PREFIX_SPLIT  # the piecewise plan may split a prefix this long


def max_extend_requests(config: EngineConfig) -> int:
    """The most requests an extend graph's batch holds (the padding one not counted)."""
    return min(MAX_REQUESTS, config.max_running_requests)


class ExtendGraphRunner(WholeGraphRunner):
    """Captures and replays whole EXTEND passes of ``model_runner``'s decoder per token bucket
    up to ``max_tokens``.
    """

    reasons = (
        "not_captured",
        "mode",
        "too_many_tokens",
        "too_many_requests",
        "hidden_mode",
        "input_embeds",
        "input_logprobs",
        "long_prefix",
        "seq_len",
    )

    def __init__(self, model_runner: ModelRunner, max_tokens: int) -> None:
        super().__init__(model_runner)
        config = model_runner.config
        self.hidden_mode = model_runner.extend_capture_hidden_mode
        self.buckets = capture_buckets(max_tokens, config.piecewise_cuda_graph_tokens)
        if not self.buckets:
            raise ValueError(
                f"piecewise_cuda_graph_tokens {config.piecewise_cuda_graph_tokens} has no bucket "
                f"<= the extend graphs' {max_tokens} tokens"
            )
        self.max_requests = max_extend_requests(config)
        rows, reqs = self.buckets[-1], self.requests(self.buckets[-1]) + 1

        def buffer(value: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=self.device)

        self.input_ids = buffer(0, torch.int64, rows)
        self.positions = buffer(0, torch.int64, rows)
        self.out_cache_loc = buffer(-1, torch.int64, rows)
        self.seq_lens = buffer(0, torch.int32, reqs)
        self.extend_lens = buffer(0, torch.int32, reqs)
        self.extend_start = buffer(0, torch.int32, reqs)
        self.page_table = buffer(0, torch.int32, reqs, self.max_pages)
        # NOTE: the sampled rows, one per request at most; a bucket's graph computes the logits
        # of its first ``requests(bucket)`` entries (stale ones are clamped into the bucket)
        self.logits_rows = buffer(0, torch.int64, self.max_requests)
        self.logits_out = self._logits_buffer(self.max_requests)
        self._pad = pad_batch if self.device.type == "cuda" else pad_batch_ref
        # NOTE: each bucket's views of the static buffers, made once: a replay's host path
        # (before the GPU has work) takes them instead of slicing eight tensors
        self._views = {bucket: self._bucket_views(bucket) for bucket in self.buckets}

    def requests(self, bucket: int) -> int:
        """Requests a batch of ``bucket`` tokens may hold (the padding one not counted)."""
        return min(bucket, self.max_requests)

    # Capture ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one pool."""
        seconds, mib = self.capture_keys(self.buckets, "extend graphs")
        logger.info(
            "Captured %d extend graphs (%d..%d tokens, up to %d requests, %s) in %.1f s, %.0f MiB",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            self.requests(self.buckets[-1]),
            "CUDA" if self.device.type == "cuda" else "eager stand-in",
            seconds,
            mib,
        )

    def _before_capture(self, bucket: int) -> None:
        # NOTE: an empty batch: the padding request owns every row and writes no KV
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        lens = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._load(empty, empty, empty, lens, lens, self.page_table[:0], empty, bucket)

    def _static_batch(self, bucket: int) -> ForwardBatch:
        reqs = self.requests(bucket) + 1
        ids, pos, loc, start, seq_lens, extend_lens = self._views[bucket]
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            seq_lens=seq_lens,
            extend_lens=extend_lens,
            page_table=self.page_table[:reqs],
            page_size=self.page_size,
            seq_lens_cpu=(self.max_seq_len,) * reqs,  # bounds, not contents
            extend_lens_cpu=(bucket,) * reqs,
            logits_indices=self.logits_rows[: self.requests(bucket)],
            capture_hidden_mode=self.hidden_mode,
            extend_start=start,
        )

    def _logits(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        rows = batch.logits_indices.clamp(max=hidden.shape[0] - 1)
        return self._logits_into(hidden.index_select(0, rows))

    # Replay ----------------------------------------------------------------------------------

    def _refusal(self, batch: ForwardBatch) -> str | None:
        if not self.graphs:
            return "not_captured"
        if batch.forward_mode is not ForwardMode.EXTEND or batch.num_tokens == 0:
            return "mode"
        bucket = pad_to_bucket(batch.num_tokens, self.buckets)
        if bucket is None:
            return "too_many_tokens"
        if max(batch.batch_size, batch.logits_indices.shape[0]) > self.requests(bucket):
            return "too_many_requests"  # NOTE: or more logits rows than the graph computes
        if (reason := prefill_input_refusal(batch, self.hidden_mode)) is not None:
            return reason
        seqs, exts = batch.seq_lens_cpu, batch.extend_lens_cpu
        if max(s - n for s, n in zip(seqs, exts)) >= LONG_PREFIX:
            return "long_prefix"
        if not self._fits(batch.page_table.shape[1], max(seqs)):
            return "seq_len"
        return None

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> GraphOutput:
        """The decoder outputs for ``batch`` (``can_run`` must hold): its rows and the logits of
        its sampled rows (``logits_indices``), graph memory."""
        n = batch.num_tokens
        bucket = pad_to_bucket(n, self.buckets)
        if bucket is None or bucket not in self.graphs:
            raise ValueError(f"no extend graph for {n} tokens (captured: {sorted(self.graphs)})")
        self._load(
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.extend_lens,
            batch.seq_lens,
            batch.page_table,
            batch.logits_indices,
            bucket,
        )
        rows = batch.logits_indices.shape[0]
        self.graphs[bucket].replay()
        self._count_run(bucket - n)
        hidden, aux, logits = self.outputs[bucket]
        return GraphOutput(hidden[:n], None if aux is None else aux[:n], logits[:rows])

    def _load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_cache_loc: torch.Tensor,
        extend_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        sampled: torch.Tensor,
        bucket: int,
    ) -> None:
        """A batch's rows, requests, page table and sampled rows into bucket ``bucket``'s static
        buffers, padded: one launch."""
        ids, pos, loc, start, out_seq_lens, out_extend_lens = self._views[bucket]
        requests = PaddedRequests(
            seq_lens,
            out_seq_lens,
            out_extend_lens,
            page_table,
            self.page_table,
            sampled,
            self.logits_rows,
        )
        self._pad(input_ids, positions, out_cache_loc, extend_lens, ids, pos, loc, start, requests)

    def _bucket_views(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """Bucket ``bucket``'s rows of the token buffers and its requests' of the request
        buffers: ids, positions, slots, first rows, lengths, new lengths."""
        reqs = self.requests(bucket) + 1
        return (
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.out_cache_loc[:bucket],
            self.extend_start[:reqs],
            self.seq_lens[:reqs],
            self.extend_lens[:reqs],
        )
