"""Scheduler and page pool, driven without a model: every sampled row gets token 7."""

from __future__ import annotations

import pytest

from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.request import Request, RequestStatus
from pcgspec.engine.scheduler import MAX_HOLD_STEPS, ScheduledBatch, Scheduler
from pcgspec.runners.forward_batch import ForwardMode
from pcgspec.sampling_params import SamplingParams


class _NoText:
    text = ""

    def add_token(self, token_id: int) -> str:
        return ""


def _request(name: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(name, list(range(prompt_len)), params, 0, _NoText(), max_len=10_000)


def _step(sched: Scheduler):
    batch = sched.schedule()
    if batch is None:
        return None
    for req in batch.sampled_requests:
        req.append_token(7, frozenset())
    sched.launched(batch)
    sched.retire(batch.requests)
    return batch


def test_page_pool_refcounts():
    pool = PagePool(4)
    a = pool.alloc(2)
    pool.incref(a)
    pool.free(a)
    assert pool.num_free == 2  # still held once
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="freed twice"):
        pool.free(a[:1])
    with pytest.raises(MemoryError):
        pool.alloc(5)


def test_chunked_prefill_then_decode():
    sched = Scheduler(PagePool(64), page_size=4, max_running_requests=8, prefill_token_budget=32)
    req = _request("a", 100, max_tokens=3)
    sched.add(req)
    sizes = [_step(sched).num_new_tokens[0] for _ in range(4)]
    assert sizes == [32, 32, 32, 4]
    assert req.status is RequestStatus.RUNNING and req.num_output_tokens == 1
    batch = _step(sched)
    assert batch.mode is ForwardMode.DECODE and batch.num_new_tokens == [1]
    _step(sched)
    assert req.finished and req.num_output_tokens == 3
    assert sched.pages.num_free == 64 and not sched.has_work


def test_prefill_budget_is_shared_and_order_kept():
    sched = Scheduler(PagePool(64), page_size=4, max_running_requests=8, prefill_token_budget=20)
    reqs = [_request(str(i), 8, max_tokens=2) for i in range(4)]
    for r in reqs:
        sched.add(r)
    batch = _step(sched)
    assert [r.request_id for r in batch.requests] == ["0", "1", "2"]
    assert batch.num_new_tokens == [8, 8, 4]
    assert batch.samples == [True, True, False]


def test_decode_preempts_newest_and_recomputes():
    # 6 pages of 4 tokens; two requests of 8 prompt tokens need 3 pages each after 4 outputs.
    sched = Scheduler(PagePool(6), page_size=4, max_running_requests=8, prefill_token_budget=64)
    old, new = _request("old", 8, max_tokens=10), _request("new", 8, max_tokens=10)
    sched.add(old)
    sched.add(new)
    while not old.finished:
        _step(sched)
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    while sched.has_work:
        _step(sched)
    assert new.finished and new.num_output_tokens == 10 and old.num_output_tokens == 10
    assert sched.pages.num_free == 6


def test_request_alone_larger_than_pool_finishes_with_length():
    sched = Scheduler(PagePool(2), page_size=4, max_running_requests=8, prefill_token_budget=64)
    req = _request("big", 6, max_tokens=50)
    sched.add(req)
    while sched.has_work:
        _step(sched)
    assert req.finish_reason == "length" and req.num_output_tokens == 3
    assert sched.pages.num_free == 2


def test_overlap_schedules_one_step_ahead_of_the_tokens():
    """Driven as the overlap schedule drives it: each step is scheduled and launched before the
    previous step's tokens are appended. Inputs still line up with the tokens, pages cover the
    pending token, and a request whose pending token reaches max_tokens gets no further step.
    """
    sched = Scheduler(PagePool(64), page_size=4, max_running_requests=8, prefill_token_budget=8)
    reqs = [_request("a", 10, max_tokens=4), _request("b", 3, max_tokens=2)]
    for req in reqs:
        sched.add(req)
    pending, batches = [], []
    while sched.has_work or pending:
        batch = sched.schedule()
        if batch is not None:
            batches.append((batch.mode, [r.request_id for r in batch.requests], batch.num_decode))
            for req, n in zip(batch.requests, batch.num_new_tokens):
                end = req.num_computed_tokens + n
                assert end <= min(req.num_tokens, len(req.pages) * 4)
                assert batch.mode is ForwardMode.EXTEND or end == req.num_tokens
            for req in batch.sampled_requests:
                req.num_pending_tokens += 1
            sched.launched(batch)
        for req in pending:
            req.num_pending_tokens -= 1
            req.append_token(7, frozenset())
        sched.retire(pending)
        pending = [] if batch is None else batch.sampled_requests
    assert [r.num_output_tokens for r in reqs] == [4, 2] and all(r.finished for r in reqs)
    extend, decode = ForwardMode.EXTEND, ForwardMode.DECODE
    assert batches == [
        (extend, ["b", "a"], 0),  # b's whole prompt fits the budget: it goes first
        (extend, ["b", "a"], 1),  # b decodes beside a's last chunk
        (decode, ["a"], 1),
        (decode, ["a"], 1),
        (decode, ["a"], 1),
    ]
    assert sched.pages.num_free == 64


