"""Owns the model, the KV cache and the attention backend; runs one ForwardBatch."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pcgspec.attention import ATTENTION_BACKENDS
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.compile.forward_context import forward_context
from pcgspec.config import EngineConfig
from pcgspec.models.loader import load_model
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch
from pcgspec.sampling.batch import SamplingBatch
from pcgspec.sampling.sampler import SamplerOutput, sample

logger = logging.getLogger("pcgspec")


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, V] float32, rows = batch.logits_indices
    hidden_states: torch.Tensor | None = None  # LAST: [R, C], FULL: [T, C], else None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.model = load_model(model_path, self.dtype, self.device)
        hf = self.model.config
        self.context_length = config.context_length or hf.max_position_embeddings
        self.page_size = config.page_size
        spec = KVCacheSpec(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim,
                           self.dtype)
        self.kv_cache = KVCache(spec, self._num_kv_pages(spec), self.page_size, self.device)
        backend_cls = ATTENTION_BACKENDS.get(config.resolved_attention_backend)
        self.attn_backend = backend_cls(
            self.kv_cache, self.model.num_heads, self.model.head_dim, self.model.attn_scale
        )
        logger.info("KV cache: %d pages x %d tokens (%.1f MiB), attention backend %s",
                    self.kv_cache.num_pages, self.page_size,
                    self.kv_cache.num_slots * spec.bytes_per_token / 2**20,
                    config.resolved_attention_backend)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def _num_kv_pages(self, spec: KVCacheSpec) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.mem_fraction_static) - (total - free)
        else:
            budget = self.config.cpu_kv_cache_bytes
        tokens = budget // spec.bytes_per_token
        if self.config.max_total_tokens is not None:
            tokens = min(tokens, self.config.max_total_tokens)
        pages = tokens // self.page_size
        if pages < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no page of {self.page_size} tokens "
                f"({spec.bytes_per_token} bytes per token); raise mem_fraction_static, "
                "cpu_kv_cache_bytes or max_total_tokens"
            )
        return pages

    def set_aux_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        """Layers whose residual-stream inputs FULL/LAST hidden capture returns (EAGLE3)."""
        self.model.set_aux_hidden_layers(layer_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        hidden, aux = self._run_decoder(batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        captured = aux if aux is not None else hidden
        mode = batch.capture_hidden_mode
        if mode is CaptureHiddenMode.FULL:
            return ForwardOutput(logits, captured)
        if mode is CaptureHiddenMode.LAST:
            return ForwardOutput(logits, captured[batch.logits_indices])
        return ForwardOutput(logits)

    def _run_decoder(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.attn_backend.init_forward_metadata(batch)
        with forward_context(batch, self.attn_backend):
            return self.model.model(batch.input_ids, batch.positions, batch.input_embeds)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SamplerOutput:
        return sample(logits, sampling)
