"""Tree drafting end to end (``speculative_eagle_topk > 1``) on a tiny random Llama with an
EAGLE3 head (CPU, float32): greedy output equals plain decoding at batch 1, 3 and 16, seeded
sampling too, with the draft trees as the head builds them and with trees where one branch
follows the target's own continuation (an oracle planted on the device), so that walks go deep
and accepted nodes' K/V move into place. The CUDA graph paths have GPU tests at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Iterator

import pytest
import torch
from oracle import assert_all_pages_free
from spec_setup import spec_graphs
from test_models import tiny_hf_model

from pcgspec import LLM, SamplingParams
from pcgspec.models.default_model import default_model_path
from pcgspec.models.eagle3 import write_eagle3_checkpoint
from pcgspec.models.loader import load_config
from pcgspec.models.mtp import write_mtp_checkpoint
from pcgspec.models.random_weights import shape_config
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.tree import ancestor_mask
from pcgspec.speculative.worker import SpecWorker

SHAPES = {"wide": (3, 3, 8), "deep": (5, 2, 7)}  # (num_steps, topk, num_draft_tokens)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tree")
    tiny_hf_model("LlamaConfig").save_pretrained(root / "llama")  # context 128
    head = write_eagle3_checkpoint(root / "eagle3", load_config(root / "llama"), seed=1)
    return {"target": str(root / "llama"), "head": str(head)}


def _llm(paths: dict[str, str], shape: str | None, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "tokenizer": str(default_model_path()), **kw}
    if shape is not None:
        steps, topk, nodes = SHAPES[shape]
        kw.update(
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=paths["head"],
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=nodes,
            speculative_policy="always",
        )
    return LLM(paths["target"], **kw)


@pytest.fixture(scope="module")
def plain(paths) -> LLM:
    return _llm(paths, None)


@pytest.fixture(scope="module", params=list(SHAPES))
def spec(paths, request) -> LLM:
    return _llm(paths, request.param)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [
        torch.randint(1, 256, (int(m),), generator=gen).tolist()
        for m in torch.randint(2, 50, (n,), generator=gen)
    ]


class PlantedBranch:
    """Wraps a proposer: after the head drafts, one branch of every tree (the path to a random
    node) is overwritten with the target's greedy continuation (``want``), up to a random
    depth, so the verify pass accepts deep paths of nodes that are not consecutive. Inside a
    captured speculative step (the eager stand-in on CPU) the requests are found by their
    sampling slots and their progress by their lengths there."""

    def __init__(self, llm: LLM, want: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.proposer, self.want = llm.engine.spec_worker.proposer, want
        self.slots = llm.engine.slots
        self.rng = random.Random(seed)
        self.original = self.proposer.propose
        self.original_captured = self.proposer.propose_captured

    def __call__(self, batch):
        proposal = self.original(batch)
        reqs = batch.requests
        return self._plant(proposal, reqs, [len(r.output_token_ids) for r in reqs])

    def captured(self, step):
        proposal = self.original_captured(step)
        by_slot = {slot: req for req, slot in self.slots._slot_of.items()}
        reqs, done = [], []
        for slot, valid, n in zip(*(t.tolist() for t in (step.slots, step.valid, step.seq_lens))):
            req = by_slot[slot] if valid else None
            reqs.append(req)
            done.append(0 if req is None else n - len(req.prompt_token_ids))
        return self._plant(proposal, reqs, done)

    def _plant(self, proposal, reqs, done: list[int]):
        tokens = proposal.tokens.clone()
        parents = proposal.parents.tolist()
        for b, (req, n) in enumerate(zip(reqs, done)):
            if req is None:
                continue
            ahead = self.want[tuple(req.prompt_token_ids)][n:]
            node = self.rng.randrange(1, len(parents[b]))
            path = []
            while node > 0:
                path.append(node)
                node = parents[b][node]
            keep = self.rng.randrange(0, len(path) + 1)
            for depth, node in enumerate(path[::-1][:keep]):
                if depth < len(ahead):
                    tokens[b, node - 1] = ahead[depth]
        return dataclasses.replace(proposal, tokens=tokens)


@contextlib.contextmanager
def planted(llm: LLM, prompts: list[list[int]], want: list, seed: int = 0) -> Iterator[None]:
    """``llm``'s proposer drafts through ``PlantedBranch`` (``want``: the plain outputs of
    ``prompts``) inside the block."""
    proposer = llm.engine.spec_worker.proposer
    continuations = {tuple(p): w.token_ids for p, w in zip(prompts, want)}
    branch = PlantedBranch(llm, continuations, seed)
    proposer.propose, proposer.propose_captured = branch, branch.captured
    try:
        yield
    finally:
        del proposer.propose, proposer.propose_captured


def _greedy(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_greedy_equals_plain(plain, spec, batch):
    prompts = _prompts(batch)
    want = plain.generate(prompts, _greedy(), use_tqdm=False)
    got = spec.generate(prompts, _greedy(), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.spec_stats()["verify_steps"] > 0
    assert_all_pages_free(spec)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_greedy_equals_plain_with_deep_accepted_paths(plain, spec, batch):
    prompts = _prompts(batch + 100)[:batch]
    want = plain.generate(prompts, _greedy(), use_tqdm=False)
    before = spec.engine.spec_stats()
    with planted(spec, prompts, want, seed=batch):
        got = spec.generate(prompts, _greedy(), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    after = spec.engine.spec_stats()
    per_position = [  # NOTE: empty before the engine's first verify step
        a - b
        for a, b in itertools.zip_longest(
            after["accepted_per_position"], before["accepted_per_position"], fillvalue=0
        )
    ]
    assert per_position[1] > 0  # paths of two drafts and more: their K/V moved
    assert_all_pages_free(spec)


@pytest.mark.parametrize(("topk", "nodes"), [(1, 2), (2, 3)])
def test_one_draft_level_greedy_equals_plain(paths, plain, topk, nodes):
    """``speculative_num_steps`` 1: the catch-up's candidates alone, no draft level after it."""
    spec = _llm(
        paths,
        None,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=paths["head"],
        speculative_num_steps=1,
        speculative_eagle_topk=topk,
        speculative_num_draft_tokens=nodes,
        speculative_policy="always",
    )
    prompts = _prompts(3)
    want = plain.generate(prompts, _greedy(16), use_tqdm=False)
    got = spec.generate(prompts, _greedy(16), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.spec_stats()["verify_steps"] > 0


def test_nextn_trees_greedy_equal_plain(tmp_path, paths):
    """A MiMo target whose own MTP layer drafts trees (NEXTN, no draft path)."""
    target = write_mtp_checkpoint(tmp_path / "mimo", shape_config("tiny"), seed=1, layout="mimo")
    kw = {"dtype": "float32", "device": "cpu", "tokenizer": str(default_model_path())}
    plain_mimo = LLM(str(target), **kw)
    spec = LLM(
        str(target),
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=6,
        speculative_policy="always",
        **kw,
    )
    prompts = _prompts(3)
    want = plain_mimo.generate(prompts, _greedy(24), use_tqdm=False)
    with planted(spec, prompts, want):
        got = spec.generate(prompts, _greedy(24), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert spec.engine.spec_stats()["accepted_per_position"][1] > 0
    assert_all_pages_free(spec)


def test_topk_past_the_draft_vocabulary_is_refused(tmp_path, paths):
    small = write_eagle3_checkpoint(
        tmp_path / "small", load_config(paths["target"]), seed=1, draft_vocab_size=8
    )
    with pytest.raises(ValueError, match="speculative_eagle_topk 9 exceeds the draft vocab"):
        LLM(
            paths["target"],
            dtype="float32",
            device="cpu",
            tokenizer=str(default_model_path()),
            speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(small),
            speculative_num_steps=2,
            speculative_eagle_topk=9,
            speculative_num_draft_tokens=10,
        )


def test_seeded_sampling_equals_plain(plain, spec):
    """A tree draws each node's target token at its depth's output position: a seeded request
    emits what it emits without speculation, with planted branches too."""
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=30, temperature=0.9, seed=s) for s in (1, 2, 3)]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    with planted(spec, prompts, want):
        again = spec.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in again] == [w.token_ids for w in want]


