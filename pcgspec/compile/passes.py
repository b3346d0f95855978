"""Inductor graph passes of the compiled pieces.

``UnfusedResidualAdds``: Inductor turns ``residual + x @ w`` into ``addmm(residual, x, w)``
(on CUDA wherever the sum has a user that is not pointwise: the next layer's residual add, once
that is an ``addmm`` itself, or the piece's output; elsewhere always), so every decoder layer's
two residual adds become ``addmm``s. ATen's CUDA ``addmm`` copies a whole-matrix ``residual``
into its output before the GEMM (cuBLAS adds ``beta * C`` in place), so each is a
device-to-device copy and a GEMM: two copies a layer, about 56 of a SmolLM2 decode step's 450
GPU activities (H200 profile). The pass, after Inductor's own, splits them back into ``x @ w``
and an add that Inductor fuses into the RMSNorm reading it, as the eager model computes it (the
GEMM's output rounded to the model's dtype before the add). An ``addmm`` of a bias row (a linear
layer's bias, added in the GEMM's epilogue without a copy) stays, and so does one with ``beta``
or ``alpha``.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    Arg,
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

_PATTERNS = PatternMatcherPass(pass_name="pcgspec_unfused_residual_adds")


def _adds_a_whole_matrix(match: Match) -> bool:
    """A plain ``addmm`` (no ``beta`` / ``alpha``, which the pattern would drop) whose input has
    the product's shape and dtype: a residual, not a broadcast bias row."""
    node, inp = match.output_node(), match.kwargs["inp"]
    if node.target is not aten.addmm.default or node.kwargs:
        return False
    if not isinstance(inp, fx.Node) or not isinstance(inp.meta.get("val"), torch.Tensor):
        return False
    if inp.meta["val"].dtype != node.meta["val"].dtype:
        return False
    shape, out = inp.meta["val"].shape, node.meta["val"].shape
    # NOTE: sizes compared without guards (the token count is symbolic and must stay so)
    return len(shape) == len(out) and all(statically_known_true(a == b) for a, b in zip(shape, out))


@register_graph_pattern(
    CallFunction(aten.addmm, KeywordArg("inp"), Arg(), Arg()),
    pass_dict=_PATTERNS,
    extra_check=_adds_a_whole_matrix,
)
def _unfuse(match: Match, mat1: fx.Node, mat2: fx.Node, *, inp: fx.Node) -> None:
    def repl(inp: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
        return inp + mat1 @ mat2

    match.replace_by_example(repl, [inp, mat1, mat2])


class UnfusedResidualAdds(CustomGraphPass):
    """``post_grad_custom_post_pass``: whole-matrix ``addmm``s back to a GEMM and an add."""

    def __call__(self, graph: fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def inductor_patches() -> dict[str, object]:
    """Inductor config for compiling a piece: no CUDA graphs of its own (the runners capture
    them), no copies before residual adds."""
    return {"triton.cudagraphs": False, "post_grad_custom_post_pass": UnfusedResidualAdds()}
