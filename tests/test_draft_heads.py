"""EAGLE3 and NEXTN/MTP draft heads: checkpoints in the published layouts load with every
tensor in its place, and the forward pass (paged KV cache, torch attention backend) matches a
pure-torch re-implementation that reads the checkpoint tensors by their published names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.attention.torch_backend import TorchAttentionBackend
from pcgspec.compile.backend import CompiledDecoder, PiecewiseBackend
from pcgspec.compile.forward_context import forward_context
from pcgspec.models.draft_head import DraftHead
from pcgspec.models.eagle3 import load_eagle3_head, write_eagle3_checkpoint
from pcgspec.models.loader import load_model
from pcgspec.models.mtp import MtpHead, load_mtp_head, write_mtp_checkpoint
from pcgspec.models.random_weights import SHAPES, random_model, shape_config
from pcgspec.models.registry import DRAFT_HEAD_REGISTRY
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.forward_batch import ForwardMode

CPU = torch.device("cpu")
PAGE_SIZE = 4
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# checkpoint name (under the layer prefix) -> our module, per MTP layout; the rest is the block
MTP_SPECIAL = {
    "deepseek": {
        "enorm": "enorm",
        "hnorm": "hnorm",
        "eh_proj": "eh_proj",
        "shared_head.norm": "final_norm",
    },
    "mimo": {
        "token_layernorm": "enorm",
        "hidden_layernorm": "hnorm",
        "input_proj": "eh_proj",
        "final_layernorm": "final_norm",
    },
}
PREFIX = {"deepseek": "model.layers.2.", "mimo": "model.mtp_layers.0."}


@pytest.fixture(scope="module")
def target() -> nn.Module:
    return random_model("tiny", torch.float32, CPU, seed=1)


def unfused_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by checkpoint-style name: fused projections split into their parts."""
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        *path, owner, leaf = name.split(".")
        if owner not in FUSED:
            state[name] = param
            continue
        sizes = module.get_submodule(".".join([*path, owner])).output_sizes
        for part, value in zip(FUSED[owner], param.split(sizes)):
            state[".".join([*path, part, leaf])] = value
    return state


def rewrite(src: Path, dst: Path, drop: tuple[str, ...] = (), add: dict | None = None) -> Path:
    """A copy of checkpoint folder ``src`` without ``drop`` and with ``add`` tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
    save_file(tensors, dst / "model.safetensors")
    return dst


def edit_config(folder: Path, **fields: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


# --- pure-torch reference -------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    d = x.shape[-1]
    freqs = pos[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    angles = torch.cat([freqs, freqs], -1)
    cos, sin = angles.cos().float(), angles.sin().float()
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def ref_attention(t: dict, p: str, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sequence ``x`` [T, in] with the tiny shape (4 / 2 heads)."""

    def proj(name: str, heads: int) -> torch.Tensor:
        y = x @ t[f"{p}self_attn.{name}.weight"].T + t.get(f"{p}self_attn.{name}.bias", 0)
        return y.view(len(x), heads, 16)

    q, k, v = proj("q_proj", 4), proj("k_proj", 2), proj("v_proj", 2)
    if f"{p}self_attn.q_norm.weight" in t:  # Qwen3: per-head norms before RoPE
        q, k = rms(q, t[f"{p}self_attn.q_norm.weight"]), rms(k, t[f"{p}self_attn.k_norm.weight"])
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / 4.0  # sqrt(head_dim 16)
    scores = scores.masked_fill(torch.ones(len(x), len(x)).triu(1).bool(), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(x), -1)
    return out @ t[f"{p}self_attn.o_proj.weight"].T


