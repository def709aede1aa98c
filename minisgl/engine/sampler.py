# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 5 (id c05-005) ---
"""Turn the last-token logits of a batch into next tokens: greedy, temperature, top-k, top-p, per request.

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
    top_ks: torch.Tensor  # [B] int; vocab size = off
    top_ps: torch.Tensor  # [B] float; 1 = off
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: index of the token being drawn
    all_greedy: bool
    any_top_k_p: bool


# --- notebooks/05_scheduler.ipynb, cell 19 (id c05-019) ---
def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= top_ks[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_ps[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


# --- notebooks/05_scheduler.ipynb, cell 22 (id c05-022) ---
def sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits `[B, V]` float32 → next token ids `[B]` int64."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    if logits.is_cuda and not st.any_top_k_p:
        from minisgl.kernels import sampling as fused
        if fused.triton is not None:  # one pass over the logits instead of ~15
            return fused.gumbel_argmax(logits, st.temperatures, st.seeds, st.steps)
    greedy_tokens = logits.argmax(dim=-1)
    temps = st.temperatures.clamp_min(1e-6)[:, None]
    scaled = logits / temps
    if st.any_top_k_p:
        scaled = apply_top_k_top_p(scaled, st.top_ks, st.top_ps)
    u = uniform_noise(st.seeds, st.steps, logits.shape[-1])
    gumbel = -torch.log(-torch.log(u))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(st.temperatures == 0, greedy_tokens, sampled)
