"""Gemma 3 against transformers' ``Gemma3ForCausalLM`` (float32, CPU): a tiny random model whose
sliding window (8 keys) is shorter than most prompts, through verify passes of the paged cache
and through ``LLM.generate`` (prefill, then decode past the window).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracle import assert_all_pages_free, assert_greedy_match, greedy, hf_greedy
from test_models import ATOL, GEMMA3, RTOL, Driver, hf_logits, random_ids, tiny_hf_model

from pcgspec import LLM
from pcgspec.models.gemma3 import check_gemma3_config
from pcgspec.models.loader import load_model
from pcgspec.runners.batch_builder import SeqChunk
from pcgspec.runners.forward_batch import ForwardMode

WINDOW = GEMMA3["sliding_window"]


@pytest.fixture(scope="module", params=[None, 3.0], ids=["no-softcap", "softcap-3"])
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, its saved folder): two sliding layers around a global one."""
    hf = tiny_hf_model("Gemma3TextConfig", **GEMMA3, final_logit_softcapping=request.param)
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, path


def test_verify_after_prefill_and_decode(gemma) -> None:
    """TARGET_VERIFY scores 4 tokens per request over a cache longer than the window."""
    hf, path = gemma
    ours = load_model(path, torch.float32, torch.device("cpu"))
    assert ours.sliding_windows == (WINDOW, None, WINDOW)
    seqs = [random_ids(20, seed=11), random_ids(17, seed=12)]
    refs = [hf_logits(hf, s) for s in seqs]
    driver = Driver(ours)
    pages = [driver.alloc(len(s)) for s in seqs]
    prompt_lens = [5, 10]
    driver.step(
        ForwardMode.EXTEND, [SeqChunk(s[:n], 0, p) for s, n, p in zip(seqs, prompt_lens, pages)]
    )
    for i in range(3):
        chunks = [SeqChunk([s[n + i]], n + i, p) for s, n, p in zip(seqs, prompt_lens, pages)]
        logits, _ = driver.step(ForwardMode.DECODE, chunks)
        ref = torch.stack([r[n + i] for r, n in zip(refs, prompt_lens)])
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)
    starts = [n + 3 for n in prompt_lens]
    chunks = [SeqChunk(s[i : i + 4], i, p) for s, i, p in zip(seqs, starts, pages)]
    logits, _ = driver.step(ForwardMode.TARGET_VERIFY, chunks)
    ref = torch.cat([r[i : i + 4] for r, i in zip(refs, starts)])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


def test_greedy_generate_equals_transformers(gemma, smollm2_path: Path) -> None:
    """Prompts shorter and longer than the window, batched, each decoding well past it."""
    hf, path = gemma
    llm = LLM(str(path), tokenizer=str(smollm2_path), dtype="float32", device="cpu")
    prompts = [random_ids(5, seed=13), random_ids(3 * WINDOW, seed=14), random_ids(9, seed=15)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_greedy_match(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 20))
    assert_all_pages_free(llm)


def test_triton_backend_greedy_equals_transformers(gemma, smollm2_path: Path) -> None:
    """The Triton kernels (interpreted on CPU) with the per-layer windows: a prefill longer
    than the window, then decode steps past it."""
    hf, path = gemma
    llm = LLM(
        str(path),
        tokenizer=str(smollm2_path),
        attention_backend="triton",
        dtype="float32",
        device="cpu",
    )
    backend = llm.engine.runner.attn_backend
    assert backend.name == "triton" and backend.sliding_windows == (WINDOW, None, WINDOW)
    prompts = [random_ids(3 * WINDOW, seed=16), random_ids(4, seed=17)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_greedy_match(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 16))
    assert_all_pages_free(llm)


def test_config_rejects_what_is_not_implemented(gemma) -> None:
    hf, _ = gemma
    check_gemma3_config(hf.config)
    for field, value, match in [
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "silu", "hidden_activation"),
        (
            "layer_types",
            ["sliding_attention", "chunked_attention", "sliding_attention"],
            "layer_types",
        ),
        ("sliding_window", 0, "sliding_window"),
    ]:
        config = hf.config.__class__.from_dict(hf.config.to_dict())
        setattr(config, field, value)
        with pytest.raises(ValueError, match=match):
            check_gemma3_config(config)
