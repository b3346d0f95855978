"""``SamplingSlots`` == ``SamplingBatch.build`` (the host reference) over random parameter mixes,
plain and verify rows, after device commits, slot reuse and re-admission; slot lifecycle in the
engine (finishes, aborts, preemptions)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

import pytest
import torch
from oracle import assert_pool_whole

from pcgspec.sampling import SamplingBatch, sample
from pcgspec.sampling.slots import SLOT_INDEX_CACHE, SamplingSlots
from pcgspec.sampling_params import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 40


@dataclass(eq=False)
class _Req:
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def _params(rng: random.Random) -> SamplingParams:
    penalties = rng.random() < 0.5
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.3]),
        top_k=rng.choice([-1, 1, 5, VOCAB + 3]),
        top_p=rng.choice([1.0, 0.8]),
        min_p=rng.choice([0.0, 0.1]),
        repetition_penalty=rng.choice([1.0, 1.3]) if penalties else 1.0,
        presence_penalty=rng.choice([0.0, 0.5]) if penalties else 0.0,
        frequency_penalty=rng.choice([0.0, 0.2]) if penalties else 0.0,
        logprobs=rng.choice([None, None, 2]),
    )


def _request(rng: random.Random) -> _Req:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
    outputs = [rng.randrange(VOCAB) for _ in range(rng.choice([0, 0, 3]))]  # 3: preempted
    return _Req(_params(rng), rng.randrange(-(2**63), 2**64), prompt, outputs)


def _reference(reqs: list[_Req], drafts: torch.Tensor | None = None) -> SamplingBatch:
    """k+1 rows per request with drafts (row j has seen drafts[:j]), else one."""
    k1 = 1 if drafts is None else drafts.shape[1] + 1
    extra = [[]] * len(reqs) if drafts is None else drafts.tolist()
    rows = [(r, j, e) for r, e in zip(reqs, extra) for j in range(k1)]
    return SamplingBatch.build(
        [r.params for r, _, _ in rows],
        [r.seed for r, _, _ in rows],
        [len(r.output_token_ids) + j for r, j, _ in rows],
        [r.prompt_token_ids for r, _, _ in rows],
        [r.output_token_ids + e[:j] for r, j, e in rows],
        VOCAB,
        DEVICE,
    )


def _assert_same(got: SamplingBatch, want: SamplingBatch) -> None:
    for f in fields(SamplingBatch):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and torch.equal(g, w), f.name
        else:
            assert g == w, f.name


def _commit(slots: SamplingSlots, reqs: list[_Req], rng: random.Random, k: int) -> None:
    """Emit 1..k+1 random tokens per request (the rest -1, as the verify kernel writes)."""
    n = [rng.randint(1, k + 1) for _ in reqs]
    tokens = [[rng.randrange(VOCAB) if j < m else -1 for j in range(k + 1)] for m in n]
    slots.commit(reqs, torch.tensor(tokens, device=DEVICE), torch.tensor(n, device=DEVICE))
    for req, row, m in zip(reqs, tokens, n):
        req.output_token_ids += row[:m]


def _admitted(
    rng: random.Random, num_slots: int, num_reqs: int, triton: bool
) -> tuple[SamplingSlots, list[_Req]]:
    slots = SamplingSlots(num_slots, VOCAB, DEVICE, triton=triton)
    reqs = [_request(rng) for _ in range(num_reqs)]
    slots.admit(reqs[0])
    slots.admit(*reqs)  # the rest in one upload per table (as a prefill step admits a wave)
    return slots, reqs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("triton", [False, True])
def test_rows_match_host_reference_through_commits_and_reuse(seed: int, triton: bool) -> None:
    _check_rows_through_commits(seed, triton)


@pytest.mark.gpu
def test_rows_on_cuda_match_host_reference() -> None:
    """On the device the rows are gathered into aligned views of wider buffers and verify rows
    come from the Triton kernel: the same rows as the host reference."""
    for seed in range(2):
        _check_rows_through_commits(seed, triton=True)


def _check_rows_through_commits(seed: int, triton: bool) -> None:
    rng = random.Random(seed)
    slots, reqs = _admitted(rng, 10, 7, triton)
    k = 3
    for step in range(5):
        _assert_same(slots.rows(reqs), _reference(reqs))
        drafts = torch.randint(0, VOCAB, (len(reqs), k), device=DEVICE)
        _assert_same(slots.rows(reqs, drafts), _reference(reqs, drafts))
        _commit(slots, reqs, rng, k if step % 2 else 0)
        gone = reqs.pop(rng.randrange(len(reqs)))
        slots.free(gone)
        reqs.insert(rng.randrange(len(reqs) + 1), _request(rng))  # may reuse gone's slot
        slots.admit(*reqs)  # the held ones keep their rows
    _assert_same(slots.rows(reqs[::-1]), _reference(reqs[::-1]))


@pytest.mark.parametrize("triton", [False, True])
def test_a_steady_batch_reuses_its_rows_until_a_slot_is_rewritten(triton: bool) -> None:
    rng = random.Random(7)
    slots, reqs = _admitted(rng, 4, 3, triton)
    k = 2
    for step in range(4):
        first = slots.rows(reqs)
        _assert_same(slots.rows(reqs), _reference(reqs))
        assert slots.rows(reqs).temperature.data_ptr() == first.temperature.data_ptr()  # reused
        drafts = torch.randint(0, VOCAB, (len(reqs), k), device=DEVICE)
        _assert_same(slots.rows(reqs, drafts), _reference(reqs, drafts))
        _commit(slots, reqs, rng, k)  # the reused rows must re-read the advanced positions
        if step == 1:  # the same request back in the same slot, with other parameters
            slot = slots.slot(reqs[1])
            slots.free(reqs[1])
            reqs[1].params = SamplingParams(temperature=0.5, top_k=3, seed=1)
            slots.admit(reqs[1])
            assert slots.slot(reqs[1]) == slot


def test_slot_lists_stay_on_the_device_for_the_last_few() -> None:
    """``slot_indices`` uploads a list once while it is one of the last ``SLOT_INDEX_CACHE``
    uploaded (a mixed step indexes its sampled rows, its decode rows, then its sampled rows
    again); an older one is uploaded anew, with the same values."""
    rng = random.Random(3)
    slots, reqs = _admitted(rng, 8, 6, triton=False)
    lists = [reqs[: i + 1] for i in range(SLOT_INDEX_CACHE + 1)]
    first = [slots.slot_indices(r) for r in lists[:SLOT_INDEX_CACHE]]
    kept = [slots.slot_indices(r) for r in lists[:SLOT_INDEX_CACHE]]
    assert all(a is b for a, b in zip(kept, first))  # the same tensors, nothing uploaded
    slots.slot_indices(lists[-1])  # one more: the oldest is dropped
    again = slots.slot_indices(lists[0])
    assert again is not first[0] and again.tolist() == [slots.slot(r) for r in lists[0]]
    assert slots.slot_indices(lists[2]) is first[2]


@pytest.mark.parametrize("triton", [False, True])
def test_rollback_undoes_the_newest_commit(triton: bool) -> None:
    """A failed step's commit rolled back: positions, last tokens and penalty counts are those
    before it (the rows equal the host reference of the requests as they were), for the
    committed requests only; the token history is the same up to each request's length.
    """
    rng = random.Random(3)
    slots = SamplingSlots(6, VOCAB, DEVICE, triton=triton, history_len=32)
    reqs = [_request(rng) for _ in range(4)]
    reqs[0].params = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.2)
    slots.admit(*reqs)
    _commit(slots, reqs, rng, 2)
    before = (
        [list(r.output_token_ids) for r in reqs],
        slots.last_tokens(reqs).clone(),
        slots.token_history.clone(),
        slots.output_counts.clone(),
    )
    mark = slots.checkpoint()
    slots.rollback(mark)  # nothing committed since: a no-op
    _commit(slots, reqs[1:3] + reqs[:1], rng, 3)
    slots.rollback(mark)
    for req, outputs in zip(reqs, before[0]):
        req.output_token_ids = outputs
    _assert_same(slots.rows(reqs), _reference(reqs))
    assert torch.equal(slots.last_tokens(reqs), before[1])
    assert torch.equal(slots.output_counts, before[3])
    lens = slots.seq_lens(reqs).tolist()
    for b, n in enumerate(lens):
        slot = slots.slot(reqs[b])
        assert torch.equal(slots.token_history[slot, :n], before[2][slot, :n])
    _commit(slots, reqs, rng, 1)
    _commit(slots, reqs, rng, 1)
    with pytest.raises(RuntimeError, match="2 commits"):
        slots.rollback(mark)


def test_seeded_rows_do_not_depend_on_slot_or_batch() -> None:
    params = SamplingParams(temperature=0.8, seed=5)
    alone, other = _Req(params, 5, [1, 2]), _Req(SamplingParams(temperature=1.0), 9, [3])
    a, b = SamplingSlots(4, VOCAB, DEVICE), SamplingSlots(4, VOCAB, DEVICE)
    a.admit(alone)
    b.admit(other)
    b.admit(alone)
    assert a.slot(alone) != b.slot(alone)
    logits = torch.randn(1, VOCAB, device=DEVICE).expand(2, VOCAB)
    for _ in range(3):
        got_a = sample(logits[:1], a.rows([alone])).tokens
        got_b = sample(logits, b.rows([other, alone])).tokens
        assert got_a.item() == got_b[1].item()
        a.commit([alone], got_a[:, None], torch.ones_like(got_a))
        b.commit([other, alone], got_b[:, None], torch.ones_like(got_b))
    assert a.table.position[a.slot(alone)].item() == 3


def test_lifecycle_and_lazy_penalty_tables() -> None:
    slots = SamplingSlots(2, VOCAB, DEVICE)
    plain = _Req(SamplingParams(), 0, [1])
    penalized = _Req(SamplingParams(presence_penalty=1.0), 0, [2])
    slots.admit(plain)
    slots.admit(plain)  # idempotent while held
    assert slots.num_free == 1 and slots.output_counts is None
    assert slots.rows([plain]).output_counts is None
    slots.admit(penalized)
    assert slots.output_counts is not None and slots.output_counts.shape == (2, VOCAB)
    assert slots.rows([plain]).output_counts is None  # no penalty row in this batch
    with pytest.raises(RuntimeError, match="all 2 sampling slots"):
        slots.admit(_Req(SamplingParams(), 0, [3]))
    slots.free(plain)
    with pytest.raises(RuntimeError, match="all 2 sampling slots"):  # all or none
        slots.admit(plain, _Req(SamplingParams(), 0, [3]))
    assert slots.num_free == 1 and slots.slot(plain) is None
    slots.free(plain)  # idempotent once freed
    with pytest.raises(ValueError, match="without a sampling slot"):
        slots.rows([plain])
    slots.free(penalized)
    assert slots.num_free == 2
    with pytest.raises(ValueError, match="num_slots"):
        SamplingSlots(0, VOCAB, DEVICE)


# --- in the engine -----------------------------------------------------------------------------


def _engine_params() -> list[SamplingParams]:
    common = dict(max_tokens=12, ignore_eos=True)
    return [
        SamplingParams(temperature=0, repetition_penalty=1.3, **common),
        SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.5, seed=11, **common),
        SamplingParams(temperature=0.8, top_k=20, seed=12, **common),
        SamplingParams(temperature=0, presence_penalty=0.8, **common),
    ]


def _check_slots(engine) -> None:
    """Slot holders are exactly the requests holding pages, each at its output count."""
    sched, slots = engine.scheduler, engine.slots
    holders = [r for r in (*sched.running, *sched.waiting) if r.pages]
    assert slots.num_slots - slots.num_free == len(holders)
    for req in holders:
        assert slots.table.position[slots.slot(req)].item() == req.num_output_tokens


def test_engine_slots_through_finishes_aborts_and_preemptions(smollm2_path) -> None:
    from oracle import PROMPTS

    from pcgspec import LLM

    # 12 pages of 4 tokens: alone a request fits, 3 running ones growing to ~20 tokens do not.
    llm = LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        page_size=4,
        max_total_tokens=48,
        max_running_requests=3,
        disable_piecewise_cuda_graph=True,
    )
    engine, tok, params = llm.engine, llm.get_tokenizer(), _engine_params()
    want = [llm.generate(p, sp, use_tqdm=False)[0].token_ids for p, sp in zip(PROMPTS[:4], params)]
    assert engine.scheduler.num_preemptions == 0
    reqs = [engine.add_request(tok.encode(p), sp)[0] for p, sp in zip(PROMPTS[:4], params)]
    engine.add_request(tok.encode(PROMPTS[5]), params[1], request_id="aborted")
    for step in range(200):
        if not engine.has_unfinished:
            break
        engine.step()
        _check_slots(engine)
        if step == 3:
            assert engine.abort("aborted")
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in reqs] == want
    assert engine.slots.num_free == engine.slots.num_slots
    assert_pool_whole(engine)


@pytest.mark.gpu
def test_rows_and_commit_never_sync_with_the_host() -> None:
    rng = random.Random(0)
    slots = SamplingSlots(8, VOCAB, "cuda", history_len=32)  # commit appends to the history
    reqs = [_request(rng) for _ in range(6)]
    for req in reqs:
        slots.admit(req)
    drafts = torch.randint(0, VOCAB, (6, 3), device="cuda")
    tokens = torch.randint(0, VOCAB, (6, 4), device="cuda")
    num_emitted = torch.randint(1, 5, (6,), device="cuda")
    slots.rows(reqs)  # the first call may load kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        slots.rows(reqs)
        slots.rows(reqs, drafts)
        slots.commit(reqs, tokens, num_emitted)
        slots.seq_lens(reqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.float32])
def test_host_tensor_equals_torch_tensor(dtype: torch.dtype) -> None:
    """The upload path's list -> tensor (through ``array``) gives what ``torch.tensor`` does,
    the full int64 range (seeds) and the empty list included."""
    from pcgspec.runners.batch_builder import host_tensor

    rng = random.Random(0)
    if dtype is torch.int64:
        values = [-(2**63), 2**63 - 1, *(rng.randrange(-(2**63), 2**63) for _ in range(50))]
    elif dtype is torch.int32:
        values = [-(2**31), 2**31 - 1, *(rng.randrange(-(2**31), 2**31) for _ in range(50))]
    else:
        values = [0.1, -3.5, 1e-30, 7, *(rng.uniform(-1e3, 1e3) for _ in range(50))]
    got = host_tensor(values, dtype, pin=False)
    assert got.dtype == dtype and torch.equal(got, torch.tensor(values, dtype=dtype))
    empty = host_tensor([], dtype, pin=False)
    assert empty.dtype == dtype and empty.shape == (0,)
