"""Prefix caching: a radix tree of KV pages keyed by token ids, compressed into runs of whole
pages.

Each node holds a run of whole pages and their tokens (``page_size`` per page), so a path from
the root spells a token prefix and lists the pages holding its K/V. A node's children are keyed
by their first page's tokens; a shared prefix of a hundred pages is one node, and a match
compares it in one list comparison instead of walking a hundred nodes (SGLang's tree is
compressed the same way). A match or an insert that ends inside a node splits it there
(``_split``: the node keeps its tail, so a hit that ends with a node still does). The tree
holds one reference to each of its pages in the ``PagePool``; a request that hits a prefix
holds the same pages by reference too, so a page returns to the pool only when the tree evicts
it and no request holds it.

- ``match`` finds the longest cached prefix of whole pages. The partial last page of a prompt
  is never shared: it is recomputed (its page is the request's own, so the request's writes
  never reach a shared page). The scheduler also leaves at least one token to prefill, so the
  step has logits to sample from.
- ``insert`` adds a request's whole pages whose K/V are written: after every prefill step (so
  concurrent requests and the ``n`` sequences of one prompt share a prompt at once) and when the
  request finishes or is preempted (prompt + output tokens). A page already in the tree keeps
  its node's page; the request keeps its duplicate until it releases it.
- ``evict`` frees pages of unreferenced leaves, from a leaf's end, least recently used leaf
  first; the scheduler calls it when the pool runs short, before preempting anything. The
  leaves wait in one heap ordered by last use that lives with the tree (an entry whose node
  was used again, or is gone, is skipped when it surfaces), so an eviction costs O(log n) per
  leaf however many requests the tree remembers.

Model drafters (EAGLE3, NEXTN, STANDALONE) keep their own K/V in the same page ids (the draft
cache shares the target's page table), so a cached page also carries the draft's K/V of its
positions if the request that wrote it had caught its draft up over them. With
``track_draft`` each node counts its leading pages that hold it (``draft_pages``, set at insert
from the draft's progress, and raised when a later request inserts the same tokens with a
caught-up draft: its pages take the place of the node's), and ``match`` stops at the first page
without it: a hit then gives valid target *and* draft K/V, and the draft starts from the hit
length instead of position 0. Output stays lossless regardless: verification accepts only the
target's own tokens; the draft's K/V only shape acceptance. (A head fed by the target, EAGLE3 /
MTP, computed its K/V of a page's last position from the token that followed it in the writer's
sequence; a request that continues differently sees one stale draft position there.) NGRAM
keeps no K/V and needs nothing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pcgspec.engine.kv_pool import PagePool


@dataclass(eq=False)
class _Node:
    tokens: list[int]  # the run's tokens, page_size per page; [] at the root
    pages: list[int]  # the run's pages, in order
    parent: _Node | None
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)  # by first page
    last_access: int = 0
    draft_pages: int = 0  # the leading pages that also hold the draft's K/V


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
    node: _Node | None = None  # the node it ends with (splits keep that): inserts go on from it


class RadixCache:
    def __init__(self, pool: PagePool, page_size: int, track_draft: bool = False) -> None:
        self.pool = pool
        self.page_size = page_size
        self.track_draft = track_draft
        self.root = _Node([], [], None)
        self.num_pages = 0  # pages the tree holds
        # NOTE: every leaf has an entry (last_access, node) here; stale ones are skipped lazily
        # (a leaf may have two of the same time, which evicts nothing twice)
        self._heap: list[tuple[int, int, _Node]] = []
        self.stats = CacheStats()
        self._clock = itertools.count(1)

    def match(self, token_ids: Sequence[int], max_tokens: int) -> PrefixHit:
        """The longest cached prefix of whole pages within ``token_ids[:max_tokens]``; marks
        its nodes used. Takes no references (the caller increfs the pages it keeps).
        """
        ids, p = _as_list(token_ids), self.page_size
        limit = min(max_tokens, len(ids)) // p  # whole pages to look for
        now, node, pages = next(self._clock), self.root, []
        while len(pages) < limit:
            start = len(pages) * p
            child = node.children.get(tuple(ids[start : start + p]))
            if child is None:
                break
            n = self._common_pages(child, ids, start, limit - len(pages))
            if self.track_draft:
                n = min(n, child.draft_pages)
            if n == 0:
                break
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages += child.pages
            node = child
        if node is not self.root:
            self._touch(node, now)  # NOTE: only the last node can be a leaf
        return PrefixHit(pages, len(pages) * p, node)

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
        the first ``draft_tokens`` positions also hold the draft's K/V (ignored without
        ``track_draft``). ``after``: the hit this
        request holds, whose pages are in the tree already (held, so never evicted; with
        ``track_draft`` all draft-valid): the walk starts past them.
        """
        ids, p = _as_list(token_ids), self.page_size
        node, i = self.root, 0  # i: pages of the request's prefix that the tree holds
        if after is not None and after.node is not None and after.node.parent is not None:
            node, i = after.node, len(after.pages)  # NOTE: a reset or evicted node has none
        now, total = next(self._clock), num_tokens // p
        # pages that hold the draft's K/V too
        drafted = min(total, draft_tokens // p) if self.track_draft else 0
        while i < total:
            key = tuple(ids[i * p : (i + 1) * p])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(
                    ids[i * p : total * p],
                    list(pages[i:total]),
                    node,
                    draft_pages=max(0, drafted - i),
                )
                for page in child.pages:
                    self.pool.cache_hold(page)
                self.num_pages += total - i
                self.stats.inserted_tokens += (total - i) * p
                self._touch(child, now)
                return
            n = self._common_pages(child, ids, i * p, total - i)
            if n < len(child.pages):
                child = self._split(child, n)
            for j in range(child.draft_pages, min(n, drafted - i)):
                # the same tokens, now with the draft's K/V too: this request's page serves
                if child.pages[j] != pages[i + j]:
                    self.pool.cache_hold(pages[i + j])
                    self.pool.cache_release(child.pages[j])
                    child.pages[j] = pages[i + j]
                child.draft_pages = j + 1
            self._touch(child, now)
            node, i = child, i + n

    def _common_pages(self, node: _Node, ids: list[int], start: int, limit: int) -> int:
        """How many of ``node``'s leading pages ``ids[start:]`` repeats, at most ``limit``. Its
        first page is known to match (its key led here); the rest compare as list slices, all
        at once and else by bisection, in C rather than page by page.
        """
        p, n = self.page_size, min(len(node.pages), limit)
        if ids[start : start + n * p] == node.tokens[: n * p]:
            return n
        lo, hi = 1, n - 1  # the answer: at least the first page, fewer than n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[start : start + mid * p] == node.tokens[: mid * p]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` pages: a new node takes them, in ``node``'s place
        under its parent, and ``node`` keeps the rest as its child (so it keeps its end, and a
        hit that ends with it still does). Returns the new node.
        """
        p, parent = self.page_size, node.parent
        assert parent is not None
        head = _Node(
            node.tokens[: n * p],
            node.pages[:n],
            parent,
            last_access=node.last_access,
            draft_pages=min(node.draft_pages, n),
        )
        parent.children[tuple(node.tokens[:p])] = head
        node.tokens, node.pages = node.tokens[n * p :], node.pages[n:]
        node.draft_pages = max(0, node.draft_pages - n)
        node.parent = head
        head.children[tuple(node.tokens[:p])] = node
        return head

    def _touch(self, node: _Node, now: int) -> None:
        node.last_access = now
        if not node.children:
            heapq.heappush(self._heap, (now, id(node), node))
            self._compact()

    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages of unreferenced leaves, from the end of the least
        recently used leaf first. Returns how many pages went back to the pool.
        """
        freed, held, p = 0, [], self.page_size
        while self._heap and freed < num_pages:
            last_access, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.children or last_access != node.last_access:
                continue  # evicted, no longer a leaf, or used since: a newer entry stands
            key, trimmed = tuple(node.tokens[:p]), 0
            while (
                node.pages
                and freed + trimmed < num_pages
                and self.pool.refcount(node.pages[-1]) == 1
            ):
                self.pool.cache_release(node.pages.pop())
                del node.tokens[-p:]
                trimmed += 1
            freed += trimmed
            self.num_pages -= trimmed
            self.stats.evicted_tokens += trimmed * p
            node.draft_pages = min(node.draft_pages, len(node.pages))  # counts pages it holds
            if not node.pages:
                parent = node.parent
                del parent.children[key]
                node.parent = None
                if parent is not self.root and not parent.children:
                    heapq.heappush(self._heap, (parent.last_access, id(parent), parent))
            elif freed < num_pages:
                held.append(node)  # a request holds its last page: in use, so as recent as now
            else:
                heapq.heappush(self._heap, (last_access, id(node), node))  # pages left to evict
        # NOTE: behind every older leaf, so the next evictions do not pop these again first
        now = next(self._clock)
        for node in held:
            node.last_access = now
            heapq.heappush(self._heap, (now, id(node), node))
        return freed

    def _compact(self) -> None:
        """Rebuild the heap from the leaves once stale entries outnumber live pages."""
        if len(self._heap) > 2 * self.num_pages + 1024:
            self._heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children]
            heapq.heapify(self._heap)

    def reset(self) -> None:
        """Drop every page the tree holds (requests keep theirs)."""
        for node in self._nodes():
            for page in node.pages:
                self.pool.cache_release(page)
            node.parent = None
        self.root.children.clear()
        self._heap.clear()
        self.num_pages = 0

    def pages(self) -> list[int]:
        """Every page the tree holds."""
        return [page for node in self._nodes() for page in node.pages]

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


def _as_list(token_ids: Sequence[int]) -> list[int]:
    """``token_ids`` as a list: slices of it compare with a node's tokens."""
    return token_ids if isinstance(token_ids, list) else list(token_ids)
