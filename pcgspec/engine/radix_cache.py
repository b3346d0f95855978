"""Prefix caching: a radix tree of KV pages keyed by token ids, one node per whole page.

Each node is one page of ``page_size`` tokens; its key is those tokens, so a path from the root
spells a token prefix and lists the pages holding its K/V. The tree holds one reference to
each of its pages in the ``PagePool``; a request that hits a prefix holds the same pages by
reference too, so a page returns to the pool only when the tree evicts it and no request holds
it.

- ``match`` finds the longest cached prefix of whole pages. The partial last page of a prompt
  is never shared: it is recomputed (its page is the request's own, so the request's writes
  never reach a shared page). The scheduler also leaves at least one token to prefill, so the
  step has logits to sample from.
- ``insert`` adds a request's whole pages whose K/V are written: after every prefill step (so
  concurrent requests and the ``n`` sequences of one prompt share a prompt at once) and when the
  request finishes or is preempted (prompt + output tokens). A page already in the tree keeps
  its node's page; the request keeps its duplicate until it releases it.
- ``evict`` drops unreferenced leaves (only the tree holds their page), least recently used
  first; the scheduler calls it when the pool runs short, before preempting anything. The
  leaves wait in one heap ordered by last use that lives with the tree (an entry whose node
  was used again, or is gone, is skipped when it surfaces), so an eviction costs O(log n) per
  page however many requests the tree remembers.

Model drafters (EAGLE3, NEXTN, STANDALONE) keep their own K/V in the same page ids (the draft
cache shares the target's page table), so a cached page also carries the draft's K/V of its
positions if the request that wrote it had caught its draft up over them. With
``track_draft`` each node records that (``draft_valid``, set at insert from the draft's
progress, and upgraded when a later request inserts the same tokens with a caught-up draft), and
``match`` stops at the first page without it: a hit then gives valid target *and* draft K/V, and
the draft starts from the hit length instead of position 0. Output stays lossless regardless:
verification accepts only the target's own tokens; the draft's K/V only shape acceptance. (A
head fed by the target, EAGLE3 / MTP, computed its K/V of a page's last position from the token
that followed it in the writer's sequence; a request that continues differently sees one stale
draft position there.) NGRAM keeps no K/V and needs nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pcgspec.engine.kv_pool import PagePool


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]  # the page's tokens; () at the root
    page: int  # -1 at the root
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    last_access: int = 0
    draft_valid: bool = False


@dataclass
class CacheStats:
    prompt_tokens: int = 0  # tokens looked up (prompts, and resumed sequences after preemption)
    cached_tokens: int = 0  # of those, served from the cache
    evicted_tokens: int = 0
    inserted_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class PrefixHit:
    pages: list[int]  # whole pages, in order
    num_tokens: int  # len(pages) * page_size
    node: _Node | None = None  # the last page's node: ``insert`` goes on from it


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, track_draft: bool = False) -> None:
        self.pool = pool
        self.page_size = page_size
        self.track_draft = track_draft
        self.root = _Node((), -1, None)
        self.num_pages = 0  # pages the tree holds
        # NOTE: every leaf has an entry (last_access, node) here; stale ones are skipped lazily
        self._heap: list[tuple[int, int, _Node]] = []
        self.stats = CacheStats()
        self._clock = itertools.count(1)

    def match(self, token_ids: Sequence[int], max_tokens: int) -> PrefixHit:
        """The longest cached prefix of whole pages within ``token_ids[:max_tokens]``; marks
        its nodes used. Takes no references (the caller increfs the pages it keeps).
        """
        now, node, pages, p = next(self._clock), self.root, [], self.page_size
        children, track = self.root.children, self.track_draft
        # NOTE: a hot loop (a long shared prompt is a hundred pages): keys are built as it goes
        # and nodes marked inline; every node before the last has a child, so only the last
        # can be a leaf that needs an eviction-heap entry (``_touch``).
        for i in range(0, min(max_tokens, len(token_ids)) - p + 1, p):
            child = children.get(tuple(token_ids[i : i + p]))
            if child is None or (track and not child.draft_valid):
                break
            child.last_access = now
            pages.append(child.page)
            node, children = child, child.children
        if node is not self.root:
            self._touch(node, now)
        return PrefixHit(pages, len(pages) * self.page_size, node)

    def record_lookup(self, num_tokens: int, num_cached: int) -> None:
        self.stats.prompt_tokens += num_tokens
        self.stats.cached_tokens += num_cached

    def insert(
        self,
        token_ids: Sequence[int],
        pages: Sequence[int],
        num_tokens: int,
        draft_tokens: int = 0,
        after: PrefixHit | None = None,
    ) -> None:
        """Cache the whole pages of ``token_ids[:num_tokens]`` (their K/V written in ``pages``);
        the first ``draft_tokens`` positions also hold the draft's K/V. ``after``: the hit this
        request holds, whose pages are in the tree already (held, so never evicted; with
        ``track_draft`` all draft-valid): the walk starts past them, which spares a request on
        a long shared prompt a walk over every page of it at each step that inserts.
        """
        node, start = self.root, 0
        if after is not None and after.node is not None and after.node.parent is not None:
            node, start = after.node, len(after.pages)  # NOTE: a reset or evicted node has none
        now, p = next(self._clock), self.page_size
        for i in range(start, num_tokens // p):
            key = tuple(token_ids[i * p : (i + 1) * p])
            draft = (i + 1) * p <= draft_tokens
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, pages[i], node, draft_valid=draft)
                self.pool.cache_hold(pages[i])
                self.num_pages += 1
                self.stats.inserted_tokens += p
            elif draft and not child.draft_valid:
                if child.page != pages[i]:  # the same tokens, now with the draft's K/V too
                    self.pool.cache_hold(pages[i])
                    self.pool.cache_release(child.page)
                    child.page = pages[i]
                child.draft_valid = True
            self._touch(child, now)
            node = child

    def _touch(self, node: _Node, now: int) -> None:
        node.last_access = now
        if not node.children:
            heapq.heappush(self._heap, (now, id(node), node))
            self._compact()

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages of unreferenced leaves, least recently used first.
        Returns how many pages went back to the pool.
        """
        freed, held = 0, []
        while self._heap and freed < num_pages:
            last_access, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.children or last_access != node.last_access:
                continue  # evicted, no longer a leaf, or used since: a newer entry stands
            if self.pool.refcount(node.page) > 1:
                held.append(node)  # a request holds it: in use, so as recent as now
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.pool.cache_release(node.page)
            self.num_pages -= 1
            self.stats.evicted_tokens += self.page_size
            freed += 1
            if parent is not self.root and not parent.children:
                heapq.heappush(self._heap, (parent.last_access, id(parent), parent))
        # NOTE: behind every older leaf, so the next evictions do not pop these again first
        now = next(self._clock)
        for node in held:
            node.last_access = now
            heapq.heappush(self._heap, (now, id(node), node))
        return freed

    def _compact(self) -> None:
        """Rebuild the heap from the leaves once stale entries outnumber live nodes."""
        if len(self._heap) > 2 * self.num_pages + 1024:
            self._heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._heap)

    def reset(self) -> None:
        """Drop every page the tree holds (requests keep theirs)."""
        for node in self._nodes():
            self.pool.cache_release(node.page)
            node.parent = None
        self.root.children.clear()
        self._heap.clear()
        self.num_pages = 0

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [n.page for n in self._nodes()]

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
