"""Whole speculative steps as graphs (``SpecStepGraphs``): drafting, the verify pass,
acceptance and commit replayed per batch-size bucket give the same output as plain decoding
(greedy, seeded sampling beside greedy requests, steady batches and batches that change), for a
model drafter (an EAGLE3 chain) and prompt lookup; a batch that needs penalties runs the other
graphs with eager acceptance, counted; ``can_run`` refuses what the graphs cannot serve. On CPU
the eager stand-in replaces CUDA graphs (trees: test_tree_spec); the ``gpu`` test captures
real ones.
"""

from __future__ import annotations

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
from pcgspec.runners.spec_step_graphs import StepBatch

K = 3


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("steps")
    tiny_hf_model("LlamaConfig").save_pretrained(root / "llama")
    head = write_eagle3_checkpoint(root / "eagle3", load_config(root / "llama"), seed=1)
    return {"target": str(root / "llama"), "head": str(head)}


def _llm(paths: dict[str, str], algorithm: str | None = None, **kw) -> LLM:
    """Under the overlap schedule, as on CUDA: a step launches before the last one is read,
    so steady batches replay from the rows the step before left on the device."""
    kw = {
        "dtype": "float32",
        "device": "cpu",
        "tokenizer": str(default_model_path()),
        "disable_overlap_schedule": False,
        **kw,
    }
    if algorithm is not None:
        kw |= {
            "speculative_algorithm": algorithm,
            "speculative_num_steps": K,
            "speculative_policy": "always",
        }
        if algorithm == "EAGLE3":
            kw["speculative_draft_model_path"] = paths["head"]
    return LLM(paths["target"], **kw)


@pytest.fixture(scope="module")
def plain(paths) -> LLM:
    return _llm(paths)


@pytest.fixture(scope="module", params=["EAGLE3", "NGRAM"])
def spec(paths, request) -> Iterator[LLM]:
    with spec_graphs(_llm(paths, request.param)) as llm:
        yield llm


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # repeats in every prompt, so that prompt lookup drafts too
    return [
        (torch.randint(1, 256, (int(m),), generator=gen).tolist() * 3)[: 3 * int(m) - 1]
        for m in torch.randint(2, 12, (n,), generator=gen)
    ]


def test_whole_steps_equal_plain_decoding(plain, spec):
    """Batch 3 (a padded bucket of 4), greedy beside seeded sampling, requests of different
    lengths (the batch shrinks as they finish, so catch-up rows are gathered and copied in)."""
    prompts = _prompts(3)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=20, temperature=0.9, seed=4),
        SamplingParams(max_tokens=28, temperature=0.0),
    ]
    before = spec.engine.graph_stats()["spec_step"]["runs"]
    got = spec.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.graph_stats()
    steps = stats["spec_step"]
    assert steps["runs"] > before + 10 and steps["padded_rows"] > 0, stats
    assert not any(steps["fallbacks"].values()), stats
    assert stats["verify"]["runs"] == 0, stats  # every step was one replay
    assert spec.engine.spec_stats()["verify_steps"] > 0
    assert_all_pages_free(spec)


class Recorded:
    """Records every proposal's drafts of the real requests (a captured step's padding left
    out), eager or captured (the eager stand-in reruns the captured drafting on CPU)."""

    def __init__(self, proposer) -> None:
        self.proposer, self.drafts = proposer, []
        self.eager, self.captured = proposer.propose, proposer.propose_captured

    def __enter__(self) -> Recorded:
        def eager(batch):
            proposal = self.eager(batch)
            self.drafts.append(proposal.tokens.tolist())
            return proposal

        def captured(step):
            proposal = self.captured(step)
            self.drafts.append(proposal.tokens[step.valid].tolist())
            return proposal

        self.proposer.propose, self.proposer.propose_captured = eager, captured
        return self

    def __exit__(self, *exc) -> None:
        del self.proposer.propose, self.proposer.propose_captured


