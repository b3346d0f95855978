"""The k best entries of each row of a ``[R, V]`` tensor, for the small k of draft trees:
Triton kernels, launch, torch reference.

``torch.topk`` runs a radix select in one thread block per row: over a draft vocabulary of a
few thousand entries and a handful of rows it took 40-50 us a call on an H200, about 350 us of
a 16-node tree's speculative step. Here a row is cut into chunks of at most ``CHUNK`` entries;
one program per (row, chunk) keeps its chunk's k best (k rounds of a maximum and its first
position) and, with ``log_softmax``, the chunk's maximum and sum of exponentials; one program
per row merges the chunks' candidates and their sums into the row's k best and its
log-sum-exp. A row of at most ``CHUNK`` entries takes the first launch only.

Entries are ranked by their input value, best first; equal inputs go to the lower index (a
stable descending sort), and NaN ranks as -inf. With ``log_softmax`` a row holding
NaN or +inf has NaN log-probabilities, as ``torch.log_softmax`` gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches
from pcgspec.speculative.config import MAX_TREE_WIDTH as MAX_K  # draft trees call it

CHUNK = 1024  # entries per program of the first launch


@triton.jit
def pick_best(values, taken, lane, SIZE: tl.constexpr):
    """The best value not yet taken and the lowest lane holding it (``SIZE``: none left)."""
    masked = tl.where(taken, float("-inf"), values)
    best = tl.max(masked, 0)
    lane_of = tl.min(tl.where((masked == best) & ~taken, lane, SIZE), 0)
    return best, lane_of


@triton.jit(do_not_specialize_on_alignment=["X", "Val", "Idx", "Max", "Sum"])
def _chunk_top_k_kernel(
    X,
    Val,
    Idx,
    Max,
    Sum,
    stride,
    V,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr,
    FINAL: tl.constexpr,
    F64: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    chunks = tl.num_programs(1)
    lane = tl.arange(0, BLOCK)
    col = chunk * BLOCK + lane
    inside = col < V
    raw = tl.load(X + row.to(tl.int64) * stride + col, mask=inside, other=float("-inf"))
    raw = raw.to(tl.float64) if F64 else raw.to(tl.float32)
    x = tl.where(raw == raw, raw, float("-inf"))  # NaN ranks last
    if LOG_SOFTMAX:
        top = tl.max(x, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # an all -inf chunk sums to 0
        total = tl.sum(tl.exp(x - top), 0)  # NOTE: NaN when the chunk holds +inf
        total = tl.where(tl.max((raw != raw).to(tl.int32), 0) > 0, float("nan"), total)
        if FINAL:
            lse = top + tl.log(total)
        else:
            # NOTE: a NaN sum (the chunk held NaN or +inf) reaches the merge and its result
            tl.store(Max + row * chunks + chunk, tl.where(total != 0, top, float("-inf")))
            tl.store(Sum + row * chunks + chunk, total)
    out = (row * chunks + chunk) * K
    taken = ~inside
    for j in tl.static_range(K):
        best, at = pick_best(x, taken, lane, BLOCK)
        taken = taken | (lane == at)
        if LOG_SOFTMAX and FINAL:
            best = best - lse
        tl.store(Val + out + j, best)
        tl.store(Idx + out + j, tl.where(at < BLOCK, chunk * BLOCK + at, -1).to(tl.int64))


@triton.jit(do_not_specialize_on_alignment=["CandVal", "CandIdx", "Max", "Sum", "Val", "Idx"])
def _merge_top_k_kernel(
    CandVal,
    CandIdx,
    Max,
    Sum,
    Val,
    Idx,
    chunks,
    K: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
    LOG_SOFTMAX: tl.constexpr,
):
    row = tl.program_id(0)
    n = chunks * K
    c = tl.arange(0, BLOCK_C)
    val = tl.load(CandVal + row * n + c, mask=c < n, other=float("-inf"))
    idx = tl.load(CandIdx + row * n + c, mask=c < n, other=-1)
    taken = idx < 0  # padding, and chunks with fewer than K entries
    if LOG_SOFTMAX:
        ch = tl.arange(0, BLOCK_CHUNKS)
        tops = tl.load(Max + row * chunks + ch, mask=ch < chunks, other=float("-inf"))
        sums = tl.load(Sum + row * chunks + ch, mask=ch < chunks, other=0.0)
        top = tl.max(tops, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        lse = top + tl.log(tl.sum(tl.where(sums != 0, sums * tl.exp(tops - top), 0.0), 0))
    for j in tl.static_range(K):
        best, at = pick_best(val, taken, c, BLOCK_C)
        taken = taken | (c == at)
        if LOG_SOFTMAX:
            best = best - lse
        tl.store(Val + row * K + j, best)
        tl.store(Idx + row * K + j, tl.sum(tl.where(c == at, idx, 0), 0))


# NOTE: inside the speculative step's graph as a rule; eager drafting launches them per level
_CHUNKS = CompiledLaunches(_chunk_top_k_kernel)
_MERGE = CompiledLaunches(_merge_top_k_kernel)


def num_launches(v: int) -> int:
    """The launches of ``top_k`` over rows of ``v`` entries."""
    return 1 + (v > CHUNK)


def _check(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"top_k takes [R, V] rows, got shape {list(x.shape)}")
    if not (isinstance(k, int) and 1 <= k <= min(MAX_K, x.shape[1])):
        raise ValueError(f"k must be in 1..{min(MAX_K, x.shape[1])}, got {k!r}")


def top_k(x: torch.Tensor, k: int, log_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, V] -> (values [R, k], ids [R, k] int64)``, best first, equal inputs to the lower
    id; values in float32 (float64 for a float64 ``x``), with ``log_softmax`` the rows'
    log-probabilities. Two launches (one for V <= ``CHUNK``), sized by host ints only."""
    _check(x, k)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, v = x.shape
    f64 = x.dtype == torch.float64
    dtype = torch.float64 if f64 else torch.float32
    val = torch.empty(rows, k, dtype=dtype, device=x.device)
    idx = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    block = min(triton.next_power_of_2(v), CHUNK)
    chunks = -(-v // block)
    final = chunks == 1
    if final:
        cand_val, cand_idx, tops, sums = val, idx, val, val  # NOTE: tops/sums unused
    else:
        cand_val = torch.empty(rows, chunks * k, dtype=dtype, device=x.device)
        cand_idx = torch.empty(rows, chunks * k, dtype=torch.int64, device=x.device)
        tops = torch.empty(rows, chunks, dtype=dtype, device=x.device)
        sums = torch.empty(rows, chunks, dtype=dtype, device=x.device)
    constants = {"K": k, "BLOCK": block, "LOG_SOFTMAX": log_softmax, "FINAL": final, "F64": f64}
    tensors = (x, cand_val, cand_idx, tops, sums)
    _CHUNKS((rows, chunks, 1), tensors, (x.stride(0), v), constants)
    if not final:
        constants = {
            "K": k,
            "BLOCK_C": triton.next_power_of_2(chunks * k),
            "BLOCK_CHUNKS": triton.next_power_of_2(chunks),
            "LOG_SOFTMAX": log_softmax,
        }
        tensors = (cand_val, cand_idx, tops, sums, val, idx)
        _MERGE((rows, 1, 1), tensors, (chunks,), constants)
    return val, idx


def top_k_ref(
    x: torch.Tensor, k: int, log_softmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` in torch: a stable descending sort of the input."""
    _check(x, k)
    x = x.double() if x.dtype == torch.float64 else x.float()
    ranked = torch.where(x.isnan(), float("-inf"), x)
    values, ids = ranked.sort(dim=-1, descending=True, stable=True)
    values, ids = values[:, :k], ids[:, :k]
    if log_softmax:
        values = x.log_softmax(dim=-1).gather(1, ids)
    return values, ids
