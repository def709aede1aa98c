"""Property-based tests of the page allocator and the prefix caches (radix and naive).

A harness drives a cache the way the scheduler does (admit = match + lock + alloc, cache a running prefix,
release = insert + free duplicates + unlock, evict under pressure) in random orders drawn by hypothesis, and
checks it against a plain-dict oracle after every operation: which pages a prefix maps to, that locked
pages are never evicted, that every page is exactly one of free / cached / owned by a live request, and
that the radix tree's counters agree with the tree.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.kvcache import NaiveCache, PageAllocator, RadixCache, ReqToTokenPool

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- PageAllocator ------------------------------------------------------------------------------------------

@SETTINGS
@given(num_pages=st.integers(2, 40), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 45)), max_size=60))
def test_allocator_never_hands_out_a_page_twice(num_pages, ops):
    alloc = PageAllocator(num_pages)
    held: list[int] = []
    assert alloc.capacity == num_pages - 1 == alloc.num_free
    for is_alloc, n in ops:
        if is_alloc:
            before = alloc.num_free
            pages = alloc.alloc(n)
            if n > before:
                assert pages is None and alloc.num_free == before  # nothing taken
                continue
            assert len(pages) == n and alloc.num_free == before - n
            assert all(0 < p < num_pages for p in pages)  # page 0 is reserved
            assert not set(pages) & set(held) and len(set(pages)) == n
            held += pages
        elif held:
            k = n % (len(held) + 1)
            give, held = held[:k], held[k:]
            alloc.free(give)
        assert alloc.num_free + len(held) == alloc.capacity
        assert sorted(alloc._free + held) == list(range(1, num_pages))
    if held:
        alloc.free(held[:1])
        with pytest.raises(RuntimeError, match="double free"):
            alloc.free(held[:1])


def test_allocator_rejects_bad_frees():
    alloc = PageAllocator(5)
    pages = alloc.alloc(2)
    for bad in ([0], [5], [-1], [4] if 4 not in pages else [3]):
        with pytest.raises(RuntimeError):
            alloc.free(bad)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(pages[:1])
    assert alloc.num_free == alloc.capacity == 4
    with pytest.raises(ValueError):
        PageAllocator(1)


# --- the prefix caches --------------------------------------------------------------------------------------

class Harness:
    """Drives a prefix cache like the scheduler does and checks it against an oracle."""

    def __init__(self, cache_cls, page_size: int, num_pages: int) -> None:
        self.p = page_size
        self.alloc = PageAllocator(num_pages)
        self.cache = cache_cls(self.alloc, page_size)
        self.radix = isinstance(self.cache, RadixCache)
        self.oracle: dict[tuple[int, ...], int] = {}  # whole-page prefix -> page holding its last page
        self.reqs: list[dict] = []  # live requests
        self.probes: list[tuple[object, list[int]]] = []  # extra locks on matched nodes

    # oracle ---------------------------------------------------------------------------------------------
    def expected_match(self, tokens) -> list[int]:
        pages, k = [], 1
        while k * self.p <= len(tokens) and tuple(tokens[:k * self.p]) in self.oracle:
            pages.append(self.oracle[tuple(tokens[:k * self.p])])
            k += 1
        return pages

    def learn(self, tokens, pages, start_page: int, end_page: int) -> None:
        for k in range(start_page, end_page):
            key = tuple(tokens[:(k + 1) * self.p])
            assert key not in self.oracle, "insert adopted pages for a prefix that was already cached"
            self.oracle[key] = pages[k]

    def locked_pages(self) -> set[int]:
        locked = set()
        for r in self.reqs:
            locked |= set(r["pages"][:r["cached_len"] // self.p])
        for _, pages in self.probes:
            locked |= set(pages)
        return locked

    # operations -----------------------------------------------------------------------------------------
    def match(self, tokens) -> None:
        m = self.cache.match(tokens)
        assert m.pages == self.expected_match(tokens), "match returned pages not inserted for that prefix"

    def evict(self, n: int) -> int:
        before = set(self.alloc._free)
        evictable = self.cache.evictable_pages
        locked = self.locked_pages()
        owned = {pg for r in self.reqs for pg in r["pages"][r["cached_len"] // self.p:]}
        freed = self.cache.evict(n)
        new = set(self.alloc._free) - before
        assert len(new) == freed == self.alloc.num_free - len(before)
        assert freed >= min(n, evictable), "evict left evictable pages behind while short"
        assert not new & locked, "a locked page was evicted"
        assert not new & owned, "evict freed a page the cache does not own"
        self.oracle = {k: v for k, v in self.oracle.items() if v not in new}
        for key in self.oracle:  # eviction removes leaves only: what is left is prefix-closed
            assert all(key[:j * self.p] in self.oracle for j in range(1, len(key) // self.p))
        return freed

    def admit(self, tokens) -> None:
        m = self.cache.match(tokens[:-1])  # like the scheduler: the last token is always computed
        assert m.pages == self.expected_match(tokens[:-1])
        self.cache.lock(m.node)
        need = -(-len(tokens) // self.p) - len(m.pages)
        short = need - self.alloc.num_free
        if short > 0:
            self.reqs.append(dict(tokens=tokens, pages=list(m.pages), cached_len=len(m.pages) * self.p,
                                  node=m.node))  # count our lock while evicting
            self.evict(short)
            self.reqs.pop()
        new = self.alloc.alloc(need)
        if new is None:
            self.cache.unlock(m.node)
            return
        self.reqs.append(dict(tokens=tokens, pages=list(m.pages) + new, cached_len=len(m.pages) * self.p,
                              node=m.node))

    def cache_prefix(self, i: int, frac: float) -> None:
        """Scheduler._cache_prefix: cache a running request's computed whole pages now."""
        r = self.reqs[i]
        p, tokens, pages = self.p, r["tokens"], r["pages"]
        full = len(tokens) // p
        aligned = max(r["cached_len"] // p, round(full * frac)) * p
        if aligned <= r["cached_len"]:
            return
        n_dup, result = self.cache.insert(tokens[:aligned], pages[:aligned // p])
        assert n_dup % p == 0 and r["cached_len"] <= n_dup <= aligned
        lo, hi = r["cached_len"] // p, n_dup // p
        assert result.pages[:lo] == pages[:lo]
        assert result.pages[:hi] == self.expected_match(tokens[:n_dup])
        assert result.pages[hi:] == pages[hi:aligned // p]
        self.learn(tokens, pages, hi, aligned // p)
        if hi > lo:
            self.alloc.free(pages[lo:hi])
            pages[lo:hi] = result.pages[lo:hi]
        self.cache.lock(result.node)
        self.cache.unlock(r["node"])
        r["node"], r["cached_len"] = result.node, aligned

    def release(self, i: int) -> None:
        """Scheduler.release: the aligned prefix to the cache, duplicates and the partial page to the pool."""
        r = self.reqs.pop(i)
        p, tokens, pages = self.p, r["tokens"], r["pages"]
        aligned = len(tokens) // p * p
        n_dup, result = self.cache.insert(tokens[:aligned], pages[:aligned // p])
        if self.radix:
            assert r["cached_len"] <= n_dup <= aligned
            assert result.pages[:r["cached_len"] // p] == pages[:r["cached_len"] // p]
            assert result.pages == self.expected_match(tokens[:n_dup]) + pages[n_dup // p:aligned // p]
            self.learn(tokens, pages, n_dup // p, aligned // p)
        else:
            assert n_dup == aligned and result.pages == []
        self.alloc.free(pages[r["cached_len"] // p:n_dup // p])
        self.alloc.free(pages[aligned // p:])
        self.cache.unlock(r["node"])

    def probe_lock(self, tokens) -> None:
        m = self.cache.match(tokens)
        self.cache.lock(m.node)
        self.probes.append((m.node, list(m.pages)))

    def probe_unlock(self, i: int) -> None:
        node, _ = self.probes.pop(i)
        self.cache.unlock(node)

    # invariants -----------------------------------------------------------------------------------------
    def check(self) -> None:
        alloc, cache, p = self.alloc, self.cache, self.p
        free = list(alloc._free)
        assert len(set(free)) == len(free) and 0 not in free
        owned = [pg for r in self.reqs for pg in r["pages"][r["cached_len"] // p:]]
        assert len(set(owned)) == len(owned), "two requests own the same page"
        if self.radix:
            cache.check()
            cached = [pg for n in cache._nodes() for pg in n.pages]
            assert sorted(cached) == sorted(self.oracle.values())
            assert cache.cached_pages - cache.evictable_pages == len(self.locked_pages())
        else:
            cached = []
            assert cache.cached_pages == cache.evictable_pages == 0 and not self.oracle
        everything = free + cached + owned
        assert sorted(everything) == list(range(1, alloc.num_pages)), "a page leaked or is held twice"
        assert alloc.num_free + cache.cached_pages + len(owned) == alloc.capacity

    def drain(self) -> None:
        """Release everything: all pages are then free or evictable; evicting all frees every page."""
        while self.probes:
            self.probe_unlock(0)
        while self.reqs:
            self.release(0)
        self.check()
        assert self.alloc.num_free + self.cache.evictable_pages == self.alloc.capacity
        assert self.cache.evictable_pages == self.cache.cached_pages
        self.evict(self.alloc.capacity)
        assert self.alloc.num_free == self.alloc.capacity and self.cache.cached_pages == 0
        assert not self.oracle
        if self.radix:
            assert not self.cache.root.children


def token_strategy(p: int):
    """Sequences built mostly from two page-sized words, so prefixes are shared and edges split, plus a
    partial tail page."""
    words = [tuple([0] * p), tuple([1] * p)]
    page = st.one_of(st.sampled_from(words), st.sampled_from(words), st.sampled_from(words),
                     st.lists(st.integers(0, 2), min_size=p, max_size=p).map(tuple))
    tail = st.lists(st.integers(0, 2), max_size=p - 1)
    return st.tuples(st.lists(page, min_size=1, max_size=6), tail).map(
        lambda x: [t for w in x[0] for t in w] + x[1])


def ops_strategy(p: int):
    toks = token_strategy(p)
    admit = st.tuples(st.just("admit"), toks)
    release = st.tuples(st.just("release"), st.integers(0, 100))
    return st.lists(st.one_of(
        admit, admit, admit, release, release,
        st.tuples(st.just("cache_prefix"), st.integers(0, 100), st.floats(0, 1)),
        st.tuples(st.just("cache_prefix"), st.integers(0, 100), st.just(1.0)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
        st.tuples(st.just("match"), toks),
        st.tuples(st.just("probe_lock"), toks),
        st.tuples(st.just("probe_unlock"), st.integers(0, 100)),
    ), min_size=20, max_size=60)


def run_ops(h: Harness, ops) -> None:
    for op in ops:
        kind = op[0]
        if kind == "admit":
            h.admit(op[1])
        elif kind == "release" and h.reqs:
            h.release(op[1] % len(h.reqs))
        elif kind == "cache_prefix" and h.reqs and h.radix:
            h.cache_prefix(op[1] % len(h.reqs), op[2])
        elif kind == "evict":
            h.evict(op[1])
        elif kind == "match":
            h.match(op[1])
        elif kind == "probe_lock":
            h.probe_lock(op[1])
        elif kind == "probe_unlock" and h.probes:
            h.probe_unlock(op[1] % len(h.probes))
        h.check()
    h.drain()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cache_cls", [RadixCache, NaiveCache], ids=["radix", "naive"])
def test_prefix_cache_properties(cache_cls, page_size):
    # the naive cache is trivial: fewer examples
    @settings(SETTINGS, max_examples=50 if cache_cls is RadixCache else 20)
    @given(num_pages=st.integers(8, 30), ops=ops_strategy(page_size))
    def run(num_pages, ops):
        run_ops(Harness(cache_cls, page_size, num_pages), ops)

    run()


# --- a few exact scenarios ----------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [1, 4])
def test_radix_match_insert_split_and_lru(p):
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, p)
    a = [7] * (3 * p)
    b = [7] * p + [8] * (2 * p)  # shares a's first page: inserting it splits a's edge
    pa, pb = alloc.alloc(3), alloc.alloc(3)
    assert cache.insert(a, pa)[0] == 0
    n_dup, res = cache.insert(b, pb)
    assert n_dup == p and res.pages == pa[:1] + pb[1:]
    alloc.free(pb[:1])  # the duplicate first page is ours to free
    cache.check()
    assert cache.match(a + [1]).pages == pa and cache.match(b).pages == res.pages
    assert cache.match(a[:2 * p - 1]).pages == pa[:1]  # only whole pages match
    assert cache.match([9] * p).pages == []
    assert cache.cached_pages == cache.evictable_pages == 5
    # lock b: its pages (and the shared first page) survive any eviction; a's own two pages go
    cache.lock(cache.match(b).node)
    cache.match(a)  # touch a, so LRU would prefer b if it could
    assert cache.evict(100) == 2
    cache.check()
    assert cache.match(b).pages == res.pages and cache.match(a).pages == pa[:1]
    assert cache.evictable_pages == 0 and cache.cached_pages == 3
    cache.unlock(cache.match(b).node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(cache.match(b).node)
    assert cache.evict(1) >= 1
    cache.check()


def test_radix_evicts_least_recently_used_first():
    alloc = PageAllocator(16)
    cache = RadixCache(alloc, 1)
    seqs = [[1, 2], [3, 4], [5, 6]]
    for s in seqs:
        cache.insert(s, alloc.alloc(2))
    cache.match([1, 2])  # now [3, 4] is the oldest
    assert cache.evict(2) == 2
    assert cache.match([3, 4]).pages == [] and len(cache.match([1, 2]).pages) == 2
    assert len(cache.match([5, 6]).pages) == 2
    cache.check()


def test_radix_insert_rejects_partial_pages():
    cache = RadixCache(PageAllocator(8), 4)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], [1])
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [1, 2])


def test_naive_cache_keeps_nothing():
    alloc = PageAllocator(8)
    cache = NaiveCache(alloc, 2)
    pages = alloc.alloc(2)
    n_dup, res = cache.insert([1, 2, 3, 4], pages)
    assert n_dup == 4 and res.pages == []  # the caller frees everything
    alloc.free(pages)
    assert cache.match([1, 2, 3, 4]).pages == [] and cache.evict(10) == 0
    assert alloc.num_free == alloc.capacity and cache.cached_pages == cache.evictable_pages == 0


# --- ReqToTokenPool: the slot table and the token-id table ---------------------------------------------------

def test_token_table_writes_are_queued_and_flushed_with_the_slots():
    pool = ReqToTokenPool(max_reqs=3, max_context_len=8, device="cpu")
    a, b = pool.alloc(), pool.alloc()
    pool.write(a, 0, [5, 6, 7])
    pool.write_tokens(a, 0, [100, 101, 102])
    pool.write_tokens(b, 2, [200, 201])
    pool.write_tokens(b, 5, [])
    assert pool.token_ids.sum() == 0 and pool.table.sum() == 0, "writes only queue"
    pool.flush()
    assert pool.table[a, :3].tolist() == [5, 6, 7]
    assert pool.token_ids[a].tolist() == [100, 101, 102, 0, 0, 0, 0, 0]
    assert pool.token_ids[b].tolist() == [0, 0, 200, 201, 0, 0, 0, 0]
    pool.write_tokens(a, 3, [103])  # token ids alone (no slot write) flush too
    pool.flush()
    assert pool.token_ids[a, :4].tolist() == [100, 101, 102, 103] and pool.table[a, :4].tolist() == [5, 6, 7, 0]
    pool.write(b, 0, [9])
    pool.write_tokens(b, 0, [9])
    pool.discard_writes()  # a failed step: its queued writes are dropped
    pool.flush()
    assert pool.table[b, 0] == 0 and pool.token_ids[b, 0] == 0
