"""Whether a decode batch speculates: a policy that keeps speculation from losing.

A speculative step of a batch emits the accept lengths (accepted drafts + 1) of its requests;
a plain step emits one token per request. The policy prices both kinds of step with a cost
model learned from every step (``StepCosts``: per kind and batch-size bucket, leaning on a
line over the buckets where a bucket has few times or none), keeps per request an estimate of
its accept length, and speculates when

    sum_b accept_b / t_spec(B)  >  B / t_plain(B)

taking a plain step otherwise. Until both kinds have a cost, the policy tries each kind.

A request's estimate is its mean accept length over its recent verify steps (decayed by
``_DECAY`` a step), shrunk toward the mean over all requests with the weight of ``_PRIOR_WEIGHT``
steps: accept lengths of one request vary from step to step (1 to k+1), and a short noisy
average that dips under break-even would switch speculation off for a request that pays.

A switch costs more than either kind of step: a plain step launched over the speculative step
in flight waits for the rest of it when reading it, and a model drafter's speculative step
catches up over the positions of the plain steps. Such steps (with the step after them, which
reads them) are timed as switches, not as steps, or the catch-up after every run of plain
steps would make speculation look dearer than it is. The switch cost shapes two choices:

- Hysteresis: the policy leaves the kind of its last step only for a gain that would repay the
  switch within ``HYSTERESIS_STEPS`` steps (a margin of at most ``MAX_MARGIN``). Near break-even
  (prompt lookup on text that repeats now and then) it would otherwise flip every few steps and
  pay a switch each time. (A band above break-even, speculation starting at a gain of up to
  1.25 and stopping under 1, kept 70% of the steps of 16 streams plain on chat and lost a third
  of plain serving's throughput: each run of plain steps made the next speculative step catch
  up over it, which priced speculation higher still.)
- Probes: a bucket that chose plain steps probes with one speculative step after a run of them,
  and doubles that run after every probe that does not win it back (a request that stops
  accepting stops drafting, at a probe cost that fades). A probe is judged once its results
  arrive (a step later under the overlap schedule). The run is at least long enough that
  probes cost under ``PROBE_SHARE`` of the plain steps' time. ``always`` speculates every step.
- Re-timing: a speculative step's cost is measured only while the policy speculates, so a
  stretch in which steps ran slow could keep it on plain steps for good. A probe after
  ``RETIME_AFTER`` plain steps without a timed speculative one, for requests that would gain
  ``RETIME_GAIN`` if a speculative step cost no more than a plain one, drops the bucket's
  speculative times and speculates ``MEAN_AFTER`` + 3 more steps to measure them again (the
  first two are a switch, and a step's time comes in after the next choice: the verdict sees
  ``MEAN_AFTER`` times, enough for a mean, which counts the prefill steps between them); a
  re-timing that does not pay doubles the plain steps before the next (up to
  ``MAX_RETIME_AFTER``): at 64 requests in flight each is ten steps that cost twice a plain one
  for 2.2 tokens a request, and a catch-up over the batch, every few hundred steps in each
  bucket the batch visits. A bucket priced by the line alone is measured so too: a probe's step
  is a switch, never timed as a step, so without it a line drawn through a few slow steps of
  small batches (a ramp of arrivals, each catching the drafter up over a new prompt) priced 16
  requests' speculative step at 6.3 ms, against 2.1 ms measured, and kept 16 streams on plain
  steps for good. The other way round, a bucket that speculated ``RETIME_PLAIN_AFTER`` steps
  without a timed plain one (its plain cost is old, or only the line's) takes ``MEAN_AFTER``
  plain steps after a switch when speculation wins by less than ``RETIME_PLAIN_GAIN`` for the
  typical request: a close call is made on fresh costs.

The choice comes before the step's tokens are on the host (under the overlap schedule the last
ones are still on the device). Prompt lookup (NGRAM)
finds no match for some requests: a request's expected gain is ``1 + match_rate * (accept -
1)``, with its match rate and its accept estimate over steps with a match, both learned from
the verify steps' results. A step in which no request matched still verifies, for one token per
request; the falling match rates then keep such batches on plain steps, but for the probes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator, Sequence

from pcgspec.compile.buckets import pad_to_bucket
from pcgspec.speculative.step_cost import MEAN_AFTER, MIN_TIMED, StepCosts

_DECAY = 0.85  # weight of a request's earlier verify steps against its newest, per step
_PRIOR_WEIGHT = 2.0  # verify steps' worth of weight of the mean over all requests
_PRIOR_EMA = 0.05  # weight of one verify step in the mean over all requests (at least)
MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 512
PROBE_SHARE = 0.02  # the most a probe's switches may cost, against the plain steps between probes
RETIME_AFTER = 64  # plain steps before a probe measures speculative steps again (at first)
RETIME_GAIN = 1.1  # ... when its requests would gain this much at a plain step's time
MAX_RETIME_AFTER = 4096  # ... doubled after every re-timing that does not pay, up to this
RETIME_PLAIN_AFTER = 256  # speculative steps of a bucket before plain steps are timed again
RETIME_PLAIN_GAIN = 1.25  # ... when speculation wins by less than this for the typical request
HYSTERESIS_STEPS = 16  # a switch of kind must repay its cost within this many steps
MAX_MARGIN = 0.05  # ... and needs at most this relative gain
_ESTIMATORS = itertools.count()  # keys of the estimators' entries in a request's estimates

__all__ = ["MIN_TIMED", "RunningAverage", "SpecPolicy"]


class RunningAverage:
    """Per request, a decayed mean of its samples shrunk toward the mean over all requests:
    ``(prior * _PRIOR_WEIGHT + sum) / (_PRIOR_WEIGHT + n)`` with ``sum`` and ``n`` decayed by
    ``_DECAY`` a sample. The mean over all requests is a plain mean (the start value counting
    as one sample) until that weighs less than ``_PRIOR_EMA``: a drafter that never accepts is
    known after a handful of requests.

    A request's ``sum`` and ``n`` live on the request (``_estimates``), so they go with it when it
    finishes; every verify step adds a sample per request, and a weak dictionary's lookups cost
    six times an attribute's (0.15 ms a step at 64 requests on a 2-core CPU). Keyed by a number
    per estimator, so that a request refers to no policy object.
    """

    def __init__(self, start: float) -> None:
        self.prior = start
        self._count = 0  # samples averaged into the prior
        self._key = next(_ESTIMATORS)  # its entry in a request's estimates

    def get(self, request: object) -> float:
        total, n = _estimates(request).get(self._key, (0.0, 0.0))
        return (self.prior * _PRIOR_WEIGHT + total) / (_PRIOR_WEIGHT + n)

    def add(self, request: object, value: float) -> None:
        own = _estimates(request)
        total, n = own.get(self._key, (0.0, 0.0))
        own[self._key] = (_DECAY * total + value, _DECAY * n + 1)
        self._count += 1
        weight = max(_PRIOR_EMA, 1 / (self._count + 1))
        self.prior = (1 - weight) * self.prior + weight * value


def _estimates(request: object) -> dict[int, tuple]:
    """What the policy's estimators keep of ``request`` (``Request.spec_estimates``), keyed by
    the estimator's number."""
    own = getattr(request, "spec_estimates", None)
    if own is None:
        own = request.spec_estimates = {}  # type: ignore[attr-defined]
    return own


