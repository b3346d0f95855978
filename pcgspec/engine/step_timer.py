"""What each decode step cost, for the speculation policy: the longer of its cycle on the host
and its span on the device.

A step's cycle runs from its start to the start of the next step the caller ran right after it,
so that a server's work per step counts (``StepCosts``). Under the overlap schedule that is not
enough: the host waits for a step's device work only when it reads the step, which happens in a
later step, and when a prefill step follows a decode step (at high concurrency, almost every
one) the wait lands in the prefill step. A decode step would then be priced at its host launch
time, and a speculative step, whose device work is the larger, would look nearly as cheap as a
plain one. So on CUDA two events bracket each decode step's launches: the first runs once the
device finished the work before it, the second once it finished the step's own. The device
time between them is the step's span: its own work, and any wait for the host's launches.
Pipelined, a step costs the slower of the two sides, ``max(cycle, span)``.

The span is read without a synchronization: a step's closing event has run by the time its
results are read, one step later, and the timer looks at its open spans at each step's start.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from pcgspec.speculative.policy import SpecPolicy


@dataclass
class _Step:
    speculative: bool
    batch_size: int
    steady: bool  # neither waited for the steps in flight nor caught a drafter up
    switched: bool  # the last decode step was of the other kind
    start: float  # host clock at the step's start
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # around its launches (CUDA)
    cycle: float | None = None  # seconds, once the next step started


@dataclass
class StepRegimes:
    """Per kind, how many timed decode steps cost their device span, not their cycle."""

    timed: dict[bool, int]
    device_bound: dict[bool, int]

    def share(self, speculative: bool) -> float | None:
        n = self.timed[speculative]
        return self.device_bound[speculative] / n if n else None


class DecodeStepTimer:
    def __init__(self, policy: SpecPolicy, device: torch.device) -> None:
        self.policy = policy
        self.cuda = device.type == "cuda"
        self._open: _Step | None = None  # its cycle ends when the next step starts
        self._spans: deque[_Step] = deque()  # cycle known, device span not yet
        self._free: list[torch.cuda.Event] = []
        self._last_kind: bool | None = None  # whether the last decode step speculated
        self.regimes = StepRegimes({True: 0, False: 0}, {True: 0, False: 0})

    def mark(self) -> torch.cuda.Event | None:
        """An event at this point of the device's stream (CUDA), opening a decode step."""
        if not self.cuda:
            return None
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_started(self, now: float) -> None:
        """A step starts at ``now``: the open decode step's cycle ends here."""
        self._close(now)
        while self._spans and self._spans[0].events[1].query():  # type: ignore[index]
            self._report(self._spans.popleft())

    def decode_step(
        self,
        speculative: bool,
        batch_size: int,
        steady: bool,
        opened: torch.cuda.Event | None,
        start: float,
    ) -> None:
        """A decode step that started at ``start`` (host clock) and at ``opened`` on the device
        (``mark``) launched everything: its cycle is open until the next step starts."""
        if not self.policy.recording:
            if opened is not None:
                self._free.append(opened)
            return
        last, self._last_kind = self._last_kind, speculative
        switched = last is not None and last is not speculative
        events = None if opened is None else (opened, self.mark())
        self._open = _Step(speculative, batch_size, steady, switched, start, events)  # type: ignore[arg-type]

    def finish(self) -> None:
        """The caller has no work left: close the open cycle now and wait for the spans."""
        self._close(time.perf_counter())
        while self._spans:
            step = self._spans.popleft()
            step.events[1].synchronize()  # type: ignore[index]
            self._report(step)

    def _close(self, now: float) -> None:
        step, self._open = self._open, None
        if step is None:
            return
        step.cycle = now - step.start
        if step.events is None:
            self._report(step)
        else:
            self._spans.append(step)

    def _report(self, step: _Step) -> None:
        seconds = step.cycle
        if step.events is not None:
            opened, closed = step.events
            span = opened.elapsed_time(closed) / 1e3
            self._free += step.events
            if step.steady:
                self.regimes.timed[step.speculative] += 1
                self.regimes.device_bound[step.speculative] += span > seconds
            seconds = max(seconds, span)
        self.policy.record_step(
            step.speculative, step.batch_size, seconds, step.steady, step.switched
        )
