"""Piecewise CUDA graphs at the runner level: one compiled decoder, one graph set per token bucket.

A batch of ``n`` tokens is padded to ``bucket = pad_to_bucket(n, buckets)``: padded tokens have
``out_cache_loc = -1`` (they write no KV), and the per-request tensors are unchanged, so
attention treats every row past ``sum(extend_lens)`` as padding (zero output) and
``logits_indices`` still point at real rows. Padded ids and positions are whatever the static
buffers hold (zeros, or an earlier batch's valid values): every piece computes each row on its
own, so they never reach a real row. Batch composition is free; only the token count
is padded. Off CUDA the compiled pieces run directly, for any token count: padding only costs
there (a one-token decode step padded to 4 rows is ~1.5x slower on CPU), so it is off unless
``pad_without_graphs`` is set, as the tests do to run the CUDA path's padding on CPU.

``can_run`` is the guard in front of ``run`` (SGLang's runner-level check instead of a global
disable): TARGET_VERIFY, a hidden mode other than the captured one, input embeddings, input
logprobs and batches over the largest bucket run eagerly, counted by reason (refusals.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from pcgspec import envs
from pcgspec.compile.backend import CompiledDecoder, PiecewiseBackend
from pcgspec.compile.buckets import capture_buckets, pad_to_bucket
from pcgspec.compile.forward_context import forward_context
from pcgspec.compile.piecewise import PiecewiseGraphs
from pcgspec.kernels.pad_batch import pad_batch, pad_batch_ref
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch, without_kv_writes
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode
from pcgspec.runners.refusals import GuardedRunner, prefill_input_refusal

if TYPE_CHECKING:
    from pcgspec.runners.model_runner import ModelRunner

logger = logging.getLogger("pcgspec")


class PiecewiseRunner(GuardedRunner):
    """Runs the decoder stack of ``model_runner`` through the piecewise backend.

    Decoder outputs of ``run`` are graph memory on CUDA, overwritten by the next ``run``:
    consume or copy them before the next forward (``ModelRunner.forward`` does).
    """

    reasons = (
        "empty",
        "target_verify",
        "hidden_mode",
        "input_embeds",
        "input_logprobs",
        "too_many_tokens",
    )

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        config = model_runner.config
        self.device = model_runner.device
        self.page_size = model_runner.page_size
        self.attn_backend = model_runner.attn_backend
        self.hidden_mode = model_runner.extend_capture_hidden_mode
        self.buckets = capture_buckets(
            config.resolved_piecewise_max_tokens, config.piecewise_cuda_graph_tokens
        )
        if not self.buckets:
            raise ValueError(
                f"piecewise_cuda_graph_tokens {config.piecewise_cuda_graph_tokens} has no bucket "
                f"<= piecewise_cuda_graph_max_tokens ({config.resolved_piecewise_max_tokens})"
            )
        self.max_tokens = self.buckets[-1]
        self.use_graphs = self.device.type == "cuda"
        self.pad_without_graphs = False
        self.graphs = PiecewiseGraphs(self.device)
        tp = model_runner.tp  # NOTE: one compile cache per rank of a group: no shared writes
        cache = None if tp.size == 1 else envs.cache_dir() / "compile" / f"tp{tp.size}-{tp.rank}"
        self.backend = PiecewiseBackend(
            config.resolved_piecewise_compiler, graphs=self.graphs, cache_dir=cache
        )
        self.decoder = CompiledDecoder(model_runner.model.model, self.backend)
        # Static inputs: every compiled call reads views of these, so replays copy nothing; the
        # padded batch's KV slots and request starts live here too (filled by one launch).
        size = max(2, self.max_tokens)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=self.device)
        self.out_cache_loc = torch.full((size,), -1, dtype=torch.int64, device=self.device)
        self.extend_start = torch.zeros(size, dtype=torch.int32, device=self.device)
        self._pad_batch = pad_batch if self.device.type == "cuda" else pad_batch_ref

    @torch.inference_mode()
    def capture(self) -> None:
        """Trace the decoder once, then (CUDA) capture every bucket, largest first."""
        start = time.perf_counter()
        # NOTE: the first call's size is the hint inductor tunes its kernels for: the largest
        # bucket when graphs are captured; a small (cheap) one when the pieces just run.
        size = self.max_tokens if self.use_graphs else self.buckets[0]
        self._forward(self._dummy_batch(max(2, size)))
        traced = time.perf_counter()
        if self.use_graphs:
            self.graphs.capture(self.buckets, lambda b: self._forward(self._dummy_batch(b)))
        logger.info(
            "Piecewise runner: %d buckets (%d..%d tokens), hidden mode %s, pieces %s; "
            "trace and compile %.1f s, %s",
            len(self.buckets),
            self.buckets[0],
            self.max_tokens,
            self.hidden_mode.name,
            self.backend.piece_compiler,
            traced - start,
            f"capture {time.perf_counter() - traced:.1f} s" if self.use_graphs else "no graphs",
        )

    def _refusal(self, batch: ForwardBatch) -> str | None:
        if batch.num_tokens == 0 or batch.forward_mode is ForwardMode.IDLE:
            return "empty"
        if batch.forward_mode is ForwardMode.TARGET_VERIFY:
            return "target_verify"
        if (reason := prefill_input_refusal(batch, self.hidden_mode)) is not None:
            return reason
        if batch.num_tokens > self.max_tokens:
            return "too_many_tokens"
        return None

    @property
    def num_graphs(self) -> int:
        """Token buckets captured (none off CUDA, where the pieces just run)."""
        return len(self.graphs.captured)

    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder outputs for the real rows: hidden ``[n, H]`` and aux ``[n, C]`` or None.

        On CUDA these are views of graph memory, valid until the next forward.
        """
        n = batch.num_tokens
        bucket = pad_to_bucket(n, self.buckets)
        if bucket is None:
            raise ValueError(f"{n} tokens exceed the largest piecewise bucket {self.max_tokens}")
        size = bucket if self.use_graphs or self.pad_without_graphs else n
        hidden, aux = self._forward(self._pad(batch, size), bucket if self.use_graphs else None)
        self._count_run(size - n)
        return hidden[:n], None if aux is None else aux[:n]

    def _forward(
        self, padded: ForwardBatch, bucket: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder on ``padded``: called (trace, capture, no graphs), or replayed from the
        graphs of ``bucket``.
        """
        self.attn_backend.init_forward_metadata(padded)
        with forward_context(padded, self.attn_backend):
            if bucket is not None:
                return self.decoder.replay(bucket, padded.input_ids, padded.positions)
            return self.decoder(padded.input_ids, padded.positions)

    def _pad(self, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """``batch`` with ``bucket`` tokens in views of the static buffers (padded tokens have
        KV slot -1), and its requests' first rows.
        """
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        out_cache_loc, start = self.out_cache_loc[:bucket], self.extend_start[: batch.batch_size]
        self._pad_batch(
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.extend_lens,
            ids,
            positions,
            out_cache_loc,
            start,
        )
        return dataclasses.replace(
            batch,
            input_ids=ids,
            positions=positions,
            out_cache_loc=out_cache_loc,
            extend_start=start,
        )

    def _dummy_batch(self, num_tokens: int) -> ForwardBatch:
        """One token reading page 0, padded to ``num_tokens``; nothing is written to the KV
        cache.
        """
        one = build_forward_batch(
            ForwardMode.EXTEND,
            [SeqChunk([0], 0, [0])],
            self.page_size,
            self.device,
            capture_hidden_mode=self.hidden_mode,
        )
        return self._pad(without_kv_writes(one), num_tokens)
