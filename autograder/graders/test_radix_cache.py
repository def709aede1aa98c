"""Notebook 04: the radix cache against a brute-force model of what it should match."""

from __future__ import annotations

import random

import adapters
import pytest


def put(cache, tokens):
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    n_dup, result = cache.insert(tokens, pages)
    cache.allocator.free(pages[:n_dup // cache.page_size])
    return result


def longest_cached(seqs, query, p):
    best = 0
    for s in seqs:
        n = 0
        while n < len(s) and n < len(query) and s[n] == query[n]:
            n += 1
        best = max(best, n // p * p)
    return best


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("seed", range(4))
def test_match_insert_against_brute_force(page_size, seed):
    rng = random.Random(seed)
    alloc = adapters.page_allocator(4096)
    cache = adapters.radix_cache(alloc, page_size)
    stems = [[rng.randint(0, 3) for _ in range(rng.randint(0, 12))] for _ in range(4)]
    seqs = []
    for _ in range(40):
        s = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        s = s[:len(s) // page_size * page_size]
        q = rng.choice(stems) + [rng.randint(0, 3) for _ in range(rng.randint(0, 10))]
        m = cache.match(q)
        assert len(m.pages) * page_size == longest_cached(seqs, q, page_size)
        res = put(cache, s)
        seqs.append(s)
        assert len(res.pages) * page_size == len(s)
        assert cache.match(s).pages == res.pages
        cache.check()
    # everything evicts, every page comes back
    before = cache.cached_pages
    assert cache.evict(10 ** 9) == before
    assert cache.cached_pages == 0, "evicting everything leaves an empty cache"
    assert alloc.num_free == alloc.capacity, "every page is back in the allocator"


def test_locked_paths_survive_eviction():
    alloc = adapters.page_allocator(64)
    cache = adapters.radix_cache(alloc, 1)
    a = put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 9])
    put(cache, [7, 7])
    cache.lock(a.node)
    assert cache.evictable_pages == 3
    assert cache.evict(100) == 3
    assert cache.match([1, 2, 3, 4]).pages == a.pages
    cache.unlock(a.node)
    with pytest.raises(RuntimeError):
        cache.unlock(a.node)
    assert cache.evict(1) == 2 and cache.evict(1) == 2  # [3 4] then [1 2]
    cache.check()


def test_eviction_is_lru():
    alloc = adapters.page_allocator(64)
    cache = adapters.radix_cache(alloc, 2)
    for s in ([1, 1], [2, 2], [3, 3]):
        put(cache, s)
    cache.match([1, 1])
    cache.match([2, 2])
    assert cache.evict(1) == 1 and cache.match([3, 3]).pages == []
    assert cache.evict(1) == 1 and cache.match([1, 1]).pages == []
