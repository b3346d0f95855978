"""What each decode step cost, for the speculation policy: its share of the wall clock.

A decode step's time runs from its start to the start of the next decode step, to the moment
a step with prefill work (a mixed or prefill step) is ready to launch, after any wait for the
steps in flight, or to the moment the engine runs out of work. The caller's work between steps
(a server publishing tokens) and, under the overlap schedule, a decode step's wait for the
device and the read of its results land there (``StepCosts``), so a kind is priced at what a
run of it delivers, not at its launches alone. A step with prefill work runs whichever kind the
policy chooses, so its own time is neither kind's.

A step is not steady, and its excess is a switch's, when it is a plain step launched over a
speculative step in flight (reading that step, it waits for the rest of it), or when it
speculated after a plain step and its drafter first caught up over the positions of the plain
steps. Such a switch is timed together with the decode step after it, when that one is of the
same kind: under the overlap schedule a step reads the one before, so the device's share of a
catch-up lands in the next step's time, not in a steady step's. A step with prefill work
ends the open step's time when it is ready to launch, later by as long as its read of the
steps in flight took (their rest on the device and their commit). Its own launch, host work
while the device runs the step before, is in neither kind: counted in a speculative step, a
mixed launch (3 ms at 16 requests in flight, against 1.2 ms for a decode call) priced
speculation out where a mixed step follows about every second speculative step
(docs/speculative.md#served).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pcgspec.speculative.policy import SpecPolicy


@dataclass(frozen=True)
class _Step:
    speculative: bool
    batch_size: int
    steady: bool
    switched: bool  # the last decode step was of the other kind
    start: float  # host clock at the step's start


class DecodeStepTimer:
    def __init__(self, policy: SpecPolicy) -> None:
        self.policy = policy
        self._open: _Step | None = None  # its time ends at the next decode step's start
        self._last_kind: bool | None = None  # whether the last decode step speculated
        self._switch: tuple[_Step, float] | None = None  # a switch and its time, until the next

    def decode_step(
        self, speculative: bool, batch_size: int, after_spec: bool, caught_up: bool, start: float
    ) -> None:
        """A decode step that started at ``start`` (host clock) ran (``after_spec``: a plain
        step over a speculative step in flight): the open step's time ends there, and this
        one's runs until the next decode step starts."""
        self._close(start)
        if not self.policy.recording:
            self._switch = None
            return
        last, self._last_kind = self._last_kind, speculative
        switched = last is not None and last is not speculative
        steady = not (after_spec or (caught_up and switched))
        self._open = _Step(speculative, batch_size, steady, switched, start)

    def prefill_step(self, ready: float) -> None:
        """A step with prefill work was ready to launch at ``ready`` (host clock; later by its
        read of the steps in flight): the open step's time ends there."""
        self._close(ready)

    def finish(self, now: float | None = None) -> None:
        """The engine ran out of work at ``now`` (default: the present): the open step's time
        ends there (and a switch's, when no step came after it)."""
        self._close(time.perf_counter() if now is None else now)
        if self._switch is not None:
            self._record(*self._switch)
            self._switch = None

    def _close(self, now: float) -> None:
        step, self._open = self._open, None
        if step is None:
            return
        seconds = now - step.start
        switch, self._switch = self._switch, None
        if switch is not None:
            first, first_seconds = switch
            if step.speculative is first.speculative:  # NOTE: it read the switch
                self._record(first, first_seconds + seconds, steps=2)
                return
            self._record(first, first_seconds)
        if step.switched and not step.steady:
            self._switch = (step, seconds)
            return
        self._record(step, seconds)

    def _record(self, step: _Step, seconds: float, steps: int = 1) -> None:
        self.policy.record_step(
            step.speculative, step.batch_size, seconds, step.steady, step.switched, steps
        )
