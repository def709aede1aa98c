"""Engine settings. Every optimisation is a named switch, so an ablation is a flag, not an edit."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # weights and numerics
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 ; auto = bf16 on GPU, fp32 on CPU
    device: str = "auto"  # auto | cpu | cuda
    load_format: str = "auto"  # auto (safetensors) | dummy
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # KV cache
    page_size: int = 1
    num_pages: int | None = None  # default: sized from kv_memory_fraction (GPU) or kv_cache_tokens (CPU)
    kv_memory_fraction: float = 0.85  # share of free GPU memory after weights given to the KV pool
    kv_cache_tokens: int = 16384  # KV pool size on a CPU, in tokens
    # scheduler
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # token budget per step; <= 0 disables chunking
    # the four switches of the ablation table
    radix_cache: bool = True
    chunked_prefill: bool = True
    overlap: bool = True
    cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    attention_backend: str = "auto"  # auto | torch | triton | flashinfer
    tp_size: int = 1  # tensor parallelism: one process (and GPU) per rank; must divide the query heads
    progress: bool = False

    def with_(self, **kw) -> EngineConfig:
        return replace(self, **kw)

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.attention_backend not in ("auto", "torch", "triton", "flashinfer"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
