"""Speculative-decoding kernels == their torch references, exactly (tokens, lengths, bits).

On CPU the kernels run in the Triton interpreter (tests/conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pcgspec.kernels.build_sampling_params import (
    SamplingTensors,
    advance_positions,
    advance_positions_ref,
    build_sampling_params,
    build_sampling_params_ref,
    rng_uniform,
)
from pcgspec.kernels.sample_tokens import sample_tokens
from pcgspec.kernels.verify_draft_tokens import (
    VerifyStrategy,
    _draw,
    verify_draft_tokens,
    verify_draft_tokens_ref,
)
from pcgspec.sampling import GREEDY_EPS, sample_from_probs
from pcgspec.sampling.rng import STREAM_ACCEPT, STREAM_RESAMPLE, STREAM_TOKEN, uniform

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I64 = dict(dtype=torch.int64, device=DEVICE)


def _int64(n: int, gen: torch.Generator, lo: int = -(2**63), hi: int = 2**63 - 1) -> torch.Tensor:
    return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64).to(DEVICE)


@triton.jit
def _uniform_kernel(Seed, Pos, Out, n, STREAM: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    seed = tl.load(Seed + i, mask=mask, other=0)
    pos = tl.load(Pos + i, mask=mask, other=0)
    tl.store(Out + i, rng_uniform(seed, pos, STREAM), mask=mask)


@pytest.mark.parametrize("stream", [STREAM_TOKEN, STREAM_ACCEPT, STREAM_RESAMPLE, 7, 2**32 - 1])
def test_triton_uniform_is_bit_exact(stream: int) -> None:
    gen = torch.Generator().manual_seed(stream % 1000)
    n = 600
    seed, position = _int64(n, gen), _int64(n, gen, -(2**40), 2**40)
    seed[:5] = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)])
    position[:5] = torch.tensor([0, 1, 2**32, 2**32 + 1, -1])
    got = torch.empty(n, dtype=torch.float32, device=DEVICE)
    _uniform_kernel[(triton.cdiv(n, 256),)](seed, position, got, n, STREAM=stream, BLOCK=256)
    want = uniform(seed, position, stream)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("r, v, block_v", [(1, 8, None), (6, 37, 16), (9, 300, 64), (4, 129, None)])
def test_sample_tokens_matches_the_torch_draw(r: int, v: int, block_v: int | None) -> None:
    """The one-launch draw of a step's rows == ``sample``'s torch path: the argmax of greedy
    rows' logits (ties: the first), a seeded inverse-CDF draw from the others' probabilities
    (zero-weight tokens never drawn)."""
    gen = torch.Generator().manual_seed(r * v)
    logits = torch.randint(-4, 4, (r, v), generator=gen).float()  # ties in the argmax
    probs = _probs((r, v), gen)
    temperature = torch.rand(r, generator=gen) * (torch.rand(r, generator=gen) < 0.6)
    seed, position = _int64(r, gen), _int64(r, gen, 0, 5000)
    want = torch.where(
        temperature.to(DEVICE) < GREEDY_EPS,
        logits.to(DEVICE).argmax(-1),
        sample_from_probs(probs.to(DEVICE), uniform(seed, position, STREAM_TOKEN)),
    )
    got = sample_tokens(
        *(t.to(DEVICE) for t in (probs, logits, temperature)),
        seed,
        position,
        STREAM_TOKEN,
        GREEDY_EPS,
        block_v=block_v,
    )
    assert torch.equal(got, want)
    drawn = probs.gather(1, got.cpu()[:, None]).squeeze(1)[temperature >= GREEDY_EPS]
    assert len(drawn) and bool((drawn > 0).all())


def test_sample_tokens_checks_shapes() -> None:
    rows, params = torch.rand(2, 8, device=DEVICE), torch.zeros(2, **I64)
    with pytest.raises(ValueError, match="probs and logits"):
        sample_tokens(rows, rows[:, :4], rows[:, 0], params, params, STREAM_TOKEN, GREEDY_EPS)
    with pytest.raises(ValueError, match="temperature, seed and position"):
        sample_tokens(rows, rows, rows[:1, 0], params, params, STREAM_TOKEN, GREEDY_EPS)


def _request_table(n: int, gen: torch.Generator) -> SamplingTensors:
    f32 = lambda: torch.rand(n, generator=gen).to(DEVICE)  # noqa: E731
    return SamplingTensors(
        f32() * 2,
        f32(),
        torch.randint(1, 50, (n,), generator=gen).to(DEVICE),
        f32() * 0.2,
        _int64(n, gen),
        _int64(n, gen, 0, 10_000),
    )


def _filled(n: int) -> SamplingTensors:
    """Sentinel-filled rows: rows that no request covers must keep these values."""
    out = SamplingTensors.empty(n, DEVICE)
    for t in out.tensors():
        t.fill_(-7)
    return out


@pytest.mark.parametrize(
    "num_requests, k, with_slots", [(1, 1, False), (3, 2, True), (5, 4, True), (4, 3, False)]
)
def test_build_sampling_params_matches_reference(
    num_requests: int, k: int, with_slots: bool
) -> None:
    gen = torch.Generator().manual_seed(num_requests * 10 + k)
    table = _request_table(12, gen)
    rows = torch.where(torch.rand(num_requests, generator=gen) < 0.5, k + 1, 1).to(DEVICE)
    slots = None
    if with_slots:
        slots = torch.randperm(12, generator=gen)[:num_requests].to(DEVICE)
        slots[-1] = -1  # a padding request: none of its rows are written
    num_rows = int(rows.sum()) + 2  # two rows past the last request stay untouched
    got = build_sampling_params(table, rows, num_rows, req_slots=slots, out=_filled(num_rows))
    want = build_sampling_params_ref(table, rows, num_rows, req_slots=slots, out=_filled(num_rows))
    for g, w in zip(got.tensors(), want.tensors()):
        assert torch.equal(g, w)
    first = 0 if slots is None else int(slots[0])
    assert got.position[: int(rows[0])].tolist() == [
        int(table.position[first]) + j for j in range(int(rows[0]))
    ]


def test_advance_positions_in_place() -> None:
    gen = torch.Generator().manual_seed(0)
    positions = _int64(10, gen, 0, 1000)
    want, ptr = positions.clone(), positions.data_ptr()
    slots = torch.tensor([7, 2, -1, 0], **I64)
    emitted = torch.tensor([3, 1, 5, 0], **I64)
    advance_positions(positions, emitted, slots)
    advance_positions_ref(want, emitted, slots)
    assert positions.data_ptr() == ptr and torch.equal(positions, want)
    assert int(positions[7]) == int(want[7]) and positions[1] == want[1]
    before = positions.clone()
    advance_positions(positions, torch.tensor([1, 2], **I64))  # no slots: request b is entry b
    assert positions[:2].tolist() == [int(before[0]) + 1, int(before[1]) + 2]
    assert torch.equal(positions[2:], before[2:])


@pytest.mark.parametrize("num_tokens, with_history", [(1, False), (1, True), (5, False), (5, True)])
def test_advance_positions_records_the_emitted_tokens(num_tokens: int, with_history: bool) -> None:
    """The commit's one launch: counters, last tokens and token history, == the torch
    reference; a padding request (-1) and a request that emitted nothing record no token, and a
    row that runs past the history's end spills into its last column only.
    """
    gen = torch.Generator().manual_seed(num_tokens * 2 + with_history)
    n, length = 9, 12
    slots = torch.tensor([4, -1, 0, 7, 2], **I64)
    emitted = torch.tensor([num_tokens, 1, 0, 1, num_tokens], **I64)
    tokens = _int64(5 * num_tokens, gen, 0, 500).view(5, num_tokens)
    prompt_len = _int64(n, gen, 0, 6)
    prompt_len[2] = length - 1  # request 4 runs past the end of its row
    state = dict(
        positions=_int64(n, gen, 0, 6),
        last_token=_int64(n, gen, 0, 500),
        history=torch.randint(0, 500, (n, length + 1), generator=gen, dtype=torch.int32).to(DEVICE),
    )
    if not with_history:
        del state["history"]
    got = {k: v.clone() for k, v in state.items()}
    want = {k: v.clone() for k, v in state.items()}
    extra = dict(prompt_len=prompt_len) if with_history else {}
    for fn, out in ((advance_positions, got), (advance_positions_ref, want)):
        fn(
            out["positions"],
            emitted,
            slots,
            tokens=tokens,
            last_token=out["last_token"],
            history=out.get("history"),
            **extra,
        )
    before = state["positions"]
    assert torch.equal(got["positions"], want["positions"])
    assert got["positions"].tolist() == [
        int(before[i]) + {4: num_tokens, 7: 1, 2: num_tokens}.get(i, 0) for i in range(n)
    ]
    assert torch.equal(got["last_token"], want["last_token"])
    expect_last = state["last_token"].clone()
    expect_last[[4, 7, 2]] = tokens[[0, 3, 4], [num_tokens - 1, 0, num_tokens - 1]]
    assert torch.equal(got["last_token"], expect_last)  # slot 0 emitted nothing: unchanged
    if with_history:
        assert torch.equal(got["history"][:, :length], want["history"][:, :length])
        start = int(prompt_len[4] + before[4])
        assert got["history"][4, start : start + num_tokens].tolist() == tokens[0].tolist()
        untouched = [i for i in range(n) if i not in (4, 7, 2, 0)]
        assert torch.equal(got["history"][untouched], state["history"][untouched])


def test_advance_positions_rejects_mismatched_tables() -> None:
    positions, emitted = torch.zeros(4, **I64), torch.ones(2, **I64)
    slots, tokens = torch.tensor([0, 1], **I64), torch.zeros(2, 3, **I64)
    with pytest.raises(ValueError, match="tokens and last_token"):
        advance_positions(positions, emitted, slots, tokens=tokens)
    with pytest.raises(ValueError, match="history and prompt_len"):
        advance_positions(
            positions,
            emitted,
            slots,
            tokens=tokens,
            last_token=positions.clone(),
            history=torch.zeros(4, 5, dtype=torch.int32, device=DEVICE),
        )
    with pytest.raises(ValueError, match="tokens must be"):
        advance_positions(
            positions, emitted, slots, tokens=torch.zeros(3, 3, **I64), last_token=positions.clone()
        )
    with pytest.raises(ValueError, match="history must be"):
        advance_positions(
            positions,
            emitted,
            slots,
            tokens=tokens,
            last_token=positions.clone(),
            history=torch.zeros(4, 5, **I64),
            prompt_len=positions.clone(),
        )


def _probs(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random distributions with about a third of the entries exactly zero."""
    p = torch.rand(shape, generator=gen)
    p[torch.rand(shape, generator=gen) < 0.35] = 0.0
    p[..., 0] += 1e-3  # no empty row
    return p / p.sum(-1, keepdim=True)


