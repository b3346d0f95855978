"""``DecodeStepTimer``: a decode step's time runs to the next decode step's start or to the
moment a step with prefill work is ready to launch, so the caller's work and the waits count,
and steps that switched kinds or waited are told apart."""

from __future__ import annotations

import pytest

from pcgspec.engine.step_timer import DecodeStepTimer
from pcgspec.speculative.policy import SpecPolicy
from pcgspec.speculative.step_cost import CLIP, MEAN_AFTER, StepCosts


@pytest.fixture
def timed() -> tuple[DecodeStepTimer, list[tuple]]:
    policy = SpecPolicy("auto", 4, [1, 2, 4, 8, 16])
    records: list[tuple] = []
    policy.record_step = lambda *a: records.append(a)  # type: ignore[method-assign]
    return DecodeStepTimer(policy), records


def test_a_decode_step_lasts_until_the_next_decode_or_prefill_step(timed):
    t, records = timed
    t.decode_step(True, 16, False, False, start=0.0)
    t.decode_step(True, 16, False, False, start=0.005)
    # a mixed step waits 1 ms for the speculative step in flight from 7 ms, then runs to 10 ms
    # with the read of its first tokens: neither kind's time
    t.prefill_step(ready=0.008)
    t.decode_step(True, 16, False, False, start=0.010)  # no wait: built from the device
    t.decode_step(False, 16, False, False, start=0.013)
    t.prefill_step(ready=0.014)
    t.finish(now=0.020)
    assert records == [
        (True, 16, pytest.approx(0.005), True, False, 1),
        (True, 16, pytest.approx(0.003), True, False, 1),
        (True, 16, pytest.approx(0.003), True, False, 1),
        (False, 16, pytest.approx(0.001), True, True, 1),
    ]


def test_switches_and_catch_ups(timed):
    """A switch is timed with the step after it when that one is of the same kind: it reads
    the switch, so the device's share of a catch-up is in its time."""
    t, records = timed
    t.decode_step(True, 4, False, caught_up=True, start=0.0)  # a new prompt: steady
    t.decode_step(False, 4, after_spec=True, caught_up=False, start=1.0)  # over a spec step
    t.decode_step(False, 4, False, False, start=2.0)  # reads it: part of the switch
    t.decode_step(True, 4, False, caught_up=True, start=3.5)  # caught up over plain steps
    t.decode_step(True, 4, False, caught_up=True, start=4.0)  # reads the catch-up
    t.decode_step(True, 4, False, caught_up=True, start=7.0)  # a new prompt again: steady
    t.decode_step(False, 4, after_spec=True, caught_up=False, start=8.0)  # a switch ...
    t.decode_step(True, 4, False, False, start=9.0)  # ... and straight back: two switches
    t.finish(now=10.0)
    assert [
        (kind, seconds, steady, switched, steps)
        for kind, _, seconds, steady, switched, steps in records
    ] == [
        (True, pytest.approx(1.0), True, False, 1),
        (False, pytest.approx(2.5), False, True, 2),
        (True, pytest.approx(3.5), False, True, 2),
        (True, pytest.approx(1.0), True, False, 1),
        (False, pytest.approx(1.0), False, True, 1),
        (True, pytest.approx(1.0), True, True, 1),
    ]


def test_a_switch_with_no_step_after_it_is_timed_alone(timed):
    t, records = timed
    t.decode_step(False, 2, False, False, start=0.0)
    t.decode_step(True, 2, False, caught_up=True, start=1.0)
    t.finish(now=3.0)
    with t.policy.aside():  # a switch inside a benchmark's forced pass is not timed
        t.decode_step(False, 2, after_spec=True, caught_up=False, start=4.0)
    t.decode_step(False, 2, False, False, start=5.0)
    t.finish(now=6.0)
    assert [(r[2], r[3], r[4], r[5]) for r in records] == [
        (pytest.approx(1.0), True, False, 1),
        (pytest.approx(2.0), False, True, 1),
        (pytest.approx(1.0), True, True, 1),  # steady: it read no speculative step
    ]


def test_a_switch_with_the_step_after_it_costs_its_excess_over_two_steady_steps():
    policy = SpecPolicy("auto", 4, [1, 2, 4, 8, 16])
    for _ in range(MEAN_AFTER):
        policy.record_step(True, 16, 2.0)
    policy.record_step(True, 16, 2.0 + 2.0 + 3.0, steady=False, switched=True, steps=2)
    assert policy.costs.switch_cost(16) == pytest.approx(3.0)
    assert policy.costs.cost(True, 16) == pytest.approx(2.0)
    assert policy.speculative_steps == MEAN_AFTER + 2


def test_nothing_is_timed_after_the_work_ran_out_or_aside(timed):
    t, records = timed
    t.decode_step(False, 1, False, False, start=0.0)
    t.finish(now=0.002)
    t.finish(now=9.0)  # idle: no step is open
    with t.policy.aside():
        t.decode_step(False, 1, False, False, start=10.0)
    t.decode_step(False, 1, False, False, start=20.0)
    t.finish(now=20.001)
    assert [round(r[2], 6) for r in records] == [0.002, 0.001]


def test_a_kind_costs_the_clipped_mean_of_its_times():
    """A prefill every fourth step is a cost of decoding (the mean keeps it whole; a median
    would drop it); a compile that took 100 steps' time counts as CLIP steps only; the first few
    times give their median (one slow first step alone would set the cost)."""
    costs = StepCosts()
    for t in (10.0, 1.0, 1.0):
        costs.record(False, 1, t)
    assert costs.cost(False, 1) == 1.0
    costs = StepCosts()
    times = [1.0, 1.0, 1.0, 4.5] * 4 + [100.0]  # a prefill after every third plain step
    for t in times:
        costs.record(True, 8, t)
    assert len(times) > MEAN_AFTER
    want = (sum(times[:-1]) + CLIP * 1.0) / len(times)
    assert costs.cost(True, 8) == pytest.approx(want)
