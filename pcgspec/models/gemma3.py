"""Gemma 3 (text): Llama's layout with per-head q/k norms, four norms per layer applied as
``1 + weight``, a GeGLU MLP, embeddings scaled by ``sqrt(hidden)``, and sliding-window layers
with their own RoPE base beside every ``sliding_window_pattern``-th global layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pcgspec.distributed.group import SINGLE, TPGroup
from pcgspec.models.layers.linear import VocabParallelEmbedding
from pcgspec.models.layers.norm import GemmaRMSNorm
from pcgspec.models.layers.rotary import RotaryEmbedding, checked_rope_parameters
from pcgspec.models.llama import (
    AttentionFlags,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def check_gemma3_config(config: PretrainedConfig) -> None:
    """Reject settings this model does not implement, before any weight is read."""
    act = getattr(config, "hidden_activation", None)
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (only 'gelu_pytorch_tanh')")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"attn_logit_softcapping={config.attn_logit_softcapping} is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True is not supported")
    bad = sorted(set(config.layer_types) - {SLIDING, FULL})
    if bad or len(config.layer_types) != config.num_hidden_layers:
        raise ValueError(
            f"layer_types must list {SLIDING!r} or {FULL!r} for each of the "
            f"{config.num_hidden_layers} layers, got {config.layer_types}"
        )
    window = config.sliding_window
    if SLIDING in config.layer_types and not (isinstance(window, int) and window > 0):
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")


class ScaledEmbedding(VocabParallelEmbedding):
    """The embedding times ``sqrt(hidden)``, the scale rounded to the weights' dtype as in
    transformers; as the tied LM head its ``logits`` use the unscaled weight.
    """

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().forward(input_ids)
        return h * torch.full((), self.embedding_dim**0.5, dtype=h.dtype, device=h.device)


class LocalGlobalRotary(nn.Module):
    """``forward(positions)`` -> ``(cos, sin)``, each ``[2, T, D]`` float32: index 0 with the
    global layers' base, 1 with the sliding layers'.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        self.global_rope, self.local_rope = (
            RotaryEmbedding(
                head_dim_of(config),
                checked_rope_parameters(params.get(kind) or {}, DEFAULT_ROPE_THETA[kind]),
            )
            for kind in (FULL, SLIDING)
        )

    def init_rope(self) -> None:
        self.global_rope.init_rope()
        self.local_rope.init_rope()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (cos_g, sin_g), (cos_l, sin_l) = self.global_rope(positions), self.local_rope(positions)
        return torch.stack([cos_g, cos_l]), torch.stack([sin_g, sin_l])


class Gemma3Attention(LlamaAttention):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, AttentionFlags(qkv_bias=bias, o_bias=bias), tp)
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.rope_index = int(config.layer_types[layer_id] == SLIDING)
        self.self_attn = Gemma3Attention(config, layer_id, tp)
        self.mlp = Gemma3MLP(config, tp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos[self.rope_index], sin[self.rope_index]
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3Model(LlamaModel):
    """``LlamaModel``'s forward and aux hidden states over Gemma 3's modules."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup) -> None:
        nn.Module.__init__(self)  # NOTE: LlamaModel.__init__ would build Llama layers
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = LocalGlobalRotary(config)
        self.aux_hidden_layers: tuple[int, ...] = ()


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__(config, tp)
        self.attn_scale = float(config.query_pre_attn_scalar) ** -0.5
        self.sliding_windows = tuple(
            config.sliding_window if kind == SLIDING else None for kind in config.layer_types
        )
        self.final_logit_softcapping: float | None = getattr(
            config, "final_logit_softcapping", None
        )

    @staticmethod
    def check_config(config: PretrainedConfig) -> None:
        check_gemma3_config(config)

    def build_model(self, config: PretrainedConfig, tp: TPGroup) -> nn.Module:
        return Gemma3Model(config, tp)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.lm_head.logits(hidden, out)  # [R, H] -> [R, V] float32
        cap = self.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
