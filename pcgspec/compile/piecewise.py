"""Piece runners: every compute piece of the split decoder, run directly or as CUDA graphs.

A ``PiecewiseBackend`` wraps each compute piece in a ``PiecewisePiece``; all pieces of one model
share a ``PiecewiseGraphs`` (the backend's ``graphs``): the memory pool, the capture stream and
the current step. A runner drives it in three phases:

1. Trace: one plain call of the compiled decoder (e.g. the memory-profiling run). Outside any
   graph context each piece runs its compiled code directly, for any token count.
2. Capture: ``graphs.capture(buckets, run)`` calls ``run(bucket)`` for every bucket, largest
   first, inside ``graphs.capturing(bucket)``; ``run`` runs the whole decoder on a batch padded
   to ``bucket`` tokens under ``forward_context``. Each piece warms up, captures its CUDA graph
   into the shared pool and replays it once, so the attention between pieces sees real values.
3. Replay: pad the batch to ``bucket = pad_to_bucket(n, buckets)`` (padded tokens get
   ``out_cache_loc = -1``: attention writes no KV for them), call the compiled decoder inside
   ``graphs.replaying(bucket)`` and ``forward_context``, keep the first ``n`` output rows.
   The pieces only need the bucket: every tensor between them has ``bucket`` rows.

Each piece keeps, per bucket, the arguments it was captured with. At replay an argument whose
memory differs from the captured one is copied in (same shape required); arguments produced by
another piece are that piece's static outputs and never copy. Capture with decoder inputs
(ids, positions) that the runner owns and keeps, views of persistent buffers: they become the
static input buffers, and replaying with views of the same buffers copies nothing at all.

NOTE: outputs are graph memory, overwritten by the next replay of the same pool: consume or
copy the decoder's outputs before the next replaying forward. Capture and replay under the
same grad mode (``torch.inference_mode()``): static buffers are written in place.

Off CUDA, ``capturing``/``replaying`` run the same bookkeeping with ``_EagerGraph`` standing in
for ``torch.cuda.CUDAGraph`` (replay recomputes into the static outputs), so tests cover it.
"""

from __future__ import annotations

import enum
import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


class GraphMode(enum.Enum):
    CAPTURE = "capture"
    REPLAY = "replay"


@dataclass(frozen=True)
class GraphStep:
    mode: GraphMode
    bucket: int  # token count of every tensor between the pieces in this forward


class PiecewiseGraphs:
    """What all pieces of one compiled model share: pool, capture stream, current step."""

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
        self.step: GraphStep | None = None
        self.captured: set[int] = set()
        self.pieces: list[PiecewisePiece] = []
        self._stream: torch.cuda.Stream | None = None

    @property
    def num_graphs(self) -> int:
        return sum(len(piece.entries) for piece in self.pieces)

    def capture(self, buckets: Sequence[int], run: Callable[[int], object]) -> None:
        """Capture every bucket, largest first; ``run(bucket)`` runs the decoder on a batch
        of ``bucket`` tokens (under ``forward_context``).
        """
        order = sorted(set(buckets), reverse=True)
        if not order:
            raise ValueError("capture needs at least one bucket")
        if self.device.type == "cuda":
            gc.collect()  # once here; torch.cuda.graph() would do it for every piece
            torch.cuda.empty_cache()
        start, before = time.perf_counter(), self._reserved_bytes()
        for bucket in tqdm(order, desc="Capturing piecewise graphs", unit="bucket"):
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
        """Pieces called inside capture their graph for ``bucket`` tokens."""
        with self._active(GraphStep(GraphMode.CAPTURE, bucket)), self._capture_stream():
            yield
        self.captured.add(bucket)

    @contextmanager
    def replaying(self, bucket: int) -> Iterator[None]:
        """Pieces called inside replay their graph for ``bucket`` tokens."""
        if bucket not in self.captured:
            have = sorted(self.captured)
            raise ValueError(f"no graphs captured for {bucket} tokens (captured: {have})")
        with self._active(GraphStep(GraphMode.REPLAY, bucket)):
            yield

    @contextmanager
    def _active(self, step: GraphStep) -> Iterator[None]:
        if self.step is not None:
            raise RuntimeError(f"graph step {step} inside {self.step}; nesting is a bug")
        self.step = step
        try:
            yield
        finally:
            self.step = None

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


class PiecewisePiece(nn.Module):
    """One compiled compute piece: runs ``fn`` directly, or captures/replays per bucket."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., object],
        graphs: PiecewiseGraphs,
        args_from_pieces: Sequence[bool],
    ) -> None:
        super().__init__()
        self.piece_name = name
        self.fn = fn
        self.graphs = graphs
        self.args_from_pieces = tuple(args_from_pieces)
        self.entries: dict[int, _BucketGraph] = {}
        graphs.pieces.append(self)

    def forward(self, *args: object) -> object:
        step = self.graphs.step
        if step is None:
            return self.fn(*args)
        if step.mode is GraphMode.CAPTURE:
            return self._capture(step.bucket, args)
        entry = self.entries.get(step.bucket)
        if entry is None:
            raise RuntimeError(f"{self.piece_name}: no graph captured for {step.bucket} tokens")
        return entry.replay(args)

    def _capture(self, bucket: int, args: tuple[object, ...]) -> object:
        self.entries.pop(bucket, None)
        for _ in range(self.graphs.num_warmup):
            self.fn(*args)
        on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if on_cuda and self.graphs.pool is None:
            raise RuntimeError(f"CUDA inputs, but PiecewiseGraphs is on {self.graphs.device}")
        graph = _CudaGraph(self.graphs.pool) if on_cuda else _EagerGraph()
        out = graph.capture(self.fn, args)
        graph.replay()
        # NOTE: tensors made by other pieces (and our outputs) live in the graph pool; weak
        # aliases let the pool reuse them as eager execution would, so memory stays about one
        # forward of the largest bucket instead of the sum over buckets. Graph inputs (ids,
        # positions, weights) are held strongly: they are our static input buffers.
        keep = _weak_alias if on_cuda else _same
        static_args = tuple(
            keep(a) if from_piece and isinstance(a, torch.Tensor) else a
            for a, from_piece in zip(args, self.args_from_pieces, strict=True)
        )
        outputs = tree_map_only(torch.Tensor, keep, out)
        self.entries[bucket] = _BucketGraph(self.piece_name, graph, static_args, outputs)
        return out


@dataclass(frozen=True)
class _BucketGraph:
    piece_name: str
    graph: _CudaGraph | _EagerGraph
    static_args: tuple[object, ...]
    outputs: object

    def replay(self, args: tuple[object, ...]) -> object:
        for i, (static, arg) in enumerate(zip(self.static_args, args, strict=True)):
            if arg is static:  # weights and other captured-as-is inputs: the common case
                continue
            if isinstance(static, torch.Tensor):
                if not isinstance(arg, torch.Tensor) or arg.shape != static.shape:
                    raise ValueError(self._mismatch(i, static, arg))
                if arg.data_ptr() != static.data_ptr():
                    static.copy_(arg)
            elif arg != static:
                raise ValueError(self._mismatch(i, static, arg))
        self.graph.replay()
        return self.outputs

    def _mismatch(self, i: int, static: object, arg: object) -> str:
        def show(x: object) -> object:
            return tuple(x.shape) if isinstance(x, torch.Tensor) else x

        return (
            f"{self.piece_name}: argument {i} is {show(arg)}, captured as {show(static)}; "
            "pad every input to the bucket passed to replaying()"
        )


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


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _weak_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory alive."""
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(weak, t.storage_offset(), t.size(), t.stride())
