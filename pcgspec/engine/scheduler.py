"""Scheduling: each step runs every running request's next token first and fills the rest of
a token budget with prefill chunks (a mixed step), as vLLM does; a step is a decode batch when
nothing waits to prefill and an extend batch when nothing runs.

The budget is the prefill budget (``--max-prefill-tokens``, capped by ``--chunked-prefill-size``):
the decode rows take one token each, the prefill chunks what they leave, and at least half of it,
so a prompt keeps going however many requests decode. Within the prefill share, waiting
requests whose whole remaining prompt fits go first, in arrival order, then chunks of the others:
a long prompt does not hold a short one behind its whole prefill, and no decode waits for it.
Under a queue, new requests are admitted in groups (a sixteenth of the running limit), so a full
batch does not pay a mixed step (through the piecewise graphs, not the decode graph) every time
a few requests finish.
When the KV pool runs dry, unreferenced cached prefixes are evicted first (``RadixCache``),
then the newest running request is preempted: its pages are freed and it is queued again to be
recomputed from its tokens so far (a prefix-cache hit where its pages are still cached).

With a prefix cache a request starting from nothing (new, or preempted) takes its longest cached
prefix of whole pages, leaving at least one token to prefill, and prefills the rest; every
prefill step and every release (finish, abort, preemption) inserts the request's written whole
pages. The ``n`` sequences of one prompt prefill it once: the later ones wait for the first
one's prefill and then hit its pages.

Under the overlap schedule (engine/overlap.py) a step is scheduled while the previous one runs:
a plain step's requests' progress advances when it is launched (``launched``; a speculative
step's when it is read), and sampled tokens are counted as pending (``Request.num_pending_tokens``,
k+1 for a speculative step: its worst case) until the host reads them and ``retire`` releases
the requests they finished. A request whose pending tokens reach its length limit is not
scheduled again, and a preempted one is not prefilled again before its pending tokens are read.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from pcgspec.engine.kv_pool import PagePool
from pcgspec.engine.radix_cache import RadixCache
from pcgspec.engine.request import Request, RequestStatus
from pcgspec.runners.forward_batch import ForwardMode

logger = logging.getLogger("pcgspec")
ADMISSION_GROUPS = 16  # under a queue, admit max_running_requests // this at a time
# a speculative engine holds new requests until len(running) / this of them, rounded up,
# wait (``_holds_arrivals``) ...
ARRIVAL_GROUPS = 16
MAX_HOLD_STEPS = 6  # ... for at most this many steps


@dataclass(frozen=True)
class ScheduledBatch:
    mode: ForwardMode
    requests: list[Request]
    num_new_tokens: list[int]  # per request: tokens to compute this step
    samples: list[bool]  # per request: reaches its last token, so a new one is sampled
    # NOTE: the leading rows that decode a running request's next token: all of a DECODE
    # batch's, the first ones of a mixed EXTEND batch's (the rest prefill)
    num_decode: int = 0

    @classmethod
    def of(
        cls, mode: ForwardMode, requests: list[Request], sizes: list[int], num_decode: int = 0
    ) -> ScheduledBatch:
        """A decode row always samples (its request's length may be unknown to the host: a
        speculative step in flight); a prefill chunk samples when it reaches the last token."""
        samples = [
            i < num_decode or r.num_computed_tokens + n == r.num_tokens
            for i, (r, n) in enumerate(zip(requests, sizes))
        ]
        return cls(mode, requests, sizes, samples, num_decode)

    @classmethod
    def mixed(cls, decode: ScheduledBatch, prefill: ScheduledBatch) -> ScheduledBatch:
        """One EXTEND batch of ``decode``'s rows (one token each), then ``prefill``'s."""
        return cls(
            ForwardMode.EXTEND,
            decode.requests + prefill.requests,
            decode.num_new_tokens + prefill.num_new_tokens,
            decode.samples + prefill.samples,
            decode.num_decode,
        )

    @property
    def is_mixed(self) -> bool:
        return self.mode is ForwardMode.EXTEND and self.num_decode > 0

    @property
    def num_prefill_samples(self) -> int:
        """Prefilling rows that sample (mostly requests' first tokens)."""
        return sum(self.samples[self.num_decode :])

    @property
    def sampled_requests(self) -> list[Request]:
        return [r for r, s in zip(self.requests, self.samples) if s]

    def subset(self, rows: list[int]) -> ScheduledBatch:
        """The requests ``rows`` (ascending) as a batch of their own (their pages are reserved)."""
        return ScheduledBatch(
            self.mode,
            [self.requests[i] for i in rows],
            [self.num_new_tokens[i] for i in rows],
            [self.samples[i] for i in rows],
            sum(1 for i in rows if i < self.num_decode),
        )


class RequestSlots(Protocol):
    """Per-request state outside the scheduler (e.g. ``SamplingSlots``): a request is admitted
    when first scheduled for prefill and freed when it finishes, is aborted or is preempted.
    """

    def admit(self, *reqs: Request) -> None: ...

    def free(self, req: Request) -> None: ...


class DraftKV(Protocol):
    """A model drafter's K/V progress per request (``ModelProposer``), which lives in the
    request's pages: how far it is valid, and a prefix-cache hit that brings it that far.
    """

    def draft_computed(self, req: Request) -> int: ...

    def adopt_prefix(self, req: Request, num_tokens: int) -> None: ...


class Scheduler:
    def __init__(
        self,
        pages: PagePool,
        page_size: int,
        max_running_requests: int,
        prefill_token_budget: int,
        slots: RequestSlots | None = None,
        prefix_cache: RadixCache | None = None,
    ) -> None:
        self.pages = pages
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.prefill_token_budget = prefill_token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.draft: DraftKV | None = None  # set by the engine for model drafters
        self.hold_arrivals = False  # set by the engine when it speculates (``_holds_arrivals``)
        self._held_front: Request | None = None  # the first waiting request when last held
        self._held = 0  # steps it was held

    @property
    def admission_group(self) -> int:
        """Requests admitted at a time under a queue (``_admits_later``): a sixteenth of the
        running limit."""
        return max(1, self.max_running_requests // ADMISSION_GROUPS)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's batch: the running requests' next tokens, then prefill chunks."""
        decode = self._schedule_decode()
        if self._admits_later(decode):
            return decode
        budget = self.prefill_token_budget
        num_decode = 0 if decode is None else decode.num_decode
        prefill = self._schedule_prefill(max(budget - num_decode, budget // 2))
        if prefill is None or decode is None:
            return prefill or decode
        return ScheduledBatch.mixed(decode, prefill)

    def _pages_needed(self, req: Request, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.page_size) - len(req.pages))

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        """Prefill chunks within ``budget`` tokens: first the waiting requests whose whole
        remaining prompt fits, among as many as there are free running slots (a long queue is
        not scanned every step), then chunks of the others, each pass in arrival order.
        """
        picked: list[Request] = []
        taken: set[int] = set()  # ids of ``picked``
        sizes: list[int] = []
        groups: set[str] = set()  # n > 1 groups whose prompt pages this step computes
        free = max(0, self.max_running_requests - len(self.running))
        for whole in (True, False):
            for req in itertools.islice(self.waiting, free) if whole else self.waiting:
                if budget == 0 or len(picked) >= free:
                    break
                left = len(req.token_ids) - req.num_computed_tokens
                if id(req) in taken or (whole and left > budget):
                    continue
                if self._defer_sibling(req, groups) or req.num_pending_tokens:
                    continue  # NOTE: a preempted request waits for its pending tokens to be read
                n = self._take(req, budget)
                if n == 0:
                    break
                if self._computes_shared_pages(req):
                    groups.add(req.group_id)
                picked.append(req)
                taken.add(id(req))
                sizes.append(n)
                budget -= n
        if not picked:
            return None
        if self.slots is not None:
            self.slots.admit(*picked)
        return ScheduledBatch.of(ForwardMode.EXTEND, picked, sizes)

    def _take(self, req: Request, budget: int) -> int:
        """Reserve the pages of the next chunk of ``req`` within ``budget`` tokens (after its
        cached prefix, for a request starting from nothing); its size, 0 if the pool is full.
        """
        hit = self._take_prefix(req) if not req.pages else None
        n = min(len(req.token_ids) - req.num_computed_tokens, budget)
        need = self._pages_needed(req, req.num_computed_tokens + n)
        if not self._ensure_free(need):
            if hit is not None:
                self._drop_prefix(req)
            return 0
        if hit is not None:
            self._record_hit(req, hit)
        req.pages += self.pages.alloc(need)
        if req.scheduled_time is None:
            req.scheduled_time = time.perf_counter()
        return n

    def _admits_later(self, decode: ScheduledBatch | None) -> bool:
        """Whether new requests wait for more running ones to finish: under a queue they are
        admitted ``admission_group`` at a time, so a full batch does not pay a step (an extend
        step of the few prompts that replace the few requests just finished) between every
        two decode steps; a speculative engine also holds a few arrivals without a queue
        (``_holds_arrivals``). Never while nothing decodes or a prefill is underway.
        """
        if decode is None or not self.waiting or self.waiting[0].pages:
            return False
        free = self.max_running_requests - len(self.running)
        return free < min(len(self.waiting), self.admission_group) or self._holds_arrivals()

    def _holds_arrivals(self) -> bool:
        """Whether a speculative engine holds the waiting requests for a group of them: a
        sixteenth of the running ones (``ARRIVAL_GROUPS``), or ``MAX_HOLD_STEPS`` steps. A
        step with prefill work decodes its running requests one token each, not speculatively:
        at 64 streams with a new request every step or two, mixed steps were half the steps
        (3.35 ms each against 3.06 ms for a speculative step emitting 2.19 tokens a request).
        Holding a new request for a few steps (about 3 ms each) costs its first token that
        much; at 16 streams or fewer a group is one request, and nothing waits. Only new
        arrivals are held: not a preempted request, nor a later sequence of an ``n`` > 1 group.
        The steps are counted for the first waiting request, however its turn ends.
        """
        front = self.waiting[0]
        if not self.hold_arrivals or front.num_preemptions or front.index:
            return False
        if front is not self._held_front:
            self._held_front, self._held = front, 0
        group = -(-len(self.running) // ARRIVAL_GROUPS)
        if len(self.waiting) >= group or self._held >= MAX_HOLD_STEPS:
            return False
        self._held += 1
        return True

    def _defer_sibling(self, req: Request, groups: set[str]) -> bool:
        """With a prefix cache, a fresh sequence of an ``n`` > 1 group waits while an earlier one
        of its group computes the prompt's whole pages: then it hits the pages that one inserted.
        """
        return req.group_id in groups and not req.pages and req.num_preemptions == 0

    def _computes_shared_pages(self, req: Request) -> bool:
        """Whether this step of ``req`` computes prompt pages its ``n`` > 1 siblings could hit."""
        if self.prefix_cache is None or req.params.n == 1:
            return False
        return req.num_computed_tokens < (req.prompt_len - 1) // self.page_size * self.page_size

    def _take_prefix(self, req: Request) -> int:
        """Hold the longest cached prefix of ``req`` (whole pages, leaving >= 1 token to
        prefill); returns its length in tokens (0 without a cache or a hit).
        """
        if self.prefix_cache is None:
            return 0
        hit = self.prefix_cache.match(req.token_ids, len(req.token_ids) - 1)
        self.pages.incref(hit.pages)  # NOTE: held before evicting, so eviction spares them
        req.pages, req.prefix_hit = list(hit.pages), hit
        req.num_computed_tokens = hit.num_tokens
        return hit.num_tokens

    def _drop_prefix(self, req: Request) -> None:
        self.pages.free(req.pages)
        req.pages, req.prefix_hit = [], None
        req.num_computed_tokens = 0

    def _record_hit(self, req: Request, hit: int) -> None:
        if self.prefix_cache is None:
            return
        self.prefix_cache.record_lookup(len(req.token_ids), hit)
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit
        if self.draft is not None and hit:
            self.draft.adopt_prefix(req, hit)

    def _ensure_free(self, need: int) -> bool:
        """Whether ``need`` pages are free, after evicting unreferenced cached pages if not."""
        short = need - self.pages.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return need <= self.pages.num_free

    def _schedule_decode(self) -> ScheduledBatch | None:
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or req.length_reached:
                continue  # preempted to make room for an older request, or done once read back
            need = self._pages_needed(req, req.num_tokens)
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
        decoding = [r for r in self.running if not r.length_reached]
        if not decoding:
            return None
        return ScheduledBatch.of(ForwardMode.DECODE, decoding, [1] * len(decoding), len(decoding))

    def _make_room(self, need: int, req: Request) -> None:
        """Preempt, newest first, until ``need`` pages are free or ``req`` itself is preempted.
        Unreferenced cached pages go first, then partially prefilled waiting requests' pages.
        A victim's pages go to the prefix cache, so each preemption is followed by eviction.
        """
        if self._ensure_free(need):
            return
        for victim in [r for r in reversed(self.waiting) if r.pages] + self.running[::-1]:
            if self._ensure_free(need) or (victim is req and len(self.running) == 1):
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

    def launched(self, batch: ScheduledBatch) -> None:
        """Once the step is launched (its sampled tokens appended or pending): advance
        progress, cache written prefill pages, promote requests whose prefill completed.
        """
        for row, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            req.num_computed_tokens += n
            if req.finished:
                continue
            if batch.mode is ForwardMode.EXTEND and row >= batch.num_decode:
                self._cache(req)
            if req.status is RequestStatus.WAITING and (
                req.num_computed_tokens == req.num_tokens - 1
            ):
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                self.running.append(req)

    def retire(self, reqs: list[Request]) -> None:
        """Release those of ``reqs`` that finished."""
        for req in reqs:
            if req.finished:
                self.release(req)

    def reserve(self, reqs: list[Request], num_tokens: list[int]) -> bool:
        """Grow each request's pages to hold ``num_tokens`` slots, all or none (no preemption).
        Returns whether it fit."""
        needs = [self._pages_needed(r, n) for r, n in zip(reqs, num_tokens)]
        if not self._ensure_free(sum(needs)):
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

    def _cache(self, req: Request) -> None:
        """Insert the whole pages of ``req`` whose K/V are written (never after an error)."""
        if self.prefix_cache is None or not req.pages or req.finish_reason == "error":
            return
        draft = self.draft.draft_computed(req) if self.draft is not None else 0
        self.prefix_cache.insert(
            req.token_ids, req.pages, req.num_computed_tokens, draft, after=req.prefix_hit
        )

    def _free(self, req: Request) -> None:
        self._cache(req)
        self.pages.free(req.pages)
        req.pages, req.prefix_hit = [], None
        if self.slots is not None:
            self.slots.free(req)