def test_penalty_counts_of_tree_rows_are_their_paths() -> None:
    """Row j of a request counts the drafts of the nodes from the root to node j (a chain:
    drafts 0..j-1); an untracked request counts none."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 4], [-1, 0, 1, 2, 3, 4]])
    drafts = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    counts = torch.zeros(12, 32, dtype=torch.int32)
    SamplingSlots._add_drafts(counts, drafts, torch.tensor([True, True]), ancestor_mask(parents, 4))
    rows = [sorted(int(t) for t in row.nonzero().view(-1)) for row in counts]
    assert rows[:6] == [[], [10], [11], [10, 12], [11, 13], [11, 13, 14]]
    assert rows[6:] == [[], [20], [20, 21], [20, 21, 22], [20, 21, 22, 23], [20, 21, 22, 23, 24]]
    chain = torch.zeros_like(counts)
    SamplingSlots._add_drafts(chain, drafts, torch.tensor([True, False]))
    assert torch.equal(chain[6:], torch.zeros_like(chain[6:]))
    assert torch.equal(
        chain[:6],
        torch.zeros_like(chain[:6]).index_put_(
            (
                torch.tensor([1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5]),
                torch.tensor([10, 10, 11, 10, 11, 12, 10, 11, 12, 13, 10, 11, 12, 13, 14]),
            ),
            torch.tensor(1, dtype=torch.int32),
        ),
    )


def test_penalties_count_each_nodes_ancestors(plain, spec):
    """Repetition, presence and frequency penalties of a tree node's row count the drafts on
    its path only: greedy output with penalties equals plain decoding's, with deep paths."""
    prompts = _prompts(4)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=0.8),
        SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=0.6),
        _greedy(24),
    ]
    want = plain.generate(prompts, params, use_tqdm=False)
    worker = spec.engine.spec_worker
    fallbacks = worker.num_fallbacks
    with planted(spec, prompts, want):
        got = spec.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert worker.num_fallbacks == fallbacks


