"""``top_k`` (Triton; the interpreter on CPU) against ``top_k_ref``: the same ids and values,
ties to the lower id, over one chunk and several, with log-probabilities."""

from __future__ import annotations

import pytest
import torch

from pcgspec.kernels.top_k import CHUNK, top_k, top_k_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rows(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 4).to(dtype).to(DEVICE)


def _check_equal(x: torch.Tensor, k: int, log_softmax: bool) -> None:
    got_val, got_ids = top_k(x, k, log_softmax)
    want_val, want_ids = top_k_ref(x, k, log_softmax)
    assert got_ids.dtype == torch.int64 and got_val.dtype == want_val.dtype
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_val, want_val, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "v", "k", "log_softmax", "dtype"),
    [
        (1, 16, 4, False, torch.float64),  # a tree level's k * k children
        (3, 68, 15, False, torch.float64),  # a tree's candidates
        (4, 8 * CHUNK, 4, True, torch.bfloat16),  # four beams over a draft vocabulary
        (2, 3 * CHUNK - 5, 8, True, torch.float32),  # a short last chunk
        (2, CHUNK + 2, 4, True, torch.float16),  # a last chunk with fewer than k entries
        (5, 300, 1, True, torch.float32),
    ],
)
def test_top_k_equals_the_reference(rows, v, k, log_softmax, dtype) -> None:
    _check_equal(_rows((rows, v), dtype, seed=v + k), k, log_softmax)


def test_ties_go_to_the_lower_id_across_chunks() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (3, 2 * CHUNK + 7), generator=gen).float().to(DEVICE)
    _check_equal(x, 6, log_softmax=False)
    _check_equal(x, 6, log_softmax=True)
    _, ids = top_k(x, 6)
    top = x.max(dim=-1).values[:, None]
    want = torch.stack([(row == t).nonzero()[:6, 0] for row, t in zip(x, top)])
    assert torch.equal(ids, want)  # the lowest ids of the maximum


def test_minus_infinity_and_nan_rank_last() -> None:
    x = torch.full((2, CHUNK + 40), float("-inf"), device=DEVICE)
    x[0, [3, CHUNK + 9]] = torch.tensor([1.0, 2.0], device=DEVICE)
    x[1, :5] = float("nan")
    x[1, 7] = 0.5
    val, ids = top_k(x, 4)
    assert ids[0].tolist() == [CHUNK + 9, 3, 0, 1] and ids[1].tolist() == [7, 0, 1, 2]
    assert val[0, :2].tolist() == [2.0, 1.0] and val[1, 0] == 0.5
    assert val[:, 2:].eq(float("-inf")).all()
    logp, _ = top_k(x, 2, log_softmax=True)
    want = torch.tensor([2.0, 1.0]) - torch.tensor([2.0, 1.0]).logsumexp(0)
    torch.testing.assert_close(logp[0].cpu(), want)
    assert logp[1].isnan().all()  # as torch.log_softmax of a row holding NaN


@pytest.mark.parametrize("v", [1000, 2 * CHUNK])
def test_plus_infinity_ranks_first_with_nan_log_probabilities(v) -> None:
    """One launch or two: +inf is the best entry, and the row's log-probabilities are NaN."""
    x = torch.zeros(1, v, device=DEVICE)
    x[0, 5] = float("inf")
    for fn in (top_k, top_k_ref):
        val, ids = fn(x, 2, log_softmax=True)
        assert ids.tolist() == [[5, 0]] and val.isnan().all()


def test_inputs_closer_than_rounding_keep_their_input_order() -> None:
    """The rank is the input's: a bump below the log-probabilities' rounding still leads."""
    x = torch.zeros(1, 2 * CHUNK, device=DEVICE)
    x[0, 5] = 1e-7
    for fn in (top_k, top_k_ref):
        assert fn(x, 2, log_softmax=True)[1].tolist() == [[5, 0]]


def test_wide_float64_rows_and_the_largest_k() -> None:
    """A tree's candidates past one chunk, k = 64 (the bound), against torch.topk's values."""
    x = _rows((3, 2 * CHUNK + 100), torch.float64, seed=9)
    _check_equal(x, 64, log_softmax=False)
    want = x.topk(64, dim=-1)
    val, ids = top_k(x, 64)
    assert torch.equal(val, want.values) and torch.equal(ids, want.indices)  # no ties here
    logp = top_k_ref(x.float(), 8, log_softmax=True)[0]
    torch.testing.assert_close(logp, x.float().log_softmax(-1).topk(8, dim=-1).values)


def test_rows_of_a_strided_view() -> None:
    x = _rows((4, 2 * CHUNK), torch.float32, seed=5)[::2, 3 : CHUNK + 500]
    assert x.stride(1) == 1 and x.stride(0) != x.shape[1]
    _check_equal(x, 5, log_softmax=True)
    _check_equal(x.t().contiguous().t()[:, :40], 3, log_softmax=False)  # columns apart


@pytest.mark.parametrize("fn", [top_k, top_k_ref])
def test_bad_arguments_name_what_is_wrong(fn) -> None:
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="k must be in 1..8"):
        fn(x, 9)
    with pytest.raises(ValueError, match="k must be in 1..8"):
        fn(x, 0)
    with pytest.raises(ValueError, match=r"\[R, V\] rows"):
        fn(x[None], 2)


def test_a_drafted_tree_is_the_same_through_the_kernel(monkeypatch) -> None:
    """``TreeExpansion`` (each level's beams and the N - 1 kept candidates) through the kernels
    (top_k, tree_expand) as through their references: the same tokens, parents and depths."""
    from pcgspec.speculative import tree as tree_module

    def draft(kernels: bool) -> tree_module.DraftTree:
        monkeypatch.setattr(tree_module, "_use_kernels", lambda x: kernels)
        gen = torch.Generator().manual_seed(3)
        b, vocab, topk, depth = 2, 2 * CHUNK + 3, 3, 4
        logits = torch.randn(b, vocab, generator=gen).to(DEVICE)
        tree = tree_module.TreeExpansion(*tree_module.top_tokens(logits, topk), depth)
        for _ in range(depth - 1):
            child = torch.randn(b * topk, vocab, generator=gen).to(DEVICE)
            tree.expand(*tree_module.top_tokens(child, topk))
        return tree.select(16, depth)

    want, got = draft(False), draft(True)
    for name in ("tokens", "parents", "depths", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
