"""``DecodeStepTimer``: a decode step costs the longer of its host cycle and its device span, and
the span is read only once the device has run the step."""

from __future__ import annotations

import time

import pytest
import torch

import pcgspec.engine.step_timer as step_timer
from pcgspec.engine.step_timer import DecodeStepTimer
from pcgspec.speculative.policy import SpecPolicy


class FakeEvent:
    """A CUDA event stand-in on a fake device clock (``now``, in ms) that has run once the
    device clock passed its time."""

    device_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = None

    def run_at(self, ms: float) -> None:
        self.at = ms

    def query(self) -> bool:
        return self.at is not None and self.at <= FakeEvent.device_ms

    def synchronize(self) -> None:
        FakeEvent.device_ms = max(FakeEvent.device_ms, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query()
        return end.at - self.at


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch) -> tuple[DecodeStepTimer, list]:
    monkeypatch.setattr(step_timer.torch.cuda, "Event", FakeEvent)
    FakeEvent.device_ms = 0.0
    policy = SpecPolicy("auto", 4, [1, 2, 4, 8, 16])
    records: list[tuple[bool, int, float, bool, bool]] = []
    policy.record_step = lambda *a: records.append(a)  # type: ignore[method-assign]
    t = DecodeStepTimer(policy, torch.device("cpu"))
    t.cuda = True
    return t, records


def launch(t: DecodeStepTimer, speculative: bool, start: float, gpu: tuple[float, float]):
    """A decode step started at ``start`` s on the host, whose device work ran over ``gpu``
    (ms): returns its closing event."""
    opened = t.mark()
    t.decode_step(speculative, 16, True, opened, start)
    opened.run_at(gpu[0])
    closed = t._open.events[1]
    closed.run_at(gpu[1])
    return closed


def test_a_device_bound_step_costs_its_span(timer):
    t, records = timer
    launch(t, True, start=0.0, gpu=(0.0, 5.0))  # 5 ms on the device
    t.step_started(0.001)  # the next step starts 1 ms later: the device is still busy
    assert records == []  # the span is not known yet, and nothing waited for it
    FakeEvent.device_ms = 5.0
    t.step_started(0.002)
    assert records == [(True, 16, pytest.approx(0.005), True, False)]
    assert t.regimes.share(True) == 1.0 and t.regimes.share(False) is None


def test_a_host_bound_step_costs_its_cycle(timer):
    t, records = timer
    launch(t, False, start=0.0, gpu=(0.0, 0.5))
    FakeEvent.device_ms = 1.0
    t.step_started(0.003)
    assert records == [(False, 16, pytest.approx(0.003), True, False)]
    assert t.regimes.share(False) == 0.0


def test_finish_waits_for_the_open_spans_and_reuses_events(timer):
    t, records = timer
    launch(t, False, start=0.0, gpu=(0.0, 1.0))
    t.step_started(0.0002)
    launch(t, True, start=time.perf_counter(), gpu=(1.0, 4.0))
    t.finish()  # the device finishes 3 ms of work: far longer than the host's cycle
    assert [(r[0], round(r[2], 6), r[4]) for r in records] == [
        (False, 0.001, False),
        (True, 0.003, True),
    ]
    pool = list(t._free)
    assert len(pool) == 4  # both steps' events are back in the pool, and taken from it
    assert t.mark() in pool and len(t._free) == 3


def test_steps_set_aside_are_not_timed(timer):
    t, records = timer
    with t.policy.aside():
        launch_opened = t.mark()
        t.decode_step(True, 16, True, launch_opened, 0.0)
    t.finish()
    assert records == [] and t._free == [launch_opened]


@pytest.mark.gpu
def test_cuda_steps_are_priced_by_cycle_and_span():
    """On CUDA every decode step of a speculative engine reaches the policy, priced at least at
    its device span, with no span left open once the engine is idle."""
    from oracle import PROMPTS

    from pcgspec import LLM, SamplingParams

    llm = LLM(speculative_algorithm="NGRAM", speculative_num_steps=4, max_total_tokens=1 << 14)
    llm.generate(PROMPTS[:4], SamplingParams(max_tokens=48, temperature=0.0), use_tqdm=False)
    timer = llm.engine.step_timer
    assert timer is not None and timer.cuda and not timer._spans and timer._open is None
    timed = timer.regimes.timed
    assert timed[True] + timed[False] > 0
    assert llm.engine.spec_worker.policy.step_times()