def test_a_queue_is_admitted_in_groups():
    """With more requests waiting than slots, finished requests are replaced a sixteenth of the
    running limit at a time: decode steps go on until that many slots are free. Fewer waiting
    ones are admitted at once, as is anything while nothing runs.
    """
    sched = Scheduler(
        PagePool(512), page_size=4, max_running_requests=32, prefill_token_budget=10_000
    )
    assert sched.admission_group == 2
    for i in range(39):
        sched.add(_request(f"r{i}", 4, max_tokens=i + 2 if i < 3 else 50))
    assert _step(sched).mode is ForwardMode.EXTEND and len(sched.running) == 32
    # r0 finishes with the first decode step; one slot free is not enough
    assert [_step(sched).mode for _ in range(2)] == [ForwardMode.DECODE] * 2
    admitted = _step(sched)  # r1 finished with the second: two free, taken beside the decodes
    assert admitted.is_mixed and len(admitted.requests) - admitted.num_decode == 2
    sched = Scheduler(
        PagePool(512), page_size=4, max_running_requests=32, prefill_token_budget=10_000
    )
    for i in range(33):
        sched.add(_request(f"s{i}", 4, max_tokens=50))
    _step(sched)
    victim = sched.running[0]
    victim.finish("abort")
    sched.release(victim)
    last = _step(sched)  # the one request waiting takes the one free slot at once
    assert [r.request_id for r in last.requests[last.num_decode :]] == ["s32"]


def _holding(num_running: int, max_tokens: int = 100) -> tuple[Scheduler, ScheduledBatch]:
    """A speculative engine's scheduler (``hold_arrivals``) whose ``num_running`` requests were
    all prefilled in its first step, and that step."""
    sched = Scheduler(
        PagePool(1024), page_size=4, max_running_requests=256, prefill_token_budget=10_000
    )
    sched.hold_arrivals = True
    for i in range(num_running):
        sched.add(_request(f"r{i}", 4, max_tokens=max_tokens))
    return sched, _step(sched)


def test_a_speculative_engine_holds_arrivals_for_a_group():
    """Without a queue, a speculative engine's scheduler holds new requests until a sixteenth
    of the running ones wait, rounded up (decode steps go on meanwhile), or for
    ``MAX_HOLD_STEPS`` steps; with 16 running or fewer, or nothing running, a request is
    admitted at once.
    """
    sched, first = _holding(48)
    assert first.mode is ForwardMode.EXTEND and len(sched.running) == 48  # none ran
    sched.add(_request("a", 4, max_tokens=100))
    sched.add(_request("b", 4, max_tokens=100))
    assert [_step(sched).mode for _ in range(2)] == [ForwardMode.DECODE] * 2  # 2 of 3 wait
    sched.add(_request("c", 4, max_tokens=100))
    grouped = _step(sched)
    assert grouped.is_mixed and len(grouped.requests) - grouped.num_decode == 3
    sched.add(_request("d", 4, max_tokens=100))  # alone: held MAX_HOLD_STEPS steps at most
    modes = [_step(sched).mode for _ in range(MAX_HOLD_STEPS)]
    assert modes == [ForwardMode.DECODE] * MAX_HOLD_STEPS
    late = _step(sched)
    assert late.is_mixed and [r.request_id for r in late.requests[late.num_decode :]] == ["d"]
    few, _ = _holding(16)
    few.add(_request("e", 4, max_tokens=100))
    assert _step(few).is_mixed  # a group of one
    few.add(_request("f", 4, max_tokens=100))  # 17 running: a group of two (rounded up)
    assert _step(few).mode is ForwardMode.DECODE
    few.add(_request("g", 4, max_tokens=100))
    assert len(_step(few).requests) == 19


def test_held_arrivals_are_new_requests_and_each_gets_its_whole_hold():
    """A preempted request goes back at once (it is not a new arrival), and a request that
    arrives after a held one was aborted is held its own ``MAX_HOLD_STEPS`` steps."""
    sched, _ = _holding(34)
    victim = sched.running[-1]
    sched._preempt(victim)  # 33 still run: a new arrival would wait for a group of three
    again = _step(sched)
    assert again.is_mixed and again.requests[again.num_decode :] == [victim]
    gone = _request("gone", 4, max_tokens=100)
    gone.group_id = "gone"
    sched.add(gone)
    assert [_step(sched).mode for _ in range(3)] == [ForwardMode.DECODE] * 3
    assert sched.abort("gone") == [gone]
    sched.add(_request("new", 4, max_tokens=100))
    modes = [_step(sched).mode for _ in range(MAX_HOLD_STEPS)]
    assert modes == [ForwardMode.DECODE] * MAX_HOLD_STEPS
    assert _step(sched).is_mixed


def test_arrivals_are_not_held_while_nothing_decodes():
    """When every running request's pending tokens (a step in flight, not read yet) reach its
    length, no decode batch is scheduled: a new arrival is prefilled then, not held for a group
    (which would make an empty step)."""
    sched, _ = _holding(34, max_tokens=2)  # one token each: 34 running, a group of three
    for req in sched.running:
        req.num_pending_tokens = 1  # their last token sampled by a step in flight
    sched.add(_request("x", 4, max_tokens=100))
    batch = sched.schedule()
    assert batch is not None and [r.request_id for r in batch.requests] == ["x"]
    assert batch.mode is ForwardMode.EXTEND and batch.num_decode == 0
