"""Reference-counted pages of the KV cache (host-side bookkeeping only)."""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """Hands out page ids ``0 .. num_pages-1``. A page returns to the pool when its last
    reference is dropped, so several requests (prefix sharing, ``n`` > 1) can hold one page.

    The prefix cache holds its pages through ``cache_hold`` / ``cache_release``, so the pool
    counts the pages only the cache holds (``num_cache_only``: reclaimable by eviction).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._cached = [False] * num_pages  # held by the prefix cache
        self.num_cache_only = 0  # cached pages no request holds

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        for page in pages:
            if self._refs[page] == 0:
                raise ValueError(f"page {page} is free; only held pages can be shared")
            if self._cached[page] and self._refs[page] == 1:
                self.num_cache_only -= 1
            self._refs[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page."""
        for page in pages:
            if self._refs[page] == 0:
                raise ValueError(f"page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
            elif self._cached[page] and self._refs[page] == 1:
                self.num_cache_only += 1

    def cache_hold(self, page: int) -> None:
        """The prefix cache takes a reference to a held page."""
        if self._cached[page]:
            raise ValueError(f"page {page} is cached already")
        self.incref([page])
        self._cached[page] = True
        self.num_cache_only += self._refs[page] == 1

    def cache_release(self, page: int) -> None:
        """The prefix cache drops its reference (eviction)."""
        if not self._cached[page]:
            raise ValueError(f"page {page} is not cached")
        self.num_cache_only -= self._refs[page] == 1
        self._cached[page] = False
        self.free([page])

    def refcount(self, page: int) -> int:
        return self._refs[page]
