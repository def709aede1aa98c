"""Elementwise ops of the decoder (torch reference; Triton versions are added for the GPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(q, k, positions, cos_sin):
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half].to(q.dtype), cs[:, None, half:].to(q.dtype)

    def rot(x):
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    q.copy_(rot(q))
    k.copy_(rot(k))
    return q, k
