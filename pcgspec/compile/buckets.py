"""Token-count buckets for piecewise CUDA graphs: a batch of ``n`` tokens replays the graphs
captured for the smallest bucket that holds it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# (first, last, step): SGLang-like, dense where padding would cost the most relative to n.
_GRID = ((4, 32, 4), (48, 256, 16), (288, 512, 32), (576, 1024, 64), (1280, 4096, 256))
DEFAULT_BUCKETS: tuple[int, ...] = tuple(
    n for first, last, step in _GRID for n in range(first, last + 1, step)
)


def capture_buckets(max_tokens: int, explicit: Sequence[int] | None = None) -> list[int]:
    """The buckets to capture, ascending, none above ``max_tokens``.

    Default: the grid up to ``max_tokens``, plus ``max_tokens`` itself when it is not on the
    grid, so every batch up to ``max_tokens`` has a bucket. ``explicit`` replaces the grid and
    is taken as given (deduplicated, sorted, capped).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if explicit is not None:
        bad = [n for n in explicit if not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"explicit buckets must be positive ints, got {bad}")
        return sorted({n for n in explicit if n <= max_tokens})
    buckets = [n for n in DEFAULT_BUCKETS if n <= max_tokens]
    if not buckets or buckets[-1] != max_tokens:
        buckets.append(max_tokens)
    return buckets


def pad_to_bucket(num_tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``num_tokens`` (``buckets`` ascending); None when none is."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None
