# generated from notebooks/02_kv_pool.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/02_kv_pool.ipynb, cell 3 (id c02-003) ---
"""KV storage by pages, the page allocator and the request→token table (with the requests' token ids)."""

from __future__ import annotations

import numpy as np
import torch

from minisgl.kernels import elementwise as ew


# --- notebooks/02_kv_pool.ipynb, cell 5 (id c02-005) ---
class KVCache:
    """K and V for every layer: one tensor `[2, layers, num_pages, page_size, kv_heads, head_dim]`.

    Attention kernels see each layer as flat slots `[num_pages * page_size, kv_heads, head_dim]`;
    slot = page * page_size + offset. Page 0 is never handed out: padded rows of a CUDA Graph batch
    write their K/V there, so they can never clobber a live request.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.buffer = torch.zeros(2, num_layers, num_pages, page_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        flat = self.buffer.view(2, num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k_buffers = [flat[0, i] for i in range(num_layers)]
        self.v_buffers = [flat[1, i] for i in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # k_buffers[layer_id][loc] = k and the same for v (read `store_kv_ref`); on a GPU one Triton launch
        ew.store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], loc, k, v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


# --- notebooks/02_kv_pool.ipynb, cell 10 (id c02-010) ---
class PageAllocator:
    """Hands out whole pages. Page 0 is reserved (see KVCache)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.num_pages = num_pages
        # Popping from the end hands out low page numbers first, which keeps tests easy to read.
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = [False] + [True] * (num_pages - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages) -> None:
        for p in pages:
            p = int(p)
            if p <= 0 or p >= self.num_pages or self._is_free[p]:
                raise RuntimeError(f"double free or bad page {p}")
            self._is_free[p] = True
            self._free.append(p)


# --- notebooks/02_kv_pool.ipynb, cell 14 (id c02-014) ---
class ReqToTokenPool:
    """`table[row, pos]` = KV slot of token `pos` of the request in `row`, kept on the device; beside it
    `token_ids[row, pos]` = that token's id, which the model runner reads inputs from and writes samples to.

    Writes are queued on the host and applied by `flush()` right before a forward, so a step costs one
    host-to-device copy however many requests changed.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_reqs, self.max_context_len = max_reqs, max_context_len
        self.device = torch.device(device)
        self.table = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device)
        self.token_ids = torch.zeros(max_reqs, max_context_len, dtype=torch.int64, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        # queued writes as three flat lists: cheap to append one decode token at a time
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._vals: list[int] = []
        self._token_runs: list[tuple[int, int, list[int]]] = []  # (row, start, ids): a prompt is one run

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: list[int]) -> None:
        n = len(slots)
        if n:
            self._rows.extend([row] * n)
            self._cols.extend(range(start, start + n))
            self._vals.extend(slots)

    def write_tokens(self, row: int, start: int, ids: list[int]) -> None:
        """Queue token ids for positions `start, start+1, ...` of `row` (applied by `flush`)."""
        if len(ids):
            self._token_runs.append((row, start, ids))

    def discard_writes(self) -> None:
        """Forget the queued writes (after a failed step: the rows they were for are given back)."""
        self._rows, self._cols, self._vals, self._token_runs = [], [], [], []

    def take_writes(self) -> tuple[np.ndarray, int]:
        """The queued writes as one array `[3, n + m]` of (row, position, value), the n slot writes first and
        then the m token ids, and n. The queues are emptied."""
        n, m = len(self._rows), sum(len(ids) for _, _, ids in self._token_runs)
        packed = np.empty((3, n + m), dtype=np.int64)
        packed[:, :n] = self._rows, self._cols, self._vals
        at = n
        for row, start, ids in self._token_runs:
            packed[0, at:at + len(ids)] = row
            packed[1, at:at + len(ids)] = np.arange(start, start + len(ids))
            packed[2, at:at + len(ids)] = ids
            at += len(ids)
        self.discard_writes()
        return packed, n

    def apply_writes(self, packed: torch.Tensor, n: int) -> None:
        """Scatter writes from `take_writes`, already on the device, into the two tables."""
        if n:
            self.table[packed[0, :n], packed[1, :n]] = packed[2, :n].to(torch.int32)
        if packed.shape[1] > n:
            self.token_ids[packed[0, n:], packed[1, n:]] = packed[2, n:]

    def flush(self) -> None:
        """Apply the queued writes: one host-to-device copy, one scatter per table. (The model runner instead
        sends them in the step's own copy: `take_writes` there, `apply_writes` on the device.)"""
        packed, n = self.take_writes()
        if packed.shape[1] == 0:
            return
        dev = torch.from_numpy(packed)
        if self.device.type == "cuda":
            dev = dev.pin_memory().to(self.device, non_blocking=True)
        self.apply_writes(dev, n)
