"""Loading: folder layouts, error messages, and the real default model (GGUF -> HF folder)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from test_models import Driver, hf_logits, random_ids, tiny_hf_model

from pcgspec.models.default_model import default_model_path
from pcgspec.models.loader import load_model, load_tokenizer
from pcgspec.runners.batch_builder import SeqChunk
from pcgspec.runners.forward_batch import ForwardMode

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("LlamaConfig").save_pretrained(path)
    return path


def prefill_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:  # [L, V]
    driver = Driver(model, num_pages=(len(ids) + 3) // 4 + 1)
    return driver.step(ForwardMode.EXTEND, [SeqChunk(ids, 0, driver.alloc(len(ids)))])[0]


def test_missing_path_names_what_was_looked_for(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*config\.json.*\.gguf"):
        load_model(missing, torch.float32, CPU)
    with pytest.raises(FileNotFoundError, match=rf"no config\.json in model folder '{tmp_path}'"):
        load_model(tmp_path, torch.float32, CPU)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(tmp_path / "weights.bin", torch.float32, CPU)


def test_missing_weights(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors\.index\.json and \*\.safe"):
        load_model(tmp_path, torch.float32, CPU)
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(tmp_path, torch.float32, CPU)


def test_unsupported_architecture_lists_supported(tiny_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["MyLM"]}))
    supported = (
        "Gemma3ForCausalLM, LlamaForCausalLM, MiMoForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    )
    with pytest.raises(ValueError, match=f"'MyLM'; supported: {supported}"):
        load_model(tmp_path, torch.float32, CPU)


def test_load_weights_rejects_unknown_missing_and_misshapen(tiny_dir: Path) -> None:
    model = load_model(tiny_dir, torch.float32, CPU)
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    hf_state = tiny_hf_model("LlamaConfig").state_dict()
    with pytest.raises(ValueError, match="unexpected weight 'model.extra.weight'"):
        model.load_weights([("model.extra.weight", torch.zeros(1))])
    partial = {k: v for k, v in hf_state.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"1 parameters missing.*layers\.1\.self_attn\.k_proj"):
        model.load_weights(partial.items())
    with pytest.raises(ValueError, match=r"k_proj.weight'.*shape \(3, 64\) != parameter"):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 64))])
    model.load_weights(hf_state.items())  # the full checkpoint loads again, fused shards included
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, state[name], atol=0, rtol=0)


def test_shards_without_index(tmp_path: Path) -> None:
    hf = tiny_hf_model("Qwen3Config", head_dim=32)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    (tmp_path / "model.safetensors.index.json").unlink()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = random_ids(7, seed=11)
    logits = prefill_logits(load_model(tmp_path, torch.float32, CPU), ids)
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> torch.nn.Module:
    return load_model(smollm2_path, torch.float32, CPU)


def chat_ids(path: Path, question: str) -> list[int]:
    tokenizer = load_tokenizer(path)
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_default_model_matches_transformers(smollm2_path: Path, smollm2) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    ids = chat_ids(smollm2_path, "Name three colors.")
    torch.testing.assert_close(prefill_logits(smollm2, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_default_model_reloads_fast_and_identical(smollm2_path: Path, smollm2) -> None:
    start = time.perf_counter()
    assert default_model_path() == smollm2_path  # cached: no second conversion
    reloaded = load_model(smollm2_path, torch.float32, CPU)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"reloading the converted model took {elapsed:.1f} s"
    ids = random_ids(16, seed=12)
    assert torch.equal(prefill_logits(reloaded, ids), prefill_logits(smollm2, ids))


def test_default_model_answers(smollm2_path: Path, smollm2) -> None:
    """A wrong conversion (e.g. q/k rows left permuted) still loads, but talks nonsense."""
    tokenizer = load_tokenizer(smollm2_path)
    ids = chat_ids(smollm2_path, "What is the capital of France?")
    driver = Driver(smollm2, num_pages=32)
    pages = driver.alloc(len(ids) + 12)
    logits, _ = driver.step(ForwardMode.EXTEND, [SeqChunk(ids, 0, pages)])
    out = [int(logits[-1].argmax())]
    for pos in range(len(ids), len(ids) + 11):
        logits, _ = driver.step(ForwardMode.DECODE, [SeqChunk(out[-1:], pos, pages)])
        out.append(int(logits[-1].argmax()))
    assert "Paris" in tokenizer.decode(out)
