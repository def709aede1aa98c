"""The FlashInfer backend: FlashInfer's paged decode and prefill kernels over the pool's pages.

FlashInfer reads KV as pages `[num_pages, page_size, Hkv, D]` (layout "NHD"), which is exactly what
`kv_cache.buffer[0 | 1, layer]` holds, and describes each request by a CSR page table: `kv_indptr[B+1]`,
`kv_indices` (page ids) and `kv_last_page_len[B]`. The page ids come from `req_to_token`, which relies on the
pool's invariant that token `pos` of a request sits at offset `pos % page_size` of its page.

`plan()` runs once per step in `prepare` (it copies the indptr arrays to the host and builds FlashInfer's
schedule); `run()` runs per layer. The host indptr arrays are built from the metadata's host copies
(`seq_lens_cpu`, `extend_lens_cpu`), and the page ids with device ops, so a step costs no device-to-host sync
when those copies are present.
"""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend, AttentionMetadata

# FlashInfer's split-k scratch (it suggests 128 MB; long contexts want more)
_WORKSPACE_BYTES = 256 * 1024 * 1024


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, kv_cache, req_to_token: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float, max_context_len: int | None = None) -> None:
        super().__init__(kv_cache, req_to_token, num_q_heads, num_kv_heads, head_dim, scale)
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(
                "the 'flashinfer' attention backend needs FlashInfer on a CUDA machine "
                "(pip install flashinfer-python); use the 'triton' or 'torch' backend otherwise") from e
        self._fi = flashinfer
        self.device = req_to_token.device
        self.page_size = kv_cache.page_size
        self.max_context_len = int(max_context_len or req_to_token.shape[1])
        self.dtype = kv_cache.dtype  # q is expected in the model dtype, which is the cache dtype
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # Tensor-core decode pays off once several q heads share a kv head; CUDA-core decode is best below.
        self.decode_use_tensor_cores = num_q_heads // num_kv_heads >= 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_use_tensor_cores)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._active = None  # the wrapper planned for the current step
        self._planned: torch.cuda.Event | None = None  # recorded after the last plan's host-to-device copies
        self._graph_wrappers: dict[int, object] = {}
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None

    # --- page table ---

    def _page_table(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kv_indptr on the host, kv_indices on the device, kv_last_page_len on the host), all int32."""
        ps = self.page_size
        seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
        # A padded CUDA-graph row may carry seq_len 0; FlashInfer wants >= 1 entry, so it reads one dummy key.
        seq_lens = [max(int(s), 1) for s in seq_lens]
        num_pages = [(s + ps - 1) // ps for s in seq_lens]
        bs = len(seq_lens)
        indptr = torch.zeros(bs + 1, dtype=torch.int32)
        indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
        last_page_len = torch.tensor([s - (n - 1) * ps for s, n in zip(seq_lens, num_pages)],
                                     dtype=torch.int32)
        total = int(indptr[-1])

        # Page ids on the device: entry e belongs to request req[e], page number e - indptr[req[e]] of it.
        host = torch.stack([torch.tensor(num_pages, dtype=torch.int64), indptr[:-1].to(torch.int64)])
        counts, starts = host.to(self.device, non_blocking=True).unbind(0)
        req = torch.repeat_interleave(torch.arange(bs, device=self.device), counts, output_size=total)
        page_no = torch.arange(total, device=self.device) - starts[req]
        rows = meta.req_pool_indices.to(torch.int64)[req]
        indices = torch.div(self.req_to_token[rows, page_no * ps], ps, rounding_mode="floor").to(torch.int32)
        return indptr, indices, last_page_len

    def _plan(self, wrapper, *args, **kwargs) -> None:
        # plan() fills a pinned host buffer and queues its copy to the device. Under the overlap loop the
        # previous step's copy may still be queued behind the running step: wait for it before refilling.
        if self._planned is not None:
            self._planned.synchronize()
        wrapper.plan(*args, **kwargs)
        self._planned = torch.cuda.Event()
        self._planned.record()

    def _plan_decode(self, wrapper, meta: AttentionMetadata) -> None:
        indptr, indices, last_page_len = self._page_table(meta)
        self._plan(wrapper, indptr, indices, last_page_len, self.num_q_heads, self.num_kv_heads, self.head_dim,
                   self.page_size, q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale)

    def prepare(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        if meta.is_decode:
            self._plan_decode(self.decode_wrapper, meta)
            self._active = self.decode_wrapper
            return
        indptr, indices, last_page_len = self._page_table(meta)
        # FlashInfer takes the new tokens packed by request in batch order, i.e. extend_start must be the
        # exclusive prefix sum of extend_lens (how the model runner lays the batch out).
        ext = meta.extend_lens_cpu if meta.extend_lens_cpu is not None else meta.extend_lens.tolist()
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.tensor(ext, dtype=torch.int32).cumsum(0)
        self._plan(self.prefill_wrapper, qo_indptr, indptr, indices, last_page_len, self.num_q_heads,
                   self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                   sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        self._active = self.prefill_wrapper

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.store_kv(k, v, layer_id)
        kv = (self.kv_cache.buffer[0, layer_id], self.kv_cache.buffer[1, layer_id])
        q = q.contiguous()  # a no-op for Qwen3 (q comes out of q_norm); Llama's q is a view into the qkv output
        out = torch.empty_like(q)
        self._active.run(q, kv, out=out)
        return out

    # --- CUDA Graph (decode) ---
    # One FlashInfer wrapper per captured batch size, all sharing fixed indptr / indices / last_page_len
    # buffers; plan() (host work, never captured) refills them before capture and before every replay.

    def init_cuda_graph_state(self, max_bs: int) -> None:
        max_pages = (self.max_context_len + self.page_size - 1) // self.page_size
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)

    def prepare_for_capture(self, meta: AttentionMetadata) -> None:
        if self._graph_indices is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing")
        bs = meta.batch_size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_use_tensor_cores,
                paged_kv_indptr_buffer=self._graph_indptr[: bs + 1],
                paged_kv_indices_buffer=self._graph_indices,
                paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs])
            self._graph_wrappers[bs] = wrapper
        self.meta = meta
        self._plan_decode(wrapper, meta)
        self._active = wrapper

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        wrapper = self._graph_wrappers[meta.batch_size]
        self.meta = meta
        self._plan_decode(wrapper, meta)
        self._active = wrapper
