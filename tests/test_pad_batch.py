"""``pad_batch`` (one Triton launch) against ``pad_batch_ref``: padded slots -1, rows past the
batch keep their ids and positions, each request's first row; bad shapes raise ValueError.
"""

from __future__ import annotations

import pytest
import torch

from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch, pad_batch_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = [  # extend_lens, rows
    ([16], 16),
    ([3, 1, 9], 16),
    ([1] * 2500, 3000),  # several programs, and the scan over more than one block of requests
    ([700, 1, 1500], 4096),
]


@pytest.mark.parametrize("with_start", [True, False])
@pytest.mark.parametrize(("lens", "rows"), CASES)
def test_pad_batch_matches_reference(lens: list[int], rows: int, with_start: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    n = sum(lens)
    src = [torch.randint(0, 1 << 40, (n,), generator=gen).to(DEVICE) for _ in range(3)]
    extend_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    outs = {}
    for name, fn in (("kernel", pad_batch), ("ref", pad_batch_ref)):
        stale = torch.arange(rows, dtype=torch.int64, device=DEVICE) + 7
        bufs = [stale.clone(), stale.clone(), stale.clone()]
        start = torch.full((len(lens),), -5, dtype=torch.int32, device=DEVICE)
        fn(*src, extend_lens, *bufs, start if with_start else None)
        outs[name] = (*bufs, start)
    for got, want in zip(outs["kernel"], outs["ref"]):
        assert torch.equal(got, want)
    ids, positions, loc, start = outs["kernel"]
    assert torch.equal(ids[:n], src[0]) and torch.equal(ids[n:], stale[n:])
    assert torch.equal(positions[n:], stale[n:]) and (loc[n:] == -1).all()
    want = [sum(lens[:b]) for b in range(len(lens))] if with_start else [-5] * len(lens)
    assert start.tolist() == want


@pytest.mark.parametrize(
    ("lens", "rows", "num_out", "pages"),
    [
        ([3, 1, 9], 16, 5, 3),
        ([4], 4, 2, 0),
        ([1] * 1100, 1200, 1200, 2),
        ([5, 2], 8, 3, 700),
        ([], 4, 2, 3),  # no request: the padding one owns every row (capture warm-ups)
    ],
)
def test_pad_batch_pads_requests(lens: list[int], rows: int, num_out: int, pages: int) -> None:
    """An extend graph's requests: the batch's, one owning the padded rows, then empty ones;
    the batch's page table into the first rows and columns of the graph's (the rest stale), its
    sampled rows into the first entries of the graph's (a table over several programs' blocks,
    one of no pages, and a source table whose rows are wider than its columns, included)."""
    gen = torch.Generator().manual_seed(rows)
    n, b = sum(lens), len(lens)
    src = [torch.randint(0, 1 << 40, (n,), generator=gen).to(DEVICE) for _ in range(3)]
    extend_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    seq_lens = extend_lens + torch.randint(0, 500, (b,), generator=gen, dtype=torch.int32).to(
        DEVICE
    )
    wide = torch.randint(0, 1 << 30, (b, pages + 3), generator=gen, dtype=torch.int32)
    table = wide.to(DEVICE)[:, :pages]  # NOTE: a row stride past the columns copied
    sampled = torch.randint(0, max(n, 1), (b,), generator=gen).to(DEVICE)
    outs = {}
    for name, fn in (("kernel", pad_batch), ("ref", pad_batch_ref)):
        bufs = [torch.full((rows,), 7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
        start, out_seq, out_ext = (
            torch.full((num_out,), -5, dtype=torch.int32, device=DEVICE) for _ in range(3)
        )
        out_table = torch.full((num_out, pages + 5), -3, dtype=torch.int32, device=DEVICE)
        out_sampled = torch.full((b + 2,), -4, dtype=torch.int64, device=DEVICE)
        requests = PaddedRequests(
            seq_lens, out_seq, out_ext, table, out_table, sampled, out_sampled
        )
        fn(*src, extend_lens, *bufs, start, requests)
        outs[name] = (*bufs, start, out_seq, out_ext, out_table, out_sampled)
    for got, want in zip(outs["kernel"], outs["ref"]):
        assert torch.equal(got, want)
    *_, start, out_seq, out_ext, out_table, out_sampled = outs["kernel"]
    empty = [0] * (num_out - b - 1)
    assert out_ext.tolist() == [*lens, rows - n, *empty]
    assert out_seq.tolist() == [*seq_lens.tolist(), rows - n, *empty]
    assert start.tolist() == [sum(lens[:i]) for i in range(b)] + [n] + [rows] * len(empty)
    assert torch.equal(out_table[:b, :pages], table)
    assert (out_table[b:] == -3).all() and (out_table[:, pages:] == -3).all()
    assert out_sampled.tolist() == [*sampled.tolist(), -4, -4]


def test_pad_batch_rejects_bad_shapes() -> None:
    i64 = dict(dtype=torch.int64, device=DEVICE)
    tokens = [torch.zeros(5, **i64) for _ in range(3)]
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    start = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    short = [torch.zeros(4, **i64) for _ in range(3)]
    with pytest.raises(ValueError, match="do not pad to 4 rows"):
        pad_batch(*tokens, lens, *short, start)
    with pytest.raises(ValueError, match="contiguous"):
        pad_batch(*tokens[:2], torch.zeros(10, **i64)[::2], lens, *tokens, start)
    with pytest.raises(ValueError, match="out_start"):
        pad_batch(*tokens, lens, *tokens, start.long())
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    two = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    table, rows = torch.zeros(1, 3, dtype=torch.int32, device=DEVICE), tokens[0][:1]

    def padded(seq, table=table, out_table=table, sampled=rows, out_sampled=rows):
        return PaddedRequests(lens, seq, seq.clone(), table, out_table, sampled, out_sampled)

    with pytest.raises(ValueError, match="do not hold 1 requests and the padding one"):
        pad_batch(*tokens, lens, *tokens, start, padded(one))
    wide = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)
    for bad, match in [
        (dict(table=table.long()), "page tables must be"),
        (dict(table=wide), r"a page table \(2, 4\) of 1 requests does not fit"),
        (dict(out_table=table[:, :2]), r"a page table \(1, 3\) of 1 requests does not fit"),
        (dict(table=table.to("meta")), "must be on the batch's device"),
        (dict(sampled=rows.int()), "sampled rows must be"),
        (dict(sampled=tokens[0][:3]), "3 sampled rows do not fit 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            pad_batch(*tokens, lens, *tokens, two, padded(two, **bad))