def _verify_inputs(
    b: int, k: int, v: int, strategy: VerifyStrategy, extras: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    p, q = _probs((b, k + 1, v), gen), _probs((b, k, v), gen)
    seed = _int64(b, gen)[:, None].expand(b, k + 1).contiguous()
    position = (_int64(b, gen, 0, 5000)[:, None] + torch.arange(k + 1, **I64)).contiguous()
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    # Make about 70% of the drafts what the target would emit, so that accepts happen.
    if strategy == VerifyStrategy.GREEDY:
        target = p.argmax(-1)
    else:
        target = _draw(p, seed.cpu(), position.cpu(), STREAM_TOKEN)
    if strategy != VerifyStrategy.REJECTION:
        drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, target[:, :k], drafts)
    kwargs = dict(seed=seed, position=position)
    if strategy == VerifyStrategy.REJECTION:
        kwargs["draft_probs"] = q.to(DEVICE)
    if extras:  # fewer drafts than k, and greedy requests inside a sampled batch
        kwargs["num_draft"] = torch.randint(0, k + 1, (b,), generator=gen).to(DEVICE)
    if extras and strategy != VerifyStrategy.GREEDY:
        kwargs["is_greedy"] = (torch.rand(b, generator=gen) < 0.4).to(DEVICE)
    return p.to(DEVICE), drafts.to(DEVICE), kwargs


