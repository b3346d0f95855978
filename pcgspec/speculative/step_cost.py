"""What a decode step costs, by kind (speculative or plain) and batch size, learned from the
steps the engine runs.

A step's cost is its whole cycle: from its start to the start of the next step the caller ran
right after it, so that what a server does per step beside the engine (publishing each step's
tokens, taking new requests) counts too; speculation takes fewer steps per token, and the
per-step cost is what it saves. Every decode step is timed in the bucket of its batch size,
whatever batch ran before it and whether requests finished in it, except a step that first
switched kinds or caught a drafter up (its excess over a steady step is the switch cost). Per
kind and bucket the cost is the median of the last ``WINDOW`` times once ``MIN_TIMED`` are in
(robust to a compile or a long collection); a bucket without its own median takes the kind's
least-squares line ``a + b * batch_size`` over the buckets that have one (a single bucket: its
median), so that the sizes a batch passes through as requests arrive and finish are priced
before they were ever timed.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque

WINDOW = 16  # step times kept per kind and bucket
MIN_TIMED = 3  # times of a kind and bucket before its median counts


class StepCosts:
    def __init__(self) -> None:
        self._times: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        self._medians: dict[tuple[bool, int], float] = {}
        # the excess of a step that switched kinds over a steady one, per kind and bucket
        self._switch: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        self._lines: dict[bool, tuple[float, float] | None] = {}  # per kind, None: no bucket

    def record(self, speculative: bool, bucket: int, seconds: float) -> None:
        times = self._times[(speculative, bucket)]
        times.append(seconds)
        if len(times) >= MIN_TIMED:
            self._medians[(speculative, bucket)] = statistics.median(times)
            self._lines.pop(speculative, None)

    def record_switch(self, speculative: bool, bucket: int, seconds: float) -> None:
        """A step of ``bucket`` that switched to this kind (or caught a drafter up) took
        ``seconds``: its excess over the kind's steady cost, where that is known."""
        steady = self.cost(speculative, bucket)
        if steady is not None:
            self._switch[(speculative, bucket)].append(max(0.0, seconds - steady))

    def own(self, speculative: bool, bucket: int) -> float | None:
        """The bucket's own median of this kind; None before ``MIN_TIMED`` times."""
        return self._medians.get((speculative, bucket))

    def forget(self, speculative: bool, bucket: int) -> None:
        """Drop the bucket's times of this kind (its median stays until ``MIN_TIMED`` new)."""
        self._times[(speculative, bucket)].clear()

    def measured(self, speculative: bool) -> bool:
        return any(kind is speculative for kind, _ in self._medians)

    def cost(self, speculative: bool, bucket: int) -> float | None:
        """Seconds a steady step of this kind and bucket costs: the bucket's median, else the
        kind's line; None while no bucket of the kind has a median."""
        own = self._medians.get((speculative, bucket))
        if own is not None:
            return own
        line = self._line(speculative)
        if line is None:
            return None
        intercept, slope = line
        return intercept + slope * bucket

    def _line(self, speculative: bool) -> tuple[float, float] | None:
        if speculative not in self._lines:
            points = [(b, t) for (kind, b), t in self._medians.items() if kind is speculative]
            self._lines[speculative] = _fit(points) if points else None
        return self._lines[speculative]

    def switch_cost(self, bucket: int) -> float:
        """Seconds a switch to a speculative step and back costs beyond the two steady steps:
        per kind the median excess of the bucket's switches, else of the nearest bucket's (by
        batch-size ratio) that has some (a catch-up grows with the batch)."""
        cost = 0.0
        for speculative in (True, False):
            timed = [b for (kind, b), ts in self._switch.items() if kind is speculative and ts]
            if timed:
                near = min(timed, key=lambda b: abs(math.log(b / bucket)))
                cost += statistics.median(self._switch[(speculative, near)])
        return cost

    def buckets(self) -> list[int]:
        return sorted({bucket for _, bucket in self._times})


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``t = a + b * x`` over the points, the slope kept >= 0 (a larger batch
    never costs less); one distinct x: a flat line through their mean."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return mean_t, 0.0
    slope = max(0.0, sum((x - mean_x) * (t - mean_t) for x, t in points) / var)
    return mean_t - slope * mean_x, slope
