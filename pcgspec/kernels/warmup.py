"""Start-up warm-up: launch every Triton kernel variant that serving can reach, once, so the
first concurrent batches compile nothing.

Triton compiles a kernel per specialization: its constexprs, the dtypes of its tensors, the
16-byte alignment of the pointers it specializes on and the value class (== 1, multiple of 16,
other) of its specialized ints. The kernels here keep per-batch values out of that key (sizes
are ``do_not_specialize``, index arrays ``do_not_specialize_on_alignment``, the extend kernel's
padding program a runtime test), so what is left depends on the model and the configuration
only, and one launch per variant on scratch buffers compiles (or loads from Triton's disk
cache) and loads all of them. Every launch writes no KV (slots -1) and no engine state.

Per family: ``warm_extend`` (per ``BLOCK_M`` that ``plan_extend`` can choose for the head config,
one launch whole and one with its prefix split, and its merge), ``warm_split_kv`` (KV store +
split-KV decode and reduce per tokens per request), ``warm_pad_batch`` (with and without request
starts, and with an extend graph's padded requests), ``warm_sampling`` (advance_positions, the
verify rows' build_sampling_params, the token draw),
``warm_verify`` (GREEDY and TARGET_MATCH verification, the strategies the speculative worker
uses, the accept kernel, and the padded rows of verify passes, in place for a verify graph or
not, and of draft catch-ups), for draft trees ``warm_verify_tree`` (their walk),
``warm_move_kv`` (their accepted K/V moved into place) and ``warm_tree_drafting`` (their
drafting's top-k and expansion), ``warm_draft_levels`` (a model drafter's level inputs) and
``warm_ngram`` (prompt lookup).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pcgspec.kernels.attention import decode_attention, decode_workspace, store_kv
from pcgspec.kernels.build_sampling_params import (
    SamplingTensors,
    advance_positions,
    build_sampling_params,
)
from pcgspec.kernels.draft_levels import draft_levels
from pcgspec.kernels.extend_attention import ExtendPlan, extend_attention, plan_extend
from pcgspec.kernels.move_kv import move_accepted_kv
from pcgspec.kernels.ngram_propose import ngram_propose
from pcgspec.kernels.pad_batch import PaddedRequests, pad_batch
from pcgspec.kernels.padded_rows import GraphRows, VerifyTokens, padded_rows, padded_rows_into
from pcgspec.kernels.sample_tokens import sample_tokens
from pcgspec.kernels.top_k import num_launches, top_k
from pcgspec.kernels.tree_expand import Beams, expand_beams, select_nodes
from pcgspec.kernels.verify_draft_tokens import VerifyStrategy, verify_draft_tokens
from pcgspec.sampling.batch import GREEDY_EPS
from pcgspec.sampling.rng import STREAM_TOKEN

if TYPE_CHECKING:
    from pcgspec.attention.base import AttentionBackend

logger = logging.getLogger("pcgspec")

_MAX_EXTEND_SWEEP = 128  # extend lengths tried: at >= the largest tile every BLOCK_M is capped
_WARM_SPLITS = 2  # split counts are runtime arguments: any value > 1 compiles the same kernel
VERIFY_STRATEGIES = (VerifyStrategy.GREEDY, VerifyStrategy.TARGET_MATCH)


@dataclass(frozen=True)
class AttentionShape:
    """One model's attention as the kernels see it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # of the KV cache and of q/k/v
    page_size: int
    sliding: bool = False  # some layers have a sliding window: their kernels are variants too

    @classmethod
    def of(cls, backend: AttentionBackend) -> AttentionShape:
        """The shape ``backend`` runs."""
        cache = backend.kv_cache
        return cls(
            backend.num_heads,
            backend.num_kv_heads,
            backend.head_dim,
            cache.spec.dtype,
            cache.page_size,
            any(w is not None for w in backend.sliding_windows),
        )

    @property
    def windows(self) -> tuple[int | None, ...]:
        """A window of each kind of layer (the window's value is a runtime argument)."""
        return (None, 1) if self.sliding else (None,)


@dataclass(frozen=True)
class KernelWarmup:
    """What serving launches: the Triton attention of each model (the target's, a model
    drafter's), the tokens per request of its split-KV passes (decode 1; verify and a draft
    catch-up k+1), with speculation (k, vocab size) of verification, and with prompt lookup
    (k, min window, max window) of its search; with draft trees their masked split-KV passes
    (N nodes, topk beams) and their walk.
    """

    attention: tuple[AttentionShape, ...] = ()
    split_kv_tokens: tuple[int, ...] = (1,)
    vocab_size: int | None = None  # of sampled rows' token draw (None: this process samples none)
    verify: tuple[int, int] | None = None
    ngram: tuple[int, int, int] | None = None
    tree: tuple[int, int, int] | None = None  # draft trees: (depth k, nodes N, topk)
    # draft trees' top-k over the draft vocabulary: (its size, the dtypes of the head's scores)
    tree_vocab: tuple[int, tuple[torch.dtype, ...]] | None = None
    draft_levels: tuple[int, int] | None = None  # a model drafter's levels: (depth - 1, topk)


