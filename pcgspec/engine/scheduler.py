"""SGLang-style scheduling: a step is either a prefill (EXTEND) batch or a decode batch.

Prefill has priority and is chunked to a token budget; decode runs every running request.
When the KV pool runs dry the newest running request is preempted: its pages are freed and
it is queued again to be recomputed from its tokens so far.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.request import Request, RequestStatus
from pcgspec.runners.forward_batch import ForwardMode

logger = logging.getLogger("pcgspec")


@dataclass(frozen=True)
class ScheduledBatch:
    mode: ForwardMode
    requests: list[Request]
    num_new_tokens: list[int]  # per request: tokens to compute this step
    samples: list[bool]  # per request: reaches its last token, so a new one is sampled

    @classmethod
    def of(cls, mode: ForwardMode, requests: list[Request], sizes: list[int]) -> ScheduledBatch:
        samples = [r.num_computed_tokens + n == len(r.token_ids) for r, n in zip(requests, sizes)]
        return cls(mode, requests, sizes, samples)

    @property
    def sampled_requests(self) -> list[Request]:
        return [r for r, s in zip(self.requests, self.samples) if s]


class RequestSlots(Protocol):
    """Per-request state outside the scheduler (e.g. ``SamplingSlots``): a request is admitted
    when first scheduled for prefill and freed when it finishes, is aborted or is preempted.
    """

    def admit(self, req: Request) -> None: ...

    def free(self, req: Request) -> None: ...


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        page_size: int,
        max_running_requests: int,
        prefill_token_budget: int,
        slots: RequestSlots | None = None,
    ) -> None:
        self.pages = pages
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.prefill_token_budget = prefill_token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.slots = slots

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.prefill_token_budget
        picked: list[Request] = []
        sizes: list[int] = []
        for req in self.waiting:
            if budget == 0 or len(self.running) + len(picked) >= self.max_running_requests:
                break
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            need = self._pages_needed(req, req.num_computed_tokens + n)
            if need > self.pages.num_free:
                break
            req.pages += self.pages.alloc(need)
            if self.slots is not None:
                self.slots.admit(req)
            picked.append(req)
            sizes.append(n)
            budget -= n
        if not picked:
            return None
        return ScheduledBatch.of(ForwardMode.EXTEND, picked, sizes)

    def _schedule_decode(self) -> ScheduledBatch | None:
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older request
            need = self._pages_needed(req, len(req.token_ids))
            if need > self.pages.num_free:
                self._make_room(need, req)
            if req.status is not RequestStatus.RUNNING:
                continue
            if need > self.pages.num_free:
                logger.warning("request %s alone outgrows the KV pool", req.request_id)
                req.finish("length")
                self.release(req)
                continue
            req.pages += self.pages.alloc(need)
        if not self.running:
            return None
        return ScheduledBatch.of(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def _make_room(self, need: int, req: Request) -> None:
        """Preempt, newest first, until ``need`` pages are free or ``req`` itself is preempted.
        Partially prefilled waiting requests give up their pages first.
        """
        for victim in [r for r in reversed(self.waiting) if r.pages] + self.running[::-1]:
            if need <= self.pages.num_free or (victim is req and len(self.running) == 1):
                return
            self._preempt(victim)
            if victim is req:
                return

    def _preempt(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.waiting.appendleft(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch) -> None:
        """After the step's tokens were appended: advance progress, promote requests whose
        prefill completed, release finished ones.
        """
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            if req.finished:
                self.release(req)
            elif req.status is RequestStatus.WAITING and (
                req.num_computed_tokens == len(req.token_ids) - 1
            ):
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def reserve(self, reqs: list[Request], num_tokens: list[int]) -> bool:
        """Grow each request's pages to hold ``num_tokens`` slots, all or none (no preemption).
        Returns whether it fit."""
        needs = [self._pages_needed(r, n) for r, n in zip(reqs, num_tokens)]
        if sum(needs) > self.pages.num_free:
            return False
        for req, need in zip(reqs, needs):
            req.pages += self.pages.alloc(need)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the pages of ``req`` past the first ``num_tokens`` slots."""
        keep = -(-num_tokens // self.page_size)
        if len(req.pages) > keep:
            self.pages.free(req.pages[keep:])
            req.pages = req.pages[:keep]

    def abort(self, group_id: str) -> list[Request]:
        """Finish every unfinished sequence of ``group_id`` with "abort"; free its pages now."""
        reqs = [r for r in (*self.waiting, *self.running) if r.group_id == group_id]
        for req in reqs:
            req.finish("abort")
            self.release(req)
        return reqs

    def release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        self.pages.free(req.pages)
        req.pages = []
        if self.slots is not None:
            self.slots.free(req)
