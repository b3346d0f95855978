"""``expand_beams`` (Triton; the interpreter on CPU) against ``expand_beams_ref``: the same
candidates written, the same next beams, masks and parent beams."""

from __future__ import annotations

import pytest
import torch

from pcgspec.kernels.top_k import top_k, top_k_ref
from pcgspec.kernels.tree_expand import (
    Beams,
    expand_beams,
    expand_beams_ref,
    select_nodes,
    select_nodes_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
STRICT = 2.0**-30  # the tree's margin: exact in float32, as compiled kernels take floats


def _setup(b: int, k: int, level: int, seed: int, ties: bool = False):
    """Beams of level ``level`` (masks over ``level * k`` slots) and their children, and
    candidate tables with the earlier levels' columns filled."""
    gen = torch.Generator().manual_seed(seed)
    width = level * k
    first = k + (level - 1) * k * k
    size = first + k * k + 5  # NOTE: columns past this level's stay untouched
    beams = Beams(
        torch.randn(b, k, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randint(0, first, (b, k), generator=gen).to(DEVICE),
        torch.randint(0, 1000, (b, k), generator=gen).to(DEVICE),
        (torch.rand(b, k, width, generator=gen) < 0.5).to(DEVICE),
    )
    lp = torch.randn(b * k, k, generator=gen)
    if ties:
        lp = lp.round()
        beams = beams._replace(scores=beams.scores.round())
    child_tok = torch.randint(0, 1000, (b * k, k), generator=gen).to(DEVICE)
    tables = (
        torch.randn(b, size, generator=gen, dtype=torch.float64).to(DEVICE),
        torch.randint(0, 9, (b, size), generator=gen).to(DEVICE),
        torch.randint(0, 9, (b, size), generator=gen).to(DEVICE),
    )
    return beams, lp.to(DEVICE), child_tok, tables, first


@pytest.mark.parametrize(
    ("b", "k", "level", "ties"),
    [(1, 2, 1, False), (3, 4, 2, False), (2, 3, 4, True), (5, 8, 1, True), (2, 5, 3, False)],
)
def test_expand_beams_equals_the_reference(b, k, level, ties) -> None:
    beams, lp, tok, tables, first = _setup(b, k, level, seed=b * 100 + k * 10 + level, ties=ties)
    want_tables = tuple(t.clone() for t in tables)
    want = expand_beams_ref(beams, lp, tok, want_tables, first, STRICT)
    got = expand_beams(beams, lp, tok, tables, first, STRICT)
    for name in Beams._fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for got_t, want_t in zip(tables, want_tables):
        assert torch.equal(got_t, want_t)
    assert got.mask.shape == (b, k, (level + 1) * k)


@pytest.mark.parametrize(("b", "k", "ties"), [(1, 2, False), (3, 4, True), (2, 8, False)])
def test_the_root_expansion_keeps_its_children_in_order(b, k, ties) -> None:
    """Depth 1: the root's children (sorted, as ``top_tokens`` gives them) become the beams in
    their order, each seeing itself; candidates 0..k-1 with the root (-1) as parent."""
    gen = torch.Generator().manual_seed(b * 10 + k)
    lp = torch.randn(b, k, generator=gen).sort(dim=-1, descending=True).values
    if ties:
        lp = lp.round()
    tok = torch.randint(0, 1000, (b, k), generator=gen)
    size = k + 3  # NOTE: later depths' columns
    for fn in (expand_beams_ref, expand_beams):
        tables = tuple(
            torch.zeros(b, size, dtype=d, device=DEVICE)
            for d in (torch.float64, torch.int64, torch.int64)
        )
        out = fn(None, lp.to(DEVICE), tok.to(DEVICE), tables, 0, 0.5)
        assert torch.equal(out.scores.cpu(), lp.double() - 0.5), fn.__name__
        assert torch.equal(out.ids.cpu(), torch.arange(k).repeat(b, 1))
        assert torch.equal(out.tokens.cpu(), tok)
        assert torch.equal(out.mask.cpu(), torch.eye(k, dtype=torch.bool).repeat(b, 1, 1))
        assert torch.equal(out.parent.cpu(), torch.zeros(b, k, dtype=torch.int64))


def test_the_root_expansion_fills_the_first_candidates() -> None:
    lp = torch.tensor([[-0.25, -1.5, -3.0]])
    tok = torch.tensor([[5, 9, 2]])
    for fn in (expand_beams_ref, expand_beams):
        tables = tuple(
            torch.zeros(1, 5, dtype=d) for d in (torch.float64, torch.int64, torch.int64)
        )
        fn(None, lp, tok, tables, 0, 0.0)
        assert tables[0][0, :3].tolist() == [-0.25, -1.5, -3.0]
        assert tables[1][0, :3].tolist() == [5, 9, 2]
        assert tables[2][0].tolist() == [-1, -1, -1, 0, 0]  # columns past the root's untouched


def test_the_reference_keeps_the_best_children_and_grows_their_masks() -> None:
    """By hand: two beams of two children each."""
    beams = Beams(
        torch.tensor([[-1.0, -2.0]], dtype=torch.float64),
        torch.tensor([[0, 1]]),
        torch.tensor([[7, 8]]),
        torch.tensor([[[True, False], [False, True]]]),
    )
    lp = torch.tensor([[-3.0, -0.5], [-0.125, -4.0]])  # beam 0: -4, -1.5; beam 1: -2.125, -6
    tok = torch.tensor([[10, 11], [12, 13]])
    tables = (torch.zeros(1, 6, dtype=torch.float64), torch.zeros(1, 6, dtype=torch.int64))
    tables = (*tables, torch.zeros(1, 6, dtype=torch.int64))
    for fn in (expand_beams_ref, expand_beams):
        out = fn(beams, lp, tok, tuple(t.clone() for t in tables), 2, 0.0)
        assert out.tokens.tolist() == [[11, 12]] and out.ids.tolist() == [[3, 4]]
        assert out.scores.tolist() == [[-1.5, -2.125]] and out.parent.tolist() == [[0, 1]]
        assert out.mask.tolist() == [[[True, False, True, False], [False, True, False, True]]]


def test_shapes_are_checked() -> None:
    beams, lp, tok, tables, first = _setup(2, 3, 1, seed=0)
    with pytest.raises(ValueError, match=r"child_lp must be \[6, 3\]"):
        expand_beams(beams, lp[:5], tok, tables, first, STRICT)
    with pytest.raises(ValueError, match="one row-major"):
        expand_beams(beams, lp, tok, (tables[0], tables[1].t().contiguous().t(), tables[2]), 1, 0)


@pytest.mark.parametrize(("b", "k", "depth", "nodes"), [(1, 2, 3, 6), (3, 4, 5, 16), (2, 3, 4, 28)])
def test_select_nodes_equals_the_reference(b, k, depth, nodes) -> None:
    """Trees grown by the reference's expansion, their best ``nodes - 1`` candidates handed
    over in a shuffled order: the same drafts, parents, depths and masks."""
    gen = torch.Generator().manual_seed(b + k + depth)
    size = k + (depth - 1) * k * k
    tables = (
        torch.empty(b, size, dtype=torch.float64),
        torch.randint(0, 1000, (b, size), generator=gen),
        torch.empty(b, size, dtype=torch.int64),
    )
    scores = torch.randn(b, k, generator=gen, dtype=torch.float64) - STRICT
    tables[0][:, :k], tables[2][:, :k] = scores, -1
    beams = Beams(
        scores,
        torch.arange(k).repeat(b, 1),
        tables[1][:, :k],
        torch.eye(k, dtype=torch.bool).repeat(b, 1, 1),
    )
    for level in range(1, depth):
        lp = torch.randn(b * k, k, generator=gen).log_softmax(-1)
        tok = torch.randint(0, 1000, (b * k, k), generator=gen)
        beams = expand_beams_ref(beams, lp, tok, tables, k + (level - 1) * k * k, STRICT)
    chosen = top_k_ref(tables[0], nodes - 1)[1]
    shuffled = chosen.gather(1, torch.rand(chosen.shape, generator=gen).argsort(dim=-1))
    want = select_nodes_ref(chosen, tables[1], tables[2], depth)
    got = select_nodes(shuffled.to(DEVICE), tables[1].to(DEVICE), tables[2].to(DEVICE), depth)
    for name, g, w in zip(("tokens", "parents", "depths", "mask"), got, want):
        assert torch.equal(g.cpu(), w), name
    assert want[2].max() == depth  # drafts at depths 1..depth, the root at 0


@pytest.mark.gpu
def test_compiled_kernels_equal_the_references_on_cuda() -> None:
    """Compiled, not interpreted: scalars typed as the compiled launch types them (scores small
    enough that a rounded margin would show), the chunked top-k and the node selection."""
    for b, k, level in ((3, 4, 2), (2, 3, 4), (1, 8, 1)):
        beams, lp, tok, tables, first = _setup(b, k, level, seed=k)
        beams = beams._replace(scores=beams.scores * 1e-9)
        want_tables = tuple(t.clone() for t in tables)
        want = expand_beams_ref(beams, lp * 1e-9, tok, want_tables, first, STRICT)
        got = expand_beams(beams, lp * 1e-9, tok, tables, first, STRICT)
        for name in Beams._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert all(torch.equal(g, w) for g, w in zip(tables, want_tables))
    for b, k in ((3, 4), (16, 8)):  # the root's expansion
        _, lp, tok, tables, _ = _setup(b, k, 1, seed=k)
        lp, tok = lp[:b] * 1e-9, tok[:b]
        want_tables = tuple(t.clone() for t in tables)
        want = expand_beams_ref(None, lp, tok, want_tables, 0, STRICT)
        got = expand_beams(None, lp, tok, tables, 0, STRICT)
        for name in Beams._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert all(torch.equal(g, w) for g, w in zip(tables, want_tables))
    gen = torch.Generator().manual_seed(0)
    for shape, dtype, k, log_softmax in (
        ((4, 8192), torch.bfloat16, 4, True),
        ((3, 2200), torch.float64, 16, False),
        ((2, 49152), torch.float32, 8, True),
    ):
        x = torch.randn(shape, generator=gen).to(dtype).cuda()
        got_val, got_ids = top_k(x, k, log_softmax)
        want_val, want_ids = top_k_ref(x, k, log_softmax)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_val, want_val, rtol=1e-5, atol=1e-5)
    scores = torch.randn(3, 68, generator=gen, dtype=torch.float64).cuda()
    parents = torch.cat(
        [torch.full((3, 4), -1), torch.arange(4).repeat_interleave(16)[None].expand(3, -1)], 1
    )
    chosen = top_k_ref(scores[:, :4], 4)[1]  # the four roots' children: a valid tree of depth 1
    tokens = torch.randint(0, 100, (3, 68), generator=gen).cuda()
    got = select_nodes(chosen, tokens, parents.cuda().contiguous(), 1)
    want = select_nodes_ref(chosen, tokens, parents.cuda().contiguous(), 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
