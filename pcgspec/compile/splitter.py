"""Cut a traced decoder graph at its split ops (attention) into alternating pieces.

A pure FX pass over the graph Dynamo hands a backend: every call of a split op becomes a piece
of its own, and the nodes between two split ops become one compute piece. The result is a
stitched top-level module that calls the pieces (submodules ``submod_<i>``) in the original
order. For an L-layer decoder: L split pieces and L + 1 compute pieces, alternating.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import fx
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx.passes.split_module import split_module


@dataclass(frozen=True)
class Piece:
    name: str  # attribute of the stitched module, e.g. "submod_0"
    graph_module: fx.GraphModule
    is_split_op: bool


@dataclass(frozen=True)
class SplitResult:
    split_module: fx.GraphModule  # the stitched graph; calls the pieces in order
    pieces: tuple[Piece, ...]

    @property
    def compute_pieces(self) -> tuple[Piece, ...]:
        return tuple(p for p in self.pieces if not p.is_split_op)

    @property
    def num_split_points(self) -> int:
        return sum(p.is_split_op for p in self.pieces)


def split_graph(gm: fx.GraphModule, split_ops: Sequence[OpOverload]) -> SplitResult:
    """Split ``gm`` at every call of one of ``split_ops`` (``gm`` itself is left unchanged).

    A split op that mutates an argument (attention writes ``output``) keeps working: the
    buffer is an output of the compute piece that allocates it, an input of the split piece,
    and an input of every later piece that reads it, all the same tensor at run time.
    """
    is_split = _split_matcher(split_ops)
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split(node):
            partition[node] = current + 1
            current += 2
        else:
            partition[node] = current
    split_ids = {partition[n] for n in partition if is_split(n)}
    # NOTE: keep_original_order is load-bearing: a split piece returns nothing, so only the
    # original order (not data flow) puts attention i before compute piece i + 1 reads `out`.
    stitched = split_module(gm, None, lambda n: partition[n], keep_original_order=True)
    pieces = tuple(
        Piece(
            name=node.target,
            graph_module=stitched.get_submodule(node.target),
            is_split_op=int(node.target.removeprefix("submod_")) in split_ids,
        )
        for node in stitched.graph.nodes
        if node.op == "call_module"
    )
    return SplitResult(stitched, pieces)


def _split_matcher(split_ops: Sequence[OpOverload]) -> Callable[[fx.Node], bool]:
    """Matches a node calling one of ``split_ops``, whether Dynamo recorded the overload
    (``torch.ops.ns.op.default``) or the packet (``torch.ops.ns.op``).
    """
    overloads = set(split_ops)
    packets = {op.overloadpacket for op in split_ops}

    def is_split(node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        if isinstance(target, OpOverloadPacket):
            return target in packets
        return isinstance(target, OpOverload) and target in overloads

    return is_split