def test_overlap_schedule_and_prefix_cache(paths, plain):
    """Under the overlap schedule (steps read one late, catch-ups from the verify rows on the
    device) with prefix-cache hits on a shared prompt, tree steps with deep accepted paths keep
    greedy output plain decoding's, and nothing is left held."""
    spec = _llm(paths, "deep", disable_overlap_schedule=False)
    shared = _prompts(1)[0] * 3  # 3 pages of the default page size 16 at least
    prompts = [shared[:60] + q[:8] for q in _prompts(3)]
    want = plain.generate(prompts, _greedy(30), use_tqdm=False)
    with planted(spec, prompts, want):
        got = spec.generate(prompts[:1], _greedy(30), use_tqdm=False)
        got += spec.generate(prompts[1:], _greedy(30), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(o.num_cached_tokens > 0 for o in got[1:])
    assert spec.engine.spec_stats()["accepted_per_position"][1] > 0
    assert not spec.engine.in_flight
    assert_all_pages_free(spec)


def test_a_failing_request_in_a_tree_step_ends_alone(paths, plain, monkeypatch):
    """A tree step that fails after the accepted K/V moved (before its commit) is rerun on
    halves: the failing request ends with an error, the others equal plain decoding."""
    mark = 4242
    spec = _llm(paths, "wide")
    verify = SpecWorker.verify

    def failing(self, reqs, *args):
        step = verify(self, reqs, *args)
        if any(r.params.seed == mark and len(r.output_token_ids) >= 2 for r in reqs):
            raise RuntimeError("injected fault")
        return step

    monkeypatch.setattr(SpecWorker, "verify", failing)
    prompts = _prompts(4)
    params = [_greedy(16)] * 3 + [SamplingParams(max_tokens=16, temperature=0.0, seed=mark)]
    *want, _ = plain.generate(prompts, _greedy(16), use_tqdm=False)
    with planted(spec, prompts, [*want, _]):
        *got, bad = spec.generate(prompts, params, use_tqdm=False)
    assert bad.finish_reason == "error" and len(bad.token_ids) >= 2
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert_all_pages_free(spec)


@pytest.mark.parametrize("sampled", [False, True])
def test_graph_runners_replay_trees_like_eager(plain, spec, sampled):
    """Tree drafting and tree verify passes through the draft and verify graph runners with
    eager acceptance (as for penalties): the same output, every batch replayed, nothing
    refused; then whole speculative steps as graphs (acceptance, K/V move and commit inside),
    the same output again. Greedy, or seeded sampling beside a greedy request (the SAMPLED
    variant); batch 3 replays a padded bucket."""
    prompts = _prompts(3)
    params = [_greedy(24)] * 3
    if sampled:
        params[1:] = [SamplingParams(max_tokens=24, temperature=0.8, seed=s) for s in (5, 6)]
    want = plain.generate(prompts, params, use_tqdm=False)
    with spec_graphs(spec, whole_steps=False), planted(spec, prompts, want):
        got = spec.generate(prompts, params, use_tqdm=False)
        stats = spec.engine.graph_stats()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for name in ("verify", "draft"):
        assert stats[name]["runs"] > 0 and stats[name]["padded_rows"] > 0, stats
        assert not any(stats[name]["fallbacks"].values()), stats
    before = spec.engine.spec_stats()["accepted_draft_tokens"]
    with spec_graphs(spec), planted(spec, prompts, want):
        got = spec.generate(prompts, params, use_tqdm=False)
        stats = spec.engine.graph_stats()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    steps = stats["spec_step"]
    assert steps["runs"] > 0 and steps["padded_rows"] > 0, stats
    assert not any(steps["fallbacks"].values()), stats
    assert stats["verify"]["runs"] == stats["draft"]["runs"] == 0, stats
    assert spec.engine.spec_stats()["accepted_draft_tokens"] > before + 10  # deep walks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_cuda_graphs_greedy_equals_plain(paths, batch):
    """Captured draft trees and tree verify graphs replay (no refusal counted) and keep greedy
    output equal to plain decoding."""
    kw = {"device": "cuda", "max_total_tokens": 1 << 15, "disable_piecewise_cuda_graph": True}
    plain_gpu, spec_gpu = _llm(paths, None, **kw), _llm(paths, "wide", **kw)
    prompts = _prompts(batch)
    want = plain_gpu.generate(prompts, _greedy(), use_tqdm=False)
    with planted(spec_gpu, prompts, want):
        got = spec_gpu.generate(prompts, _greedy(), use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec_gpu.engine.graph_stats()
    assert stats["spec_step"]["runs"] > 0, stats
    for name in ("verify", "draft", "spec_step"):
        assert not any(stats[name]["fallbacks"].values()), stats
