"""Verification of k draft tokens per request against the target's k+1 rows, in Triton, with
a checking wrapper and a plain torch reference.

Row ``j`` of request ``b`` is the target's distribution for the token after draft ``j - 1``
(row 0: after the last verified token). Strategies:

- GREEDY: draft j is accepted iff it is argmax p_j; the next token is argmax p_{accept_len}.
- TARGET_MATCH: draft j is accepted iff it equals the target's own seeded draw from p_j
  (``sample_from_probs`` with ``uniform(seed, position + j, STREAM_TOKEN)``), and that draw is
  the next token: seeded output equals non-speculative seeded output (lossless for any drafter).
- REJECTION: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)) (``STREAM_ACCEPT``); on the
  first rejection draw from normalize(max(p_j - q_j, 0)) (``STREAM_RESAMPLE``); if all drafts
  pass, the bonus is drawn from p_k (``STREAM_TOKEN``). Lossless when d_j ~ q_j.

Draft trees (``parents``: node i's parent, in depth order; node 0 the root, row i the target's
distribution after node i): row i's candidate is its argmax (GREEDY) or its seeded draw
(TARGET_MATCH, at the output position of its depth), and the walk from the root moves to the
child whose token equals the candidate while there is one; the last node's candidate is the
next token. So a tree accepts the longest root path the target's own choices follow, and seeded
output stays the target's seeded output (the same rule as SGLang's target-only tree sampling:
move to a child with the target's probability of its token, else draw from the rest). The
accepted nodes come back as ``path`` (node of each output position's input).

Draws are inverse CDFs in vocabulary order, as in ``pcgspec.sampling.sample_from_probs``.
``num_draft[b] < k`` (a drafter that proposed fewer) caps the accepted length; the token after
the last proposed draft then comes from p_{num_draft} as if all had passed. ``is_greedy`` marks
requests of a sampled batch that use the GREEDY rule.

Two launches, sized from host ints only (graph-capturable): one program per (request, row)
scores its row, one program per request turns the row verdicts into the output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pcgspec.kernels.build_sampling_params import rng_uniform
from pcgspec.kernels.launches import CompiledLaunches
from pcgspec.kernels.sample_tokens import argmax_row, sample_row
from pcgspec.kernels.tree_walk import check_tree, walk_trees, walk_trees_ref
from pcgspec.sampling.rng import STREAM_ACCEPT, STREAM_RESAMPLE, STREAM_TOKEN, uniform
from pcgspec.sampling.sampler import probs_from_logits, sample_from_probs

_TOKEN = tl.constexpr(STREAM_TOKEN)
_ACCEPT = tl.constexpr(STREAM_ACCEPT)
_RESAMPLE = tl.constexpr(STREAM_RESAMPLE)
_PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class VerifyStrategy(enum.IntEnum):
    GREEDY = 0
    TARGET_MATCH = 1
    REJECTION = 2


_GREEDY = tl.constexpr(int(VerifyStrategy.GREEDY))
_TARGET_MATCH = tl.constexpr(int(VerifyStrategy.TARGET_MATCH))


@dataclass(frozen=True)
class VerifyOutput:
    accept_len: torch.Tensor  # [B] int64, accepted drafts in 0..k
    tokens: torch.Tensor  # [B, k+1] int64: accept_len drafts, the next token, then -1
    # [B, k+1] int64 trees: the accepted nodes (0 the root, then one per accepted draft), then
    # -1; None: a chain (node j at position j)
    path: torch.Tensor | None = None

    @classmethod
    def empty(cls, b: int, k: int, device: torch.device, tree: bool = False) -> VerifyOutput:
        rows = 2 * (k + 1) + 1 if tree else k + 2
        buffer = torch.empty(b * rows, dtype=torch.int64, device=device)  # one allocation
        tokens = buffer[b : b * (k + 2)].view(b, k + 1)
        path = buffer[b * (k + 2) :].view(b, k + 1) if tree else None
        return cls(buffer[:b], tokens, path)


@triton.jit
def _rejection_row(p_row, q_row, draft, seed, pos, is_draft, V, BLOCK_V: tl.constexpr):
    """(token if this row ends the accepted run, draft accepted) for REJECTION."""
    if is_draft:
        # accept with probability min(1, p/q):  u < p(d) / q(d)  <=>  u * q(d) < p(d)
        p_d = tl.load(p_row + draft).to(tl.float32)
        q_d = tl.load(q_row + draft).to(tl.float32)
        ok = rng_uniform(seed, pos, _ACCEPT) * q_d < p_d
        u = rng_uniform(seed, pos, _RESAMPLE)
        token, total = sample_row(p_row, q_row, 1.0, u, V, True, BLOCK_V)
        if total == 0.0:  # NOTE: an empty residual only comes from rounding: fall back to p
            token, _ = sample_row(p_row, q_row, 0.0, u, V, False, BLOCK_V)
    else:  # the bonus after the last proposed draft
        token, _ = sample_row(p_row, q_row, 0.0, rng_uniform(seed, pos, _TOKEN), V, False, BLOCK_V)
        ok = token < 0  # i.e. False: this row has no draft
    return token, ok


# NOTE: the per-row index arrays may be views (of the sampling rows): their alignment is not
# specialized; the probability rows' is.
@triton.jit(
    do_not_specialize_on_alignment=["Draft", "Seed", "Pos", "NumDraft", "Greedy", "Accept", "Cand"]
)
def _verify_rows_kernel(
    P,
    Q,
    Draft,
    Seed,
    Pos,
    NumDraft,
    Greedy,
    Accept,
    Cand,
    stride_pb,
    stride_pj,
    stride_qb,
    stride_qj,
    V,
    K,
    STRATEGY: tl.constexpr,
    HAS_NUM_DRAFT: tl.constexpr,
    HAS_GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    n = K
    if HAS_NUM_DRAFT:
        n = tl.maximum(tl.minimum(tl.load(NumDraft + b).to(tl.int32), K), 0)
    if j > n:
        return  # NOTE: the output never reads rows past the last proposed draft
    p_row = P + b.to(tl.int64) * stride_pb + j * stride_pj
    q_row = Q + b.to(tl.int64) * stride_qb + j * stride_qj
    row = b * (K + 1) + j
    is_draft = j < n
    draft = tl.load(Draft + b * K + j, mask=is_draft, other=-1).to(tl.int32)
    greedy = STRATEGY == _GREEDY
    if HAS_GREEDY:
        greedy = tl.load(Greedy + b) != 0
    if greedy:
        token = argmax_row(p_row, V, BLOCK_V)
        ok = token == draft
    elif STRATEGY == _TARGET_MATCH:
        u = rng_uniform(tl.load(Seed + row), tl.load(Pos + row), _TOKEN)
        token, _ = sample_row(p_row, q_row, 0.0, u, V, False, BLOCK_V)
        ok = token == draft
    else:
        seed = tl.load(Seed + row)
        token, ok = _rejection_row(
            p_row, q_row, draft, seed, tl.load(Pos + row), is_draft, V, BLOCK_V
        )
    tl.store(Accept + row, (ok & is_draft).to(tl.int32))
    tl.store(Cand + row, token.to(tl.int64))


@triton.jit(do_not_specialize_on_alignment=["Accept", "Cand", "Draft", "AcceptLen", "Out"])
def _accept_kernel(Accept, Cand, Draft, AcceptLen, Out, K, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    ok = tl.load(Accept + b * (K + 1) + j, mask=j < K, other=0)
    accept_len = tl.min(tl.where(ok != 0, BLOCK_K, j), 0)  # first rejected row; row n rejects
    draft = tl.load(Draft + b * K + j, mask=j < accept_len, other=-1)
    cand = tl.load(Cand + b * (K + 1) + j, mask=j == accept_len, other=-1)
    tokens = tl.where(j < accept_len, draft, cand)
    tl.store(Out + b * (K + 1) + j, tokens, mask=j <= K)
    tl.store(AcceptLen + b, accept_len.to(tl.int64))


# NOTE: a verify step is host-bound at small batch: launch without Triton's binder.
_VERIFY_ROWS = CompiledLaunches(_verify_rows_kernel)
_ACCEPT_RUNS = CompiledLaunches(_accept_kernel)


def match_targets(processed: torch.Tensor, is_greedy: torch.Tensor) -> torch.Tensor:
    """TARGET_MATCH's rows from processed logits [R, V]: probabilities, except the rows of
    greedy requests (``is_greedy`` [R]), which keep their logits: pass the requests' flags as
    ``is_greedy`` and the kernel takes their argmax, as plain decoding does."""
    return torch.where(is_greedy[:, None], processed, probs_from_logits(processed))


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check(
    name: str,
    x: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    contiguous: bool = True,
) -> None:
    _require(tuple(x.shape) == shape, f"{name} must be {list(shape)}, got {list(x.shape)}")
    _require(x.dtype in dtypes, f"{name} dtype must be one of {dtypes}, got {x.dtype}")
    _require(x.device == device, f"{name} is on {x.device}, target_probs on {device}")
    _require(x.is_contiguous() or not contiguous, f"{name} must be contiguous")


def _check_inputs(
    p: torch.Tensor,
    draft: torch.Tensor,
    strategy: VerifyStrategy,
    q: torch.Tensor | None,
    seed: torch.Tensor | None,
    position: torch.Tensor | None,
    num_draft: torch.Tensor | None,
    is_greedy: torch.Tensor | None,
) -> None:
    ok = p.dim() == 3 and p.shape[1] >= 2 and p.dtype in _PROB_DTYPES and p.stride(2) == 1
    _require(
        ok,
        f"target_probs must be [B, k+1, V] (k >= 1) in {_PROB_DTYPES} with unit stride "
        f"along V, got {list(p.shape)} {p.dtype}",
    )
    (b, k1, v), dev = p.shape, p.device
    _check("draft_tokens", draft, (b, k1 - 1), (torch.int64, torch.int32), dev)
    _require(
        (q is not None) == (strategy == VerifyStrategy.REJECTION),
        "draft_probs is required by REJECTION and only by it",
    )
    if q is not None:
        _check("draft_probs", q, (b, k1 - 1, v), _PROB_DTYPES, dev, contiguous=False)
        _require(q.stride(2) == 1, "draft_probs must have unit stride along V")
    _require(
        strategy == VerifyStrategy.GREEDY or (seed is not None and position is not None),
        f"{strategy.name} needs seed and position",
    )
    optional = [
        ("seed", seed, (b, k1), (torch.int64,)),
        ("position", position, (b, k1), (torch.int64,)),
        ("num_draft", num_draft, (b,), (torch.int64, torch.int32)),
        ("is_greedy", is_greedy, (b,), (torch.bool,)),
    ]
    for name, x, shape, dtypes in optional:
        if x is not None:
            _check(name, x, shape, dtypes, dev)


def verify_draft_tokens(
    target_probs: torch.Tensor,  # [B, k+1, V] processed and normalized; GREEDY: logits will do
    draft_tokens: torch.Tensor,  # [B, k]
    strategy: VerifyStrategy,
    *,
    draft_probs: torch.Tensor | None = None,  # [B, k, V], REJECTION only
    seed: torch.Tensor | None = None,  # [B, k+1] int64 per row (not needed by GREEDY)
    position: torch.Tensor | None = None,  # [B, k+1] int64 output index of each row
    num_draft: torch.Tensor | None = None,  # [B] drafts actually proposed (<= k); None = k
    is_greedy: torch.Tensor | None = None,  # [B] bool, requests that use the GREEDY rule
    parents: torch.Tensor | None = None,  # [B, k+1] int64 draft trees; None: a chain
    max_depth: int | None = None,  # trees: their depth D; output positions D+1
    block_v: int | None = None,
    out: VerifyOutput | None = None,
) -> VerifyOutput:
    """See the module docstring. Draft tokens must be in [0, V) (fillers included)."""
    strategy = VerifyStrategy(strategy)
    _check_inputs(
        target_probs, draft_tokens, strategy, draft_probs, seed, position, num_draft, is_greedy
    )
    b, k1, v = target_probs.shape
    depth = k1 - 1
    if parents is not None or max_depth is not None:
        depth = check_tree(parents, max_depth, strategy != VerifyStrategy.REJECTION, b, k1)
        _check("parents", parents, (b, k1), (torch.int64,), target_probs.device)
    device = target_probs.device
    out = out if out is not None else VerifyOutput.empty(b, depth, device, parents is not None)
    _check("out.accept_len", out.accept_len, (b,), (torch.int64,), device)
    _check("out.tokens", out.tokens, (b, depth + 1), (torch.int64,), device)
    if parents is not None:
        _require(out.path is not None, "a tree's out needs a path")
        _check("out.path", out.path, (b, depth + 1), (torch.int64,), device)
    if b == 0:
        return out
    accept = torch.empty(b, k1, dtype=torch.int32, device=device)
    cand = torch.empty(b, k1, dtype=torch.int64, device=device)
    q = draft_probs if draft_probs is not None else target_probs
    dummy = draft_tokens  # stands in for absent optional pointers; never read
    tensors = (
        target_probs,
        q,
        draft_tokens,
        seed if seed is not None else dummy,
        position if position is not None else dummy,
        num_draft if num_draft is not None else dummy,
        is_greedy if is_greedy is not None else dummy,
        accept,
        cand,
    )
    scalars = (target_probs.stride(0), target_probs.stride(1), q.stride(0), q.stride(1), v, k1 - 1)
    constants = {
        "STRATEGY": int(strategy),
        "HAS_NUM_DRAFT": num_draft is not None,
        "HAS_GREEDY": is_greedy is not None and strategy != VerifyStrategy.GREEDY,
        "BLOCK_V": block_v or min(4096, triton.next_power_of_2(v)),
        "num_warps": 8 if v >= 8192 else 4,
    }
    _VERIFY_ROWS((b, k1, 1), tensors, scalars, constants)
    if parents is not None:
        walk_trees(cand, draft_tokens, parents, num_draft, (out.accept_len, out.tokens, out.path))
        return out
    constants = {"BLOCK_K": triton.next_power_of_2(k1)}
    _ACCEPT_RUNS(
        (b, 1, 1), (accept, cand, draft_tokens, out.accept_len, out.tokens), (k1 - 1,), constants
    )
    return out


def _accept_test(u: torch.Tensor, p_d: torch.Tensor, q_d: torch.Tensor) -> torch.Tensor:
    # accept with probability min(1, p/q):  u < p(d) / q(d)  <=>  u * q(d) < p(d)
    return u * q_d < p_d


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0); a row that rounding left empty falls back to p. [..., V]"""
    r = (p - q).clamp_min(0.0)
    return torch.where((r.sum(-1, keepdim=True) == 0), p, r)


