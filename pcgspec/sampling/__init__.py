"""Logits processing and sampling on output rows (one row = one position whose token is chosen)."""

from pcgspec.sampling.batch import GREEDY_EPS, SamplingBatch
from pcgspec.sampling.penalties import apply_penalties
from pcgspec.sampling.rng import STREAM_ACCEPT, STREAM_RESAMPLE, STREAM_TOKEN, hash32, uniform
from pcgspec.sampling.sampler import (
    SampleLogprobs,
    SamplerOutput,
    compute_logprobs,
    probs_from_logits,
    process_logits,
    sample,
    sample_from_probs,
)

__all__ = [
    "GREEDY_EPS",
    "STREAM_ACCEPT",
    "STREAM_RESAMPLE",
    "STREAM_TOKEN",
    "SampleLogprobs",
    "SamplerOutput",
    "SamplingBatch",
    "apply_penalties",
    "compute_logprobs",
    "hash32",
    "probs_from_logits",
    "process_logits",
    "sample",
    "sample_from_probs",
    "uniform",
]
