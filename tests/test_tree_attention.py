"""Tree attention (``ForwardBatch.tree_mask``): the Triton split-KV kernel against its torch
reference on random trees, both backends against each other, and a tree verify pass against
verifying every root-to-leaf path on its own. Tree helpers (``speculative/tree.py``) too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_triton_attention import DEVICE, _backends, _batch, _cache, _lens, _page_table, _run

from pcgspec.kernels.attention import decode_attention, decode_attention_ref
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.speculative.tree import (
    TreeExpansion,
    TreeShape,
    ancestor_mask,
    path_rows,
)


def depths_of(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, N]`` depth of every node of trees given by ``parents`` [B, N], hop by hop (the
    reference for the depths a drafted tree carries)."""
    depth = torch.zeros_like(parents)
    cur = parents
    for _ in range(max_depth):
        depth += (cur >= 0).long()
        cur = torch.where(cur >= 0, parents.gather(1, cur.clamp_min(0)), -1)
    return depth


def chain_parents(batch_size: int, num_nodes: int, device: torch.device) -> torch.Tensor:
    """``[B, N]`` parents of a chain: -1, 0, 1, .., N-2."""
    return (torch.arange(num_nodes, device=device) - 1).expand(batch_size, num_nodes).contiguous()


def random_parents(b: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``[B, N]`` random trees in depth order: node i's parent is one of nodes 0..i-1."""
    rows = [[-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]]
    rows += [
        [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
        for _ in range(b - 1)
    ]
    return torch.tensor(rows, dtype=torch.int64)


def test_ancestor_mask_and_depths() -> None:
    parents = torch.tensor([[-1, 0, 0, 1, 3, 2]])
    mask = ancestor_mask(parents, max_depth=3)
    want = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 3, 4}, {0, 2, 5}]
    assert [set(row.nonzero().view(-1).tolist()) for row in mask[0]] == want
    assert depths_of(parents, 3).tolist() == [[0, 1, 1, 2, 3, 2]]
    chain = chain_parents(2, 4, torch.device("cpu"))
    assert torch.equal(ancestor_mask(chain, 3)[1], torch.ones(4, 4, dtype=torch.bool).tril())
    hidden = torch.arange(12.0)[:, None]  # 2 requests x 6 nodes
    path = torch.tensor([[0, 1, 3, -1], [0, 2, 5, 4]])
    assert path_rows(hidden, path, 6).view(-1).tolist() == [0, 1, 3, 0, 6, 8, 11, 10]


@pytest.mark.parametrize("topk, depth, nodes", [(1, 3, 4), (2, 3, 6), (3, 4, 12), (4, 2, 21)])
def test_expansion_keeps_the_best_paths_closed_under_parents(topk, depth, nodes) -> None:
    """The tree holds the N - 1 candidates of highest path probability (brute force over the
    candidate list), every node's parent is in it, and depths follow the parents.
    """
    gen = torch.Generator().manual_seed(topk * 10 + depth)
    b, vocab = 3, 9
    logp = torch.randn(b, vocab, generator=gen).log_softmax(-1)
    tree = TreeExpansion(*logp.topk(topk, dim=-1), depth)
    for _ in range(depth - 1):
        child = torch.randn(b * topk, vocab, generator=gen).log_softmax(-1)
        tree.expand(*child.topk(topk, dim=-1))
    out = tree.select(nodes, depth)
    shape = TreeShape(depth, topk, nodes)
    assert out.parents.shape == (b, shape.num_nodes) and out.tokens.shape == (b, nodes - 1)
    scores, _, cand_parents = tree.candidates
    assert tree.num_candidates == scores.shape[1] == topk + (depth - 1) * topk**2
    for r in range(b):
        parents = out.parents[r].tolist()
        assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
        best = set(scores[r].topk(nodes - 1).indices.tolist())
        chosen = sorted(best)
        for i, c in enumerate(chosen, start=1):
            p = int(cand_parents[r, c])
            assert parents[i] == (0 if p < 0 else chosen.index(p) + 1)
    assert torch.equal(out.depths, depths_of(out.parents, depth))
    if topk > 1:
        assert torch.equal(out.mask, ancestor_mask(out.parents, depth))
    if topk == 1:
        assert out.parents.tolist() == chain_parents(b, nodes, out.parents.device).tolist()


