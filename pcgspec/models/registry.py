"""Hugging Face architecture name -> model class, imported on first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from pcgspec.registry import Registry

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MODEL_REGISTRY: Registry[type[nn.Module]] = Registry("model architecture")
MODEL_REGISTRY.register("LlamaForCausalLM", "pcgspec.models.llama:LlamaForCausalLM")
MODEL_REGISTRY.register("Qwen2ForCausalLM", "pcgspec.models.qwen2:Qwen2ForCausalLM")
MODEL_REGISTRY.register("Qwen3ForCausalLM", "pcgspec.models.qwen3:Qwen3ForCausalLM")
MODEL_REGISTRY.register("MiMoForCausalLM", "pcgspec.models.qwen2:MiMoForCausalLM")
MODEL_REGISTRY.register("Gemma3ForCausalLM", "pcgspec.models.gemma3:Gemma3ForCausalLM")

# config.json model_type transformers does not know (its class lives in remote code) -> the
# model_type whose config class reads it
MODEL_TYPE_ALIASES: dict[str, str] = {"mimo": "qwen2"}

# speculative algorithm -> loader(path, target, dtype, device) of its draft head
DRAFT_HEAD_REGISTRY: Registry[Callable[..., nn.Module]] = Registry("draft head")
DRAFT_HEAD_REGISTRY.register("EAGLE3", "pcgspec.models.eagle3:load_eagle3_head")
DRAFT_HEAD_REGISTRY.register("NEXTN", "pcgspec.models.mtp:load_mtp_head")


def model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first of ``config.architectures`` we support; ``ValueError`` listing
    the supported ones when there is none.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY.get(name)
    return MODEL_REGISTRY.get(" / ".join(architectures) or "<none in config.architectures>")
