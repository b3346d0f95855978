"""``pcgspec::attention``: the one opaque op the decoder graph is split at."""

from __future__ import annotations

import torch

from pcgspec.compile.forward_context import get_forward_context

ATTENTION_OP_NAME = "pcgspec::attention"


@torch.library.custom_op(ATTENTION_OP_NAME, mutates_args=("output",))
def attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KV, D]
    v: torch.Tensor,  # [T, KV, D]
    output: torch.Tensor,  # [T, H, D], written in place
    layer_id: int,
) -> None:
    """Store ``k``/``v`` in the paged cache and write attention over the sequence to ``output``."""
    get_forward_context().attn_backend.forward(q, k, v, output, layer_id)


@attention.register_fake
def _attention_fake(q, k, v, output, layer_id) -> None:  # noqa: ANN001
    return None


def split_ops() -> list[object]:
    """The ops the piecewise splitter cuts at."""
    return [torch.ops.pcgspec.attention.default]