@pytest.mark.parametrize(
    ("page_size", "seq", "n", "width", "splits"),
    [(4, [13, 40], 4, 4, 3), (1, [9, 30, 17], 6, 6, 2), (16, [70], 3, 9, 4), (4, [8, 25], 5, 5, 1)],
)
def test_tree_decode_attention_matches_reference(page_size, seq, n, width, splits) -> None:
    """Random masks over the last ``width`` keys (``width > n``: a draft level's beams over the
    tree so far), with the prefix keys always seen."""
    gen = torch.Generator().manual_seed(page_size + n + width)
    h, kv, d = 4, 2, 16
    page_table = _page_table(seq, page_size, gen)
    k_cache, v_cache = _cache(page_table.numel() * page_size, kv, d, gen)
    q = torch.randn(len(seq) * n, h, d, generator=gen).to(DEVICE)
    mask = (torch.rand(len(seq), n, width, generator=gen) < 0.5).to(DEVICE)
    mask[:, torch.arange(n), width - n + torch.arange(n)] = True  # each query sees itself
    out, ref = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    args = (page_table, _lens(seq), page_size, d**-0.5)
    decode_attention(
        q, k_cache, v_cache, out, *args, splits, tokens_per_seq=n, tree_mask=mask, block_n=16
    )
    decode_attention_ref(q, k_cache, v_cache, ref, *args, tokens_per_seq=n, tree_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    causal = torch.full_like(q, float("nan"))
    decode_attention_ref(q, k_cache, v_cache, causal, *args, tokens_per_seq=n)
    assert not torch.allclose(out, causal, atol=1e-3)  # the mask matters


def test_decode_attention_rejects_a_bad_tree_mask() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _cache(16, 2, 16, gen)
    q = torch.randn(4, 4, 16, generator=gen).to(DEVICE)
    table, lens = _lens([[0, 1, 2, 3]]), _lens([10])
    for bad in (torch.ones(1, 3, 4, dtype=torch.bool), torch.ones(1, 4, 4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="tree_mask must be"):
            decode_attention(
                q,
                k_cache,
                v_cache,
                torch.empty_like(q),
                table,
                lens,
                4,
                1.0,
                2,
                tokens_per_seq=4,
                tree_mask=bad.to(DEVICE),
            )


def _tree_batch(reqs: list[tuple[int, int]], parents: torch.Tensor, gen: torch.Generator):
    batch = _batch(ForwardMode.TARGET_VERIFY, reqs, 0, gen)
    n = reqs[0][1]
    mask = ancestor_mask(parents, n - 1).to(DEVICE)
    return dataclasses.replace(batch, tree_mask=mask, spec_num_draft_tokens=n)


def test_triton_backend_matches_torch_backend_on_trees() -> None:
    gen = torch.Generator().manual_seed(5)
    oracle, triton_backend = _backends(gen)
    reqs, n = [(21, 6), (3, 6), (50, 6)], 6
    batch = _tree_batch(reqs, random_parents(3, n, gen), gen)
    t = batch.num_tokens
    qkv = [
        tuple(torch.randn(t, *s, generator=gen).to(DEVICE) for s in ((6, 32), (2, 32), (2, 32)))
        for _ in range(2)
    ]
    want = _run(oracle, batch, qkv)
    got = _run(triton_backend, batch, qkv)
    assert triton_backend.metadata.tree_mask is not None
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_tree_verify_equals_verifying_each_path_on_its_own() -> None:
    """Every node of a tree pass sees what the same tokens laid out as its root-to-node chain
    (a causal pass) see: the attention outputs agree row by row."""
    gen = torch.Generator().manual_seed(9)
    oracle, _ = _backends(gen)
    prefix, n = 11, 7
    parents = random_parents(1, n, gen)
    tree = _tree_batch([(prefix, n)], parents, gen)
    qkv = [
        tuple(torch.randn(n, *s, generator=gen).to(DEVICE) for s in ((6, 32), (2, 32), (2, 32)))
        for _ in range(2)
    ]
    tree_out = _run(oracle, tree, qkv)
    for node in range(n):
        path, cur = [], node
        while cur >= 0:
            path.append(cur)
            cur = int(parents[0, cur])
        path = path[::-1]
        chain = _batch(ForwardMode.TARGET_VERIFY, [(prefix, len(path))], 0, gen)
        chain = dataclasses.replace(chain, page_table=tree.page_table)
        chain = dataclasses.replace(chain, out_cache_loc=tree.out_cache_loc[: len(path)])
        rows = torch.tensor(path, device=DEVICE)
        chain_out = _run(oracle, chain, [tuple(x[rows] for x in layer) for layer in qkv])
        for t_out, c_out in zip(tree_out, chain_out):
            torch.testing.assert_close(t_out[node], c_out[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_tree_verify_equals_each_path_verified_alone(tmp_path, backend) -> None:
    """A tiny Llama's TARGET_VERIFY pass over a random tree (nodes at their depths' positions,
    under the tree mask) gives every node the logits that verifying its root-to-node path as a
    chain gives its last row."""
    from test_decode_graphs import tiny_runner
    from test_models import tiny_hf_model

    from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch

    tiny_hf_model("LlamaConfig").save_pretrained(tmp_path)
    runner = tiny_runner(tmp_path, attention_backend=backend, disable_piecewise_cuda_graph=True)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(1, 256, (13,), generator=gen).tolist()
    pages, page, n = list(range(8)), runner.page_size, 7
    start = len(prompt) - 1
    prefill = build_forward_batch(
        ForwardMode.EXTEND, [SeqChunk(prompt[:-1], 0, pages)], page, "cpu"
    )
    parents = random_parents(1, n, gen)
    tokens = torch.randint(1, 256, (n - 1,), generator=gen).tolist()
    depths = depths_of(parents, n - 1)[0]

    def verify(ids: list[int], tree: bool) -> torch.Tensor:
        chunk = SeqChunk(ids, start, pages)
        batch = build_forward_batch(
            ForwardMode.TARGET_VERIFY,
            [chunk],
            page,
            "cpu",
            logits_rows=range(len(ids)),
            spec_num_draft_tokens=len(ids),
        )
        if tree:
            batch = dataclasses.replace(
                batch, positions=start + depths, tree_mask=ancestor_mask(parents, n - 1)
            )
        with torch.inference_mode():
            return runner.forward(batch).logits

    with torch.inference_mode():
        runner.forward(prefill)
    tree_logits = verify([prompt[-1], *tokens], tree=True)
    for node in range(n):
        path, cur = [], node
        while cur > 0:
            path.append(cur)
            cur = int(parents[0, cur])
        chain = verify([prompt[-1], *(tokens[i - 1] for i in path[::-1])], tree=False)
        torch.testing.assert_close(tree_logits[node], chain[-1], atol=1e-4, rtol=1e-4)
