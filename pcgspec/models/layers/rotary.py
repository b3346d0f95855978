"""Rotary position embeddings: default, linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; 4.x in ``config.rope_theta`` and
    ``config.rope_scaling`` (whose type key was once called ``type``).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    return checked_rope_parameters(params, getattr(config, "rope_theta", 10000.0))


def checked_rope_parameters(params: dict[str, Any], default_theta: float) -> dict[str, Any]:
    """A copy of ``params`` with ``rope_type`` and ``rope_theta`` set; ``ValueError`` for what
    ``compute_inv_freq`` does not implement.
    """
    params = dict(params)
    params.setdefault("rope_theta", default_theta)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {params['rope_type']!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    return params


def compute_inv_freq(params: dict[str, Any], head_dim: int) -> torch.Tensor:  # [D / 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (float(params["rope_theta"]) ** exponents)
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Keep high frequencies, divide low ones by ``factor``, interpolate in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """``forward(positions)`` -> ``(cos, sin)``, each ``[T, D]`` float32, shared by all layers."""

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        self.register_buffer("inv_freq", compute_inv_freq(params, head_dim), persistent=False)

    def init_rope(self) -> None:
        """Recompute ``inv_freq`` in float32 on its device.

        NOTE: needed after ``to_empty`` (garbage) or a dtype cast of the model (precision).
        """
        self.inv_freq = compute_inv_freq(self.params, self.head_dim).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face layout): ``x`` [T, H, D], ``cos``/``sin`` [T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
