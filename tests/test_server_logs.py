"""What the server logs at info level: a line per finished request, and the throughput line
every interval while the engine is busy (with a closing line for a spell that logged one)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pcgspec.server.deltas import FirstTokenTimes, SeqDelta
from pcgspec.server.logs import ThroughputLog, log_finished

RUNNING, KV = "running 3, waiting 2 | ", " | KV cache 25.0% (4/16 pages)"
STATS = {"num_running": 3, "num_waiting": 2, "kv_pages_used": 4, "kv_pages_total": 16}


def _delta(tokens: int, first: bool = False) -> SeqDelta:
    times = FirstTokenTimes(0.0, 0.0, 0.0) if first else None
    return SeqDelta(0, "", tuple(range(tokens)), (), None, first_token=times)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="pcgspec")
    clock = _Clock()
    return ThroughputLog(interval=10.0, clock=clock), clock, caplog


def _step(
    throughput: ThroughputLog,
    clock: _Clock,
    seconds: float,
    busy: bool = True,
    prompt_len: int = 0,
    deltas: tuple[SeqDelta, ...] = (),
) -> None:
    throughput.begin()
    clock.now += seconds
    firsts = sum(d.first_token is not None for d in deltas)
    throughput.count(prompt_len * firsts, sum(len(d.token_ids) for d in deltas))
    throughput.tick(busy, lambda: STATS)


def test_a_line_every_interval_while_busy_with_the_window_rates(log):
    throughput, clock, caplog = log
    _step(throughput, clock, 2.0, prompt_len=50, deltas=(_delta(1, first=True),))
    for _ in range(3):
        _step(throughput, clock, 2.0, deltas=(_delta(3),))
    assert caplog.messages == []  # 8 s
    _step(throughput, clock, 2.0, deltas=(_delta(3),))  # 10 s: 50 prompt, 13 generated
    assert caplog.messages == [RUNNING + "prompt 5.0 tok/s, generation 1.3 tok/s" + KV]
    _step(throughput, clock, 4.0, busy=False, deltas=(_delta(8),))  # the spell ends
    assert caplog.messages[-1] == RUNNING + "prompt 0.0 tok/s, generation 2.0 tok/s" + KV
    assert len(caplog.messages) == 2


def test_a_short_spell_logs_nothing_and_an_idle_pause_opens_a_new_window(log):
    throughput, clock, caplog = log
    _step(throughput, clock, 3.0, busy=False, prompt_len=99, deltas=(_delta(5, first=True),))
    clock.now += 60.0  # idle
    _step(throughput, clock, 3.0, deltas=(_delta(1),))  # then aborts end it: no step does
    clock.now += 30.0
    for _ in range(5):
        _step(throughput, clock, 2.0, deltas=(_delta(2),))
    assert caplog.messages == [RUNNING + "prompt 0.0 tok/s, generation 1.0 tok/s" + KV]


def test_a_finished_request_is_one_line(caplog):
    caplog.set_level(logging.INFO, logger="pcgspec")
    stream = SimpleNamespace(
        request_id="cmpl-1-0",
        finish_reasons=["length", "stop", "length"],
        num_prompt_tokens=12,
        num_output_tokens=30,
        arrival=5.0,
    )
    log_finished(stream, 5.25, None)
    log_finished(stream, 6.0, RuntimeError("the request failed: boom"))
    assert caplog.messages == [
        "request cmpl-1-0 finished (length,stop): 12 prompt tokens, 30 output tokens, 250 ms",
        "request cmpl-1-0 finished (error: the request failed: boom): 12 prompt tokens, "
        "30 output tokens, 1000 ms",
    ]
