"""Owns the model, the KV cache and the attention backend; runs one ForwardBatch."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pcgspec.attention import ATTENTION_BACKENDS
from pcgspec.attention.base import AttentionBackend
from pcgspec.attention.kv_cache import KVCache, KVCacheSpec
from pcgspec.compile.forward_context import forward_context
from pcgspec.config import EngineConfig
from pcgspec.distributed.group import SINGLE, TPGroup
from pcgspec.distributed.launcher import TPDriver
from pcgspec.distributed.process_group import TPProcessGroups
from pcgspec.models.loader import context_length, load_model
from pcgspec.models.random_weights import RandomWeights, random_model
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch, without_kv_writes
from pcgspec.runners.batch_wire import kv_move_message, to_message
from pcgspec.runners.decode_graph_runner import DecodeGraphRunner, max_decode_batch
from pcgspec.runners.extend_graph_runner import ExtendGraphRunner, max_extend_requests
from pcgspec.runners.forward_batch import CaptureHiddenMode, ForwardBatch, ForwardMode
from pcgspec.runners.whole_graphs import GraphOutput
from pcgspec.sampling.batch import SamplingBatch
from pcgspec.sampling.sampler import SamplerOutput, sample
from pcgspec.speculative.tree import move_accepted_kv

if TYPE_CHECKING:
    from pcgspec.runners.piecewise_runner import PiecewiseRunner
    from pcgspec.runners.refusals import GuardedRunner

logger = logging.getLogger("pcgspec")


@dataclass(frozen=True)
class ForwardOutput:
    # [R, V] float32, rows = batch.logits_indices; None: not asked. NOTE: from a decode or
    # extend graph they are rows of ``ModelRunner.graph_logits``, which the next forward may
    # overwrite: consume (or enqueue what reads them) or copy them first
    logits: torch.Tensor | None
    hidden_states: torch.Tensor | None = None  # LAST: [R, C], FULL: [T, C], else None


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path | RandomWeights | None = None,
        model: nn.Module | None = None,
        draft_kv_bytes_per_token: int = 0,
        drafter_reads_hidden: bool = False,
        tp_groups: TPProcessGroups | None = None,
    ) -> None:
        """Loads ``model_path`` (None: the embedded default model; ``RandomWeights``: a named
        shape with random weights), or runs ``model``, an already-built model on the config's
        device in its dtype. ``draft_kv_bytes_per_token``: a draft KV cache of as many pages
        will follow; the page count is sized for both. ``drafter_reads_hidden``: the draft
        (EAGLE3, MTP) reads the hidden states of every position the target computes, so every
        pass captures them. ``config.tp_size > 1``: this runner is rank 0 and spawns the other
        ranks (``tp_groups``: a worker's runner, in a group already joined).
        """
        self.config = config
        self.tp_driver: TPDriver | None = None
        if config.tp_size > 1 and tp_groups is None:
            if model is not None:
                raise ValueError(
                    "tp_size > 1 loads a shard in every rank: pass model_path "
                    "(a folder or RandomWeights), not a built model"
                )
            from pcgspec.runners.tp_worker import WorkerSetup, run_worker  # NOTE: imports us

            setup = WorkerSetup(config, draft_kv_bytes_per_token, drafter_reads_hidden)
            self.tp_driver = TPDriver(config, model_path, run_worker, setup)
            tp_groups = self.tp_driver.groups
        self.tp_groups = tp_groups
        self.tp = SINGLE if tp_groups is None else tp_groups.tp
        self.device = config.torch_device if tp_groups is None else tp_groups.device
        self.dtype = config.torch_dtype
        if model is None:
            model = _build_model(model_path, self.dtype, self.device, self.tp)
        elif model.dtype != self.dtype or model.device.type != self.device.type:
            raise ValueError(
                f"model is {model.dtype} on {model.device}, the config asks for "
                f"{self.dtype} on {self.device}"
            )
        self.model = model
        hf = self.model.config
        self.context_length = context_length(config.context_length, hf)
        self.page_size = config.page_size
        spec = KVCacheSpec(
            self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, self.dtype
        )
        logits_rows = self._graph_logits_rows()
        reserve = self._activation_reserve_bytes(spec) + logits_rows * self.vocab_size * 4
        pages = self._num_kv_pages(spec.bytes_per_token + draft_kv_bytes_per_token, reserve)
        if tp_groups is not None:  # NOTE: rank 0's page ids index every rank's cache
            pages = tp_groups.min_over_ranks(pages)
        self.kv_cache = KVCache(spec, pages, self.page_size, self.device)
        self.attn_backend = self._attention_backend(self.kv_cache)
        logger.info(
            "KV cache: %d pages x %d tokens (%.1f MiB), attention backend %s",
            self.kv_cache.num_pages,
            self.page_size,
            self.kv_cache.num_slots * spec.bytes_per_token / 2**20,
            config.resolved_attention_backend,
        )
        self.drafter_reads_hidden = drafter_reads_hidden
        self.extend_capture_hidden_mode = self._configure_aux_hidden_layers()
        # the logits rows the decode and extend graphs write (``whole_graphs.py``)
        self.graph_logits: torch.Tensor | None = None
        if logits_rows:
            shape = (logits_rows, self.vocab_size)
            self.graph_logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        self.piecewise: PiecewiseRunner | None = None
        self.extend_graphs: ExtendGraphRunner | None = None
        self.decode_graphs: DecodeGraphRunner | None = None
        self.verify_graphs: DecodeGraphRunner | None = None
        self._init_graph_runners()

    def _attention_backend(self, kv_cache: KVCache) -> AttentionBackend:
        backend_cls = ATTENTION_BACKENDS.get(self.config.resolved_attention_backend)
        model = self.model
        windows = getattr(model, "sliding_windows", ())
        return backend_cls(kv_cache, model.num_heads, model.head_dim, model.attn_scale, windows)

    def _configure_aux_hidden_layers(self) -> CaptureHiddenMode:
        """Set the configured aux layers before any graph runner traces the decoder (the trace
        bakes them in); extend batches then capture FULL hidden states (the aux layers' inputs,
        or the final normed hidden state for NEXTN), else none.
        """
        layers = self.config.aux_hidden_state_layers
        if layers is not None:
            self.model.set_aux_hidden_layers(layers)
        if layers is None and not self.drafter_reads_hidden:
            return CaptureHiddenMode.NULL
        return CaptureHiddenMode.FULL

    def capture_hidden_mode(self, mode: ForwardMode) -> CaptureHiddenMode:
        """The hidden mode batches of ``mode`` are built with (what the graphs captured):
        extend-like passes always, decode passes too when the drafter reads every position.
        """
        if mode.is_extend() or self.drafter_reads_hidden:
            return self.extend_capture_hidden_mode
        return CaptureHiddenMode.NULL

    def _init_graph_runners(self) -> None:
        """Piecewise graphs serve extend batches when ``config.use_piecewise`` (CUDA; pieces
        without graphs on CPU only when asked), whole-decoder extend graphs the small ones;
        decode graphs, and with speculation TARGET_VERIFY graphs of k+1 tokens per request,
        need CUDA. All capture after the KV cache exists.
        """
        if self.config.use_piecewise:
            from pcgspec.runners.piecewise_runner import PiecewiseRunner

            self.piecewise = PiecewiseRunner(self)
            self.piecewise.capture()
        if max_tokens := self.config.resolved_extend_graph_max_tokens:
            self.extend_graphs = ExtendGraphRunner(self, max_tokens)
            self.extend_graphs.capture()
        if self._uses_decode_graphs():
            self.decode_graphs = DecodeGraphRunner(self)
            self.decode_graphs.capture()
            spec = self.config.speculative_config
            if spec is not None:
                self.verify_graphs = DecodeGraphRunner(
                    self, ForwardMode.TARGET_VERIFY, spec.num_draft_tokens, tree=spec.topk > 1
                )
                self.verify_graphs.capture()

    def _uses_decode_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.disable_cuda_graph

    def _graph_logits_rows(self) -> int:
        """Rows of the logits buffer the decode and extend graphs share: their largest batch's
        (0: neither captures)."""
        rows = 0
        if self.config.resolved_extend_graph_max_tokens:
            rows = max_extend_requests(self.config)
        if self._uses_decode_graphs():
            rows = max(rows, max_decode_batch(self.config))
        return rows

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @torch.inference_mode()
    def _activation_reserve_bytes(self, spec: KVCacheSpec) -> int:
        """CUDA: peak memory of one eager forward at the largest prefill size, measured on a
        one-page scratch KV cache, counted twice (the forward itself and the graph pool that
        holds one forward of the largest bucket). Zero elsewhere.
        """
        if self.device.type != "cuda":
            return 0
        num_tokens = self.config.resolved_piecewise_max_tokens
        scratch = KVCache(spec, 1, self.page_size, self.device)
        # NOTE: every position maps to page 0 of the scratch cache and writes nothing (-1).
        pages = [0] * -(-num_tokens // self.page_size)
        batch = without_kv_writes(
            build_forward_batch(
                ForwardMode.EXTEND,
                [SeqChunk([0] * num_tokens, 0, pages)],
                self.page_size,
                self.device,
            )
        )
        backend = self._attention_backend(scratch)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        backend.init_forward_metadata(batch)
        with forward_context(batch, backend):
            hidden, _ = self.model.model(batch.input_ids, batch.positions)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, backend, hidden
        torch.cuda.empty_cache()
        logger.info("activation peak at %d tokens: %.1f MiB", num_tokens, peak / 2**20)
        return 2 * peak

    def _num_kv_pages(self, bytes_per_token: int, reserve: int) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.mem_fraction_static) - (total - free) - reserve
        else:
            budget = self.config.cpu_kv_budget(self.context_length, bytes_per_token)
        tokens = budget // bytes_per_token
        if self.config.max_total_tokens is not None:
            tokens = min(tokens, self.config.max_total_tokens)
        pages = tokens // self.page_size
        if pages < 1:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no page of {self.page_size} tokens "
                f"({bytes_per_token} bytes per token); raise mem_fraction_static, "
                "cpu_kv_cache_bytes or max_total_tokens"
            )
        return pages

    def set_aux_hidden_layers(self, layer_ids: Sequence[int]) -> None:
        """Layers whose residual-stream inputs FULL/LAST hidden capture returns (EAGLE3).

        Graph runners bake the layers in at their trace: set them through
        ``EngineConfig.aux_hidden_state_layers`` instead when graphs are on.
        """
        traced = any(
            r is not None
            for r in (self.piecewise, self.extend_graphs, self.decode_graphs, self.verify_graphs)
        )
        if traced and tuple(layer_ids) != self.model.model.aux_hidden_layers:
            raise RuntimeError(
                f"aux hidden layers {tuple(layer_ids)} set after the graphs were traced with "
                f"{self.model.model.aux_hidden_layers}; set EngineConfig.aux_hidden_state_layers"
            )
        self.model.set_aux_hidden_layers(layer_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run ``batch`` (on rank 0 of a tensor-parallel group: on every rank); the outputs hold
        until the next forward (``ForwardOutput``)."""
        if self.tp_driver is None:
            return self._forward(batch)
        with self.tp_driver.step(to_message(batch)):
            return self._forward(batch)

    @torch.inference_mode()
    def move_accepted_kv(
        self, page_table: torch.Tensor, start: torch.Tensor, path: torch.Tensor
    ) -> None:
        """A tree verify pass's accepted nodes' K/V moved into place (``move_accepted_kv`` of
        ``speculative/tree.py``), on every rank of a tensor-parallel group."""
        if self.tp_driver is None:
            move_accepted_kv(self.kv_cache, page_table, start, path)
            return
        with self.tp_driver.step(kv_move_message(page_table, start, path)):
            move_accepted_kv(self.kv_cache, page_table, start, path)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the runner is collected)."""
        if self.tp_driver is not None:
            self.release_graphs()
            self.tp_driver.shutdown()

    def release_graphs(self) -> None:
        """Free the piecewise, extend, decode and verify graphs; passes run eagerly from then on.
        Under tensor parallelism every rank does so before leaving its group: NCCL's teardown waits
        forever on a live graph that captured its collectives (pytorch#115388; seen on two
        H100s).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.piecewise is not None:
            self.piecewise.graphs.reset()
        for graphs in (self.extend_graphs, self.decode_graphs, self.verify_graphs):
            if graphs is not None:
                graphs.reset()
        self.piecewise = self.extend_graphs = self.decode_graphs = self.verify_graphs = None
        self.graph_logits = None

    def graph_runners(self) -> dict[str, GuardedRunner]:
        """The target's graph runners by name (those built), for their ``stats()``."""
        runners = {
            "piecewise": self.piecewise,
            "extend": self.extend_graphs,
            "decode": self.decode_graphs,
            "verify": self.verify_graphs,
        }
        return {name: r for name, r in runners.items() if r is not None}

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        hidden, aux, logits = self._run_decoder(batch)
        if logits is None:  # NOTE: not captured with the step
            every_row = batch.logits_every_row
            rows = hidden[: batch.num_tokens] if every_row else hidden[batch.logits_indices]
            logits = self.model.compute_logits(rows)
        captured = aux if aux is not None else hidden
        mode = batch.capture_hidden_mode
        if mode is CaptureHiddenMode.FULL:  # NOTE: graph runners return graph memory: copy
            return ForwardOutput(logits, captured.clone())
        if mode is CaptureHiddenMode.LAST:
            return ForwardOutput(logits, captured[batch.logits_indices])
        return ForwardOutput(logits)

    def _run_decoder(self, batch: ForwardBatch) -> GraphOutput:
        """Hidden states, auxiliary hidden states and (from an extend or decode graph) the
        logits of the batch's logits rows."""
        graphs = {
            ForwardMode.EXTEND: self.extend_graphs,
            ForwardMode.DECODE: self.decode_graphs,
            ForwardMode.TARGET_VERIFY: self.verify_graphs,
        }.get(batch.forward_mode)
        if graphs is not None and graphs.can_run(batch):
            return graphs.replay(batch)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            return GraphOutput(*self.piecewise.run(batch), None)
        return GraphOutput(*self.run_eager(batch), None)

    def run_eager(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.attn_backend.init_forward_metadata(batch)
        with forward_context(batch, self.attn_backend):
            return self.model.model(batch.input_ids, batch.positions, batch.input_embeds)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> SamplerOutput:
        return sample(logits, sampling)


def _build_model(
    source: Path | RandomWeights | None, dtype: torch.dtype, device: torch.device, tp: TPGroup
) -> nn.Module:
    if isinstance(source, RandomWeights):
        return random_model(source.shape, dtype, device, source.seed, tp)
    return load_model(source, dtype, device, tp)
