"""Speculative verification is lossless: on the torch reference path, a speculative generation
emits tokens from exactly the target distribution (chi-square over many seeded trials), and a
deliberately wrong rule is caught by the same test.

Target and draft are tiny table-driven "models": the next-token distribution is a fixed
function of the previous token (an 8x8 transition matrix), different for target and draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from scipy import stats

from pcgspec.kernels import verify_draft_tokens as vdt
from pcgspec.kernels.verify_draft_tokens import VerifyStrategy, verify_draft_tokens_ref
from pcgspec.sampling.rng import STREAM_TOKEN, uniform
from pcgspec.sampling.sampler import sample_from_probs

V, K, TRIALS, START = 8, 3, 50_000, 5
P_MIN = 1e-3  # a correct rule passes above this p-value
P_WRONG = 1e-6  # a wrong rule fails below it


def _transition(seed: int, temperature: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=gen) * 1.5 / temperature, dim=-1)


TARGET = _transition(0, temperature=0.8)  # TARGET[a] = p(next | previous a)
DRAFT = _transition(1, temperature=1.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """The tensors are small ([50k, 8]): intra-op threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _seeds() -> torch.Tensor:
    return torch.arange(TRIALS, dtype=torch.int64) * 7919 + 12345  # one distinct seed per trial


def _speculative_generate(strategy: VerifyStrategy, num_tokens: int) -> torch.Tensor:
    """``[TRIALS, num_tokens]`` tokens after START, one seeded trial per row, by repeated
    draft-k-then-verify steps, all trials batched."""
    gen = torch.Generator().manual_seed(7)
    seed = _seeds()
    out = torch.full((TRIALS, num_tokens), -1, dtype=torch.int64)
    emitted = torch.zeros(TRIALS, dtype=torch.int64)
    last = torch.full((TRIALS,), START, dtype=torch.int64)
    rows = torch.arange(K + 1)
    while int(emitted.min()) < num_tokens:
        drafts, prev = [], last
        for _ in range(K):  # d_j ~ q(. | d_{j-1})
            prev = torch.multinomial(DRAFT[prev], 1, generator=gen).squeeze(1)
            drafts.append(prev)
        draft = torch.stack(drafts, dim=1)  # [T, K]
        context = torch.cat([last[:, None], draft], dim=1)  # [T, K+1]
        position = emitted[:, None] + rows  # row j chooses output token emitted + j
        result = verify_draft_tokens_ref(
            TARGET[context],
            draft,
            strategy,
            draft_probs=DRAFT[context[:, :K]],
            seed=seed[:, None].expand(-1, K + 1),
            position=position,
        )
        _check_output_layout(result.tokens, result.accept_len, draft)
        new = (rows < result.accept_len[:, None] + 1) & (position < num_tokens)
        out[torch.nonzero(new)[:, 0], position[new]] = result.tokens[new]
        last = result.tokens.gather(1, result.accept_len[:, None]).squeeze(1)
        emitted += result.accept_len + 1
    return out


def _check_output_layout(tokens: torch.Tensor, accept_len: torch.Tensor, draft: torch.Tensor):
    rows = torch.arange(K + 1)
    accepted = rows[:K] < accept_len[:, None]
    assert torch.equal(tokens[:, :K][accepted], draft[accepted])
    assert (tokens.gather(1, accept_len[:, None]) >= 0).all()
    assert (tokens[rows > accept_len[:, None]] == -1).all()


def _chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against exact probabilities; cells expecting < 5 are pooled."""
    expected = probs.double().flatten() / probs.double().sum() * observed.sum()
    observed = observed.double().flatten()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(stats.chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def _distribution_p_values(tokens: torch.Tensor) -> tuple[float, float]:
    """p-values of (first two tokens jointly, token number K+1) vs the exact target chain."""
    joint = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    exact_joint = TARGET[START][:, None] * TARGET  # p(y1) p(y2 | y1)
    marginal = torch.bincount(tokens[:, K], minlength=V)
    exact_marginal = torch.linalg.matrix_power(TARGET.double(), K + 1)[START]
    return _chi_square_p(joint, exact_joint), _chi_square_p(marginal, exact_marginal)


def test_rejection_output_follows_target() -> None:
    p_joint, p_marginal = _distribution_p_values(
        _speculative_generate(VerifyStrategy.REJECTION, K + 1)
    )
    assert p_joint >= P_MIN and p_marginal >= P_MIN, (p_joint, p_marginal)


def test_target_match_is_plain_seeded_sampling() -> None:
    tokens = _speculative_generate(VerifyStrategy.TARGET_MATCH, K + 1)
    p_joint, p_marginal = _distribution_p_values(tokens)
    assert p_joint >= P_MIN and p_marginal >= P_MIN, (p_joint, p_marginal)
    seed = _seeds()
    prev = torch.full((TRIALS,), START, dtype=torch.int64)
    for t in range(K + 1):  # non-speculative decoding: one seeded draw per output position
        u = uniform(seed, torch.full_like(seed, t), STREAM_TOKEN)
        prev = sample_from_probs(TARGET[prev], u)
        assert torch.equal(tokens[:, t], prev)


def test_greedy_emits_the_target_argmax_chain() -> None:
    tokens = _speculative_generate(VerifyStrategy.GREEDY, K + 2)
    chain, prev = [], START
    for _ in range(K + 2):
        prev = int(TARGET[prev].argmax())
        chain.append(prev)
    assert (tokens == torch.tensor(chain)).all()


_WRONG_RULES: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    "accept with min(1, q/p)": ("_accept_test", lambda u, p_d, q_d: u * p_d < q_d),
    "resample from p, not the residual": ("_residual", lambda p, q: p),
}


@pytest.mark.parametrize("rule", list(_WRONG_RULES))
def test_wrong_rejection_rule_is_detected(rule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vdt, *_WRONG_RULES[rule])
    p_joint, p_marginal = _distribution_p_values(
        _speculative_generate(VerifyStrategy.REJECTION, K + 1)
    )
    assert min(p_joint, p_marginal) < P_WRONG, (p_joint, p_marginal)
