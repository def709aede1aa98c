"""Attention backends over the paged KV pool. Only the torch one is imported eagerly: the GPU ones pull in
Triton or FlashInfer, which a CPU machine may not have."""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend, AttentionMetadata
from minisgl.attention.torch_backend import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "create_backend"]


def create_backend(name: str, **kwargs) -> AttentionBackend:
    if name == "torch":
        return TorchAttentionBackend(**{k: v for k, v in kwargs.items() if k != "max_context_len"})
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    if name == "flashinfer":
        from minisgl.attention.flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r} (torch, triton, flashinfer)")
