"""A draft tree's drafting kernels (``speculative.tree.TreeExpansion``), each one Triton launch
with its torch reference: a depth's expansion, and the selection of the kept nodes.

Expansion (``expand_beams``).
Per request, from its ``k`` beams (path scores, candidate ids, ancestor masks over the levels
so far; depth 1: the root alone) and the head's ``k`` best children of each beam
(log-probabilities, tokens): record
the ``k * k`` children as candidates (score: the beam's plus the child's, less ``strict``;
token; parent: the beam's candidate id) at columns ``first ..`` of the candidate tables, keep
the ``k`` best as the next beams (ties to the lower child index, as ``kernels.top_k``), and
grow their masks by the new level (each new beam sees its parent beam's ancestors and itself).
Eager torch took about a dozen small kernels a depth for the same.

Selection (``select_nodes``): from the ``N - 1`` chosen candidates of a request (any order),
the tree in candidate order (a parent's id is below its children's, so parents come first):
the nodes' tokens, parent nodes, depths and ancestor mask. Eager torch took about 25.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches
from pcgspec.kernels.top_k import pick_best, top_k_ref


class Beams(NamedTuple):
    """A tree level's beams, per request: ``scores`` [B, k] float64 (path log-probabilities),
    ``ids`` [B, k] (candidate ids), ``tokens`` [B, k], ``mask`` [B, k, W] bool (what each sees
    of the levels' slots), ``parent`` [B, k] (the beam of the level before each continues)."""

    scores: torch.Tensor
    ids: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    parent: torch.Tensor | None = None


@triton.jit(
    do_not_specialize=["stride_cand", "first", "width", "strict"],  # one variant per level width
    do_not_specialize_on_alignment=[
        "BeamScores",
        "BeamIds",
        "BeamMask",
        "ChildLp",
        "ChildTok",
        "Scores",
        "Tokens",
        "Parents",
        "OutScores",
        "OutIds",
        "OutTokens",
        "OutMask",
        "OutParent",
    ],
)
def _expand_kernel(
    BeamScores,
    BeamIds,
    BeamMask,
    ChildLp,
    ChildTok,
    Scores,
    Tokens,
    Parents,
    OutScores,
    OutIds,
    OutTokens,
    OutMask,
    OutParent,
    stride_cand,
    first,
    width,
    strict,
    K: tl.constexpr,
    BLOCK_KK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_KK)  # child c of beam c // K (the root: child c of the root)
    if ROOT:  # depth 1: no beams yet, the root's K children (path score: their own)
        valid = c < K
        child = b * K + c
        base = tl.zeros([BLOCK_KK], tl.float64)
        parent = tl.full([BLOCK_KK], -1, tl.int64)
    else:
        valid = c < K * K
        child = b * K * K + c
        base = tl.load(BeamScores + b * K + c // K, mask=valid, other=0.0)
        parent = tl.load(BeamIds + b * K + c // K, mask=valid, other=0)
    lp = tl.load(ChildLp + child, mask=valid, other=float("-inf")).to(tl.float64)
    score = tl.where(valid, base + lp - strict, float("-inf"))
    token = tl.load(ChildTok + child, mask=valid, other=0)
    row = b * stride_cand + first + c
    tl.store(Scores + row, score, mask=valid)
    tl.store(Tokens + row, token, mask=valid)
    tl.store(Parents + row, parent, mask=valid)
    w = tl.arange(0, BLOCK_W)
    taken = ~valid
    score = tl.where(score == score, score, float("-inf"))  # NaN ranks as -inf
    for r in tl.static_range(K):
        best, at = pick_best(score, taken, c, BLOCK_KK)
        taken = taken | (c == at)
        tl.store(OutScores + b * K + r, best)
        tl.store(OutIds + b * K + r, (first + at).to(tl.int64))
        tl.store(OutTokens + b * K + r, tl.sum(tl.where(c == at, token, 0), 0))
        tl.store(OutParent + b * K + r, (at // K).to(tl.int64))
        seen = tl.load(BeamMask + (b * K + at // K) * width + w, mask=w < width, other=0)
        grown = tl.where(w < width, seen != 0, w == width + r)
        tl.store(OutMask + (b * K + r) * (width + K) + w, grown, mask=w < width + K)


# NOTE: inside the speculative step's graph as a rule; eager drafting launches it per depth
_EXPAND = CompiledLaunches(_expand_kernel)


def _check(beams: Beams | None, child_lp: torch.Tensor, child_tok: torch.Tensor) -> tuple[int, ...]:
    """``(b, k, width)`` of a checked expansion (the root's: one beam, width 0)."""
    if beams is None:
        (b, k), num_beams, width, shapes = child_lp.shape, 1, 0, {}
    else:
        (b, k), width = beams.scores.shape, beams.mask.shape[2]
        num_beams = k
        shapes = {
            "beams.scores": (beams.scores, (b, k)),
            "beams.ids": (beams.ids, (b, k)),
            "beams.mask": (beams.mask, (b, k, width)),
        }
    shapes["child_lp"] = (child_lp, (b * num_beams, k))
    shapes["child_tok"] = (child_tok, (b * num_beams, k))
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    return b, k, width


def expand_beams(
    beams: Beams | None,
    child_lp: torch.Tensor,
    child_tok: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    strict: float,
) -> Beams:
    """One depth in one launch: writes the ``k * k`` children into ``candidates`` (scores
    float64, tokens, parents: [B, C], columns ``first ..``) and returns the next ``Beams``.
    ``beams`` None: depth 1, the root's ``k`` children (``child_lp``, ``child_tok``: [B, k]),
    each a beam of its own, in their order (ties to the lower child)."""
    b, k, width = _check(beams, child_lp, child_tok)
    scores, tokens, parents = candidates
    if any(t.stride() != scores.stride() or t.stride(1) != 1 for t in candidates):
        raise ValueError("the candidate tables must share one row-major [B, C] layout")
    device = child_lp.device
    out = Beams(
        torch.empty(b, k, dtype=torch.float64, device=device),
        torch.empty(b, k, dtype=torch.int64, device=device),
        torch.empty(b, k, dtype=child_tok.dtype, device=device),
        torch.empty(b, k, width + k, dtype=torch.bool, device=device),
        torch.empty(b, k, dtype=torch.int64, device=device),
    )
    child_lp, child_tok = child_lp.contiguous(), child_tok.contiguous()
    # NOTE: the root has no beams to read: its launch passes the children in their place
    if beams is None:
        beam_tensors = (child_lp, child_tok, child_tok)
    else:
        beam_tensors = (beams.scores.contiguous(), beams.ids.contiguous(), beams.mask.contiguous())
    tensors = (*beam_tensors, child_lp, child_tok, scores, tokens, parents, *out)
    constants = {
        "K": k,
        "BLOCK_KK": triton.next_power_of_2(k if beams is None else k * k),
        "BLOCK_W": triton.next_power_of_2(width + k),
        "ROOT": beams is None,
    }
    _EXPAND((b, 1, 1), tensors, (scores.stride(0), first, width, strict), constants)
    return out


def expand_beams_ref(
    beams: Beams | None,
    child_lp: torch.Tensor,
    child_tok: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    strict: float,
) -> Beams:
    """``expand_beams`` in torch (the root: one beam of score 0, no candidate id, no mask)."""
    b, k, width = _check(beams, child_lp, child_tok)
    if beams is None:
        device = child_lp.device
        beams = Beams(
            torch.zeros(b, 1, dtype=torch.float64, device=device),
            torch.full((b, 1), -1, dtype=torch.int64, device=device),
            torch.zeros(b, 1, dtype=child_tok.dtype, device=device),
            torch.zeros(b, 1, 0, dtype=torch.bool, device=device),
        )
    n = beams.scores.shape[1] * k  # children
    scores, tokens, parents = candidates
    child = (beams.scores[..., None] + child_lp.view(b, -1, k).double() - strict).view(b, n)
    cols = slice(first, first + n)
    scores[:, cols] = child
    tokens[:, cols] = child_tok.reshape(b, n)
    parents[:, cols] = beams.ids.repeat_interleave(k, dim=1)
    best_scores, best = top_k_ref(child, k)
    parent = best // k
    grown = beams.mask.gather(1, parent[..., None].expand(-1, -1, width))
    fresh = torch.eye(k, dtype=torch.bool, device=child.device).expand(b, -1, -1)
    return Beams(
        best_scores,
        first + best,
        child_tok.reshape(b, n).gather(1, best),
        torch.cat([grown, fresh], dim=2),
        parent,
    )


@triton.jit(
    do_not_specialize=["stride_cand"],
    do_not_specialize_on_alignment=[
        "Chosen",
        "CandTokens",
        "CandParents",
        "Tokens",
        "Parents",
        "Depths",
        "Mask",
    ],
)
def _select_kernel(
    Chosen,
    CandTokens,
    CandParents,
    Tokens,
    Parents,
    Depths,
    Mask,
    stride_cand,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)  # lanes: node i (0 the root), or pick i - 1 of ``Chosen``
    real = (i >= 1) & (i < N)
    cand = tl.load(Chosen + b * (N - 1) + i - 1, mask=real, other=0)
    # node of pick i: 1 + the picks with a lower candidate id (candidate order is depth order)
    below = (cand[None, :] < cand[:, None]) & real[None, :]
    node = tl.where(real, tl.sum(below.to(tl.int32), 1) + 1, 0)
    # node m's candidate: the pick whose node is m
    sorted_cand = tl.sum(tl.where(node[None, :] == i[:, None], cand[None, :], 0), 1)
    row = b * stride_cand + sorted_cand
    token = tl.load(CandTokens + row, mask=real, other=0)
    up = tl.load(CandParents + row, mask=real, other=-1)  # the parent's candidate id
    parent_node = tl.sum(((cand[None, :] < up[:, None]) & real[None, :]).to(tl.int32), 1) + 1
    parent = tl.where(i == 0, -1, tl.where(up < 0, 0, parent_node))
    # ancestor rows in node order: node m sees what its parent sees, and itself
    mask = (i[:, None] == i[None, :]) & (i[:, None] == 0)
    for m in tl.static_range(1, N):
        p = tl.sum(tl.where(i == m, parent, 0), 0)
        seen = tl.sum(tl.where(i[:, None] == p, mask.to(tl.int32), 0), 0) > 0
        mask = tl.where(i[:, None] == m, seen[None, :] | (i[None, :] == m), mask)
    depth = tl.sum(mask.to(tl.int32), 1) - 1
    tl.store(Tokens + b * (N - 1) + i - 1, token, mask=real)
    tl.store(Parents + b * N + i, parent.to(tl.int64), mask=i < N)
    tl.store(Depths + b * N + i, depth.to(tl.int64), mask=i < N)
    both = (i[:, None] < N) & (i[None, :] < N)
    tl.store(Mask + b * N * N + i[:, None] * N + i[None, :], mask, mask=both)


_SELECT = CompiledLaunches(_select_kernel)


def select_nodes(
    chosen: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree of the candidates ``chosen`` [B, N-1] (candidate ids, any order) of candidate
    tables ``tokens``, ``parents`` [B, C]: its drafts [B, N-1], parent nodes [B, N] (the root
    -1), depths [B, N] and ancestor mask [B, N, N], in one launch (``max_depth``: the
    reference's, unused here)."""
    b, n = chosen.shape[0], chosen.shape[1] + 1
    if tokens.stride() != parents.stride() or tokens.stride(1) != 1:
        raise ValueError("the candidate tables must share one row-major [B, C] layout")
    device = chosen.device
    out = (
        torch.empty(b, n - 1, dtype=tokens.dtype, device=device),
        torch.empty(b, n, dtype=torch.int64, device=device),
        torch.empty(b, n, dtype=torch.int64, device=device),
        torch.empty(b, n, n, dtype=torch.bool, device=device),
    )
    constants = {"N": n, "BLOCK": triton.next_power_of_2(n)}
    _SELECT((b, 1, 1), (chosen.contiguous(), tokens, parents, *out), (tokens.stride(0),), constants)
    return out


def select_nodes_ref(
    chosen: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_nodes`` in torch (``max_depth``: the most hops of the ancestor mask)."""
    chosen = chosen.sort(dim=-1).values  # [B, N-1]
    b, device = chosen.shape[0], chosen.device
    parent_ids = parents.gather(1, chosen)
    # node of a candidate: 1 + its rank among the chosen (chosen is sorted); root: 0
    node = torch.searchsorted(chosen, parent_ids.clamp_min(0)) + 1
    node_parents = torch.where(parent_ids < 0, 0, node)
    root = torch.full((b, 1), -1, dtype=torch.int64, device=device)
    all_parents = torch.cat([root, node_parents], dim=1)
    mask = ancestor_mask(all_parents, max_depth)
    depths = mask.sum(dim=2) - 1  # a node's ancestors, itself left out
    return tokens.gather(1, chosen), all_parents, depths, mask


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N, N]`` bool: ``mask[b, i, j]`` iff node j is node i or one of its ancestors
    (at most ``max_depth`` hops up). Built on the device in ``max_depth`` gathers.
    """
    b, n = parents.shape
    cur = torch.arange(n, device=parents.device).expand(b, n)
    up = parents.clamp_min(0)  # NOTE: the root is its own parent, so hops stop there
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, cur[..., None], True)
    for _ in range(max_depth):
        cur = up.gather(1, cur)
        mask.scatter_(2, cur[..., None], True)
    return mask
