"""Per-request sampling parameters -> per-row tensors, the device-side output-position counter,
and the counter-based RNG of ``pcgspec.sampling.rng`` in Triton.

A request contributes ``rows_per_request[b]`` consecutive rows from ``row_start[b]`` on: k+1
when it verifies k drafts, 1 when it decodes or ends a prefill. Row ``j`` of a request chooses
its output token number ``position + j`` and draws from ``uniform(seed, position + j, stream)``,
so a seeded request samples the same tokens with or without speculation.

One step is two launches, both sized from host ints only (no host sync, graph-capturable):
``build_sampling_params`` before sampling reads the counter and expands the rows;
``advance_positions`` after sampling/verification adds what each request emitted (1 for a
decode, accept_len + 1 for a verify, 0 for a prefill chunk that samples nothing) and, in the
same launch, records the emitted tokens: each request's last one (the next decode step's input)
and, for prompt lookup, its token history. The split exists because a verify step's advance is
only known after verification.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from pcgspec.kernels.launches import CompiledLaunches

# The constants of pcgspec.sampling.rng (its docstring has the math).
_SEED_SALT = tl.constexpr(0x9E3779B9)
_MUL1 = tl.constexpr(0x21F0AAAD)
_MUL2 = tl.constexpr(0x735A2D97)
_ROW_BLOCK = 16  # rows of one request written per loop iteration
_ADVANCE_BLOCK = 128


@triton.jit
def _mix32(x):
    """Wellons' two-round permutation on uint32 (multiplies wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * _MUL1
    x = x ^ (x >> 15)
    x = x * _MUL2
    return x ^ (x >> 15)


@triton.jit
def rng_hash32(seed, position, stream):
    """``pcgspec.sampling.rng.hash32`` as uint32: ``seed``/``position`` int64, ``stream`` an int
    (constexpr or tensor). Bit-exact with the torch version.
    """
    h = _mix32(seed.to(tl.uint32) ^ _SEED_SALT)  # NOTE: int64 -> uint32 keeps bits 0-31
    h = _mix32(h ^ (seed >> 32).to(tl.uint32))
    # NOTE: Triton turns an int argument equal to 1 into a constexpr, which has no .to():
    # build the uint32 stream value by arithmetic on h instead.
    h = _mix32(h ^ (h * 0 + stream))
    return _mix32(h ^ position.to(tl.uint32))


@triton.jit
def rng_uniform(seed, position, stream):
    """``pcgspec.sampling.rng.uniform``: float32 in (0, 1), bit-exact with the torch version."""
    h = rng_hash32(seed, position, stream)
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


# NOTE: the request table's rows are views at offsets of num_slots entries; the per-batch index
# arrays are small: no input's alignment is specialized.
_TABLE_AND_INDEX = ["Temp", "TopP", "TopK", "MinP", "Seed", "Pos", "Slots", "RowsPer", "RowStart"]


