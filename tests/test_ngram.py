"""NGRAM drafting against two references (a plain Python search and the earlier vectorized
suffix match over the whole history), incrementally as requests grow, and SpeculativeConfig
validation.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.ngram import NgramProposer

_PAD = -1  # left padding of the right-aligned batch; never equals a token id


def right_align(
    token_ids: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str
) -> torch.Tensor:
    """Reference only. Per-request token lists -> ``[B, max_len]`` int64, right-aligned,
    left-padded with -1.
    """
    width = max((len(t) for t in token_ids), default=0)
    out = torch.full((len(token_ids), width), _PAD, dtype=torch.int64, device=device)
    for row, ids in zip(out, token_ids):
        if len(ids):
            row[width - len(ids) :] = torch.as_tensor(ids, dtype=torch.int64)
    return out


def suffix_match_lengths(tokens: torch.Tensor, max_window: int) -> torch.Tensor:
    """Reference only. ``[B, N]`` right-aligned -> ``[B, N-1]``: at end position e, the length
    (<= max_window) of the longest common suffix of ``tokens[:, :e+1]`` and the whole sequence.
    """
    b, n = tokens.shape
    padded = F.pad(tokens, (max_window, 0), value=_PAD)  # token x sits at column x + max_window
    run = torch.zeros(b, n - 1, dtype=torch.int32, device=tokens.device)
    alive = (tokens[:, n - 1 :] != _PAD).expand(b, n - 1).clone()  # an empty row matches nothing
    for d in range(min(max_window, n - 1)):
        earlier = padded[:, max_window - d : max_window - d + n - 1]  # tokens[:, e - d]
        alive &= earlier == tokens[:, n - 1 - d : n - d]  # vs tokens[:, N-1-d]
        run += alive
    # NOTE: a window reaches the left padding before the suffix does (e < N-1), and padding
    # never equals a token, so no match extends past the start of a sequence.
    return run


def ngram_propose(
    tokens: torch.Tensor, num_steps: int, min_window: int, max_window: int
) -> DraftProposal:
    """Reference only (the full-history scan ``NgramProposer`` replaced): drafts for
    right-aligned ``tokens`` [B, N], the longest suffix match in [min_window, max_window], its
    latest earlier occurrence, the (up to) ``num_steps`` tokens after it.
    """
    b, n = tokens.shape
    device = tokens.device
    steps = torch.arange(num_steps, device=device)
    if n < 2:
        return DraftProposal(torch.full((b, num_steps), FILLER_TOKEN, device=device),
                             torch.zeros(b, dtype=torch.int64, device=device))  # fmt: skip
    run = suffix_match_lengths(tokens, max_window)  # [B, N-1]
    best = run.amax(dim=1)  # [B] longest earlier match of the suffix
    ends = torch.arange(n - 1, device=device)
    last_end = torch.where(run >= best[:, None], ends, -1).amax(dim=1)  # latest such occurrence
    num = (n - 1 - last_end).clamp_max(num_steps)  # tokens that follow it, at most k
    num = torch.where(best >= min_window, num, 0)
    follow = (last_end[:, None] + 1 + steps).clamp_max(n - 1)  # [B, k]
    drafts = torch.where(steps < num[:, None], tokens.gather(1, follow), FILLER_TOKEN)
    return DraftProposal(drafts, num)


def _ngram_ref(seq: list[int], k: int, min_window: int, max_window: int) -> list[int]:
    """Longest suffix first, then its latest earlier occurrence; the tokens after it."""
    n = len(seq)
    for w in range(min(max_window, n - 1), min_window - 1, -1):
        for start in range(n - w - 1, -1, -1):  # occurrences ending before the last token
            if seq[start : start + w] == seq[n - w :]:
                return seq[start + w : start + w + k]
    return []


def _proposed(proposal: DraftProposal) -> list[list[int]]:
    num = proposal.num_tokens.tolist()
    assert proposal.num_tokens_host in (None, num)
    assert (proposal.tokens[torch.arange(proposal.num_steps) >= proposal.num_tokens[:, None]]
            == FILLER_TOKEN).all()  # fmt: skip
    return [row[:n] for row, n in zip(proposal.tokens.tolist(), num)]


@pytest.mark.parametrize("k, min_window, max_window", [(1, 1, 12), (3, 1, 3), (4, 2, 5), (2, 3, 3)])
def test_ngram_matches_python_reference(k: int, min_window: int, max_window: int) -> None:
    rng = random.Random(k * 100 + min_window * 10 + max_window)
    seqs = []
    for _ in range(40):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat n-grams often
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        if seq and rng.random() < 0.5:  # splice in an earlier chunk: a long match
            a = rng.randrange(len(seq))
            seq += seq[a : a + rng.randrange(1, 8)]
        seqs.append(seq)
    proposer = NgramProposer(k, min_window, max_window)
    proposal = proposer.propose(ProposeInput(seqs))
    assert proposal.tokens.shape == (len(seqs), k) and proposal.probs is None
    assert proposal.num_tokens_host == proposal.num_tokens.tolist()
    assert _proposed(proposal) == [_ngram_ref(s, k, min_window, max_window) for s in seqs]
    ref = ngram_propose(right_align(seqs, "cpu"), k, min_window, max_window)
    assert torch.equal(proposal.tokens, ref.tokens)
    assert torch.equal(proposal.num_tokens, ref.num_tokens)


def _propose(seq: list[int], k: int = 3, min_window: int = 1, max_window: int = 4) -> list[int]:
    drafts = _proposed(NgramProposer(k, min_window, max_window).propose(ProposeInput([seq])))[0]
    ref = _proposed(ngram_propose(right_align([seq], "cpu"), k, min_window, max_window))[0]
    assert drafts == ref == _ngram_ref(seq, k, min_window, max_window)
    return drafts


def test_ngram_without_match_proposes_nothing() -> None:
    assert _propose([1, 2, 3, 4, 5]) == []
    assert _propose([]) == [] and _propose([7]) == []
    assert _propose([1, 2, 9, 1, 2], min_window=3) == []  # "1 2" matches, but is too short


def test_ngram_prefers_longest_match_then_latest_occurrence() -> None:
    # suffix "1 2": the 2-gram occurs at 0 (followed by 7) and at 5 (followed by 8); the 1-gram
    # "2" last occurs at 9 (followed by 4), but the longer match wins; of it, the latest.
    seq = [1, 2, 7, 7, 7, 1, 2, 8, 6, 2, 4, 1, 2]
    assert _propose(seq) == [8, 6, 2]
    assert _propose(seq, max_window=1) == [4, 1, 2]  # window capped at 1: latest "2"
    assert _propose([5, 6, 1, 2, 3, 9, 6, 1, 2, 3], max_window=3) == [9, 6, 1]
    assert _propose([5, 6, 1, 2, 3, 9, 6, 1, 2, 3], max_window=2) == [9, 6, 1]


def test_ngram_proposes_fewer_near_the_end() -> None:
    assert _propose([4, 4, 4], k=3) == [4]  # "4 4" last occurred at 0, one token follows it
    assert _propose([1, 2, 1, 2], k=4) == [1, 2]


def test_ngram_batches_ragged_requests_on_device_of_choice() -> None:
    seqs = [torch.tensor([3, 1, 3]), [9], [5, 6, 5, 6, 5]]
    proposal = NgramProposer(2, max_window=3).propose(ProposeInput(seqs))
    assert _proposed(proposal) == [[1, 3], [], [6, 5]]
    assert proposal.num_tokens.tolist() == [2, 0, 2]


class _Req:
    """Stands in for the engine's Request: the proposer keys its per-request index by it."""

    def __init__(self, tokens: list[int]) -> None:
        self.token_ids = tokens


