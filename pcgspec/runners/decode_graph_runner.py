"""Decode and verify CUDA graphs: one graph per batch-size bucket, replayed for every batch of
the runner's mode with the same number of tokens per request: DECODE (1) or TARGET_VERIFY (k+1,
so a bucket of ``bs`` requests holds ``bs * (k+1)`` tokens).

Each is a whole decoder step (``whole_graphs.py``). DECODE graphs also capture the LM head over
every row (each request's one token is sampled), as SGLang's decode graphs do: its launches
leave the host's step (on an H100 the 1B shape's device step at batch 1 fell from 1.69 to
1.57 ms). Verify graphs leave it to the caller (k+1 rows of float32 logits per request would
hold a large static buffer).

Static buffers hold ``max_bs`` requests; bucket ``bs`` sees requests ``[:bs]``. A replay copies
the batch into the first ``B`` requests' rows (in place, three launches), makes requests
``B..bs`` padding (``out_cache_loc`` -1: no KV write, ``seq_len`` 0: no KV read), replays the
smallest bucket ``bs >= B`` and returns the real requests' output rows. Padded ids and positions,
and page-table entries past a request's pages, keep older values: no real row reads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.kernels.pad_batch import pad_batch, pad_batch_ref
from pcgspec.kernels.padded_rows import GraphRows
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.runners.whole_graphs import GraphOutput, WholeGraphRunner

if TYPE_CHECKING:
    from pcgspec.config import EngineConfig
    from pcgspec.runners.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def max_decode_batch(config: EngineConfig) -> int:
    """The largest batch the decode and verify graphs capture."""
    return min(config.cuda_graph_max_bs, config.max_running_requests)


def decode_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_bs``, and ``max_bs`` itself; ascending."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = {n for n in (1, 2, 4) if n <= max_bs} | set(range(8, max_bs + 1, 8)) | {max_bs}
    return sorted(sizes)


@dataclass(frozen=True)
class StaticBuffers:
    """The graph inputs: ``max_bs`` requests of ``n`` tokens each (N = max_bs * n rows);
    requests past a batch are padding.
    """

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    out_cache_loc: torch.Tensor  # [N] int64, -1 = write no KV
    seq_lens: torch.Tensor  # [max_bs] int32, 0 = read no KV
    extend_lens: torch.Tensor  # [max_bs] int32, all n
    page_table: torch.Tensor  # [max_bs, max_pages] int32
    rows: torch.Tensor  # [N] int64, arange

    @classmethod
    def allocate(
        cls, max_bs: int, tokens_per_seq: int, max_pages: int, device: torch.device
    ) -> StaticBuffers:
        num_rows = max_bs * tokens_per_seq

        def full(value: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        return cls(
            input_ids=full(0, torch.int64, num_rows),
            positions=full(0, torch.int64, num_rows),
            out_cache_loc=full(-1, torch.int64, num_rows),
            seq_lens=full(0, torch.int32, max_bs),
            extend_lens=full(tokens_per_seq, torch.int32, max_bs),
            page_table=full(0, torch.int32, max_bs, max_pages),
            rows=torch.arange(num_rows, dtype=torch.int64, device=device),
        )

    @property
    def tokens_per_seq(self) -> int:
        return self.input_ids.shape[0] // self.seq_lens.shape[0]

    def batch(
        self, mode: ForwardMode, bs: int, page_size: int, max_seq_len: int, **fields: object
    ) -> ForwardBatch:
        """The static batch of bucket ``bs``: views of the first ``bs`` requests' rows."""
        n = self.tokens_per_seq
        return ForwardBatch(
            forward_mode=mode,
            input_ids=self.input_ids[: bs * n],
            positions=self.positions[: bs * n],
            out_cache_loc=self.out_cache_loc[: bs * n],
            seq_lens=self.seq_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            page_table=self.page_table[:bs],
            page_size=page_size,
            seq_lens_cpu=(max_seq_len,) * bs,  # bounds, not contents
            extend_lens_cpu=(n,) * bs,
            **{"logits_indices": self.rows[: bs * n], **fields},  # type: ignore[arg-type]
        )

    def bucket_rows(self, bs: int) -> GraphRows:
        """Bucket ``bs``'s rows, for a pass built in place (``padded_rows_into``)."""
        n = bs * self.tokens_per_seq
        return GraphRows(
            self.input_ids[:n],
            self.positions[:n],
            self.out_cache_loc[:n],
            self.seq_lens[:bs],
            self.extend_lens[:bs],
            self.rows[:n],
        )

    def load(self, batch: ForwardBatch, bs: int) -> None:
        """Copy ``batch`` into the first requests' rows, requests ``B..bs`` padding. A batch
        built in place (its rows are these buffers, padding written) needs its page table only.
        """
        # NOTE: few launches: before the graph launch the GPU has nothing to do.
        if batch.input_ids.data_ptr() == self.input_ids.data_ptr():
            self.page_table[: batch.batch_size, : batch.page_table.shape[1]].copy_(batch.page_table)
            return
        n, rows = batch.batch_size, bs * self.tokens_per_seq
        pad = pad_batch if self.input_ids.device.type == "cuda" else pad_batch_ref
        pad(
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.extend_lens,
            self.input_ids[:rows],
            self.positions[:rows],
            self.out_cache_loc[:rows],
            None,
        )
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.page_table[:n, : batch.page_table.shape[1]].copy_(batch.page_table)
        if bs > n:
            self.seq_lens[n:bs].zero_()


