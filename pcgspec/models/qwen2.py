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


class MiMoForCausalLM(Qwen2ForCausalLM):
    """MiMo-7B: Qwen2 whose checkpoint also holds MTP layers (``model.mtp_layers.*``); the
    target skips them and ``pcgspec.models.mtp`` loads them as a draft head.
    """

    def _skip_weight(self, name: str) -> bool:
        return name.startswith("model.mtp_layers.") or super()._skip_weight(name)
