"""Notebook 03: the torch reference backend against dense attention, on mixed prefill/decode batches."""

from __future__ import annotations

import random

import adapters
import pytest
import torch
import torch.nn.functional as F


def step(reqs, hq, hkv, d, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(p + n) // page_size) for p, n in reqs) + 2
    kv = adapters.kv_cache(1, num_pages, page_size, hkv, d, torch.float32)
    alloc = adapters.page_allocator(num_pages)
    table = adapters.req_to_token_pool(len(reqs), max(p + n for p, n in reqs))
    rows, locs, qs, ks, vs, refs = [], [], [], [], [], []
    for prefix, n in reqs:
        seq = prefix + n
        pages = alloc.alloc(-(-seq // page_size))
        slots = [pages[i // page_size] * page_size + i % page_size for i in range(seq)]
        row = table.alloc()
        table.write(row, 0, slots)
        k_all, v_all = torch.randn(seq, hkv, d, generator=g), torch.randn(seq, hkv, d, generator=g)
        kv.store(0, torch.tensor(slots[:prefix], dtype=torch.long), k_all[:prefix], v_all[:prefix])
        q = torch.randn(n, hq, d, generator=g)
        mask = torch.arange(seq)[None, :] <= torch.arange(prefix, seq)[:, None]
        refs.append(F.scaled_dot_product_attention(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
                                                   attn_mask=mask, scale=d ** -0.5, enable_gqa=True).transpose(0, 1))
        rows.append(row)
        locs += slots[prefix:]
        qs.append(q)
        ks.append(k_all[prefix:])
        vs.append(v_all[prefix:])
    table.flush()
    ext = [n for _, n in reqs]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    meta = adapters.attention_metadata(
        is_decode=all(n == 1 for n in ext), req_pool_indices=torch.tensor(rows),
        seq_lens=i32([p + n for p, n in reqs]), prefix_lens=i32([p for p, _ in reqs]), extend_lens=i32(ext),
        extend_start=i32([sum(ext[:i]) for i in range(len(ext))]), out_cache_loc=torch.tensor(locs),
        max_seq_len=max(p + n for p, n in reqs), max_extend_len=max(ext))
    backend = adapters.torch_attention_backend(kv, table.table, hq, hkv, d, d ** -0.5)
    backend.prepare(meta)
    return backend, torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(refs)


@pytest.mark.parametrize("seed", range(6))
def test_torch_backend_matches_dense_attention(seed):
    rng = random.Random(seed)
    hkv = rng.choice([1, 2, 4])
    hq = hkv * rng.choice([1, 2, 4])
    reqs = [(rng.choice([0, rng.randint(1, 40)]), rng.choice([1, rng.randint(1, 20)]))
            for _ in range(rng.randint(1, 6))]
    backend, q, k, v, ref = step(reqs, hq, hkv, rng.choice([8, 16]), rng.choice([1, 2, 4]), seed)
    out = backend.forward(q, k, v, 0)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
