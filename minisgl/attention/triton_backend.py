"""The Triton backend: paged split-K decode and causal extend kernels from minisgl.kernels.attention.

The kernels read every key through `req_to_token`, so they need no per-step planning: `prepare` only keeps
the metadata, and CUDA Graph capture works by pointing the backend at the graph runner's fixed buffers.
The one thing a captured decode needs fixed is its split count and workspace; both depend only on the batch
size and `max_context_len`, never on the step's sequence lengths. The workspace's tail holds the split-merge
counters (kernels/attention.py, the fused merge): zeroed once here when allocated, left at zero by every
launch, and sized for every batch size that shares it.

A decode step stores its new K/V inside the decode kernel (kernels/attention.py; kernel option
`decode_fused_store`): one launch fewer per layer. `forward` still stores k/v either way; extend steps always store
with store_kv first.

A mixed step (chunked prefill with decode rows riding along; the scheduler puts the decode rows first) sends its
leading one-token rows through the decode kernel and only the rest through the extend kernel (kernel option
`mixed_decode_split`).
The extend kernel gives each request and head a 128-query tile: a decode row would fill one row of it and pay
the tensor-core work of 128 over its whole context, which made the decode rows of a 1-4k-prompt mix three times
dearer in a mixed step than in a decode step (reports/h200/run12, sweep_phases06). The split needs the host's
extend lengths, so a prefill-graph step (engine/prefill_graph.py, whose fixed metadata has none) keeps one launch.

With the kernel option `extend_tiles` the extend kernel runs from a tile list (kernels/attention.py): `prepare`
makes an eager step's list from the host lengths; a prefill graph reads a fixed list, which `load_graph_step`
fills from the step's host lengths before each replay (`init_prefill_graph_state` allocates it). A prefill graph
then splits its decode rows off too, on the device: it launches the decode kernel over all its request rows with
a fixed array of lengths that holds a decode row's seq_len and 0 for every other row (skipped), and its tile list
leaves the decode rows out.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from minisgl.attention.base import AttentionBackend, AttentionMetadata
from minisgl.kernels.attention import (
    DecodeRope,
    decode_attention,
    decode_num_splits,
    decode_shared_workspace_numel,
    extend_attention,
    extend_block_m,
    extend_tile_list,
    extend_tiles_bound,
)
from minisgl.kernels.options import current_options


def leading_decode_rows(meta: AttentionMetadata) -> int:
    """How many of the step's first requests extend by one token (0 when the host lengths are unknown, or when
    every request does: a decode step, or a mixed step of nothing else, keeps its own path)."""
    ext = meta.extend_lens_cpu
    if ext is None:
        return 0
    n = next((i for i, e in enumerate(ext) if e != 1), len(ext))
    return n if n < len(ext) else 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    # Extend steps capture too (engine/prefill_graph.py): the extend kernel's grid comes from the host
    # max_extend_len (fixed per graph) and it masks each request on the device.
    supports_extend_cuda_graph = True

    def __init__(self, kv_cache, req_to_token: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, max_context_len: int | None = None) -> None:
        super().__init__(kv_cache, req_to_token, num_q_heads, num_kv_heads, head_dim, scale)
        # The split count comes from this fixed bound (not the step's longest request) so eager and replayed
        # decode steps run the very same reduction and give bit-identical results.
        self.max_context_len = int(max_context_len or req_to_token.shape[1])
        device = req_to_token.device
        self._num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                         if device.type == "cuda" else 132)
        # Workspaces and the largest batch each is sized for: one buffer serves every batch size up to its bound
        # (the counters at its end must never be overwritten by another size's partials; see
        # decode_shared_workspace_numel), so a batch is given a buffer by its size, not by the buffer's numel.
        self._graph_workspace: torch.Tensor | None = None  # fixed once allocated: captured graphs point at it
        self._graph_ws_bs = 0
        self._eager_workspace: torch.Tensor | None = None  # grows for eager batches larger than max_bs
        self._eager_ws_bs = 0
        self._block_m = extend_block_m(head_dim, device, kv_cache.dtype.itemsize)
        self._planned: AttentionMetadata | None = None  # the metadata `prepare` planned the step for
        self._n_dec = 0  # its leading decode rows (see forward)
        self._tiles: torch.Tensor | None = None  # its extend tile list (kernel option extend_tiles)
        self._graph_tiles: torch.Tensor | None = None  # the prefill graphs' fixed list (init_prefill_graph_state)
        self._graph_decode: torch.Tensor | None = None  # and their decode rows' lengths (0: not a decode row)
        self._graph_decode_lens: torch.Tensor | None = None  # this graph's slice of it, when its decode rows split
        self._rope: DecodeRope | None = None  # the rotation the next forward applies (defer_rope)

    def num_splits_for(self, bs: int) -> int:
        """Splits of each request's keys in a decode batch of bs rows (host values only: a graph's grid)."""
        return decode_num_splits(bs, self.num_kv_heads, self.max_context_len, self._num_sms)

    def _workspace_numel(self, max_bs: int) -> int:
        """Elements of a workspace shared by decode batches of 1..max_bs."""
        return decode_shared_workspace_numel(range(1, max_bs + 1), self.num_q_heads, self.num_kv_heads,
                                             self.head_dim, self.num_splits_for)

    def _next_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The next layer's K/V buffers for the decode kernel's L2 prefetch (kernel option decode_prefetch_next_kv),
        if there is a next layer in the pool; a wrong guess costs speed, never correctness."""
        nxt = layer_id + 1
        if not current_options().decode_prefetch_next_kv or nxt >= len(self.kv_cache.k_buffers):
            return None
        return self.kv_cache.k_buffers[nxt], self.kv_cache.v_buffers[nxt]

    def _workspace(self, bs: int, device: torch.device) -> torch.Tensor | None:
        if self.num_splits_for(bs) <= 1:
            return None
        if self._graph_workspace is not None and bs <= self._graph_ws_bs:
            return self._graph_workspace
        if self._eager_workspace is None or bs > self._eager_ws_bs:
            # zeros: the merge counters must start at zero (each launch leaves them so)
            self._eager_workspace = torch.zeros(self._workspace_numel(bs), dtype=torch.float32, device=device)
            self._eager_ws_bs = bs
        return self._eager_workspace

    def _fuse_store(self, *new: torch.Tensor) -> bool:
        """Whether this decode step's K/V store goes into the decode kernel, for the new k and v given (the engine's
        kernel option, read at every call, so a captured graph holds the path of the options it was captured
        under; and rows of each with a contiguous last dim)."""
        return current_options().decode_fused_store and all(t.stride(-1) == 1 for t in new)

    # --- extend tile lists (kernel option extend_tiles) ---

    def prepare(self, meta: AttentionMetadata) -> None:
        """The step's plan, once for all its layers: how many leading decode rows take the decode kernel, and with
        the kernel option extend_tiles the extend kernel's tile list (or a prefill graph's fixed inputs)."""
        self.meta = self._planned = meta
        self._rope = None  # a rotation is taken on for the very next forward only
        self._n_dec = 0 if meta.is_decode else self._first_row(meta)
        self._tiles = self._graph_decode_lens = None
        if meta.is_decode or not current_options().extend_tiles:
            return
        if meta.extend_lens_cpu is None:  # a prefill graph's fixed metadata: the fixed inputs, sized for its shape
            if self._graph_tiles is not None:
                tokens, reqs = meta.out_cache_loc.shape[0], meta.batch_size
                self._tiles = self._graph_tiles[:2 * extend_tiles_bound(tokens, reqs, self._block_m)]
                if self._graph_decode_split(reqs):
                    self._graph_decode_lens = self._graph_decode[:reqs]
            return
        tiles = extend_tile_list(meta.prefix_lens_cpu, meta.extend_lens_cpu, self._block_m, self._n_dec)
        self._tiles = self._upload(torch.from_numpy(tiles), meta.req_pool_indices.device)

    @staticmethod
    def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host

    def _first_row(self, meta: AttentionMetadata) -> int:
        """The first request of a step the extend kernel computes (the others are decode rows for the decode
        kernel; see forward)."""
        return leading_decode_rows(meta) if current_options().mixed_decode_split else 0

    def _graph_decode_split(self, reqs: int) -> bool:
        """Whether a prefill graph of `reqs` requests sends its leading decode rows through the decode kernel: the
        split is on and the launch needs no workspace, or the decode graphs' fixed one holds it (an eager
        workspace may be reallocated under a captured graph)."""
        as_bs = self._as_batch_size(reqs)
        return (current_options().mixed_decode_split and self._graph_decode is not None
                and (self.num_splits_for(as_bs) <= 1 or as_bs <= self._graph_ws_bs))

    def init_prefill_graph_state(self, max_tokens: int, max_reqs: int) -> None:
        """The fixed inputs every prefill graph reads, refilled before each replay by load_graph_step: the extend
        tile list (each graph its first extend_tiles_bound(shape) tiles) and each request's length for the decode
        kernel (a decode row's seq_len, 0 for the rest: the decode launch skips them). Kept once allocated when
        large enough: captured graphs point at them (a second runner of the same buckets, such as an uncaptured
        twin, shares them)."""
        if not current_options().extend_tiles:
            return
        need = 2 * extend_tiles_bound(max_tokens, max_reqs, self._block_m)
        device = self.req_to_token.device
        if self._graph_tiles is None or self._graph_tiles.numel() < need:
            self._graph_tiles = torch.zeros(need, dtype=torch.int32, device=device)
        if self._graph_decode is None or self._graph_decode.numel() < max_reqs:
            self._graph_decode = torch.zeros(max_reqs, dtype=torch.int32, device=device)

    def load_graph_step(self, meta: AttentionMetadata, shape: tuple[int, int]) -> None:
        """Before a prefill graph's replay, from the step's host lengths (padded to the graph's shape): its tile
        list, padded to the graph's bound, and its decode rows' lengths, into the fixed inputs."""
        if self._graph_tiles is None:
            return
        tokens, reqs = shape
        n_dec = self._first_row(meta) if self._graph_decode_split(reqs) else 0
        bound = extend_tiles_bound(tokens, reqs, self._block_m)
        tiles = extend_tile_list(meta.prefix_lens_cpu, meta.extend_lens_cpu, self._block_m, n_dec, pad_to=bound)
        decode_lens = np.zeros(reqs, dtype=np.int32)
        decode_lens[:n_dec] = meta.seq_lens_cpu[:n_dec]
        device = self._graph_tiles.device
        self._graph_tiles[:2 * bound].copy_(self._upload(torch.from_numpy(tiles), device), non_blocking=True)
        self._graph_decode[:reqs].copy_(self._upload(torch.from_numpy(decode_lens), device), non_blocking=True)

    def defer_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   q_norm: nn.Module | None, k_norm: nn.Module | None) -> bool:
        """Whether the next `forward` applies this rotation itself (attention/fused_rope.py, the kernel option
        decode_fused_rope): in a decode step whose K/V store is fused, for a whole-head rotary, it keeps what the
        decode kernel needs and says yes; q and k then reach `forward` unrotated."""
        if not (self.meta.is_decode and self._fuse_store(k)):  # v is not here: forward checks it again
            return False
        rope = DecodeRope(positions, cos_sin, None if q_norm is None else q_norm.weight,
                          None if k_norm is None else k_norm.weight, 0.0 if q_norm is None else q_norm.eps)
        if not rope.fits(q):
            return False
        self._rope = rope
        return True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        meta = self.meta
        rope, self._rope = self._rope, None  # a rotation defer_rope took on for this call: q and k are unrotated
        fuse_store = meta.is_decode and self._fuse_store(k, v)
        if rope is not None and not fuse_store:  # (v's layout ruled the fused store out) rotate here after all
            q, k = rope.apply(q, k)
            rope = None
        if not fuse_store:
            self.store_kv(k, v, layer_id)
        k_buf, v_buf = self.kv_cache.k_buffers[layer_id], self.kv_cache.v_buffers[layer_id]
        out = torch.empty_like(q)
        if meta.is_decode:
            bs = q.shape[0]
            # fused: the stage-1 kernel stores row b's k/v at out_cache_loc[b] before reading keys (a decode
            # step has one new token per row, so out_cache_loc is per row)
            decode_attention(q, k_buf, v_buf, self.req_to_token, meta.req_pool_indices, meta.seq_lens, out,
                             self.scale, max_seq_len=self.max_context_len,
                             workspace=self._workspace(bs, q.device), num_splits=self.num_splits_for(bs),
                             new_kv=(k, v, meta.out_cache_loc) if fuse_store else None, rope=rope,
                             next_kv=self._next_kv(layer_id))
        elif self._planned is meta and self._graph_decode_lens is not None:
            # a prefill graph: every request row through the decode kernel, with the lengths load_graph_step wrote
            # (a decode row's seq_len, else 0: skipped, its output row zeroed), before the extend kernel, which
            # then writes the prefill requests' rows from its tile list (which leaves the decode rows out)
            reqs = meta.batch_size
            self._mixed_decode_rows(reqs, q, k, v, k_buf, v_buf, out, seq_lens=self._graph_decode_lens)
            extend_attention(q, k_buf, v_buf, self.req_to_token, meta.req_pool_indices, meta.prefix_lens,
                             meta.extend_lens, meta.extend_start, out, self.scale, meta.max_extend_len,
                             tiles=self._tiles)
        else:
            # prepare's plan for this step; metadata set without prepare (e.g. restored directly) has none
            planned = self._planned is meta
            n_dec = self._n_dec if planned else self._first_row(meta)
            if n_dec:
                self._mixed_decode_rows(n_dec, q, k, v, k_buf, v_buf, out)
            # the requests from n_dec on; extend_start holds absolute token offsets, so only their rows are written
            extend_attention(q, k_buf, v_buf, self.req_to_token, meta.req_pool_indices, meta.prefix_lens,
                             meta.extend_lens, meta.extend_start, out, self.scale, meta.max_extend_len,
                             first_row=n_dec, tiles=self._tiles if planned else None)
        return out

    @staticmethod
    def _as_batch_size(n: int) -> int:
        return 1 << (n - 1).bit_length()

    def _mixed_decode_rows(self, n: int, q, k, v, k_buf, v_buf, out, seq_lens: torch.Tensor | None = None) -> None:
        """Rows 0..n-1 of a mixed step (tokens 0..n-1, one each) through the decode kernel, launched as a decode
        step of the next power-of-2 batch size launches it: the same split count and the same K/V store choice, so
        it runs a kernel variant the decode graphs compiled (the split count is a compile-time constant; an exact
        count for every n would compile new variants in the middle of serving). Their K/V were stored with the
        rest of the step; the fused store writes the same values to the same slots again. `seq_lens` (default:
        the step's) as a prefill graph gives them: rows of length 0 are skipped."""
        meta = self.meta
        as_bs = self._as_batch_size(n)
        fuse = self._fuse_store(k, v)
        seq_lens = meta.seq_lens[:n] if seq_lens is None else seq_lens
        decode_attention(q[:n], k_buf, v_buf, self.req_to_token, meta.req_pool_indices[:n], seq_lens,
                         out[:n], self.scale, max_seq_len=self.max_context_len,
                         workspace=self._workspace(as_bs, q.device), num_splits=self.num_splits_for(as_bs),
                         new_kv=(k[:n], v[:n], meta.out_cache_loc[:n]) if fuse else None)

    # --- CUDA Graph (decode) ---

    def init_cuda_graph_state(self, max_bs: int) -> None:
        # Splits shrink as the batch grows, so the largest partials may belong to a mid-sized batch.
        if max_bs <= self._graph_ws_bs:
            return
        need = self._workspace_numel(max_bs)
        if need:  # zeros: the merge counters must start at zero (each launch leaves them so)
            self._graph_workspace = torch.zeros(need, dtype=torch.float32, device=self.req_to_token.device)
        self._graph_ws_bs = max_bs

    def prepare_for_capture(self, meta: AttentionMetadata) -> None:
        if self.num_splits_for(meta.batch_size) > 1 and meta.batch_size > self._graph_ws_bs:
            # An eager workspace may be reallocated later, which would leave the graph reading freed memory.
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing this batch size")
        self.meta = meta
        self._rope = None

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        # The kernels read seq_lens / req_pool_indices from meta's fixed buffers on the device: nothing to do.
        self.meta = meta
