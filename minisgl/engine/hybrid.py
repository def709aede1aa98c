"""The runtime of a hybrid model (Qwen3.5): per-request linear-attention state beside the KV pool.

A Gated DeltaNet layer keeps a fixed-size state per request (kvcache/state_pool.py, notebook 10) instead of KV per
token; its request's state lives in the slot of its request-table row. What the engine does for it, through the
hooks of `ModelRuntime` (engine/runtime.py):

- memory: the state pool is allocated before the KV pool is sized (rows and snapshots), the KV pool holds the
  full-attention layers only; sized automatically, the snapshots are counted first (from the free memory) and
  the rows, each costing its state slot too, may take half of the rest (engine/sizing.py);
- each step: the state slots of its requests (slot = row) and its sequence bounds `cu_seqlens` travel with the
  step's inputs into `HybridAttentionMetadata`; requests admitted this step start from zeros or a prefix
  snapshot before the forward, and snapshots are saved after it (the scheduler says which: `HybridBatch`);
- CUDA graphs: the slots and bounds are two more fixed buffers (`StateGraphInputs`). A decode graph's padded rows
  point at the pool's dummy slot (their state updates land there, as their K/V land in page 0) and its bounds are
  0..B, fixed. A prefill graph's are padded on the host (`pad_state_step`): padded requests point at the dummy
  slot and are empty sequences placed after the real tokens (cu_seqlens ends at the real token count), so padded
  tokens belong to no sequence and the GDN kernels leave every real state alone. A shape with as many tokens as
  requests is not captured: the GDN ops take T == N as a decode step (one token per sequence);
- scheduling: the snapshot-aware radix cache and scheduler (scheduler/hybrid.py).

Tensor parallelism does not run hybrid models yet.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from minisgl.attention import AttentionMetadata
from minisgl.config import EngineConfig
from minisgl.engine.cuda_graph import CudaGraphRunner, default_batch_sizes
from minisgl.engine.prefill_graph import pad_array
from minisgl.engine.runtime import GraphInputs, ModelRuntime
from minisgl.engine.sampler import SamplingTensors
from minisgl.engine.sizing import HYBRID_ROW_MEMORY_SHARE
from minisgl.engine.staged_graph import StagedCudaGraphRunner
from minisgl.kvcache import PageAllocator, PrefixCache, ReqToTokenPool
from minisgl.kvcache.state_pool import HybridAttentionMetadata, StatePool
from minisgl.scheduler import Batch
from minisgl.scheduler.hybrid import HybridScheduler, make_hybrid_scheduler


def pad_state_step(shape: tuple[int, int], state_slots: np.ndarray, cu_seqlens: np.ndarray, dummy_slot: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """A hybrid step's state slots [requests] and sequence bounds [requests + 1], padded to a prefill graph's
    `shape` (tokens, requests): padded requests on `dummy_slot`, empty, at the end of the real tokens (the padded
    tokens past it belong to none)."""
    _, reqs = shape
    if len(state_slots) > reqs or len(cu_seqlens) != len(state_slots) + 1:
        raise ValueError(f"{len(state_slots)} state slots / {len(cu_seqlens)} bounds do not fit {shape}")
    return pad_array(state_slots, reqs, dummy_slot), pad_array(cu_seqlens, reqs + 1, int(cu_seqlens[-1]))


class StateGraphInputs(GraphInputs):
    """The fixed state slots [n] and sequence bounds [n + 1] a graph reads (see the module docstring)."""

    def __init__(self, rows: int, dummy_slot: int, device: torch.device, decode: bool) -> None:
        self.dummy_slot, self.decode = dummy_slot, decode
        self.state_slots = torch.full((rows,), dummy_slot, dtype=torch.int64, device=device)
        # decode: one token per row, so bounds 0..B never change; extend: refreshed from each step
        self.cu_seqlens = (torch.arange(rows + 1, dtype=torch.int32, device=device) if decode
                           else torch.zeros(rows + 1, dtype=torch.int32, device=device))

    def metadata(self, meta: AttentionMetadata, rows: int) -> HybridAttentionMetadata:
        return HybridAttentionMetadata(**{f.name: getattr(meta, f.name) for f in fields(meta)},
                                       state_slots=self.state_slots[:rows], cu_seqlens=self.cu_seqlens[:rows + 1])

    def load(self, meta: HybridAttentionMetadata, rows: int) -> None:
        if self.decode:  # the step's rows, then padded rows on the dummy slot
            n = meta.batch_size
            self.state_slots[:n].copy_(meta.state_slots)
            self.state_slots[n:].fill_(self.dummy_slot)
            return
        # a prefill graph's step was padded by ModelRunner.prepare (pad_state_step): dummy slot, empty sequences
        if meta.state_slots.shape[0] != rows or meta.cu_seqlens.shape[0] != rows + 1:
            raise ValueError(f"state slots / cu_seqlens are not padded to {rows} requests")
        self.state_slots[:rows].copy_(meta.state_slots)
        self.cu_seqlens[:rows + 1].copy_(meta.cu_seqlens)


class StateCudaGraphRunner(CudaGraphRunner):
    """The decode graphs of notebook 06 plus the extra fixed inputs of a runtime (`GraphInputs`)."""

    def __init__(self, runner, max_bs: int, inputs: GraphInputs, batch_sizes: list[int] | None = None) -> None:
        self.inputs = inputs  # before the base class captures: its _meta (below) hands them to the graphs
        super().__init__(runner, max_bs, batch_sizes)

    def _meta(self, bs: int) -> AttentionMetadata:
        return self.inputs.metadata(super()._meta(bs), bs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sampling: SamplingTensors, token_dst: torch.Tensor | None = None) -> torch.Tensor:
        self.inputs.load(meta, meta.batch_size)
        return super().run(input_ids, positions, meta, sampling, token_dst)


class StagedStateCudaGraphRunner(StateCudaGraphRunner, StagedCudaGraphRunner):
    """The hybrid's decode graphs with their inputs staged in one copy (engine switch graph_staged_inputs): the
    state slots are a row of the block too (a request's slot is its row, padded rows on the dummy slot)."""

    def _stage_buffers(self) -> None:
        super()._stage_buffers()
        slots = self._row(self.block, "state_slots")
        slots.fill_(self.inputs.dummy_slot)
        self.inputs.state_slots = slots

    def _stage_extra(self, host: dict, arrays, n: int, bs: int) -> None:
        host["state_slots"][:n] = arrays.rows
        host["state_slots"][n:bs] = self.inputs.dummy_slot


class LinearStateRuntime(ModelRuntime):
    name = "linear_state"
    metadata_cls = HybridAttentionMetadata
    row_memory_share = HYBRID_ROW_MEMORY_SHARE  # a hybrid's state is its "KV": engine/sizing.py
    supports_tensor_parallel = False
    tokens_may_equal_requests = False

    def __init__(self, model_config) -> None:
        super().__init__(model_config)
        mc = model_config
        # (layers, conv channels, conv kernel, value heads, key dim, value dim): the StatePool's shape
        self.shape = (len(mc.linear_attention_layers), mc.conv_channels, mc.linear_conv_kernel,
                      mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim)
        self.state_pool: StatePool | None = None
        self._num_snapshots: int | None = None  # counted once: before the rows are sized, then allocated

    @property
    def kv_layers(self) -> int:
        return len(self.model_config.full_attention_layers)

    def slot_bytes(self, dtype: torch.dtype) -> int:
        return StatePool.bytes_per_slot(*self.shape, dtype)

    @staticmethod
    def snapshots_follow_rows(config: EngineConfig, device: torch.device) -> bool:
        """On a CPU, without an explicit count, there is a snapshot per running request (num_snapshots_for)."""
        return config.state_snapshots is None and device.type != "cuda"

    def num_snapshots(self, config: EngineConfig, dtype: torch.dtype, device: torch.device, rows: int) -> int:
        """The snapshot slots (StatePool.num_snapshots_for), counted once: the rows are sized with the memory
        they take left aside (`reserved_state_bytes`), and `allocate` allocates that many."""
        if self._num_snapshots is None:
            self._num_snapshots = StatePool.num_snapshots_for(
                config.state_snapshots, config.state_snapshot_memory_fraction, self.slot_bytes(dtype), device,
                fallback=rows)
        return self._num_snapshots

    def row_state_bytes(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
        # its own state slot, and its snapshot where the snapshots follow the rows
        return self.slot_bytes(dtype), 2 if self.snapshots_follow_rows(config, device) else 1

    def reserved_state_bytes(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
        # the snapshots, counted from the free memory (or given) before the rows take their share
        if self.snapshots_follow_rows(config, device):
            return 0
        return self.num_snapshots(config, dtype, device, rows=0) * self.slot_bytes(dtype)

    def allocate(self, runner, config: EngineConfig) -> None:
        snapshots = self.num_snapshots(config, runner.dtype, runner.device, rows=config.max_running_requests)
        self.state_pool = StatePool(self.shape[0], runner.max_reqs, snapshots, *self.shape[1:], runner.dtype,
                                    runner.device)
        runner.model.state_pool = self.state_pool

    def step_arrays(self, rows: np.ndarray, start: np.ndarray, num_tokens: int,
                    pad_to: tuple[int, int] | None) -> list[np.ndarray]:
        state_slots, cu_seqlens = rows, np.append(start, num_tokens)  # slot = row
        if pad_to is not None:  # padded requests: the dummy slot, empty
            state_slots, cu_seqlens = pad_state_step(pad_to, state_slots, cu_seqlens, self.state_pool.dummy_slot)
        return [state_slots, cu_seqlens.astype(np.int32)]  # the bounds as the kernels read them: no conversion

    def attach(self, meta: HybridAttentionMetadata, arrays: list[torch.Tensor]) -> None:
        meta.state_slots, meta.cu_seqlens = arrays

    def before_step(self, batch: Batch) -> None:
        self.state_pool.start(batch.state_inits)  # admitted requests start from zeros or a prefix snapshot

    def after_step(self, batch: Batch) -> None:
        self.state_pool.save(batch.state_saves)  # snapshots of the state after this step's layers

    def decode_graphs(self, runner, max_bs: int) -> StateCudaGraphRunner:
        rows = default_batch_sizes(max_bs)[-1]
        cls = StagedStateCudaGraphRunner if runner.config.graph_staged_inputs else StateCudaGraphRunner
        return cls(runner, max_bs, self.graph_inputs(rows, runner.device, decode=True))

    def graph_inputs(self, rows: int, device: torch.device, decode: bool) -> StateGraphInputs:
        return StateGraphInputs(rows, self.state_pool.dummy_slot, device, decode)

    def make_scheduler(self, config: EngineConfig, allocator: PageAllocator,
                       req_pool: ReqToTokenPool) -> tuple[PrefixCache, HybridScheduler]:
        return make_hybrid_scheduler(config, allocator, req_pool, self.state_pool)
