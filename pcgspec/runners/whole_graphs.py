"""What the runners that capture whole decoder steps share: decode and verify graphs per batch
size (``decode_graph_runner.py``), extend graphs per token bucket (``extend_graph_runner.py``).

Each captures, per key, one step of the decoder stack over its static buffers: the piecewise
runner's compiled decoder (called outside a piecewise capture/replay step, its pieces run their
compiled code directly, so no second compile) or the plain ``model.model``, with the attention
between the layers reading metadata that ``AttentionBackend.init_capture_metadata`` builds over
those buffers. Keys are captured largest first into one memory pool, each after ``num_warmup``
eager runs (kernels compile there, outside the capture).

NOTE: outputs are graph memory, overwritten by the next replay: consume or copy them first.
The logits the graphs compute are rows of one float32 buffer that the model runner's decode and
extend graphs share (``ModelRunner.graph_logits``), so a replay of any of them overwrites them:
one buffer of their largest batch's rows, not an output of every key (1,687 rows over the
default buckets, the vocabulary wide: 316 MiB of graph memory for a 49k vocabulary, 1.6 GiB for
Gemma 3's 262k).
Off CUDA the piecewise ``_EagerGraph`` stands in for ``torch.cuda.CUDAGraph`` (replay reruns the
captured step on the static buffers), so capture and replay are tested on CPU.
"""

from __future__ import annotations

import functools
import gc
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, NamedTuple

import torch

from pcgspec.compile.forward_context import forward_context
from pcgspec.compile.piecewise import _CudaGraph, _EagerGraph
from pcgspec.progress import progress
from pcgspec.runners.forward_batch import ForwardBatch
from pcgspec.runners.refusals import GuardedRunner

if TYPE_CHECKING:
    from pcgspec.runners.model_runner import ModelRunner

DecoderOutput = tuple[torch.Tensor, torch.Tensor | None]  # hidden [T, H], aux [T, A] | None


class GraphOutput(NamedTuple):
    """A replay's rows: graph memory, overwritten by the next replay."""

    hidden: torch.Tensor  # [T, H]
    aux: torch.Tensor | None  # [T, A]: the auxiliary hidden states, when captured
    # [R, V] float32: the logits of the batch's ``logits_indices`` rows, captured with the step;
    # None where the caller computes them
    logits: torch.Tensor | None


@contextmanager
def capture_stream(device: torch.device) -> Iterator[None]:
    """Warm-ups and captures on a side stream (capture refuses the default stream)."""
    if device.type != "cuda":
        yield
        return
    current = torch.cuda.current_stream(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


class WholeGraphRunner(GuardedRunner):
    """One captured decoder step per key (a batch size, a token bucket) of ``model_runner``'s
    model, KV cache and attention. Subclasses give each key's static batch and replay.
    """

    num_warmup: int = 2  # eager runs per key before its capture: kernels compile there

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__()
        piecewise = model_runner.piecewise
        self.decoder: Callable[..., DecoderOutput] = (
            piecewise.decoder if piecewise is not None else model_runner.model.model
        )
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.page_size = model_runner.page_size
        self.max_seq_len = model_runner.context_length
        self.max_pages = -(-self.max_seq_len // self.page_size)
        self.graphs: dict[int, _CudaGraph | _EagerGraph] = {}
        self.outputs: dict[int, GraphOutput] = {}
        self.pool: tuple[int, int] | None = None
        self.compute_logits = model_runner.model.compute_logits
        self._shared_logits = model_runner.graph_logits
        self._vocab_size = model_runner.vocab_size
        # [rows, V] float32 where the graphs write logits (``_logits_into``); None: they compute
        # none (a subclass sets it with ``_logits_buffer``)
        self.logits_out: torch.Tensor | None = None

    def _logits_buffer(self, rows: int) -> torch.Tensor:
        """Where the graphs write the logits of up to ``rows`` rows: the model runner's shared
        buffer, or one of this runner's own where it has none that large (a runner built apart
        from the model runner's, e.g. by a benchmark)."""
        shared = self._shared_logits
        if shared is not None and shared.shape[0] >= rows:
            return shared
        return torch.empty(rows, self._vocab_size, dtype=torch.float32, device=self.device)

    def _logits_into(self, rows: torch.Tensor) -> torch.Tensor:
        """The logits of hidden ``rows`` [R, H], written into the first R rows of
        ``logits_out``."""
        return self.compute_logits(rows, out=self.logits_out[: rows.shape[0]])

    @abstractmethod
    def _static_batch(self, key: int) -> ForwardBatch:
        """The batch key ``key``'s graph reads: views of the static buffers."""

    def _before_capture(self, key: int) -> None:
        """Make the static buffers a batch that writes no KV (warm-ups and the capture run it)."""

    def _logits(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits captured with the step (None: the caller computes them)."""
        return None

    @torch.inference_mode()
    def capture_keys(self, keys: Sequence[int], what: str) -> tuple[float, float]:
        """Capture every key, largest first, into one pool: the seconds and MiB it took."""
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            gc.collect()
            torch.cuda.empty_cache()
            self.pool = self.pool or torch.cuda.graph_pool_handle()
        start, before = time.perf_counter(), self._reserved_bytes()
        with capture_stream(self.device):
            for key in progress(
                sorted(keys, reverse=True), desc=f"Capturing {what}", unit="bucket"
            ):
                self._before_capture(key)
                step = functools.partial(self.decoder_step, self._static_batch(key))
                for _ in range(self.num_warmup):
                    step()  # compiles Triton/inductor kernels for this shape outside the capture
                graph = _CudaGraph(self.pool) if on_cuda else _EagerGraph()
                self.outputs[key] = graph.capture(step, ())
                self.graphs[key] = graph
        return time.perf_counter() - start, (self._reserved_bytes() - before) / 2**20

    def decoder_step(self, batch: ForwardBatch) -> GraphOutput:
        """One step of the decoder over ``batch``, whose tensors a graph holds (the static
        buffers, or those a captured speculative step builds): the captured region."""
        self.attn_backend.init_capture_metadata(batch, self.max_seq_len)
        with forward_context(batch, self.attn_backend):
            hidden, aux = self.decoder(batch.input_ids, batch.positions)
        return GraphOutput(hidden, aux, self._logits(batch, hidden))

    def _fits(self, max_pages: int, max_seq_len: int) -> bool:
        """Whether page tables of ``max_pages`` and lengths up to ``max_seq_len`` fit the static
        buffers (the context length)."""
        return max_pages <= self.max_pages and max_seq_len <= self.max_seq_len

    def _reserved_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)

    def reset(self) -> None:
        """Free every graph; ``can_run`` refuses every batch from then on."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)
