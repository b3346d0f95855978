"""Fault isolation: a step that fails on one request's data fails that request, not the batch.

When running a batch raises, its requests run again in halves, recursively, so the culprits end
up alone; a request whose run fails alone finishes with "error" and its pages are freed, while
the others complete this same step. A failure that every request of the batch meets alone is
not tied to a request: it is raised and stops the engine. So is, at once, an error that marks
the device unusable (``device_unusable``: a sticky CUDA error every later launch meets, which
no request is to blame for and no bisection would survive).

A failed run runs again, so it must leave no trace: KV rewritten at the same slots is fine, and
what it committed on the device (sampling-slot positions, last tokens, output counts:
``SamplingSlots.commit``) and kept for the next step (a drafter's verify rows) is rolled back
(``Rollback``) before its requests run again, so none advances twice. A request whose host
progress it advanced (its tokens pending in a launched step) cannot run twice and fails with the
rest of its run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pcgspec.engine.request import Request
from pcgspec.engine.scheduler import ScheduledBatch

logger = logging.getLogger("pcgspec")

RunBatch = Callable[[ScheduledBatch], None]  # compute, sample, commit (or launch)
# NOTE: how CUDA reports a sticky error (the context is lost; every later call fails too)
_DEVICE_LOST = (
    "CUDA error",
    "device-side assert",
    "illegal memory access",
    "CUBLAS_STATUS_EXECUTION_FAILED",
)


def device_unusable(error: BaseException) -> bool:
    """Whether ``error`` marks the device as unusable for the rest of the process."""
    accelerator = getattr(torch, "AcceleratorError", None)  # NOTE: torch >= 2.8
    if accelerator is not None and isinstance(error, accelerator):
        return True
    return any(mark in str(error) for mark in _DEVICE_LOST)


class Rollback(Protocol):
    """State a run changes that a failed run must give back (``SamplingSlots``, ``Proposer``)."""

    def checkpoint(self) -> object: ...
    def rollback(self, checkpoint: object) -> None: ...


@dataclass(frozen=True)
class RequestFailure:
    request: Request
    error: Exception


def run_isolated(
    batch: ScheduledBatch,
    run: RunBatch,
    release: Callable[[Request], None],
    state: Sequence[Rollback] = (),
) -> list[Request]:
    """Run ``batch`` with ``run``; returns the requests that failed (finished with "error" and
    handed to ``release``). Raises the first error when every request failed. ``state`` is
    rolled back after every failed run.
    """
    failures = _run_or_split(batch, run, state)
    if len(failures) == len(batch.requests):
        raise failures[0].error
    for failure in failures:
        req, error = failure.request, failure.error
        logger.error(
            "request %s failed in its step; it finishes with an error, the other %d go on",
            req.request_id,
            len(batch.requests) - len(failures),
            exc_info=error,
        )
        req.fail(f"{type(error).__name__}: {error}")
        release(req)
    return [f.request for f in failures]


def _run_or_split(
    batch: ScheduledBatch, run: RunBatch, state: Sequence[Rollback]
) -> list[RequestFailure]:
    """The requests of ``batch`` that fail: none if it runs, else those failing in its halves."""
    before = [_progress(r) for r in batch.requests]
    marks = [s.checkpoint() for s in state]
    try:
        run(batch)
        return []
    except Exception as error:
        if device_unusable(error):
            raise
        for s, mark in zip(state, marks):
            s.rollback(mark)
        if len(batch.requests) == 1:
            return [RequestFailure(batch.requests[0], error)]
        advanced = [_progress(r) != p for r, p in zip(batch.requests, before)]
        failures = [RequestFailure(r, error) for r, a in zip(batch.requests, advanced) if a]
        rest = [i for i, a in enumerate(advanced) if not a]
        half = len(rest) // 2
        for part in (rest[:half], rest[half:]):
            failures += _run_or_split(batch.subset(part), run, state) if part else []
        return failures


def _progress(req: Request) -> tuple[int, int, int]:
    return len(req.token_ids), req.num_computed_tokens, req.num_pending_tokens
