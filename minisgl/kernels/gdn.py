"""Gated DeltaNet ops (Qwen3.5's linear-attention layers) over packed variable-length sequences.

Two ops, each reading and writing a per-request state held in a pool (one pool row, "slot", per request):

- `causal_conv1d`: the depthwise causal convolution (kernel K) over the q/k/v channels, then SiLU. Each
  sequence's window starts with its slot's last K-1 inputs; the last K-1 inputs are written back.
- `gated_delta_rule`: the linear-attention recurrence. Per value head, with S the [Dk, Dv] state:
      S <- exp(g_t) * S;  S <- S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = S^T q_t * Dk^-0.5
  with q and k L2-normalised first (in fp32). Each sequence starts from its slot's state and leaves its final
  state there.

A batch is T tokens of N sequences, packed: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1] and owns pool row
slots[i]. A decode step is the case T == N (one token each); padded rows of a CUDA graph point at a dummy slot.

Each op has a torch reference (`*_ref`, the semantics; a plain loop over tokens, which is also the CPU path) and
the public wrapper, which uses the reference for CPU tensors (Triton kernels for CUDA tensors go here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "causal_conv1d_ref", "gated_delta_rule", "gated_delta_rule_ref"]


def _spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                      slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] with weight [C, K]; conv_state [S, C, K-1] updated in place."""
    out = torch.empty_like(x)
    keep = weight.shape[1] - 1
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist()):
        # [C, K-1 + L]: the request's previous inputs, then this step's
        window = torch.cat([conv_state[slot].float(), x[start:end].float().t()], dim=1)
        y = F.conv1d(window[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                     groups=weight.shape[0])[0]  # [C, L]: valid positions only
        out[start:end] = F.silu(y).t().to(x.dtype)
        conv_state[slot] = window[:, window.shape[1] - keep:].to(conv_state.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """q, k [T, Hk, Dk]; v [T, Hv, Dv]; g (log decay, <= 0) and beta [T, Hv]; state [S, Hv, Dk, Dv] (fp32),
    updated in place. Value head h reads q/k head h // (Hv // Hk). Returns o [T, Hv, Dv] in v's dtype."""
    group = v.shape[1] // k.shape[1]
    scale = k.shape[-1] ** -0.5
    qf = _l2norm(q.float()).repeat_interleave(group, dim=1) * scale
    kf = _l2norm(k.float()).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    for (start, end), slot in zip(_spans(cu_seqlens), slots.tolist()):
        s = state[slot].float()  # [Hv, Dk, Dv]
        for t in range(start, end):
            s = s * gf[t].exp()[:, None, None]
            predicted = torch.einsum("hkv,hk->hv", s, kf[t])
            s = s + kf[t][:, :, None] * ((vf[t] - predicted) * bf[t][:, None])[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", s, qf[t]).to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return causal_conv1d_ref(x, weight, bias, conv_state, slots, cu_seqlens)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return gated_delta_rule_ref(q, k, v, g, beta, state, slots, cu_seqlens)
