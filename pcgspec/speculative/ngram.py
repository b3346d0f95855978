"""NGRAM (prompt lookup) drafting: find the longest suffix of prompt + output that occurred
earlier in the same sequence, and propose what followed its most recent earlier occurrence.

Each request keeps an index (``NgramIndex``) from every w-gram (w in [min_window, max_window])
to the end position of its latest occurrence, extended with only the tokens appended since the
previous step: a step costs O(new tokens * windows + windows) host work per request, not
O(sequence length); the first step of a request indexes its whole prompt once. Memory is bounded
by one dict entry per token per window size (``max_window - min_window + 1`` entries per token,
each keyed by a tuple of w ints: ~1.7 KB per token with the default 12 windows on CPython), kept
in a ``WeakKeyDictionary`` so a finished or aborted request's index goes with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from pcgspec.runners.batch_builder import upload
from pcgspec.speculative.base import FILLER_TOKEN, DraftProposal, ProposeInput, Proposer
from pcgspec.speculative.config import SpeculativeConfig

_BULK = 64  # extend by zipped slices from this many new tokens on (a prompt), else per token


class NgramIndex:
    """The w-grams of one token sequence that end before its last token, each mapped to the
    end position of its latest such occurrence.
    """

    def __init__(self, min_window: int, max_window: int) -> None:
        self.windows = range(max_window, min_window - 1, -1)  # longest first
        self.grams: dict[tuple[int, ...], int] = {}
        self.num_seen = 0  # NOTE: grams ending at positions < num_seen - 1 are indexed
        self.last_token: int | None = None  # token_ids[num_seen - 1], to spot a replaced list

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the grams ending at ``num_seen - 1 .. len(tokens) - 2``; rebuild from scratch
        when ``tokens`` is not a continuation of what was seen (shorter, or a changed token).
        """
        n = len(tokens)
        if n < self.num_seen or (self.num_seen and tokens[self.num_seen - 1] != self.last_token):
            self.grams.clear()
            self.num_seen = 0
        lo, hi = max(self.num_seen - 1, 0), n - 1  # new end positions [lo, hi)
        if hi - lo >= _BULK:
            self._extend_bulk(tokens, lo, hi)
        else:
            grams, windows, longest = self.grams, self.windows, self.windows[0]
            for end in range(lo, hi):
                tail = tuple(tokens[max(end + 1 - longest, 0) : end + 1])
                fit = windows if len(tail) == longest else [w for w in windows if w <= len(tail)]
                for w in fit:
                    grams[tail[-w:]] = end
        self.num_seen = n
        self.last_token = tokens[n - 1] if n else None

    def _extend_bulk(self, tokens: Sequence[int], lo: int, hi: int) -> None:
        ends = list(range(lo, hi))  # one int object per end, shared by its windows' entries
        for w in self.windows:
            first = max(lo, w - 1)  # the first end position with a whole w-gram
            if first >= hi:
                continue
            start = first - w + 1
            columns = [tokens[start + i : hi - w + 1 + i] for i in range(w)]  # NOTE: ends < hi
            self.grams.update(zip(zip(*columns), ends[first - lo :]))  # later ends overwrite

    def lookup(self, tokens: Sequence[int], num_steps: int) -> list[int]:
        """The (up to ``num_steps``) tokens after the latest earlier occurrence of the longest
        indexed suffix of ``tokens`` (already ``extend``-ed to it); [] without a match.
        """
        n = len(tokens)
        lo, hi = self.windows[-1], min(self.windows[0], n - 1)  # earlier occurrences: w < n
        tail = tuple(tokens[n - hi :]) if hi > 0 else ()
        found = None
        # NOTE: a suffix w-gram that occurred earlier implies every shorter one did (at the same
        # end), so the longest match is bisected; each hit is longer than the one before.
        while lo <= hi:
            mid = (lo + hi) // 2
            end = self.grams.get(tail[-mid:])
            if end is None:
                hi = mid - 1
            else:
                found, lo = end, mid + 1
        return [] if found is None else list(tokens[found + 1 : found + 1 + num_steps])


class NgramProposer(Proposer):
    proposes_first = True

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
        self._indexes: weakref.WeakKeyDictionary[object, NgramIndex] = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, config: SpeculativeConfig, device: torch.device | str = "cpu"
                    ) -> NgramProposer:  # fmt: skip
        return cls(config.num_steps, config.speculative_ngram_min_match_window_size,
                   config.speculative_ngram_max_match_window_size, device)  # fmt: skip

    def propose(self, batch: ProposeInput) -> DraftProposal:
        """Drafts on ``self.device`` through one host-to-device copy, the counts also on the
        host (``num_tokens_host``). Without ``batch.requests`` nothing is kept between calls.
        """
        k = self.num_steps
        drafts, flat = [], []
        for i, ids in enumerate(batch.token_ids):
            tokens = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            index = self._index(batch.requests[i] if batch.requests else None)
            index.extend(tokens)
            draft = index.lookup(tokens, k)
            drafts.append(len(draft))
            flat += draft + [FILLER_TOKEN] * (k - len(draft))
        tokens_dev, num_dev = upload(self.device, int64=[flat, drafts])
        return DraftProposal(tokens_dev.view(len(drafts), k), num_dev, num_tokens_host=drafts)

    def _index(self, request: object | None) -> NgramIndex:
        if request is None:
            return NgramIndex(self.min_window, self.max_window)
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = NgramIndex(self.min_window, self.max_window)
        return index
