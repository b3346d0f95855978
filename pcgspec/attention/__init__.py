"""Attention backends behind ``pcgspec::attention`` and the paged KV cache they read."""

from pcgspec.registry import Registry

ATTENTION_BACKENDS: Registry = Registry("attention backend")
ATTENTION_BACKENDS.register("torch", "pcgspec.attention.torch_backend:TorchAttentionBackend")
ATTENTION_BACKENDS.register("triton", "pcgspec.attention.triton_backend:TritonAttentionBackend")
