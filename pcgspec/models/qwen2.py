"""Qwen2 / Qwen2.5: Llama with a bias on the q, k and v projections."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pcgspec.models.llama import AttentionFlags, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_flags(config: PretrainedConfig) -> AttentionFlags:
        return AttentionFlags(qkv_bias=True)
