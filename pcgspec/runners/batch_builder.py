"""Build a ``ForwardBatch`` from per-request chunks of new tokens."""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pcgspec.kernels.padded_rows import (
    GraphRows,
    VerifyTokens,
    padded_rows,
    padded_rows_into,
    padded_rows_into_ref,
    padded_rows_ref,
)
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode


class SeqChunk(NamedTuple):
    """New tokens of one request for one pass: positions ``start .. start + len(token_ids)``.
    (A named tuple: a batch builds one per request every step.)"""

    token_ids: Sequence[int]
    start: int  # tokens of this request already in the KV cache
    pages: Sequence[int]  # the request's pages, covering at least start + len(token_ids) slots
    sample: bool = True  # compute logits for the last new token


def build_forward_batch(
    mode: ForwardMode,
    chunks: Sequence[SeqChunk],
    page_size: int,
    device: torch.device | str,
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL,
    logits_rows: Sequence[int] | None = None,
    **extra: object,
) -> ForwardBatch:
    """Flatten ``chunks`` into one batch. By default the sampled rows are the last new token
    of each chunk with ``sample=True``; ``logits_rows`` overrides that (e.g. every verify row).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sampled: list[int] = []
    starts: list[int] = []  # each chunk's first row
    seq_lens: list[int] = []
    extend_lens: list[int] = []
    for token_ids, start, pages, sample in chunks:
        end = start + len(token_ids)
        if end > len(pages) * page_size:
            raise ValueError(f"chunk needs {end} KV slots but owns {len(pages)} pages")
        starts.append(len(input_ids))
        seq_lens.append(end)
        extend_lens.append(len(token_ids))
        input_ids += token_ids
        positions += range(start, end)
        slots += page_slot_ranges(pages, start, end, page_size)
        if sample:
            sampled.append(len(input_ids) - 1)
    table, max_pages = padded_page_table([c.pages for c in chunks])
    ids, pos, locs, rows, lens, ext, first, pages = upload(
        device,
        int64=(input_ids, positions, slots, sampled if logits_rows is None else logits_rows),
        int32=(seq_lens, extend_lens, starts, table),
    )
    return ForwardBatch(
        forward_mode=mode,
        input_ids=ids,
        positions=pos,
        out_cache_loc=locs,
        seq_lens=lens,
        extend_lens=ext,
        page_table=pages.view(len(chunks), max_pages),
        page_size=page_size,
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
        logits_indices=rows,
        extend_start=first,
        capture_hidden_mode=capture_hidden_mode,
        **extra,  # type: ignore[arg-type]
    )


def page_slot_ranges(pages: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """KV slots of positions ``start .. end`` through ``pages``: one range per page touched."""
    if end - start == 1:  # NOTE: a decode row, the common case
        return [pages[start // page_size] * page_size + start % page_size]
    slots: list[int] = []
    p = start
    while p < end:
        page = p // page_size
        stop = min(end, (page + 1) * page_size)
        shift = (pages[page] - page) * page_size  # slot - position on this page
        slots += range(p + shift, stop + shift)
        p = stop
    return slots


def padded_page_table(pages: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """The requests' page lists as one flat row-major ``[B, max_pages]`` table, rows padded
    with page 0 (read nowhere: past each request's length), and ``max_pages``.
    """
    max_pages = max(map(len, pages))
    padding = [0] * max_pages
    flat: list[int] = []
    for row in pages:
        flat += row
        flat += padding[: max_pages - len(row)]
    return flat, max_pages


def upload(
    device: torch.device | str,
    int64: Sequence[Sequence[int]] = (),
    int32: Sequence[Sequence[int]] = (),
) -> list[torch.Tensor]:
    """Host integer lists as 1-D device tensors (the ``int64`` ones, then the ``int32`` ones)
    through one host-to-device copy: a batch's metadata is a handful of short lists, and on
    the GPU each copy costs more host time than its bytes. Every tensor starts 16-byte aligned
    (Triton specializes kernels on it).
    """
    flat: list[int] = []
    spans: list[tuple[int, int]] = []
    for columns, per_16_bytes in ((int64, 2), (int32, 4)):
        for column in columns:
            spans.append((len(flat), len(column)))
            flat.extend(column)
            flat.extend([0] * (-len(column) % per_16_bytes))
    pinned = torch.device(device).type == "cuda"
    dtype = torch.int64 if int64 else torch.int32  # NOTE: int32 alone needs no conversion
    packed = host_tensor(flat, dtype, pinned).to(device, non_blocking=True)
    out = [packed[start : start + n] for start, n in spans[: len(int64)]]
    if int32:
        wide = spans[len(int64)][0]
        narrow = packed[wide:].to(torch.int32)  # a no-op without int64 columns
        out += [narrow[start - wide : start - wide + n] for start, n in spans[len(int64) :]]
    return out


_TYPECODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: Sequence[int | float], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``values`` as a 1-D host tensor (int64, int32 or float32), pinned with ``pin``. The list
    goes through an ``array`` (C speed): ``torch.tensor`` reads a list of Python numbers about
    4x slower, which on an H100's host was 0.4 ms for a batch's 2,500 ids and page-table
    entries.
    """
    if not values:
        return torch.empty(0, dtype=dtype, pin_memory=pin)
    packed = array.array(_TYPECODES[dtype])
    # NOTE: fromlist reads a list about 1.5x faster than array(typecode, values)
    packed.fromlist(values if isinstance(values, list) else list(values))
    host = torch.frombuffer(packed, dtype=dtype)
    # NOTE: a copy into torch's own memory either way: on CPU, tensors over the array's buffer
    # made the CPU test suite's steps (Triton interpreted) about 10% slower
    return host.pin_memory() if pin else host.clone()


def device_page_table(
    pages: Sequence[Sequence[int]],
    device: torch.device | str,
    padded: tuple[list[int], int] | None = None,
) -> torch.Tensor:
    """The requests' pages as a ``[B, max_pages]`` int32 device table (``padded_page_table``,
    or ``padded`` where the caller has it), one upload.
    """
    table, max_pages = padded_page_table(pages) if padded is None else padded
    (flat,) = upload(device, int32=(table,))
    return flat.view(len(pages), max_pages)


def build_verify_batch(
    tokens: VerifyTokens,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    seq_len_bounds: Sequence[int],
    graph_rows: GraphRows | None = None,
    row_offsets: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    **extra: object,
) -> ForwardBatch:
    """A ``TARGET_VERIFY`` batch of ``[last token, drafts]`` per request (``tokens``), built on
    the device in one launch: ``seq_lens`` [B] (device) are the requests' token counts before
    the step, so that the host need not have read the tokens of a step still running (the
    overlap schedule); ``page_table`` [B, P] (device) holds their pages. ``seq_len_bounds`` are
    host upper bounds of the lengths after the pass (``seq_lens + k``), for sizing. With
    ``graph_rows`` (``DecodeGraphRunner.rows_for``) the rows are written into the verify
    graph's static buffers, whose views the batch then holds. ``row_offsets`` [B, k+1] are
    added to the rows' consecutive positions (a draft tree's nodes sit at their depths).
    ``valid`` [B] (bool, device) marks the real requests of a padded batch: the others write no
    KV and read none (length 0), their rows at positions 0 onwards.
    """
    b, k1 = tokens.drafts.shape[0], tokens.drafts.shape[1] + 1
    common = dict(
        forward_mode=ForwardMode.TARGET_VERIFY,
        page_table=page_table,
        page_size=page_size,
        seq_lens_cpu=tuple(seq_len_bounds),
        extend_lens_cpu=(k1,) * b,
        spec_num_draft_tokens=k1,
    )
    if graph_rows is not None:
        if valid is not None:
            raise ValueError("graph_rows pads the batch itself: valid must be None")
        into = padded_rows_into if seq_lens.is_cuda else padded_rows_into_ref
        into(graph_rows, seq_lens, page_table, page_size, k1, start_offset=-1, tokens=tokens)
        n, g = b * k1, graph_rows
        if row_offsets is not None:
            g.positions[:n].view(b, k1).add_(row_offsets)
        return ForwardBatch(
            input_ids=g.input_ids[:n],
            positions=g.positions[:n],
            out_cache_loc=g.out_cache_loc[:n],
            seq_lens=g.seq_lens[:b],
            extend_lens=g.extend_lens[:b],
            logits_indices=g.all_rows[:n],
            **common,
            **extra,
        )  # type: ignore[arg-type]
    build = padded_rows if seq_lens.is_cuda else padded_rows_ref
    num_valid = None
    if valid is not None:
        seq_lens, num_valid = torch.where(valid, seq_lens, 1), valid.to(torch.int64) * k1
    rows = build(seq_lens, page_table, page_size, k1, num_valid, start_offset=-1, tokens=tokens)
    if row_offsets is not None:
        rows.positions.view(b, k1).add_(row_offsets)
    return ForwardBatch(
        input_ids=rows.input_ids,
        positions=rows.positions,
        out_cache_loc=rows.out_cache_loc,
        seq_lens=_padding_zeroed(rows.seq_lens, valid),
        extend_lens=rows.extend_lens,
        logits_indices=rows.all_rows,
        extend_start=rows.extend_start,
        **common,
        **extra,
    )  # type: ignore[arg-type]


def build_padded_batch(
    mode: ForwardMode,
    input_ids: torch.Tensor,
    starts: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    seq_len_bounds: Sequence[int],
    num_valid: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    **extra: object,
) -> ForwardBatch:
    """k+1 rows per request at positions ``starts[b] ..`` (``input_ids`` [B, k+1], ``starts``
    [B], ``page_table`` [B, P], device tensors), built on the device in one launch
    (``padded_rows``): a verify pass, whose logits are every row's, or with ``num_valid`` a
    draft catch-up padded to k+1 rows, whose rows from ``num_valid[b]`` on write no KV and
    whose logits are each request's last valid row's. ``seq_len_bounds``: host upper bounds of
    ``starts + k+1``, for sizing. ``valid`` [B] (bool, device) marks the real requests of a
    padded batch: the others write no KV and read none (length 0), their rows at positions 0
    onwards (with ``num_valid`` their logits index means nothing).
    """
    b, k1 = input_ids.shape
    every_row = num_valid is None  # a verify pass's logits: every row's
    if valid is not None:
        starts = torch.where(valid, starts, 0)
        num_valid = torch.where(valid, k1 if num_valid is None else num_valid, 0)
    build = padded_rows if input_ids.is_cuda else padded_rows_ref
    rows = build(starts, page_table, page_size, k1, num_valid)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=input_ids.reshape(-1),
        positions=rows.positions,
        out_cache_loc=rows.out_cache_loc,
        seq_lens=_padding_zeroed(rows.seq_lens, valid),
        extend_lens=rows.extend_lens,
        page_table=page_table,
        page_size=page_size,
        seq_lens_cpu=tuple(seq_len_bounds),
        extend_lens_cpu=(k1,) * b,
        logits_indices=rows.all_rows if every_row else rows.last_rows,
        extend_start=rows.extend_start,
        spec_num_draft_tokens=k1,
        **extra,  # type: ignore[arg-type]
    )


def _padding_zeroed(seq_lens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``seq_lens`` with the padding requests' (``valid`` False) lengths 0: they read no KV."""
    return seq_lens if valid is None else torch.where(valid, seq_lens, 0)


def without_kv_writes(batch: ForwardBatch) -> ForwardBatch:
    """``batch`` with every KV slot -1: attention reads the cache but writes nothing (for
    warm-up, memory profiling and capture runs over dummy tokens).
    """
    return dataclasses.replace(batch, out_cache_loc=torch.full_like(batch.out_cache_loc, -1))
