"""``padded_rows`` (one Triton launch) against ``padded_rows_ref`` and against what the rows
mean: positions from each request's start, slots through its page-table row, -1 from num_valid
on, lengths, and each request's last valid row; bad shapes raise ValueError.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pcgspec.kernels.padded_rows import padded_rows, padded_rows_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(b: int, k1: int, page_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 40, (b,), generator=gen)
    num_pages = (40 + k1) // page_size + 1
    table = torch.randperm(4 * num_pages * b, generator=gen)[: b * num_pages]
    return starts.to(DEVICE), table.view(b, num_pages).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("valid", [False, True])
@pytest.mark.parametrize(("b", "k1", "page_size"), [(1, 5, 16), (3, 5, 4), (17, 3, 1), (2, 8, 8)])
def test_padded_rows_matches_reference_and_meaning(b: int, k1: int, page_size: int,
                                                   valid: bool) -> None:  # fmt: skip
    starts, table = _case(b, k1, page_size, seed=b * k1)
    num = (torch.arange(b, device=DEVICE) % k1 + 1) if valid else None
    got = padded_rows(starts, table, page_size, k1, num)
    want = padded_rows_ref(starts, table, page_size, k1, num)
    for field in dataclasses.fields(got):
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
    rows = padded_rows(torch.zeros(0, dtype=torch.int64, device=DEVICE),
                       torch.zeros(0, 3, dtype=torch.int32, device=DEVICE), 4, 5)  # fmt: skip
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
