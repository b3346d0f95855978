"""``SamplingSlots``: each running request's sampling state in persistent device tables.

A request owns a slot from admission (its first prefill chunk) until it finishes, is aborted or
is preempted. Admission writes the slot once: parameters, seed and the output-position counter
(the request's output count, nonzero after a preemption) and, while some admitted request uses
penalties, its output-token counts and prompt mask. After that a step touches the tables on the
device only: ``rows`` expands slots into a ``SamplingBatch`` (1 row per request, or k+1 to verify
k drafts) and ``commit`` advances the counters and counts by what each request emitted and
records its last token, which the next decode step reads as its input (``last_tokens``), so the
host need not have read it back (the overlap schedule). A step that fails after its commit gives
it back (``checkpoint`` / ``rollback``, engine/isolation.py) before it runs again.

With ``history_len`` the slots also keep each request's tokens (prompt + outputs) in
``token_history``, for prompt lookup (NGRAM) to search on the device: admission writes the row
whole and ``commit`` appends the emitted tokens at the request's length (prompt length + output
position), which ``seq_lens`` reads back as a device tensor.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pcgspec.kernels.build_sampling_params import (
    SamplingTensors,
    advance_positions,
    advance_positions_ref,
    build_sampling_params,
    build_sampling_params_ref,
)
from pcgspec.runners.batch_builder import host_tensor
from pcgspec.sampling.batch import FLOAT_FIELDS, SamplingBatch, as_int64, host_flags, row_values
from pcgspec.sampling_params import SamplingParams

_PENALTY_FIELDS = slice(3, 6)  # repetition, presence, frequency in FLOAT_FIELDS
SLOT_INDEX_CACHE = 4  # slot lists kept on the device (``SamplingSlots._indices``)


def _sampling_tensors(floats: torch.Tensor, ints: torch.Tensor) -> SamplingTensors:
    """``SamplingTensors`` of columns laid out as the slot tables are: ``floats`` [6, N] in
    ``FLOAT_FIELDS`` order, ``ints`` [>= 3, N] top_k, seed, position."""
    f = dict(zip(FLOAT_FIELDS, floats))
    return SamplingTensors(f["temperature"], f["top_p"], ints[0], f["min_p"], ints[1], ints[2])


@dataclass(frozen=True)
class _Rows:
    """One ``rows`` expansion, kept for the next call with the same requests."""

    key: tuple[tuple[int, ...], int]  # the requests' slots, the table's version
    tensors: SamplingTensors  # [R]; .position is re-read in place on reuse
    row_slots: torch.Tensor  # [R] the slot of each row
    offsets: torch.Tensor | None  # [R] j of row j of its request (k+1 rows per request)
    penalties: torch.Tensor  # [3, R] repetition, presence, frequency
    flags: dict[str, bool | int | None]  # host_flags


class SlotRequest(Protocol):
    """What a slot reads of a request (``pcgspec.engine.request.Request`` has it)."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]

    @property
    def output_token_ids(self) -> list[int]: ...


