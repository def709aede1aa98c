# generated from notebooks/10_hybrid_state.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/10_hybrid_state.ipynb, cell 3 (id c10-003) ---
"""Torch references of the Gated DeltaNet ops (Qwen3.5's linear-attention layers): the semantics, and the CPU path.

`minisgl.kernels.gdn` runs these on CPU tensors and tests its Triton kernels against them; its docstring describes
the two ops and the packed batch: sequence i of a step is rows cu_seqlens[i]:cu_seqlens[i+1] and owns state pool
row slots[i].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# --- notebooks/10_hybrid_state.ipynb, cell 8 (id c10-008) ---
def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


# --- notebooks/10_hybrid_state.ipynb, cell 9 (id c10-009) ---
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# --- notebooks/10_hybrid_state.ipynb, cell 10 (id c10-010) ---
def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0) and beta [T, Hv]; state [S, Hv, Dk, Dv] (fp32),
    updated in place. Value head h reads q/k head h // (Hv // Hk). Returns o [T, Hv, Dv] in v's dtype."""
    group = v.shape[1] // k.shape[1]
    scale = k.shape[-1] ** -0.5
    qf = _l2norm(q.float()).repeat_interleave(group, dim=1) * scale
    kf = _l2norm(k.float()).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.zeros_like(v)  # a token of no sequence (a prefill graph's padding) gets 0, never garbage
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist()):
        s = state[slot].float()  # [Hv, Dk, Dv]
        for t in range(start, end):
            s = s * gf[t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", s, kf[t])
            s = s + kf[t][:, :, None] * ((vf[t] - predicted) * bf[t][:, None])[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t]).to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


# --- notebooks/10_hybrid_state.ipynb, cell 17 (id c10-017) ---
def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] with weight [C, K]; conv_state [S, C, K-1] updated in place."""
    out = torch.zeros_like(x)  # as in gated_delta_rule_ref: padded tokens get 0
    keep = weight.shape[1] - 1
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist()):
        if end == start:  # an empty sequence (a padded request of a prefill graph) keeps its state
            continue
        # [C, K-1 + L]: the request's previous inputs, then this step's
        window = torch.cat([conv_state[slot].float(), x[start:end].float().t()], dim=1)
        y = F.conv1d(window[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                     groups=weight.shape[0])[0]  # [C, L]: valid positions only
        out[start:end] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - keep:].to(conv_state.dtype)
    return out
