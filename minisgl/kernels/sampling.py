"""Fused sampling on the GPU: argmax(logits / T + Gumbel noise) in one pass over the logits.

The torch version in minisgl/engine/sampler.py makes ~15 passes over a [batch, vocab] tensor (hash, logs,
divide, add, argmax); at batch 256 and a 152k vocabulary that is several GB of traffic per step. This
kernel reads each logit once and draws exactly the same noise (same counter-based hash, minisgl/kernels/hashing.py).
"""

from __future__ import annotations

import torch

from minisgl.kernels.hashing import row_hash

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the torch path in sampler.py is used instead
    triton = None

if triton is not None:

    @triton.jit
    def _mix32(x):
        # hashing.mix32 in Triton: int64 lanes holding 32-bit values, masked after each multiply, the same
        # arithmetic as the torch version whatever Triton's rules for mixing unsigned types and large constants
        x = x & 0xFFFFFFFF
        x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
        x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, stride, temps_ptr, row_hash_ptr, partial_val_ptr, partial_idx_ptr,
                              vocab, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        # grid: (rows, chunks); each program scans one chunk of one row and writes its best (value, index)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        temp = tl.load(temps_ptr + row)
        inv_t = 1.0 / tl.maximum(temp, 1e-6)
        greedy = temp == 0.0
        h = tl.load(row_hash_ptr + row)  # int64, < 2**32
        best_val = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        start = chunk * CHUNK
        for off in range(0, CHUNK, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < vocab
            x = tl.load(logits_ptr + row * stride + idx, mask=mask, other=float("-inf")).to(tl.float32)
            bits = _mix32(h ^ ((idx.to(tl.int64) * 0x85EBCA77) & 0xFFFFFFFF))
            u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            g = -tl.log(-tl.log(u))
            val = tl.where(greedy, x, x * inv_t + g)
            val = tl.where(mask, val, float("-inf"))
            better = val > best_val
            best_val = tl.where(better, val, best_val)
            best_idx = tl.where(better, idx, best_idx)
        m = tl.max(best_val, axis=0)
        # lowest index among the maxima, as torch.argmax does
        i = tl.min(tl.where(best_val == m, best_idx, 2147483647), axis=0)
        tl.store(partial_val_ptr + row * num_chunks + chunk, m)
        tl.store(partial_idx_ptr + row * num_chunks + chunk, i)


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Next tokens [B] (int64): greedy rows (T == 0) take the argmax, others a Gumbel-max draw."""
    b, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(b, num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b, num_chunks, dtype=torch.int32, device=logits.device)
    hashes = row_hash(seeds, steps)
    _gumbel_argmax_kernel[(b, num_chunks)](logits, logits.stride(0), temperatures.float(), hashes, vals, idxs,
                                           vocab, num_chunks, CHUNK=chunk, BLOCK=1024)
    best = vals.argmax(dim=1, keepdim=True)
    return idxs.gather(1, best).squeeze(1).long()
