# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 6 (id c05-006) ---
"""Continuous batching with chunked prefill, prefix reuse and retraction.

Every step the scheduler builds one flat batch:
1. every running request that has a token to compute (decodes: one token each);
2. the next chunks of prefills already under way, then new requests from the waiting queue, while the
   prefill token budget (`chunk_size`) and the KV pool allow.
Decodes and prefill chunks share the batch, so a long prompt delays the decoders by one chunk's time,
not by its whole prefill. When a decode cannot get a KV page even after evicting the prefix cache, the
newest running request is retracted: its KV goes back (to the prefix cache when there is one) and it
returns to the front of the queue, to be resumed by a prefill of everything it has so far.

The scheduler owns a request's state from queue to release: `release_finished`, `abort`, and `fail_all`
after a step that raised. It never handles a sampled token's value: the model runner puts it in the token
table on the device, and the scheduler only counts it (`Req.num_pending`).
"""

from __future__ import annotations

import time
from collections import deque

from minisgl.kvcache import PageAllocator, PrefixCache, ReqToTokenPool
from minisgl.scheduler.batch import Batch
from minisgl.scheduler.req import Req, ReqStatus

# schedule() needs the step in flight resolved first: a request to retract has a token the host has not read,
# and it can be re-admitted only with all its token ids known (its row, and the token there, are given back)
NEED_SYNC = object()