class SpecPolicy:
    def __init__(self, mode: str, num_steps: int, batch_sizes: Sequence[int]) -> None:
        self.mode = mode
        self.num_steps = num_steps
        self.batch_sizes = list(batch_sizes)  # cost buckets; larger batches share the last
        self.costs = StepCosts()
        self._plain_run: dict[int, int] = defaultdict(int)  # plain steps since the last probe
        self._interval: dict[int, int] = defaultdict(lambda: MIN_PROBE_INTERVAL)
        self._probed: dict[int, int] = {}  # buckets awaiting a probe's verdict: _samples then
        self._retiming: dict[int, int] = {}  # per bucket speculative steps left to re-time
        self._retimed: set[int] = set()  # buckets whose probe re-times: its verdict pending
        # per bucket plain steps before a probe re-times, doubled by every re-timing that loses
        self._retime_after: dict[int, int] = defaultdict(lambda: RETIME_AFTER)
        self._retiming_plain: dict[int, int] = {}  # per bucket plain steps left to re-time
        # per bucket: speculative_steps when a plain step was last timed, or re-timed
        self._plain_timed: dict[int, int] = {}
        # per bucket: plain_steps when a speculative step was last timed, or re-timed
        self._spec_timed: dict[int, int] = {}
        self._speculating = True  # the kind of the last step chosen
        self._accept = RunningAverage(num_steps + 1.0)  # every draft accepted, until measured
        self._match = RunningAverage(1.0)  # the share of steps with drafts (prompt lookup)
        self.speculative_steps = 0
        self.plain_steps = 0  # plain steps the policy chose
        self._recording = True
        self._samples = 0  # accept and match samples so far: a batch's sum is valid until one
        self._sum: tuple[tuple[object, ...], int, float] = ((), 0, 0.0)  # (batch, _samples, sum)
        self._key = next(_ESTIMATORS)  # its expected tokens' entry in a request's estimates

    def bucket(self, batch_size: int) -> int:
        """The batch-size bucket whose step costs price a batch of ``batch_size``."""
        return pad_to_bucket(batch_size, self.batch_sizes) or self.batch_sizes[-1]

    def step_times(self) -> dict[int, dict[str, float | None]]:
        """Per batch-size bucket timed so far, the step costs the policy decides by (ms; None:
        not known yet), for benchmarks and debugging."""
        costs = self.costs
        return {
            b: {
                "spec_ms": _ms(costs.cost(True, b)),
                "plain_ms": _ms(costs.cost(False, b)),
                "switch_ms": _ms(costs.switch_cost(b)),
            }
            for b in costs.buckets()
        }

    def probe_interval(self, bucket: int, t_plain: float, switch_cost: float) -> int:
        """Plain steps before the next probe: backed off, and long enough that the probe's
        switches cost at most ``PROBE_SHARE`` of their time."""
        floor = math.ceil(switch_cost / (PROBE_SHARE * t_plain))
        return min(max(self._interval[bucket], floor), MAX_PROBE_INTERVAL)

    def expected_accept(self, request: object) -> float:
        """The request's expected tokens from a speculative step: its accept estimate (the
        mean over all requests before its first verify step), discounted by how often it had
        no drafts.
        """
        return 1 + self._match.get(request) * (self._accept.get(request) - 1)

    def _expected_sum(self, requests: Sequence[object]) -> float:
        """``sum(expected_accept)`` over the batch, kept while the batch and every estimate
        stay the same (a run of plain steps: no verify step, so no new sample), and per request
        while the estimates do (under continuous batching the batch changes every few steps:
        64 requests' estimates cost 0.1 ms a step on a 2-core CPU).
        """
        batch, samples, total = self._sum
        if (
            samples == self._samples
            and len(batch) == len(requests)
            and all(a is b for a, b in zip(batch, requests))
        ):
            return total
        total, samples = 0.0, self._samples
        for request in requests:  # per request (samples, expected_accept) on the request
            own = _estimates(request)
            at, expected = own.get(self._key, (-1, 0.0))
            if at != samples:
                expected = self.expected_accept(request)
                own[self._key] = (samples, expected)
            total += expected
        self._sum = (tuple(requests), self._samples, total)
        return total

    def choose(self, requests: Sequence[object]) -> bool:
        """True: speculate on this batch; False: take a plain decode step."""
        if self.mode == "always":
            return True
        bucket = self.bucket(len(requests))
        t_spec, t_plain = self.costs.cost(True, bucket), self.costs.cost(False, bucket)
        if t_spec is None or t_plain is None:  # measure the speculative step first, then plain
            return self._chose(t_spec is None, bucket)
        switch_cost = self.costs.switch_cost(bucket)
        # tokens/s of a speculative step over a plain one, against a margin that favours the
        # kind of the last step
        gain = self._expected_sum(requests) * t_plain / (len(requests) * t_spec)
        margin = min(switch_cost / (HYSTERESIS_STEPS * t_plain), MAX_MARGIN)
        pays = gain > (1 - margin if self._speculating else 1 + margin)
        if self._retiming.get(bucket):  # NOTE: like a probe, not a choice to speculate
            self._retiming[bucket] -= 1
            return True
        if self._retiming_plain.get(bucket) or (
            pays and self._plain_is_old(bucket, t_spec, t_plain)
        ):
            self._retiming_plain[bucket] -= 1
            return self._chose(False, bucket)
        if self._probed.get(bucket, self._samples) < self._samples:
            # the probe's results are in: probe again after 8 plain steps, or twice as many;
            # a re-timing probe's: re-time after RETIME_AFTER plain steps, or twice as many
            del self._probed[bucket]
            interval = (
                MIN_PROBE_INTERVAL
                if pays
                else 2 * self.probe_interval(bucket, t_plain, switch_cost)
            )
            self._interval[bucket] = min(interval, MAX_PROBE_INTERVAL)
            if bucket in self._retimed:
                self._retimed.discard(bucket)
                after = RETIME_AFTER if pays else 2 * self._retime_after[bucket]
                self._retime_after[bucket] = min(after, MAX_RETIME_AFTER)
        if pays:
            return self._chose(True, bucket)
        if bucket not in self._probed and self._plain_run[bucket] >= self.probe_interval(
            bucket, t_plain, switch_cost
        ):
            self._probe(requests, bucket)
            return True  # NOTE: not a choice to speculate: the bar to go on stays the same
        return self._chose(False, bucket)

    def _probe(self, requests: Sequence[object], bucket: int) -> None:
        """Mark a probe of ``bucket``; time its speculative steps (again) where they would pay
        at a plain step's cost and none was timed for ``_retime_after[bucket]`` plain steps."""
        self._probed[bucket] = self._samples
        self._plain_run[bucket] = 0
        if (
            self._expected_sum(requests) > RETIME_GAIN * len(requests)
            and self.plain_steps - self._spec_timed.get(bucket, 0) >= self._retime_after[bucket]
        ):
            self.costs.forget(True, bucket)
            # NOTE: a step's time is recorded after the next choice, and the first two re-timed
            # steps are a switch: three more steps, and the verdict sees MEAN_AFTER times
            self._retiming[bucket] = MEAN_AFTER + 3
            self._retimed.add(bucket)
            self._spec_timed[bucket] = self.plain_steps

    def _plain_is_old(self, bucket: int, t_spec: float, t_plain: float) -> bool:
        """Whether the bucket's plain cost is old and speculation's win close for the typical
        request (the mean over requests: one batch's estimates swing with its requests' runs
        of hits and misses); then forget it, to time plain steps again (the first of them is
        a switch)."""
        typical = 1 + self._match.prior * (self._accept.prior - 1)
        if (
            typical * t_plain / t_spec >= RETIME_PLAIN_GAIN
            or self.speculative_steps - self._plain_timed.get(bucket, 0) < RETIME_PLAIN_AFTER
        ):
            return False
        self.costs.forget(False, bucket)
        self._retiming_plain[bucket] = MEAN_AFTER + 2  # NOTE: the first two are a switch
        self._plain_timed[bucket] = self.speculative_steps
        return True

    def _chose(self, speculate: bool, bucket: int) -> bool:
        self._speculating = speculate
        if speculate:
            self._plain_run[bucket] = 0
            self._retime_after.pop(bucket, None)  # it pays: re-time after RETIME_AFTER again
        else:
            self._plain_run[bucket] += 1
            self.plain_steps += 1
        return speculate

    @property
    def recording(self) -> bool:
        """Whether steps are timed and counted now (not inside ``aside``)."""
        return self._recording

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Steps in the block are neither timed nor counted (a benchmark's forced or
        synchronized passes, whose step times are not what serving would see)."""
        self._recording = False
        try:
            yield
        finally:
            self._recording = True

    def record_drafted(self, request: object, drafted: bool) -> None:
        """Whether ``request`` had drafts in a verify step (prompt lookup finds none for some;
        a model drafter always has them): its match rate."""
        self._match.add(request, float(drafted))
        self._samples += 1

    def record_step(
        self,
        speculative: bool,
        batch_size: int,
        seconds: float | None,
        steady: bool = True,
        switched: bool = False,
        steps: int = 1,
    ) -> None:
        """``steps`` decode steps of ``batch_size`` requests cost ``seconds`` (None: not
        measured). A step that is not ``steady`` (a plain step over the speculative step in
        flight, or a model drafter first caught up over the positions of plain steps or a new
        prompt) is counted but not timed as a step: that cost comes with switching or
        admission, not with each step. One that ``switched`` (the last decode step was of the
        other kind) is timed as a switch instead, with the step after it where that one read it
        (``steps`` 2, ``engine/step_timer.py``).
        """
        if not self._recording:
            return
        bucket = self.bucket(batch_size)
        self.speculative_steps += speculative * steps
        if seconds is None:
            return
        if steady:
            self.costs.record(speculative, bucket, seconds)
            if speculative:
                self._spec_timed[bucket] = self.plain_steps
            else:
                self._plain_timed[bucket] = self.speculative_steps
        elif switched:
            self.costs.record_switch(speculative, bucket, seconds, steps)

    def record_accept(self, request: object, accept_length: int) -> None:
        """``request`` accepted ``accept_length - 1`` drafts in a verify step (where it had
        drafts, when the proposer says so before verifying: then the estimate is of steps with
        drafts)."""
        self._accept.add(request, accept_length)
        self._samples += 1


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds
