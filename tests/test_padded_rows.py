"""``padded_rows`` (one Triton launch) against ``padded_rows_ref`` and against what the rows
mean: positions from each request's start, slots through its page-table row, -1 from num_valid
on, lengths, and each request's last valid row; bad shapes raise ValueError.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcgspec.kernels.padded_rows import (
    GraphRows,
    VerifyTokens,
    padded_rows,
    padded_rows_into,
    padded_rows_into_ref,
    padded_rows_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(b: int, k1: int, page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (b,), generator=gen)
    num_pages = (40 + k1) // page_size + 1
    table = torch.randperm(4 * num_pages * b, generator=gen)[: b * num_pages]
    return starts.to(DEVICE), table.view(b, num_pages).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("valid", [False, True])
@pytest.mark.parametrize(("b", "k1", "page_size"), [(1, 5, 16), (3, 5, 4), (17, 3, 1), (2, 8, 8)])
def test_padded_rows_matches_reference_and_meaning(
    b: int, k1: int, page_size: int, valid: bool
) -> None:
    starts, table = _case(b, k1, page_size, seed=b * k1)
    num = (torch.arange(b, device=DEVICE) % k1 + 1) if valid else None
    got = padded_rows(starts, table, page_size, k1, num)
    want = padded_rows_ref(starts, table, page_size, k1, num)
    assert got.input_ids is None and want.input_ids is None
    for field in dataclasses.fields(got)[:-1]:
        assert torch.equal(getattr(got, field.name), getattr(want, field.name)), field.name
    for r in range(b):
        n = k1 if num is None else int(num[r])
        for j in range(k1):
            row, pos = r * k1 + j, int(starts[r]) + j
            assert got.positions[row] == pos
            slot = int(table[r, pos // page_size]) * page_size + pos % page_size
            assert got.out_cache_loc[row] == (slot if j < n else -1)
        assert got.last_rows[r] == r * k1 + n - 1
        assert got.seq_lens[r] == int(starts[r]) + k1 and got.extend_start[r] == r * k1
    assert (got.extend_lens == k1).all()
    assert got.all_rows.tolist() == list(range(b * k1))


def test_padded_rows_of_no_request() -> None:
    rows = padded_rows(
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, 3, dtype=torch.int32, device=DEVICE),
        4,
        5,
    )
    assert rows.positions.numel() == 0 and rows.last_rows.numel() == 0


def test_padded_rows_rejects_bad_inputs() -> None:
    starts, table = _case(2, 5, 4, seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        padded_rows(starts.to(torch.int32), table, 4, 5)
    with pytest.raises(ValueError, match="num_valid has 1 requests"):
        padded_rows(starts, table, 4, 5, starts[:1].clone())
    with pytest.raises(ValueError, match="page_table must be"):
        padded_rows(starts, table[:1], 4, 5)
    with pytest.raises(ValueError, match="int32"):
        padded_rows(starts, table.long(), 4, 5)


def test_padded_rows_past_the_page_table_write_no_kv() -> None:
    """A row whose page is past its table row (never with the host's reservations) gets slot
    -1, not a slot in some other request's page."""
    table = torch.tensor([[7, 9]], dtype=torch.int32, device=DEVICE)  # 2 pages of 4: positions < 8
    rows = padded_rows(torch.tensor([5], device=DEVICE), table, 4, 5)
    assert rows.positions.tolist() == [5, 6, 7, 8, 9]
    assert rows.out_cache_loc.tolist() == [9 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, -1, -1]


def _tokens(b: int, k1: int, seed: int) -> VerifyTokens:
    gen = torch.Generator().manual_seed(seed)
    last = torch.randint(0, 1000, (11,), generator=gen).to(DEVICE)
    slots = torch.randperm(11, generator=gen)[:b].to(DEVICE)
    drafts = torch.randint(0, 1000, (b, k1 - 1), generator=gen).to(DEVICE)
    return VerifyTokens(last, slots, drafts)


@pytest.mark.parametrize(("b", "k1", "page_size"), [(1, 5, 16), (3, 5, 4), (5, 2, 1)])
def test_a_verify_pass_gets_its_input_ids_and_start_offset(b: int, k1: int, page_size: int) -> None:
    """Row j of request b: id ``last[slots[b]]`` then ``drafts[b, j-1]``, at ``starts + offset
    + j``."""
    starts, table = _case(b, k1, page_size, seed=b + k1)
    starts = starts + 1
    tokens = _tokens(b, k1, seed=b)
    got = padded_rows(starts, table, page_size, k1, start_offset=-1, tokens=tokens)
    want = padded_rows_ref(starts, table, page_size, k1, start_offset=-1, tokens=tokens)
    for field in dataclasses.fields(got):
        assert torch.equal(getattr(got, field.name), getattr(want, field.name)), field.name
    for r in range(b):
        ids = got.input_ids[r * k1 : (r + 1) * k1].tolist()
        assert ids == [int(tokens.last[tokens.slots[r]]), *tokens.drafts[r].tolist()]
        assert got.positions[r * k1] == int(starts[r]) - 1
        assert got.seq_lens[r] == int(starts[r]) - 1 + k1


@pytest.mark.parametrize(("b", "bucket"), [(1, 1), (3, 4), (2, 8)])
def test_a_verify_pass_in_place_pads_its_bucket(b: int, bucket: int) -> None:
    """Into a graph bucket's buffers: the requests' rows as ``padded_rows`` builds them, the
    padding requests' slots -1 and lengths 0, the extend lengths and row indices untouched."""
    k1, page_size = 5, 4
    starts, table = _case(b, k1, page_size, seed=bucket)
    tokens = _tokens(b, k1, seed=bucket)
    want = padded_rows_ref(starts, table, page_size, k1, start_offset=-1, tokens=tokens)
    for into in (padded_rows_into, padded_rows_into_ref):
        n = bucket * k1
        rows = GraphRows(
            torch.full((n,), 7, dtype=torch.int64, device=DEVICE),
            torch.full((n,), 7, dtype=torch.int64, device=DEVICE),
            torch.full((n,), 7, dtype=torch.int64, device=DEVICE),
            torch.full((bucket,), 7, dtype=torch.int32, device=DEVICE),
            torch.full((bucket,), k1, dtype=torch.int32, device=DEVICE),
            torch.arange(n, device=DEVICE),
        )
        into(rows, starts, table, page_size, k1, start_offset=-1, tokens=tokens)
        m = b * k1
        assert torch.equal(rows.input_ids[:m], want.input_ids)
        assert torch.equal(rows.positions[:m], want.positions)
        assert torch.equal(rows.out_cache_loc[:m], want.out_cache_loc)
        assert torch.equal(rows.seq_lens[:b], want.seq_lens)
        assert (rows.out_cache_loc[m:] == -1).all() and (rows.seq_lens[b:] == 0).all()
        assert (rows.extend_lens == k1).all() and rows.all_rows.tolist() == list(range(n))


def test_a_verify_pass_rejects_bad_tokens_and_buckets() -> None:
    starts, table = _case(2, 5, 4, seed=1)
    tokens = _tokens(2, 5, seed=1)
    with pytest.raises(ValueError, match="tokens must be"):
        padded_rows(
            starts,
            table,
            4,
            5,
            tokens=VerifyTokens(tokens.last, tokens.slots, tokens.drafts[:, :3]),
        )
    small = GraphRows(
        *(torch.zeros(5, dtype=torch.int64, device=DEVICE) for _ in range(3)),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
        torch.zeros(5, dtype=torch.int64, device=DEVICE),
    )
    with pytest.raises(ValueError, match="bucket of >= 2"):
        padded_rows_into(small, starts, table, 4, 5, tokens=tokens)
