"""RMSNorm, computed in float32 like Hugging Face's ``LlamaRMSNorm`` and ``Gemma3RMSNorm``."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        return self.weight * _normalized(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores ``scale - 1``, applied in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        return (_normalized(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:  # float32
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
