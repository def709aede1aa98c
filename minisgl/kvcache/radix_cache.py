# generated from notebooks/04_radix_cache.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/04_radix_cache.ipynb, cell 4 (id c04-004) ---
"""A radix tree over token ids whose nodes hold KV pages: prefix reuse across requests.

Each edge holds a whole number of pages of tokens. Nodes locked by running requests (and their
ancestors) are protected; unlocked leaves are evicted least recently used first.
"""

from __future__ import annotations

import heapq
import itertools

from minisgl.kvcache.pool import PageAllocator
from minisgl.kvcache.prefix_cache import MatchResult, PrefixCache

_clock = itertools.count()


# --- notebooks/04_radix_cache.ipynb, cell 11 (id c04-011) ---
class Node:
    __slots__ = ("key", "pages", "children", "parent", "ref", "last_used")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: Node | None) -> None:
        self.key = key  # token ids on the edge into this node, len = len(pages) * page_size
        self.pages = pages
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first page of tokens
        self.parent = parent
        self.ref = 0  # how many requests lock this node
        self.last_used = next(_clock)


# --- notebooks/04_radix_cache.ipynb, cell 12 (id c04-012) ---
class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        super().__init__(allocator, page_size)
        self.root = Node((), [], None)
        self.root.ref = 1  # the root is never evicted
        self._cached_pages = 0
        self._protected_pages = 0

    # --- queries ---------------------------------------------------------------------------------------
    def _common_pages(self, key: tuple[int, ...], tokens: list[int], start: int) -> int:
        """How many whole pages of `key` equal tokens[start:]."""
        p, n = self.page_size, 0
        while (n + 1) * p <= len(key) and start + (n + 1) * p <= len(tokens):
            if key[n * p:(n + 1) * p] != tuple(tokens[start + n * p:start + (n + 1) * p]):
                break
            n += 1
        return n

    def _split(self, node: Node, num_pages: int) -> Node:
        """Cut node's edge after num_pages pages; returns the new upper node."""
        p = self.page_size
        upper = Node(node.key[:num_pages * p], node.pages[:num_pages], node.parent)
        upper.ref, upper.last_used = node.ref, node.last_used
        node.parent.children[node.key[:p]] = upper
        node.key, node.pages, node.parent = node.key[num_pages * p:], node.pages[num_pages:], upper
        upper.children[node.key[:p]] = node
        return upper

    def _walk(self, tokens: list[int]) -> tuple[Node, list[int]]:
        p = self.page_size
        node, pages, i = self.root, [], 0
        now = next(_clock)
        node.last_used = now
        while i + p <= len(tokens):
            child = node.children.get(tuple(tokens[i:i + p]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * p < len(child.key):
                child = self._split(child, n)
            child.last_used = now
            pages += child.pages
            i += n * p
            node = child
        return node, pages

    def match(self, token_ids: list[int]) -> MatchResult:
        node, pages = self._walk(token_ids)
        return MatchResult(pages, node)

    # --- updates ---------------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], pages: list[int]) -> tuple[int, MatchResult]:
        p = self.page_size
        if len(token_ids) % p or len(token_ids) != len(pages) * p:
            raise ValueError("insert takes whole pages: len(token_ids) == len(pages) * page_size")
        node, cached = self._walk(token_ids)
        n_dup = len(cached) * p
        if n_dup < len(token_ids):
            new = Node(tuple(token_ids[n_dup:]), list(pages[len(cached):]), node)
            node.children[new.key[:p]] = new
            self._cached_pages += len(new.pages)
            node = new
            cached = cached + new.pages
        return n_dup, MatchResult(cached, node)

    def lock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.ref == 0:
                self._protected_pages += len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node is not self.root:
            if node.ref <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.ref -= 1
            if node.ref == 0:
                self._protected_pages -= len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while freed < num_pages and leaves:
            _, _, leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self._cached_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                yield n
            stack.extend(n.children.values())

    @property
    def evictable_pages(self) -> int:
        return self._cached_pages - self._protected_pages

    @property
    def cached_pages(self) -> int:
        return self._cached_pages

    def check(self) -> None:
        """Invariants, for tests: counters agree with the tree, keys are whole pages, no page twice."""
        seen, total, protected = set(), 0, 0
        for n in self._nodes():
            assert len(n.key) == len(n.pages) * self.page_size and n.pages, "edge is not whole pages"
            assert n.parent.children[n.key[:self.page_size]] is n
            assert n.ref >= 0 and all(n.ref >= c.ref for c in n.children.values()), "child locked more"
            for pg in n.pages:
                assert pg not in seen, f"page {pg} cached twice"
                seen.add(pg)
            total += len(n.pages)
            protected += len(n.pages) if n.ref > 0 else 0
        assert total == self._cached_pages and protected == self._protected_pages
