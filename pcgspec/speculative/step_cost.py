"""What a decode step costs, by kind (speculative or plain) and batch size, learned from the
steps the engine runs.

A step's cost is its share of the wall clock: from its start to the start of the next decode
step (``engine/step_timer.py``). So everything the engine and its caller do between two decode
steps counts: a server's work per step, the prefill steps of arriving requests and the read of
their first tokens, a drafter's catch-up over a new prompt, and a step's read-back and its wait
for the device, wherever they land. Over a run of one kind the costs add up to the wall time,
and the tokens per second of each kind are what a run of it would deliver: at high concurrency
a prefill step follows most decode steps, and a step's cost up to the next step alone would
leave its wait for the device and the read of its tokens to the prefill step.

Every decode step is timed in the bucket of its batch size, whatever batch ran before it and
whether requests finished in it, except a step that first switched kinds (its excess over a
steady step is the switch cost). Per kind and bucket the cost is the mean of the last
``WINDOW`` times, each clipped at ``CLIP`` times their median (a compile or a long garbage
collection is no cost of the kind, but a prefill step after a short plain step, several times
as long, counts whole, as it does after a longer speculative step), and their median while
fewer than ``MEAN_AFTER`` are in (one slow first step alone would set the cost).

Per kind, a least-squares line ``a + b * batch_size`` over the buckets with ``MIN_TIMED``
times, each weighted by its number of times (a single bucket: its cost), and never below the
kind's cheapest bucket, prices a bucket without times of its own, so that the sizes a batch
passes through as requests arrive and finish are priced before they were ever timed. It also
steadies a bucket with fewer than ``MEAN_AFTER`` times (priced by their median): its own price
is shrunk toward the line with the weight of ``LINE_TIMES`` times. At high concurrency the
batch wanders over several buckets as requests arrive and finish, the rarer ones timed a
handful of times between other steps; priced by those alone, two neighbouring buckets of 64
requests came out at 3.8 and 5.8 ms a speculative step, and the choice flipped (paying a switch
each time) as the batch moved between them. From ``MEAN_AFTER`` times on a bucket's own cost
stands: a bucket re-timed after a slow stretch must not be held back by neighbours timed in it.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict, deque

WINDOW = 64  # step times kept per kind and bucket
MIN_TIMED = 3  # times of a kind and bucket before its own cost counts
MEAN_AFTER = 8  # times before the cost is their (clipped) mean, not their median
CLIP = 10.0  # a time counts at most this many times the median
LINE_TIMES = 32  # the weight of the kind's line in a bucket's cost, in step times


class StepCosts:
    def __init__(self) -> None:
        self._times: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        # per kind and bucket: its own price and the number of times it is of
        self._costs: dict[tuple[bool, int], tuple[float, int]] = {}
        # the excess of a step that switched kinds over a steady one, per kind and bucket
        self._switch: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=WINDOW)
        )
        # per kind (intercept, slope, floor), None: no bucket
        self._lines: dict[bool, tuple[float, float, float] | None] = {}
        self._switch_costs: dict[int, float] = {}  # ``switch_cost`` per bucket, until a switch

    def record(self, speculative: bool, bucket: int, seconds: float) -> None:
        times = self._times[(speculative, bucket)]
        times.append(seconds)
        if len(times) >= MIN_TIMED:
            self._costs[(speculative, bucket)] = (_price(times), len(times))
            self._lines.pop(speculative, None)

    def record_switch(self, speculative: bool, bucket: int, seconds: float, steps: int = 1) -> None:
        """``steps`` steps of ``bucket``, the first switched to this kind (or caught a drafter
        up), took ``seconds``: their excess over as many steady steps of the kind, where that
        cost is known."""
        steady = self.cost(speculative, bucket)
        if steady is not None:
            self._switch[(speculative, bucket)].append(max(0.0, seconds - steps * steady))
            self._switch_costs.clear()

    def own(self, speculative: bool, bucket: int) -> float | None:
        """The bucket's own cost of this kind; None before ``MIN_TIMED`` times."""
        own = self._costs.get((speculative, bucket))
        return None if own is None else own[0]

    def forget(self, speculative: bool, bucket: int) -> None:
        """Drop the bucket's times of this kind (its cost stays until ``MIN_TIMED`` new)."""
        self._times[(speculative, bucket)].clear()

    def measured(self, speculative: bool) -> bool:
        return any(kind is speculative for kind, _ in self._costs)

    def cost(self, speculative: bool, bucket: int) -> float | None:
        """Seconds a steady step of this kind and bucket costs: the bucket's own (shrunk toward
        the kind's line while it has fewer than ``MEAN_AFTER`` times), else the line; None
        while no bucket of the kind has its own."""
        own = self._costs.get((speculative, bucket))
        if own is not None and own[1] >= MEAN_AFTER:
            return own[0]
        line = self._line(speculative)
        if line is None:
            return None
        intercept, slope, floor = line
        fitted = max(floor, intercept + slope * bucket)
        if own is None:
            return fitted
        price, n = own
        return (n * price + LINE_TIMES * fitted) / (n + LINE_TIMES)

    def _line(self, speculative: bool) -> tuple[float, float, float] | None:
        """The kind's line (intercept, slope) and its floor, the cheapest bucket's price."""
        if speculative not in self._lines:
            points = [(b, t, n) for (kind, b), (t, n) in self._costs.items() if kind is speculative]
            self._lines[speculative] = (
                (*_fit(points), min(t for _, t, _ in points)) if points else None
            )
        return self._lines[speculative]

    def switch_cost(self, bucket: int) -> float:
        """Seconds a switch to a speculative step and back costs beyond the two steady steps:
        per kind the median excess of the bucket's switches, else of the nearest bucket's (by
        batch-size ratio) that has some (a catch-up grows with the batch). Kept until the
        next switch is recorded: the policy asks every step."""
        cost = self._switch_costs.get(bucket)
        if cost is not None:
            return cost
        cost = 0.0
        for speculative in (True, False):
            timed = [b for (kind, b), ts in self._switch.items() if kind is speculative and ts]
            if timed:
                near = min(timed, key=lambda b: abs(math.log(b / bucket)))
                cost += statistics.median(self._switch[(speculative, near)])
        self._switch_costs[bucket] = cost
        return cost

    def buckets(self) -> list[int]:
        return sorted({bucket for _, bucket in self._times})


def _price(times: deque[float]) -> float:
    """The median of ``times`` while fewer than ``MEAN_AFTER``, then their mean, each clipped
    at ``CLIP`` times the median (one sort: it runs after every decode step)."""
    ordered = sorted(times)
    n, mid = len(ordered), len(ordered) // 2
    median = ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if n < MEAN_AFTER:
        return median
    cap = CLIP * median
    kept = bisect.bisect_right(ordered, cap)
    return math.fsum(ordered[:kept] + [cap] * (n - kept)) / n


def _fit(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """Weighted least squares ``t = a + b * x`` over the points ``(x, t, weight)``, the slope
    kept >= 0 (a larger batch never costs less); one distinct x: a flat line through their
    weighted mean."""
    total = sum(w for _, _, w in points)
    mean_x = sum(w * x for x, _, w in points) / total
    mean_t = sum(w * t for _, t, w in points) / total
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    if var == 0:
        return mean_t, 0.0
    cov = sum(w * (x - mean_x) * (t - mean_t) for x, t, w in points)
    slope = max(0.0, cov / var)
    return mean_t - slope * mean_x, slope
