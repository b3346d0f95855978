"""Llama / Qwen2 / Qwen3 / Gemma 3 against Hugging Face transformers, through the paged KV cache.

Tiny random models (weights re-drawn so logits are O(1) and every parameter matters) are
saved with ``save_pretrained``, loaded with ``load_model`` and driven like the engine does:
``build_forward_batch`` -> ``TorchAttentionBackend`` -> ``forward_context`` -> model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn

from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.compile.forward_context import forward_context
from pcgspec.models.loader import load_model
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardMode

PAGE_SIZE = 4
ATOL = RTOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # small, so the test positions hit all three bands
}
# a sliding window shorter than most test sequences, a local RoPE base, a query scale of its own
GEMMA3 = {
    "head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": True,
}
# name -> (config class, extra config kwargs, save_pretrained max_shard_size)
CASES = {
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}, None),
    "llama3-rope-untied": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE}, None),
    "qwen2-sharded": ("Qwen2Config", {"tie_word_embeddings": False}, "100KB"),
    "qwen3-tied": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, None),
    "gemma3-window-8": ("Gemma3TextConfig", GEMMA3, None),
}


def tiny_hf_model(config_cls: str, **overrides: object) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **{"tie_word_embeddings": False, **overrides},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.2)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    config_cls, overrides, shard_size = CASES[request.param]
    hf = tiny_hf_model(config_cls, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    if shard_size:
        assert len(list(path.glob("*.safetensors"))) > 1
    return hf, load_model(path, torch.float32, torch.device("cpu"))


class Driver:
    """Runs our model like the engine: paged KV cache, torch attention, forward_context."""

    def __init__(self, model: nn.Module, num_pages: int = 64) -> None:
        spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
        self.model = model
        self.kv_cache = KVCache(spec, num_pages, PAGE_SIZE, torch.device("cpu"))
        self.backend = TorchAttentionBackend(
            self.kv_cache, model.num_heads, model.head_dim, model.attn_scale, model.sliding_windows
        )
        self.free_pages = list(range(num_pages))

    def alloc(self, num_tokens: int) -> list[int]:
        n = math.ceil(num_tokens / PAGE_SIZE)
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    @torch.inference_mode()
    def step(
        self, mode: ForwardMode, chunks: Sequence[SeqChunk]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of every new token [T, V] and the aux hidden states."""
        batch = build_forward_batch(mode, chunks, PAGE_SIZE, "cpu")
        self.backend.init_forward_metadata(batch)
        with forward_context(batch, self.backend):
            hidden, aux = self.model(batch.input_ids, batch.positions)
        return self.model.compute_logits(hidden), aux


@torch.inference_mode()
def hf_logits(hf: nn.Module, ids: Sequence[int]) -> torch.Tensor:  # [L, V]
    return hf(torch.tensor([list(ids)])).logits[0].float()


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_batch_of_two(models) -> None:
    hf, ours = models
    a, b = random_ids(11, seed=1), random_ids(7, seed=2)
    driver = Driver(ours)
    chunks = [SeqChunk(a, 0, driver.alloc(len(a))), SeqChunk(b, 0, driver.alloc(len(b)))]
    logits, aux = driver.step(ForwardMode.EXTEND, chunks)
    assert aux is None and logits.dtype == torch.float32
    ref = torch.cat([hf_logits(hf, a), hf_logits(hf, b)])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


def test_decode_after_prefill(models) -> None:
    hf, ours = models
    seqs = [random_ids(14, seed=3), random_ids(10, seed=4)]
    prompt_lens = [9, 4]
    refs = [hf_logits(hf, s) for s in seqs]
    driver = Driver(ours)
    pages = [driver.alloc(len(s)) for s in seqs]
    chunks = [SeqChunk(s[:n], 0, p) for s, n, p in zip(seqs, prompt_lens, pages)]
    logits, _ = driver.step(ForwardMode.EXTEND, chunks)
    ref = torch.cat([r[:n] for r, n in zip(refs, prompt_lens)])
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)
    for step in range(5):
        starts = [n + step for n in prompt_lens]
        chunks = [SeqChunk([s[i]], i, p) for s, i, p in zip(seqs, starts, pages)]
        logits, _ = driver.step(ForwardMode.DECODE, chunks)
        ref = torch.stack([r[i] for r, i in zip(refs, starts)])
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=RTOL)


def test_chunked_prefill(models) -> None:
    hf, ours = models
    ids = random_ids(13, seed=5)
    ref = hf_logits(hf, ids)
    driver = Driver(ours)
    pages = driver.alloc(len(ids))
    for start, end in [(0, 5), (5, 9), (9, 13)]:
        logits, _ = driver.step(ForwardMode.EXTEND, [SeqChunk(ids[start:end], start, pages)])
        torch.testing.assert_close(logits, ref[start:end], atol=ATOL, rtol=RTOL)


def test_aux_hidden_states_are_layer_inputs(models) -> None:
    hf, ours = models
    ids = random_ids(9, seed=6)
    with torch.inference_mode():
        hf_hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    driver = Driver(ours)
    ours.set_aux_hidden_layers([1, 2, ours.num_layers])
    try:
        logits, aux = driver.step(ForwardMode.EXTEND, [SeqChunk(ids, 0, driver.alloc(9))])
    finally:
        ours.set_aux_hidden_layers([])
    h = ours.hidden_size
    assert aux.shape == (len(ids), 3 * h)
    torch.testing.assert_close(aux[:, : 2 * h], torch.cat([hf_hidden[1][0], hf_hidden[2][0]], -1))
    # NOTE: HF's last hidden state is post-norm; ours for id L is the final pre-norm stream.
    with torch.inference_mode():
        final = ours.compute_logits(ours.model.norm(aux[:, 2 * h :]))
    torch.testing.assert_close(final, logits)


