"""The ``torch.compile`` backend for piecewise graphs, and the decoder wrapper that uses it.

``CompiledDecoder(model.model)`` marks dim 0 (tokens) of every tensor argument dynamic and has
Dynamo trace the decoder stack once. ``PiecewiseBackend`` splits that graph at attention,
compiles every compute piece once for the symbolic token count, and installs each as a
``PiecewisePiece`` (see ``piecewise.py`` for capture and replay).

Guards: a recompile is a bug, so Dynamo's guards are dropped (as vLLM does): the one graph
serves every token count, 1 included, and ``CompiledDecoder`` checks the invariants itself
(which arguments are tensors, their dtypes and ranks, the non-tensor values). The backend
raises if compiling a piece specialized the token count, and if it is ever invoked twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Literal

import torch
from torch import fx, nn
from torch._ops import OpOverload
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from pcgspec import envs
from pcgspec.compile.custom_ops import direct_impls
from pcgspec.compile.custom_ops import split_ops as default_split_ops
from pcgspec.compile.piecewise import PiecewiseGraphs, PiecewisePiece
from pcgspec.compile.splitter import SplitResult, split_graph
from pcgspec.progress import progress

logger = logging.getLogger(__name__)

PieceCompilerFn = Callable[[fx.GraphModule, list[object]], Callable[..., object]]
PieceCompiler = Literal["eager", "inductor"] | PieceCompilerFn

_INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class PiecewiseBackend:
    """``(gm, example_inputs) -> callable`` for ``torch.compile``.

    ``piece_compiler``: ``"eager"`` runs the traced FX pieces, ``"inductor"`` compiles each with
    inductor for the symbolic shape, a callable ``(piece, fake_inputs) -> fn`` does its own;
    None picks inductor for CUDA inputs and eager otherwise.
    """

    def __init__(
        self,
        piece_compiler: PieceCompiler | None = None,
        graphs: PiecewiseGraphs | None = None,
        split_ops: Sequence[OpOverload] | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        if isinstance(piece_compiler, str) and piece_compiler not in ("eager", "inductor"):
            raise ValueError(
                f"piece_compiler must be 'eager', 'inductor' or a callable, got {piece_compiler!r}"
            )
        self.piece_compiler = piece_compiler
        self.graphs = graphs if graphs is not None else PiecewiseGraphs()
        self.split_ops = tuple(split_ops if split_ops is not None else default_split_ops())
        self.cache_dir = cache_dir
        self.num_traces = 0
        self.split: SplitResult | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[object]) -> Callable:
        if self.split is not None:
            raise RuntimeError(
                "PiecewiseBackend invoked a second time: the decoder was re-traced, which is a "
                "bug (run with TORCH_LOGS=recompiles to see why)"
            )
        start = time.perf_counter()
        sizes = _symbolic_sizes(gm)
        split = split_graph(gm, self.split_ops)
        name, compile_piece = self._piece_compiler(example_inputs)
        pieces = split.compute_pieces
        with self._cache() if name == "inductor" else nullcontext(), torch.no_grad():
            for piece in progress(pieces, desc=f"Compiling pieces ({name})", show=name != "eager"):
                fn = compile_piece(piece.graph_module, _example_inputs(piece.graph_module))
                runner = PiecewisePiece(piece.name, fn, self.graphs)
                setattr(split.split_module, piece.name, runner)
        _check_still_symbolic(sizes)
        _call_split_ops_directly(split, self.graphs)
        self.split, self.num_traces = split, self.num_traces + 1
        logger.info(
            "Compiled %d pieces around %d split points (%s) in %.1f s",
            len(pieces),
            split.num_split_points,
            name,
            time.perf_counter() - start,
        )
        return split.split_module

    def _piece_compiler(self, example_inputs: Sequence[object]) -> tuple[str, PieceCompilerFn]:
        choice = self.piece_compiler
        if choice is None:
            on_cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
            choice = "inductor" if on_cuda else "eager"
        if choice == "eager":
            return "eager", _compile_eager
        if choice == "inductor":
            return "inductor", _compile_inductor
        return getattr(choice, "__name__", "custom"), choice

    @contextmanager
    def _cache(self) -> Iterator[None]:
        """Inductor's on-disk caches (FX graph, AOT autograd, kernels) in our cache dir while
        compiling: identical layers hit the cache after the first, and so does a second start.
        """
        directory = self.cache_dir or envs.cache_dir() / "compile"
        directory.mkdir(parents=True, exist_ok=True)
        previous = os.environ.get(_INDUCTOR_CACHE_ENV)
        os.environ[_INDUCTOR_CACHE_ENV] = str(directory)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(_INDUCTOR_CACHE_ENV, None)
            else:
                os.environ[_INDUCTOR_CACHE_ENV] = previous


# NOTE: every engine adds a Dynamo cache entry to the traced function's code object, and with
# the guards dropped all of them count against recompile_limit (8), so a process could build
# only 8 engines per architecture. A trace is never a recompile here: lift the limit for it.
_TRACE_LIMITS = {"recompile_limit": 1 << 20, "accumulated_recompile_limit": 1 << 20}


class CompiledDecoder:
    """A decoder stack (a module or a function, e.g. a draft head's ``decode``) compiled through
    a ``PiecewiseBackend``. Dim 0 of every tensor argument is the token dimension. The first
    call (at least 2 tokens) traces; no call ever re-traces.

    NOTE: with the guards dropped, module state read by ``forward`` (e.g. the aux hidden layer
    ids) is baked in at the trace: set it before the first call.
    """

    def __init__(
        self, module: nn.Module | Callable[..., object], backend: PiecewiseBackend | None = None
    ) -> None:
        self.module = module
        self.backend = backend if backend is not None else PiecewiseBackend()
        self._compiled = torch.compile(
            module,
            backend=self.backend,
            fullgraph=True,
            dynamic=False,
            options={"guard_filter_fn": _drop_all_guards},
        )
        self._signature: tuple[object, ...] | None = None

    @property
    def graphs(self) -> PiecewiseGraphs:
        return self.backend.graphs

    def __call__(self, *args: object, **kwargs: object) -> object:
        signature = _signature(args, kwargs)
        if self._signature is None:
            out = self._trace(signature, args, kwargs)
        elif signature != self._signature:
            raise ValueError(
                f"decoder traced for arguments {self._signature}, called with {signature}; "
                "build a second CompiledDecoder for another call signature"
            )
        else:
            with torch.compiler.set_stance("fail_on_recompile"):
                out = self._compiled(*args, **kwargs)
        self.graphs.record_decoder_call(_inputs(args, kwargs), out)
        return out

    def replay(self, bucket: int, *args: object, **kwargs: object) -> object:
        """The outputs of a call with these arguments, replayed from ``bucket``'s captured
        graphs (see ``PiecewiseGraphs.replay``): graph memory, valid until the next replay.
        """
        return self.graphs.replay(bucket, _inputs(args, kwargs))

    def _trace(
        self, signature: tuple[object, ...], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        tensors = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        if any(t.dim() == 0 or t.shape[0] < 2 for t in tensors):
            raise ValueError("trace the decoder with at least 2 tokens (1 would be specialized)")
        for t in tensors:
            torch._dynamo.mark_dynamic(t, 0)
        with torch._dynamo.config.patch(_TRACE_LIMITS):
            out = self._compiled(*args, **kwargs)
        self._signature = signature
        return out


def _call_split_ops_directly(split: SplitResult, graphs: PiecewiseGraphs) -> None:
    """Point every split-op call at its Python implementation (no dispatcher round trip),
    recorded on the tape while capturing.
    """
    recorded = {op: graphs.split_op(impl) for op, impl in direct_impls().items()}
    for piece in split.pieces:
        if not piece.is_split_op:
            continue
        for node in piece.graph_module.graph.nodes:
            if node.op == "call_function" and node.target in recorded:
                node.target = recorded[node.target]
        piece.graph_module.recompile()


def _compile_eager(piece: fx.GraphModule, example_inputs: list[object]) -> Callable[..., object]:
    return piece


def _compile_inductor(piece: fx.GraphModule, example_inputs: list[object]) -> Callable[..., object]:
    """Inductor over the symbolic fake inputs: one kernel set for every token count."""
    from torch._inductor.compile_fx import compile_fx

    from pcgspec.compile.passes import inductor_patches

    return compile_fx(piece, example_inputs, config_patches=inductor_patches())


def _inputs(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
    return (*args, *(kwargs[name] for name in sorted(kwargs)))


def _drop_all_guards(entries: Sequence[object]) -> list[bool]:
    return [False] * len(entries)


def _signature(args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[object, ...]:
    def describe(x: object) -> object:
        if isinstance(x, torch.Tensor):
            return ("tensor", x.dtype, x.dim(), x.device.type)
        return x

    return (*map(describe, args), *((k, describe(v)) for k, v in sorted(kwargs.items())))


def _example_value(node: fx.Node) -> object:
    return node.meta["example_value"] if "example_value" in node.meta else node.meta["val"]


def _example_inputs(gm: fx.GraphModule) -> list[object]:
    """The fake inputs Dynamo traced with (symbolic token count), from the placeholders."""
    return [_example_value(node) for node in gm.graph.find_nodes(op="placeholder")]


def _symbolic_sizes(gm: fx.GraphModule) -> dict[str, torch.SymInt]:
    """The symbolic input sizes (``name[dim]`` -> size); raises when there is none."""
    sizes: dict[str, torch.SymInt] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        value = _example_value(node)
        if isinstance(value, torch.SymInt) and not is_concrete_int(value):
            sizes[node.name] = value
        elif isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and not is_concrete_int(size):
                    sizes[f"{node.name}[{dim}]"] = size
    if not sizes:
        raise ValueError(
            "the traced graph has no dynamic dimension: mark the token dimension dynamic "
            "(CompiledDecoder does), or every token count will need a new trace"
        )
    return sizes


def _check_still_symbolic(sizes: dict[str, torch.SymInt]) -> None:
    fixed = [name for name, size in sizes.items() if is_concrete_int(size)]
    if fixed:
        raise RuntimeError(
            f"compiling the pieces specialized {fixed} to a constant; the compiled pieces would "
            "only be valid for the traced token count"
        )
