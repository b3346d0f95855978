"""Tree verification (``verify_draft_tokens(parents=...)``): the Triton kernel against the torch
reference on random trees, the greedy walk against brute force over root-to-leaf paths, a chain
given as a tree against the chain rule, and sampled output that keeps the target distribution
(chi-square over many seeded trials, and a wrong rule caught by the same test).
"""

from __future__ import annotations

import pytest
import torch
from test_spec_distribution import P_MIN, P_WRONG, START, TARGET, V, _chi_square_p, _seeds
from test_tree_attention import chain_parents, depths_of

from pcgspec.kernels.verify_draft_tokens import (
    VerifyStrategy,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)

GREEDY, MATCH = VerifyStrategy.GREEDY, VerifyStrategy.TARGET_MATCH
SHAPE = [-1, 0, 0, 1, 1, 2, 3, 6]  # depth 4: the root's two children, a long branch


def _random_trees(b: int, n: int, vocab: int, gen: torch.Generator):
    """Random parents (node i's parent among 0..i-1) and tokens, siblings distinct."""
    parents = torch.full((b, n), -1, dtype=torch.int64)
    tokens = torch.zeros(b, n, dtype=torch.int64)
    for r in range(b):
        for i in range(1, n):
            parents[r, i] = int(torch.randint(0, i, (), generator=gen))
        for p in range(n):
            kids = (parents[r] == p).nonzero().view(-1)
            tokens[r, kids] = torch.randperm(vocab, generator=gen)[: len(kids)]
    return parents, tokens[:, 1:].contiguous()


def _target_rows(parents: torch.Tensor, drafts: torch.Tensor, vocab: int, gen: torch.Generator):
    """Random rows, each peaked (mostly) at the token of one of its node's children, so that
    walks go deep."""
    b, n = parents.shape
    logits = torch.randn(b, n, vocab, generator=gen)
    for r in range(b):
        for i in range(n):
            kids = (parents[r] == i).nonzero().view(-1)
            if len(kids) and float(torch.rand((), generator=gen)) < 0.8:
                kid = kids[int(torch.randint(0, len(kids), (), generator=gen))]
                logits[r, i, drafts[r, kid - 1]] += 4.0
    return logits.softmax(-1)


@pytest.mark.parametrize("b, n, vocab", [(5, 6, 16), (3, 9, 40), (2, 4, 7)])
def test_kernel_matches_reference_on_random_trees(b, n, vocab) -> None:
    gen = torch.Generator().manual_seed(b * 100 + n)
    parents, drafts = _random_trees(b, n, vocab, gen)
    depth = int(depths_of(parents, n).max())
    probs = _target_rows(parents, drafts, vocab, gen)
    seed = torch.randint(0, 1 << 30, (b, 1), generator=gen).expand(b, n).contiguous()
    position = 10 + depths_of(parents, n)
    num = torch.full((b,), n - 1, dtype=torch.int64)
    num[0] = n // 2  # fewer drafts: the later nodes are never accepted
    greedy = torch.rand(b, generator=gen) < 0.4
    cases = [
        (GREEDY, {}),
        (MATCH, dict(seed=seed, position=position)),
        (MATCH, dict(seed=seed, position=position, is_greedy=greedy, num_draft=num)),
    ]
    deepest = 0
    for strategy, kw in cases:
        want = verify_draft_tokens_ref(
            probs, drafts, strategy, parents=parents, max_depth=depth, **kw
        )
        got = verify_draft_tokens(probs, drafts, strategy, parents=parents, max_depth=depth, **kw)
        assert torch.equal(got.accept_len, want.accept_len)
        assert torch.equal(got.tokens, want.tokens)
        assert torch.equal(got.path, want.path)
        deepest = max(deepest, int(want.accept_len.max()))
    assert deepest >= 2  # deep walks were exercised


def test_greedy_walk_is_the_longest_matching_root_path() -> None:
    """Brute force: over every root-to-node path, the longest whose tokens are each the
    target argmax after the previous node."""
    gen = torch.Generator().manual_seed(3)
    b, n, vocab = 12, 8, 12
    parents, drafts = _random_trees(b, n, vocab, gen)
    probs = _target_rows(parents, drafts, vocab, gen)
    depth = int(depths_of(parents, n).max())
    out = verify_draft_tokens(probs, drafts, GREEDY, parents=parents, max_depth=depth)
    argmax = probs.argmax(-1)
    for r in range(b):
        best: list[int] = [0]
        for node in range(1, n):
            path, cur = [], node
            while cur > 0:
                path.append(cur)
                cur = int(parents[r, cur])
            path = [0, *path[::-1]]
            if all(int(drafts[r, c - 1]) == int(argmax[r, p]) for p, c in zip(path, path[1:])):
                best = max(best, path, key=len)
        a = len(best) - 1
        assert int(out.accept_len[r]) == a
        assert out.path[r, : a + 1].tolist() == best
        want = [int(drafts[r, c - 1]) for c in best[1:]] + [int(argmax[r, best[-1]])]
        assert out.tokens[r, : a + 1].tolist() == want
        assert (out.tokens[r, a + 1 :] == -1).all() and (out.path[r, a + 1 :] == -1).all()


