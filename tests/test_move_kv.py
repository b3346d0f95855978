"""``move_accepted_kv`` (Triton; the interpreter on CPU) and its torch reference against the
rule itself: after the move, position ``start + j`` of every layer holds, in K and V, what node
``path[j]`` wrote at ``start + path[j]``; every other slot is unchanged."""

from __future__ import annotations

import pytest
import torch

from pcgspec.kernels.move_kv import move_accepted_kv, move_accepted_kv_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(b: int, nodes: int, depth: int, page_size: int, seed: int):
    """A KV cache of 3 layers (one spare slot last), per request a page table of shuffled
    pages, a root position ``start`` (the last request: padding, -1) and an accepted path
    (strictly increasing node ids after the root, -1 past its end)."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_req = -(-(40 + nodes) // page_size)
    num_pages = b * pages_per_req
    k_all = torch.randn(3, num_pages * page_size + 1, 2, 5, generator=gen)
    v_all = torch.randn(k_all.shape, generator=gen)
    table = torch.randperm(num_pages, generator=gen).view(b, pages_per_req).int()
    start = torch.randint(0, 40, (b,), generator=gen)
    if b > 1:
        start[-1] = -1  # NOTE: a batch of one stays real
    path = torch.full((b, depth + 1), -1, dtype=torch.int64)
    path[:, 0] = 0
    for r in range(b):
        accepted = int(torch.randint(0, depth + 1, (), generator=gen))
        chosen = torch.randperm(nodes - 1, generator=gen)[:accepted] + 1
        path[r, 1 : accepted + 1] = chosen.sort().values
    return [t.to(DEVICE) for t in (k_all, v_all, table, start, path)]


def _expected(k_all, v_all, table, page_size, start, path):
    k_want, v_want = k_all.clone(), v_all.clone()
    for r in range(path.shape[0]):
        if start[r] < 0:
            continue
        for j, node in enumerate(path[r].tolist()):
            if node < 0:
                break
            src, dst = (int(start[r]) + p for p in (node, j))
            src_slot = int(table[r, src // page_size]) * page_size + src % page_size
            dst_slot = int(table[r, dst // page_size]) * page_size + dst % page_size
            k_want[:, dst_slot] = k_all[:, src_slot]
            v_want[:, dst_slot] = v_all[:, src_slot]
    return k_want, v_want


@pytest.mark.parametrize("move", [move_accepted_kv, move_accepted_kv_ref])
@pytest.mark.parametrize(
    ("b", "nodes", "depth", "page_size", "seed"),
    [(1, 16, 5, 1, 0), (3, 16, 5, 4, 1), (4, 24, 6, 16, 2), (5, 8, 7, 3, 3)],
)
def test_move_matches_the_rule(move, b, nodes, depth, page_size, seed) -> None:
    k_all, v_all, table, start, path = _case(b, nodes, depth, page_size, seed)
    k_want, v_want = _expected(k_all, v_all, table, page_size, start, path)
    steps = torch.arange(depth + 1, device=path.device)
    assert bool(((path > steps) & (start[:, None] >= 0)).any()), "some node must move"
    move(k_all, v_all, table, page_size, start, path)
    torch.testing.assert_close(k_all, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_all, v_want, rtol=0, atol=0)


def test_nodes_in_place_beside_moved_ones_and_a_wider_table() -> None:
    """Path 0, 1, 3, 4: node 1 stays, nodes 3 and 4 move; the page table is a column slice
    of a wider one (its row stride is not its width)."""
    k_all, v_all, table, start, path = _case(2, 8, 3, 2, 6)
    wide = torch.zeros(2, table.shape[1] + 5, dtype=torch.int32, device=DEVICE)
    wide[:, : table.shape[1]] = table
    table = wide[:, : table.shape[1]]
    start[:] = torch.tensor([5, 9])
    path[:] = torch.tensor([[0, 1, 3, 4], [0, 2, -1, -1]])
    k_want, v_want = _expected(k_all, v_all, table, 2, start, path)
    move_accepted_kv(k_all, v_all, table, 2, start, path)
    torch.testing.assert_close(k_all, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_all, v_want, rtol=0, atol=0)


def test_a_node_read_where_an_earlier_one_lands() -> None:
    """Path 0, 2, 5: node 2 moves to position 1 before node 5 moves onto node 2's position."""
    k_all, v_all, table, start, path = _case(1, 8, 3, 2, 4)
    start[0] = 7
    path[0] = torch.tensor([0, 2, 5, -1])
    k_want, v_want = _expected(k_all, v_all, table, 2, start, path)
    move_accepted_kv(k_all, v_all, table, 2, start, path)
    torch.testing.assert_close(k_all, k_want, rtol=0, atol=0)
    torch.testing.assert_close(v_all, v_want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "change", "message"),
    [
        ("v_all", lambda t: t[:2], "one \\[L, slots, KV, D\\] shape"),
        ("table", lambda t: t.long(), "page_table must be 2-D torch.int32"),
        ("start", lambda t: t.int(), "start must be 1-D torch.int64"),
        ("path", lambda t: t.float(), "path must be 2-D torch.int64 with 3 rows"),
        ("start", lambda t: t[:2], "start must be 1-D torch.int64 with 3 rows"),
    ],
)
def test_bad_inputs_are_refused(field, change, message) -> None:
    args = dict(zip(("k_all", "v_all", "table", "start", "path"), _case(3, 8, 3, 4, 5)))
    args[field] = change(args[field])
    with pytest.raises(ValueError, match=message):
        move_accepted_kv_ref(
            args["k_all"], args["v_all"], args["table"], 4, args["start"], args["path"]
        )


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_compiled_move_equals_the_reference_on_cuda(page_size) -> None:
    """Compiled, not interpreted, at a served shape: 30 layers, 3 KV heads of 64, bf16, a
    batch of 16 with a padding request, against the reference on copies of one cache."""
    gen = torch.Generator().manual_seed(page_size)
    b, depth, nodes = 16, 5, 16
    slots = b * 4096
    k_all = torch.randn(30, slots + 1, 3, 64, generator=gen).to("cuda", torch.bfloat16)
    v_all = torch.randn(k_all.shape, generator=gen).to("cuda", torch.bfloat16)
    pages = slots // page_size
    table = torch.randperm(pages, generator=gen).view(b, -1).int().cuda()
    start = torch.randint(0, 4096 - nodes, (b,), generator=gen).cuda()
    start[3] = -1
    path = torch.full((b, depth + 1), -1, dtype=torch.int64)
    path[:, 0] = 0
    for r in range(b):
        chosen = torch.randperm(nodes - 1, generator=gen)[: r % (depth + 1)] + 1
        path[r, 1 : len(chosen) + 1] = chosen.sort().values
    path = path.cuda()
    want_k, want_v = k_all.clone(), v_all.clone()
    move_accepted_kv_ref(want_k, want_v, table, page_size, start, path)
    move_accepted_kv(k_all, v_all, table, page_size, start, path)
    assert torch.equal(k_all, want_k) and torch.equal(v_all, want_v)
