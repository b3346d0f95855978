"""NGRAM drafting on the device: the Triton kernel (under the interpreter on CPU) and its torch
reference against a plain Python search, on random and adversarial sequences; the token history
that ``SamplingSlots`` keeps for it against each request's host tokens, through plain and verify
commits, re-admission and slot reuse, and in the engine through preemptions; and
SpeculativeConfig validation.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from oracle import PROMPTS
from test_sampling_slots import _Req

from pcgspec.kernels.ngram_propose import ngram_propose, ngram_propose_ref
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.sampling_params import SamplingParams
from pcgspec.speculative.base import FILLER_TOKEN, ProposeInput
from pcgspec.speculative.config import SpeculativeConfig
from pcgspec.speculative.ngram import NgramProposer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SEARCHES = [ngram_propose, ngram_propose_ref]
Search = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _ngram_ref(seq: list[int], k: int, min_window: int, max_window: int) -> list[int]:
    """Longest suffix first, then its latest earlier occurrence; the tokens after it."""
    n = len(seq)
    for w in range(min(max_window, n - 1), min_window - 1, -1):
        for start in range(n - w - 1, -1, -1):  # occurrences ending before the last token
            if seq[start : start + w] == seq[n - w :]:
                return seq[start + w : start + w + k]
    return []


def _drafts(drafts: torch.Tensor, counts: torch.Tensor, k: int) -> list[list[int]]:
    """Per request the proposed tokens, after checking the outputs' form and padding."""
    assert drafts.shape == (counts.shape[0], k) and drafts.dtype == counts.dtype == torch.int64
    pad = torch.arange(k, device=drafts.device) >= counts[:, None]
    assert (drafts[pad] == FILLER_TOKEN).all()
    return [row[:n] for row, n in zip(drafts.tolist(), counts.tolist())]


