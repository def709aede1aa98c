"""Paged KV storage, the page allocator, the request→token table and the prefix caches."""

from minisgl.kvcache.pool import KVCache, PageAllocator, ReqToTokenPool
from minisgl.kvcache.prefix_cache import MatchResult, NaiveCache, PrefixCache
from minisgl.kvcache.radix_cache import RadixCache

__all__ = ["KVCache", "PageAllocator", "ReqToTokenPool", "PrefixCache", "NaiveCache", "RadixCache",
           "MatchResult"]
