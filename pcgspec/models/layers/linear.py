"""Linear layers that fuse several Hugging Face projections, and the per-shard weight loaders."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``, casting to its dtype and device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.copy_(loaded)


class MergedLinear(nn.Linear):
    """Projections of the same input stacked along the output dim (``qkv_proj``, ``gate_up_proj``).

    Shard ``i`` of the checkpoint (e.g. ``k_proj`` for ``qkv_proj``) loads into rows
    ``sum(output_sizes[:i]) : sum(output_sizes[:i + 1])`` of the weight and the bias.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(param.narrow(0, offset, size), loaded)
