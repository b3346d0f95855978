"""``SamplingBatch``: per-row sampling tensors for one step.

A row is one output position at which a request's next token is chosen: one row per request in
plain decoding, k+1 rows per request in speculative verification. Everything here is per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch

from pcgspec.sampling_params import SamplingParams

GREEDY_EPS = 1e-5  # temperature below this means greedy (SamplingParams.greedy agrees)
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class SamplingBatch:
    """Device tensors, one entry per row. Greedy rows carry temperature 0 and disabled filters
    (top_k = vocab_size, top_p = 1, min_p = 0), so the flags describe the sampled rows only.
    """

    temperature: torch.Tensor  # [R] f32, 0 for greedy rows
    top_p: torch.Tensor  # [R] f32, 1 = disabled
    top_k: torch.Tensor  # [R] int64, vocab_size = disabled
    min_p: torch.Tensor  # [R] f32, 0 = disabled
    seed: torch.Tensor  # [R] int64
    position: torch.Tensor  # [R] int64, output index of the token this row chooses
    repetition_penalty: torch.Tensor  # [R] f32
    presence_penalty: torch.Tensor  # [R] f32
    frequency_penalty: torch.Tensor  # [R] f32
    output_counts: torch.Tensor | None  # [R, V] int32, output tokens before this row's position
    prompt_mask: torch.Tensor | None  # [R, V] bool, token is in the prompt
    vocab_size: int
    all_greedy: bool
    needs_penalties: bool
    needs_filters: bool  # some sampled row uses top-k, top-p or min-p
    rank_depth: int  # highest logits per row that top-k/top-p need: 0 none, V a full sort
    max_logprobs: int | None  # largest N of top-N logprobs requested, None if none

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> torch.Tensor:
        """[R] bool."""
        return self.temperature < GREEDY_EPS

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        """All sequences are per row; ``output_ids[r]`` are the request's output tokens before
        row ``r``'s position and ``seeds[r]`` is already resolved (any int, read mod 2**64).
        """
        per_row = {"seeds": seeds, "positions": positions, "prompt_ids": prompt_ids}
        for name, seq in {**per_row, "output_ids": output_ids}.items():
            if len(seq) != len(params):
                raise ValueError(f"{name} has {len(seq)} rows, params has {len(params)}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        rows = [row_values(p, vocab_size) for p in params]
        flags = host_flags(params, rows, vocab_size)
        counts = mask = None
        if flags["needs_penalties"]:
            counts, mask = _penalty_inputs(params, prompt_ids, output_ids, vocab_size, device)
        return cls(
            **_row_tensors(rows, seeds, positions, device),
            output_counts=counts,
            prompt_mask=mask,
            vocab_size=vocab_size,
            **flags,
        )


def host_flags(
    params: Sequence[SamplingParams], rows: Sequence[dict[str, float | int]], vocab_size: int
) -> dict[str, bool | int | None]:
    """The ``SamplingBatch`` fields read on the host, from the rows' parameters and
    ``row_values``: all_greedy, needs_penalties, needs_filters, rank_depth, max_logprobs.
    """
    sampled = [r for p, r in zip(params, rows) if not p.greedy]
    rank_ks = [r["top_k"] for r in sampled if r["top_k"] < vocab_size or r["top_p"] < 1.0]
    requested = [p.logprobs for p in params if p.logprobs is not None]
    return {
        "all_greedy": not sampled,
        "needs_penalties": any(p.needs_penalties for p in params),
        "needs_filters": bool(rank_ks) or any(r["min_p"] > 0.0 for r in sampled),
        "rank_depth": int(max(rank_ks, default=0)),
        "max_logprobs": max(requested) if requested else None,
    }


def row_values(p: SamplingParams, vocab_size: int) -> dict[str, float | int]:
    """One row's (or request's) values of ``FLOAT_FIELDS`` and top_k; greedy disables filters."""
    top_k = vocab_size if p.greedy or p.top_k < 0 else min(p.top_k, vocab_size)
    return {
        "temperature": 0.0 if p.greedy else p.temperature,
        "top_p": 1.0 if p.greedy else p.top_p,
        "min_p": 0.0 if p.greedy else p.min_p,
        "top_k": top_k,
        "repetition_penalty": p.repetition_penalty,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
    }


def _row_tensors(
    rows: Sequence[dict[str, float | int]],
    seeds: Sequence[int],
    positions: Sequence[int],
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """The [R] fields, packed into two host tensors so that each needs one copy to ``device``."""
    floats = torch.tensor([[r[f] for r in rows] for f in FLOAT_FIELDS], dtype=torch.float32)
    ints = torch.tensor(
        [[r["top_k"] for r in rows], [as_int64(s) for s in seeds], list(positions)],
        dtype=torch.int64,
    )
    floats = floats.to(device, non_blocking=True)  # [6, R]
    ints = ints.to(device, non_blocking=True)  # [3, R]
    return {
        **dict(zip(FLOAT_FIELDS, floats.unbind(0))),
        "top_k": ints[0],
        "seed": ints[1],
        "position": ints[2],
    }


def as_int64(seed: int) -> int:
    """``seed`` mod 2**64 as a signed 64-bit value (the bits the RNG reads)."""
    return (seed + 2**63) % 2**64 - 2**63


def _penalty_inputs(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``output_counts`` [R, V] int32 and, if some row has a repetition penalty, ``prompt_mask``
    [R, V] bool. Rows without penalties stay zero (their penalties are neutral anyway).
    """
    num_rows = len(params)
    wanted = [p.needs_penalties for p in params]
    out_rows, out_cols = _flat_index(
        [o if w else () for o, w in zip(output_ids, wanted)], vocab_size, device
    )
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
    ones = torch.ones((), dtype=torch.int32, device=device).expand(out_rows.shape[0])
    counts.index_put_((out_rows, out_cols), ones, accumulate=True)
    if all(p.repetition_penalty == 1.0 for p in params):
        return counts, None
    rep = [p.repetition_penalty != 1.0 for p in params]
    p_rows, p_cols = _flat_index(
        [t if r else () for t, r in zip(prompt_ids, rep)], vocab_size, device
    )
    mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    mask[p_rows, p_cols] = True  # NOTE: duplicate indices all write True, so order is moot
    return counts, mask


def _flat_index(
    ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of every token of every row, checked on the host."""
    lengths = torch.tensor([len(t) for t in ids], dtype=torch.int64)
    cols = torch.tensor(list(chain.from_iterable(ids)), dtype=torch.int64)
    if cols.numel() and not (0 <= int(cols.min()) and int(cols.max()) < vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {cols.min()}..{cols.max()}")
    rows = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    return rows.to(device, non_blocking=True), cols.to(device, non_blocking=True)
