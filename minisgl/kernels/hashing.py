"""The counter-based hash behind seeded sampling: noise that is a pure function of (seed, step, token id).

Plain torch on int64 lanes that hold 32-bit values, so it runs on any device. The sampler
(minisgl/engine/sampler.py, generated from notebook 05) and the fused Triton kernel (minisgl/kernels/sampling.py,
which repeats `mix32` in Triton) both build their noise from these functions, so the two draw the same tokens.
This module sits below both: the kernels never import a module a student writes.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply); int64 lanes hold the 32-bit values."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_hash(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (request seed, index of the token being drawn); int64 `[B]`."""
    return mix32(mix32(seeds.long() * 0x9E3779B1 + steps.long()) + 0x632BE5AB)


def token_bits(row: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (row key, token id): `[B, V]` from row keys `[B]` and token ids `[V]`."""
    return mix32(row[:, None] ^ (token_ids[None, :] * 0x85EBCA77))
