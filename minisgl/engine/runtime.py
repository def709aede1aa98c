"""What the engine does for a model beyond its KV cache: one small interface, one implementation per need.

A model family declares the runtime it needs by name (models/registry.py, `ModelFamily.runtime`); the model runner
makes it (`make_runtime`, engine/runtimes.py) and calls its hooks at fixed points, whatever the model:

- sizing and memory: the layers that keep KV, the bytes of per-request state a request row costs, the memory
  sized before the rows (a hybrid's snapshots), the cap on running requests and the rows' share of the memory
  (engine/sizing.py), and `allocate` (before the KV pool is sized, so the memory it measures excludes the state);
- each step: extra int64 host arrays uploaded with the step's other inputs (`step_arrays`), the attention
  metadata class and the fields they fill (`metadata_cls`, `attach`), and work around the forward
  (`before_step`, `after_step`);
- CUDA graphs: the decode graph runner (`decode_graphs`) and the fixed buffers of the extra inputs a prefill graph
  reads (`graph_inputs`), and whether an extend step may have as many tokens as requests;
- scheduling: the prefix cache and scheduler the engine runs it with (`make_scheduler`).

This base class is a model whose only per-request memory is its KV cache (Llama-3, Qwen2, Qwen3): every hook
does nothing beyond the default, so the runner, the graph runners and the engine carry no per-model branches.
Qwen3.5's linear-attention state is engine/hybrid.py.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.attention import AttentionMetadata
from minisgl.config import EngineConfig
from minisgl.engine.cuda_graph import CudaGraphRunner
from minisgl.engine.sizing import MAX_ROWS, ROW_MEMORY_SHARE
from minisgl.engine.staged_graph import StagedCudaGraphRunner
from minisgl.kvcache import NaiveCache, PageAllocator, PrefixCache, RadixCache, ReqToTokenPool
from minisgl.scheduler import Batch, Scheduler


class GraphInputs:
    """The fixed buffers of a graph's extra inputs (none here): the metadata of a captured shape points at views
    of them (`metadata`), and a replay refreshes them from the step's metadata first (`load`)."""

    def metadata(self, meta: AttentionMetadata, rows: int) -> AttentionMetadata:
        return meta

    def load(self, meta: AttentionMetadata, rows: int) -> None:
        pass


class ModelRuntime:
    name = "kv"
    metadata_cls = AttentionMetadata
    max_rows = MAX_ROWS  # running requests at most when sized automatically (engine/sizing.py)
    row_memory_share = ROW_MEMORY_SHARE  # the rows' share of the device memory for the pools, at most
    supports_tensor_parallel = True
    # an extend step of as many tokens as requests may run as such (a linear-attention layer would take it for a
    # decode step: engine/hybrid.py)
    tokens_may_equal_requests = True
    state_pool = None  # per-request state beyond the KV cache: none

    def __init__(self, model_config) -> None:
        self.model_config = model_config

    # --- sizing and memory ---------------------------------------------------------------------------------
    @property
    def kv_layers(self) -> int:
        return self.model_config.num_layers

    def row_state_bytes(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
        """(bytes of one state slot, slots per request row) for sizing the rows: none."""
        return 0, 0

    def reserved_state_bytes(self, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
        """Bytes of state sized apart from the rows and before them, which the rows' memory share leaves aside
        (called before `allocate`, when the rows are sized from memory): none."""
        return 0

    def allocate(self, runner, config: EngineConfig) -> None:
        """Allocate the per-request state for `runner.max_reqs` rows (called before the KV pool is sized)."""

    # --- each step -----------------------------------------------------------------------------------------
    def step_arrays(self, rows: np.ndarray, start: np.ndarray, num_tokens: int,
                    pad_to: tuple[int, int] | None) -> list[np.ndarray]:
        """Extra int64 or int32 arrays of a step (its request rows, each request's first token, the token count),
        padded to a prefill graph's shape when given; they travel to the device with the step's other inputs, in
        their own dtypes."""
        return []

    def attach(self, meta: AttentionMetadata, arrays: list[torch.Tensor]) -> None:
        """Put the step's extra arrays, on the device now, into its metadata (a `metadata_cls`)."""

    def before_step(self, batch: Batch) -> None:
        pass

    def after_step(self, batch: Batch) -> None:
        pass

    # --- CUDA graphs ---------------------------------------------------------------------------------------
    def decode_graphs(self, runner, max_bs: int) -> CudaGraphRunner:
        if runner.config.graph_staged_inputs:  # the inputs in one copy (engine/staged_graph.py)
            return StagedCudaGraphRunner(runner, max_bs)
        return CudaGraphRunner(runner, max_bs)

    def graph_inputs(self, rows: int, device: torch.device, decode: bool) -> GraphInputs:
        return GraphInputs()

    # --- scheduling ----------------------------------------------------------------------------------------
    def make_scheduler(self, config: EngineConfig, allocator: PageAllocator,
                       req_pool: ReqToTokenPool) -> tuple[PrefixCache, Scheduler]:
        cache = (RadixCache if config.radix_cache else NaiveCache)(allocator, config.page_size)
        scheduler = Scheduler(allocator, req_pool, cache, config.page_size, config.max_running_requests,
                              config.prefill_budget, chunked=config.chunked_prefill,
                              mixed_chunk_size=config.mixed_prefill_tokens)
        return cache, scheduler
