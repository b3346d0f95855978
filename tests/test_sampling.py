"""Sampling: the counter-based RNG, SamplingBatch, penalties, filters, draws and logprobs."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy import stats

from pcgspec.sampling import (
    SamplingBatch,
    apply_penalties,
    hash32,
    process_logits,
    sample,
    sample_from_probs,
    uniform,
)
from pcgspec.sampling_params import SamplingParams

P_MIN = 1e-3  # statistical tests pass above this p-value


def _mix_ref(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & m
    x ^= x >> 15
    x = (x * 0x735A2D97) & m
    return x ^ (x >> 15)


def _hash_ref(seed: int, position: int, stream: int) -> int:
    """The rng docstring, step by step, on Python ints: the oracle for the Triton port."""
    seed &= 2**64 - 1
    h = _mix_ref((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _mix_ref(h ^ (seed >> 32))
    h = _mix_ref(h ^ stream)
    return _mix_ref(h ^ (position & 0xFFFFFFFF))


def _batch(
    params: Sequence[SamplingParams],
    vocab: int,
    seeds: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else [0] * n,
        positions if positions is not None else [0] * n,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        vocab,
        "cpu",
    )


def _tokens(logits: torch.Tensor, params: Sequence[SamplingParams], **kw: object) -> list[int]:
    return sample(logits, _batch(params, logits.shape[-1], **kw)).tokens.tolist()


# --- rng ---------------------------------------------------------------------------------------


def test_uniform_matches_reference_and_is_deterministic() -> None:
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789012345]
    positions = [0, 1, 7, 2**31 + 5, 2**32 + 3, 99]
    seed_t, pos_t = torch.tensor(seeds), torch.tensor(positions)
    for stream in (0, 1, 2):
        expected = [_hash_ref(s, p, stream) for s, p in zip(seeds, positions)]
        assert hash32(seed_t, pos_t, stream).tolist() == expected
        u = uniform(seed_t, pos_t, stream)
        assert u.dtype == torch.float32
        assert u.tolist() == [((h >> 9) + 0.5) * 2.0**-23 for h in expected]
        assert torch.equal(u, uniform(seed_t.clone(), pos_t.clone(), torch.tensor(stream)))
    assert not torch.equal(uniform(seed_t, pos_t, 0), uniform(seed_t, pos_t, 1))


def test_uniform_is_in_open_interval_and_uniform() -> None:
    pos = torch.arange(10_000)
    for seed in (0, 42, -7):
        u = uniform(torch.full_like(pos, seed), pos)
        assert 0.0 < u.min() and u.max() < 1.0
        assert stats.kstest(u.double().numpy(), "uniform").pvalue > P_MIN
    # extreme hashes map strictly inside (0, 1)
    edges = ((torch.tensor([0, 2**32 - 1]) >> 9).float() + 0.5) * 2.0**-23
    assert edges[0] > 0 and edges[1] < 1


def test_uniform_streams_and_seeds_are_uncorrelated() -> None:
    pos = torch.arange(10_000)
    seed = torch.full_like(pos, 5)
    a, b = uniform(seed, pos, 0).double().numpy(), uniform(seed, pos, 1).double().numpy()
    c = uniform(seed + 1, pos, 0).double().numpy()
    for x, y in ((a, b), (a, c), (a[:-1], a[1:])):
        assert stats.pearsonr(x, y).pvalue > P_MIN


# --- batch -------------------------------------------------------------------------------------


def test_build_skips_penalty_tensors_and_normalizes_greedy_rows() -> None:
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.5), SamplingParams(logprobs=4)]
    sb = _batch(params, 10)
    assert sb.output_counts is None and sb.prompt_mask is None
    assert sb.top_k.tolist() == [10, 10] and sb.top_p.tolist() == [1.0, 1.0]
    assert sb.is_greedy.tolist() == [True, False]
    assert (sb.all_greedy, sb.needs_filters, sb.rank_depth, sb.max_logprobs) == (
        False,
        False,
        0,
        4,
    )
    sb = _batch([SamplingParams(frequency_penalty=1.0, min_p=0.1)], 10, outputs=[[3, 3, 9]])
    assert sb.prompt_mask is None and sb.output_counts.tolist() == [[0, 0, 0, 2] + [0] * 5 + [1]]
    assert (sb.needs_filters, sb.rank_depth) == (True, 0)
    top_k_rows = [SamplingParams(top_k=4), SamplingParams(top_k=7, min_p=0.1)]
    assert _batch(top_k_rows, 10).rank_depth == 7
    assert _batch([*top_k_rows, SamplingParams(top_p=0.9)], 10).rank_depth == 10
    with pytest.raises(ValueError, match="token ids"):
        _batch([SamplingParams(presence_penalty=1.0)], 10, outputs=[[10]])
    with pytest.raises(ValueError, match="positions"):
        SamplingBatch.build([SamplingParams()], [0], [], [[]], [[]], 10, "cpu")


# --- penalties ---------------------------------------------------------------------------------


def test_penalties_match_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 12, 5
    logits = torch.randn(rows, vocab, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        SamplingParams(),
        SamplingParams(temperature=0, repetition_penalty=1.7, presence_penalty=2.0),
    ]
    prompts = [[random.Random(r).randrange(vocab) for _ in range(6)] for r in range(rows)]
    outputs = [[random.Random(10 + r).randrange(vocab) for _ in range(7)] for r in range(rows)]
    got = apply_penalties(logits, _batch(params, vocab, prompts=prompts, outputs=outputs))
    expected = logits.clone()
    for r, p in enumerate(params):
        for t in range(vocab):
            x, count = expected[r, t].item(), outputs[r].count(t)
            if t in prompts[r] or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            expected[r, t] = x - p.frequency_penalty * count - p.presence_penalty * (count > 0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(got, logits)


# --- filters -----------------------------------------------------------------------------------

_PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]  # sums to 1, no ties


@pytest.mark.parametrize(
    ("kwargs", "kept"),
    [
        ({}, 10),
        ({"top_k": 3}, 3),
        ({"top_k": 50}, 10),
        ({"top_p": 0.6}, 3),  # mass before the 4th is 0.65 >= 0.6
        ({"top_p": 0.66}, 4),
        ({"top_k": 2, "top_p": 0.55}, 1),  # renormalized over the top 2: 0.6, 0.4
        ({"top_k": 2, "top_p": 0.65}, 2),
        ({"min_p": 0.4}, 3),  # p >= 0.12
        ({"min_p": 0.2, "top_k": 5}, 5),  # p >= 0.06 keeps 6, top-k keeps 5
        ({"min_p": 0.2, "top_p": 0.45}, 2),
    ],
)
def test_filters_keep_exact_support(kwargs: dict[str, float], kept: int) -> None:
    perm = torch.randperm(len(_PROBS), generator=torch.Generator().manual_seed(1))
    logits = torch.empty(len(_PROBS))
    logits[perm] = torch.tensor(_PROBS).log()
    rows = [SamplingParams(**kwargs), SamplingParams(temperature=0, top_k=1)]
    sb = _batch(rows, len(_PROBS))
    processed = process_logits(logits.expand(2, -1), sb)
    assert set(torch.nonzero(processed[0].isfinite()).flatten().tolist()) == set(
        perm[:kept].tolist()
    )
    assert processed[1].isfinite().all()  # greedy rows are never filtered
    # a row's cut does not depend on how deep the other rows make the ranking
    wide = _batch([rows[0], SamplingParams(top_p=0.99), SamplingParams(top_k=9)], len(_PROBS))
    assert wide.rank_depth == len(_PROBS)
    assert torch.equal(process_logits(logits.expand(3, -1), wide)[0], processed[0])


def test_process_logits_keeps_input_and_greedy_argmax() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    original = logits.clone()
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=5, top_p=0.8, min_p=0.1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1e-6, frequency_penalty=1.0),
    ]
    outputs = [[int(original[0].argmax())], [], [], [int(original[3].argmax())] * 3]
    sb = _batch(params, 50, outputs=outputs, prompts=[[1, 2]] * 4)
    processed = process_logits(logits, sb)
    assert torch.equal(logits, original)
    penalized = apply_penalties(logits, sb)
    greedy = [0, 2, 3]
    assert torch.equal(processed[greedy], penalized[greedy])  # greedy rows are not scaled
    tokens = sample(logits, sb).tokens
    assert torch.equal(tokens[greedy], penalized[greedy].argmax(-1))
    assert tokens[0] != original[0].argmax() and tokens[3] != original[3].argmax()


@pytest.mark.parametrize(
    "kwargs", [{"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.5}, {"top_p": 0.5, "top_k": 3}, {}]
)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_overflowing_repetition_penalty_keeps_the_seen_tokens(
    kwargs: dict[str, float], temperature: float
) -> None:
    """A valid but tiny penalty divides positive logits past float32's range: the row must
    still keep a token (the penalized seen ones) and leave the other rows as they are alone."""
    logits = torch.linspace(-10.0, 10.0, 50).repeat(3, 1)
    seen, boosted = [1, 7, 40, 45, 48], {40, 45, 48}  # the seen tokens with positive logits
    odd = SamplingParams(temperature=temperature, repetition_penalty=1.2e-38, **kwargs)
    others = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0)]
    tokens = _tokens(logits, [others[0], odd, others[1]], seeds=[1, 2, 3], prompts=[seen] * 3)
    assert tokens[1] in boosted
    assert tokens[::2] == _tokens(logits[:2], others, seeds=[1, 3], prompts=[seen] * 2)


def test_a_nan_row_keeps_the_other_rows() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_p=0.8), SamplingParams(top_p=0.5, top_k=4), SamplingParams()]
    alone = _tokens(logits, params, seeds=[1, 2, 3])
    logits[1, 5] = math.nan
    tokens = _tokens(logits, params, seeds=[1, 2, 3])
    assert tokens[0] == alone[0] and tokens[2] == alone[2]
    assert 0 <= tokens[1] < 40


# --- draws -------------------------------------------------------------------------------------


def test_seeded_row_is_batch_independent() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 64
    target = SamplingParams(temperature=0.9, top_p=0.95, seed=123)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_k=4, min_p=0.05),
        SamplingParams(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.randn(1 + len(others), vocab, generator=gen)
    for position in range(16):
        alone = _tokens(logits[:1], [target], seeds=[123], positions=[position])
        order = [0, 1, 2, 3, 4]
        random.Random(position).shuffle(order)
        params = [target, *others]
        batched = _tokens(
            logits[order],
            [params[i] for i in order],
            seeds=[123 if i == 0 else 1000 + position + i for i in order],
            positions=[position if i == 0 else 3 * i for i in order],
            outputs=[[5, 6, 6]] * 5,
            prompts=[[1, 2]] * 5,
        )
        assert batched[order.index(0)] == alone[0]


def test_different_seeds_and_positions_differ() -> None:
    logits = torch.zeros(32, 64)
    params = [SamplingParams()] * 32
    a = _tokens(logits, params, seeds=[1] * 32, positions=range(32))
    assert a == _tokens(logits, params, seeds=[1] * 32, positions=range(32))
    assert a != _tokens(logits, params, seeds=[2] * 32, positions=range(32))
    assert len(set(a)) > 10


def test_greedy_rows_ignore_seed() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0, seed=s) for s in range(8)]
    expected = logits.argmax(-1).tolist()
    assert _tokens(logits, params, seeds=range(8)) == expected
    assert _tokens(logits, params, seeds=range(100, 108), positions=range(8)) == expected


def test_sample_from_probs_skips_zero_weight_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 2.0, 0.0, 0.0]])
    lo, hi = torch.full((2,), 2.0**-24), torch.full((2,), 1 - 2.0**-24)
    assert sample_from_probs(probs, lo).tolist() == [1, 2]
    assert sample_from_probs(probs, hi).tolist() == [3, 2]
    assert sample_from_probs(probs, torch.full((2,), 0.5)).tolist() == [3, 2]


def _expected_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """softmax(logits / T) restricted by top-k, then top-p, then min-p, renormalized."""
    p = np.exp(logits / temperature - (logits / temperature).max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, dtype=bool)
    keep[order[:top_k]] = True
    q = np.where(keep, p, 0) / p[keep].sum()
    mass_before = np.cumsum(q[order]) - q[order]
    keep[order[mass_before >= top_p]] = False
    keep &= p >= min_p * p.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(0.8, -1, 1.0, 0.0), (0.7, 7, 0.9, 0.0), (1.5, -1, 1.0, 0.2), (1.2, 6, 0.9, 0.3)],
)
def test_sampled_frequencies_match_target(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    vocab, rows = 8, 20_000
    logits = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.5, 0.8, 1.6, -0.2])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    sb = _batch([params] * rows, vocab, seeds=[17] * rows, positions=range(rows))
    counts = np.bincount(sample(logits.expand(rows, -1), sb).tokens.numpy(), minlength=vocab)
    k = vocab if top_k < 0 else top_k

    def p_value(t: float) -> float:
        expected = _expected_probs(logits.double().numpy(), t, k, top_p, min_p)
        support = expected > 0
        if counts[~support].any():
            return 0.0
        return stats.chisquare(counts[support], expected[support] * rows).pvalue

    assert p_value(temperature) >= P_MIN
    assert p_value(temperature * 1.25) < 1e-6


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 2
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.8, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=2.0, presence_penalty=1.0),
    ]
    out = sample(logits, _batch(params, 40, seeds=[1, 2, 3], outputs=[[0, 1]] * 3))
    raw = torch.log_softmax(logits, dim=-1)
    top = raw.topk(5, dim=-1)
    assert out.logprobs is not None
    assert torch.equal(out.logprobs.top_ids, top.indices)
    torch.testing.assert_close(out.logprobs.top_logprobs, top.values)
    torch.testing.assert_close(
        out.logprobs.token_logprobs, raw.gather(1, out.tokens[:, None])[:, 0]
    )
    assert sample(logits, _batch([SamplingParams()] * 3, 40)).logprobs is None


# --- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", 1e39),
        ("top_p", 0.0),
        ("top_p", 1e-300),
        ("top_p", 5e-324),
        ("top_p", 1.5),
        ("top_k", 0),
        ("top_k", -2),
        ("max_tokens", 0),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", 1e39),
        ("presence_penalty", 2.5),
        ("logprobs", -1),
    ],
)
def test_sampling_params_rejects_invalid(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"{field}.*{re.escape(repr(value))}"):
        SamplingParams(**{field: value})


def test_sampling_params_rejects_unknown_keyword() -> None:
    with pytest.raises(ValueError, match="bogus=1"):
        SamplingParams.from_kwargs(bogus=1)
    assert SamplingParams.from_kwargs(temperature=0.5).temperature == 0.5