def test_captured_drafting_drafts_what_eager_drafting_does(paths, plain):
    """The catch-up a captured step builds from its buffers (positions, hidden rows, rows
    copied in after the batch changed) drafts the same tokens, step by step, as the eager
    catch-up; an untrained head accepts next to nothing, so both runs take the same steps."""
    prompts = _prompts(3, seed=5)
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in (10, 18, 26)]
    with spec_graphs(_llm(paths, "EAGLE3")) as llm:
        worker = llm.engine.spec_worker
        with Recorded(worker.proposer) as captured:
            got = llm.generate(prompts, params, use_tqdm=False)
        graphs, worker.step_graphs = worker.step_graphs, None
        with Recorded(worker.proposer) as eager:
            want = llm.generate(prompts, params, use_tqdm=False)
    assert graphs.stats()["runs"] == len(captured.drafts) > 10
    assert captured.drafts == eager.drafts
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_self_draft_in_captured_steps_accepts_every_draft(paths, plain):
    """The target as its own STANDALONE draft: where captured steps catch the draft up right,
    every draft is accepted, up to the requests' ends."""
    prompts = _prompts(2, seed=6)
    params = SamplingParams(max_tokens=4 * (K + 1) + 1, temperature=0.0, ignore_eos=True)
    draft = {"speculative_draft_model_path": paths["target"]}
    with spec_graphs(_llm(paths, "STANDALONE", **draft)) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.graph_stats()["spec_step"]["runs"] > 0
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for out in got:
        accepted = out.metrics.spec_accepted_per_position
        assert accepted[K - 1] >= 3, accepted  # the steps before the last accept all k


def test_steps_with_penalties_accept_eagerly(plain, spec):
    """A repetition penalty needs the eager acceptance: the step graphs refuse and count it,
    the draft and verify graphs serve the step, and the output is plain decoding's."""
    prompts = _prompts(2, seed=1)
    params = [
        SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=16, temperature=0.0),
    ]
    refused = spec.engine.graph_stats()["spec_step"]["fallbacks"]["penalties"]
    got = spec.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = spec.engine.graph_stats()
    assert stats["spec_step"]["fallbacks"]["penalties"] > refused
    assert stats["verify"]["runs"] > 0


def test_step_graphs_refuse_what_they_cannot_serve(spec) -> None:
    steps = spec.engine.spec_worker.step_graphs
    ok = {
        "all_greedy": True,
        "needs_penalties": False,
        "needs_filters": False,
        "rank_depth": 0,
        "max_logprobs": None,
    }
    before = steps.stats()["fallbacks"]
    assert steps.can_run(StepBatch(3, ok, 1, 64))
    assert not steps.can_run(StepBatch(steps.max_bs + 1, ok, 1, 64))
    assert not steps.can_run(StepBatch(3, ok, steps.max_pages + 1, 64))
    assert not steps.can_run(StepBatch(3, ok, 1, steps.max_seq_len + 1))
    assert not steps.can_run(StepBatch(3, {**ok, "needs_penalties": True}, 1, 64))
    assert not steps.can_run(StepBatch(3, {**ok, "needs_filters": True}, 1, 64))
    assert not steps.can_run(StepBatch(3, {**ok, "max_logprobs": 2}, 1, 64))
    after = steps.stats()["fallbacks"]
    assert {r: after[r] - before[r] for r in after} == {
        "not_captured": 0,
        "batch_size": 1,
        "seq_len": 2,
        "penalties": 1,
        "filters": 1,
        "logprobs": 1,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algorithm", ["EAGLE3", "NGRAM"])
def test_cuda_step_graphs_serve_the_engine(paths, algorithm) -> None:
    """On CUDA a speculative engine captures both variants of every bucket, and greedy and
    seeded sampled speculation through them equal plain decoding."""
    kw = dict(device="cuda", mem_fraction_static=0.3, max_total_tokens=4096)
    llm = _llm(paths, algorithm, **kw)
    steps = llm.engine.spec_worker.step_graphs
    assert steps is not None and steps.stats()["graphs"] == 2 * len(steps.batch_sizes)
    prompts = _prompts(3, seed=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    ]
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert steps.stats()["runs"] > 0 and not any(steps.stats()["fallbacks"].values())
    plain = _llm(paths, **kw)
    assert got == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
