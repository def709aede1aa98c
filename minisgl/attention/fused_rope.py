"""The fused RoPE (kernel option `decode_fused_rope`): a decode step rotates q and k inside the attention kernel.

In a batch-1 decode step every launch is a link in a chain of ~260 short kernels, and each link costs its own
latency whatever work it does. The RoPE kernel (with Qwen3's per-head q/k norms, kernels/elementwise.py) is one
such link a layer, between the QKV projection and the decode attention kernel. Every decode attention program
already loads its q heads and, for the program that owns the new position, the new key it stores (the fused
store): it can normalise and rotate them as it loads them, with the very operations the RoPE kernel runs
(`norm_rope_halves`), so the link goes and the tokens stay the same.

The model does not change. Its attention calls `rotary(q, k, positions, q_norm, k_norm)` and then the backend's
`forward(q, k, v, layer_id)` (models/decoder.py); the engine swaps the model's rotary embedding for a
`DeferredRotary`, which asks the backend first (`defer_rope`): in a step the backend can fuse (a decode step whose
K/V store is fused, a whole-head rotary) the backend keeps what the rotation needs and the next `forward` hands it
to the decode kernel, and q and k come back unrotated; in any other step (a prefill, a mixed step) the rotation
runs as before. A model that rotates without calling its rotary module (Qwen3.5's partial rotary reads the table
itself) is never deferred.
"""

from __future__ import annotations

import torch
from torch import nn


class DeferredRotary(nn.Module):
    """A rotary embedding (models/layers.py's RotaryEmbedding) that lets the attention backend apply itself where
    the backend can fuse it (attention/triton_backend.py, `defer_rope`). The same table, as `cos_sin`."""

    def __init__(self, rotary: nn.Module, backend) -> None:
        super().__init__()
        self.rotary = rotary
        self.backend = backend  # not a module: held as a plain attribute

    @property
    def cos_sin(self) -> torch.Tensor:
        return self.rotary.cos_sin

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, q_norm: nn.Module | None = None,
                k_norm: nn.Module | None = None):
        if self.backend.defer_rope(q, k, positions, self.rotary.cos_sin, q_norm, k_norm):
            return q, k  # rotated inside the decode kernel of the backend's next forward
        return self.rotary(q, k, positions, q_norm, k_norm)


def use_fused_rope(model: nn.Module, rotary_class: type, backend) -> int:
    """Swap every module of `rotary_class` under `model` for a DeferredRotary tied to `backend`; returns how many."""
    swapped = 0
    for name, child in list(model.named_children()):
        if type(child) is rotary_class:
            setattr(model, name, DeferredRotary(child, backend))
            swapped += 1
        else:
            swapped += use_fused_rope(child, rotary_class, backend)
    return swapped