@triton.jit(do_not_specialize_on_alignment=_TABLE_AND_INDEX)
def _build_kernel(
    Temp,
    TopP,
    TopK,
    MinP,
    Seed,
    Pos,
    Slots,
    RowsPer,
    RowStart,
    OTemp,
    OTopP,
    OTopK,
    OMinP,
    OSeed,
    OPos,
    HAS_SLOTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    slot = b.to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(Slots + b).to(tl.int64)
    if slot < 0:
        return
    n = tl.load(RowsPer + b)
    start = tl.load(RowStart + b).to(tl.int64)
    temp = tl.load(Temp + slot)
    top_p = tl.load(TopP + slot)
    top_k = tl.load(TopK + slot)
    min_p = tl.load(MinP + slot)
    seed = tl.load(Seed + slot)
    pos = tl.load(Pos + slot)
    for j0 in range(0, n, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        mask = j < n
        rows = start + j
        zero_f = tl.zeros([BLOCK], dtype=tl.float32)
        zero_i = tl.zeros([BLOCK], dtype=tl.int64)
        tl.store(OTemp + rows, zero_f + temp, mask=mask)
        tl.store(OTopP + rows, zero_f + top_p, mask=mask)
        tl.store(OTopK + rows, zero_i + top_k, mask=mask)
        tl.store(OMinP + rows, zero_f + min_p, mask=mask)
        tl.store(OSeed + rows, zero_i + seed, mask=mask)
        tl.store(OPos + rows, pos + j, mask=mask)


@triton.jit(
    do_not_specialize=[
        "num_requests",
        "num_tokens",
        "token_stride",
        "history_stride",
        "history_end",
    ],
    do_not_specialize_on_alignment=[
        "Pos",
        "Slots",
        "Emitted",
        "Tokens",
        "LastToken",
        "History",
        "PromptLen",
    ],
)
def _advance_kernel(
    Pos,
    Slots,
    Emitted,
    Tokens,
    LastToken,
    History,
    PromptLen,
    num_requests,
    num_tokens,
    token_stride,
    history_stride,
    history_end,
    HAS_SLOTS: tl.constexpr,
    HAS_TOKENS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = b < num_requests
    slot = b.to(tl.int64)
    if HAS_SLOTS:
        slot = tl.load(Slots + b, mask=mask, other=-1).to(tl.int64)
        mask = mask & (slot >= 0)
    emitted = tl.load(Emitted + b, mask=mask, other=0).to(tl.int64)
    pos = tl.load(Pos + slot, mask=mask, other=0)
    if HAS_TOKENS:
        j = tl.arange(0, BLOCK_T)
        in_row = mask[:, None] & (j[None, :] < num_tokens)
        tokens = tl.load(
            Tokens + b.to(tl.int64)[:, None] * token_stride + j[None, :], mask=in_row, other=0
        )
        last = tl.sum(tl.where(j[None, :] == emitted[:, None] - 1, tokens, 0), axis=1)
        tl.store(LastToken + slot, last, mask=mask & (emitted > 0))
        if HAS_HISTORY:  # NOTE: at the old length; past a row's end into its spill column
            length = tl.load(PromptLen + slot, mask=mask, other=0) + pos
            column = tl.minimum(length[:, None] + j[None, :], history_end)
            tl.store(
                History + slot[:, None] * history_stride + column, tokens.to(tl.int32), mask=in_row
            )
    tl.store(Pos + slot, pos + emitted, mask=mask)


# NOTE: both run every decode step, host-bound at small batch: launch without Triton's binder.
_BUILD = CompiledLaunches(_build_kernel)
_ADVANCE = CompiledLaunches(_advance_kernel)


@dataclass(frozen=True)
class SamplingTensors:
    """Sampling parameters, one entry per request (a request table, where ``position`` is the
    counter: the output index of the request's next token) or per row (``position`` = the output
    index of the token the row chooses). Greedy entries carry temperature 0.
    """

    temperature: torch.Tensor  # [N] f32
    top_p: torch.Tensor  # [N] f32
    top_k: torch.Tensor  # [N] int64
    min_p: torch.Tensor  # [N] f32
    seed: torch.Tensor  # [N] int64
    position: torch.Tensor  # [N] int64

    @classmethod
    def empty(cls, n: int, device: torch.device | str) -> SamplingTensors:
        # NOTE: rows of two allocations, not six (a batch's rows are built every step it
        # changes), each row 16-byte aligned like an allocation (Triton specializes on it)
        m = -(-n // 4) * 4
        f32 = torch.empty(3, m, dtype=torch.float32, device=device)[:, :n]
        i64 = torch.empty(3, m, dtype=torch.int64, device=device)[:, :n]
        (temperature, top_p, min_p), (top_k, seed, position) = f32.unbind(), i64.unbind()
        return cls(temperature, top_p, top_k, min_p, seed, position)

    def __len__(self) -> int:
        return self.temperature.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.seed, self.position)

    def check(self, name: str) -> None:
        n, device = len(self), self.temperature.device
        for field, want, t in zip(_FIELDS, _DTYPES, self.tensors()):
            ok = t.shape == (n,) and t.dtype == want and t.device == device and t.is_contiguous()
            if not ok:  # NOTE: the message is built on failure only: checks run every step
                raise ValueError(
                    f"{name}.{field} must be contiguous [{n}] {want} on {device}, "
                    f"got {tuple(t.shape)} {t.dtype} on {t.device}"
                )


_FIELDS = tuple(f.name for f in fields(SamplingTensors))
_DTYPES = (torch.float32, torch.float32, torch.int64, torch.float32, torch.int64, torch.int64)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _check_index(name: str, x: torch.Tensor | None, n: int, device: torch.device) -> None:
    if x is None:
        return
    ok = x.shape == (n,) and x.dtype in (torch.int32, torch.int64) and x.is_contiguous()
    if not ok:
        raise ValueError(
            f"{name} must be contiguous [{n}] int32/int64, got {tuple(x.shape)} {x.dtype}"
        )
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the request table on {device}")


def build_sampling_params(
    requests: SamplingTensors,  # [N] per request; .position is the counter
    rows_per_request: torch.Tensor,  # [B] k+1 to verify k drafts, 1 to decode
    num_rows: int,  # R, host-known: the size of the outputs
    *,
    req_slots: torch.Tensor | None = None,  # [B] entry of request b in `requests`; < 0 = padding
    row_start: torch.Tensor | None = None,  # [B] exclusive cumsum of rows_per_request
    out: SamplingTensors | None = None,  # [R] static buffers (CUDA graphs)
) -> SamplingTensors:
    """Expand the request table into ``num_rows`` rows: row ``row_start[b] + j`` gets request
    b's parameters and position ``requests.position[slot] + j``. Rows no request covers (and
    the rows of padding requests) are left as they are in ``out``. Reads the counter only.
    """
    requests.check("requests")
    device = requests.temperature.device
    num_requests = rows_per_request.shape[0] if rows_per_request.dim() == 1 else -1
    _check_index("rows_per_request", rows_per_request, num_requests, device)
    _check_index("req_slots", req_slots, num_requests, device)
    _check_index("row_start", row_start, num_requests, device)
    if req_slots is None and num_requests > len(requests):
        raise ValueError(
            f"{num_requests} requests without req_slots "
            f"need a table of >= {num_requests} entries, got {len(requests)}"
        )
    if out is None:
        out = SamplingTensors.empty(num_rows, device)
    out.check("out")
    if len(out) != num_rows:
        raise ValueError(f"out has {len(out)} rows, num_rows is {num_rows}")
    _require(out.temperature.device == device, "out must be on the request table's device")
    if num_requests == 0:
        return out
    if row_start is None:
        row_start = torch.cumsum(rows_per_request, 0) - rows_per_request
    slots = req_slots if req_slots is not None else rows_per_request  # unused when no slots
    has_slots = req_slots is not None
    _BUILD(
        (num_requests, 1, 1),
        (*requests.tensors(), slots, rows_per_request, row_start, *out.tensors()),
        (),
        {"HAS_SLOTS": has_slots, "BLOCK": _ROW_BLOCK},
    )
    return out


def advance_positions(
    positions: torch.Tensor,  # [N] int64 counter, updated in place
    num_emitted: torch.Tensor,  # [B] tokens request b emitted this step
    req_slots: torch.Tensor | None = None,  # [B] unique entries of `positions`; < 0 = padding
    *,
    tokens: torch.Tensor | None = None,  # [B, n] int64: request b emitted tokens[b, :num_emitted]
    last_token: torch.Tensor | None = None,  # [N] int64, with tokens: each entry's last token
    history: torch.Tensor | None = None,  # [N, L + 1] int32 token rows, the last column a spill
    prompt_len: torch.Tensor | None = None,  # [N] int64, with history: each entry's prompt
) -> None:
    """``positions[req_slots[b]] += num_emitted[b]`` on the device, no host sync. With
    ``tokens`` the same launch records each request's last emitted token in ``last_token``
    (none for a request that emitted nothing) and, with ``history``, writes ``tokens[b, j]`` at
    column ``prompt_len + position + j`` (the old position) of its row for every ``j``: the
    emitted tokens extend the row, the others land past its new length, and columns past ``L``
    fall into the spill column, which nothing reads.
    """
    _require(positions.dim() == 1 and positions.dtype == torch.int64, "positions must be [N] int64")
    _require(positions.is_contiguous(), "positions must be contiguous")
    num_requests = num_emitted.shape[0] if num_emitted.dim() == 1 else -1
    device = positions.device
    _check_index("num_emitted", num_emitted, num_requests, device)
    _check_index("req_slots", req_slots, num_requests, device)
    if req_slots is None:
        _require(num_requests <= positions.shape[0], "num_emitted is longer than positions")
    _check_commit(positions, num_requests, tokens, last_token, history, prompt_len)
    if num_requests == 0:
        return
    has_slots, has_tokens = req_slots is not None, tokens is not None
    has_history = history is not None
    dummy = positions  # stands in for absent pointers; never read
    tensors = (
        positions,
        req_slots if has_slots else num_emitted,
        num_emitted,
        tokens if has_tokens else dummy,
        last_token if has_tokens else dummy,
        history if has_history else dummy,
        prompt_len if has_history else dummy,
    )
    num_tokens = tokens.shape[1] if has_tokens else 1
    scalars = (
        num_requests,
        num_tokens,
        tokens.stride(0) if has_tokens else 0,
        history.stride(0) if has_history else 0,
        history.shape[1] - 1 if has_history else 0,
    )
    constants = {
        "HAS_SLOTS": has_slots,
        "HAS_TOKENS": has_tokens,
        "HAS_HISTORY": has_history,
        "BLOCK": _ADVANCE_BLOCK,
        "BLOCK_T": triton.next_power_of_2(num_tokens),
    }
    _ADVANCE((-(-num_requests // _ADVANCE_BLOCK), 1, 1), tensors, scalars, constants)


def _check_commit(
    positions: torch.Tensor,
    num_requests: int,
    tokens: torch.Tensor | None,
    last_token: torch.Tensor | None,
    history: torch.Tensor | None,
    prompt_len: torch.Tensor | None,
) -> None:
    device, n = positions.device, positions.shape[0]
    _require((tokens is None) == (last_token is None), "tokens and last_token go together")
    _require((history is None) == (prompt_len is None), "history and prompt_len go together")
    _require(history is None or tokens is not None, "history needs tokens")
    if tokens is None:
        return
    ok = (
        tokens.dim() == 2
        and tokens.shape[0] == num_requests
        and tokens.dtype == torch.int64
        and (tokens.stride(1) == 1 or tokens.shape[1] == 1)
        and tokens.device == device
    )
    if not ok:
        raise ValueError(
            f"tokens must be [{num_requests}, n] int64 on {device} with unit column stride, "
            f"got {tuple(tokens.shape)} {tokens.dtype} on {tokens.device}"
        )
    ok = (
        last_token.shape == (n,) and last_token.dtype == torch.int64 and last_token.device == device
    )
    if not (ok and last_token.is_contiguous()):
        raise ValueError(f"last_token must be contiguous [{n}] int64")
    if history is None:
        return
    ok = (
        history.dim() == 2
        and history.shape[0] == n
        and history.shape[1] >= 2
        and history.dtype == torch.int32
        and history.stride(1) == 1
        and history.device == device
    )
    if not ok:
        raise ValueError(f"history must be [{n}, L + 1] int32 with unit column stride")
    ok = prompt_len.shape == (n,) and prompt_len.dtype == torch.int64
    if not (ok and prompt_len.is_contiguous() and prompt_len.device == device):
        raise ValueError(f"prompt_len must be contiguous [{n}] int64")


def _slots(req_slots: torch.Tensor | None, num_requests: int) -> list[int]:
    return req_slots.tolist() if req_slots is not None else list(range(num_requests))


def build_sampling_params_ref(
    requests: SamplingTensors,
    rows_per_request: torch.Tensor,
    num_rows: int,
    *,
    req_slots: torch.Tensor | None = None,
    row_start: torch.Tensor | None = None,
    out: SamplingTensors | None = None,
) -> SamplingTensors:
    if out is None:
        out = SamplingTensors.empty(num_rows, requests.temperature.device)
    if row_start is None:
        row_start = torch.cumsum(rows_per_request, 0) - rows_per_request
    spans = zip(
        _slots(req_slots, len(rows_per_request)), row_start.tolist(), rows_per_request.tolist()
    )
    for slot, start, n in spans:
        if slot < 0:
            continue
        for src, dst in zip(requests.tensors()[:-1], out.tensors()[:-1]):
            dst[start : start + n] = src[slot]
        steps = torch.arange(n, device=out.position.device)
        out.position[start : start + n] = requests.position[slot] + steps
    return out


def advance_positions_ref(
    positions: torch.Tensor,
    num_emitted: torch.Tensor,
    req_slots: torch.Tensor | None = None,
    *,
    tokens: torch.Tensor | None = None,
    last_token: torch.Tensor | None = None,
    history: torch.Tensor | None = None,
    prompt_len: torch.Tensor | None = None,
) -> None:
    num_requests = len(num_emitted)
    _check_commit(positions, num_requests, tokens, last_token, history, prompt_len)
    device = positions.device
    slots = (
        torch.arange(num_requests, device=device)
        if req_slots is None
        else req_slots.to(torch.int64)
    )
    valid = slots >= 0
    slots, emitted = slots[valid], num_emitted[valid].to(torch.int64)
    if tokens is not None:
        rows = tokens[valid]
        if history is not None:
            steps = torch.arange(rows.shape[1], device=device)
            start = prompt_len[slots] + positions[slots]  # NOTE: before the advance
            columns = (start[:, None] + steps).clamp_max(history.shape[1] - 1)
            history[slots[:, None].expand_as(columns), columns] = rows.to(torch.int32)
        some = emitted > 0
        last_token[slots[some]] = rows[some].gather(1, (emitted[some] - 1)[:, None]).squeeze(1)
    positions.index_add_(0, slots, emitted)
