"""Real model shapes with random weights, built directly on the device: benchmarks of large
shapes without checkpoints (no files, no CPU round trip).

``random_model("llama-3.2-1b", torch.bfloat16, "cuda")`` builds the registry's class on the meta
device, allocates it with ``to_empty`` and fills it in place: every RMSNorm weight 1, every
other parameter N(0, 0.02^2), from a generator on the device seeded with ``seed``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pcgspec.distributed.group import SINGLE, TPGroup
from pcgspec.models.layers.norm import GemmaRMSNorm, RMSNorm
from pcgspec.models.registry import model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # Hugging Face's default initializer_range

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_QWEN25 = dict(  # what Qwen2.5-Coder 0.5B and 1.5B share (the catalog's converted config.json)
    architectures=["Qwen2ForCausalLM"],
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
)
_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
_GEMMA3_LAYERS = (["sliding_attention"] * 5 + ["full_attention"]) * 3

# name -> (model_type, config kwargs); the numbers are those of the public config.json files.
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": (
        "llama",
        dict(
            architectures=["LlamaForCausalLM"],
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=_LLAMA3_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            architectures=["Qwen3ForCausalLM"],
            hidden_size=4096,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=12288,
            vocab_size=151936,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(
            architectures=["LlamaForCausalLM"],
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-coder-0.5b": (
        "qwen2",
        dict(
            _QWEN25,
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            intermediate_size=4864,
        ),
    ),
    "qwen2.5-coder-1.5b": (
        "qwen2",
        dict(
            _QWEN25,
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            intermediate_size=8960,
        ),
    ),
    "gemma-3-270m": (
        "gemma3_text",
        dict(
            architectures=["Gemma3ForCausalLM"],
            hidden_size=640,
            num_hidden_layers=18,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=2048,
            vocab_size=262144,
            max_position_embeddings=32768,
            rms_norm_eps=1e-6,
            rope_parameters=_GEMMA3_ROPE,
            layer_types=_GEMMA3_LAYERS,
            sliding_window=512,
            query_pre_attn_scalar=256,
            tie_word_embeddings=True,
        ),
    ),
    "tiny": (
        "llama",
        dict(  # for tests: a few MB, runs anywhere in milliseconds
            architectures=["LlamaForCausalLM"],
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    ),
    "tiny-gemma3": (
        "gemma3_text",
        dict(  # for tests: Gemma 3's layout with a 4-token window, a global layer in the middle
            architectures=["Gemma3ForCausalLM"],
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters=_GEMMA3_ROPE,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=4,
            query_pre_attn_scalar=16,
            tie_word_embeddings=True,
        ),
    ),
}
_ACTIVATIONS = {"gemma3_text": {}}  # NOTE: Gemma 3's default hidden_activation; the rest SiLU


@dataclass(frozen=True)
class RandomWeights:
    """A model source without files: ``random_model(shape, ..., seed)`` in every rank (what
    tensor-parallel workers build when a benchmark asks for random weights).
    """

    shape: str
    seed: int = 0


def shape_config(shape: str) -> PretrainedConfig:
    """The Hugging Face config of a named shape; ``ValueError`` listing them when unknown."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    from transformers import AutoConfig

    model_type, kwargs = SHAPES[shape]
    activation = _ACTIVATIONS.get(model_type, {"hidden_act": "silu"})
    return AutoConfig.for_model(
        model_type, attention_bias=False, initializer_range=INIT_STD, **activation, **kwargs
    )


def random_model(
    shape: str | PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    tp: TPGroup = SINGLE,
) -> nn.Module:
    """A model of ``shape`` (a name from ``SHAPES`` or a config) with random weights, in eval
    mode without gradients, like ``load_model`` returns. With ``tp`` of several ranks each rank
    draws its own shard: the same shapes and timings as a sharded checkpoint, other numbers.
    """
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    start = time.perf_counter()
    config = shape_config(shape) if isinstance(shape, str) else shape
    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    fill_random_(model, seed)
    model.model.rotary_emb.init_rope()
    model.requires_grad_(False).eval()
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    logger.info(
        "Built %s (%.1fM params, %s) with random weights on %s in %.1f s",
        cls.__name__,
        millions,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model


@torch.no_grad()
def fill_random_(model: nn.Module, seed: int = 0, std: float = INIT_STD) -> None:
    """Every RMSNorm a scale of 1 (Gemma's stores ``scale - 1``: 0), every other parameter
    N(0, std^2), in place on its device.

    NOTE: tied parameters appear once in ``named_parameters``, so each is drawn once.
    """
    norms = {
        id(m.weight): 0.0 if isinstance(m, GemmaRMSNorm) else 1.0
        for m in model.modules()
        if isinstance(m, RMSNorm)
    }
    generators: dict[torch.device, torch.Generator] = {}
    for param in model.parameters():
        if id(param) in norms:
            param.fill_(norms[id(param)])
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        param.normal_(0.0, std, generator=gen)
