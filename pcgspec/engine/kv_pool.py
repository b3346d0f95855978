"""Reference-counted pages of the KV cache (host-side bookkeeping only)."""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """Hands out page ids ``0 .. num_pages-1``. A page returns to the pool when its last
    reference is dropped, so several requests (prefix sharing, ``n`` > 1) can hold one page.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

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
            self._refs[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page."""
        for page in pages:
            if self._refs[page] == 0:
                raise ValueError(f"page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]
