"""One depth of a draft tree's expansion (``speculative.tree.TreeExpansion.expand``) in one
Triton launch, with a torch reference.

Per request, from its ``k`` beams (path scores, candidate ids, ancestor masks over the levels
so far) and the head's ``k`` best children of each beam (log-probabilities, tokens): record
the ``k * k`` children as candidates (score: the beam's plus the child's, less ``strict``;
token; parent: the beam's candidate id) at columns ``first ..`` of the candidate tables, keep
the ``k`` best as the next beams (ties to the lower child index, as ``kernels.top_k``), and
grow their masks by the new level (each new beam sees its parent beam's ancestors and itself).
Eager torch took about a dozen small kernels a depth for the same.
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
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_KK)  # child c of beam c // K
    valid = c < K * K
    beam = c // K
    lp = tl.load(ChildLp + b * K * K + c, mask=valid, other=float("-inf")).to(tl.float64)
    score = tl.load(BeamScores + b * K + beam, mask=valid, other=0.0) + lp - strict
    score = tl.where(valid, score, float("-inf"))
    token = tl.load(ChildTok + b * K * K + c, mask=valid, other=0)
    parent = tl.load(BeamIds + b * K + beam, mask=valid, other=0)
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


def _check(beams: Beams, child_lp: torch.Tensor, child_tok: torch.Tensor) -> tuple[int, ...]:
    b, k = beams.scores.shape
    width = beams.mask.shape[2]
    shapes = {
        "beams.scores": (beams.scores, (b, k)),
        "beams.ids": (beams.ids, (b, k)),
        "beams.mask": (beams.mask, (b, k, width)),
        "child_lp": (child_lp, (b * k, k)),
        "child_tok": (child_tok, (b * k, k)),
    }
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    return b, k, width


def expand_beams(
    beams: Beams,
    child_lp: torch.Tensor,
    child_tok: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    strict: float,
) -> Beams:
    """One depth in one launch: writes the ``k * k`` children into ``candidates`` (scores
    float64, tokens, parents: [B, C], columns ``first ..``) and returns the next ``Beams``."""
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
    tensors = (
        beams.scores.contiguous(),
        beams.ids.contiguous(),
        beams.mask.contiguous(),
        child_lp.contiguous(),
        child_tok.contiguous(),
        scores,
        tokens,
        parents,
        *out,
    )
    constants = {
        "K": k,
        "BLOCK_KK": triton.next_power_of_2(k * k),
        "BLOCK_W": triton.next_power_of_2(width + k),
    }
    _EXPAND((b, 1, 1), tensors, (scores.stride(0), first, width, strict), constants)
    return out


def expand_beams_ref(
    beams: Beams,
    child_lp: torch.Tensor,
    child_tok: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    first: int,
    strict: float,
) -> Beams:
    """``expand_beams`` in torch."""
    b, k, width = _check(beams, child_lp, child_tok)
    scores, tokens, parents = candidates
    child = (beams.scores[..., None] + child_lp.view(b, k, k).double() - strict).view(b, k * k)
    cols = slice(first, first + k * k)
    scores[:, cols] = child
    tokens[:, cols] = child_tok.reshape(b, k * k)
    parents[:, cols] = beams.ids.repeat_interleave(k, dim=1)
    best_scores, best = top_k_ref(child, k)
    parent = best // k
    grown = beams.mask.gather(1, parent[..., None].expand(-1, -1, width))
    fresh = torch.eye(k, dtype=torch.bool, device=child.device).expand(b, -1, -1)
    return Beams(
        best_scores,
        first + best,
        child_tok.reshape(b, k * k).gather(1, best),
        torch.cat([grown, fresh], dim=2),
        parent,
    )
