"""NGRAM drafting against a plain Python oracle, and SpeculativeConfig validation."""

from __future__ import annotations

import random

import pytest
import torch

from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.ngram import NgramProposer, ngram_propose, right_align


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
    assert _proposed(proposal) == [_ngram_ref(s, k, min_window, max_window) for s in seqs]


def _propose(seq: list[int], k: int = 3, min_window: int = 1, max_window: int = 4) -> list[int]:
    return _proposed(ngram_propose(right_align([seq], "cpu"), k, min_window, max_window))[0]


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
