"""Verify tail graphs: the LM head, acceptance and commit of a speculative step replayed behind a
verify graph equal the eager path (the same accepted tokens, the same sampling-slot state after
the commit), padding requests commit nothing, and ``can_run`` refuses what the graph cannot
serve. On CPU the eager stand-in replaces CUDA graphs; the ``gpu`` test captures real ones.
"""

from __future__ import annotations

import pytest
import torch
from test_decode_graphs import PAGE_SIZE, Requests, tiny_path, tiny_runner  # noqa: F401
from test_verify_graphs import K1, verify_graphs

from pcgspec.kernels.padded_rows import VerifyTokens
from pcgspec.kernels.verify_draft_tokens import verify_draft_tokens_ref
from pcgspec.runners.batch_builder import build_verify_batch, device_page_table
from pcgspec.runners.verify_tail_graphs import TailBatch, VerifyTailGraphs
from pcgspec.sampling.sampler import process_logits
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.sampling_params import SamplingParams
from pcgspec.speculative.worker import _target_rows

ROWS = [4, 2, 9]  # bucket 4: one padding request


class SlotReq:
    def __init__(self, params: SamplingParams, seed: int, prompt: list[int]) -> None:
        self.params, self.seed, self.prompt_token_ids = params, seed, prompt
        self.output_token_ids: list[int] = [7, 8]


def _slots(runner, reqs: list[SlotReq]) -> SamplingSlots:
    slots = SamplingSlots(8, runner.vocab_size, runner.device, history_len=128)
    slots.admit(SlotReq(SamplingParams(), 1, [1]))  # slot 0 taken: the batch's are not 0..2
    slots.admit(*reqs)
    return slots


def _verify_pass(runner, graphs, reqs: Requests, slot_reqs, slots: SamplingSlots, drafts):
    """A verify pass of ``ROWS`` replayed by the bucket's graph (hidden left in its buffer)."""
    device = runner.device
    lens = [reqs.lens[r] for r in ROWS]
    last = torch.tensor([reqs.ids[r][n] for r, n in zip(ROWS, lens)], device=device)
    slot_idx = slots.slot_indices(slot_reqs)
    slots.last_token.index_copy_(0, slot_idx, last)
    table = device_page_table([reqs.pages[r] for r in ROWS], device)
    bounds = [n + K1 for n in lens]
    rows = graphs.rows_for(len(ROWS), table.shape[1], max(bounds))
    batch = build_verify_batch(
        VerifyTokens(slots.last_token, slot_idx, drafts),
        torch.tensor(lens, device=device) + 1,
        table,
        PAGE_SIZE,
        bounds,
        rows,
    )
    assert graphs.can_run(batch)
    return graphs.replay(batch).hidden[: len(ROWS) * K1].clone()