class SamplingSlots:
    """``num_slots`` rows of sampling state. ``triton`` picks the Triton kernels over their torch
    references (default: on CUDA). ``history_len``: keep up to that many tokens per request in
    ``token_history`` (None: no history).
    """

    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        device: torch.device | str,
        triton: bool | None = None,
        history_len: int | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if history_len is not None and history_len < 1:
            raise ValueError(f"history_len must be >= 1 or None, got {history_len}")
        self.num_slots, self.vocab_size = num_slots, vocab_size
        self.device = torch.device(device)
        self._floats = torch.zeros(len(FLOAT_FIELDS), num_slots, device=self.device)  # [6, S]
        # top_k, seed, position, prompt length, last token
        self._ints = torch.zeros(5, num_slots, dtype=torch.int64, device=self.device)  # [5, S]
        self.last_token = self._ints[4]  # [S]
        self._moved = self._ints[2::2]  # [2, S] position, last token: what a commit moves
        self._before_commit = torch.zeros_like(self._moved)  # them before the newest commit
        self._undo: tuple[torch.Tensor, tuple | None] | None = None  # the newest commit's
        self.num_commits = 0
        self.table = _sampling_tensors(self._floats, self._ints)
        self._prompt_len = self._ints[3]
        # NOTE: the column past the end takes the writes that fall outside a row (never read).
        self._history: torch.Tensor | None = None  # [S, history_len + 1] int32
        self.token_history: torch.Tensor | None = None  # [S, history_len] view of it
        if history_len is not None:
            self._history = torch.zeros(
                num_slots, history_len + 1, dtype=torch.int32, device=self.device
            )
            self.token_history = self._history[:, :history_len]
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out the lowest first
        self._slot_of: dict[SlotRequest, int] = {}
        self._values: list[dict[str, float | int]] = [{} for _ in range(num_slots)]
        self.output_counts: torch.Tensor | None = None  # [S, V] int32, allocated on first need
        self.prompt_mask: torch.Tensor | None = None  # [S, V] bool
        self._tracked: torch.Tensor | None = None  # [S] bool: the slot's request has penalties
        self._triton = self.device.type == "cuda" if triton is None else triton
        # the slot indices of the last few request lists (a mixed step indexes its sampled rows,
        # then its decode rows, then its sampled rows again)
        self._slot_index: dict[tuple[int, ...], torch.Tensor] = {}
        self._version = 0  # bumped by every write: rows expanded before it are stale
        self._rows: dict[int, _Rows] = {}  # the last rows per rows-per-request
        self._layouts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._flags: tuple[object, dict[str, bool | int | None]] = ((), {})  # (key, flags)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, req: SlotRequest) -> int | None:
        return self._slot_of.get(req)

    # lifecycle ----------------------------------------------------------------------------

    def admit(self, *reqs: SlotRequest) -> None:
        """Give each of ``reqs`` a slot and write its row; a request that holds one keeps it.
        All or none: ``RuntimeError`` when the free slots are too few. The rows of one call go
        up in one upload per table (a prefill step admits a whole wave of arrivals).
        """
        new = [req for req in dict.fromkeys(reqs) if req not in self._slot_of]
        if len(new) > len(self._free):
            raise RuntimeError(f"all {self.num_slots} sampling slots are taken")
        if new:
            slots = [self._free.pop() for _ in new]
            self._slot_of.update(zip(new, slots))
            self._write(new, slots)

    def free(self, req: SlotRequest) -> None:
        """Return the slot of ``req`` (finished, aborted or preempted); no-op without one."""
        slot = self._slot_of.pop(req, None)
        if slot is not None:
            self._free.append(slot)

    def _write(self, reqs: Sequence[SlotRequest], slots: Sequence[int]) -> None:
        """Write the rows of ``reqs`` (in ``slots``) from their host state: parameters, seed,
        position = its output count, prompt length, the penalty state of its outputs so far and
        its tokens (with a history).
        """
        self._version += 1
        values: list[dict[str, float | int]] = []
        for req, slot in zip(reqs, slots):
            values.append(row_values(req.params, self.vocab_size))
            self._values[slot] = values[-1]
        # NOTE: the tables' own layout, field by field ([6, n] float32, [4, n] int64), so the
        # copies take the uploaded rows as they are; the slots go last, as int64
        floats = [v[name] for name in FLOAT_FIELDS for v in values]
        ints = [v["top_k"] for v in values]
        ints += [as_int64(req.seed) for req in reqs]
        ints += [len(req.output_token_ids) for req in reqs]
        ints += [len(req.prompt_token_ids) for req in reqs]
        ints += slots
        n = len(reqs)
        # NOTE: one upload: the float32 rows' bytes, then the int64 ones' (24n: aligned)
        float_bytes = array.array("f", floats).tobytes()
        packed = self._upload_bytes(float_bytes + array.array("q", ints).tobytes())
        int_rows = packed[len(float_bytes) :].view(torch.int64)
        index = int_rows[4 * n :]
        self._floats.index_copy_(
            1, index, packed[: len(float_bytes)].view(torch.float32).view(-1, n)
        )
        self._ints[:4].index_copy_(1, index, int_rows[: 4 * n].view(4, n))
        for req, slot in zip(reqs, slots):
            if req.params.needs_penalties and self.output_counts is None:
                self._allocate_penalty_tables()
            if self.output_counts is not None:
                self._write_penalty_row(slot, req)
            if self.token_history is not None:
                self._write_history_row(slot, [*req.prompt_token_ids, *req.output_token_ids])

    def _allocate_penalty_tables(self) -> None:
        shape = (self.num_slots, self.vocab_size)
        self.output_counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self._tracked = torch.zeros(self.num_slots, dtype=torch.bool, device=self.device)

    def _write_penalty_row(self, slot: int, req: SlotRequest) -> None:
        """Zero the slot's counts and mask; fill them when ``req`` uses penalties."""
        assert self.output_counts is not None and self.prompt_mask is not None
        p = req.params
        counts, mask = self.output_counts[slot], self.prompt_mask[slot]
        counts.zero_()
        mask.zero_()
        self._tracked[slot] = p.needs_penalties
        if not p.needs_penalties:
            return
        outputs = self._index(req.output_token_ids)
        counts.index_put_((outputs,), torch.ones_like(outputs, dtype=torch.int32), accumulate=True)
        if p.repetition_penalty != 1.0:
            mask[self._index(req.prompt_token_ids)] = True

    def _write_history_row(self, slot: int, tokens: list[int]) -> None:
        assert self.token_history is not None
        if len(tokens) > self.token_history.shape[1]:
            raise ValueError(
                f"a request of {len(tokens)} tokens does not fit the token history "
                f"of {self.token_history.shape[1]}"
            )
        self.token_history[slot, : len(tokens)].copy_(self._upload(tokens, torch.int32))

    # the step -----------------------------------------------------------------------------

    def rows(
        self,
        reqs: Sequence[SlotRequest],
        drafts: torch.Tensor | None = None,
        ancestors: torch.Tensor | None = None,
    ) -> SamplingBatch:
        """One row per request, or with ``drafts`` [B, k] (device) k+1 rows per request: row j
        chooses output position ``position + j`` and its penalties count ``drafts[b, :j]`` too,
        or with ``ancestors`` [B, k+1, k+1] (draft trees: node j's ancestors and itself) the
        drafts of row j's ancestors.
        The same requests with the same rows per request as the last such call (every step of
        a steady decode run) reuse its rows and only re-read the positions.
        """
        key = self._slot_key(reqs)
        slots = self._indices(key)
        per_request = 1 if drafts is None else drafts.shape[1] + 1
        rows = self._expanded(reqs, key, slots, per_request)
        counts = mask = None
        if rows.flags["needs_penalties"]:
            counts = self.output_counts.index_select(0, rows.row_slots)  # [R, V]
            if drafts is not None:
                self._add_drafts(counts, drafts, self._tracked[slots], ancestors)
            if any(r.params.repetition_penalty != 1.0 for r in reqs):
                mask = self.prompt_mask.index_select(0, rows.row_slots)
        t = rows.tensors
        return SamplingBatch(
            t.temperature,
            t.top_p,
            t.top_k,
            t.min_p,
            t.seed,
            t.position,
            *rows.penalties,
            output_counts=counts,
            prompt_mask=mask,
            vocab_size=self.vocab_size,
            **rows.flags,
        )

    def _expanded(
        self,
        reqs: Sequence[SlotRequest],
        slot_key: tuple[int, ...],
        slots: torch.Tensor,
        per_request: int,
    ) -> _Rows:
        """The rows of ``reqs`` (``slots``, ``slot_key`` on the host): the last ones of this
        ``per_request`` with their positions re-read when the requests and the table are the
        same, else expanded anew.
        """
        key = (slot_key, self._version)
        rows = self._rows.get(per_request)
        if rows is not None and rows.key == key:
            position = rows.tensors.position
            torch.index_select(self.table.position, 0, rows.row_slots, out=position)
            if rows.offsets is not None:
                position.add_(rows.offsets)
            return rows
        if per_request == 1:
            tensors, penalties = self._gathered(slots)
            row_slots, offsets = slots, None
        else:
            counts, starts, offsets = self._row_layout(len(reqs), per_request)
            build = build_sampling_params if self._triton else build_sampling_params_ref
            num_rows = len(reqs) * per_request
            tensors = build(self.table, counts, num_rows, req_slots=slots, row_start=starts)
            row_slots = slots[:, None].expand(-1, per_request).reshape(-1)  # [R]
            penalties = self._floats[_PENALTY_FIELDS].index_select(1, row_slots)  # [3, R]
        values = [self._values[self._slot_of[r]] for r in reqs]
        rows = _Rows(
            key,
            tensors,
            row_slots,
            offsets,
            penalties,
            host_flags([r.params for r in reqs], values, self.vocab_size),
        )
        self._rows[per_request] = rows
        return rows

    def _gathered(self, slots: torch.Tensor) -> tuple[SamplingTensors, torch.Tensor]:
        """One row per request: the tables' columns ``slots`` [B], in two gathers (the float
        fields, penalties included, and the int ones). A batch's rows are rebuilt every step
        its requests change (each arrival and finish): on an H200's host the two gathers took
        38 us of host time against 51-84 for ``build_sampling_params`` and the penalties'
        gather (0.16 ms inside a served-like engine run). Rows 16-byte aligned, as
        ``SamplingTensors.empty`` makes them (Triton specializes on it).
        """
        n = len(slots)
        m = -(-n // 4) * 4
        floats = torch.empty(len(FLOAT_FIELDS), m, device=self.device)[:, :n]
        ints = torch.empty(3, m, dtype=torch.int64, device=self.device)[:, :n]
        torch.index_select(self._floats, 1, slots, out=floats)  # [6, B]
        torch.index_select(self._ints[:3], 1, slots, out=ints)  # [3, B] top_k, seed, position
        return _sampling_tensors(floats, ints), floats[_PENALTY_FIELDS]

    def _row_layout(
        self, num_requests: int, per_request: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``build_sampling_params``' rows per request and first rows for ``num_requests`` of
        ``per_request`` rows each, and each row's j within its request (``position + j``),
        kept on the device per pair: a verify batch's rows are rebuilt every step its requests
        change, and building the first two (a fill and a cumsum) took 30 us of host time on an
        H200's host, the kernel's launch 12."""
        layout = self._layouts.get((num_requests, per_request))
        if layout is None:
            starts = torch.arange(0, num_requests * per_request, per_request, device=self.device)
            offsets = torch.arange(per_request, device=self.device).repeat(num_requests)
            layout = self._layouts[num_requests, per_request] = (
                torch.full_like(starts, per_request),
                starts,
                offsets,
            )
        return layout

    def flags(self, reqs: Sequence[SlotRequest]) -> dict[str, bool | int | None]:
        """The host flags of ``rows(reqs)`` (``host_flags``) without building the rows, kept
        while the batch and the tables stay the same."""
        key = (self._slot_key(reqs), self._version)  # NOTE: keyed as rows() keys them
        if self._flags[0] != key:
            values = [self._values[slot] for slot in key[0]]
            self._flags = (key, host_flags([r.params for r in reqs], values, self.vocab_size))
        return self._flags[1]

    def commit_tables(self) -> dict[str, torch.Tensor | None]:
        """The tables ``commit`` writes besides the counters, as ``advance_positions`` takes
        them (a commit captured in a graph)."""
        history = self._history is not None
        return {
            "last_token": self.last_token,
            "history": self._history,
            "prompt_len": self._prompt_len if history else None,
        }

    @staticmethod
    def _add_drafts(
        counts: torch.Tensor,
        drafts: torch.Tensor,
        tracked: torch.Tensor,
        ancestors: torch.Tensor | None = None,
    ) -> None:
        """``counts[b * (k+1) + j, drafts[b, i - 1]] += 1`` for every draft node i >= 1 on the
        way to node j (a chain: i <= j; a tree: ``ancestors[b, j, i]``) of a tracked request."""
        b, k = drafts.shape
        if ancestors is None:
            j, i = torch.tril_indices(k + 1, k + 1, offset=-1, device=counts.device)  # i < j
            weight = tracked[:, None].expand(b, len(j)).to(torch.int32)
        else:  # every (row j, draft i) pair, weighed by whether node i + 1 leads to node j
            j = torch.arange(k + 1, device=counts.device).repeat_interleave(k)
            i = torch.arange(k, device=counts.device).repeat(k + 1)
            weight = (ancestors[:, j, i + 1] & tracked[:, None]).to(torch.int32)
        rows = torch.arange(b, device=counts.device)[:, None] * (k + 1) + j  # [B, P]
        counts.index_put_((rows, drafts[:, i]), weight, accumulate=True)

    def commit(
        self, reqs: Sequence[SlotRequest], tokens: torch.Tensor, num_emitted: torch.Tensor
    ) -> None:
        """After sampling or verification: request b emitted ``tokens[b, :num_emitted[b]]``
        (``tokens`` [B, n], ``num_emitted`` [B] >= 1, device tensors). Advances each counter and
        the output counts, records the last tokens and appends the emitted ones to the token
        history on the device, with no host sync.
        """
        slots = self.slot_indices(reqs)
        self.save_before_commit()
        self.mark_commit(slots)
        advance = advance_positions if self._triton else advance_positions_ref
        advance(self.table.position, num_emitted, slots, tokens=tokens, **self.commit_tables())
        if self.output_counts is None or not any(r.params.needs_penalties for r in reqs):
            return
        steps = torch.arange(tokens.shape[1], device=self.device)
        emitted = (steps < num_emitted[:, None]) & self._tracked[slots][:, None]  # [B, n]
        columns = tokens.clamp(0, self.vocab_size - 1)  # NOTE: unemitted entries may hold -1
        index, counts = (slots[:, None].expand_as(tokens), columns), emitted.to(torch.int32)
        self._undo = (slots, (index, counts))
        self.output_counts.index_put_(index, counts, accumulate=True)

    def save_before_commit(self) -> None:
        """What ``rollback`` restores, saved before every commit (one launch; captured in a
        graph with a commit there)."""
        self._before_commit.copy_(self._moved)

    def mark_commit(self, slots: torch.Tensor) -> None:
        """A commit of ``slots`` [B] (after ``save_before_commit``): the newest, for
        ``rollback``; one that counts penalties adds their undo. A commit captured in a graph
        counts none (refused there)."""
        self.num_commits += 1
        self._undo = (slots, None)

    def checkpoint(self) -> int:
        """A mark to ``rollback`` to: the commits so far."""
        return self.num_commits

    def rollback(self, checkpoint: int) -> None:
        """Undo the commit made since ``checkpoint``, if any (a step that failed after it, and
        will run again): its requests' positions, last tokens and output counts go back to
        what they were. Token history written past a request's length is overwritten later.
        """
        since, undo = self.num_commits - checkpoint, self._undo
        if since == 0:
            return
        if since != 1 or undo is None:
            raise RuntimeError(f"{since} commits since the checkpoint: only the newest undoes")
        slots, counted = undo
        self._undo, self.num_commits = None, checkpoint
        self._moved.index_copy_(1, slots, self._before_commit.index_select(1, slots))
        if counted is not None:
            index, counts = counted
            self.output_counts.index_put_(index, -counts, accumulate=True)

    def seq_lens(self, reqs: Sequence[SlotRequest]) -> torch.Tensor:
        """[B] int64 device tensor: each request's token count, prompt + outputs (as of the
        device).
        """
        return self.lengths(self.slot_indices(reqs))

    def lengths(self, slots: torch.Tensor) -> torch.Tensor:
        """[B] int64: the token counts of the requests in ``slots`` [B] (device; also inside a
        captured speculative step)."""
        # NOTE: rows 2 and 3 of the int table are the position and the prompt length
        return self._ints[2:4].index_select(1, slots).sum(0)

    def last_tokens(self, reqs: Sequence[SlotRequest]) -> torch.Tensor:
        """[B] int64 device tensor: each request's last emitted token (as of the device)."""
        return self.last_token.index_select(0, self.slot_indices(reqs))

    def slot_indices(self, reqs: Sequence[SlotRequest]) -> torch.Tensor:
        """[B] int64 device tensor of the requests' slots (reused while the batch repeats)."""
        return self._indices(self._slot_key(reqs))

    def _slot_key(self, reqs: Sequence[SlotRequest]) -> tuple[int, ...]:
        try:
            return tuple(self._slot_of[r] for r in reqs)
        except KeyError as e:
            raise ValueError("a request without a sampling slot (never admitted or freed)") from e

    def _indices(self, key: tuple[int, ...]) -> torch.Tensor:
        """The slots ``key`` as a device tensor, uploaded unless it is one of the last
        ``SLOT_INDEX_CACHE`` lists uploaded."""
        index = self._slot_index.get(key)
        if index is None:
            if len(self._slot_index) >= SLOT_INDEX_CACHE:
                del self._slot_index[next(iter(self._slot_index))]  # the oldest
            index = self._slot_index[key] = self._index(key)
        return index

    def _index(self, values: Sequence[int]) -> torch.Tensor:
        return self._upload(values, torch.int64)

    def _upload_bytes(self, data: bytes) -> torch.Tensor:
        """``data`` on the device as uint8, through pinned memory on CUDA (``_upload``)."""
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        host = host.pin_memory() if self.device.type == "cuda" else host
        return host.to(self.device, non_blocking=True)

    def _upload(self, values: Sequence[int | float], dtype: torch.dtype) -> torch.Tensor:
        """A flat list on the device through pinned memory on CUDA: a pageable copy may wait
        for the stream, i.e. for a step the overlap schedule left running.
        """
        pinned = self.device.type == "cuda"
        return host_tensor(values, dtype, pinned).to(self.device, non_blocking=True)
