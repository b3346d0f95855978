"""Whether a decode batch speculates: a policy that keeps speculation from losing.

A speculative step of a batch emits the accept lengths (accepted drafts + 1) of its requests;
a plain step emits one token per request. Per batch-size bucket the policy keeps the recent
wall times of both kinds of step (median of the last few, robust to a compile or a long
catch-up), and per request a running average of its accept length, starting from the running
average over all requests. It speculates when

    sum_b accept_b / t_spec  >  B / t_plain

and takes a plain step otherwise. Until both times of a bucket are measured it tries each.
A bucket that chose plain steps probes with one speculative step after a run of them, and
doubles that run after every probe that does not win it back (a request that stops accepting
stops drafting, at a probe cost that fades). ``always`` speculates every step.

A model drafter that took plain steps (or met a new prompt) first catches up over those
positions; such a step is not timed (``record_step(steady=False)``), or the catch-up after every
run of plain steps would make speculation look dearer than it is and keep the policy off it.

Prompt lookup (NGRAM) knows before the step which requests found a match: the others count as
accept length 1, their averages are of steps with a match, and a batch where none matched
takes a plain step (also under ``always``: there is nothing to verify).
"""

from __future__ import annotations

import statistics
import weakref
from collections import defaultdict, deque
from collections.abc import Sequence

from pcgspec.compile.buckets import pad_to_bucket

_WINDOW = 16  # step times kept per bucket and kind
_EMA = 0.3  # weight of the newest verify step in a request's accept-length average
_PRIOR_EMA = 0.05  # weight of one verify step in the average over all requests (at least)
MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 512


class SpecPolicy:
    def __init__(self, mode: str, num_steps: int, batch_sizes: Sequence[int]) -> None:
        self.mode = mode
        self.num_steps = num_steps
        self.batch_sizes = list(batch_sizes)  # time buckets; larger batches share the last
        self._times: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=_WINDOW)
        )
        self._plain_run: dict[int, int] = defaultdict(int)  # plain steps since the last probe
        self._interval: dict[int, int] = defaultdict(lambda: MIN_PROBE_INTERVAL)
        self._probed: set[int] = set()  # buckets whose last step was a probe
        self._accept: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()
        self._prior = num_steps + 1.0  # every draft accepted, until verify steps say otherwise
        self._num_accepts = 0  # request-steps averaged into the prior
        self.speculative_steps = 0
        self.plain_steps = 0  # plain steps the policy chose

    def _bucket(self, batch_size: int) -> int:
        return pad_to_bucket(batch_size, self.batch_sizes) or self.batch_sizes[-1]

    def _time(self, speculative: bool, bucket: int) -> float | None:
        times = self._times[(speculative, bucket)]
        return statistics.median(times) if times else None

    def expected_accept(self, request: object) -> float:
        """The request's running accept length (the average over all requests before its
        first verify step).
        """
        return self._accept.get(request, self._prior)

    def choose(self, requests: Sequence[object], drafted: Sequence[bool] | None = None) -> bool:
        """True: speculate on this batch; False: take a plain decode step. ``drafted``: which
        requests have drafts, where the proposer knows before the step (prompt lookup); one
        without drafts gains nothing (accept length 1), and a batch without any takes a plain
        step whatever the mode.
        """
        if drafted is not None and not any(drafted):
            self.plain_steps += 1
            return False
        if self.mode == "always":
            return True
        bucket = self._bucket(len(requests))
        t_spec, t_plain = self._time(True, bucket), self._time(False, bucket)
        if t_spec is None:
            return True  # measure the speculative step first, then the plain one
        if t_plain is not None:
            expected = [self.expected_accept(r) for r in requests]
            if drafted is not None:
                expected = [a if d else 1.0 for a, d in zip(expected, drafted)]
            gain = sum(expected) * t_plain
            pays = gain > len(requests) * t_spec
            if bucket in self._probed:  # the probe's verdict: back to 8, or twice as long
                self._probed.discard(bucket)
                interval = MIN_PROBE_INTERVAL if pays else 2 * self._interval[bucket]
                self._interval[bucket] = min(interval, MAX_PROBE_INTERVAL)
            if pays:
                self._plain_run[bucket] = 0
                return True
            if self._plain_run[bucket] >= self._interval[bucket]:
                self._plain_run[bucket] = 0
                self._probed.add(bucket)
                return True
        self._plain_run[bucket] += 1
        self.plain_steps += 1
        return False

    def record_step(
        self, speculative: bool, batch_size: int, seconds: float, steady: bool = True
    ) -> None:
        """A decode step of ``batch_size`` requests took ``seconds`` of wall time. A step that
        is not ``steady`` (a model drafter first caught up over the positions of plain steps or
        a new prompt) is counted but not timed: that cost comes with switching to speculation,
        which the probes' back-off already bounds, not with each speculative step.
        """
        if steady:
            self._times[(speculative, self._bucket(batch_size))].append(seconds)
        self.speculative_steps += speculative

    def record_accept(self, request: object, accept_length: int) -> None:
        """``request`` accepted ``accept_length - 1`` drafts in a verify step (where it had
        drafts, when the proposer says so before the step: then the averages are of steps with
        drafts)."""
        old = self.expected_accept(request)
        self._accept[request] = (1 - _EMA) * old + _EMA * accept_length
        # NOTE: a plain mean (the optimistic start counting as one step) until it weighs less
        # than the EMA: a drafter that never accepts is known after a handful of requests.
        self._num_accepts += 1
        weight = max(_PRIOR_EMA, 1 / (self._num_accepts + 1))
        self._prior = (1 - weight) * self._prior + weight * accept_length