def _grow(rng: random.Random, seq: list[int], vocab: int, k: int) -> None:
    """Append what a step could: a few tokens (accepted drafts + one), now and then a copy of an
    earlier chunk (a long match) or a long run (the bulk indexing path).
    """
    r = rng.random()
    if seq and r < 0.3:
        a = rng.randrange(len(seq))
        seq += seq[a : a + rng.randrange(1, k + 2)]
    elif r < 0.33:
        seq += [rng.randrange(vocab) for _ in range(rng.randrange(60, 140))]
    else:
        seq += [rng.randrange(vocab) for _ in range(rng.randrange(1, k + 2))]


@pytest.mark.parametrize("k, min_window, max_window", [
    (1, 1, 12), (3, 1, 3), (4, 2, 5), (2, 3, 3), (5, 1, 1), (3, 4, 8),
])  # fmt: skip
def test_ngram_incremental_index_matches_full_scan(
    k: int, min_window: int, max_window: int
) -> None:
    rng = random.Random(1000 * k + 10 * min_window + max_window)
    proposer = NgramProposer(k, min_window, max_window)
    reqs = [_Req([rng.randrange(v) for _ in range(rng.randrange(0, 150))])
            for v in (2, 3, 4, 5, 8, 50)]  # fmt: skip
    vocab = {id(r): v for r, v in zip(reqs, (2, 3, 4, 5, 8, 50))}
    num_drafted = 0
    for _ in range(60):
        batch = [r for r in reqs if rng.random() < 0.8]  # not every request runs every step
        proposal = proposer.propose(ProposeInput([r.token_ids for r in batch], batch))
        ref = ngram_propose(right_align([r.token_ids for r in batch], "cpu"), k, min_window,
                            max_window)  # fmt: skip
        assert torch.equal(proposal.tokens, ref.tokens)
        assert torch.equal(proposal.num_tokens, ref.num_tokens)
        assert proposal.num_tokens_host == ref.num_tokens.tolist()
        num_drafted += sum(proposal.num_tokens_host)
        for r in batch:
            _grow(rng, r.token_ids, vocab[id(r)], k)
    assert num_drafted > 0


