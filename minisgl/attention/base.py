# generated from notebooks/03_attention.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/03_attention.ipynb, cell 2 (id c03-002) ---
"""The attention backend interface.

A backend owns how attention reads the paged KV pool. The model calls `forward(q, k, v, layer_id)` in every
layer; the engine calls `prepare(meta)` once per step before the layers run. CUDA Graph capture needs the
metadata in fixed buffers, hence the three `*cuda_graph*` hooks.

Layout conventions (all backends):
- the pool stores, per layer, K and V as `[num_slots, num_kv_heads, head_dim]`; slot = page * page_size + offset.
- `req_to_token[row, pos]` is the slot of token `pos` of the request that owns `row`.
- one step is a flat batch of T new tokens from B requests; request i owns tokens
  `extend_start[i] : extend_start[i] + extend_lens[i]` of the step, at positions
  `prefix_lens[i] : seq_lens[i]`. A decode step is the case `extend_lens == 1` for all requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


# --- notebooks/03_attention.ipynb, cell 5 (id c03-005) ---
@dataclass
class AttentionMetadata:
    """Device tensors describing one step, built by the model runner."""

    is_decode: bool  # every request extends by exactly one token
    req_pool_indices: torch.Tensor  # [B] int64: row of each request in req_to_token
    seq_lens: torch.Tensor  # [B] int32: tokens in KV after this step (prefix + extend)
    prefix_lens: torch.Tensor  # [B] int32: tokens already in KV before this step
    extend_lens: torch.Tensor  # [B] int32: new tokens this step
    extend_start: torch.Tensor  # [B] int32: offset of each request's first new token in the flat batch
    out_cache_loc: torch.Tensor  # [T] int64: slot each new token's K/V is written to
    max_seq_len: int  # host-side maxima, so kernels can size their grids without a device sync
    max_extend_len: int
    seq_lens_cpu: list[int] | None = None  # host copies, for backends that plan on the CPU
    prefix_lens_cpu: list[int] | None = None
    extend_lens_cpu: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return self.req_pool_indices.shape[0]


# --- notebooks/03_attention.ipynb, cell 6 (id c03-006) ---
class AttentionBackend(ABC):
    """Base class of every attention backend (torch reference, Triton, FlashInfer)."""

    name: str = "base"

    def __init__(self, kv_cache, req_to_token: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 head_dim: int, scale: float) -> None:
        self.kv_cache = kv_cache  # minisgl.kvcache.pool.KVCache
        self.req_to_token = req_to_token
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the layers run."""
        self.meta = meta

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> None:
        self.kv_cache.store(layer_id, self.meta.out_cache_loc, k, v)

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Stores k/v, returns [T, Hq, D]."""

    # --- CUDA Graph hooks (decode only). Backends that cannot be captured leave these as they are. ---
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate fixed metadata buffers for batch sizes up to max_bs."""
        raise NotImplementedError(f"{self.name} backend does not support CUDA Graph")

    def prepare_for_capture(self, meta: AttentionMetadata) -> None:
        """Point the backend at fixed buffers for one captured batch size (meta holds those buffers)."""
        raise NotImplementedError

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """Refresh fixed buffers in place before a replay (meta holds the fixed buffers, already filled)."""
        raise NotImplementedError
