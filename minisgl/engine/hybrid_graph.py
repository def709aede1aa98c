"""Decode CUDA graphs of a hybrid model (Qwen3.5): the graph runner of notebook 06 plus each row's state slot.

A Gated DeltaNet layer reads and updates its request's state in the state pool (kvcache/state_pool.py) at
`meta.state_slots`, over sequences `meta.cu_seqlens`. In a decode step both have fixed shapes (B slots, 0..B),
so they become two more static inputs: the slots are refreshed before each replay, padded rows point at the
pool's dummy slot (their state updates land there, as their K/V land in page 0), and cu_seqlens never changes.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from minisgl.engine.cuda_graph import CudaGraphRunner, default_batch_sizes
from minisgl.engine.sampler import SamplingTensors
from minisgl.kvcache.state_pool import HybridAttentionMetadata


class HybridCudaGraphRunner(CudaGraphRunner):
    def __init__(self, runner, max_bs: int, batch_sizes: list[int] | None = None) -> None:
        n = (batch_sizes or default_batch_sizes(max_bs))[-1]
        self.dummy_slot = runner.state_pool.dummy_slot
        # before the base class captures: its _meta (below) hands these to the graphs
        self.state_slots = torch.full((n,), self.dummy_slot, dtype=torch.int64, device=runner.device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=runner.device)
        super().__init__(runner, max_bs, batch_sizes)

    def _meta(self, bs: int) -> HybridAttentionMetadata:
        base = super()._meta(bs)
        return HybridAttentionMetadata(**{f.name: getattr(base, f.name) for f in fields(base)},
                                       state_slots=self.state_slots[:bs], cu_seqlens=self.cu_seqlens[:bs + 1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: HybridAttentionMetadata,
            sampling: SamplingTensors, token_dst: torch.Tensor | None = None) -> torch.Tensor:
        n = meta.batch_size
        self.state_slots[:n].copy_(meta.state_slots)
        self.state_slots[n:].fill_(self.dummy_slot)  # padded rows: their state updates go to the dummy slot
        return super().run(input_ids, positions, meta, sampling, token_dst)
