# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 5 (id c05-005) ---
"""Turn the last-token logits of a batch into next tokens: greedy, temperature, top-k, top-p, min-p, per request.

Randomness comes from a counter-based hash of (request seed, output index, token id), not from a stateful
generator. So a seeded request draws the same tokens whatever batch it shares, in either loop, with or
without CUDA Graph, and the whole batch samples in a few vectorised ops with no host sync.
Sampling by argmax(logits / T + Gumbel noise) is the same as drawing from softmax(logits / T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels.hashing import row_hash, token_bits


# --- notebooks/05_scheduler.ipynb, cell 15 (id c05-015) ---
def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) `[B, vocab]`, a pure function of (seed, step, token id)."""
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = token_bits(row_hash(seeds, steps), idx)  # [B, vocab]
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


# --- notebooks/05_scheduler.ipynb, cell 17 (id c05-017) ---
@dataclass
class SamplingTensors:
    """Per-row sampling settings on the device, built once per batch."""

    temperatures: torch.Tensor  # [B] float; 0 = greedy
    top_ks: torch.Tensor  # [B] int: the k of the cut; vocab size for a request without one (top_k_within)
    top_ps: torch.Tensor  # [B] float; 1 = off
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: index of the token being drawn
    all_greedy: bool
    any_top_k_p: bool  # any row cuts its distribution: top-k, top-p or min-p
    min_ps: torch.Tensor | None = None  # [B] float; 0 = off (None: off for every row)
    # some row's logits are processed before sampling (penalties, a grammar mask, logprobs: notebook 12), so a
    # decode graph must hand back the logits rather than tokens (notebook 06)
    processed: bool = False


# --- notebooks/05_scheduler.ipynb, cell 19 (id c05-019) ---
def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                      min_ps: torch.Tensor | None = None, inv_temps: torch.Tensor | None = None) -> torch.Tensor:
    vocab = logits.shape[-1]
    inv_t = torch.ones_like(top_ps)[:, None] if inv_temps is None else inv_temps[:, None]
    x, _ = logits.sort(dim=-1, descending=True)
    kth = x.gather(1, (top_ks.clamp(1, vocab) - 1)[:, None])  # the k-th largest logit
    weights = torch.exp(x * inv_t - x[:, :1] * inv_t) * (x >= kth)  # zero outside the top-k
    mass = weights.cumsum(dim=-1)
    # the first rank whose cumulated weight reaches top_p of the top-k's weight: its logit is the threshold
    rank = (mass < top_ps[:, None] * mass[:, -1:]).sum(dim=-1, keepdim=True).clamp_max(vocab - 1)
    threshold = torch.where(top_ps[:, None] < 1, x.gather(1, rank), kth)
    keep = logits >= threshold
    if min_ps is not None:
        keep &= logits * inv_t - x[:, :1] * inv_t >= torch.log(min_ps)[:, None]
    return logits.masked_fill(~keep, float("-inf"))


# --- notebooks/05_scheduler.ipynb, cell 22 (id c05-022) ---
def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits `[B, V]` (float32, or a bf16 model's own) → next token ids `[B]` int64."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda:
        from minisgl.kernels import sampling as fused
        if fused.triton is not None:  # no sort, no host sync: a few passes over the logits
            return fused.fused_sample(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps, st.seeds,
                                      st.steps, cuts=st.any_top_k_p)
    logits = logits.float()  # a bf16 model's logits, widened: the maths below is float32
    greedy_tokens = logits.argmax(dim=-1)
    inv_t = 1.0 / st.temperatures.clamp_min(1e-6)
    if st.any_top_k_p:
        logits = apply_top_k_top_p(logits, st.top_ks, st.top_ps, st.min_ps, inv_t)
    u = uniform_noise(st.seeds, st.steps, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    sampled = (logits * inv_t[:, None] + gumbel).argmax(dim=-1)
    return torch.where(st.temperatures == 0, greedy_tokens, sampled)
