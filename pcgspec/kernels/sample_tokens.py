"""One token per row in one launch: greedy rows take the argmax, sampled rows a seeded
inverse-CDF draw, with the row helpers speculative verification draws with too.

A plain step's sampled rows used to go through about fifty eager ops (the counter-based
uniform of ``pcgspec.sampling.rng`` alone is some thirty integer ops, then a prefix sum, a
search, a gather and two selects over the vocabulary): on a host-bound decode step that
doubled its time. Here one program per row reads its probabilities (or, greedy, its processed
logits), hashes its own uniform (``rng_uniform``) and finds its token in two passes over the
vocabulary. The draw is ``sample_row``, the one ``verify_draft_tokens`` makes for the target's
seeded choice (TARGET_MATCH), so a seeded request draws the same tokens with or without
speculation; ``pcgspec.sampling.sample_from_probs`` is its torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.kernels.build_sampling_params import rng_uniform
from pcgspec.kernels.launches import CompiledLaunches


@triton.jit
def argmax_row(P, V, BLOCK_V: tl.constexpr):
    """First index of the row's maximum (``P`` may hold logits)."""
    best = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), 0)
    best_idx = tl.min(tl.zeros([BLOCK_V], tl.int32), 0)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(P + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        idx = tl.min(tl.where(x == m, offs, V), 0)
        best_idx = tl.where(m > best, idx, best_idx)
        best = tl.maximum(m, best)
    return best_idx


@triton.jit
def _weights(P, Q, offs, mask, q_scale, HAS_Q: tl.constexpr):
    """p, or the residual max(p - q_scale * q, 0) when ``HAS_Q``."""
    w = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(Q + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.maximum(w - q_scale * q, 0.0)
    return w


@triton.jit
def sample_row(P, Q, q_scale, u, V, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse CDF over the row's weights: the first positive-weight token whose cumulative weight
    exceeds u * total, else the first mode. Returns (token, total).
    """
    total = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)
    best = total - 1.0
    mode = tl.min(tl.zeros([BLOCK_V], tl.int32), 0)
    for v0 in range(0, V, BLOCK_V):  # pass 1: the total (as the running CDF ends) and the mode
        offs = v0 + tl.arange(0, BLOCK_V)
        w = _weights(P, Q, offs, offs < V, q_scale, HAS_Q)
        m = tl.max(w, 0)
        mode = tl.where(m > best, tl.min(tl.where(w == m, offs, V), 0), mode)
        best = tl.maximum(m, best)
        total = tl.max(total + tl.cumsum(w, 0), 0)
    target = u * total
    token = mode * 0 + V
    carry = total * 0.0
    for v0 in range(0, V, BLOCK_V):  # pass 2: the first CDF entry above the target
        offs = v0 + tl.arange(0, BLOCK_V)
        w = _weights(P, Q, offs, offs < V, q_scale, HAS_Q)
        cdf = carry + tl.cumsum(w, 0)
        token = tl.minimum(token, tl.min(tl.where((cdf > target) & (w > 0), offs, V), 0))
        carry = tl.max(cdf, 0)
    return tl.where(token < V, token, mode), total


# NOTE: the per-row parameters are views of the step's sampling rows: their alignment is not
# specialized; the probability and logit rows' is.
@triton.jit(do_not_specialize_on_alignment=["Temp", "Seed", "Pos", "Out"])
def _sample_kernel(
    P,
    L,
    Temp,
    Seed,
    Pos,
    Out,
    stride_p,
    stride_l,
    V,
    greedy_below,
    STREAM: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    if tl.load(Temp + r) < greedy_below:
        token = argmax_row(L + r.to(tl.int64) * stride_l, V, BLOCK_V)
    else:
        u = rng_uniform(tl.load(Seed + r), tl.load(Pos + r), STREAM)
        row = P + r.to(tl.int64) * stride_p
        token, _ = sample_row(row, row, 0.0, u, V, False, BLOCK_V)
    tl.store(Out + r, token.to(tl.int64))


_SAMPLE = CompiledLaunches(_sample_kernel)  # NOTE: a decode step is host-bound: a lean launch


def sample_tokens(
    probs: torch.Tensor,  # [R, V] f32, each row's distribution (need not be normalized)
    logits: torch.Tensor,  # [R, V] f32, the processed logits greedy rows take the argmax of
    temperature: torch.Tensor,  # [R] f32; a row below ``greedy_below`` is greedy
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64, the output index of the token each row chooses
    stream: int,
    greedy_below: float,
    block_v: int | None = None,
) -> torch.Tensor:
    """[R] int64 tokens: per row ``argmax(logits)`` where greedy, else the first token whose
    cumulative weight in ``probs`` exceeds ``uniform(seed, position, stream) * total``."""
    r, v = probs.shape
    if logits.shape != probs.shape or probs.stride(1) != 1 or logits.stride(1) != 1:
        raise ValueError(
            f"probs and logits must be [R, V] with unit stride along V, got "
            f"{list(probs.shape)} and {list(logits.shape)}"
        )
    if not temperature.shape == seed.shape == position.shape == (r,):
        raise ValueError(f"temperature, seed and position must be [{r}]")
    out = torch.empty(r, dtype=torch.int64, device=probs.device)
    if r == 0:
        return out
    constants = {
        "STREAM": stream & 0xFFFFFFFF,
        "BLOCK_V": block_v or min(4096, triton.next_power_of_2(v)),
        "num_warps": 8 if v >= 8192 else 4,
    }
    tensors = (probs, logits, temperature, seed, position, out)
    _SAMPLE((r, 1, 1), tensors, (probs.stride(0), logits.stride(0), v, greedy_below), constants)
    return out