@torch.inference_mode()
@pytest.mark.parametrize(
    "temperatures", [(0.0, 0.0, 0.0), (0.9, 0.0, 1.3)], ids=["greedy", "mixed"]
)
def test_tail_replay_equals_eager_acceptance(tiny_path, temperatures) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    graphs, reqs = verify_graphs(runner), Requests(runner)
    slot_reqs = [
        SlotReq(SamplingParams(temperature=t, seed=i), 100 + i, [3, 4, 5])
        for i, t in enumerate(temperatures)
    ]
    eager, tailed = _slots(runner, slot_reqs), _slots(runner, slot_reqs)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(0, runner.vocab_size, (len(ROWS), K1 - 1), generator=gen)
    for j in range(K1 - 1):  # request 0's drafts all the target's picks, request 1's first
        hidden = _verify_pass(runner, graphs, reqs, slot_reqs, eager, drafts)
        picks = runner.model.compute_logits(hidden).view(len(ROWS), K1, -1).argmax(-1)
        drafts[0, j] = picks[0, j]
        drafts[1, 0] = picks[1, 0]
    num = torch.tensor([K1 - 1, K1 - 1, 1])
    hidden = _verify_pass(runner, graphs, reqs, slot_reqs, eager, drafts)  # with these drafts
    _verify_pass(runner, graphs, reqs, slot_reqs, tailed, drafts)

    sampling = eager.rows(slot_reqs, drafts)
    target, strategy = _target_rows(
        process_logits(runner.model.compute_logits(hidden), sampling), sampling
    )
    want = verify_draft_tokens_ref(
        target.view(len(ROWS), K1, -1),
        drafts,
        strategy,
        seed=sampling.seed.view(-1, K1),
        position=sampling.position.view(-1, K1),
        num_draft=num,
    )
    eager.commit(slot_reqs, want.tokens, want.accept_len + 1)

    tail = VerifyTailGraphs(graphs, tailed, runner.model.compute_logits)
    tail.capture()
    flags = tailed.flags(slot_reqs)
    assert tail.can_run(TailBatch(len(ROWS), flags, graph_replays=True))
    results, got = tail.replay(
        tailed.slot_indices(slot_reqs), drafts, num, bool(flags["all_greedy"])
    )
    assert torch.equal(got.accept_len, want.accept_len) and torch.equal(got.tokens, want.tokens)
    assert torch.equal(results[:, 1], num)
    if temperatures == (0.0, 0.0, 0.0):
        assert got.accept_len.tolist()[:2] == [K1 - 1, 1]
    for name in ("position", "seed", "temperature"):
        assert torch.equal(getattr(tailed.table, name), getattr(eager.table, name)), name
    assert torch.equal(tailed.last_token, eager.last_token)
    assert torch.equal(tailed.token_history, eager.token_history)
    assert tail.stats()["runs"] == 1 and tail.stats()["padded_rows"] == K1
    eager.rollback(eager.checkpoint() - 1)
    tailed.rollback(tailed.checkpoint() - 1)  # a failed step gives its captured commit back
    assert torch.equal(tailed.table.position, eager.table.position)
    assert torch.equal(tailed.last_token, eager.last_token)


def test_tail_refuses_what_it_cannot_serve(tiny_path) -> None:  # noqa: F811
    runner = tiny_runner(tiny_path, disable_piecewise_cuda_graph=True)
    graphs = verify_graphs(runner)
    tail = VerifyTailGraphs(graphs, _slots(runner, []), runner.model.compute_logits)
    ok = {
        "all_greedy": True,
        "needs_penalties": False,
        "needs_filters": False,
        "rank_depth": 0,
        "max_logprobs": None,
    }
    assert tail.can_run(TailBatch(3, ok, True))
    assert not tail.can_run(TailBatch(3, ok, False))
    assert not tail.can_run(TailBatch(graphs.max_bs + 1, ok, True))
    assert not tail.can_run(TailBatch(3, {**ok, "needs_penalties": True}, True))
    assert not tail.can_run(TailBatch(3, {**ok, "needs_filters": True}, True))
    assert not tail.can_run(TailBatch(3, {**ok, "max_logprobs": 2}, True))
    assert not tail.can_run(TailBatch(3, ok, True, tree=True))
    assert tail.stats() == {
        "graphs": 0,
        "runs": 0,
        "padded_rows": 0,
        "fallbacks": {
            "no_verify_graph": 2,
            "tree": 1,
            "penalties": 1,
            "filters": 1,
            "logprobs": 1,
        },
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tail_graphs_serve_the_engine(tiny_path, smollm2_path) -> None:  # noqa: F811
    """On CUDA a speculative engine captures the tail behind its verify graphs, and greedy and
    seeded sampled speculation through it equal plain decoding."""
    from pcgspec import LLM

    kw = dict(
        tokenizer=str(smollm2_path), dtype="float32", mem_fraction_static=0.3, max_total_tokens=4096
    )
    llm = LLM(
        str(tiny_path),
        speculative_algorithm="NGRAM",
        speculative_num_steps=K1 - 1,
        speculative_policy="always",
        **kw,
    )
    tail = llm.engine.spec_worker.tail
    assert tail is not None and tail.stats()["graphs"] == 2 * len(tail.batch_sizes)
    prompts = [{"prompt_token_ids": p} for p in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 8, 5, 6])]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
    ]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tail.stats()["runs"] > 0
    plain = LLM(str(tiny_path), **kw)
    assert got == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
