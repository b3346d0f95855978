"""Draft trees: EAGLE-2 style top-k expansion per depth, kept on the device.

A request's tree has N nodes: node 0 is the root (the request's last token, verified already),
nodes 1..N-1 are drafts, in depth order (a parent precedes its children). ``parents[b, i]`` is
node i's parent (-1 for the root), ``depths[b, i]`` its depth (root 0). A chain of k drafts is
the tree with ``parents = i - 1``, ``depths = i``: topk 1 drafts one through the same code.

Expansion (``TreeExpansion``): depth 1 keeps the top-k tokens of the head's first distribution
as candidates and beams; each later depth runs the head on the k beams at once (each sees the
prefix and its own ancestors: ``beam_mask``), scores their k * k children by the product of the
probabilities along their path (a sum of log-probabilities) and keeps the k best as the next
beams. Every candidate is kept; the N - 1 best of them form the tree (``select``). A child's
score is strictly below its parent's (``_STRICT``), so the best N - 1 are closed under parents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcgspec.attention.kv_cache import KVCache
from pcgspec.kernels.move_kv import move_accepted_kv as move_kv
from pcgspec.kernels.move_kv import move_accepted_kv_ref as move_kv_ref
from pcgspec.kernels.top_k import top_k, top_k_ref
from pcgspec.kernels.tree_expand import (
    ancestor_mask,
    expand_beams,
    expand_beams_ref,
    select_nodes,
    select_nodes_ref,
)
from pcgspec.speculative.config import MAX_TREE_WIDTH

# NOTE: float64 scores minus a tiny margin per depth: a child that took a probability-1 token
# still ranks below its parent, so no selection keeps a child without its parent.
_STRICT = 2.0**-30  # NOTE: exact in float32, as the expansion kernel takes it


@dataclass(frozen=True)
class TreeShape:
    """What a propose phase drafts per request: ``depth`` (k) levels of ``topk`` beams, kept as
    ``num_nodes`` (N) tree nodes, root included. A chain: topk 1, N = k + 1."""

    depth: int
    topk: int = 1
    num_nodes: int = 0  # 0: depth + 1 (a chain)

    def __post_init__(self) -> None:
        if self.num_nodes == 0:
            object.__setattr__(self, "num_nodes", self.depth + 1)
        most = min(1 + self.topk + (self.depth - 1) * self.topk**2, MAX_TREE_WIDTH + 1)
        if (
            self.depth < 1
            or not 1 <= self.topk <= MAX_TREE_WIDTH
            or not 2 <= self.num_nodes <= most
        ):
            raise ValueError(
                f"a draft tree of depth {self.depth} and topk {self.topk} holds 2..{most} "
                f"nodes, got num_nodes={self.num_nodes}"
            )
        if self.topk == 1 and self.num_nodes != self.depth + 1:
            raise ValueError(f"a chain of depth {self.depth} has {self.depth + 1} nodes")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


@dataclass(frozen=True)
class DraftTree:
    """``tokens`` [B, N-1] int64 (the drafts, nodes 1..N-1); for trees of topk > 1
    ``parents`` and ``depths`` [B, N] int64 (node 0 the root) and ``mask`` [B, N, N]
    (``ancestor_mask``); a chain has none of them."""

    tokens: torch.Tensor
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def top_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best ids of every row of ``logits`` [R, V] with their log-probabilities, each
    ``[R, k]``; with k = 1 the argmax and zero scores (a chain ranks nothing).
    """
    if k == 1:
        ids = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device), ids
    return _top_k(logits, k, log_softmax=True)


def _use_kernels(x: torch.Tensor) -> bool:
    """The Triton kernels (``kernels.top_k``, ``kernels.tree_expand``) on the GPU, their torch
    references elsewhere."""
    return x.is_cuda


