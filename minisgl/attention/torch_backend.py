# generated from notebooks/03_attention.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/03_attention.ipynb, cell 3 (id c03-003) ---
"""The reference backend: plain torch, one request at a time. Slow, obviously right, runs anywhere."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend


# --- notebooks/03_attention.ipynb, cell 8 (id c03-008) ---
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.store_kv(k, v, layer_id)
        meta = self.meta
        k_buf, v_buf = self.kv_cache.k_buffers[layer_id], self.kv_cache.v_buffers[layer_id]
        out = torch.empty_like(q)
        group = self.num_q_heads // self.num_kv_heads
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        extend_lens = meta.extend_lens_cpu or meta.extend_lens.tolist()
        starts = meta.extend_start.tolist()
        rows = meta.req_pool_indices.tolist()
        for row, start, n_new, seq_len in zip(rows, starts, extend_lens, seq_lens):
            slots = self.req_to_token[row, :seq_len].long()
            keys = k_buf[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
            vals = v_buf[slots].float().repeat_interleave(group, dim=1)
            qs = q[start:start + n_new].float()  # [n, Hq, D]
            scores = torch.einsum("nhd,shd->hns", qs, keys) * self.scale
            # query j sits at position seq_len - n_new + j and may see keys up to that position
            q_pos = torch.arange(seq_len - n_new, seq_len, device=q.device)[:, None]
            k_pos = torch.arange(seq_len, device=q.device)[None, :]
            scores.masked_fill_(k_pos > q_pos, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start:start + n_new] = torch.einsum("hns,shd->nhd", probs, vals).to(q.dtype)
        return out
