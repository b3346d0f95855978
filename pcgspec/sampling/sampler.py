"""The one logits-processing and sampling stage: penalties, temperature, top-k/top-p/min-p,
then greedy argmax or a seeded inverse-CDF draw per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pcgspec.kernels.sample_tokens import sample_tokens
from pcgspec.sampling.batch import GREEDY_EPS, SamplingBatch
from pcgspec.sampling.penalties import apply_penalties
from pcgspec.sampling.rng import STREAM_TOKEN, uniform

_F32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SampleLogprobs:
    """Log-probabilities of the model's raw distribution, before penalties and temperature."""

    token_logprobs: torch.Tensor  # [R] f32, of the chosen token
    top_ids: torch.Tensor  # [R, N] int64
    top_logprobs: torch.Tensor  # [R, N] f32, descending


@dataclass(frozen=True)
class SamplerOutput:
    tokens: torch.Tensor  # [R] int64
    logprobs: SampleLogprobs | None = None  # set when sb.max_logprobs is not None


def process_logits(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """[R, V] f32 -> [R, V] f32: penalties, temperature (not on greedy rows), then top-k, top-p
    and min-p as -inf masks. Never writes into ``logits``; returns it as is when nothing applies.
    """
    logits = apply_penalties(logits, sb)
    if sb.all_greedy:
        return logits
    logits = scale_by_temperature(logits, sb.temperature)  # fresh: the filter masks in place
    if sb.needs_penalties:  # NOTE: a tiny repetition penalty overflows; the filters need finite
        logits.clamp_(-_F32_MAX, _F32_MAX)
    if sb.needs_filters:
        logits.masked_fill_(logits < _filter_threshold(logits, sb), float("-inf"))
    return logits


def scale_by_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """A new ``logits / temperature`` [R, V]; greedy rows (temperature 0) stay as they are."""
    return logits / torch.where(temperature < GREEDY_EPS, 1.0, temperature)[:, None]


def _filter_threshold(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """[R, 1]: the smallest logit each row keeps. Ties with it are all kept.

    min-p: p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p)
    top-p: keep the highest tokens (after top-k) while the mass before them is < top_p.
    """
    log_min_p = torch.log(sb.min_p)[:, None]  # -inf where disabled
    if sb.rank_depth == 0:
        return logits.amax(dim=-1, keepdim=True) + log_min_p
    ranked = _highest(logits, sb.rank_depth)  # [R, D] descending
    kth = ranked.gather(1, (sb.top_k[:, None] - 1).clamp_max(ranked.shape[-1] - 1))
    kth = torch.where(sb.top_k[:, None] < sb.vocab_size, kth, float("-inf"))
    # NOTE: top-p rows have top_k <= D. Unnormalized weights and one prefix sum make a row's
    # cut independent of D, i.e. of the other rows in the batch.
    weights = torch.exp(ranked - ranked[:, :1]).masked_fill_(ranked < kth, 0.0)
    cdf = weights.cumsum(dim=-1)
    num_kept = (cdf - weights < sb.top_p[:, None] * cdf[:, -1:]).sum(dim=-1, keepdim=True)
    # NOTE: the first weight is 1, so num_kept >= 1 unless the row holds inf or NaN.
    top_p_min = ranked.gather(1, num_kept.clamp_min_(1) - 1)
    top_p_min = torch.where(sb.top_p[:, None] < 1.0, top_p_min, float("-inf"))
    return torch.maximum(torch.maximum(kth, top_p_min), ranked[:, :1] + log_min_p)


def _highest(logits: torch.Tensor, depth: int) -> torch.Tensor:
    """[R, V] -> [R, depth]: each row's ``depth`` highest logits, descending."""
    if depth >= logits.shape[-1]:
        return logits.sort(dim=-1, descending=True).values
    return logits.topk(depth, dim=-1, sorted=True).values


def probs_from_logits(processed: torch.Tensor) -> torch.Tensor:
    """[R, V] processed logits -> [R, V] probabilities (masked tokens get exactly 0)."""
    return torch.softmax(processed, dim=-1)


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in vocabulary order: per row the first token whose cumulative weight exceeds
    ``u * total``. ``probs`` [R, V] need not be normalized; ``u`` [R] in (0, 1). -> [R] int64.
    """
    cdf = probs.cumsum(dim=-1)  # [R, V]
    target = u[:, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True).clamp_max_(probs.shape[-1] - 1)
    # NOTE: a zero-weight token can only come from float rounding; fall back to the mode.
    valid = probs.gather(1, token) > 0
    return torch.where(valid, token, probs.argmax(dim=-1, keepdim=True)).squeeze(1)


def sample(logits: torch.Tensor, sb: SamplingBatch) -> SamplerOutput:
    """Next token per row for ``logits`` [R, V]; greedy rows take the argmax, sampled rows one
    draw from ``uniform(seed, position, STREAM_TOKEN)``, so a row's token depends only on its
    own logits, parameters, seed and position. On CUDA the draw and the argmax are one kernel
    (``sample_tokens``, whose reference this is).
    """
    logits = logits.float()
    processed = process_logits(logits, sb)
    if sb.all_greedy:
        tokens = processed.argmax(dim=-1)
    elif processed.is_cuda:
        probs = probs_from_logits(processed)
        tokens = sample_tokens(
            probs, processed, sb.temperature, sb.seed, sb.position, STREAM_TOKEN, GREEDY_EPS
        )
    else:
        u = uniform(sb.seed, sb.position, STREAM_TOKEN)
        drawn = sample_from_probs(probs_from_logits(processed), u)
        tokens = torch.where(sb.is_greedy, processed.argmax(dim=-1), drawn)
    if sb.max_logprobs is None:
        return SamplerOutput(tokens)
    return SamplerOutput(tokens, compute_logprobs(logits, tokens, sb.max_logprobs))


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> SampleLogprobs:
    """Raw ``log_softmax(logits)`` of ``tokens`` [R] and the top ``num_top`` per row."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]
    top = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return SampleLogprobs(chosen, top.indices, top.values)