@pytest.mark.parametrize("strategy", list(VerifyStrategy))
@pytest.mark.parametrize(
    "b, k, v, block_v, extras",
    [
        (1, 1, 8, None, False),
        (2, 3, 37, 16, True),
        (5, 4, 300, 128, True),
        (4, 2, 129, None, False),
        (3, 4, 64, 32, True),
    ],
)
def test_verify_matches_reference(
    strategy: VerifyStrategy, b: int, k: int, v: int, block_v: int | None, extras: bool
) -> None:
    gen = torch.Generator().manual_seed(1000 * int(strategy) + 10 * b + k)
    p, drafts, kwargs = _verify_inputs(b, k, v, strategy, extras, gen)
    got = verify_draft_tokens(p, drafts, strategy, block_v=block_v, **kwargs)
    want = verify_draft_tokens_ref(p, drafts, strategy, **kwargs)
    assert torch.equal(got.accept_len, want.accept_len)
    assert torch.equal(got.tokens, want.tokens)


def test_verify_greedy_on_logits_with_ties() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-3, 3, (4, 3, 40), generator=gen).float().to(DEVICE)  # many ties
    logits[0, 1] = float("-inf")
    drafts = logits[:, :2].argmax(-1)
    drafts[2, 1] = (drafts[2, 1] + 1) % 40
    got = verify_draft_tokens(logits, drafts, VerifyStrategy.GREEDY, block_v=16)
    want = verify_draft_tokens_ref(logits, drafts, VerifyStrategy.GREEDY)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.accept_len, want.accept_len)
    assert want.accept_len.tolist() == [2, 2, 1, 2]
    assert want.tokens[0].tolist() == [*drafts[0].tolist(), int(logits[0, 2].argmax())]


