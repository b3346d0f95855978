"""Piece runners: every compute piece of the split decoder, run directly or captured as CUDA
graphs, and the replay tape that runs a captured bucket without the decoder's Python.

A ``PiecewiseBackend`` wraps each compute piece in a ``PiecewisePiece`` and each split-op call
in ``PiecewiseGraphs.split_op``; all of one model share a ``PiecewiseGraphs`` (the backend's
``graphs``): the memory pool, the capture stream and the tapes. A runner drives it in three
phases:

1. Trace: one plain call of the compiled decoder (e.g. the memory-profiling run). Outside a
   capture each piece runs its compiled code directly, for any token count.
2. Capture: ``graphs.capture(buckets, run)`` calls ``run(bucket)`` for every bucket, largest
   first, inside ``graphs.capturing(bucket)``; ``run`` calls the compiled decoder once on a
   batch padded to ``bucket`` tokens under ``forward_context``. Each piece warms up, captures
   its CUDA graph into the shared pool and replays it once, so the attention between pieces
   sees real values. Meanwhile the bucket's tape records, in order, every piece's graph and
   every split-op call with its arguments, and the decoder's inputs and outputs.
3. Replay: pad the batch to ``bucket = pad_to_bucket(n, buckets)`` (padded tokens get
   ``out_cache_loc = -1``: attention writes no KV for them) and call
   ``decoder.replay(bucket, *inputs)`` under ``forward_context``: the inputs are copied into
   the captured ones (nothing is copied when they are the same memory), the tape runs, and the
   captured outputs come back; keep their first ``n`` rows.

Why a tape: every tensor between the pieces is graph memory at a fixed address per bucket, so
the stitched module would pass the same arguments on every replay. Running the recorded calls
directly skips Dynamo's frame, the FX glue and an ``nn.Module`` call per piece: about half the
host time of a short prefill, which is host-bound.

NOTE: outputs are graph memory, overwritten by the next replay of the same pool: consume or
copy them before the next replay. Capture and replay under the same grad mode
(``torch.inference_mode()``): inputs are written in place. The attention between pieces reads
the current ``forward_context`` at every replay, so its metadata is the batch's own.

Off CUDA, capture runs the same bookkeeping with ``_EagerGraph`` standing in for
``torch.cuda.CUDAGraph`` (replay recomputes into the captured outputs), so tests cover it.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from pcgspec.progress import progress

logger = logging.getLogger(__name__)


@dataclass
class _Tape:
    """One bucket's replay: the decoder inputs it was captured with, the calls in order (piece
    graphs and split ops, with their arguments), and the decoder outputs.
    """

    calls: list[tuple[Callable[..., object], tuple[object, ...]]] = field(default_factory=list)
    num_graphs: int = 0
    inputs: tuple[object, ...] | None = None  # None until the decoder returns
    outputs: object = None


class PiecewiseGraphs:
    """What all pieces of one compiled model share: pool, capture stream, one tape per bucket."""

    def __init__(
        self,
        device: torch.device | str | None = None,
        pool: tuple[int, int] | None = None,
        num_warmup: int = 1,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.pool = pool  # a torch.cuda.graph_pool_handle(); created at the first capture
        self.num_warmup = num_warmup
        self.tapes: dict[int, _Tape] = {}
        self.recording: _Tape | None = None  # the tape of the bucket being captured
        self._stream: torch.cuda.Stream | None = None
        self._graphs: list[_CudaGraph | _EagerGraph] = []  # every captured piece graph

    def reset(self) -> None:
        """Free every captured graph; the pieces run eagerly from then on."""
        for graph in self._graphs:
            graph.reset()
        self._graphs.clear()
        self.tapes.clear()

    @property
    def captured(self) -> set[int]:
        return set(self.tapes)

    @property
    def num_graphs(self) -> int:
        return sum(tape.num_graphs for tape in self.tapes.values())

    def capture(self, buckets: Sequence[int], run: Callable[[int], object]) -> None:
        """Capture every bucket, largest first; ``run(bucket)`` calls the decoder once on a
        batch of ``bucket`` tokens (under ``forward_context``).
        """
        order = sorted(set(buckets), reverse=True)
        if not order:
            raise ValueError("capture needs at least one bucket")
        if self.device.type == "cuda":
            gc.collect()  # once here; torch.cuda.graph() would do it for every piece
            torch.cuda.empty_cache()
        start, before = time.perf_counter(), self._reserved_bytes()
        for bucket in progress(order, desc="Capturing piecewise graphs", unit="bucket"):
            with self.capturing(bucket):
                run(bucket)
        elapsed, mib = time.perf_counter() - start, (self._reserved_bytes() - before) / 2**20
        logger.info(
            "Captured %d piecewise graphs for %d buckets (%d..%d tokens) in %.1f s, %.0f MiB",
            self.num_graphs,
            len(order),
            order[-1],
            order[0],
            elapsed,
            mib,
        )

    @contextmanager
    def capturing(self, bucket: int) -> Iterator[None]:
        """Pieces called inside capture their graph for ``bucket`` tokens, and the bucket's tape
        records; the block must call the compiled decoder exactly once.
        """
        if self.recording is not None:
            raise RuntimeError(f"capture of {bucket} tokens inside another; nesting is a bug")
        tape = self.recording = _Tape()
        try:
            with self._capture_stream():
                yield
        finally:
            self.recording = None
        if tape.inputs is None:
            raise RuntimeError(f"the capture of {bucket} tokens never returned from the decoder")
        self.tapes[bucket] = tape

    def record_decoder_call(self, inputs: tuple[object, ...], outputs: object) -> None:
        """While capturing: the decoder's inputs (tensors held: they are the static inputs)
        and outputs of the bucket being captured.
        """
        tape = self.recording
        if tape is None:
            return
        if tape.inputs is not None:
            raise RuntimeError("the decoder was called twice in one capture")
        tape.inputs, tape.outputs = inputs, tree_map_only(torch.Tensor, self._keep, outputs)

    def split_op(self, impl: Callable[..., None]) -> Callable[..., None]:
        """``impl`` of a split op as the stitched module calls it: while capturing, the call
        and its arguments go on the tape, so replay makes it again between the same graphs.
        """

        def call(*args: object) -> None:
            if self.recording is not None:
                kept = tuple(self._keep(a) if isinstance(a, torch.Tensor) else a for a in args)
                self.recording.calls.append((impl, kept))
            impl(*args)

        call.__name__ = f"recorded_{getattr(impl, '__name__', 'split_op')}"
        return call

    def replay(self, bucket: int, inputs: Sequence[object]) -> object:
        """Run ``bucket``'s tape on ``inputs`` (shaped as captured; copied in unless they are
        the captured memory) and return the captured outputs (graph memory).
        """
        tape = self.tapes.get(bucket)
        if tape is None:
            have = sorted(self.tapes)
            raise ValueError(f"no graphs captured for {bucket} tokens (captured: {have})")
        if self.recording is not None:
            raise RuntimeError("replay inside a capture; nesting is a bug")
        assert tape.inputs is not None
        if len(inputs) != len(tape.inputs):
            raise ValueError(f"{len(inputs)} decoder inputs, captured with {len(tape.inputs)}")
        for i, (static, arg) in enumerate(zip(tape.inputs, inputs)):
            if arg is static:
                continue
            if isinstance(static, torch.Tensor):
                if not isinstance(arg, torch.Tensor) or arg.shape != static.shape:
                    raise ValueError(_mismatch(i, static, arg))
                if arg.data_ptr() != static.data_ptr():
                    static.copy_(arg)
            elif arg != static:
                raise ValueError(_mismatch(i, static, arg))
        for fn, args in tape.calls:
            fn(*args)
        return tape.outputs

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        """How the tape holds tensors made inside a capture.

        NOTE: on CUDA they live in the graph pool; weak aliases let the pool reuse them as eager
        execution would, so memory stays about one forward of the largest bucket instead of the
        sum over buckets. The tape holds the decoder inputs strongly (its static inputs), and
        weights belong to the model.
        """
        return _weak_alias(t) if t.is_cuda else t

    @contextmanager
    def _capture_stream(self) -> Iterator[None]:
        """Run the whole capturing forward (warm-ups, attention, captures) on one side stream."""
        if self.device.type != "cuda":
            yield
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def _reserved_bytes(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)


def _mismatch(i: int, static: object, arg: object) -> str:
    def show(x: object) -> object:
        return tuple(x.shape) if isinstance(x, torch.Tensor) else x

    return (
        f"decoder input {i} is {show(arg)}, captured as {show(static)}; pad every input to the "
        "bucket passed to replay()"
    )


class PiecewisePiece(nn.Module):
    """One compiled compute piece: runs ``fn`` directly, or, while its graphs are capturing a
    bucket, captures a graph of ``fn`` and puts it on the bucket's tape.
    """

    def __init__(self, name: str, fn: Callable[..., object], graphs: PiecewiseGraphs) -> None:
        super().__init__()
        self.piece_name = name
        self.fn = fn
        self.graphs = graphs

    def forward(self, *args: object) -> object:
        tape = self.graphs.recording
        if tape is None:
            return self.fn(*args)
        for _ in range(self.graphs.num_warmup):
            self.fn(*args)
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if on_cuda and self.graphs.pool is None:
            raise RuntimeError(f"CUDA inputs, but PiecewiseGraphs is on {self.graphs.device}")
        graph = _CudaGraph(self.graphs.pool) if on_cuda else _EagerGraph()
        out = graph.capture(self.fn, args)
        graph.replay()
        self.graphs._graphs.append(graph)
        tape.calls.append((graph.replay, ()))
        tape.num_graphs += 1
        return out


class _CudaGraph:
    def __init__(self, pool: tuple[int, int] | None) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[..., object], args: tuple[object, ...]) -> object:
        # NOTE: capture_begin/end, not torch.cuda.graph(): that runs gc.collect() and
        # empty_cache() per capture, minutes over (pieces x buckets) captures.
        self._graph.capture_begin(pool=self._pool)
        try:
            return fn(*args)
        finally:
            self._graph.capture_end()

    def replay(self) -> None:
        self._graph.replay()

    def reset(self) -> None:
        """Free the graph (also its captured collectives)."""
        self._graph.reset()


class _EagerGraph:
    """Stands in for a CUDA graph off CUDA: replay reruns ``fn`` on the captured arguments and
    copies the results into the captured outputs, the buffers a CUDA graph would write.
    """

    def capture(self, fn: Callable[..., object], args: tuple[object, ...]) -> object:
        self._fn, self._args = fn, args
        self._out = fn(*args)
        return self._out

    def replay(self) -> None:
        fresh = self._fn(*self._args)
        for dst, src in zip(tree_leaves(self._out), tree_leaves(fresh), strict=True):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)

    def reset(self) -> None:
        self._fn, self._args, self._out = None, (), None


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory alive."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(weak, t.storage_offset(), t.size(), t.stride())
