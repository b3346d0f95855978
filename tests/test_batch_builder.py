"""``build_forward_batch`` against a position-by-position reference: random chunks (decode rows,
chunks that start mid-page and cross pages, whole prompts), scattered page lists; the padded
builders' padding requests."""

from __future__ import annotations

import random

import pytest
import torch

from pcgspec.kernels.padded_rows import VerifyTokens
from pcgspec.runners.batch_builder import (
    SeqChunk,
    build_forward_batch,
    build_padded_batch,
    build_verify_batch,
)
from pcgspec.runners.forward_batch import ForwardMode


def _chunks(rng: random.Random, page_size: int) -> list[SeqChunk]:
    chunks = []
    for _ in range(rng.randint(1, 12)):
        start = rng.randint(0, 70)
        n = rng.choice([1, 1, rng.randint(1, 3 * page_size)])
        num_pages = -(-(start + n) // page_size) + rng.randint(0, 2)  # some spare pages
        pages = rng.sample(range(1, 500), num_pages)
        ids = [rng.randrange(1000) for _ in range(n)]
        chunks.append(SeqChunk(ids, start, pages, rng.random() < 0.8))
    return chunks


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_batch_equals_a_position_by_position_reference(seed: int, page_size: int) -> None:
    rng = random.Random(seed)
    chunks = _chunks(rng, page_size)
    batch = build_forward_batch(ForwardMode.EXTEND, chunks, page_size, "cpu")
    ids, positions, slots, sampled, first = [], [], [], [], []
    for c in chunks:
        first.append(len(ids))
        for i, token in enumerate(c.token_ids):
            p = c.start + i
            ids.append(token)
            positions.append(p)
            slots.append(c.pages[p // page_size] * page_size + p % page_size)
        if c.sample:
            sampled.append(len(ids) - 1)
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.out_cache_loc.tolist() == slots
    assert batch.logits_indices.tolist() == sampled
    assert batch.extend_start.tolist() == first
    lens = [c.start + len(c.token_ids) for c in chunks]
    assert batch.seq_lens.tolist() == list(batch.seq_lens_cpu) == lens
    assert (
        batch.extend_lens.tolist()
        == list(batch.extend_lens_cpu)
        == [len(c.token_ids) for c in chunks]
    )
    width = max(len(c.pages) for c in chunks)
    assert batch.page_table.tolist() == [
        list(c.pages) + [0] * (width - len(c.pages)) for c in chunks
    ]
    assert batch.input_ids.dtype == torch.int64 and batch.page_table.dtype == torch.int32


def test_a_chunk_past_its_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 9 KV slots but owns 2 pages"):
        build_forward_batch(ForwardMode.EXTEND, [SeqChunk([1, 2], 7, [3, 4])], 4, "cpu")


def test_padding_requests_of_padded_batches_write_and_read_no_kv() -> None:
    """``valid`` marks a padded batch's real requests: theirs are the rows of the same batch
    built without padding; a padding request's rows write no KV, read none (length 0) and sit at
    position 0 onwards, whatever its stale start, length and pages held."""
    gen = torch.Generator().manual_seed(0)
    b, k1, page_size, pages = 5, 4, 4, 6
    valid = torch.tensor([True, False, True, True, False])
    table = torch.randint(1, 100, (b, pages), generator=gen, dtype=torch.int32)
    starts = torch.randint(1, 15, (b,), generator=gen)
    num = torch.randint(1, k1 + 1, (b,), generator=gen)
    ids = torch.randint(0, 50, (b, k1), generator=gen)
    last = torch.randint(0, 50, (8,), generator=gen)
    tokens = VerifyTokens(last, torch.arange(b) + 2, ids[:, 1:].contiguous())
    bounds = (20,) * b
    built = {
        "catch-up": (
            build_padded_batch(
                ForwardMode.DRAFT_EXTEND, ids, starts, table, page_size, bounds, num
            ),
            build_padded_batch(
                ForwardMode.DRAFT_EXTEND, ids, starts, table, page_size, bounds, num, valid=valid
            ),
        ),
        "verify": (
            build_verify_batch(tokens, starts, table, page_size, bounds),
            build_verify_batch(tokens, starts, table, page_size, bounds, valid=valid),
        ),
    }
    for name, (whole, padded) in built.items():
        rows = valid.repeat_interleave(k1)
        for field in ("input_ids", "positions", "out_cache_loc"):
            a, p = getattr(whole, field), getattr(padded, field)
            assert torch.equal(a[rows], p[rows]), (name, field)
        assert torch.equal(whole.seq_lens[valid], padded.seq_lens[valid]), name
        keep = rows if name == "verify" else valid  # logits: every row's, or each last row's
        assert torch.equal(whole.logits_indices[keep], padded.logits_indices[keep]), name
        assert (padded.out_cache_loc[~rows] == -1).all(), name
        assert (padded.seq_lens[~valid] == 0).all(), name
        assert padded.positions.view(b, k1)[~valid].tolist() == [list(range(k1))] * 2, name
    offsets = torch.randint(0, 3, (b, k1), generator=gen)  # a tree's nodes at their depths
    tree = build_verify_batch(tokens, starts, table, page_size, bounds, row_offsets=offsets)
    padded_tree = build_verify_batch(
        tokens, starts, table, page_size, bounds, row_offsets=offsets, valid=valid
    )
    rows = valid.repeat_interleave(k1)
    assert torch.equal(tree.positions[rows], padded_tree.positions[rows])
    with pytest.raises(ValueError, match="valid must be None"):
        build_verify_batch(
            tokens, starts, table, page_size, bounds, graph_rows=object(), valid=valid
        )