def test_model_interface(models) -> None:
    hf, ours = models
    config = hf.config
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (3, 4, 2)
    assert ours.head_dim == (getattr(config, "head_dim", None) or 64 // 4)
    assert (ours.hidden_size, ours.vocab_size, ours.dtype) == (64, 256, torch.float32)
    assert ours.attn_scale == getattr(config, "query_pre_attn_scalar", ours.head_dim) ** -0.5
    tied = config.tie_word_embeddings
    assert (ours.lm_head is ours.model.embed_tokens) == tied
    inv_freqs = [b for n, b in ours.model.rotary_emb.named_buffers() if n.endswith("inv_freq")]
    assert inv_freqs and all(f.dtype == torch.float32 for f in inv_freqs)
    with pytest.raises(ValueError, match="outside 0..3"):
        ours.set_aux_hidden_layers([4])


def test_logits_written_into_out(models) -> None:
    """``compute_logits(hidden, out=)`` (the graphs' shared logits buffer) writes what it
    returns without ``out`` into ``out`` (Gemma 3's soft-capping included); a wrong shape is
    refused."""
    hf, ours = models
    hidden = torch.randn(3, ours.hidden_size, generator=torch.Generator().manual_seed(0))
    want = ours.compute_logits(hidden)
    out = torch.full((3, ours.vocab_size), float("nan"))
    assert ours.compute_logits(hidden, out=out) is out
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"out \(4, 256\) must be \[3, 256\]"):
        ours.compute_logits(hidden, out=torch.empty(4, ours.vocab_size))


@pytest.mark.gpu
def test_16_bit_logits_written_in_float32_by_the_gemm() -> None:
    """On CUDA a bf16 LM head's float32 logits come from the GEMM itself: into ``out`` when
    given, equal to the float32 product of the same bf16 operands to float32 rounding (a bf16
    product cast afterwards is off by bf16's step), the same with and without ``out``."""
    from pcgspec.models.layers.linear import VocabParallelEmbedding

    gen = torch.Generator(device="cuda").manual_seed(0)
    head = VocabParallelEmbedding(5000, 64).cuda().to(torch.bfloat16)
    head.weight.data.normal_(generator=gen)
    hidden = torch.randn(7, 64, device="cuda", generator=gen).to(torch.bfloat16)
    exact = hidden.float() @ head.weight.float().t()
    out = torch.full((7, 5000), float("nan"), device="cuda")
    assert head.logits(hidden, out=out) is out
    torch.testing.assert_close(out, exact, atol=1e-3, rtol=1e-5)
    rounded = (hidden @ head.weight.t()).float()
    assert (rounded - exact).abs().max() > 10 * (out - exact).abs().max()
    torch.testing.assert_close(head.logits(hidden), out, atol=0, rtol=0)


def test_input_embeds_replace_embedding(models) -> None:
    _, ours = models
    ids = random_ids(6, seed=7)
    driver = Driver(ours)
    chunk = [SeqChunk(ids, 0, driver.alloc(6))]
    batch = build_forward_batch(ForwardMode.EXTEND, chunk, PAGE_SIZE, "cpu")
    outs = []
    with torch.inference_mode():
        for embeds in (None, ours.model.embed_tokens(batch.input_ids)):
            driver.backend.init_forward_metadata(batch)
            with forward_context(batch, driver.backend):
                outs.append(ours(batch.input_ids, batch.positions, embeds)[0])
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_bfloat16_close_to_hf_bfloat16(tmp_path: Path) -> None:
    hf = tiny_hf_model("LlamaConfig", rope_scaling=LLAMA3_ROPE)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    assert ours.dtype == torch.bfloat16
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = random_ids(12, seed=8)
    driver = Driver(ours)
    logits, _ = driver.step(ForwardMode.EXTEND, [SeqChunk(ids, 0, driver.alloc(12))])
    ref = hf_logits(hf.to(torch.bfloat16), ids)
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


# NOTE: engines built earlier in the session left entries on the same forward's code object;
# Dynamo's per-code limit (8) counts them too.
@torch._dynamo.config.patch(recompile_limit=64)
def test_decoder_traces_as_one_graph(models) -> None:
    """``model.model`` is what gets compiled: one graph, no breaks, dynamic token count."""
    hf, ours = models
    graphs: list[torch.fx.GraphModule] = []

    def count_graphs(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(ours.model, backend=count_graphs, fullgraph=True, dynamic=True)
    ours.set_aux_hidden_layers([0, 2])
    try:
        for n, seed in [(5, 9), (8, 10)]:
            ids = random_ids(n, seed)
            driver = Driver(ours)
            batch = build_forward_batch(
                ForwardMode.EXTEND, [SeqChunk(ids, 0, driver.alloc(n))], PAGE_SIZE, "cpu"
            )
            driver.backend.init_forward_metadata(batch)
            with torch.inference_mode(), forward_context(batch, driver.backend):
                hidden, aux = compiled(batch.input_ids, batch.positions)
            ref = hf_logits(hf, ids)
            torch.testing.assert_close(ours.compute_logits(hidden), ref, atol=ATOL, rtol=RTOL)
            assert aux.shape == (n, 2 * ours.hidden_size)
        assert len(graphs) == 1, "the second token count recompiled"
    finally:
        ours.set_aux_hidden_layers([])
        torch.compiler.reset()
