"""Attention backends over the paged KV pool. Only the torch one is imported eagerly: the GPU ones pull in
Triton or FlashInfer, which a CPU machine may not have."""

from __future__ import annotations

from minisgl.attention.base import AttentionBackend, AttentionMetadata
from minisgl.attention.torch_backend import PaddedDecodeTorchBackend, TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "PaddedDecodeTorchBackend", "TorchAttentionBackend",
           "create_backend"]


def create_backend(name: str, **kwargs) -> AttentionBackend:
    torch_kwargs = {k: v for k, v in kwargs.items() if k != "max_context_len"}
    if name == "torch":  # the reference loop, with decode steps as a few padded ops
        return PaddedDecodeTorchBackend(**torch_kwargs)
    if name == "torch_loop":  # the reference loop for every step (notebook 03's exercise)
        return TorchAttentionBackend(**torch_kwargs)
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(**kwargs)
    if name == "flashinfer":
        from minisgl.attention.flashinfer_backend import FlashInferAttentionBackend
        return FlashInferAttentionBackend(**kwargs)
    raise ValueError(f"unknown attention backend {name!r} (torch, torch_loop, triton, flashinfer)")