def test_verify_checks_inputs() -> None:
    p = torch.rand(2, 3, 8, device=DEVICE)
    drafts = torch.zeros(2, 2, **I64)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_draft_tokens(p, drafts, VerifyStrategy.GREEDY, draft_probs=p[:, :2])
    with pytest.raises(ValueError, match="seed and position"):
        verify_draft_tokens(p, drafts, VerifyStrategy.TARGET_MATCH)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_draft_tokens(p, drafts[:, :1], VerifyStrategy.GREEDY)


def test_build_verify_advance_compose() -> None:
    """One speculative step on device tensors: expand rows, verify, advance the counter."""
    gen = torch.Generator().manual_seed(5)
    b, k, v = 3, 2, 16
    table = _request_table(6, gen)
    slots = torch.tensor([4, 0, 2], **I64)
    start = table.position.clone()
    rows = build_sampling_params(
        table, torch.full((b,), k + 1, **I64), b * (k + 1), req_slots=slots
    )
    p = _probs((b, k + 1, v), gen).to(DEVICE)
    seed, position = rows.seed.view(b, k + 1), rows.position.view(b, k + 1)
    drafts = _draw(p.cpu(), seed.cpu(), position.cpu(), STREAM_TOKEN)[:, :k].contiguous().to(DEVICE)
    drafts[1, 0] = (drafts[1, 0] + 1) % v  # request 1 rejects its first draft
    result = verify_draft_tokens(
        p, drafts, VerifyStrategy.TARGET_MATCH, seed=seed, position=position
    )
    assert result.accept_len.tolist() == [k, 0, k]
    advance_positions(table.position, result.accept_len + 1, slots)
    assert torch.equal(table.position[slots], start[slots] + result.accept_len + 1)
