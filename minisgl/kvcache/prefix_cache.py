# generated from notebooks/04_radix_cache.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/04_radix_cache.ipynb, cell 3 (id c04-003) ---
"""What a prefix cache promises the scheduler, and the naive cache that keeps nothing (the ablation)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from minisgl.kvcache.pool import PageAllocator


# --- notebooks/04_radix_cache.ipynb, cell 6 (id c04-006) ---
@dataclass
class MatchResult:
    pages: list[int]  # KV pages of the longest cached, page-aligned prefix
    node: object  # handle to pass to lock/unlock

    @property
    def num_pages(self) -> int:
        return len(self.pages)


# --- notebooks/04_radix_cache.ipynb, cell 7 (id c04-007) ---
class PrefixCache(ABC):
    """Keeps the KV pages of finished (and in-progress) requests so later requests can reuse a prefix.

    Token sequences are cached in whole pages only. A locked node (and its ancestors) is never evicted.
    """

    keeps_pages = True  # False: nothing is ever shared, so caching a running request is pointless

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size

    @abstractmethod
    def match(self, token_ids: list[int]) -> MatchResult: ...

    @abstractmethod
    def insert(self, token_ids: list[int], pages: list[int]) -> tuple[int, MatchResult]:
        """Cache `token_ids` (a whole number of pages) held in `pages`.

        Returns (n, result): the first n tokens were already cached under other pages, which the caller
        still owns and should free (the cache keeps its own copy); `result` is the cached path now
        (its pages may differ from `pages` in that first part).
        """

    @abstractmethod
    def lock(self, node) -> None: ...

    @abstractmethod
    def unlock(self, node) -> None: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to num_pages unlocked pages to the allocator; return how many were freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def cached_pages(self) -> int: ...


# --- notebooks/04_radix_cache.ipynb, cell 9 (id c04-009) ---
class NaiveCache(PrefixCache):
    """Caches nothing: every page goes straight back to the allocator. The radix-cache ablation."""

    keeps_pages = False

    def match(self, token_ids):
        return MatchResult([], None)

    def insert(self, token_ids, pages):
        # Adopt nothing: reporting every token as "already cached" makes the caller free all its pages.
        return len(token_ids), MatchResult([], None)

    def lock(self, node):
        pass

    def unlock(self, node):
        pass

    def evict(self, num_pages):
        return 0

    @property
    def evictable_pages(self):
        return 0

    @property
    def cached_pages(self):
        return 0