def test_a_chain_given_as_a_tree_verifies_like_a_chain() -> None:
    gen = torch.Generator().manual_seed(4)
    b, k, vocab = 6, 4, 10
    drafts = torch.randint(0, vocab, (b, k), generator=gen)
    probs = _target_rows(chain_parents(b, k + 1, torch.device("cpu")), drafts, vocab, gen)
    seed = torch.randint(0, 1 << 30, (b, k + 1), generator=gen)
    position = torch.arange(k + 1).expand(b, -1) + 3
    chain = chain_parents(b, k + 1, torch.device("cpu"))
    for strategy in (GREEDY, MATCH):
        kw = {} if strategy == GREEDY else dict(seed=seed, position=position)
        want = verify_draft_tokens(probs, drafts, strategy, **kw)
        got = verify_draft_tokens(probs, drafts, strategy, parents=chain, max_depth=k, **kw)
        assert torch.equal(got.accept_len, want.accept_len)
        assert torch.equal(got.tokens, want.tokens)
        path = torch.where(torch.arange(k + 1) <= want.accept_len[:, None], torch.arange(k + 1), -1)
        assert torch.equal(got.path, path)


def test_trees_are_checked() -> None:
    probs = torch.rand(1, 4, 5)
    drafts = torch.zeros(1, 3, dtype=torch.int64)
    parents = torch.tensor([[-1, 0, 0, 1]])
    with pytest.raises(ValueError, match="max_depth must be in 1..3"):
        verify_draft_tokens(probs, drafts, GREEDY, parents=parents)
    with pytest.raises(ValueError, match="not REJECTION"):
        verify_draft_tokens(
            probs,
            drafts,
            VerifyStrategy.REJECTION,
            parents=parents,
            max_depth=2,
            draft_probs=torch.rand(1, 3, 5),
            seed=torch.zeros(1, 4, dtype=torch.int64),
            position=torch.zeros(1, 4, dtype=torch.int64),
        )
    with pytest.raises(ValueError, match="parents must be"):
        verify_draft_tokens(probs, drafts, GREEDY, parents=parents[:, :3], max_depth=2)


# --- sampled trees keep the target distribution -------------------------------------------


def _draft_tree_tokens(last: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``[T, N-1]`` drafts on the fixed SHAPE: a node's children are distinct tokens drawn
    without replacement from a draft distribution after their parent's token."""
    draft = torch.softmax(torch.randn(V, V, generator=gen), -1)  # a fresh drafter per step
    tokens = torch.zeros(len(last), len(SHAPE), dtype=torch.int64)
    tokens[:, 0] = last
    for p in range(len(SHAPE)):
        kids = [i for i, q in enumerate(SHAPE) if q == p]
        if kids:
            picked = torch.multinomial(draft[tokens[:, p]], len(kids), generator=gen)
            tokens[:, kids] = picked
    return tokens[:, 1:]


def _tree_generate(num_tokens: int, verify=verify_draft_tokens_ref) -> torch.Tensor:
    """``[TRIALS, num_tokens]`` tokens after START by repeated tree-draft-then-verify steps."""
    gen = torch.Generator().manual_seed(11)
    seed = _seeds()
    trials = len(seed)
    parents = torch.tensor(SHAPE).expand(trials, -1).contiguous()
    depths = depths_of(parents, len(SHAPE))
    depth = int(depths.max())
    out = torch.full((trials, num_tokens), -1, dtype=torch.int64)
    emitted = torch.zeros(trials, dtype=torch.int64)
    last = torch.full((trials,), START, dtype=torch.int64)
    cols = torch.arange(depth + 1)
    while int(emitted.min()) < num_tokens:
        drafts = _draft_tree_tokens(last, gen)
        context = torch.cat([last[:, None], drafts], dim=1)  # node tokens
        result = verify(
            TARGET[context],
            drafts,
            MATCH,
            seed=seed[:, None].expand(-1, len(SHAPE)),
            position=emitted[:, None] + depths,
            parents=parents,
            max_depth=depth,
        )
        position = emitted[:, None] + cols
        new = (cols <= result.accept_len[:, None]) & (position < num_tokens)
        out[torch.nonzero(new)[:, 0], position[new]] = result.tokens[new]
        last = result.tokens.gather(1, result.accept_len[:, None]).squeeze(1)
        emitted += result.accept_len + 1
    return out


def _p_values(tokens: torch.Tensor) -> tuple[float, float]:
    joint = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    exact_joint = TARGET[START][:, None] * TARGET
    marginal = torch.bincount(tokens[:, 4], minlength=V)
    exact_marginal = torch.linalg.matrix_power(TARGET.double(), 5)[START]
    return _chi_square_p(joint, exact_joint), _chi_square_p(marginal, exact_marginal)


def test_sampled_trees_keep_the_target_distribution() -> None:
    tokens = _tree_generate(5)
    assert min(_p_values(tokens)) > P_MIN


def test_a_wrong_tree_rule_is_detected() -> None:
    """Drawing every node's candidate at the same output position (the depth ignored) makes
    the draws along a path dependent: caught."""

    def same_position(*args, position, **kw):
        return verify_draft_tokens_ref(*args, position=position * 0 + position[:, :1], **kw)

    tokens = _tree_generate(5, verify=same_position)
    assert min(_p_values(tokens)) < P_WRONG