def ref_mlp(t: dict, p: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ t[f"{p}mlp.gate_proj.weight"].T, x @ t[f"{p}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def ref_eagle3(t: dict, embed, ids, pos, hidden) -> tuple[torch.Tensor, ...]:
    h = hidden @ t["fc.weight"].T if hidden.shape[-1] != 64 else hidden
    x = torch.cat(
        [
            rms(embed[ids], t["midlayer.input_layernorm.weight"]),
            rms(h, t["midlayer.hidden_norm.weight"]),
        ],
        -1,
    )
    r = h + ref_attention(t, "midlayer.", x, pos)
    y = r + ref_mlp(t, "midlayer.", rms(r, t["midlayer.post_attention_layernorm.weight"]))
    return rms(y, t["norm.weight"]), y


def ref_mtp(t: dict, layout: str, embed, ids, pos, hidden) -> tuple[torch.Tensor, ...]:
    p, n = PREFIX[layout], {ours: name for name, ours in MTP_SPECIAL[layout].items()}
    e = rms(torch.where(pos[:, None] == 0, 0.0, embed[ids]), t[f"{p}{n['enorm']}.weight"])
    h = rms(hidden, t[f"{p}{n['hnorm']}.weight"])
    x = torch.cat([h, e] if layout == "mimo" else [e, h], -1) @ t[f"{p}{n['eh_proj']}.weight"].T
    y = x + ref_attention(t, p, rms(x, t[f"{p}input_layernorm.weight"]), pos)
    y = y + ref_mlp(t, p, rms(y, t[f"{p}post_attention_layernorm.weight"]))
    normed = rms(y, t[f"{p}{n['final_norm']}.weight"])
    return normed, normed if layout == "mimo" else y


# --- driving a head through the paged KV cache ----------------------------------------------


class HeadDriver:
    def __init__(self, head: DraftHead, num_pages: int = 16) -> None:
        spec = KVCacheSpec(head.num_layers, head.num_kv_heads, head.head_dim, head.dtype)
        self.head, self.kv_cache = head, KVCache(spec, num_pages, PAGE_SIZE, CPU)
        self.backend = TorchAttentionBackend(
            self.kv_cache, head.num_heads, head.head_dim, head.attn_scale
        )

    @torch.inference_mode()
    def step(self, chunks: list[SeqChunk], hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = build_forward_batch(ForwardMode.DRAFT_EXTEND, chunks, PAGE_SIZE, "cpu")
        self.backend.init_forward_metadata(batch)
        with forward_context(batch, self.backend):
            return self.head(batch.input_ids, batch.positions, hidden)


def check_forward(head: DraftHead, reference, target: nn.Module, project=lambda h: h) -> None:
    """Prefill two sequences, then one step each on the head's own ``next_hidden``; every row
    equals ``reference(embed, ids, positions, hidden)`` run over the whole sequence at once
    (``project`` maps the target's hidden states to the head's width, as the head does).
    """
    gen = torch.Generator().manual_seed(3)
    lens, pages = (7, 5), ([0, 1, 2], [3, 4])
    ids = [torch.randint(0, head.vocab_size, (n + 1,), generator=gen) for n in lens]
    aux = [torch.randn(n, head.target_hidden_size, generator=gen) for n in lens]
    driver = HeadDriver(head)
    chunks = [SeqChunk(i[:n].tolist(), 0, p) for i, n, p in zip(ids, lens, pages)]
    logits_h, next_h = driver.step(chunks, torch.cat(aux))
    assert logits_h.shape == next_h.shape == (sum(lens), head.hidden_size)
    last = next_h[[lens[0] - 1, sum(lens) - 1]]
    chunks = [SeqChunk([i[n].item()], n, p) for i, n, p in zip(ids, lens, pages)]
    step_h, step_next = driver.step(chunks, last)
    embed = target.model.embed_tokens.weight.detach()
    for b, n in enumerate(lens):
        start = sum(lens[:b])
        pos = torch.arange(n + 1)
        first = reference(embed, ids[b][:n], pos[:n], aux[b])
        own = reference(embed, ids[b], pos, torch.cat([project(aux[b]), last[b : b + 1]]))
        for ours, ref in ((logits_h, first[0]), (next_h, first[1])):
            torch.testing.assert_close(ours[start : start + n], ref, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(step_h[b], own[0][n], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(step_next[b], own[1][n], atol=1e-5, rtol=1e-4)
    assert head.compute_logits(step_h).shape == (2, head.vocab_size)


# --- EAGLE3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocab,own_embed", [(None, False), (100, False), (100, True)])
def test_eagle3_checkpoint_loads_every_tensor(tmp_path, target, draft_vocab, own_embed) -> None:
    path = write_eagle3_checkpoint(tmp_path, shape_config("tiny"), 0, draft_vocab, own_embed)
    head = load_eagle3_head(path, target, torch.float32, CPU)
    tensors = load_file(path / "model.safetensors")
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    state = unfused_state(head)
    assert sorted(state) == sorted(tensors)
    for name, tensor in tensors.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)
    assert torch.equal(head.draft_to_target, torch.arange(len(d2t)) + d2t)
    assert t2d.sum() == len(d2t) == (draft_vocab or 512)
    assert head.identity_vocab == (draft_vocab is None)
    assert (head.embed_tokens is not None) == own_embed and head.target_hidden_size == 3 * 64
    half = load_eagle3_head(path, target, torch.bfloat16, CPU)
    assert half.dtype == torch.bfloat16 and half.draft_to_target.dtype == torch.int64


def test_eagle3_missing_extra_or_bad_tensors_raise(tmp_path, target) -> None:
    src = write_eagle3_checkpoint(tmp_path / "src", shape_config("tiny"), 0, draft_vocab_size=100)
    cases = {
        "extra": ({"add": {"midlayer.extra.weight": torch.zeros(1)}}, "midlayer.extra.weight"),
        "missing": ({"drop": ("midlayer.self_attn.k_proj.weight",)}, "self_attn.k_proj.weight"),
        "no-d2t": ({"drop": ("d2t",)}, "no 'd2t'"),
        "bad-d2t": ({"add": {"d2t": torch.full((100,), 500)}}, "'d2t' must map"),
        "bad-t2d": ({"add": {"t2d": torch.ones(512, dtype=torch.bool)}}, "'t2d'"),
    }
    for case, (change, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_eagle3_head(rewrite(src, tmp_path / case, **change), target, torch.float32, CPU)


def test_eagle3_logits_are_over_target_ids(tmp_path, target) -> None:
    path = write_eagle3_checkpoint(tmp_path, shape_config("tiny"), 0, draft_vocab_size=100)
    head = load_eagle3_head(path, target, torch.float32, CPU)
    tensors = load_file(path / "model.safetensors")
    target_ids = torch.arange(100) + tensors["d2t"]
    hidden = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    logits = head.compute_logits(hidden)
    assert logits.shape == (6, 512) and logits.dtype == torch.float32
    assert torch.equal(logits.isfinite(), tensors["t2d"].expand(6, -1))
    torch.testing.assert_close(logits[:, target_ids], hidden @ tensors["lm_head.weight"].T)
    assert set(logits.argmax(-1).tolist()) <= set(target_ids.tolist())
    _, best = head.top_tokens(hidden, 1)
    assert torch.equal(best[:, 0], logits.argmax(-1))  # argmax in the draft vocabulary
    scores, ids = head.top_tokens(hidden, 3)
    want = logits.log_softmax(-1).topk(3, dim=-1)
    assert torch.equal(ids, want.indices)
    torch.testing.assert_close(scores, want.values)


def test_eagle3_aux_layers(tmp_path, target) -> None:
    path = write_eagle3_checkpoint(tmp_path / "default", shape_config("tiny"), 0)
    head = load_eagle3_head(path, target, torch.float32, CPU)
    assert head.target_aux_layers(30) == (2, 15, 27) and head.target_aux_layers(2) == (2, 1, 0)
    for name, fields in {
        "nested": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]}},
        "top-level": {"eagle_aux_hidden_state_layer_ids": [1, 14, 26]},
    }.items():
        edit_config(folder := rewrite(path, tmp_path / name), **fields)
        head = load_eagle3_head(folder, target, torch.float32, CPU)
        assert head.target_aux_layers(30) == (2, 15, 27)  # layer outputs -> inputs of the next
        with pytest.raises(ValueError, match=r"eagle_aux_hidden_state_layer_ids .*\[26\]"):
            head.target_aux_layers(20)
    edit_config(folder := rewrite(path, tmp_path / "two"), eagle_aux_hidden_state_layer_ids=[1, 2])
    with pytest.raises(ValueError, match="must name 3 layers"):
        load_eagle3_head(folder, target, torch.float32, CPU)
    edit_config(
        folder := rewrite(path, tmp_path / "no-aux", drop=("fc.weight",)),
        eagle_config={"use_aux_hidden_state": False},
    )
    head = load_eagle3_head(folder, target, torch.float32, CPU)
    assert head.target_aux_layers(30) is None and head.target_hidden_size == 64


@pytest.mark.parametrize("own_embed", [False, True])
def test_eagle3_forward_matches_reference(tmp_path, target, own_embed) -> None:
    path = write_eagle3_checkpoint(tmp_path, shape_config("tiny"), 0, 100, own_embed)
    head = load_eagle3_head(path, target, torch.float32, CPU)
    t = load_file(path / "model.safetensors")

    def reference(embed, ids, pos, hidden):
        return ref_eagle3(t, t["embed_tokens.weight"] if own_embed else embed, ids, pos, hidden)

    check_forward(head, reference, target, project=lambda aux: aux @ t["fc.weight"].T)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_eagle3_compiled_head_matches_reference(tmp_path, target, compiler) -> None:
    """The head past its fc compiled into pieces around attention (as the draft runner does
    where the target runs piecewise): one trace serves the prefill and the one-token steps."""
    path = write_eagle3_checkpoint(tmp_path, shape_config("tiny"), 0, 100)
    head = load_eagle3_head(path, target, torch.float32, CPU)
    head.compiled_decoder = CompiledDecoder(head.decode, PiecewiseBackend(compiler))
    t = load_file(path / "model.safetensors")
    check_forward(
        head,
        lambda embed, ids, pos, hidden: ref_eagle3(t, embed, ids, pos, hidden),
        target,
        project=lambda aux: aux @ t["fc.weight"].T,
    )
    backend = head.compiled_decoder.backend
    assert backend.num_traces == 1 and len(backend.split.compute_pieces) == 2


def test_draft_runner_compiles_an_eagle3_head_where_the_target_runs_piecewise(tmp_path, target):
    from pcgspec.config import EngineConfig
    from pcgspec.speculative.draft_runner import DraftRunner

    path = write_eagle3_checkpoint(tmp_path, shape_config("tiny"), 0, 100)
    for piecewise, page_size in ((False, PAGE_SIZE), (True, PAGE_SIZE), (True, 1)):
        compiled = piecewise
        head = load_eagle3_head(path, target, torch.float32, CPU)
        config = EngineConfig(device="cpu", disable_piecewise_cuda_graph=not piecewise)
        assert config.use_piecewise is piecewise  # NOTE: the tests set PCGSPEC_CPU_PIECEWISE=1
        runner = DraftRunner(head, 8, page_size, config)
        assert (head.compiled_decoder is not None) is compiled
        if compiled:  # traced at construction, on tokens that wrote no KV
            assert head.compiled_decoder.backend.num_traces == 1
        cache = runner.kv_cache  # NOTE: padded tokens may land in the scratch slot past the end
        assert not any(t[: cache.num_slots].any() for t in (*cache.k, *cache.v))


# --- NEXTN / MTP ----------------------------------------------------------------------------


# (layout, target model_type): MiMo checkpoints are Qwen2 and carry their own target
MTP_CASES = [("deepseek", "llama"), ("deepseek", "qwen3"), ("mimo", "qwen2")]


def mtp_checkpoint(tmp_path: Path, layout: str, model_type: str) -> tuple[Path, nn.Module]:
    """(folder, target) of an untrained MTP layer for a tiny target."""
    from transformers import AutoConfig

    kwargs = SHAPES["tiny"][1] | {"architectures": [f"{model_type.capitalize()}ForCausalLM"]}
    config = AutoConfig.for_model(model_type, hidden_act="silu", **kwargs)
    path = write_mtp_checkpoint(tmp_path / layout, config, 0, layout)
    if layout == "mimo":
        return path, load_model(path, torch.float32, CPU)
    return path, random_model(config, torch.float32, CPU, seed=1)


@pytest.mark.parametrize("layout,model_type", MTP_CASES)
def test_mtp_checkpoint_loads_every_tensor(tmp_path, layout, model_type) -> None:
    path, target = mtp_checkpoint(tmp_path, layout, model_type)
    head = load_mtp_head(path, target, torch.float32, CPU)
    assert isinstance(head, MtpHead) and head.layout.prefix == PREFIX[layout]
    state, special = unfused_state(head), MTP_SPECIAL[layout]
    tensors = load_file(path / "model.safetensors")
    mtp = {k[len(PREFIX[layout]) :]: v for k, v in tensors.items() if k.startswith(PREFIX[layout])}
    ours = {}
    for name in mtp:
        module, _, leaf = name.rpartition(".")
        ours[name] = f"{special[module]}.{leaf}" if module in special else f"block.{name}"
    assert sorted(ours.values()) == sorted(state)
    for name, tensor in mtp.items():
        torch.testing.assert_close(state[ours[name]], tensor, atol=0, rtol=0, msg=name)
    if layout == "mimo":  # the target took every other tensor, the MTP layer none
        assert type(target).__name__ == "MiMoForCausalLM"
        target_state = unfused_state(target)
        assert sorted(target_state) == sorted(set(tensors) - {PREFIX[layout] + n for n in mtp})
        for name, tensor in target_state.items():
            torch.testing.assert_close(tensor, tensors[name], atol=0, rtol=0, msg=name)


def test_mimo_checkpoint_needs_the_mimo_architecture(tmp_path) -> None:
    path = write_mtp_checkpoint(tmp_path, shape_config("tiny"), 0, layout="mimo")
    assert json.loads((path / "config.json").read_text())["model_type"] == "mimo"
    edit_config(path, architectures=["Qwen2ForCausalLM"])
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.mtp_layers\.0\."):
        load_model(path, torch.float32, CPU)


def test_mtp_missing_extra_or_ignored_tensors(tmp_path) -> None:
    src, target = mtp_checkpoint(tmp_path, "deepseek", "llama")
    cases = {
        "extra": ({"add": {"model.layers.2.extra.weight": torch.zeros(1)}}, "layers.2.extra"),
        "missing": ({"drop": ("model.layers.2.hnorm.weight",)}, r"missing.*layers\.2\.hnorm"),
    }
    for case, (change, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            load_mtp_head(rewrite(src, tmp_path / case, **change), target, torch.float32, CPU)
    copies = {
        "model.layers.2.embed_tokens.weight": torch.zeros(512, 64),
        "model.layers.2.shared_head.head.weight": torch.zeros(512, 64),
    }
    load_mtp_head(rewrite(src, tmp_path / "copies", add=copies), target, torch.float32, CPU)
    plain = write_eagle3_checkpoint(tmp_path / "eagle", shape_config("tiny"), 0)
    with pytest.raises(ValueError, match="no MTP layer"):
        load_mtp_head(plain, target, torch.float32, CPU)


@pytest.mark.parametrize("layout,model_type", MTP_CASES)
def test_mtp_forward_matches_reference(tmp_path, layout, model_type) -> None:
    path, target = mtp_checkpoint(tmp_path, layout, model_type)
    head = load_mtp_head(path, target, torch.float32, CPU)
    assert head.target_aux_layers(2) is None and head.target_hidden_size == 64
    t = load_file(path / "model.safetensors")
    check_forward(head, lambda *args: ref_mtp(t, layout, *args), target)
    hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(head.compute_logits(hidden), target.compute_logits(hidden))


def test_draft_head_registry() -> None:
    assert DRAFT_HEAD_REGISTRY.get("EAGLE3") is load_eagle3_head
    assert DRAFT_HEAD_REGISTRY.get("NEXTN") is load_mtp_head
    with pytest.raises(ValueError, match="supported: EAGLE3, NEXTN"):
        DRAFT_HEAD_REGISTRY.get("MEDUSA")
