"""Scheduling and prefix caching for a hybrid model (Qwen3.5): KV pages plus a per-request state.

A full-attention layer can resume from any cached prefix: its KV is per token. A linear-attention layer can
only resume where its state was saved. So a radix hit is taken only at a node that holds a *snapshot* of the
state at its end, and the request's state is copied from it (copy on hit):

- snapshots are taken at page-aligned ends of prefill chunks, and at the last page boundary below the prompt's
  end: the prompt's chunk is cut there so that the state at that point exists (that boundary is the deepest
  point a later `match(prompt[:-1])` can reach);
- and at the branch point of a shared prefix: when a request's KV match goes deeper than its deepest snapshot
  (a prompt that shares a system prompt with an earlier one, which cached its KV but snapshotted only its own
  prompt's end), its prefill is cut at the end of the KV match and the state there is saved. The request itself
  recomputes that prefix (its linear layers need the state), but every later request sharing it hits there;
- a match walks the radix tree as usual, then backs up to the deepest node with a snapshot;
- a snapshot lives as long as its node: evicting a node (LRU, with its pages) frees its snapshot; when the
  snapshot slots run out, the least recently used snapshot is dropped (its node keeps its pages).

Each request's state lives in the state pool slot of its request-table row (see kvcache/state_pool.py). The
batch tells the model runner which requests start this step (from a snapshot, or from zeros) and which states
to snapshot after it; the runner queues those copies around the forward, so on the device they run in step
order and a snapshot freed and reused by a later step is never read after it is overwritten.

With the radix cache off (the naive cache) nothing is matched, cut or snapshotted: every request starts from
zeros, the ablation's baseline.

Known gap: the base scheduler caches a prefix only for chunks of more than one token, so when a shared prefill
budget leaves a 1-token chunk that ends on the prompt's boundary, that boundary gets no snapshot (a later hit
resumes from an earlier one: fewer cached tokens, same tokens out).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from minisgl.kvcache import NaiveCache, PageAllocator, PrefixCache, RadixCache, ReqToTokenPool
from minisgl.kvcache.prefix_cache import MatchResult
from minisgl.kvcache.state_pool import StatePool
from minisgl.scheduler.batch import Batch
from minisgl.scheduler.req import Req
from minisgl.scheduler.scheduler import Scheduler


@dataclass
class HybridBatch(Batch):
    # (state slot, snapshot slot or None = zeros): requests that start this step
    state_inits: list[tuple[int, int | None]] = field(default_factory=list)
    # (state slot, snapshot slot): states to copy into snapshots after the step
    state_saves: list[tuple[int, int]] = field(default_factory=list)


class HybridRadixCache(RadixCache):
    """A radix cache whose nodes may also hold a state snapshot; matches stop at the deepest one that does."""

    def __init__(self, allocator: PageAllocator, page_size: int, state_pool: StatePool) -> None:
        super().__init__(allocator, page_size)
        self.state_pool = state_pool
        self.snapshots: dict[object, int] = {}  # node -> snapshot slot (the state after the node's last token)

    def match(self, token_ids: list[int]) -> MatchResult:
        result = super().match(token_ids)
        node, pages = result.node, result.pages
        while node is not self.root and node not in self.snapshots:
            pages = pages[:len(pages) - len(node.pages)]
            node = node.parent
        return MatchResult(pages, node)

    def kv_match_len(self, token_ids: list[int]) -> int:
        """Tokens of the longest cached page-aligned prefix of `token_ids`, snapshot or not (RadixCache.match's
        depth), read only: no split, no LRU touch."""
        p, node, i = self.page_size, self.root, 0
        while i + p <= len(token_ids):
            child = node.children.get(tuple(token_ids[i:i + p]))
            if child is None:
                break
            key = child.key
            if i + len(key) <= len(token_ids) and key == tuple(token_ids[i:i + len(key)]):
                i, node = i + len(key), child  # the whole edge (the common case, compared in one go)
                continue
            return i + self._common_pages(key, token_ids, i) * p
        return i

    def snapshot_of(self, node) -> int | None:
        """The snapshot slot a request matched at `node` starts from; None: the root (zeros) or no cache."""
        return self.snapshots.get(node)

    def reserve_snapshot(self, node, busy: set[int]) -> int | None:
        """A snapshot slot for the state at the end of `node`; None when it has one already or no slot is left.
        `busy`: slots this step already saves into, which must not be handed out twice."""
        if node is None or node is self.root or node in self.snapshots:
            return None
        slot = self.state_pool.alloc_snapshot()
        if slot is None:  # all taken: drop the least recently used snapshot, keep its node's pages
            victims = [n for n, s in self.snapshots.items() if s not in busy]
            if not victims:
                return None
            slot = self.snapshots.pop(min(victims, key=lambda n: n.last_used))
        self.snapshots[node] = slot
        return slot

    def evict(self, num_pages: int) -> int:
        freed = super().evict(num_pages)
        # an evicted node is no longer its parent's child; its snapshot goes with it
        p = self.page_size
        for node in [n for n in self.snapshots if n.parent.children.get(n.key[:p]) is not n]:
            self.state_pool.free_snapshot(self.snapshots.pop(node))
        return freed

    def check(self) -> None:
        super().check()
        live = set(self._nodes())
        assert all(n in live for n in self.snapshots), "a snapshot outlived its node"
        slots = list(self.snapshots.values())
        assert len(set(slots)) == len(slots), "a snapshot slot is held twice"
        # every snapshot slot is either held here or free in the pool: none both, none lost
        assert len(slots) + self.state_pool.num_free_snapshots == self.state_pool.num_snapshots, \
            "a snapshot slot is both held and free, or lost"


class HybridScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._fresh: set[int] = set()  # ids of the requests that may be admitted by the schedule() under way
        # id(req) -> (req, token): a page boundary where a running prefill stops a chunk and snapshots its state,
        # the end of the KV it matched past its snapshot (a shared prefix's branch point)
        self._branch_points: dict[int, tuple[Req, int]] = {}

    def _pages_for(self, req: Req, n: int) -> int:
        # A chunk cut short in _build keeps the pages taken for the rest of it, so a request may already hold
        # more than n more tokens need (its next chunk may be smaller: a step that decodes gets the mixed budget).
        # Never negative: PageAllocator.alloc(-k) would hand over all but k free pages, and a negative count would
        # hide the pages other decoders need in schedule()'s sum.
        return max(super()._pages_for(req, n), 0)

    def schedule(self):
        self._fresh = {id(r) for r in self.waiting}
        try:
            return super().schedule()
        finally:
            self._fresh = set()

    def _retract(self, req: Req) -> None:
        super()._retract(req)
        self._fresh.add(id(req))  # it may be admitted again in this very step, from a different prefix

    def _build(self, plan: list[tuple[Req, int]]) -> HybridBatch:
        p, snapshots = self.page_size, self.cache.keeps_pages
        # forget the branch points of requests that passed them or gave their row back (finished, retracted)
        self._branch_points = {k: (r, b) for k, (r, b) in self._branch_points.items()
                               if r.row is not None and r.kv_len < b}
        inits, cut = [], []
        for req, n in plan:
            if id(req) in self._fresh:  # just admitted: req.cache_node is still the node it matched
                inits.append((req.row, self.cache.snapshot_of(req.cache_node) if snapshots else None))
                self._branch_points.pop(id(req), None)
                if snapshots:  # the KV matched past the snapshot it starts from: a branch point to snapshot
                    depth = self.cache.kv_match_len(req.known_ids(req.num_tokens - 1))
                    if depth > req.kv_len:
                        self._branch_points[id(req)] = (req, depth)
            if snapshots and n > 1:  # (a 1-token chunk, every decode, cannot be cut: skip the per-row work)
                # stop the prompt's chunk at the last page boundary below its end, so the state there is saved,
                # and before that at its branch point (a cut leaving a 1-token chunk is skipped: such a chunk is
                # not cached, so it could not be snapshotted); the pages already taken for the rest stay with the
                # request for its next step
                boundary = (req.num_tokens - 1) // p * p
                branch = self._branch_points.get(id(req), (None, 0))[1]
                if req.kv_len + 1 < branch < req.kv_len + n:
                    n = branch - req.kv_len
                elif req.kv_len < boundary < req.kv_len + n:
                    n = boundary - req.kv_len
            cut.append((req, n))
        batch = super()._build(cut)
        saves = []
        if snapshots:
            for req, n in zip(batch.reqs, batch.extend_lens):
                # a prefill chunk that ended on a page boundary has just been cached up to its end (decodes
                # are not snapshotted: with page size 1 that would be every token)
                if n > 1 and req.kv_len % p == 0 and req.cached_len == req.kv_len:
                    slot = self.cache.reserve_snapshot(req.cache_node, {s for _, s in saves})
                    if slot is not None:
                        saves.append((req.row, slot))
        return HybridBatch(**{f.name: getattr(batch, f.name) for f in fields(Batch)},
                           state_inits=inits, state_saves=saves)


def make_hybrid_scheduler(config, allocator: PageAllocator, req_pool: ReqToTokenPool,
                          state_pool: StatePool) -> tuple[PrefixCache, HybridScheduler]:
    """The prefix cache and scheduler of a hybrid model (the engine calls this instead of building its own)."""
    if config.radix_cache:
        cache = HybridRadixCache(allocator, config.page_size, state_pool)
    else:
        cache = NaiveCache(allocator, config.page_size)
    scheduler = HybridScheduler(allocator, req_pool, cache, config.page_size, config.max_running_requests,
                                config.prefill_budget, chunked=config.chunked_prefill,
                                mixed_chunk_size=config.mixed_prefill_tokens)
    return cache, scheduler
