"""NGRAM (prompt lookup) drafting on the device, in Triton, with a checking wrapper and a plain
torch reference.

Request b's tokens are ``t = history[slots[b], :lengths[b]]``, of length n. For every end
position e <= n-2, r(e) is the length of the common suffix of t[:e+1] and t, capped at
``max_window``: the suffix w-grams of t with w <= r(e) all occurred earlier, ending at e. The
match is the largest (r(e), e) with r(e) >= ``min_window``, i.e. the longest suffix that
occurred earlier, at its latest earlier occurrence; the drafts are the (up to k) tokens after
it, t[e+1 : min(e+1+k, n)], and without a match there are none (count 0). Padding entries hold
``FILLER_TOKEN``.

One launch of one program per request, sized from host ints only (no host sync,
graph-capturable): the program walks the history backwards in blocks of end positions, scores a
block as one [block, window] tile (r(e) is the first offset d at which t[e-d] != t[n-1-d]),
keeps the best ``r(e) << 32 | e`` seen, and stops early once r reaches ``max_window``: no
earlier end can beat that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches
from pcgspec.speculative.base import FILLER_TOKEN

_BLOCK = 256  # end positions scored per loop iteration
_TOKEN_DTYPES = (torch.int32, torch.int64)


# NOTE: the history row stride is fixed per engine; the per-batch index arrays are small.
@triton.jit(do_not_specialize=["stride"], do_not_specialize_on_alignment=["Slots", "Lengths"])
def _ngram_kernel(
    History,
    Slots,
    Lengths,
    Drafts,
    Counts,
    stride,
    K: tl.constexpr,
    MIN_W: tl.constexpr,
    MAX_W: tl.constexpr,
    FILLER: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    row = History + tl.load(Slots + b).to(tl.int64) * stride
    n = tl.load(Lengths + b).to(tl.int32)
    d = tl.arange(0, BLOCK_W)  # offsets back from a window's last token
    suffix = tl.load(row + n - 1 - d, mask=d < n, other=0)  # t[n-1-d]
    best = tl.full([], -1, tl.int64)  # r(e) << 32 | e of the best end so far; -1: none
    e0 = n - 1 - BLOCK  # the block [e0, e0 + BLOCK) ends at n-2
    while (e0 > -BLOCK) & (best < (MAX_W << 32)):
        e = e0 + tl.arange(0, BLOCK)
        start = e[:, None] - d[None, :]  # [BLOCK, BLOCK_W] t[e-d]
        valid = (start >= 0) & (d[None, :] < MAX_W)
        same = valid & (tl.load(row + start, mask=valid, other=0) == suffix[None, :])
        run = tl.min(tl.where(same, BLOCK_W, d[None, :]), 1)  # r(e): the first offset that differs
        # NOTE: r(e) >= MIN_W >= 1 only where t[e] is valid, i.e. e >= 0
        key = tl.where(run >= MIN_W, (run.to(tl.int64) << 32) | e.to(tl.int64), -1)
        best = tl.maximum(best, tl.max(key, 0))
        e0 -= BLOCK
    end = best.to(tl.int32)  # NOTE: int64 -> int32 keeps bits 0-31: e
    count = tl.where(best >= 0, tl.minimum(n - 1 - end, K), 0)
    j = tl.arange(0, BLOCK_K)
    drafts = tl.load(row + end + 1 + j, mask=j < count, other=FILLER)
    tl.store(Drafts + b * K + j, drafts.to(tl.int64), mask=j < K)
    tl.store(Counts + b, count.to(tl.int64))


# NOTE: proposing runs every speculative step, host-bound at small batch: launch without
# Triton's binder.
_PROPOSE = CompiledLaunches(_ngram_kernel)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_inputs(
    history: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    num_steps: int,
    min_window: int,
    max_window: int,
) -> None:
    _require(
        history.dim() == 2 and history.dtype in _TOKEN_DTYPES and history.stride(1) == 1,
        f"history must be [S, L] in {_TOKEN_DTYPES} with unit stride along L, got "
        f"{list(history.shape)} {history.dtype}",
    )
    b = slots.shape[0] if slots.dim() == 1 else -1
    for name, x in (("slots", slots), ("lengths", lengths)):
        ok = x.shape == (b,) and x.dtype in _TOKEN_DTYPES and x.is_contiguous()
        _require(ok, f"{name} must be contiguous [{b}] int32/int64, got {list(x.shape)} {x.dtype}")
        _require(
            x.device == history.device, f"{name} is on {x.device}, history on {history.device}"
        )
    _require(num_steps >= 1, f"num_steps must be >= 1, got {num_steps}")
    _require(
        1 <= min_window <= max_window,
        f"need 1 <= min_window <= max_window, got {min_window}, {max_window}",
    )


def _empty(b: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((b, k), FILLER_TOKEN, dtype=torch.int64, device=device),
        torch.zeros(b, dtype=torch.int64, device=device),
    )


def ngram_propose(
    history: torch.Tensor,  # [S, L] int32/int64 token table, unit stride along L
    slots: torch.Tensor,  # [B] the row of request b
    lengths: torch.Tensor,  # [B] request b's token count, in 0..L
    num_steps: int,  # k
    min_window: int,
    max_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. Returns (drafts [B, k] int64, counts [B] int64)."""
    _check_inputs(history, slots, lengths, num_steps, min_window, max_window)
    b = slots.shape[0]
    drafts, counts = _empty(b, num_steps, history.device)
    if b == 0:
        return drafts, counts
    constants = {
        "K": num_steps,
        "MIN_W": min_window,
        "MAX_W": max_window,
        "FILLER": FILLER_TOKEN,
        "BLOCK": _BLOCK,
        "BLOCK_W": triton.next_power_of_2(max_window),
        "BLOCK_K": triton.next_power_of_2(num_steps),
    }
    _PROPOSE((b, 1, 1), (history, slots, lengths, drafts, counts), (history.stride(0),), constants)
    return drafts, counts


def ngram_propose_ref(
    history: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    num_steps: int,
    min_window: int,
    max_window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule in plain torch, vectorized over requests and end positions."""
    _check_inputs(history, slots, lengths, num_steps, min_window, max_window)
    width = max(lengths.tolist(), default=0)
    drafts, counts = _empty(slots.shape[0], num_steps, history.device)
    if width < 2:  # no end position before a last token
        return drafts, counts
    t = history.index_select(0, slots.long())[:, :width].long()  # [B, N]
    n = lengths.long()[:, None]  # [B, 1]
    ends = torch.arange(width, device=t.device)  # e; real ones are <= n-2
    run = torch.zeros_like(t)  # [B, N] r(e)
    same = ends < n - 1
    for d in range(min(max_window, width - 1)):
        same &= (ends >= d) & (t[:, (ends - d).clamp_min(0)] == t.gather(1, (n - 1 - d).clamp(0)))
        run += same
    key = torch.where(run >= min_window, run << 32 | ends, -1).amax(dim=1)  # [B]
    end = key & 0xFFFFFFFF
    counts = torch.where(key >= 0, (n[:, 0] - 1 - end).clamp_max(num_steps), 0)
    steps = torch.arange(num_steps, device=t.device)
    follow = (end[:, None] + 1 + steps).clamp_max(width - 1)  # [B, k]
    drafts = torch.where(steps < counts[:, None], t.gather(1, follow), FILLER_TOKEN)
    return drafts, counts