def extend_lengths(shape: AttentionShape) -> list[int]:
    """The shortest extend length of each distinct specialization ``plan_extend`` chooses for
    ``shape`` (one per ``BLOCK_M``), ascending.
    """
    seen, lengths = set(), []
    for n in range(1, _MAX_EXTEND_SWEEP + 1):
        key = _plan(shape, n, n).specialization
        if key not in seen:
            seen.add(key)
            lengths.append(n)
    return lengths


def extend_variants(shape: AttentionShape) -> list[dict[str, object]]:
    """The extend kernel's constants (``BLOCK_M``, warps, ...) of each length in
    ``extend_lengths``.
    """
    return [_plan(shape, n, n).constants for n in extend_lengths(shape)]


def _plan(shape: AttentionShape, n: int, rows: int, num_splits: int = 1) -> ExtendPlan:
    return plan_extend(
        [n],
        rows,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        shape.dtype,
        shape.page_size,
        1.0,
        num_splits=num_splits,
    )


class _Scratch:
    """Small scratch tensors on one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def zeros(self, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def full(self, value: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.full(shape, value, dtype=dtype, device=self.device)

    def attention(self, shape: AttentionShape, rows: int) -> tuple[torch.Tensor, ...]:
        """q, k, v, out with the model's layout ([T, H, D], [T, KV, D]) and a one-page cache."""
        h, kv, d, dt = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype
        q, out = self.zeros(rows, h, d, dtype=dt), self.zeros(rows, h, d, dtype=dt)
        k, v = self.zeros(rows, kv, d, dtype=dt), self.zeros(rows, kv, d, dtype=dt)
        cache = [self.zeros(shape.page_size + 1, kv, d, dtype=dt) for _ in range(2)]
        return q, k, v, out, *cache


