"""The real checkpoints of the catalog: Qwen2.5-Coder's converted weights equal the ``gguf``
library's dequantization of the published file; greedy output (Qwen: chat, Gemma 3: text)
equals transformers' own GGUF loading. Each runs only where the model is converted in the
cache already (hundreds of MB to download: `pcgspec models` says which are; `LLM(NAME)` fetches
one); a skip names it.
bench/results/greedy_equal_*.json hold longer runs of the same greedy check.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from script_modules import load_script

from pcgspec.models.catalog import GEMMA3_270M, QWEN25_CODER_05B, QWEN25_CODER_15B, ModelSource
from pcgspec.models.fetch import converted_dir, has_parts, is_cached, join_parts

QWEN2 = [QWEN25_CODER_05B, QWEN25_CODER_15B]


def needs_cached(source: ModelSource) -> None:
    """Skip unless ``source`` is converted and its wheels are downloaded."""
    if not is_cached(source) or not has_parts(source):
        pytest.skip(
            f"{source.name} is not in the cache ({converted_dir(source)}); fetch it once with "
            f"`python -c \"from pcgspec import LLM; LLM('{source.name}')\"`"
        )


@pytest.mark.parametrize("source", QWEN2, ids=lambda m: m.name)
def test_converted_weights_equal_gguf_dequantize(source: ModelSource, tmp_path: Path) -> None:
    needs_cached(source)
    reader = gguf.GGUFReader(join_parts(source, tmp_path))
    tensors = {t.name: t for t in reader.tensors}
    blocks = 1 + max(int(n.split(".")[1]) for n in tensors if n.startswith("blk."))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, blocks)
    kinds, matched = set(), set()
    with safe_open(converted_dir(source) / "model.safetensors", framework="pt") as weights:
        for key in weights.keys():
            name = names.get_name(key, try_suffixes=(".weight", ".bias"))
            raw = tensors[name]
            ours = weights.get_tensor(key)
            expected = gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(ours.shape)
            assert torch.equal(ours, torch.from_numpy(expected.copy())), key
            kinds.add(raw.tensor_type.name)
            matched.add(name)
    assert matched == set(tensors)
    assert {"Q4_K", "Q6_K"} <= kinds


def test_greedy_chat_equals_transformers_gguf_loading() -> None:
    """The 0.5B only (1.5 min); scripts/check_greedy_equal.py runs the 1.5B (3 min here)."""
    source = QWEN25_CODER_05B
    needs_cached(source)
    check = load_script("check_greedy_equal")
    prompts = ("Write a Python function that reverses a string.", "What is a Python decorator?")
    result = check.compare(source.name, prompts, max_tokens=24)
    assert set(result["stop_tokens"].values()) == {"<|im_end|>", "<|endoftext|>"}
    for row in result["prompts"]:
        assert row["prompt_ids_equal_gguf_tokenizer"], row["prompt"]
        assert row["equal"], row


def test_gemma3_greedy_text_equals_transformers_gguf_loading() -> None:
    """A base model: text prompts, one longer than its 512-token sliding window."""
    needs_cached(GEMMA3_270M)
    check = load_script("check_greedy_equal")
    prompts = (check.PLAIN_PROMPTS[0], check.PLAIN_PROMPTS[-1])
    result = check.compare(GEMMA3_270M.name, prompts, max_tokens=16, plain=True)
    assert result["prompts"][-1]["prompt_tokens"] > 512
    for row in result["prompts"]:
        assert row["prompt_ids_equal_gguf_tokenizer"], row["prompt"]
        assert row["equal"], row
