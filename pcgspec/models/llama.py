"""Llama (SmolLM2, Llama 3.x). Qwen2 and Qwen3 reuse it through ``AttentionFlags``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import pcgspec.compile.custom_ops  # noqa: F401  (registers torch.ops.pcgspec.attention)
from pcgspec.distributed.group import SINGLE, TPGroup
from pcgspec.models.layers.linear import MergedLinear, RowParallelLinear, VocabParallelEmbedding
from pcgspec.models.layers.norm import RMSNorm
from pcgspec.models.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from pcgspec.models.layers.weights import load_named_weights

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class AttentionFlags:
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k, before RoPE


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_config(config: PretrainedConfig) -> None:
    """Reject settings these models do not implement, before any weight is read."""
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")


def kv_head_split(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing each): split when there are at least as many KV heads
    as ranks, else each head replicated on ``tp.size / num_kv_heads`` consecutive ranks.
    """
    if num_kv_heads >= tp.size:
        return tp.shard(num_kv_heads, "num_key_value_heads"), 1
    if tp.size % num_kv_heads:
        raise ValueError(
            f"tp_size ({tp.size}) must divide num_key_value_heads "
            f"({num_kv_heads}) or be a multiple of it"
        )
    return 1, tp.size // num_kv_heads


class LlamaAttention(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int, flags: AttentionFlags, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")  # this rank's
        self.num_kv_heads, kv_replicas = kv_head_split(config.num_key_value_heads, tp)
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            self.split_sizes,
            bias=flags.qkv_bias,
            tp=tp,
            replicas=(1, kv_replicas, kv_replicas),
        )
        self.o_proj = RowParallelLinear(q_size * tp.size, config.hidden_size, flags.o_bias, tp)
        self.qk_norm = flags.qk_norm
        if flags.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k [T, KV, D]`` (RoPE applied) and ``v [T, KV, D]`` of ``h``: views
        whose rows lie further apart than their heads (the attention kernels take row strides),
        so no copy makes them contiguous. Without q/k norms one RoPE kernel rotates q and k
        together."""
        qkv = self.qkv_proj(h)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk_size = (heads + kv_heads) * d
        v = qkv[:, qk_size:].view(-1, kv_heads, d)  # [T, KV, D]
        if self.qk_norm:
            q = self.q_norm(qkv[:, : heads * d].view(-1, heads, d))
            k = self.k_norm(qkv[:, heads * d : qk_size].view(-1, kv_heads, d))
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        qk = apply_rotary(qkv[:, :qk_size].view(-1, heads + kv_heads, d), cos, sin)
        return qk[:, :heads], qk[:, heads:], v

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(h, cos, sin)
        out = torch.empty_like(q)
        torch.ops.pcgspec.attention(q, k, v, out, self.layer_id)
        return self.o_proj(out.view(-1, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        part = tp.shard(inter, "intermediate_size")
        self.gate_up_proj = MergedLinear(hidden, (part, part), bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: PretrainedConfig, layer_id: int, flags: AttentionFlags, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, flags, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The decoder stack (what gets compiled): embedding, layers, final norm."""

    def __init__(self, config: PretrainedConfig, flags: AttentionFlags, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, flags, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config))
        self.aux_hidden_layers: tuple[int, ...] = ()

    def set_aux_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        num_layers = len(self.layers)
        bad = [i for i in layer_ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"aux hidden layer ids {bad} outside 0..{num_layers}")
        self.aux_hidden_layers = tuple(layer_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        input_embeds: torch.Tensor | None = None,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the normed hidden states [T, hidden] and, when aux layers are set, the
        residual-stream inputs of those layers concatenated: [T, len(ids) * hidden].
        """
        h = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        cos, sin = self.rotary_emb(positions)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_layers:
                aux[i] = h
            h = layer(h, cos, sin)
        if len(self.layers) in self.aux_hidden_layers:
            aux[len(self.layers)] = h  # "layer L": the final pre-norm residual stream
        if not self.aux_hidden_layers:
            return self.norm(h), None
        return self.norm(h), torch.cat([aux[i] for i in self.aux_hidden_layers], dim=-1)


class LlamaForCausalLM(nn.Module):
    """Decoder stack plus LM head, with Hugging Face parameter names except the fused
    ``qkv_proj`` and ``gate_up_proj``; with ``tp`` of several ranks, this rank's shard of it
    (``num_heads`` and ``num_kv_heads`` are then this rank's).
    """

    # HF module name -> (fused module name, shard index)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.model = self.build_model(config, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head: VocabParallelEmbedding = (
            self.model.embed_tokens
            if self.tie_word_embeddings
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        )
        attention = self.model.layers[0].self_attn
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = attention.num_heads
        self.num_kv_heads: int = attention.num_kv_heads
        self.head_dim: int = head_dim_of(config)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.attn_scale: float = self.head_dim**-0.5
        # per layer: the keys a query sees (itself included), None = all
        self.sliding_windows: tuple[int | None, ...] = (None,) * self.num_layers

    @staticmethod
    def check_config(config: PretrainedConfig) -> None:
        check_config(config)

    def build_model(self, config: PretrainedConfig, tp: TPGroup) -> nn.Module:
        return LlamaModel(config, self.attention_flags(config), tp)

    @staticmethod
    def attention_flags(config: PretrainedConfig) -> AttentionFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFlags(qkv_bias=bias, o_bias=bias)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def set_aux_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        """Make ``forward`` also return the residual-stream inputs of these layers (L = final)."""
        self.model.set_aux_hidden_layers(layer_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model(input_ids, positions, input_embeds)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden`` [R, H] -> logits [R, V] float32, written into ``out`` when given."""
        return self.lm_head.logits(hidden, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face named tensors; every parameter must be filled."""
        load_named_weights(self, weights, self.packed_modules_mapping, skip=self._skip_weight)
        self.model.rotary_emb.init_rope()

    def _skip_weight(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"
