# generated from notebooks/01_model.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/01_model.ipynb, cell 4 (id c01-004) ---
"""The building blocks shared by our decoder models: norm, rotary embedding, MLP.

The elementwise work goes through `minisgl.kernels.elementwise`, which fuses it in Triton on a GPU and
falls back to plain torch on a CPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minisgl.kernels import elementwise as ew


# --- notebooks/01_model.ipynb, cell 12 (id c01-011) ---
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if residual is None:
            return ew.rms_norm(x, self.weight, self.eps)
        return ew.fused_add_rms_norm(x, residual, self.weight, self.eps)


# --- notebooks/01_model.ipynb, cell 15 (id c01-014) ---
def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


# --- notebooks/01_model.ipynb, cell 19 (id c01-018) ---
class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin table `[max_positions, head_dim]` (cos in the first half, sin in the second)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        """Rotate q and k by their positions. Qwen3 passes its per-head norms: they run first, in the same pass
        over q and k on a GPU (one kernel instead of three)."""
        if q_norm is None:
            return ew.apply_rope(q, k, positions, self.cos_sin)
        return ew.norm_and_rope(q, k, positions, self.cos_sin, q_norm.weight, k_norm.weight, q_norm.eps)


# --- notebooks/01_model.ipynb, cell 21 (id c01-020) ---
class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        # gate and up fused into one matmul: one launch instead of two
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ew.silu_and_mul(self.gate_up_proj(x)))