def _search(
    search: Search,
    seqs: list[list[int]],
    k: int,
    min_window: int,
    max_window: int,
    history_len: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """``search`` over ``seqs`` laid into shuffled rows of a history table (with a spill
    column, as ``SamplingSlots`` keeps it) whose entries past each length hold junk tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    width = history_len or max((len(s) for s in seqs), default=0) + 5
    num_rows = len(seqs) + 2
    table = torch.randint(0, 4, (num_rows, width + 1), generator=gen, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=gen)[: len(seqs)]
    for row, seq in zip(rows.tolist(), seqs):
        table[row, : len(seq)] = torch.tensor(seq, dtype=torch.int32)
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    history = table.to(DEVICE)[:, :width]
    return _drafts(
        *search(history, rows.to(DEVICE), lengths.to(DEVICE), k, min_window, max_window), k
    )


def _random_seqs(rng: random.Random, count: int, max_len: int) -> list[list[int]]:
    seqs = []
    for _ in range(count):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat n-grams often
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(0, max_len))]
        if seq and rng.random() < 0.5:  # splice in an earlier chunk: a long match
            a = rng.randrange(len(seq))
            seq += seq[a : a + rng.randrange(1, 20)]
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize(
    "k, min_window, max_window",
    [
        (1, 1, 12),
        (3, 1, 3),
        (4, 2, 5),
        (2, 3, 3),
        (5, 1, 1),
        (3, 4, 8),
        (2, 1, 20),
    ],
)
def test_search_matches_python_reference(
    search: Search, k: int, min_window: int, max_window: int
) -> None:
    rng = random.Random(1000 * k + 10 * min_window + max_window)
    seqs = _random_seqs(rng, 30, 40)
    # Longer than a kernel block (256 ends): the match may lie blocks before the end.
    seqs += [
        s + [rng.randrange(1000, 2000) for _ in range(rng.randrange(250, 700))] + s[:8]
        for s in _random_seqs(rng, 4, 30)
    ]
    got = _search(search, seqs, k, min_window, max_window, seed=k)
    assert got == [_ngram_ref(s, k, min_window, max_window) for s in seqs]
    assert sum(map(len, got)) > 0


def _propose(
    seq: list[int],
    k: int = 3,
    min_window: int = 1,
    max_window: int = 4,
    history_len: int | None = None,
) -> list[int]:
    want = _ngram_ref(seq, k, min_window, max_window)
    for search in SEARCHES:
        assert _search(search, [seq], k, min_window, max_window, history_len) == [want], search
    return want


def test_search_without_match_proposes_nothing() -> None:
    assert _propose([1, 2, 3, 4, 5]) == []
    assert _propose([]) == [] and _propose([7]) == [] and _propose([7, 8]) == []
    assert _propose([1, 2, 9, 1, 2], min_window=3) == []  # "1 2" matches, but is too short
    assert _propose([1, 2, 9, 1, 2], min_window=2) == [9, 1, 2]


def test_search_matches_at_the_very_start() -> None:
    assert _propose([7, 7]) == [7]  # n = 2: the end e = 0
    assert _propose([5, 1, 2, 3, 5]) == [1, 2, 3]
    assert _propose([5, 6, 1, 2, 3, 4, 5, 6], min_window=2) == [1, 2, 3]


def test_search_prefers_longest_match_then_latest_occurrence() -> None:
    # suffix "1 2": the 2-gram occurs at 0 (followed by 7) and at 5 (followed by 8); the 1-gram
    # "2" last occurs at 9 (followed by 4), but the longer match wins; of it, the latest.
    seq = [1, 2, 7, 7, 7, 1, 2, 8, 6, 2, 4, 1, 2]
    assert _propose(seq) == [8, 6, 2]
    assert _propose(seq, max_window=1) == [4, 1, 2]  # window capped at 1: latest "2"
    assert _propose([5, 6, 1, 2, 3, 9, 6, 1, 2, 3], max_window=3) == [9, 6, 1]
    assert _propose([5, 6, 1, 2, 3, 9, 6, 1, 2, 3], max_window=2) == [9, 6, 1]
    # A capped match (4 of 5 tokens) near the end beats a longer one further back.
    assert _propose([9, 1, 2, 3, 4, 5, 8, 6, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]) == [7, 1, 2]


def test_search_proposes_fewer_near_the_end_and_on_repeats() -> None:
    assert _propose([4, 4, 4], k=3) == [4]  # "4 4" last occurred at 0, one token follows it
    assert _propose([1, 2, 1, 2], k=4) == [1, 2]
    assert _propose([4] * 30, k=3) == [4]  # every end matches: the latest capped one
    assert _propose([1, 2] * 15 + [1], k=5, max_window=12) == [2, 1]


def test_search_reads_a_full_row_and_nothing_past_it() -> None:
    # The spill column past a full row holds junk (0..3): a draft read past the end shows it.
    assert _propose([6] * 10, k=4, history_len=10) == [6]
    assert _propose([7, 8, 9, 7, 8], k=4, history_len=5) == [9, 7, 8]


def test_search_checks_inputs() -> None:
    history = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for search in SEARCHES:
        with pytest.raises(ValueError, match="min_window"):
            search(history, slots, slots, 2, 0, 3)
        with pytest.raises(ValueError, match="history must be"):
            search(history.float(), slots, slots, 2, 1, 3)
        with pytest.raises(ValueError, match="lengths must be"):
            search(history, slots, slots[:0], 2, 1, 3)


# The history in the slots ---------------------------------------------------------------------

VOCAB, K = 6, 3


def _request(rng: random.Random) -> _Req:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
    outputs = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 4]))]  # 4: preempted
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.8]), presence_penalty=rng.choice([0.0, 0.5])
    )
    return _Req(params, rng.randrange(2**63), prompt, outputs)


def _commit(
    slots: SamplingSlots, reqs: list[_Req], rng: random.Random, n: int, history_len: int
) -> None:
    """Emit 1..n random tokens per request (the rest -1, as the verify kernel writes); the host
    keeps what fits the history (a request stops at its context length).
    """
    counts = [rng.randint(1, n) for _ in reqs]
    tokens = [[rng.randrange(VOCAB) if j < m else -1 for j in range(n)] for m in counts]
    slots.commit(reqs, torch.tensor(tokens, device=DEVICE), torch.tensor(counts, device=DEVICE))
    for req, row, m in zip(reqs, tokens, counts):
        req.output_token_ids += row[
            : min(m, history_len - len(req.prompt_token_ids) - len(req.output_token_ids))
        ]


def _check_history(slots: SamplingSlots, proposer: NgramProposer, reqs: list[_Req]) -> int:
    """Each request's history row and length equal its host tokens, and the drafts equal the
    Python search over them. Returns the drafted tokens.
    """
    seqs = [r.prompt_token_ids + r.output_token_ids for r in reqs]
    assert slots.seq_lens(reqs).tolist() == [len(s) for s in seqs]
    for req, seq in zip(reqs, seqs):
        assert slots.token_history[slots.slot(req), : len(seq)].tolist() == seq
    proposal = proposer.propose(ProposeInput(reqs, slots.seq_lens(reqs)))
    got = _drafts(proposal.tokens, proposal.num_tokens, K)
    assert got == [_ngram_ref(s, K, proposer.min_window, proposer.max_window) for s in seqs]
    return sum(map(len, got))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("triton", [False, True])
def test_history_follows_commits_readmission_and_slot_reuse(seed: int, triton: bool) -> None:
    rng, history_len = random.Random(seed), 40
    slots = SamplingSlots(8, VOCAB, DEVICE, triton=triton, history_len=history_len)
    proposer = NgramProposer(slots, K, min_window=1, max_window=3)
    reqs = [_request(rng) for _ in range(6)]
    for req in reqs:
        slots.admit(req)
    drafted = 0
    for step in range(12):
        drafted += _check_history(slots, proposer, reqs)
        _commit(slots, reqs, rng, 1 if step % 3 == 0 else K + 1, history_len)  # plain / verify
        full = [
            r
            for r in reqs
            if len(r.prompt_token_ids) + len(r.output_token_ids) + K + 1 > history_len
        ]
        for req in full:  # at its context length: finished
            reqs.remove(req)
            slots.free(req)
        if step % 4 == 1:  # preempted, re-admitted with its outputs (a slot another may take)
            req = reqs.pop(rng.randrange(len(reqs)))
            slots.free(req)
            reqs.insert(rng.randrange(len(reqs) + 1), req)
        while len(reqs) < 6:
            reqs.insert(rng.randrange(len(reqs) + 1), _request(rng))
        for req in reqs:
            slots.admit(req)
    assert drafted > 0


def test_history_commit_past_the_end_touches_no_other_row() -> None:
    history_len = 8
    slots = SamplingSlots(3, VOCAB, DEVICE, history_len=history_len)
    proposer = NgramProposer(slots, K)
    near_end = _Req(SamplingParams(), 0, [1, 2, 3, 1, 2], [3])  # 7 of 8 tokens
    others = [_Req(SamplingParams(), 0, [5] * 8), _Req(SamplingParams(), 0, [4])]
    for req in [others[0], near_end, others[1]]:  # near_end in the middle row
        slots.admit(req)
    tokens = torch.tensor([[1, 2, 3, 1]], device=DEVICE)  # the last three fall past the end
    slots.commit([near_end], tokens, torch.tensor([4], device=DEVICE))
    assert slots.token_history[slots.slot(near_end)].tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    near_end.output_token_ids.append(1)
    assert _check_history(slots, proposer, others) > 0  # the full row [5] * 8 drafts too
    slots.free(near_end)
    with pytest.raises(ValueError, match="does not fit the token history of 8"):
        slots.admit(_Req(SamplingParams(), 0, [1] * 9))


def test_proposer_needs_a_history() -> None:
    with pytest.raises(ValueError, match="token history"):
        NgramProposer(SamplingSlots(2, VOCAB, DEVICE), K)
    with pytest.raises(ValueError, match="min_window"):
        NgramProposer(SamplingSlots(2, VOCAB, DEVICE, history_len=4), K, 3, 2)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_history_equals_host_tokens_through_preemptions(smollm2_path, overlap) -> None:
    from pcgspec import LLM

    # 12 pages of 4 tokens: 3 requests growing to ~30 tokens with k = 3 verify slots do not fit.
    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=4,
        max_total_tokens=48,
        max_running_requests=3,
        disable_piecewise_cuda_graph=True,
        speculative_algorithm="NGRAM",
        speculative_num_steps=K,
        speculative_policy="always",
        disable_overlap_schedule=not overlap,
    )
    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["a b c a b c a b", "1, 2, 3, 1, 2, 3,", PROMPTS[0], "x y x y x y x"]
    reqs = [engine.add_request(tok.encode(p), params)[0] for p in prompts]
    slots, checked = engine.slots, 0
    for _ in range(300):
        if not engine.has_unfinished:
            break
        engine.step()
        for req in (*engine.scheduler.running, *engine.scheduler.waiting):
            if slots.slot(req) is None:
                continue
            n = len(req.token_ids)
            # pending tokens included: a launched speculative step counts its worst case, k+1
            (seq_len,) = slots.seq_lens([req]).tolist()
            assert n <= seq_len <= req.num_tokens
            assert seq_len == n or req.num_pending_tokens
            assert slots.token_history[slots.slot(req), :n].tolist() == req.token_ids
            checked += 1
    assert all(len(r.output_token_ids) == 20 for r in reqs) and checked > 0
    assert engine.scheduler.num_preemptions > 0
    assert engine.spec_stats()["accepted_draft_tokens"] > 0


def test_speculative_config_defaults_and_normalization() -> None:
    cfg = SpeculativeConfig("ngram")  # prompt lookup's k, measured served: 4; the heads': 3
    assert cfg.algorithm == "NGRAM" and cfg.num_steps == 4
    assert cfg.speculative_num_draft_tokens == 5
    chain = SpeculativeConfig("EAGLE3", speculative_eagle_topk=1)
    assert chain.num_steps == SpeculativeConfig("NextN").num_steps == 3
    assert SpeculativeConfig("NGRAM", speculative_num_steps=2).num_draft_tokens == 3
    assert cfg.speculative_ngram_min_match_window_size == 1
    assert cfg.speculative_ngram_max_match_window_size == 12
    slots = SamplingSlots(1, VOCAB, DEVICE, history_len=4)
    assert NgramProposer.from_config(cfg, slots).max_window == 12
    nextn = SpeculativeConfig.from_kwargs(speculative_algorithm="NextN", speculative_num_steps=2)
    assert nextn.speculative_num_draft_tokens == 3 and nextn.draft_model_path("/m") == "/m"
    eagle = SpeculativeConfig("EAGLE3", speculative_draft_model_path="/d")
    assert eagle.draft_model_path("/m") == "/d"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(speculative_algorithm="medusa"), "speculative_algorithm"),
        (dict(speculative_algorithm=None), "speculative_algorithm"),
        (dict(speculative_algorithm="STANDALONE"), "speculative_draft_model_path"),
        (
            dict(speculative_algorithm="eagle3", speculative_draft_model_path=""),
            "speculative_draft_model_path",
        ),
        (
            dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/d"),
            "speculative_draft_model_path",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=0), "speculative_num_steps"),
        (dict(speculative_algorithm="NGRAM", speculative_num_steps=True), "speculative_num_steps"),
        (
            dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3),
            "speculative_num_draft_tokens",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=0), "speculative_eagle_topk"),
        (
            dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=0),
            "speculative_ngram_min_match_window_size",
        ),
        (
            dict(
                speculative_algorithm="NGRAM",
                speculative_ngram_min_match_window_size=4,
                speculative_ngram_max_match_window_size=3,
            ),
            "speculative_ngram_max_match_window_size",
        ),
        (dict(speculative_algorithm="NGRAM", speculative_num_step=3), "speculative_num_step"),
    ],
)
def test_speculative_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_kwargs(**kwargs)


def test_speculative_config_messages_name_the_value() -> None:
    with pytest.raises(ValueError, match="EAGLE3, NEXTN, STANDALONE, NGRAM, got 'medusa'"):
        SpeculativeConfig("medusa")
    with pytest.raises(ValueError, match="needs one of EAGLE3, NEXTN, not NGRAM, got 2"):
        SpeculativeConfig("NGRAM", speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    with pytest.raises(ValueError, match="not STANDALONE, got 2"):
        SpeculativeConfig("STANDALONE", speculative_draft_model_path="/d", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match=r"in 2\.\.13 .* got 14"):
        SpeculativeConfig(
            "NEXTN",
            speculative_num_steps=2,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=14,
        )
    with pytest.raises(ValueError, match=r"in 2\.\.13 .* got 1"):
        SpeculativeConfig(
            "NEXTN",
            speculative_num_steps=2,
            speculative_eagle_topk=3,
            speculative_num_draft_tokens=1,
        )
    with pytest.raises(ValueError, match=r"in 2\.\.65 .*at most 65 nodes.* got 66"):
        SpeculativeConfig(
            "EAGLE3",
            speculative_num_steps=3,
            speculative_eagle_topk=8,
            speculative_num_draft_tokens=66,
        )
    with pytest.raises(ValueError, match="speculative_eagle_topk must be at most 64, got 65"):
        SpeculativeConfig("EAGLE3", speculative_eagle_topk=65, speculative_num_draft_tokens=4)
    tree = SpeculativeConfig(
        "EAGLE3", speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8
    )
    assert (tree.topk, tree.num_draft_tokens, tree.slots_ahead) == (4, 8, 8)
    assert SpeculativeConfig("NGRAM").slots_ahead == 4


def test_eagle3_default_tree_only_without_shape_options() -> None:
    """EAGLE3 with none of the three shape options drafts the measured 5/4/16 tree; one given
    option keeps the others' own defaults (a chain of 3 unless topk says otherwise)."""

    def shape(spec: SpeculativeConfig) -> tuple[int, int, int]:
        return spec.num_steps, spec.topk, spec.num_draft_tokens

    assert shape(SpeculativeConfig("eagle3")) == (5, 4, 16)
    assert shape(SpeculativeConfig("EAGLE3", speculative_num_steps=3)) == (3, 1, 4)
    assert shape(SpeculativeConfig("EAGLE3", speculative_eagle_topk=1)) == (3, 1, 4)
    assert shape(SpeculativeConfig("EAGLE3", speculative_eagle_topk=2)) == (3, 2, 4)
    assert shape(SpeculativeConfig("NEXTN")) == (3, 1, 4)
    assert shape(SpeculativeConfig("NGRAM")) == (4, 1, 5)
    with pytest.raises(ValueError, match="= 5 with speculative_eagle_topk 1, got 16"):
        SpeculativeConfig("EAGLE3", speculative_num_steps=4, speculative_num_draft_tokens=16)
    with pytest.raises(ValueError, match="= 3 with speculative_eagle_topk 1, got 5"):
        SpeculativeConfig("NGRAM", speculative_num_steps=2, speculative_num_draft_tokens=5)
