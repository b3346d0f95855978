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
    ("lens", "rows", "num_out"), [([3, 1, 9], 16, 5), ([4], 4, 2), ([1] * 1100, 1200, 1200)]
)
def test_pad_batch_pads_requests(lens: list[int], rows: int, num_out: int) -> None:
    """An extend graph's requests: the batch's, one owning the padded rows, then empty ones."""
    gen = torch.Generator().manual_seed(rows)
    n, b = sum(lens), len(lens)
    src = [torch.randint(0, 1 << 40, (n,), generator=gen).to(DEVICE) for _ in range(3)]
    extend_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    seq_lens = extend_lens + torch.randint(0, 500, (b,), generator=gen, dtype=torch.int32).to(
        DEVICE
    )
    outs = {}
    for name, fn in (("kernel", pad_batch), ("ref", pad_batch_ref)):
        bufs = [torch.full((rows,), 7, dtype=torch.int64, device=DEVICE) for _ in range(3)]
        start, out_seq, out_ext = (
            torch.full((num_out,), -5, dtype=torch.int32, device=DEVICE) for _ in range(3)
        )
        fn(*src, extend_lens, *bufs, start, PaddedRequests(seq_lens, out_seq, out_ext))
        outs[name] = (*bufs, start, out_seq, out_ext)
    for got, want in zip(outs["kernel"], outs["ref"]):
        assert torch.equal(got, want)
    *_, start, out_seq, out_ext = outs["kernel"]
    empty = [0] * (num_out - b - 1)
    assert out_ext.tolist() == [*lens, rows - n, *empty]
    assert out_seq.tolist() == [*seq_lens.tolist(), rows - n, *empty]
    assert start.tolist() == [sum(lens[:i]) for i in range(b)] + [n] + [rows] * len(empty)


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
    with pytest.raises(ValueError, match="do not hold 1 requests and the padding one"):
        pad_batch(*tokens, lens, *tokens, start, PaddedRequests(lens, one, one.clone()))
