"""Linear layers that fuse several Hugging Face projections, their tensor-parallel shards, and
the per-shard weight loaders.

Column-parallel (``MergedLinear``): rank ``r`` holds its slice of every fused part's output
rows; no collective. Row-parallel (``RowParallelLinear``): rank ``r`` holds its slice of the
input columns; the partial products are summed across ranks. Vocab-parallel
(``VocabParallelEmbedding``): rank ``r`` holds ``ceil(V / tp)`` rows of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pcgspec.distributed.group import SINGLE, TPGroup


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a checkpoint tensor into ``param``, casting to its dtype and device."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != parameter shape {tuple(param.shape)}")
    param.copy_(loaded)


def load_slice(
    param: torch.Tensor, loaded: torch.Tensor, dim: int, index: int, num_slices: int
) -> None:
    """Load slice ``index`` of ``num_slices`` equal slices of ``loaded`` along ``dim``, which
    must be exactly ``num_slices`` times ``param``'s size there.
    """
    if num_slices == 1:
        return default_weight_loader(param, loaded)
    size = param.shape[dim]
    if loaded.dim() != param.dim() or loaded.shape[dim] != size * num_slices:
        raise ValueError(
            f"shape {tuple(loaded.shape)} does not split into {num_slices} slices "
            f"of the parameter shape {tuple(param.shape)} along dim {dim}"
        )
    default_weight_loader(param, loaded.narrow(dim, index * size, size))


class MergedLinear(nn.Linear):
    """Projections of the same input stacked along the output dim (``qkv_proj``, ``gate_up_proj``),
    column-parallel over ``tp``.

    ``output_sizes`` are this rank's rows of each part. ``replicas[i]``: how many consecutive
    ranks hold the same slice of part ``i`` (KV heads fewer than ranks), 1 by default. Shard
    ``i`` of the checkpoint (e.g. ``k_proj`` for ``qkv_proj``) loads its rank's slice into rows
    ``sum(output_sizes[:i]) : sum(output_sizes[:i + 1])`` of the weight and the bias.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        tp: TPGroup = SINGLE,
        replicas: Sequence[int] | None = None,
    ) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)
        self.replicas = tuple(replicas) if replicas is not None else (1,) * len(output_sizes)
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        copies = self.replicas[shard_id]
        load_slice(
            param.narrow(0, offset, size), loaded, 0, self.tp.rank // copies, self.tp.size // copies
        )


class RowParallelLinear(nn.Linear):
    """``o_proj``, ``down_proj``: this rank's ``in_features / tp`` input columns; the outputs
    are summed across ranks, then the bias (held whole by every rank) is added once.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__(tp.shard(in_features, "in_features"), out_features, bias=bias)
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias
            default_weight_loader(param, loaded)
        else:
            load_slice(param, loaded, 1, self.tp.rank, self.tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The embedding (and, tied or not, the LM head's weight): rank ``r`` holds vocabulary rows
    ``r * per_rank .. (r + 1) * per_rank`` (``per_rank = ceil(V / tp)``; rows past ``V`` are
    zero padding). A lookup zeroes the ids other ranks hold and sums across ranks.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE) -> None:
        self.per_rank = -(-num_embeddings // tp.size)
        super().__init__(self.per_rank, embedding_dim)
        self.full_vocab_size = num_embeddings
        self.vocab_start = tp.rank * self.per_rank
        self.tp = tp

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.full_vocab_size, param.shape[1]):
            raise ValueError(
                f"shape {tuple(loaded.shape)} != full vocabulary shape "
                f"{(self.full_vocab_size, param.shape[1])}"
            )
        rows = loaded[self.vocab_start : self.vocab_start + self.per_rank]
        param.zero_()
        default_weight_loader(param[: rows.shape[0]], rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden @ weight.T`` [R, V] float32 over the whole vocabulary, gathered from every
        rank; written into ``out`` [R, V] float32 when given (one rank: the GEMM writes it)."""
        if out is not None and out.shape != (hidden.shape[0], self.full_vocab_size):
            raise ValueError(
                f"out {tuple(out.shape)} must be [{hidden.shape[0]}, {self.full_vocab_size}]"
            )
        if self.tp.size == 1:
            return float_matmul(hidden, self.weight, out)
        logits = self.tp.all_gather_last(float_matmul(hidden, self.weight))
        logits = logits[:, : self.full_vocab_size]
        return logits if out is None else out.copy_(logits)


def float_matmul(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T`` [R, N] in float32 (into ``out`` when given). On CUDA a 16-bit GEMM writes
    float32 itself (cuBLAS accumulates in float32; no rounding to 16 bits, no cast kernel over a
    [R, V] tensor); elsewhere the product is cast.
    """
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, weight.t(), out_dtype=torch.float32, out=out)  # out None: allocates
    product = F.linear(x, weight)
    return product.float() if out is None else out.copy_(product)
