# generated from notebooks/03_attention.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/03_attention.ipynb, cell 3 (id c03-003) ---
"""Attention in plain torch, for any device. `TorchAttentionBackend` is the reference: one request at a time,
slow, obviously right. `PaddedDecodeTorchBackend`, the engine's "torch" backend, runs a decode step as one padded
op over the whole batch and everything else through the reference loop."""

from __future__ import annotations

import torch

from minisgl.attention.base import AttentionBackend, AttentionMetadata


# --- notebooks/03_attention.ipynb, cell 8 (id c03-008) ---
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        self.store_kv(k, v, layer_id)
        meta = self.meta
        k_buf, v_buf = self.kv_cache.k_buffers[layer_id], self.kv_cache.v_buffers[layer_id]
        # zeros, not empty: the padded tokens of a prefill graph belong to no request and must still come out
        # finite (their K/V land in slot 0, which a padded decode step reads, masked)
        out = torch.zeros_like(q)
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


# --- notebooks/03_attention.ipynb, cell 16 (id c03-014b) ---
class PaddedDecodeTorchBackend(TorchAttentionBackend):
    """The engine's torch backend: a decode step as a few padded ops over the batch, the rest through the loop."""

    name = "torch"
    max_gather_elements = 1 << 24  # K elements one op gathers at most (64 MiB in fp32)

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        self.decode_groups = None
        if meta.is_decode:
            # rows sorted by length, cut where the longest would pass twice the shortest (padding at most
            # doubles the keys read) or the gather would pass max_gather_elements
            lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
            order = sorted(range(len(lens)), key=lens.__getitem__)
            per_token = self.num_kv_heads * self.head_dim
            self.decode_groups, start = [], 0
            for end in range(1, len(order) + 1):
                if (end == len(order) or lens[order[end]] > 2 * lens[order[start]]
                        or (end - start + 1) * lens[order[end]] * per_token > self.max_gather_elements):
                    self.decode_groups.append(self._group(meta, order[start:end], lens[order[end - 1]]))
                    start = end

    def _group(self, meta: AttentionMetadata, rows: list[int], seq_len: int):
        """(the rows, their slots flattened, which are real): padding reads slot 0 and is masked."""
        rows_d = torch.tensor(rows, device=meta.seq_lens.device)
        valid = torch.arange(seq_len, device=rows_d.device)[None, :] < meta.seq_lens[rows_d][:, None]
        table = self.req_to_token[meta.req_pool_indices[rows_d], :seq_len]
        return rows_d, torch.where(valid, table, 0).long().flatten(), valid

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        if self.decode_groups is None:
            return super().forward(q, k, v, layer_id)
        self.store_kv(k, v, layer_id)
        k_buf, v_buf = self.kv_cache.k_buffers[layer_id], self.kv_cache.v_buffers[layer_id]
        hkv, d = self.num_kv_heads, self.head_dim
        group = self.num_q_heads // hkv
        out = torch.empty_like(q)
        for rows, slots, valid in self.decode_groups:
            n, seq_len = valid.shape
            keys = k_buf.index_select(0, slots).view(n, seq_len, hkv, d).float()
            vals = v_buf.index_select(0, slots).view(n, seq_len, hkv, d).float()
            qs = q.index_select(0, rows).float().view(n, hkv, group, d)  # query head h reads K/V head h // group
            scores = torch.einsum("bhgd,bshd->bhgs", qs, keys) * self.scale
            scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
            o = torch.einsum("bhgs,bshd->bhgd", scores.softmax(dim=-1), vals)
            out.index_copy_(0, rows, o.reshape(n, hkv * group, d).to(q.dtype))
        return out
