"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pcgspec.models.llama import AttentionFlags, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_flags(config: PretrainedConfig) -> AttentionFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