# --- notebooks/05_scheduler.ipynb, cell 29 (id c05-029) ---
class SchedulerPages:
    """A request's KV pages: how many to add, where its tokens go, and giving them back. A part of `Scheduler`
    (below), which sets the attributes listed here."""

    allocator: PageAllocator
    req_pool: ReqToTokenPool
    cache: PrefixCache
    page_size: int

    def _pages_for(self, req: Req, n: int) -> int:
        """Pages to add so that `req` (holding `kv_len` tokens in `pages`) can hold `n` more tokens."""
        p = self.page_size
        return -(-(req.kv_len + n) // p) - len(req.pages)

    def _ensure_free(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.num_free >= n

    def _slots(self, req: Req, start: int, end: int) -> list[int]:
        """KV slots of the request's tokens start..end-1."""
        p, pages = self.page_size, req.pages
        if p == 1:
            return pages[start:end]
        return [pages[i // p] * p + i % p for i in range(start, end)]

    def release(self, req: Req, cache_kv: bool = True) -> None:
        """Give back a request's KV: the page-aligned prefix to the prefix cache, the rest to the pool.

        `cache_kv=False` (after a failed step) puts nothing new in the cache: the KV may cover a token the
        host never received, or a chunk that was never computed."""
        p = self.page_size
        if cache_kv:
            aligned = req.kv_len // p * p
            n_dup, _ = self.cache.insert(req.known_ids(aligned), req.pages[:aligned // p])
            self.allocator.free(req.pages[req.cached_len // p:n_dup // p])  # ours, but cached already
            self.allocator.free(req.pages[aligned // p:])  # the partial last page
        else:  # past the prefix it borrowed from the cache, every page is the request's alone
            self.allocator.free(req.pages[req.cached_len // p:])
        self.cache.unlock(req.cache_node)
        self.req_pool.free(req.row)
        req.pages, req.row, req.cache_node, req.cached_len, req.kv_len = [], None, None, 0, 0

    def _cache_prefix(self, req: Req) -> int:
        """Put a running request's computed prefix in the cache now, so requests admitted later reuse it.
        Returns the end of the positions it pointed at someone else's pages (0: none)."""
        p = self.page_size
        aligned = req.kv_len // p * p
        if aligned <= req.cached_len:
            return 0
        n_dup, result = self.cache.insert(req.known_ids(aligned), req.pages[:aligned // p])
        lo, hi = req.cached_len // p, n_dup // p
        if hi > lo:  # someone cached the same tokens first: use their pages, free ours
            self.allocator.free(req.pages[lo:hi])
            req.pages[lo:hi] = result.pages[lo:hi]
            self.req_pool.write(req.row, lo * p, self._slots(req, lo * p, hi * p))
        self.cache.lock(result.node)
        self.cache.unlock(req.cache_node)
        req.cache_node, req.cached_len = result.node, aligned
        return hi * p if hi > lo else 0


# --- notebooks/05_scheduler.ipynb, cell 31 (id c05-031) ---
class SchedulerQueue:
    """The waiting queue and the running list, from a request's arrival to its release. A part of `Scheduler`
    (below), which sets the attributes listed here; `release` is `SchedulerPages`'."""

    waiting: deque[Req]
    running: list[Req]
    num_retractions: int

    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _retract(self, req: Req) -> None:
        """Release a running request's KV and put it back at the front of the waiting queue."""
        self.release(req)
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def release_finished(self, in_flight: set[int]) -> list[Req]:
        """Release finished requests that no launched step still uses; returns them."""
        done = [r for r in self.running if r.finished and id(r) not in in_flight]
        for r in done:
            self.release(r)
            self.running.remove(r)
            r.status = ReqStatus.RELEASED
        return done

    def abort(self, req: Req) -> None:
        """End a request now with finish_reason "abort" (a finished one is left as it is). A waiting request is
        released at once; a running one at the next `release_finished` that no launched step prevents."""
        if req.finished:
            return
        req.status, req.finish_reason, req.finish_time = ReqStatus.FINISHED, "abort", time.perf_counter()
        if req in self.waiting:
            self.waiting.remove(req)
            req.status = ReqStatus.RELEASED

    def fail_all(self) -> list[Req]:
        """After a failed step: end every request (finish_reason "error" unless it had finished), give back
        every page and row, and return them. Nothing enters the prefix cache (see `release(cache_kv=False)`),
        and the cache is emptied: chunks are cached when scheduled, so it may hold KV never computed."""
        now, reqs = time.perf_counter(), [*self.waiting, *self.running]
        for req in reqs:
            if not req.finished:
                req.status, req.finish_reason, req.finish_time = ReqStatus.FINISHED, "error", now
        for req in self.running:
            self.release(req, cache_kv=False)
        for req in reqs:
            req.status = ReqStatus.RELEASED
        self.waiting.clear()
        self.running.clear()
        self.req_pool.discard_writes()  # queued for rows just given back
        self.cache.evict(self.cache.cached_pages)
        return reqs


# --- notebooks/05_scheduler.ipynb, cell 33 (id c05-033) ---
class SchedulerAdmission:
    """How many prompt tokens a step takes, admitting a waiting request, and a step's plan as a `Batch`. A part
    of `Scheduler` (below), which sets the attributes listed here and those of the other two parts."""

    chunk_size: int
    chunked: bool
    step_id: int

    def _prefill_len(self, todo: int, prefill_tokens: int) -> int:
        """How many of `todo` prompt tokens fit this step (0: none)."""
        if self.chunked:
            return min(todo, self.chunk_size - prefill_tokens)
        if prefill_tokens and prefill_tokens + todo > self.chunk_size:
            return 0
        return todo

    def _admit(self, req: Req, prefill_tokens: int) -> int:
        """Admit `req`, the head of the waiting queue, for a chunk that fits what is left of the budget and the
        pool. Returns the tokens it computes this step; 0: not admitted (it stays at the head of the queue)."""
        ids = req.known_ids(req.num_tokens)
        match = self.cache.match(ids[:-1])  # leave at least one token to compute: it gives the logits
        matched = len(match.pages) * self.page_size
        n = self._prefill_len(req.num_tokens - matched, prefill_tokens)
        if n <= 0:
            return 0
        self.cache.lock(match.node)
        need = -(-(matched + n) // self.page_size) - len(match.pages)
        # keep a page per running request spare, so admitting does not force the decoders to retract
        if not self._ensure_free(need + len(self.running)):
            self.cache.unlock(match.node)
            return 0
        self.waiting.popleft()
        req.row = self.req_pool.alloc()
        req.pages, req.kv_len = list(match.pages), matched
        req.cached_len, req.cache_node = matched, match.node
        if req.num_retractions == 0:
            req.num_cached_prompt_tokens = min(matched, len(req.input_ids))
        self.req_pool.write(req.row, 0, self._slots(req, 0, matched))
        # the ids of every token it will compute: all are known here (nothing of it is in flight)
        self.req_pool.write_tokens(req.row, matched, req.ids_between(matched, req.num_tokens))
        req.pages += self.allocator.alloc(need)
        req.status = ReqStatus.RUNNING
        self.running.append(req)
        return n

    def _build(self, plan: list[tuple[Req, int]]) -> Batch:
        self.step_id += 1
        batch = Batch(self.step_id, [], [], [], [], [])
        for i, (req, n) in enumerate(plan):
            start = req.kv_len
            slots = self._slots(req, start, start + n)
            batch.reqs.append(req)
            batch.prefix_lens.append(start)
            batch.extend_lens.append(n)
            batch.out_cache_loc.extend(slots)
            req.kv_len = start + n
            if req.kv_len == req.num_tokens:  # its last token is computed: it samples the next one
                batch.sample_rows.append(i)
                req.num_pending += 1
            # The table points the new positions at their slots, except those that _cache_prefix has just
            # pointed at another request's pages holding the same tokens: one write per position, since a
            # scatter that writes a position twice has no defined winner on a GPU.
            shared_end = self._cache_prefix(req) if n > 1 and self.cache.keeps_pages else 0
            first = max(start, shared_end)
            self.req_pool.write(req.row, first, slots[first - start:])
        return batch


# --- notebooks/05_scheduler.ipynb, cell 35 (id c05-035) ---
class Scheduler(SchedulerPages, SchedulerQueue, SchedulerAdmission):
    def __init__(self, allocator: PageAllocator, req_pool: ReqToTokenPool, cache: PrefixCache,
                 page_size: int, max_running: int, chunk_size: int, chunked: bool = True,
                 mixed_chunk_size: int = 0) -> None:
        self.allocator, self.req_pool, self.cache = allocator, req_pool, cache
        self.page_size = page_size
        self.max_running = max_running
        # Prefill tokens per step. Chunked: prompts are cut to fit. Not chunked: prompts are never cut, and a
        # prompt larger than the budget runs as the only prefill of its step.
        self.chunk_size = chunk_size
        self.chunked = chunked
        # Chunked: at most this many prefill tokens in a step that also decodes (0: chunk_size). A server under
        # steady arrivals may trade prompt speed for steadier token gaps of the requests already streaming.
        self.mixed_chunk_size = mixed_chunk_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.step_id = 0
        self.num_retractions = 0

    def _wants_step(self, req: Req) -> bool:
        return (not req.finished and req.num_tokens > req.kv_len
                and req.num_outputs_scheduled < req.params.max_tokens)

    def schedule(self):
        """The next Batch, None when nothing can run now, or NEED_SYNC."""
        active = [r for r in self.running if self._wants_step(r)]
        decodes = [r for r in active if r.num_tokens - r.kv_len == 1]
        prefills = [r for r in active if r.num_tokens - r.kv_len > 1]

        # 1. one new token for every decoder; retract the newest requests until their pages fit
        while True:
            need = sum(self._pages_for(r, 1) for r in decodes)
            if self._ensure_free(need):
                break
            victims = [r for r in self.running if not r.finished]
            if any(r.num_pending for r in victims):
                return NEED_SYNC
            victim = victims[-1]
            self._retract(victim)
            for group in (decodes, prefills):
                if victim in group:
                    group.remove(victim)
        plan: list[tuple[Req, int]] = []
        for r in decodes:
            r.pages += self.allocator.alloc(self._pages_for(r, 1))
            plan.append((r, 1))

        # 2. continue prefills under way, then admit new requests, within the token budget (a step that decodes
        # starts with part of it counted as spent when mixed_chunk_size is smaller)
        prefill_tokens = 0
        if decodes and self.chunked and 0 < self.mixed_chunk_size < self.chunk_size:
            prefill_tokens = self.chunk_size - self.mixed_chunk_size
        for r in prefills:
            n = self._prefill_len(r.num_tokens - r.kv_len, prefill_tokens)
            if n <= 0:
                break
            if not self._ensure_free(self._pages_for(r, n)):
                # a shorter chunk, as far as the free pages go; none: the next prefill may need no new page
                n = min(n, (len(r.pages) + self.allocator.num_free) * self.page_size - r.kv_len)
                if n <= 0:
                    continue
            r.pages += self.allocator.alloc(self._pages_for(r, n))
            plan.append((r, n))
            prefill_tokens += n
        while self.waiting and len(self.running) < self.max_running and self.req_pool.num_free:
            req = self.waiting[0]
            n = self._admit(req, prefill_tokens)
            if n == 0:
                break
            plan.append((req, n))
            prefill_tokens += n
        if not plan:
            # 3. prefills alone, none of which gets a page (the pool is held by the requests themselves): make
            # room as phase 1 does, or nothing would ever run again (a finished request about to be released
            # gives its pages back soon enough)
            victims = [r for r in self.running if not r.finished]
            if not active or len(victims) < 2 or len(victims) < len(self.running):
                return None
            if any(r.num_pending for r in victims):
                return NEED_SYNC
            self._retract(victims[-1])
            return self.schedule()
        return self._build(plan)
