"""The engine: requests in, one scheduled forward pass per ``step()``, tokens out."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pcgspec.attention.kv_cache import page_slots
from pcgspec.config import EngineConfig
from pcgspec.engine.cpu_threads import apply_cpu_threads
from pcgspec.engine.detokenizer import IncrementalDetokenizer
from pcgspec.engine.isolation import run_isolated
from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.overlap import PENDING_TOKEN, LaunchedStep, resolve_pending
from pcgspec.engine.radix_cache import RadixCache
from pcgspec.engine.request import Request
from pcgspec.engine.scheduler import ScheduledBatch, Scheduler
from pcgspec.engine.step_timer import DecodeStepTimer
from pcgspec.kernels.warmup import AttentionShape, KernelWarmup, warm_up_kernels
from pcgspec.models.loader import load_model, load_tokenizer, load_vocab_modules, resolve_model_dir
from pcgspec.runners.batch_builder import SeqChunk, build_forward_batch
from pcgspec.runners.draft_graph_runner import DraftGraphRunner
from pcgspec.runners.forward_batch import ForwardBatch
from pcgspec.runners.model_runner import ModelRunner
from pcgspec.runners.refusals import GraphStats
from pcgspec.runners.spec_step_graphs import SpecStepGraphs
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.sampling_params import SamplingParams
from pcgspec.speculative.draft_runner import DraftRunner, kv_spec
from pcgspec.speculative.drafts import load_draft
from pcgspec.speculative.model_proposer import ModelProposer
from pcgspec.speculative.ngram import NgramProposer
from pcgspec.speculative.worker import LaunchedSpecStep, SpecWorker

logger = logging.getLogger("pcgspec")
_SEED_MASK = (1 << 63) - 1
STEP_KINDS = ("prefill", "mixed", "decode", "speculative", "first_tokens")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        gc.collect()  # NOTE: engines dropped in cycles go before this one sizes its KV cache
        self.config = config
        apply_cpu_threads(config)
        self.model_dir: Path = resolve_model_dir(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        self.runner, draft = self._load_models(config)
        self.page_size = self.runner.page_size
        self.pages = PagePool(self.runner.kv_cache.num_pages)
        budget = config.max_prefill_tokens
        chunk = config.resolved_chunked_prefill_size
        spec = config.speculative_config
        lookup = spec is not None and spec.algorithm == "NGRAM"  # searches the tokens so far
        self.slots = SamplingSlots(
            config.max_running_requests,
            self.runner.vocab_size,
            self.runner.device,
            history_len=self.context_length if lookup else None,
        )
        self.prefix_cache = (
            None
            if config.disable_radix_cache
            else RadixCache(self.pages, self.page_size, track_draft=draft is not None)
        )
        self.scheduler = Scheduler(
            self.pages,
            self.page_size,
            config.max_running_requests,
            min(budget, chunk) if chunk else budget,
            self.slots,
            self.prefix_cache,
        )
        self.eos_token_ids = _eos_token_ids(self.tokenizer, self.runner.model.config)
        self._seeds = random.Random(config.random_seed)
        self.overlap = config.use_overlap_schedule
        self.in_flight: list[LaunchedStep | LaunchedSpecStep] = []  # launched, not read yet
        self._ids = itertools.count()
        # per kind of step (STEP_KINDS): steps run and seconds spent in ``step()``
        self.step_counts = {kind: 0 for kind in STEP_KINDS}
        self.step_seconds = {kind: 0.0 for kind in STEP_KINDS}
        self.spec_worker = (
            SpecWorker(spec, self.runner, self.scheduler, self.slots, self.eos_token_ids, draft)
            if spec is not None
            else None
        )
        self.step_timer = (  # what decode steps cost, for the speculation policy
            None if self.spec_worker is None else DecodeStepTimer(self.spec_worker.policy)
        )
        if self.spec_worker is not None:
            self.scheduler.hold_arrivals = True  # mixed steps decode one token a request
        if self.spec_worker is not None and isinstance(self.spec_worker.proposer, ModelProposer):
            self.scheduler.draft = self.spec_worker.proposer
        # what a failed step gives back before its requests run again (isolation.py)
        self._rollbacks = (self.slots, *([self.spec_worker.proposer] if spec else []))
        self._capture_spec_graphs()
        warm_up_kernels(self._kernel_warmup(), self.runner.device)

    def _load_models(self, config: EngineConfig) -> tuple[ModelRunner, DraftRunner | None]:
        """The target's runner and, for a model-based drafter, the draft's. The draft loads
        first: its weights and KV bytes per token shape the target's KV budget, and an EAGLE3
        head names the target layers whose hidden states graphs must capture.
        """
        spec = config.speculative_config
        if spec is None or spec.algorithm == "NGRAM":
            return ModelRunner(config, self.model_dir), None
        sharded = config.tp_size > 1  # NOTE: then the draft borrows one-rank vocab modules
        load_target = load_vocab_modules if sharded else load_model
        target = load_target(self.model_dir, config.torch_dtype, config.torch_device)
        draft = load_draft(spec, config, target)
        aux = draft.target_aux_layers(target.num_layers)
        if aux is not None and config.aux_hidden_state_layers is None:
            config = dataclasses.replace(config, aux_hidden_state_layers=tuple(aux))
        runner = ModelRunner(
            config,
            self.model_dir if sharded else None,
            model=None if sharded else target,
            draft_kv_bytes_per_token=kv_spec(draft).bytes_per_token,
            drafter_reads_hidden=draft.uses_target_hidden,
        )
        draft_runner = DraftRunner(draft, runner.kv_cache.num_pages, runner.page_size, config)
        return runner, draft_runner

    def _capture_spec_graphs(self) -> None:
        """CUDA: a model drafter's propose phase (catch-up + k-1 draft steps) as graphs per
        batch size, and the whole speculative step behind each verify graph (not under tensor
        parallelism, where the LM head needs every rank).
        """
        worker, config, runner = self.spec_worker, self.config, self.runner
        if worker is None or runner.device.type != "cuda" or config.disable_cuda_graph:
            return
        proposer = worker.proposer
        if isinstance(proposer, ModelProposer):
            max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
            proposer.graphs = DraftGraphRunner(
                proposer.runner, proposer.shape, max_bs, self.context_length
            )
            proposer.graphs.capture()
        if runner.verify_graphs is not None and runner.tp_driver is None:
            worker.step_graphs = SpecStepGraphs(
                runner.verify_graphs,
                proposer,
                self.slots,
                runner.model.compute_logits,
                worker.num_steps,
            )
            worker.step_graphs.capture()

    def _kernel_warmup(self) -> KernelWarmup:
        """The Triton kernel variants serving can reach (warmed at start-up: a first wave of
        concurrent requests then compiles nothing).
        """
        proposer = None if self.spec_worker is None else self.spec_worker.proposer
        runners = [self.runner, *([proposer.runner] if isinstance(proposer, ModelProposer) else [])]
        triton = self.config.resolved_attention_backend == "triton"
        spec = self.config.speculative_config
        k = None if spec is None else spec.num_steps
        ngram = None
        if isinstance(proposer, NgramProposer):
            ngram = (proposer.num_steps, proposer.min_window, proposer.max_window)
        return KernelWarmup(
            attention=tuple(AttentionShape.of(r.attn_backend) for r in runners if triton),
            split_kv_tokens=(1,) if k is None else (1, k + 1),
            vocab_size=self.runner.vocab_size,
            verify=None if k is None else (k, self.runner.vocab_size),
            ngram=ngram,
            tree=None if spec is None or spec.topk == 1 else (k, spec.num_draft_tokens, spec.topk),
            tree_vocab=(
                (proposer.runner.scored_vocab_size, (torch.float32, proposer.runner.dtype))
                if isinstance(proposer, ModelProposer) and spec.topk > 1
                else None
            ),
            draft_levels=(k - 1, spec.topk) if isinstance(proposer, ModelProposer) else None,
        )

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Request]:
        """Queue ``params.n`` sequences for one prompt; returns them."""
        ids = list(prompt_token_ids)
        self._check_prompt(ids)
        group = request_id if request_id is not None else str(next(self._ids))
        base = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        reqs = []
        for i in range(params.n):
            seed = base if i == 0 else hash((base, i)) & _SEED_MASK
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            req = Request(
                f"{group}-{i}",
                ids,
                params,
                seed,
                detok,
                self.context_length,
                group_id=group,
                index=i,
            )
            self.scheduler.add(req)
            reqs.append(req)
        return reqs

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the context length is {self.context_length}; "
                "it must leave room for at least one output token"
            )
        capacity = self.pages.num_pages * self.page_size
        if len(ids) >= capacity:
            raise ValueError(f"prompt has {len(ids)} tokens but the KV cache holds only {capacity}")
        vocab = self.runner.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.in_flight)

    def abort(self, request_id: str) -> list[Request]:
        """Abort the unfinished sequences of ``request_id`` (an ``add_request`` id): they finish
        with "abort" and their KV pages are freed at once. Returns them (none: nothing to abort).
        """
        aborted = self.scheduler.abort(request_id)
        if self.step_timer is not None and not self.has_unfinished:
            self.step_timer.finish()  # NOTE: the idle time that follows is no step's
        return aborted

    def stats(self) -> dict[str, int]:
        """Scheduler and KV-pool occupancy: running / waiting sequences, pages used (held by
        requests) / cached (held by the prefix cache, also while requests hold them) / total."""
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_pages_used": self.pages.num_pages - self.pages.num_free - self.pages.num_cache_only,
            "kv_pages_cached": self.prefix_cache.num_pages if self.prefix_cache else 0,
            "kv_pages_total": self.pages.num_pages,
            "page_size": self.page_size,
        }

    def cache_stats(self) -> dict[str, float]:
        """Prefix-cache counters; empty when the cache is disabled."""
        cache = self.prefix_cache
        if cache is None:
            return {}
        s = cache.stats
        return {
            "prompt_tokens": s.prompt_tokens,  # looked up (prompts, resumed sequences)
            "cached_tokens": s.cached_tokens,
            "hit_rate": s.hit_rate,
            "evicted_tokens": s.evicted_tokens,
            "tree_pages": cache.num_pages,
            "tree_tokens": cache.num_pages * self.page_size,
        }

    def graph_stats(self) -> dict[str, GraphStats]:
        """Runs, padding and fallbacks by reason of every graph runner built, by name: the
        target's ``piecewise``, ``extend``, ``decode``, ``verify``, the whole speculative step's
        ``spec_step``; a model drafter's ``draft`` (its propose phase) and ``draft_piecewise``
        (a STANDALONE draft's long catch-ups).
        """
        runners = self.runner.graph_runners()
        worker = self.spec_worker
        if worker is not None and worker.step_graphs is not None:
            runners["spec_step"] = worker.step_graphs
        proposer = None if worker is None else worker.proposer
        if isinstance(proposer, ModelProposer):
            drafter = {"draft": proposer.graphs, "draft_piecewise": proposer.runner.piecewise}
            runners |= {name: r for name, r in drafter.items() if r is not None}
        return {name: r.stats() for name, r in runners.items()}

    def flush_cache(self) -> None:
        """Drop every cached prefix (running requests keep their pages)."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()

    def step(self) -> list[Request]:
        """Schedule, run the model (a speculative step for decode batches when the policy
        chooses one), sample, commit. A request the step fails on finishes with "error" (see
        isolation.py). Under the overlap schedule the step is launched and the previous one's
        tokens are committed while it runs (overlap.py), speculative steps included; a plain
        step launched over a speculative step takes its decode rows' lengths from the device
        (``_build_forward_batch``). A step whose sampled rows are first tokens for at least half
        (``overlap.FIRST_TOKEN_SHARE``) is read by a step of its own, which launches nothing:
        those tokens go out before the next step's host work (``_first_tokens_in_flight``).
        Each decode step is timed for the speculation policy (step_timer.py). Returns the
        requests whose tokens were committed.
        """
        start = time.perf_counter()
        if self._first_tokens_in_flight():
            took = self.drain()
            if self.step_timer is not None:
                self._time_step(None, False, False, start, start)
            self._count_step("first_tokens", start)
            return took
        batch = self.scheduler.schedule()
        speculate = self.spec_worker is not None and self.spec_worker.chooses(batch)
        ready = time.perf_counter()
        running, self.in_flight = self.in_flight, []
        # NOTE: a plain step over a speculative step in flight takes its decode rows' lengths
        # from the device (``_build_forward_batch``) and pays for the rest of it when reading it
        after_spec = any(isinstance(s, LaunchedSpecStep) for s in running)
        try:
            if batch is not None:
                run = functools.partial(self._run, speculate=speculate, after_spec=after_spec)
                run_isolated(batch, run, self.scheduler.release, self._rollbacks)
        finally:
            reading = time.perf_counter()
            took = self._read(running)
            # a step with prefill work ends the open decode step's time when ready, later by
            # its read of that step (its wait for the device and its commit), not by its own
            # launch
            ready += time.perf_counter() - reading
            if not self.overlap:
                took += self.drain()
        if self.step_timer is not None:
            self._time_step(batch, speculate, after_spec and not speculate, start, ready)
        if batch is not None:
            kind = _step_kind(batch, speculate)
            self._count_step(kind, start)
        if batch is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "%s step: %d requests, %d new tokens%s, %.2f ms",
                kind,
                len(batch.requests),
                sum(batch.num_new_tokens),
                ", speculative" if speculate else "",
                1e3 * (time.perf_counter() - start),
            )
        return took

    def _count_step(self, kind: str, start: float) -> None:
        self.step_counts[kind] += 1
        self.step_seconds[kind] += time.perf_counter() - start

    def step_stats(self) -> dict[str, dict[str, float]]:
        """Per kind of step, how many ran and the seconds spent in ``step()`` (the caller's
        time between steps is in none): ``prefill`` (also chunks and resumed requests),
        ``mixed`` (running requests' next tokens beside prefill chunks), ``decode`` (plain),
        ``speculative``, and ``first_tokens``, a step that only read the tokens of a step
        with prefill work, first tokens for at least half (``_first_tokens_in_flight``)."""
        return {
            kind: {"steps": self.step_counts[kind], "seconds": self.step_seconds[kind]}
            for kind in STEP_KINDS
        }

    def _first_tokens_in_flight(self) -> bool:
        """Whether a step in flight sampled first tokens for at least half of its rows
        (``overlap.FIRST_TOKEN_SHARE``). Reading them before the next launch costs the overlap
        of one step (the device idles while the next step is built) and takes that step's host
        work off those requests' TTFT: worth it for a wave of new requests, not for one joining
        many running ones.
        """
        return any(isinstance(s, LaunchedStep) and s.first_tokens for s in self.in_flight)

    def drain(self) -> list[Request]:
        """Commit the tokens of every launched step, launching none."""
        steps, self.in_flight = self.in_flight, []
        return self._read(steps)

    def _read(self, steps: list[LaunchedStep | LaunchedSpecStep]) -> list[Request]:
        """Commit the tokens of launched steps; release the requests they finished."""
        took = [req for step in steps for req in step.read(self.eos_token_ids)]
        self.scheduler.retire(took)
        return took

    def _run(self, batch: ScheduledBatch, speculate: bool, after_spec: bool) -> None:
        """Launch a speculative step where chosen, else a plain step (``after_spec``: over a
        speculative step in flight)."""
        if speculate:
            self.in_flight.append(self.spec_worker.launch(batch))  # type: ignore[union-attr]
        else:
            self._forward_and_sample(batch, after_spec)
            self.scheduler.launched(batch)

    def _time_step(
        self,
        batch: ScheduledBatch | None,
        speculated: bool,
        after_spec: bool,
        start: float,
        ready: float,
    ) -> None:
        """Hand a step to the step timer (``after_spec``: a plain step that paid for the rest
        of a speculative step in flight; ``ready``: when a step with prefill work was ready to
        launch, later by its read of the steps in flight); once no work is left, end
        the last one."""
        timer, proposer = self.step_timer, self.spec_worker.proposer  # type: ignore[union-attr]
        if batch is not None and batch.mode.is_decode():
            caught_up = speculated and proposer.caught_up
            timer.decode_step(speculated, len(batch.requests), after_spec, caught_up, start)  # type: ignore[union-attr]
        elif batch is not None:
            timer.prefill_step(ready)  # type: ignore[union-attr]
        if not self.has_unfinished:
            timer.finish()  # type: ignore[union-attr]

    def _forward_and_sample(self, batch: ScheduledBatch, after_spec: bool) -> None:
        forward_batch = self._build_forward_batch(batch, after_spec)
        out = self.runner.forward(forward_batch)
        sampled = self.runner.sample(out.logits, forward_batch.sampling)
        rows = batch.sampled_requests
        self.slots.commit(rows, sampled.tokens[:, None], torch.ones_like(sampled.tokens))
        self.in_flight.append(LaunchedStep.start(rows, sampled, batch.num_prefill_samples))
        if self.spec_worker is not None:  # NOTE: after the commit: a failed run observed nothing
            self.spec_worker.observe(batch, out)

    def spec_stats(self) -> dict[str, object]:
        """Engine-wide speculative counters (summed over requests); empty without speculation."""
        worker = self.spec_worker
        if worker is None:
            return {}
        stats = worker.stats
        return {
            "verify_steps": stats.verify_steps,  # request-steps
            "accepted_draft_tokens": stats.accepted_drafts,
            "avg_spec_accept_length": stats.avg_accept_length,
            "accepted_per_position": list(stats.accepted_per_position),
            "fallback_steps": worker.num_fallbacks,
            "speculative_steps": worker.policy.speculative_steps,
            "policy_plain_steps": worker.policy.plain_steps,
            # what the policy prices each kind of step at, per batch-size bucket (ms)
            "step_costs_ms": worker.policy.step_times(),
        }

    def _build_forward_batch(self, batch: ScheduledBatch, after_spec: bool) -> ForwardBatch:
        """Input tokens from the host, but for a pending token (overlap.py), which only a
        decode row can have: the device takes it from the sampling slots. Over a speculative
        step in flight (``after_spec``) the host knows its requests' lengths only up to its
        worst case: the decode rows are built there, at the worst case's positions (a bound
        for sizing), and take their positions, KV slots and lengths from the slots on the
        device (``_decode_rows_from_device``).
        """
        chunks = []
        for row, (req, n, sample) in enumerate(
            zip(batch.requests, batch.num_new_tokens, batch.samples)
        ):
            if after_spec and row < batch.num_decode:
                chunks.append(SeqChunk([PENDING_TOKEN], req.num_tokens - 1, req.pages))
                continue
            start = req.num_computed_tokens
            ids = req.token_ids[start : start + n]
            ids += [PENDING_TOKEN] * (n - len(ids))  # NOTE: decode rows only: one token
            chunks.append(SeqChunk(ids, start, req.pages, sample))
        built = build_forward_batch(
            batch.mode,
            chunks,
            self.page_size,
            self.runner.device,
            capture_hidden_mode=self.runner.capture_hidden_mode(batch.mode),
            sampling=self.slots.rows(batch.sampled_requests),
        )
        decoding = batch.requests[: batch.num_decode]  # NOTE: one token each, the first rows
        if after_spec and decoding:
            # NOTE: every decode row's input is pending then, also a request the speculative
            # step did not run (its tokens all read)
            self._decode_rows_from_device(built, decoding)
        elif not any(r.num_pending_tokens for r in decoding):
            return built
        ids = resolve_pending(built.input_ids[: len(decoding)], self.slots.last_tokens(decoding))
        if len(decoding) < len(built.input_ids):
            ids = torch.cat([ids, built.input_ids[len(decoding) :]])
        return dataclasses.replace(built, input_ids=ids)

    def _decode_rows_from_device(self, built: ForwardBatch, decoding: list[Request]) -> None:
        """Rewrite the leading decode rows of ``built`` in place on the device: each at its
        request's last token (as of the device's lengths, ``SamplingSlots.seq_lens``), its KV
        slot through its page-table row, its length."""
        n = len(decoding)
        lens = self.slots.seq_lens(decoding)
        positions = lens - 1
        built.positions[:n].copy_(positions)
        slots = page_slots(built.page_table[:n], positions[:, None], self.page_size)
        built.out_cache_loc[:n].copy_(slots[:, 0])
        built.seq_lens[:n].copy_(lens)


def _step_kind(batch: ScheduledBatch, speculate: bool) -> str:
    if speculate:
        return "speculative"
    if batch.mode.is_decode():
        return "decode"
    return "mixed" if batch.is_mixed else "prefill"


def _eos_token_ids(tokenizer: object, hf_config: object) -> frozenset[int]:
    ids: set[int] = set()
    for source in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(hf_config, "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return frozenset(ids)
