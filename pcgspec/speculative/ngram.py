"""NGRAM (prompt lookup) drafting: find the longest suffix of prompt + output that occurred
earlier in the same sequence, and propose what followed its most recent earlier occurrence.

Vectorized over requests and positions; one loop over the (at most ``max_window``) suffix
offsets. Requests are right-aligned in one ``[B, N]`` tensor, left-padded with -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.config import SpeculativeConfig

_PAD = -1  # left padding of the right-aligned batch; never equals a token id


class NgramProposer(Proposer):
    def __init__(self, num_steps: int, min_window: int = 1, max_window: int = 12,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.num_steps = num_steps
        self.min_window = min_window
        self.max_window = max_window
        self.device = torch.device(device)

    @classmethod
    def from_config(cls, config: SpeculativeConfig, device: torch.device | str = "cpu"
                    ) -> NgramProposer:  # fmt: skip
        return cls(config.num_steps, config.speculative_ngram_min_match_window_size,
                   config.speculative_ngram_max_match_window_size, device)  # fmt: skip

    def propose(self, batch: ProposeInput) -> DraftProposal:
        tokens = right_align(batch.token_ids, self.device)
        return ngram_propose(tokens, self.num_steps, self.min_window, self.max_window)


def right_align(
    token_ids: Sequence[Sequence[int] | torch.Tensor], device: torch.device | str
) -> torch.Tensor:
    """Per-request token lists -> ``[B, max_len]`` int64, right-aligned, left-padded with -1."""
    width = max((len(t) for t in token_ids), default=0)
    out = torch.full((len(token_ids), width), _PAD, dtype=torch.int64, device=device)
    for row, ids in zip(out, token_ids):
        if len(ids):
            row[width - len(ids) :] = torch.as_tensor(ids, dtype=torch.int64)
    return out


def suffix_match_lengths(tokens: torch.Tensor, max_window: int) -> torch.Tensor:
    """``[B, N]`` right-aligned -> ``[B, N-1]``: at end position e, the length (<= max_window) of
    the longest common suffix of ``tokens[:, :e+1]`` and the whole sequence.
    """
    b, n = tokens.shape
    padded = F.pad(tokens, (max_window, 0), value=_PAD)  # token x sits at column x + max_window
    run = torch.zeros(b, n - 1, dtype=torch.int32, device=tokens.device)
    alive = (tokens[:, n - 1 :] != _PAD).expand(b, n - 1).clone()  # an empty row matches nothing
    for d in range(min(max_window, n - 1)):
        earlier = padded[:, max_window - d : max_window - d + n - 1]  # tokens[:, e - d]
        alive &= earlier == tokens[:, n - 1 - d : n - d]  # vs tokens[:, N-1-d]
        run += alive
    # NOTE: a window reaches the left padding before the suffix does (e < N-1), and padding
    # never equals a token, so no match extends past the start of a sequence.
    return run


def ngram_propose(
    tokens: torch.Tensor, num_steps: int, min_window: int, max_window: int
) -> DraftProposal:
    """Drafts for right-aligned ``tokens`` [B, N]: for the longest suffix of length in
    [min_window, max_window] that occurred earlier, the (up to) ``num_steps`` tokens that followed
    its latest earlier occurrence. Without a match a request proposes nothing.
    """
    b, n = tokens.shape
    device = tokens.device
    steps = torch.arange(num_steps, device=device)
    if n < 2:
        return DraftProposal(torch.full((b, num_steps), FILLER_TOKEN, device=device),
                             torch.zeros(b, dtype=torch.int64, device=device))  # fmt: skip
    run = suffix_match_lengths(tokens, max_window)  # [B, N-1]
    best = run.amax(dim=1)  # [B] longest earlier match of the suffix
    ends = torch.arange(n - 1, device=device)
    last_end = torch.where(run >= best[:, None], ends, -1).amax(dim=1)  # latest such occurrence
    num = (n - 1 - last_end).clamp_max(num_steps)  # tokens that follow it, at most k
    num = torch.where(best >= min_window, num, 0)
    follow = (last_end[:, None] + 1 + steps).clamp_max(n - 1)  # [B, k]
    drafts = torch.where(steps < num[:, None], tokens.gather(1, follow), FILLER_TOKEN)
    return DraftProposal(drafts, num)