def _draw(
    weights: torch.Tensor, seed: torch.Tensor, position: torch.Tensor, stream: int
) -> torch.Tensor:
    """``sample_from_probs`` over [B, J, V] weights with per-row uniforms -> [B, J]."""
    b, j, v = weights.shape
    u = uniform(seed.reshape(-1), position.reshape(-1), stream)
    return sample_from_probs(weights.reshape(-1, v), u).view(b, j)


def _rejection_rows(
    p: torch.Tensor,
    q: torch.Tensor,
    draft: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    num_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (accepted [B, k], token emitted if the row is the first not accepted [B, k+1])."""
    k = draft.shape[1]
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)
    ok = _accept_test(uniform(seed[:, :k], position[:, :k], STREAM_ACCEPT), p_d, q_d)
    resampled = _draw(_residual(p[:, :k], q), seed[:, :k], position[:, :k], STREAM_RESAMPLE)
    bonus = _draw(p, seed, position, STREAM_TOKEN)
    rows = torch.arange(k + 1, device=p.device)
    cand = torch.where(rows[:k] < num_draft[:, None], resampled, bonus[:, :k])
    return ok, torch.cat([cand, bonus[:, k:]], dim=1)


def verify_draft_tokens_ref(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    strategy: VerifyStrategy,
    *,
    draft_probs: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    position: torch.Tensor | None = None,
    num_draft: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    parents: torch.Tensor | None = None,
    max_depth: int | None = None,
) -> VerifyOutput:
    """The same rules in plain torch, vectorized over requests and rows."""
    p = target_probs.float()
    b, k1, _ = p.shape
    k = k1 - 1
    draft = draft_tokens.long()
    rows = torch.arange(k1, device=p.device)
    num_draft = torch.full((b,), k, device=p.device) if num_draft is None else num_draft
    num_draft = num_draft.long().clamp(0, k)
    if parents is not None or max_depth is not None:
        check_tree(parents, max_depth, VerifyStrategy(strategy) != VerifyStrategy.REJECTION, b, k1)
    argmax = p.argmax(dim=-1)  # [B, k+1]
    if strategy == VerifyStrategy.GREEDY:
        ok, cand = draft == argmax[:, :k], argmax
    elif strategy == VerifyStrategy.TARGET_MATCH:
        cand = _draw(p, seed, position, STREAM_TOKEN)
        ok = draft == cand[:, :k]
    else:
        ok, cand = _rejection_rows(p, draft_probs.float(), draft, seed, position, num_draft)
    if is_greedy is not None:
        ok = torch.where(is_greedy[:, None], draft == argmax[:, :k], ok)
        cand = torch.where(is_greedy[:, None], argmax, cand)
    if parents is not None:
        return VerifyOutput(*walk_trees_ref(cand, draft, parents, num_draft, max_depth))
    ok = ok & (rows[:k] < num_draft[:, None])
    accept_len = ok.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepted drafts
    padded = torch.cat([draft, torch.full_like(draft[:, :1], -1)], dim=1)
    tokens = torch.where(rows < accept_len[:, None], padded, -1)
    tokens = torch.where(rows == accept_len[:, None], cand, tokens)
    return VerifyOutput(accept_len, tokens)