def test_ngram_index_rebuilds_when_the_tokens_are_not_a_continuation() -> None:
    proposer, req = NgramProposer(2, 1, 3), _Req([1, 2, 3, 1, 2])
    assert _proposed(proposer.propose(ProposeInput([req.token_ids], [req]))) == [[3, 1]]
    req.token_ids = [4, 5, 4]  # shorter: "1 2" must be forgotten
    assert _proposed(proposer.propose(ProposeInput([req.token_ids], [req]))) == [[5, 4]]
    req.token_ids = [7, 8, 9, 7]  # as long, last seen token changed
    assert _proposed(proposer.propose(ProposeInput([req.token_ids], [req]))) == [[8, 9]]
    req.token_ids = [7, 8, 9, 6, 5]  # longer, but not a continuation of [7, 8, 9, 7]
    assert _proposed(proposer.propose(ProposeInput([req.token_ids], [req]))) == [[]]


def test_ngram_index_goes_with_its_request() -> None:
    proposer, req = NgramProposer(2), _Req([1, 2, 1])
    proposer.propose(ProposeInput([req.token_ids], [req]))
    assert len(proposer._indexes) == 1
    del req
    gc.collect()
    assert len(proposer._indexes) == 0


def test_speculative_config_defaults_and_normalization() -> None:
    cfg = SpeculativeConfig("ngram")
    assert cfg.algorithm == "NGRAM" and cfg.num_steps == 3
    assert cfg.speculative_num_draft_tokens == 4
    assert cfg.speculative_ngram_min_match_window_size == 1
    assert cfg.speculative_ngram_max_match_window_size == 12
    assert NgramProposer.from_config(cfg).max_window == 12
    nextn = SpeculativeConfig.from_kwargs(speculative_algorithm="NextN", speculative_num_steps=2)
    assert nextn.speculative_num_draft_tokens == 3 and nextn.draft_model_path("/m") == "/m"
    eagle = SpeculativeConfig("EAGLE3", speculative_draft_model_path="/d")
    assert eagle.draft_model_path("/m") == "/d"


@pytest.mark.parametrize("kwargs, field", [
    (dict(speculative_algorithm="medusa"), "speculative_algorithm"),
    (dict(speculative_algorithm=None), "speculative_algorithm"),
    (dict(speculative_algorithm="STANDALONE"), "speculative_draft_model_path"),
    (dict(speculative_algorithm="eagle3", speculative_draft_model_path=""),
     "speculative_draft_model_path"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/d"),
     "speculative_draft_model_path"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "speculative_num_steps"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=True), "speculative_num_steps"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3),
     "speculative_num_draft_tokens"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=0), "speculative_eagle_topk"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=0),
     "speculative_ngram_min_match_window_size"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=4,
          speculative_ngram_max_match_window_size=3), "speculative_ngram_max_match_window_size"),
    (dict(speculative_algorithm="NGRAM", speculative_num_step=3), "speculative_num_step"),
])  # fmt: skip
def test_speculative_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_kwargs(**kwargs)


def test_speculative_config_messages_name_the_value() -> None:
    with pytest.raises(ValueError, match="EAGLE3, NEXTN, STANDALONE, NGRAM, got 'medusa'"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="tree drafting, not supported yet, got 4"):
        SpeculativeConfig("NEXTN", speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    with pytest.raises(ValueError, match="= 3 with speculative_eagle_topk 1, got 5"):
        SpeculativeConfig("NGRAM", speculative_num_steps=2, speculative_num_draft_tokens=5)
