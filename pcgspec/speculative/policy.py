"""Whether a decode batch speculates: a policy that keeps speculation from losing.

A speculative step of a batch emits the accept lengths (accepted drafts + 1) of its requests;
a plain step emits one token per request. Per batch-size bucket the policy keeps the recent
wall times of both kinds of step (median of the last few, robust to a compile or a long
catch-up), and per request a running average of its accept length, starting from the running
average over all requests. It speculates when

    sum_b accept_b / t_spec  >  B / t_plain

and takes a plain step otherwise. A bucket without both times measured (``MIN_TIMED`` steady
steps each: the first steps of a kind may pay one-time costs, and a single inflated plain time
would keep the policy speculating, never timing a plain step again) decides by the nearest
bucket that has them: the sizes a batch passes through as its requests finish may never see a
steady step. Until some bucket has both, the policy tries each kind.

A switch costs more than either kind of step: a plain step first waits for the speculative
step in flight (its positions come from host lengths), and a model drafter's speculative step
waits for the plain steps in flight and catches up over their positions. Such steps are not
timed as steps (``record_step(steady=False)``), or the catch-up after every run of plain steps
would make speculation look dearer than it is and keep the policy off it. Their excess over a
steady step is the switch cost, and it shapes two choices:

- Hysteresis: the policy leaves the kind of its last step only for a gain that would repay the
  switch within ``HYSTERESIS_STEPS`` steps (a margin of at most ``MAX_MARGIN``). Near break-even
  (prompt lookup on text that repeats now and then) it would otherwise flip every few steps and
  pay a switch each time.
- Probes: a bucket that chose plain steps probes with one speculative step after a run of them,
  and doubles that run after every probe that does not win it back (a request that stops
  accepting stops drafting, at a probe cost that fades). A probe is judged once its results
  arrive (a step later under the overlap schedule): judged on the averages from before it, a
  new request's optimistic start would reset the back-off every time. The run is at least
  long enough that probes cost under ``PROBE_SHARE`` of the plain steps' time (an untrained
  EAGLE3 head switches for 3-10 ms on SmolLM2: a probe every 150-450 steps, not every 8).
  ``always`` speculates every step.
- Re-timing: a speculative step's time is measured only while the policy speculates, so a
  stretch in which steps ran slow (the host or the device slowed for a while: on an H100,
  speculative steps of 2-4 ms against 1.4 ms steady, for tens to hundreds of steps) could
  keep it on plain steps for good. A probe after ``RETIME_AFTER`` plain steps without a
  steady speculative one, for requests that would gain ``RETIME_GAIN`` if a speculative step
  cost no more than a plain one (a verify step is at least a plain step), drops the bucket's
  speculative times and speculates ``MIN_TIMED`` more steps to measure them again; it is
  judged after that, by the new times. A drafter that accepts nothing is never re-timed.

The choice comes before the step's tokens are on the host (under the overlap schedule the last
ones are still on the device, and only a speculative step waits for them). Prompt lookup (NGRAM)
finds no match for some requests: a request's expected gain is ``1 + match_rate * (accept -
1)``, with its running match rate and its accept-length average over steps with a match, both
learned from the verify steps' results (which requests had drafts comes back with them). A
step in which no request matched still verifies, for one token per request; the falling match
rates then keep such batches on plain steps, but for the probes.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import weakref
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence

from pcgspec.compile.buckets import pad_to_bucket

_WINDOW = 16  # step times kept per bucket and kind
MIN_TIMED = 3  # steady steps of a kind before its time counts
_EMA = 0.3  # weight of the newest verify step in a request's accept-length average
_PRIOR_EMA = 0.05  # weight of one verify step in the average over all requests (at least)
MIN_PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 512
PROBE_SHARE = 0.02  # the most a probe's switches may cost, against the plain steps between probes
RETIME_AFTER = 64  # plain steps of a bucket before a probe measures speculative steps again
RETIME_GAIN = 1.1  # ... when its requests would gain this much at a plain step's time
HYSTERESIS_STEPS = 16  # a switch of kind must repay its cost within this many steps
MAX_MARGIN = 0.05  # ... and needs at most this relative gain


class RunningAverage:
    """A per-request running average (an EMA) that starts from the average over all requests,
    which is a plain mean (the start value counting as one sample) until that weighs less
    than ``_PRIOR_EMA``: a drafter that never accepts is known after a handful of requests.
    """

    def __init__(self, start: float) -> None:
        self.prior = start
        self._count = 0  # samples averaged into the prior
        # NOTE: keyed by the Request object: a finished request's average goes with it.
        self._values: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()

    def get(self, request: object) -> float:
        return self._values.get(request, self.prior)

    def add(self, request: object, value: float) -> None:
        self._values[request] = (1 - _EMA) * self.get(request) + _EMA * value
        self._count += 1
        weight = max(_PRIOR_EMA, 1 / (self._count + 1))
        self.prior = (1 - weight) * self.prior + weight * value


class SpecPolicy:
    def __init__(self, mode: str, num_steps: int, batch_sizes: Sequence[int]) -> None:
        self.mode = mode
        self.num_steps = num_steps
        self.batch_sizes = list(batch_sizes)  # time buckets; larger batches share the last
        self._times: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=_WINDOW)
        )
        self._medians: dict[tuple[bool, int], float] = {}  # of windows with MIN_TIMED steps
        self._measured: list[int] = []  # buckets with both medians
        # the excess of a step that switched kinds over a steady one, per kind and bucket
        self._switch: dict[tuple[bool, int], deque[float]] = defaultdict(
            lambda: deque(maxlen=_WINDOW)
        )
        self._plain_run: dict[int, int] = defaultdict(int)  # plain steps since the last probe
        self._interval: dict[int, int] = defaultdict(lambda: MIN_PROBE_INTERVAL)
        self._probed: dict[int, int] = {}  # buckets awaiting a probe's verdict: _samples then
        self._retiming: dict[int, int] = {}  # per bucket speculative steps left to re-time
        # per bucket: plain_steps when a steady speculative step was last timed, or re-timed
        self._spec_timed: dict[int, int] = {}
        self._speculating = True  # the kind of the last step chosen
        self._accept = RunningAverage(num_steps + 1.0)  # every draft accepted, until measured
        self._match = RunningAverage(1.0)  # the share of steps with drafts (prompt lookup)
        self.speculative_steps = 0
        self.plain_steps = 0  # plain steps the policy chose
        self._recording = True
        self._samples = 0  # accept and match samples so far: a batch's sum is valid until one
        self._sum: tuple[tuple[object, ...], int, float] = ((), 0, 0.0)  # (batch, _samples, sum)

    def _bucket(self, batch_size: int) -> int:
        return pad_to_bucket(batch_size, self.batch_sizes) or self.batch_sizes[-1]

    def _time(self, speculative: bool, bucket: int) -> float | None:
        return self._medians.get((speculative, bucket))

    def _reference(self, bucket: int) -> int | None:
        """The bucket whose step times decide for ``bucket``: itself once both are measured,
        else the nearest (by batch-size ratio) that has both; None while none has."""
        if bucket in self._measured:
            return bucket
        if not self._measured:
            return None
        return min(self._measured, key=lambda b: abs(math.log(b / bucket)))

    def step_times(self) -> dict[int, dict[str, float | None]]:
        """Per batch-size bucket the step times the policy decides by (ms; None: not measured
        yet), for benchmarks and debugging."""
        buckets = sorted({bucket for _, bucket in self._times})
        return {b: {"spec_ms": _ms(self._time(True, b)), "plain_ms": _ms(self._time(False, b)),
                    "switch_ms": _ms(self.switch_cost(b))} for b in buckets}  # fmt: skip

    def switch_cost(self, bucket: int) -> float:
        """Seconds a switch to a speculative step and back costs beyond the two steady steps:
        per kind the bucket's own switches, else its reference bucket's."""
        ref = self._reference(bucket)
        cost = 0.0
        for speculative in (True, False):
            times = self._switch[(speculative, bucket)]
            if not times and ref is not None:
                times = self._switch[(speculative, ref)]
            cost += statistics.median(times) if times else 0.0
        return cost

    def probe_interval(self, bucket: int, t_plain: float, switch_cost: float) -> int:
        """Plain steps before the next probe: backed off, and long enough that the probe's
        switches cost at most ``PROBE_SHARE`` of their time."""
        floor = math.ceil(switch_cost / (PROBE_SHARE * t_plain))
        return min(max(self._interval[bucket], floor), MAX_PROBE_INTERVAL)

    def expected_accept(self, request: object) -> float:
        """The request's expected tokens from a speculative step: its running accept length
        (the average over all requests before its first verify step), discounted by how often
        it had no drafts.
        """
        return 1 + self._match.get(request) * (self._accept.get(request) - 1)

    def _expected_sum(self, requests: Sequence[object]) -> float:
        """``sum(expected_accept)`` over the batch, kept while the batch and every average stay
        the same (a run of plain steps: no verify step, so no new sample).
        """
        batch, samples, total = self._sum
        if samples != self._samples or len(batch) != len(requests) or any(
                a is not b for a, b in zip(batch, requests)):  # fmt: skip
            total = sum(self.expected_accept(r) for r in requests)
            self._sum = (tuple(requests), self._samples, total)
        return total

    def choose(self, requests: Sequence[object]) -> bool:
        """True: speculate on this batch; False: take a plain decode step."""
        if self.mode == "always":
            return True
        bucket = self._bucket(len(requests))
        ref = self._reference(bucket)
        if ref is None:  # measure the speculative step first, then the plain one
            return self._chose(self._time(True, bucket) is None, bucket)
        t_spec, t_plain = self._medians[(True, ref)], self._medians[(False, ref)]
        switch_cost = self.switch_cost(bucket)
        # tokens/s of a speculative step over a plain one, against a margin that favours the
        # kind of the last step
        gain = self._expected_sum(requests) * t_plain / (len(requests) * t_spec)
        margin = min(switch_cost / (HYSTERESIS_STEPS * t_plain), MAX_MARGIN)
        pays = gain > (1 - margin if self._speculating else 1 + margin)
        if self._retiming.get(bucket):  # NOTE: like a probe, not a choice to speculate
            self._retiming[bucket] -= 1
            return True
        if self._probed.get(bucket, self._samples) < self._samples:
            # the probe's results are in: probe again after 8 plain steps, or twice as many
            del self._probed[bucket]
            interval = (MIN_PROBE_INTERVAL if pays else
                        2 * self.probe_interval(bucket, t_plain, switch_cost))  # fmt: skip
            self._interval[bucket] = min(interval, MAX_PROBE_INTERVAL)
        if pays:
            return self._chose(True, bucket)
        if bucket not in self._probed and self._plain_run[bucket] >= self.probe_interval(
                bucket, t_plain, switch_cost):  # fmt: skip
            self._probed[bucket] = self._samples
            self._plain_run[bucket] = 0
            # the gain if a speculative step cost a plain one's time: sum(accept) / B
            if (ref == bucket and self._expected_sum(requests) > RETIME_GAIN * len(requests)
                    and self.plain_steps - self._spec_timed.get(bucket, 0) >= RETIME_AFTER):
                self._times[(True, bucket)].clear()  # the median stays until MIN_TIMED new
                self._retiming[bucket] = MIN_TIMED
                self._spec_timed[bucket] = self.plain_steps
            return True  # NOTE: not a choice to speculate: the bar to go on stays the same
        return self._chose(False, bucket)

    def _chose(self, speculate: bool, bucket: int) -> bool:
        self._speculating = speculate
        if speculate:
            self._plain_run[bucket] = 0
        else:
            self._plain_run[bucket] += 1
            self.plain_steps += 1
        return speculate

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
        seconds: float,
        steady: bool = True,
        switched: bool = False,
    ) -> None:
        """A decode step of ``batch_size`` requests took ``seconds`` of wall time. A step that
        is not ``steady`` (it waited for the steps in flight, ran another batch than the last
        decode step or finished requests, or a model drafter first caught up over the positions
        of plain steps or a new prompt) is counted but not timed as a step: that cost comes
        with switching or with the batch's change, not with each step. One that ``switched``
        (the last decode step, of the same batch, was of the other kind) is timed as a switch
        instead.
        """
        if not self._recording:
            return
        bucket = self._bucket(batch_size)
        if steady:
            times = self._times[(speculative, bucket)]
            times.append(seconds)
            if speculative:
                self._spec_timed[bucket] = self.plain_steps
            if len(times) >= MIN_TIMED:
                self._medians[(speculative, bucket)] = statistics.median(times)
                if (not speculative, bucket) in self._medians and bucket not in self._measured:
                    self._measured.append(bucket)
        elif switched and (ref := self._reference(bucket)) is not None:
            steady_time = self._medians[(speculative, ref)]
            self._switch[(speculative, bucket)].append(max(0.0, seconds - steady_time))
        self.speculative_steps += speculative

    def record_accept(self, request: object, accept_length: int) -> None:
        """``request`` accepted ``accept_length - 1`` drafts in a verify step (where it had
        drafts, when the proposer says so before verifying: then the average is of steps with
        drafts)."""
        self._accept.add(request, accept_length)
        self._samples += 1


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds
