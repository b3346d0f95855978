"""``draft_levels`` (Triton; the interpreter on CPU) and its torch reference against the rule
itself, request by request: level d's beams at position ``start + d``, their slots those of
positions ``start + d * topk ..`` through the page table, the sequence ending after them;
padding requests (``seq_len`` 0) at position 0, slot -1, length 0."""

from __future__ import annotations

import pytest
import torch

from pcgspec.kernels.draft_levels import draft_levels, draft_levels_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _catch_up(b: int, rows_per_req: int, page_size: int, seed: int):
    """A padded catch-up: ``rows_per_req`` rows per request at random positions, its last real
    row per request, lengths (every third request padding) and a shuffled page table."""
    gen = torch.Generator().manual_seed(seed)
    last_pos = torch.randint(3, 60, (b,), generator=gen)
    positions = (last_pos[:, None] - torch.arange(rows_per_req).flip(0)).clamp_min(0).view(-1)
    rows = torch.arange(b) * rows_per_req + rows_per_req - 1
    seq_lens = (last_pos + 1).int()
    seq_lens[1::3] = 0  # NOTE: request 0 real, so a batch of one is not all padding
    pages = -(-100 // page_size)
    table = torch.randperm(b * pages, generator=gen).view(b, pages).int()
    return [t.to(DEVICE) for t in (positions, rows, seq_lens, table)]


def _check_rule(got, positions, rows, seq_lens, table, page_size, levels, topk) -> None:
    for b in range(rows.shape[0]):
        valid = int(seq_lens[b]) > 0
        start = int(positions[rows[b]]) + 1 if valid else 0
        for d in range(levels):
            beams = slice(b * topk, (b + 1) * topk)
            want_pos = [start + d] * topk
            assert got.positions[d, beams].tolist() == want_pos
            want_slots = [-1] * topk
            if valid:
                at = [start + d * topk + r for r in range(topk)]
                want_slots = [int(table[b, p // page_size]) * page_size + p % page_size for p in at]
            assert got.out_cache_loc[d, beams].tolist() == want_slots
            assert int(got.seq_lens[d, b]) == (start + (d + 1) * topk if valid else 0)
    assert got.extend_lens.tolist() == [topk] * rows.shape[0]
    assert got.logits_indices.tolist() == list(range(rows.shape[0] * topk))


@pytest.mark.parametrize("levels_fn", [draft_levels, draft_levels_ref])
@pytest.mark.parametrize(
    ("b", "levels", "topk", "page_size", "seed"),
    [(1, 4, 1, 1, 0), (3, 3, 1, 16, 1), (4, 4, 4, 4, 2), (7, 5, 3, 3, 3), (2, 1, 8, 16, 4)],
)
def test_levels_follow_the_rule(levels_fn, b, levels, topk, page_size, seed) -> None:
    args = _catch_up(b, 5, page_size, seed)
    got = levels_fn(*args, page_size, levels, topk)
    _check_rule(got, *args, page_size, levels, topk)
    for t in got[:3]:  # rows of their own alignment, as the attention kernels specialize on
        assert all((t[i].data_ptr() % 16) == 0 for i in range(levels))


def test_a_padding_request_without_rows() -> None:
    """A graph's padding request 0 whose last row is -1 (it has no real rows): position 0,
    slot -1, length 0, and the real request beside it unchanged."""
    positions, rows, seq_lens, table = _catch_up(3, 5, 4, 7)
    seq_lens[0], rows[0] = 0, -1
    for levels_fn in (draft_levels, draft_levels_ref):
        got = levels_fn(positions, rows, seq_lens, table, 4, 3, 2)
        _check_rule(got, positions, rows, seq_lens, table, 4, 3, 2)


def test_no_levels_and_no_requests() -> None:
    args = _catch_up(2, 5, 4, 5)
    got = draft_levels(*args, 4, 0, 2)
    assert got.positions.shape == (0, 4)
    assert got.extend_lens.tolist() == [2, 2] and got.logits_indices.tolist() == [0, 1, 2, 3]
    empty = [t[:0] for t in args]
    assert draft_levels(*empty, 4, 3, 2).seq_lens.shape == (3, 0)


@pytest.mark.parametrize(
    ("index", "change", "message"),
    [
        (0, lambda t: t.int(), "positions must be 1-D torch.int64"),
        (2, lambda t: t.long(), "seq_lens must be 1-D torch.int32"),
        (3, lambda t: t[:1], "one row per request"),
    ],
)
def test_bad_inputs_are_refused(index, change, message) -> None:
    args = _catch_up(3, 5, 4, 6)
    args[index] = change(args[index])
    with pytest.raises(ValueError, match=message):
        draft_levels(*args, 4, 2, 2)


@pytest.mark.gpu
@pytest.mark.parametrize(("b", "levels", "topk"), [(1, 3, 1), (16, 4, 4), (64, 6, 4)])
def test_compiled_levels_equal_the_reference_on_cuda(b, levels, topk) -> None:
    args = _catch_up(b, 6, 16, b)
    got = draft_levels(*args, 16, levels, topk)
    want = draft_levels_ref(*args, 16, levels, topk)
    for name, g, w in zip(got._fields, got, want):
        assert torch.equal(g, w), name
