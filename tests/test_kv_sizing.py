"""The KV pool on the CPU is sized by what the run can use: by default what
``max_running_requests`` sequences of the context need, at most 256 MiB; the one-shot
``pcgspec generate`` by its prompts; explicit sizes are kept.
"""

from __future__ import annotations

import pytest
import torch

from pcgspec.cli import main
from pcgspec.config import CPU_KV_CACHE_DEFAULT_BYTES, EngineConfig
from pcgspec.models.loader import load_tokenizer
from pcgspec.models.random_weights import random_model
from pcgspec.runners.model_runner import ModelRunner

SMALL = ("--device", "cpu", "--dtype", "float32", "--disable-piecewise-cuda-graph")


def test_default_budget_is_what_the_sequences_use_capped():
    config = EngineConfig(device="cpu", max_running_requests=4)
    assert config.cpu_kv_budget(context_length=100, bytes_per_token=1000) == 4 * 100 * 1000
    assert config.cpu_kv_budget(8192, 46080) == CPU_KV_CACHE_DEFAULT_BYTES
    explicit = EngineConfig(device="cpu", cpu_kv_cache_bytes=1 << 30, max_running_requests=4)
    assert explicit.cpu_kv_budget(100, 1000) == 1 << 30


def test_a_runner_sizes_its_pool_by_the_budget():
    model = random_model("tiny", torch.float32, "cpu")
    config = EngineConfig(
        device="cpu",
        disable_piecewise_cuda_graph=True,
        max_running_requests=2,
        context_length=64,
        page_size=16,
    )
    assert ModelRunner(config, model=model).kv_cache.num_slots == 2 * 64


class _Built(Exception):
    pass


@pytest.fixture
def built(monkeypatch) -> dict:
    """The keywords ``pcgspec generate`` builds its LLM with (nothing is built)."""
    seen: dict = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise _Built

    monkeypatch.setattr("pcgspec.llm.LLM", fake_llm)
    return seen


def _generate(path, *argv: str) -> None:
    with pytest.raises(_Built):
        main(["generate", "--model-path", str(path), *SMALL, *argv])


def test_generate_sizes_the_pool_to_its_prompts(built, smollm2_path):
    prompts = ["hi", "a longer prompt of a few more tokens than the first one"]
    _generate(
        smollm2_path,
        "--prompt",
        prompts[0],
        "--prompt",
        prompts[1],
        "--max-new-tokens",
        "20",
        "-n",
        "2",
    )
    tokenizer = load_tokenizer(smollm2_path)
    pages = sum(2 * -(-(len(tokenizer.encode(p)) + 20 + 16) // 16) for p in prompts)
    assert built["max_total_tokens"] == pages * 16 < 300


def test_generate_with_the_chat_template_counts_the_template(built, smollm2_path):
    _generate(smollm2_path, "--prompt", "hi", "--max-new-tokens", "20", "--chat")
    with_template = built["max_total_tokens"]
    _generate(smollm2_path, "--prompt", "hi", "--max-new-tokens", "20")
    assert with_template > built["max_total_tokens"]


@pytest.mark.parametrize(
    ("flag", "value"), [("--max-total-tokens", 1000), ("--cpu-kv-cache-bytes", 1 << 30)]
)
def test_generate_keeps_an_explicit_size(built, smollm2_path, flag, value):
    _generate(smollm2_path, flag, str(value))
    assert built[flag[2:].replace("-", "_")] == value
    assert flag == "--max-total-tokens" or built["max_total_tokens"] is None
