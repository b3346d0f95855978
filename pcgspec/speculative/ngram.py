"""NGRAM (prompt lookup) drafting: find the longest suffix of prompt + output that occurred
earlier in the same sequence, and propose what followed its most recent earlier occurrence.

The search runs on the device (``pcgspec.kernels.ngram_propose``, the Triton kernel on CUDA, its
torch reference elsewhere) over the token history that the sampling slots keep for every
running request (``SamplingSlots.token_history``, written at admission and appended to by every
step's commit), so a step uploads nothing, copies nothing back and keeps no per-request state
here. Which requests found a match reaches the host with the step's results (the counts ride in
its one device-to-host copy), for the policy's match rates.
"""

from __future__ import annotations

import torch

from pcgspec.kernels.ngram_propose import ngram_propose, ngram_propose_ref
from pcgspec.sampling.slots import SamplingSlots
from pcgspec.speculative.base import CapturedStep, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.config import SpeculativeConfig


class NgramProposer(Proposer):
    def __init__(
        self, slots: SamplingSlots, num_steps: int, min_window: int = 1, max_window: int = 12
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        if slots.token_history is None:
            raise ValueError("NGRAM drafting needs sampling slots with a token history")
        self.slots, self.history = slots, slots.token_history  # [S, L], persistent
        self.num_steps = num_steps
        self.min_window = min_window
        self.max_window = max_window
        self._search = ngram_propose if slots.device.type == "cuda" else ngram_propose_ref

    @classmethod
    def from_config(cls, config: SpeculativeConfig, slots: SamplingSlots) -> NgramProposer:
        return cls(
            slots,
            config.num_steps,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
        )

    def propose(self, batch: ProposeInput) -> DraftProposal:
        """Drafts for ``batch.requests`` (which hold slots) on the slots' device."""
        return self._drafts(self.slots.slot_indices(batch.requests), batch.seq_lens)

    def propose_captured(self, step: CapturedStep) -> DraftProposal:
        """The same search inside a captured speculative step."""
        return self._drafts(step.slots, step.seq_lens)

    def _drafts(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> DraftProposal:
        """The search over the token history of ``slots`` (their lengths ``seq_lens``)."""
        drafts, counts = self._search(
            self.history, slots, seq_lens, self.num_steps, self.min_window, self.max_window
        )
        return DraftProposal(drafts, counts)