def warm_extend(shape: AttentionShape, device: torch.device) -> int:
    """Fused extend launches per ``BLOCK_M`` variant and kind of layer, each with a padded row:
    one whole, one with its prefix split, and its merge. Returns the launches.
    """
    s = _Scratch(device)
    lengths = extend_lengths(shape)
    for n, window in itertools.product(lengths, shape.windows):
        q, k, v, out, k_cache, v_cache = s.attention(shape, n + 1)
        pages = -(-n // shape.page_size)
        for splits in (1, _WARM_SPLITS):
            plan = _plan(shape, n, n + 1, splits)
            workspace = None
            if splits > 1:
                workspace = decode_workspace(n, shape.num_heads, shape.head_dim, splits, device)
            extend_attention(
                q,
                k,
                v,
                out,
                k_cache,
                v_cache,
                s.full(-1, n + 1),
                s.zeros(1, pages, dtype=torch.int32),
                s.full(n, 1, dtype=torch.int32),
                s.full(n, 1, dtype=torch.int32),
                s.zeros(1, dtype=torch.int32),
                plan,
                window=window,
                workspace=workspace,
            )
    return 3 * len(lengths) * len(shape.windows)


def warm_split_kv(
    shape: AttentionShape, tokens_per_seq: int, device: torch.device, tree: bool = False
) -> int:
    """KV store, then split-KV decode and its reduce per kind of layer, for one request of
    ``tokens_per_seq`` tokens (``tree``: under a tree mask, full-attention layers only)."""
    s = _Scratch(device)
    n = tokens_per_seq
    mask = torch.ones(1, n, n, dtype=torch.bool, device=device) if tree else None
    q, k, v, out, k_cache, v_cache = s.attention(shape, n)
    store_kv(k, v, k_cache, v_cache, s.full(-1, n))
    workspace = decode_workspace(n, shape.num_heads, shape.head_dim, _WARM_SPLITS, device)
    pages = -(-n // shape.page_size)
    windows = (None,) if tree else shape.windows
    for window in windows:
        decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            s.zeros(1, pages, dtype=torch.int32),
            s.full(n, 1, dtype=torch.int32),
            shape.page_size,
            1.0,
            _WARM_SPLITS,
            tokens_per_seq=n,
            window=window,
            workspace=workspace,
            tree_mask=mask,
        )
    return 1 + 2 * len(windows)


def warm_pad_batch(device: torch.device) -> int:
    """``pad_batch`` with request starts (piecewise prefill), without (decode / verify graph
    replays), and with padded requests (extend graph replays).
    """
    s = _Scratch(device)
    one = s.full(1, 1, dtype=torch.int32)
    two = [s.zeros(2, dtype=torch.int32) for _ in range(3)]
    tables = [s.zeros(n, 2, dtype=torch.int32) for n in (1, 2)]
    padded = PaddedRequests(one, two[1], two[2], tables[0], tables[1], s.zeros(1), s.zeros(2))
    for out_start, requests in (
        (s.zeros(1, dtype=torch.int32), None),
        (None, None),
        (two[0], padded),
    ):
        pad_batch(
            s.zeros(1),
            s.zeros(1),
            s.full(-1, 1),
            one,
            s.zeros(2),
            s.zeros(2),
            s.full(-1, 2),
            out_start,
            requests,
        )
    return 3


def warm_sampling(
    device: torch.device,
    num_steps: int | None = None,
    history: bool = False,
    vocab_size: int | None = None,
) -> int:
    """``advance_positions`` as ``SamplingSlots`` calls it: the commit of a decode step's one
    token per request and, with speculation, of a verify step's k+1, into a token history where
    prompt lookup keeps one; with speculation the k+1 rows per request of a verify step
    (``build_sampling_params``); with ``vocab_size`` the token draw of sampled rows
    (``sample_tokens``) over float32 rows.
    """
    s = _Scratch(device)
    drew = 0
    if vocab_size is not None:
        rows = s.zeros(1, vocab_size, dtype=torch.float32)
        f32 = s.zeros(1, dtype=torch.float32)
        sample_tokens(rows, rows, f32, s.zeros(1), s.zeros(1), STREAM_TOKEN, GREEDY_EPS)
        drew = 1
    table = SamplingTensors(*(t.zero_() for t in SamplingTensors.empty(1, device).tensors()))
    slots = s.zeros(1)
    rows = (1,) if num_steps is None else (1, num_steps + 1)
    if num_steps is not None:
        verify_rows = slots + num_steps + 1  # [1] k+1 rows
        build_sampling_params(table, verify_rows, num_steps + 1, req_slots=slots, row_start=slots)
    for n in rows:
        advance_positions(
            s.zeros(1),
            s.zeros(1),
            slots,
            tokens=s.zeros(1, n),
            last_token=s.zeros(1),
            history=s.zeros(1, 2, dtype=torch.int32) if history else None,
            prompt_len=s.zeros(1) if history else None,
        )
    return drew + (num_steps is not None) + len(rows)


def warm_verify(num_steps: int, vocab_size: int, device: torch.device) -> int:
    """Verification of ``num_steps`` drafts over ``vocab_size`` float32 rows, under each
    strategy the speculative worker uses, as it calls it; the padded rows of its passes.
    """
    s = _Scratch(device)
    k1 = num_steps + 1
    for strategy in VERIFY_STRATEGIES:
        verify_draft_tokens(
            s.zeros(1, k1, vocab_size, dtype=torch.float32),
            s.zeros(1, num_steps),
            strategy,
            seed=s.zeros(1, k1),
            position=s.zeros(1, k1),
            num_draft=s.full(num_steps, 1),
        )
    table = s.zeros(1, 1, dtype=torch.int32)
    tokens = VerifyTokens(s.zeros(1), s.zeros(1), s.zeros(1, num_steps))
    padded_rows(s.full(1, 1), table, 1, k1, start_offset=-1, tokens=tokens)  # a verify pass
    rows = GraphRows(
        s.zeros(k1),
        s.zeros(k1),
        s.full(-1, k1),
        s.zeros(1, dtype=torch.int32),
        s.full(k1, 1, dtype=torch.int32),
        s.zeros(k1),
    )
    padded_rows_into(rows, s.full(1, 1), table, 1, k1, start_offset=-1, tokens=tokens)  # graph
    padded_rows(s.zeros(1), table, 1, k1, num_valid=s.full(1, 1))  # a draft catch-up
    return 2 * len(VERIFY_STRATEGIES) + 3


def warm_verify_tree(depth: int, nodes: int, vocab_size: int, device: torch.device) -> int:
    """The tree walk of ``nodes``-node trees of ``depth`` under each strategy the worker uses."""
    s = _Scratch(device)
    parents = torch.arange(nodes, device=device).clamp_max(depth) - 1  # any valid tree
    for strategy in VERIFY_STRATEGIES:
        verify_draft_tokens(
            s.zeros(1, nodes, vocab_size, dtype=torch.float32),
            s.zeros(1, nodes - 1),
            strategy,
            seed=s.zeros(1, nodes),
            position=s.zeros(1, nodes),
            num_draft=s.full(nodes - 1, 1),
            parents=parents[None],
            max_depth=depth,
        )
    return 2 * len(VERIFY_STRATEGIES)


def warm_move_kv(shape: AttentionShape, depth: int, device: torch.device) -> int:
    """The move of a tree's accepted K/V into place in the target's cache (``shape``)."""
    s = _Scratch(device)
    kv = s.zeros(1, shape.page_size + 1, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype)
    path = s.full(-1, 1, depth + 1)
    move_accepted_kv(
        kv, kv.clone(), s.zeros(1, 1, dtype=torch.int32), shape.page_size, s.zeros(1), path
    )
    return 1


def warm_tree_drafting(
    depth: int,
    nodes: int,
    topk: int,
    vocab: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device,
) -> int:
    """A tree's drafting as it calls its kernels: each level's top-k over the draft vocabulary
    (log-probabilities, in each dtype the head scores in), the root's and each level's
    expansion (one variant per width of the beams' masks), the top-k of the kept candidates
    (float64 scores) and their selection."""
    s = _Scratch(device)
    count = 0
    for dtype in dict.fromkeys(dtypes):
        top_k(s.zeros(1, vocab, dtype=dtype), topk, log_softmax=True)
        count += num_launches(vocab)
    candidates = topk + (depth - 1) * topk * topk
    scores = s.zeros(1, candidates, dtype=torch.float64)
    tables = (scores, s.zeros(1, candidates), s.zeros(1, candidates))
    expand_beams(None, s.zeros(1, topk, dtype=torch.float32), s.zeros(1, topk), tables, 0, 0.0)
    for level in range(1, depth):
        mask = s.zeros(1, topk, level * topk, dtype=torch.bool)
        beams = Beams(
            s.zeros(1, topk, dtype=torch.float64), s.zeros(1, topk), s.zeros(1, topk), mask
        )
        lp = s.zeros(topk, topk, dtype=torch.float32)
        expand_beams(beams, lp, s.zeros(topk, topk), tables, topk, 0.0)
        count += 1
    select_nodes(top_k(scores, nodes - 1)[1], *tables[1:], depth)
    return count + num_launches(candidates) + 2


def warm_draft_levels(levels: int, topk: int, device: torch.device) -> int:
    """A model drafter's level inputs after its catch-up."""
    if levels == 0:
        return 0  # NOTE: a depth of 1 has no levels to build
    s = _Scratch(device)
    table = s.zeros(1, levels * topk, dtype=torch.int32)  # every level's slots in range
    draft_levels(s.zeros(1), s.zeros(1), s.zeros(1, dtype=torch.int32), table, 1, levels, topk)
    return 1


def warm_ngram(num_steps: int, min_window: int, max_window: int, device: torch.device) -> int:
    """The prompt-lookup search as ``NgramProposer`` calls it: an int32 token history whose
    rows have a spill column (``SamplingSlots``), int64 slots and lengths.
    """
    s = _Scratch(device)
    history = s.zeros(1, 3, dtype=torch.int32)[:, :2]
    ngram_propose(history, s.zeros(1), s.full(2, 1), num_steps, min_window, max_window)
    return 1


def run_warmup(warmup: KernelWarmup, device: torch.device) -> int:
    """Every family ``warmup`` names; returns the number of kernel launches (variants)."""
    k = None if warmup.verify is None else warmup.verify[0]
    count = warm_pad_batch(device) + warm_sampling(
        device, k, history=warmup.ngram is not None, vocab_size=warmup.vocab_size
    )
    for shape in _unique(warmup.attention):
        count += warm_extend(shape, device)
        count += sum(warm_split_kv(shape, n, device) for n in sorted(set(warmup.split_kv_tokens)))
    if warmup.verify is not None:
        count += warm_verify(*warmup.verify, device)
    if warmup.tree is not None:
        depth, nodes, topk = warmup.tree
        for shape in _unique(warmup.attention):
            count += sum(warm_split_kv(shape, n, device, tree=True) for n in {nodes, topk})
        if warmup.verify is not None:
            count += warm_verify_tree(depth, nodes, warmup.verify[1], device)
        if warmup.attention:
            count += warm_move_kv(warmup.attention[0], depth, device)
        if warmup.tree_vocab is not None:
            count += warm_tree_drafting(depth, nodes, topk, *warmup.tree_vocab, device)
    if warmup.ngram is not None:
        count += warm_ngram(*warmup.ngram, device)
    if warmup.draft_levels is not None:
        count += warm_draft_levels(*warmup.draft_levels, device)
    return count


def warm_up_kernels(warmup: KernelWarmup, device: torch.device) -> int:
    """``run_warmup`` on CUDA, timed and logged; a no-op elsewhere (the torch references
    serve there). Returns the launches.
    """
    if device.type != "cuda":
        return 0
    start = time.perf_counter()
    with torch.inference_mode():
        count = run_warmup(warmup, device)
    torch.cuda.synchronize(device)
    logger.info("kernel warm-up: %d variants in %.2f s", count, time.perf_counter() - start)
    return count


def _unique(shapes: Sequence[AttentionShape]) -> list[AttentionShape]:
    return list(dict.fromkeys(shapes))
