"""The piecewise backend end to end: one trace for every token count, outputs equal to eager
(eager and inductor piece compilers), capture/replay per bucket (emulated on CPU, CUDA graphs
in the ``gpu`` tests).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.compile.backend import CompiledDecoder, PiecewiseBackend
from pcgspec.compile.buckets import DEFAULT_BUCKETS, capture_buckets, pad_to_bucket
from pcgspec.compile.forward_context import forward_context
from pcgspec.compile.piecewise import PiecewiseGraphs
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardBatch, ForwardMode

PAGE_SIZE, NUM_PAGES, VOCAB = 4, 96, 64
TOKEN_COUNTS = [7, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 31, 33, 40, 63, 64, 65, 100, 127, 128]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


class ToyDecoder(nn.Module):
    """Llama-shaped: embedding, per layer RMSNorm -> qkv (GQA) -> attention op -> o_proj
    -> residual -> RMSNorm -> SiLU MLP -> residual, final RMSNorm.
    """

    def __init__(self, num_layers: int = 3, heads: int = 4, kv_heads: int = 2, dim: int = 8):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        width = heads * dim
        self.embed = nn.Embedding(VOCAB, width)
        self.qkv = nn.ModuleList(
            nn.Linear(width, (heads + 2 * kv_heads) * dim) for _ in range(num_layers)
        )
        self.o = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))
            for _ in range(num_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) * torch.cos(positions[:, None] * 0.1)
        for i in range(len(self.qkv)):
            qkv = self.qkv[i](F.rms_norm(h, h.shape[-1:]))
            q, k, v = qkv.split([self.heads * self.dim, *[self.kv_heads * self.dim] * 2], -1)
            q = q.view(-1, self.heads, self.dim)
            k, v = k.view(-1, self.kv_heads, self.dim), v.view(-1, self.kv_heads, self.dim)
            out = torch.empty_like(q)
            torch.ops.pcgspec.attention(q, k, v, out, i)
            h = h + self.o[i](out.view(-1, self.heads * self.dim))
            h = h + self.mlp[i](F.rms_norm(h, h.shape[-1:]))
        return F.rms_norm(h, h.shape[-1:])


class Driver:
    """Runs a decoder like the engine: paged KV cache, torch attention, forward_context."""

    def __init__(
        self, num_layers: int, kv_heads: int, dim: int, heads: int, device: str = "cpu"
    ) -> None:
        spec = KVCacheSpec(num_layers, kv_heads, dim, torch.float32)
        self.device = torch.device(device)
        self.kv = KVCache(spec, NUM_PAGES, PAGE_SIZE, self.device)
        self.attn = TorchAttentionBackend(self.kv, heads, dim, dim**-0.5)
        self.rng = random.Random(0)

    def batch(self, num_tokens: int, prefix: int = 0) -> ForwardBatch:
        """1-3 requests with ``num_tokens`` new tokens in all, each on its own pages."""
        cuts = sorted(self.rng.sample(range(1, num_tokens), min(2, num_tokens - 1)))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, num_tokens])]
        chunks, page = [], 0
        for n in lens:
            pages = -(-(prefix + n) // PAGE_SIZE)
            ids = [self.rng.randrange(VOCAB) for _ in range(n)]
            chunks.append(SeqChunk(ids, prefix, list(range(page, page + pages))))
            page += pages
        return build_forward_batch(ForwardMode.EXTEND, chunks, PAGE_SIZE, self.device)

    def run(self, decoder: Callable[..., object], batch: ForwardBatch, **kw: object) -> object:
        self.attn.init_forward_metadata(batch)
        with forward_context(batch, self.attn), torch.inference_mode():
            return decoder(batch.input_ids, batch.positions, **kw)


def pad(batch: ForwardBatch, bucket: int) -> ForwardBatch:
    """The batch padded to ``bucket`` tokens: padded rows write no KV (``out_cache_loc`` -1)."""
    extra = bucket - batch.num_tokens

    def grow(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (0, extra), value=value)

    return dataclasses.replace(
        batch,
        input_ids=grow(batch.input_ids, 0),
        positions=grow(batch.positions, 0),
        out_cache_loc=grow(batch.out_cache_loc, -1),
    )


def toy_setup(device: str = "cpu", **kw: int) -> tuple[nn.Module, Driver]:
    torch.manual_seed(0)
    model = ToyDecoder(**kw).eval().to(device)
    return model, Driver(len(model.qkv), model.kv_heads, model.dim, model.heads, device)


def llama_setup(device: str = "cpu") -> tuple[nn.Module, Driver]:
    """A tiny random Llama decoder stack that also returns EAGLE3 aux hidden states."""
    transformers = pytest.importorskip("transformers")
    from pcgspec.models.llama import LlamaForCausalLM

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(device)
    model.set_aux_hidden_layers([1, 2, 4])
    return model.model, Driver(4, 2, 8, 4, device)


def first_rows(out: object, n: int) -> object:
    return tuple(x[:n] for x in out) if isinstance(out, tuple) else out[:n]


def capture_and_check_replays(
    decoder: CompiledDecoder, model: nn.Module, driver: Driver, buckets: list[int], tol: float
) -> None:
    """Trace, capture ``buckets``, then replay padded batches (inputs copied in, or already in
    the captured buffers) interleaving buckets, against the eager model.
    """
    graphs = decoder.graphs
    driver.run(decoder, driver.batch(6))
    size = max(buckets)
    ids_buf = torch.zeros(size, dtype=torch.int64, device=driver.device)
    pos_buf = torch.zeros_like(ids_buf)

    def in_buffers(batch: ForwardBatch) -> ForwardBatch:
        n = batch.num_tokens
        ids_buf[:n], pos_buf[:n] = batch.input_ids, batch.positions
        return dataclasses.replace(batch, input_ids=ids_buf[:n], positions=pos_buf[:n])

    graphs.capture(buckets, lambda b: driver.run(decoder, in_buffers(pad(driver.batch(2), b))))
    assert graphs.captured == set(buckets)
    assert graphs.num_graphs == len(buckets) * len(decoder.backend.split.compute_pieces)
    for i, num_tokens in enumerate((1, 3, size, 4, 5, 8, 13, 16, 2, size - 1)):
        batch = driver.batch(num_tokens, prefix=num_tokens % 3)
        expected = driver.run(model, batch)
        bucket = pad_to_bucket(num_tokens, buckets)
        padded = pad(batch, bucket)
        got = driver.run(
            functools.partial(decoder.replay, bucket), in_buffers(padded) if i % 2 else padded
        )
        torch.testing.assert_close(first_rows(got, num_tokens), expected, rtol=tol, atol=tol)
    assert decoder.backend.num_traces == 1


def check_one_trace_all_counts(
    decoder: CompiledDecoder, model: nn.Module, driver: Driver, counts: Sequence[int]
) -> None:
    counters.clear()
    for num_tokens in counts:
        batch = driver.batch(num_tokens, prefix=num_tokens % 5)
        expected = driver.run(model, batch)
        got = driver.run(decoder, batch)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert decoder.backend.num_traces == 1
    assert counters["stats"]["unique_graphs"] == 1


def test_eager_pieces_one_trace_for_20_token_counts():
    model, driver = toy_setup()
    decoder = CompiledDecoder(model, PiecewiseBackend("eager"))
    check_one_trace_all_counts(decoder, model, driver, TOKEN_COUNTS)
    assert decoder.backend.split.num_split_points == 3


@pytest.mark.slow
def test_inductor_pieces_one_trace_and_cached_second_start(tmp_path):
    model, driver = toy_setup(num_layers=3)
    hits = []
    for _ in ("cold start", "warm start"):
        torch._dynamo.reset()
        decoder = CompiledDecoder(model, PiecewiseBackend("inductor", cache_dir=tmp_path))
        check_one_trace_all_counts(decoder, model, driver, [6, 1, 3, 17, 40])
        hits.append(counters["inductor"]["fxgraph_cache_hit"])
    assert hits[0] >= 1  # the two middle pieces are the same graph over other weights
    assert hits[1] == 4  # every piece


@pytest.mark.slow
def test_inductor_pieces_keep_residual_adds_out_of_the_gemms(tmp_path):
    """A Llama's pieces under Inductor: every projection a plain GEMM (no ``addmm`` taking a
    residual, which CUDA would copy before each GEMM: ``compile/passes.py``) with no kernel more
    than Inductor's own pieces launch, and eager's outputs."""
    from torch._inductor.compile_fx import compile_fx

    def inductor_alone(piece: nn.Module, example_inputs: list[object]) -> Callable[..., object]:
        return compile_fx(piece, example_inputs, config_patches={"triton.cudagraphs": False})

    model, driver = llama_setup()
    codes = {}
    for name, compiler in (("pass", "inductor"), ("alone", inductor_alone)):
        torch._dynamo.reset()
        decoder = CompiledDecoder(model, PiecewiseBackend(compiler, cache_dir=tmp_path / name))
        batch = driver.batch(9, prefix=2)
        with torch._inductor.config.patch(fx_graph_cache=False):  # NOTE: traces and compiles
            got, code = run_and_get_code(driver.run, decoder, batch)
        codes[name] = "\n".join(code)
        torch.testing.assert_close(got, driver.run(model, batch), rtol=1e-5, atol=1e-5)
        batch = driver.batch(3, prefix=1)
        expected = driver.run(model, batch)
        torch.testing.assert_close(driver.run(decoder, batch), expected, rtol=1e-5, atol=1e-5)
    assert "extern_kernels.addmm(" not in codes["pass"]
    assert codes["alone"].count("extern_kernels.addmm(") == 2 * 4  # two residual adds a layer
    assert codes["pass"].count("extern_kernels.mm(") == 4 * 4  # qkv, o, gate_up, down

    def kernels(code: str) -> int:  # launches, not definitions
        return len(re.findall(r"^\s+cpp_fused_\w+\(", code, re.MULTILINE))

    assert kernels(codes["pass"]) == kernels(codes["alone"]) > 0


def test_plain_torch_compile_with_guards_traces_once_then_refuses_to_retrace():
    model, driver = toy_setup(num_layers=2)
    backend = PiecewiseBackend("eager")
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)

    def call(input_ids: torch.Tensor, positions: torch.Tensor) -> object:
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        return compiled(input_ids, positions)

    for num_tokens in (5, 9, 2, 30):
        batch = driver.batch(num_tokens)
        torch.testing.assert_close(driver.run(call, batch), driver.run(model, batch))
    assert backend.num_traces == 1
    with pytest.raises(Exception, match="invoked a second time"):
        driver.run(compiled, driver.batch(1))  # Dynamo specializes 1: a recompile


@pytest.mark.parametrize("setup", [toy_setup, llama_setup])
def test_capture_and_replay_per_bucket(setup):
    model, driver = setup()
    graphs = PiecewiseGraphs("cpu")
    decoder = CompiledDecoder(model, PiecewiseBackend("eager", graphs=graphs))
    capture_and_check_replays(decoder, model, driver, [4, 8, 16], tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
@pytest.mark.parametrize("setup", [toy_setup, llama_setup])
def test_cuda_graphs_capture_and_replay(setup, piece_compiler, tmp_path):
    model, driver = setup("cuda")
    decoder = CompiledDecoder(model, PiecewiseBackend(piece_compiler, cache_dir=tmp_path))
    capture_and_check_replays(decoder, model, driver, [4, 8, 16, 32], tol=1e-4)
    assert decoder.graphs.pool is not None  # a shared CUDA graph pool was used


def test_replay_refuses_uncaptured_buckets_unpadded_inputs_and_nesting():
    model, driver = toy_setup(num_layers=1)
    graphs = PiecewiseGraphs("cpu")
    decoder = CompiledDecoder(model, PiecewiseBackend("eager", graphs=graphs))
    driver.run(decoder, driver.batch(4))
    graphs.capture([8], lambda bucket: driver.run(decoder, pad(driver.batch(3), bucket)))
    with pytest.raises(ValueError, match="no graphs captured for 4"):
        driver.run(functools.partial(decoder.replay, 4), driver.batch(4))
    with pytest.raises(ValueError, match="pad every input"):
        driver.run(functools.partial(decoder.replay, 8), driver.batch(5))
    with pytest.raises(RuntimeError, match="nesting"), graphs.capturing(8):
        with graphs.capturing(8):
            pass
    with pytest.raises(RuntimeError, match="never returned from the decoder"):
        with graphs.capturing(8):
            pass


def test_a_piece_compiler_that_specializes_the_token_count_is_caught():
    model, driver = toy_setup(num_layers=1)

    def specializing(piece: torch.fx.GraphModule, fakes: list[object]) -> torch.fx.GraphModule:
        sizes = [x.shape[0] for x in fakes if isinstance(x, torch.Tensor) and x.dim()]
        int(next(s for s in sizes if isinstance(s, torch.SymInt)))  # guards "T == traced T"
        return piece

    decoder = CompiledDecoder(model, PiecewiseBackend(specializing))
    with pytest.raises(Exception, match="specialized"):
        driver.run(decoder, driver.batch(5))


def test_call_signature_is_fixed_at_trace():
    model, driver = toy_setup(num_layers=1)
    decoder = CompiledDecoder(model, PiecewiseBackend("eager"))
    with pytest.raises(ValueError, match="at least 2 tokens"):
        driver.run(decoder, driver.batch(1))
    driver.run(decoder, driver.batch(3))
    batch = driver.batch(3)
    with pytest.raises(ValueError, match="traced for arguments"):
        driver.run(decoder, dataclasses.replace(batch, positions=batch.positions.int()))


def test_tiny_llama_with_aux_hidden_states_one_trace():
    model, driver = llama_setup()
    decoder = CompiledDecoder(model, PiecewiseBackend("eager"))
    check_one_trace_all_counts(decoder, model, driver, [9, 1, 4, 23])
    assert decoder.backend.split.num_split_points == 4
    assert len(decoder.backend.split.compute_pieces) == 5


def test_buckets():
    assert DEFAULT_BUCKETS[:9] == (4, 8, 12, 16, 20, 24, 28, 32, 48)
    assert DEFAULT_BUCKETS[-2:] == (3840, 4096) and 1024 in DEFAULT_BUCKETS
    assert all(a < b for a, b in zip(DEFAULT_BUCKETS, DEFAULT_BUCKETS[1:]))
    assert capture_buckets(512)[-1] == 512 and capture_buckets(500)[-2:] == [480, 500]
    assert capture_buckets(2) == [2] and capture_buckets(8192)[-2:] == [4096, 8192]
    assert capture_buckets(100, explicit=[64, 8, 8, 128]) == [8, 64]
    buckets = capture_buckets(100)
    assert [pad_to_bucket(n, buckets) for n in (1, 4, 5, 33, 100, 101)] == [4, 4, 8, 48, 100, None]
    with pytest.raises(ValueError, match="max_tokens"):
        capture_buckets(0)
