"""Gemma 3 through the piecewise runner (CPU: the traced pieces, padded to token buckets as on
CUDA): one trace split at every layer's attention, the per-layer windows reaching the attention
op through its ``layer_id``, and the same greedy tokens as the eager path, on a tiny random
model whose 8-token window is shorter than its prompts (chunked prefill with prefixes past the
window, decode past it) and on the real 270M where it is cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from oracle import greedy
from script_modules import load_script
from test_models import GEMMA3, random_ids, tiny_hf_model
from test_real_models import needs_cached

from pcgspec import LLM
from pcgspec.models.catalog import GEMMA3_270M

WINDOW = GEMMA3["sliding_window"]


@pytest.fixture(scope="module")
def tiny_gemma_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-piecewise")
    tiny_hf_model("Gemma3TextConfig", **GEMMA3).save_pretrained(path)
    return path


def _tokens(llm: LLM, prompts: Sequence[object], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(list(prompts), greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def check_piecewise_equals_eager(
    llm: LLM, prompts: Sequence[object], max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens with every extend and decode pass on the piecewise runner (padded to
    buckets) == with the runner removed (eager)."""
    runner = llm.engine.runner
    piecewise = runner.piecewise
    assert piecewise is not None, "the piecewise runner must be on (PCGSPEC_CPU_PIECEWISE=1)"
    monkeypatch.setattr(piecewise, "pad_without_graphs", True)
    runs = piecewise.stats()["runs"]
    got = _tokens(llm, prompts, max_tokens)
    assert piecewise.stats()["runs"] - runs >= max_tokens  # the prefill chunks and each decode
    assert not any(piecewise.stats()["fallbacks"].values())
    split = piecewise.backend.split
    assert piecewise.backend.num_traces == 1
    assert split.num_split_points == runner.model.num_layers
    layer_ids = [  # NOTE: each attention call takes its layer as a literal int, nothing else
        node.args[-1]
        for piece in split.pieces
        if piece.is_split_op
        for node in piece.graph_module.graph.nodes
        if node.op == "call_function"
    ]
    assert layer_ids == list(range(runner.model.num_layers))
    monkeypatch.setattr(runner, "piecewise", None)
    assert got == _tokens(llm, prompts, max_tokens)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_gemma_piecewise_equals_eager(
    tiny_gemma_path: Path, smollm2_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(
        str(tiny_gemma_path),
        tokenizer=str(smollm2_path),
        attention_backend=backend,
        dtype="float32",
        device="cpu",
        chunked_prefill_size=2 * WINDOW,
        piecewise_cuda_graph_max_tokens=64,
    )
    assert llm.engine.runner.attn_backend.sliding_windows == (WINDOW, None, WINDOW)
    prompts = [random_ids(5 * WINDOW, seed=21), random_ids(3, seed=22), random_ids(11, seed=23)]
    # NOTE: 8 new tokens take even the 3-token prompt's decode past the window
    check_piecewise_equals_eager(llm, [{"prompt_token_ids": p} for p in prompts], 8, monkeypatch)


def test_gemma3_270m_piecewise_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt longer than the 512-token window, and a short one."""
    needs_cached(GEMMA3_270M)
    prompts = load_script("check_greedy_equal").PLAIN_PROMPTS
    llm = LLM(GEMMA3_270M.name, dtype="float32", device="cpu")
    assert len(llm.get_tokenizer().encode(prompts[-1])) > 512
    with torch.inference_mode():
        check_piecewise_equals_eager(llm, [prompts[0], prompts[-1]], 8, monkeypatch)
