"""Repetition, frequency and presence penalties with vLLM's semantics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pcgspec.sampling.batch import SamplingBatch


def apply_penalties(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Penalized copy of ``logits`` [R, V] f32; ``logits`` itself when no row has penalties.

    repetition (tokens in the prompt or the output): l > 0 ? l / r : l * r
    frequency and presence (output tokens only):     l - f * count - p * (count > 0)
    """
    counts = sb.output_counts
    if counts is None:
        return logits
    in_output = counts > 0  # [R, V]
    if sb.prompt_mask is not None:
        seen = in_output | sb.prompt_mask
        rep = torch.where(seen, sb.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    penalty = sb.frequency_penalty[:, None] * counts + sb.presence_penalty[:, None] * in_output
    return logits - penalty