class DecodeGraphRunner(WholeGraphRunner):
    """Captures and replays steps of ``mode`` with ``tokens_per_seq`` tokens per request
    (DECODE: 1; TARGET_VERIFY: k+1) for ``model_runner``'s model, KV cache and attention.

    The buckets are ``decode_batch_sizes(min(cuda_graph_max_bs, max_running_requests))``
    requests; the captured decoder is the piecewise runner's compiled one when there is one, else
    the plain ``model.model``.
    """

    reasons = (
        "not_captured",
        "mode",
        "batch_size",
        "hidden_mode",
        "input_embeds",
        "seq_len",
        "tree",
    )

    def __init__(
        self,
        model_runner: ModelRunner,
        mode: ForwardMode = ForwardMode.DECODE,
        tokens_per_seq: int = 1,
        tree: bool = False,
    ) -> None:
        """``tree``: TARGET_VERIFY of draft trees, whose attention mask ([bs, N, N], the
        batch's ``tree_mask``) is a static buffer too."""
        if mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise ValueError(f"mode must be DECODE or TARGET_VERIFY, got {mode.name}")
        if tokens_per_seq < 1 or (mode is ForwardMode.DECODE and tokens_per_seq != 1):
            raise ValueError(f"tokens_per_seq {tokens_per_seq} does not fit mode {mode.name}")
        super().__init__(model_runner)
        self.mode, self.tokens_per_seq = mode, tokens_per_seq
        config = model_runner.config
        self.capture_hidden_mode = model_runner.capture_hidden_mode(mode)
        self.batch_sizes = decode_batch_sizes(max_decode_batch(config))
        self.max_bs = self.batch_sizes[-1]
        self.buffers = StaticBuffers.allocate(
            self.max_bs, tokens_per_seq, self.max_pages, self.device
        )
        if mode is ForwardMode.DECODE:  # NOTE: a verify pass's caller computes its logits
            self.logits_out = self._logits_buffer(self.max_bs)
        self.tree_mask: torch.Tensor | None = None
        if tree:
            if mode is not ForwardMode.TARGET_VERIFY:
                raise ValueError("tree graphs are TARGET_VERIFY graphs")
            shape = (self.max_bs, tokens_per_seq, tokens_per_seq)
            self.tree_mask = torch.ones(shape, dtype=torch.bool, device=self.device)

    # Capture ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one pool."""
        self.buffers.out_cache_loc.fill_(-1)  # NOTE: warm-ups and captures must write no KV
        self.buffers.seq_lens.zero_()
        what = f"{self.mode.name.lower()} graphs"
        seconds, mib = self.capture_keys(self.batch_sizes, what)
        logger.info(
            "Captured %d %s (batch %d..%d, %d tokens per request, %s) in %.1f s, %.0f MiB",
            len(self.batch_sizes),
            what,
            self.batch_sizes[0],
            self.max_bs,
            self.tokens_per_seq,
            "CUDA" if self.device.type == "cuda" else "eager stand-in",
            seconds,
            mib,
        )

    def _logits(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        """Every row's logits (DECODE graphs): a decode batch's logits rows are all its rows."""
        return None if self.logits_out is None else self._logits_into(hidden)

    def _static_batch(self, bs: int) -> ForwardBatch:
        verify = self.mode is ForwardMode.TARGET_VERIFY
        return self.buffers.batch(
            self.mode,
            bs,
            self.page_size,
            self.max_seq_len,
            capture_hidden_mode=self.capture_hidden_mode,
            spec_num_draft_tokens=self.tokens_per_seq if verify else 0,
            tree_mask=None if self.tree_mask is None else self.tree_mask[:bs],
        )

    # Replay ----------------------------------------------------------------------------------

    def rows_for(self, batch_size: int, max_pages: int, max_seq_len: int) -> GraphRows | None:
        """The static rows of the bucket that will replay a pass of ``batch_size`` requests of
        ``tokens_per_seq`` tokens (page tables of ``max_pages``, lengths up to
        ``max_seq_len``) in the runner's hidden mode, to build it in place; None where no graph
        will (``can_run`` then refuses it and counts why).
        """
        bs = pad_to_bucket(batch_size, self.batch_sizes)
        if bs not in self.graphs or not self._fits(max_pages, max_seq_len):
            return None
        return self.buffers.bucket_rows(bs)

    def _refusal(self, batch: ForwardBatch) -> str | None:
        if not self.graphs:
            return "not_captured"
        n = self.tokens_per_seq
        uniform = batch.num_tokens == n * batch.batch_size and set(batch.extend_lens_cpu) == {n}
        if batch.forward_mode is not self.mode or not uniform:
            return "mode"
        if batch.batch_size > self.max_bs:
            return "batch_size"
        if batch.capture_hidden_mode not in (CaptureHiddenMode.NULL, self.capture_hidden_mode):
            return "hidden_mode"
        if batch.input_embeds is not None:
            return "input_embeds"
        if not self._fits(batch.page_table.shape[1], max(batch.seq_lens_cpu)):
            return "seq_len"
        if (batch.tree_mask is None) != (self.tree_mask is None):
            return "tree"
        return None

    @torch.inference_mode()
    def replay(self, batch: ForwardBatch) -> GraphOutput:
        """The outputs for ``batch`` (``can_run`` must hold): its ``T`` rows of graph memory; the
        logits (DECODE graphs) only where the batch's logits rows are all of them, else None."""
        n = batch.batch_size
        bs = pad_to_bucket(n, self.batch_sizes)
        if bs is None or bs not in self.graphs:
            raise ValueError(
                f"no {self.mode.name} graph for batch size {n} (captured: {sorted(self.graphs)})"
            )
        self.buffers.load(batch, bs)
        if self.tree_mask is not None:
            self.tree_mask[:n].copy_(batch.tree_mask)
        self.graphs[bs].replay()
        self._count_run((bs - n) * self.tokens_per_seq)
        t = batch.num_tokens
        hidden, aux, logits = (None if out is None else out[:t] for out in self.outputs[bs])
        if not batch.logits_every_row:
            logits = None  # the caller's rows are a subset: it computes them
        return GraphOutput(hidden, aux, logits)
