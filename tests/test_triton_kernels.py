"""Triton kernels (attention + elementwise) under the Triton interpreter, on CPU, against torch references.

Skipped when Triton is not installed (CI). The interpreter is slow, so the shapes are small; they still cover
several page sizes through shuffled slot tables, GQA ratios 1 and 4, head dims 64 and 128, mixed extend
batches with and without prefixes, and decode lengths that cross split boundaries.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import use_triton_interpreter  # noqa: E402

# numpy patch; re-decorate the kernel modules another test imported before
use_triton_interpreter("minisgl.kernels.attention", "minisgl.kernels.elementwise", "minisgl.attention.triton_backend")


from minisgl.attention.base import AttentionMetadata  # noqa: E402
from minisgl.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from minisgl.kernels import elementwise as ew  # noqa: E402
from minisgl.kernels.attention import decode_attention, decode_num_splits, extend_attention  # noqa: E402
from minisgl.kvcache.pool import KVCache  # noqa: E402

# ------------------------------------------------------------------ helpers ---------------------------------


def make_pool(num_slots: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    k = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_slots, hkv, d, generator=gen).to(dtype)
    return k, v


def make_slot_table(num_rows: int, max_len: int, page_size: int, num_pages: int, gen: torch.Generator):
    """req_to_token with each row's pages drawn at random (so slots are neither contiguous nor ordered
    across pages); within a page, offsets follow positions, as the pool lays them out."""
    pages_per_row = (max_len + page_size - 1) // page_size
    assert num_rows * pages_per_row <= num_pages
    perm = torch.randperm(num_pages, generator=gen)[: num_rows * pages_per_row].view(num_rows, pages_per_row)
    pos = torch.arange(max_len)
    slots = perm[:, pos // page_size] * page_size + pos % page_size
    return slots.to(torch.int32).contiguous()


def ref_attention(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, extend_start, scale):
    """Gather each request's keys, causal-masked softmax in fp32."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float32)
    group = q.shape[1] // k_buf.shape[1]
    for row, pre, n, st in zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(),
                               extend_start.tolist()):
        seq = pre + n
        slots = req_to_token[row, :seq].long()
        keys = k_buf[slots].float().repeat_interleave(group, dim=1)
        vals = v_buf[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,shd->hns", q[st:st + n].float(), keys) * scale
        mask = torch.arange(seq)[None, :] > torch.arange(pre, seq)[:, None]
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        out[st:st + n] = torch.einsum("hns,shd->nhd", probs, vals)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "kernel left output elements unwritten (NaN poison survived)"
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def i32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


# ------------------------------------------------------------------ decode ----------------------------------


@pytest.mark.parametrize(
    "hq,hkv,d,page_size,num_splits,dtype",
    [
        (4, 4, 64, 1, 1, torch.float32),  # GQA 1, single split writes `out` directly
        (8, 2, 64, 16, 3, torch.float32),  # GQA 4, split count that does not divide the lengths
        (8, 2, 128, 4, 8, torch.float32),  # head_dim 128, many splits: short requests leave splits empty
        (8, 2, 64, 1, None, torch.float16),  # split count from the host bound, half precision
        (2, 1, 80, 2, 2, torch.float32),  # head_dim not a power of 2
    ],
)
def test_decode_attention(hq, hkv, d, page_size, num_splits, dtype):
    gen = torch.Generator().manual_seed(hq * 1000 + d + page_size)
    max_len, rows_total = 300, 5
    num_pages = (rows_total * ((max_len + page_size - 1) // page_size)) + 3
    k_buf, v_buf = make_pool(num_pages * page_size, hkv, d, dtype, gen)
    r2t = make_slot_table(rows_total, max_len, page_size, num_pages, gen)
    rows = torch.tensor([3, 0, 4, 1], dtype=torch.int64)
    # 1 token, exactly one key tile, a split-boundary-crossing length, the full row
    seq_lens = i32([1, 64, 129, max_len])
    bs = len(rows)
    q = torch.randn(bs, hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                     num_splits=num_splits)
    ref = ref_attention(q, k_buf, v_buf, r2t, rows, seq_lens - 1, torch.ones(bs, dtype=torch.int32),
                        torch.arange(bs), scale)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol


def test_decode_attention_workspace_and_empty_rows():
    """A caller-provided workspace is used as is; a seq_len-0 row (CUDA-graph padding) gives zeros."""
    gen = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 1, 64
    k_buf, v_buf = make_pool(512, hkv, d, torch.float32, gen)
    r2t = make_slot_table(2, 200, 1, 512, gen)
    rows = torch.tensor([1, 0])
    seq_lens = i32([200, 0])
    q = torch.randn(2, hq, d, generator=gen)
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        ws = torch.full((2 * hq * splits * (d + 1),), float("nan"))
        decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, 0.1, workspace=ws, num_splits=splits)
        ref = ref_attention(q[:1], k_buf, v_buf, r2t, rows[:1], i32([199]), i32([1]), i32([0]), 0.1)
        assert rel_err(out[:1], ref) < 1e-3
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_num_splits_is_host_only():
    assert decode_num_splits(1, 8, 32768) > 1
    assert decode_num_splits(1, 8, 100) == 1  # too short to be worth splitting
    assert decode_num_splits(512, 8, 32768) == 1  # the batch alone fills the GPU
    assert decode_num_splits(1, 1, None) == 64


# ------------------------------------------------------------------ extend ----------------------------------


@pytest.mark.parametrize(
    "hq,hkv,d,page_size,dtype",
    [
        (4, 4, 64, 1, torch.float32),
        (8, 2, 64, 16, torch.float32),
        (4, 1, 128, 4, torch.float16),
        (2, 1, 80, 2, torch.float32),  # head_dim not a power of 2: masked along D
    ],
)
def test_extend_attention_mixed_batch(hq, hkv, d, page_size, dtype):
    gen = torch.Generator().manual_seed(hq + d + page_size)
    max_len, rows_total = 160, 6
    num_pages = rows_total * ((max_len + page_size - 1) // page_size) + 2
    k_buf, v_buf = make_pool(num_pages * page_size, hkv, d, dtype, gen)
    r2t = make_slot_table(rows_total, max_len, page_size, num_pages, gen)
    # prefill from scratch (crosses a 32-row query block), decode rows, a chunk over a long prefix,
    # a short chunk over an unaligned prefix
    rows = torch.tensor([5, 2, 0, 3, 1], dtype=torch.int64)
    prefix_lens = i32([0, 57, 100, 0, 33])
    extend_lens = i32([45, 1, 60, 1, 7])
    extend_start = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens
    total = int(extend_lens.sum())
    q = torch.randn(total, hq, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start, out, scale,
                     max_extend_len=int(extend_lens.max()))
    ref = ref_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start, scale)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol


# ------------------------------------------------------------------ backend ---------------------------------


def _meta(rows, prefix, ext, total_slots_used, out_cache_loc, is_decode):
    prefix_t, ext_t = i32(prefix), i32(ext)
    return AttentionMetadata(
        is_decode=is_decode, req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=prefix_t + ext_t, prefix_lens=prefix_t, extend_lens=ext_t,
        extend_start=torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t, out_cache_loc=out_cache_loc,
        max_seq_len=max(p + e for p, e in zip(prefix, ext)), max_extend_len=max(ext),
        seq_lens_cpu=[p + e for p, e in zip(prefix, ext)], prefix_lens_cpu=list(prefix),
        extend_lens_cpu=list(ext))


def test_triton_backend_matches_torch_backend():
    """Extend then decode through the backend API (store_kv included), against the torch backend."""
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page_size, layers = 8, 2, 64, 4, 2
    num_pages, max_len = 40, 48
    caches = [KVCache(layers, num_pages, page_size, hkv, d, torch.float32, "cpu") for _ in range(2)]
    r2t = torch.zeros(4, max_len, dtype=torch.int32)
    table = make_slot_table(2, max_len, page_size, num_pages - 1, gen) + page_size  # page 0 stays reserved
    r2t[1], r2t[3] = table[0], table[1]
    scale = d ** -0.5
    backends = [TorchAttentionBackend(caches[0], r2t, hq, hkv, d, scale),
                TritonAttentionBackend(caches[1], r2t, hq, hkv, d, scale, max_context_len=max_len)]
    backends[1].init_cuda_graph_state(max_bs=4)

    rows, prefix, ext = [1, 3], [0, 0], [21, 37]
    steps = [(_meta(rows, prefix, ext, None, None, False), False)]
    steps.append((_meta(rows, [21, 37], [1, 1], None, None, True), True))
    for meta, is_decode in steps:
        meta.out_cache_loc = torch.cat([r2t[r, p:p + e] for r, p, e in zip(rows, meta.prefix_lens_cpu,
                                                                           meta.extend_lens_cpu)]).long()
        total = int(meta.extend_lens.sum())
        outs = []
        for i, backend in enumerate(backends):
            if is_decode and i == 1:
                backend.prepare_for_capture(meta)  # the graph path: same kernels on the fixed workspace
            else:
                backend.prepare(meta)
            g = torch.Generator().manual_seed(total)
            layer_outs = []
            for layer in range(layers):
                q = torch.randn(total, hq, d, generator=g)
                k = torch.randn(total, hkv, d, generator=g)
                v = torch.randn(total, hkv, d, generator=g)
                layer_outs.append(backend.forward(q, k, v, layer))
            outs.append(torch.stack(layer_outs))
        assert rel_err(outs[1], outs[0].float()) < 1e-3
    assert torch.equal(caches[0].buffer, caches[1].buffer)


# ------------------------------------------------------------------ elementwise -----------------------------


@pytest.fixture
def force_triton(monkeypatch):
    monkeypatch.setenv("MINISGL_FORCE_TRITON", "1")


def _tol(dtype: torch.dtype) -> float:
    # The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): allow 2 bf16 ulps.
    return 1e-5 if dtype == torch.float32 else 2 ** -6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(force_triton, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=gen).to(dtype)
    res = torch.randn(6, 200, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    y = ew.rms_norm(x, w, 1e-6)
    assert y.dtype == dtype
    tol = _tol(dtype)
    torch.testing.assert_close(y.float(), ew.rms_norm_ref(x, w, 1e-6).float(), rtol=tol, atol=tol)
    x0, res0 = x.clone(), res.clone()
    y, new_res = ew.fused_add_rms_norm(x, res, w, 1e-6)
    y_ref, res_ref = ew.fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched
    torch.testing.assert_close(new_res.float(), res_ref.float(), rtol=_tol(dtype), atol=_tol(dtype))
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=_tol(dtype), atol=_tol(dtype))


def test_per_head_rms_norm_on_strided_view(force_triton):
    """Qwen3's q_norm: RMSNorm over head_dim of a [T, H, D] slice of the fused qkv output, no copy."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(5, 4, 64)
    w = torch.randn(64, generator=gen)
    torch.testing.assert_close(ew.rms_norm(q, w, 1e-6), ew.rms_norm_ref(q, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(force_triton, dtype):
    gen = torch.Generator().manual_seed(2)
    gu = (3 * torch.randn(7, 2 * 1100, generator=gen)).to(dtype)  # I = 1100 spans two 1024-wide blocks
    out = ew.silu_and_mul(gu)
    assert out.shape == (7, 1100) and out.dtype == dtype
    tol = _tol(dtype)
    torch.testing.assert_close(out.float(), ew.silu_and_mul_ref(gu).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_in_place_on_qkv_views(force_triton, dtype):
    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d, max_pos = 6, 4, 2, 64, 50
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q_ref = qkv[:, : hq * d].view(t, hq, d).clone()
    k_ref = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d).clone()
    v_before = qkv[:, (hq + hkv) * d:].clone()
    ew.apply_rope_ref(q_ref, k_ref, positions, cos_sin)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    ew.apply_rope(q, k, positions, cos_sin)
    # the reference rotates in the activation dtype (as HF does); the kernel in fp32
    tol = 1e-5 if dtype == torch.float32 else 2 ** -5
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_from_qkv_views(force_triton, dtype):
    """One launch writes K and V rows (views into a fused qkv output) to shuffled slots of the layer buffers."""
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d, slots = 7, 4, 2, 64, 40
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    loc = torch.randperm(slots - 1, generator=gen)[:t] + 1
    bufs = [torch.randn(slots, hkv, d, generator=gen).to(dtype) for _ in range(2)]
    ref = [b.clone() for b in bufs]
    ew.store_kv(bufs[0], bufs[1], loc, k, v)
    ew.store_kv_ref(ref[0], ref[1], loc, k, v)
    # the written rows and every other row (the reference started from the same random buffers)
    assert torch.equal(bufs[0], ref[0]) and torch.equal(bufs[1], ref[1])
    assert torch.equal(bufs[0][loc], k) and torch.equal(bufs[1][loc], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_in_place_on_qkv_views(force_triton, dtype):
    """Qwen3's per-head q/k norms and the rotation in one launch, on views into the qkv output."""
    gen = torch.Generator().manual_seed(6)
    t, hq, hkv, d, max_pos = 5, 4, 2, 64, 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos_sin = torch.cat([torch.outer(torch.arange(max_pos).float(), inv_freq).cos(),
                         torch.outer(torch.arange(max_pos).float(), inv_freq).sin()], dim=-1)
    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=gen)).to(dtype)
    wq = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    wk = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    q_ref, k_ref = ew.norm_and_rope_ref(q.clone(), k.clone(), positions, cos_sin, wq, wk, 1e-6)
    # the three Triton kernels it replaces: per-head rms_norm of q and of k, then apply_rope
    q_sep, k_sep = ew.rms_norm(q.clone(), wq, 1e-6), ew.rms_norm(k.clone(), wk, 1e-6)
    ew.apply_rope(q_sep, k_sep, positions, cos_sin)
    v_before = qkv[:, (hq + hkv) * d:].clone()
    q_out, k_out = ew.norm_and_rope(q, k, positions, cos_sin, wq, wk, 1e-6)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place, in the qkv buffer
    tol = 1e-5 if dtype == torch.float32 else 2 ** -4  # the reference rotates in bf16 arithmetic, the kernel in fp32
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(k.float(), k_ref.float(), rtol=tol, atol=tol)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v_before)  # v untouched
    # same rounding points as the separate kernels; only the variance's summation order differs
    sep_tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(q.float(), q_sep.float(), rtol=sep_tol, atol=sep_tol)
    torch.testing.assert_close(k.float(), k_sep.float(), rtol=sep_tol, atol=sep_tol)


def test_elementwise_cpu_path_without_force():
    """Without the flag, CPU tensors take the torch reference (what CI, which has no Triton, runs)."""
    x = torch.randn(3, 16)
    w = torch.ones(16)
    assert os.environ.get("MINISGL_FORCE_TRITON", "0") != "1"
    assert torch.equal(ew.rms_norm(x, w, 1e-6), ew.rms_norm_ref(x, w, 1e-6))
