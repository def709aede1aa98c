"""The fused RoPE (kernel option `decode_fused_rope`): a decode step rotates q and k inside the attention kernel.

In a batch-1 decode step every launch is a link in a chain of ~260 short kernels, and each link costs its own
latency whatever work it does. The RoPE kernel (with Qwen3's per-head q/k norms, kernels/elementwise.py) is one
such link a layer, between the QKV projection and the decode attention kernel. Every decode attention program
already loads its q heads and, for the program that owns the new position, the new key it stores (the fused
store): it can normalise and rotate them as it loads them, with the very operations the RoPE kernel runs
(`norm_rope_halves`), so the link goes and the tokens stay the same.

`FusedRopeAttention` replaces the model's `Attention` (models/decoder.py): the same projections under the same
names, but it hands q and k to the backend's `forward_rope` unrotated, with what the rotation needs. The Triton
backend fuses the rotation into a decode step's kernel and rotates first, as the model would, in any other step
(a prefill, a mixed step; attention/triton_backend.py). The engine swaps the modules in (`use_fused_rope`) only
with the option on and the Triton backend; a model with another attention class (Qwen3.5's gated one, partial
rotary) keeps its own.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.models.decoder import Attention


class FusedRopeAttention(nn.Module):
    """A decoder `Attention` whose q and k reach the backend unrotated (`forward_rope`). Holds the same submodules
    under the same names."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.layer_id = attn.layer_id
        self.num_q_heads, self.num_kv_heads, self.head_dim = attn.num_q_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.qkv_proj, self.o_proj = attn.qkv_proj, attn.o_proj
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, attn) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_q_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = attn.forward_rope(q, k, v, self.layer_id, positions, rotary, self.q_norm, self.k_norm)
        return self.o_proj(o.reshape(t, self.q_size))


def use_fused_rope(model: nn.Module) -> int:
    """Swap every `Attention` under `model` for a FusedRopeAttention; returns how many."""
    swapped = 0
    for name, child in list(model.named_children()):
        if type(child) is Attention:
            setattr(model, name, FusedRopeAttention(child))
            swapped += 1
        else:
            swapped += use_fused_rope(child)
    return swapped
