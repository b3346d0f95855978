"""GGUF conversion on a tiny Qwen2 file written here with the ``gguf`` library, its tensors in
every quantization the catalog's files hold (Q4_K, Q5_0, Q6_K, Q8_0, Q4_1, F32): the converted
weights equal ``gguf.quants.dequantize`` of the raw blocks, pcgspec's model on them equals
transformers' own GGUF loading, and the stop tokens land in the config.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from test_loader import prefill_logits
from test_models import hf_logits, random_ids
from transformers.convert_slow_tokenizer import bytes_to_unicode

from pcgspec.models.gguf import convert_gguf
from pcgspec.models.loader import load_model

HIDDEN, FFN, VOCAB, HEADS, KV_HEADS = 256, 512, 320, 2, 1  # K-quant rows are 256 wide
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
# name -> (quantization, rows, columns); one row means a 1-D tensor
TENSORS = {
    "token_embd.weight": (Q.Q4_K, VOCAB, HIDDEN),
    "output_norm.weight": (Q.F32, 1, HIDDEN),
    "output.weight": (Q.Q6_K, VOCAB, HIDDEN),
    "blk.0.attn_norm.weight": (Q.F32, 1, HIDDEN),
    "blk.0.ffn_norm.weight": (Q.F32, 1, HIDDEN),
    "blk.0.attn_q.weight": (Q.Q4_K, HIDDEN, HIDDEN),
    "blk.0.attn_q.bias": (Q.F32, 1, HIDDEN),
    "blk.0.attn_k.weight": (Q.Q5_0, HEAD_DIM * KV_HEADS, HIDDEN),
    "blk.0.attn_k.bias": (Q.F32, 1, HEAD_DIM * KV_HEADS),
    "blk.0.attn_v.weight": (Q.Q8_0, HEAD_DIM * KV_HEADS, HIDDEN),
    "blk.0.attn_v.bias": (Q.F32, 1, HEAD_DIM * KV_HEADS),
    "blk.0.attn_output.weight": (Q.Q6_K, HIDDEN, HIDDEN),
    "blk.0.ffn_gate.weight": (Q.Q4_1, FFN, HIDDEN),
    "blk.0.ffn_up.weight": (Q.Q4_K, FFN, HIDDEN),
    "blk.0.ffn_down.weight": (Q.Q6_K, HIDDEN, FFN),
}
# K-quant blocks: byte offsets of their float16 super-block scales, and a range that keeps the
# weights small; the other bytes (sub-block scales, quants) stay random.
K_SCALES = {Q.Q4_K: ((0, 2), (1e-5, 1e-4)), Q.Q6_K: ((208,), (2e-6, 2e-5))}


def raw_tensor(kind: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    if kind in K_SCALES:
        offsets, (low, high) = K_SCALES[kind]
        block, size = gguf.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        for at in offsets:
            scale = rng.uniform(low, high, size=(rows, cols // block)).astype(np.float16)
            blocks[..., at : at + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
        return blocks.reshape(rows, -1)
    weights = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if kind == Q.F32:
        return weights[0] if rows == 1 else weights
    return gguf.quants.quantize(weights, kind)


def write_tiny_qwen2(path: Path, seed: int = 0) -> dict[str, tuple[Q, np.ndarray]]:
    """A one-layer Qwen2 GGUF file with a byte-level vocabulary; returns each tensor's raw data."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    fillers = [f"tok{i}" for i in range(VOCAB - 256 - 1 - len(SPECIALS))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(byte_tokens + ["ab"] + fillers + SPECIALS)
    writer.add_token_types([1] * (VOCAB - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(VOCAB - 2)
    writer.add_eos_token_id(VOCAB - 1)
    raw = {}
    for name, (kind, rows, cols) in TENSORS.items():
        raw[name] = (kind, raw_tensor(kind, rows, cols, rng))
        writer.add_tensor(name, raw[name][1], raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(GGUF file, its converted folder, the raw tensors)."""
    root = tmp_path_factory.mktemp("tiny-qwen2-gguf")
    raw = write_tiny_qwen2(root / "tiny.gguf")
    out = convert_gguf(root / "tiny.gguf", root / "converted", stop_tokens=SPECIALS[::-1])
    return root / "tiny.gguf", out, raw


def test_converted_weights_equal_gguf_dequantize(tiny) -> None:
    _, out, raw = tiny
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, 1)
    state = load_file(out / "model.safetensors")
    matched = {}
    for key, tensor in state.items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        kind, data = raw[name]
        expected = gguf.quants.dequantize(data, kind).reshape(tensor.shape)
        assert torch.equal(tensor, torch.from_numpy(expected)), f"{key} ({kind.name})"
        matched[name] = kind
    assert set(matched) == set(TENSORS)
    assert set(matched.values()) == {Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0, Q.Q4_1, Q.F32}


def test_pcgspec_qwen2_equals_transformers_gguf_loading(tiny) -> None:
    from transformers import AutoModelForCausalLM

    path, out, _ = tiny
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ids = random_ids(9, seed=5)
    ours = prefill_logits(load_model(out, torch.float32, torch.device("cpu")), ids)
    theirs = hf_logits(hf.eval(), ids)
    assert theirs.abs().max() > 1e-3  # weights that say something
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_stop_tokens_become_the_eos_ids(tiny, tmp_path: Path) -> None:
    path, out, _ = tiny
    im_end, end_of_text = VOCAB - 1, VOCAB - 2
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [im_end, end_of_text]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [im_end, end_of_text]
    with pytest.raises(ValueError, match=r"stop_tokens \['<\|eot_id\|>'\] are not in"):
        convert_gguf(path, tmp_path / "never", stop_tokens=["<|im_end|>", "<|eot_id|>"])
    assert not (tmp_path / "never").exists()
