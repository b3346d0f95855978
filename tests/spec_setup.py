"""What the model-drafter test modules (test_spec_models, test_spec_overlap) share: the
prompts, the engines they build and the greedy comparison with plain decoding; and the graph
runners a CPU test gives a speculative engine (``spec_graphs``: test_spec_step_graphs,
test_tree_spec).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from oracle import PROMPTS as ALL_PROMPTS
from oracle import assert_greedy_match, greedy

from pcgspec import LLM, SamplingParams
from pcgspec.runners.decode_graph_runner import DecodeGraphRunner
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.runners.spec_step_graphs import SpecStepGraphs
from pcgspec.speculative.model_proposer import ModelProposer

K = 3
NEW_TOKENS = 32
PROMPTS = ALL_PROMPTS[:8] + [
    "Repeat exactly: the old lighthouse keeper climbed the stairs every night to light the "
    "lamp. The old lighthouse keeper",
    "a b c d e f g h a b c d e f g h a b",
]
ALGORITHMS = ("STANDALONE", "EAGLE3", "NEXTN")
# several engines on one device: each caps its KV cache
GPU_KW = {"dtype": "float32", "device": "cuda", "max_total_tokens": 1 << 15}
GPU_NEW_TOKENS = 64  # tokens the GPU greedy tests generate (cheap there; NEW_TOKENS is for the CPU)
SPEC_KW = {"speculative_num_steps": K, "speculative_policy": "always"}


def spec_llm(smollm2_path, algorithm: str, draft, **kw) -> LLM:
    """A speculative engine; prefill runs eagerly unless ``disable_piecewise_cuda_graph=False``
    (NOTE: the piecewise trace of the 30-layer target costs ~8 s on the CI machine; the
    ``spec`` fixture's engines cover speculation behind piecewise prefill).
    """
    kw.setdefault("disable_piecewise_cuda_graph", True)
    return LLM(
        str(smollm2_path),
        dtype="float32",
        device="cpu",
        speculative_algorithm=algorithm,
        speculative_draft_model_path=str(draft),
        speculative_num_steps=K,
        speculative_policy="always",
        **kw,
    )


class MemoizedPlain:
    """A plain engine whose ``generate`` is memoized by prompts and sampling parameters where
    its output is deterministic (greedy, or sampled with a seed): several tests, and each
    algorithm's run of one, compare with the same plain outputs.
    """

    def __init__(self, llm: LLM) -> None:
        self.llm, self.outputs = llm, {}

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def generate(self, prompts, params, use_tqdm: bool = False) -> list:
        many = params if isinstance(params, list) else [params]
        if any(p.temperature > 0 and p.seed is None for p in many):
            return self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        key = repr((prompts, params))
        if key not in self.outputs:
            self.outputs[key] = self.llm.generate(prompts, params, use_tqdm=use_tqdm)
        return self.outputs[key]


def greedy_params(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return greedy(max_tokens, **kw)


def assert_same_greedy(llm, hf_model, prompts, want, got) -> None:
    tok = llm.get_tokenizer()
    for prompt, w, g in zip(prompts, want, got):
        assert len(g.token_ids) == len(w.token_ids)
        assert_greedy_match(hf_model, tok.encode(prompt), g.token_ids, w.token_ids)


@contextlib.contextmanager
def spec_graphs(llm: LLM, whole_steps: bool = True) -> Iterator[LLM]:
    """``llm``'s draft (a model drafter's) and verify graphs (tree graphs for trees), and with
    ``whole_steps`` its speculative step graphs, as a CUDA engine captures them (the eager
    stand-in on CPU; buckets 1, 2, 4), inside the block."""
    engine = llm.engine
    runner, worker = engine.runner, engine.spec_worker
    proposer = worker.proposer
    drafter = isinstance(proposer, ModelProposer)
    try:
        if drafter:
            proposer.graphs = DraftGraphRunner(
                proposer.runner, proposer.shape, 4, runner.context_length
            )
            proposer.graphs.capture()
        runner.verify_graphs = DecodeGraphRunner(
            runner,
            ForwardMode.TARGET_VERIFY,
            worker.shape.num_nodes,
            tree=not worker.shape.is_chain,
        )
        runner.verify_graphs.capture()
        if whole_steps:
            worker.step_graphs = SpecStepGraphs(
                runner.verify_graphs,
                proposer,
                engine.slots,
                runner.model.compute_logits,
                worker.num_steps,
            )
            worker.step_graphs.capture()
        yield llm
    finally:
        runner.verify_graphs = worker.step_graphs = None
        if drafter:
            proposer.graphs = proposer.step_rows = None


def plain_cpu_llm(path, **kw) -> LLM:
    """A plain float32 CPU engine of the model at ``path``, prefill eager by default (the
    reference of a cut target's speculative engines)."""
    kw.setdefault("disable_piecewise_cuda_graph", True)
    return LLM(str(path), dtype="float32", device="cpu", **kw)