def _top_k(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.top_k`` (``torch.topk``'s radix select is dear for a few long rows)."""
    return (top_k if _use_kernels(x) else top_k_ref)(x, k, log_softmax)


def path_rows(hidden: torch.Tensor, path: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """Rows of ``hidden`` [B * N, H] (a tree verify pass's, N rows per request) along the
    accepted paths ``path`` [B, k+1] (node indices, -1 past the end): ``[B * (k+1), H]``.
    """
    b = path.shape[0]
    base = torch.arange(b, device=path.device)[:, None] * num_nodes
    return hidden[(base + path.clamp_min(0)).view(-1)]


class TreeExpansion:
    """The candidates of one propose phase, per request, as the head expands them: candidate
    tables ``candidates`` (path scores float64, tokens, parent candidate ids; [B, C] for the
    ``depth`` levels) and the current level's ``beams``."""

    def __init__(self, scores: torch.Tensor, tokens: torch.Tensor, depth: int) -> None:
        """Depth 1 from the head's first ``top_tokens``: ``scores``, ``tokens`` [B, k]."""
        b, topk = tokens.shape
        self.topk, device = topk, tokens.device
        size = topk + (depth - 1) * topk * topk
        self.candidates = (
            torch.empty(b, size, dtype=torch.float64, device=device),
            torch.empty(b, size, dtype=torch.int64, device=device),
            torch.empty(b, size, dtype=torch.int64, device=device),
        )
        expand = expand_beams if _use_kernels(scores) else expand_beams_ref
        self.beams = expand(None, scores, tokens, self.candidates, 0, _STRICT)
        self.num_candidates = topk

    @property
    def beam_tokens(self) -> torch.Tensor:
        return self.beams.tokens

    @property
    def beam_mask(self) -> torch.Tensor:
        return self.beams.mask

    def expand(self, child_lp: torch.Tensor, child_tok: torch.Tensor) -> torch.Tensor:
        """One depth from the beams' ``top_tokens`` (``[B * k, k]`` each, beam-major): record
        the k * k children, keep the k best as beams (``kernels.tree_expand``). Returns the
        beams' parent beam ``[B, k]`` (which row of the last pass each new beam continues).
        """
        expand = expand_beams if _use_kernels(child_lp) else expand_beams_ref
        first = self.num_candidates
        self.beams = expand(self.beams, child_lp, child_tok, self.candidates, first, _STRICT)
        self.num_candidates += self.topk * self.topk
        return self.beams.parent

    def select(self, num_nodes: int, max_depth: int) -> DraftTree:
        """The ``num_nodes - 1`` best candidates as a tree (``num_nodes`` with the root)."""
        scores, tokens, parents = (t[:, : self.num_candidates] for t in self.candidates)
        chosen = _top_k(scores, num_nodes - 1)[1]  # [B, N-1]
        select = select_nodes if _use_kernels(chosen) else select_nodes_ref
        return DraftTree(*select(chosen, tokens, parents, max_depth))


@dataclass(frozen=True)
class VerifyTree:
    """What a tree verify pass adds to a chain's: row i of a request (node i) sits at position
    ``start + depths[i]`` in slot ``start + i`` and sees the prefix and its ancestors."""

    parents: torch.Tensor  # [B, N] int64
    depths: torch.Tensor  # [B, N] int64
    mask: torch.Tensor  # [B, N, N] bool (``ancestor_mask``)
    # [B, N]: what to add to consecutive per-row positions (``start + i``) to place every
    # node at its depth instead
    row_offsets: torch.Tensor
    max_depth: int

    @classmethod
    def of(
        cls,
        parents: torch.Tensor,
        depths: torch.Tensor,
        max_depth: int,
        mask: torch.Tensor | None = None,
    ) -> VerifyTree:
        """The tree's verify inputs; ``mask``: its ancestor mask where the drafter built it."""
        if mask is None:
            mask = ancestor_mask(parents, max_depth)
        offsets = depths - torch.arange(depths.shape[1], device=depths.device)
        return cls(parents, depths, mask, offsets, max_depth)


def move_accepted_kv(
    cache: KVCache,
    page_table: torch.Tensor,
    start: torch.Tensor,
    path: torch.Tensor,
) -> None:
    """After a tree verify pass whose node i of request b wrote its K/V at position
    ``start[b] + i``: move the accepted nodes' (``path`` [B, D+1], -1 past the end) to the
    consecutive positions ``start[b] + j``, where the next passes read them, in every layer
    (``kernels.move_kv``: one launch). Nodes past the path stay where they are, past the
    request's length (overwritten later). On the device.
    """
    move = move_kv if _use_kernels(path) else move_kv_ref
    move(cache.k_all, cache.v_all, page_table, cache.page_size, start, path)
