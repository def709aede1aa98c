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

from helpers import kernel_options, use_triton_interpreter  # noqa: E402

# numpy patch; re-decorate the kernel modules another test imported before
use_triton_interpreter("minisgl.kernels.attention", "minisgl.kernels.elementwise", "minisgl.attention.triton_backend")


from minisgl.attention.base import AttentionMetadata  # noqa: E402
from minisgl.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from minisgl.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from minisgl.kernels import attention as attention_kernels  # noqa: E402
from minisgl.kernels import elementwise as ew  # noqa: E402
from minisgl.kernels.attention import (  # noqa: E402
    decode_attention,
    decode_num_splits,
    decode_shared_workspace_numel,
    decode_workspace_numel,
    extend_attention,
)
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
@pytest.mark.parametrize("fused_merge", [True, False], ids=["fused", "two_launch"])
def test_decode_attention(hq, hkv, d, page_size, num_splits, dtype, fused_merge):
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
                     num_splits=num_splits, fused_merge=fused_merge)
    ref = ref_attention(q, k_buf, v_buf, r2t, rows, seq_lens - 1, torch.ones(bs, dtype=torch.int32),
                        torch.arange(bs), scale)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref) < tol


def _poisoned_workspace(numel: int, num_counters: int) -> torch.Tensor:
    """A workspace as a caller might hand it over: stale partials (NaN) and the merge counters at its end zeroed."""
    ws = torch.full((numel,), float("nan"))
    ws[numel - num_counters:].view(torch.int32).zero_()
    return ws


def _counters(ws: torch.Tensor, num_counters: int) -> torch.Tensor:
    return ws[ws.numel() - num_counters:].view(torch.int32)


def test_decode_next_kv_prefetch_changes_nothing_and_checks_its_buffers():
    """decode_attention(next_kv=): the next layer's buffers, whose rows a PDL launch asks L2 for (kernel option
    decode_prefetch_next_kv). The output is the same bits with them; buffers of another layout are refused."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = 4, 2, 64
    k_buf, v_buf = make_pool(256, hkv, d, torch.float32, gen)
    k_next, v_next = make_pool(256, hkv, d, torch.float32, gen)
    r2t = make_slot_table(1, 100, 1, 256, gen)
    q = torch.randn(1, hq, d, generator=gen)
    args = (q, k_buf, v_buf, r2t, torch.tensor([0]), i32([100]))
    want = decode_attention(*args, torch.empty_like(q), 0.1, num_splits=2)
    got = decode_attention(*args, torch.empty_like(q), 0.1, num_splits=2, next_kv=(k_next, v_next))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="next_kv"):
        decode_attention(*args, torch.empty_like(q), 0.1, num_splits=2, next_kv=(k_next[:10], v_next))


@pytest.mark.parametrize("fused_merge", [True, False], ids=["fused", "two_launch"])
def test_decode_attention_workspace_and_empty_rows(fused_merge):
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
        ws = _poisoned_workspace(max(1, decode_workspace_numel(2, hq, d, splits, hkv)), 2 * hkv)
        decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, 0.1, workspace=ws, num_splits=splits,
                         fused_merge=fused_merge)
        ref = ref_attention(q[:1], k_buf, v_buf, r2t, rows[:1], i32([199]), i32([1]), i32([0]), 0.1)
        assert rel_err(out[:1], ref) < 1e-3
        assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (8, 2, 128)])  # GQA groups 1 and 4, head dims 64 and 128
def test_decode_fused_merge_counters_across_calls(hq, hkv, d):
    """The fused merge's counters: all zero after every call, so consecutive calls on one workspace (as CUDA-graph
    replays are) with other lengths stay right. The lengths leave splits past a request's end (short rows with 8
    splits of at least one 64-key tile) and rows of length 0; both paths must agree with the reference."""
    gen = torch.Generator().manual_seed(hq * 10 + d)
    max_len, rows_total, splits, bs = 320, 6, 8, 4
    k_buf, v_buf = make_pool(rows_total * max_len + 1, hkv, d, torch.float32, gen)
    r2t = make_slot_table(rows_total, max_len, 1, rows_total * max_len + 1, gen)
    ws = _poisoned_workspace(decode_workspace_numel(bs, hq, d, splits, hkv), bs * hkv)
    scale = d ** -0.5
    steps = [([2, 5, 0, 1], [1, 300, 0, 64]),  # a row of 0 keys; 1 key: splits 1..7 past its end
             ([0, 1, 2, 3], [129, 0, 320, 7]),  # another row empty, a full-length one
             ([5, 4, 3, 2], [65, 2, 191, 0])]
    for rows, lens in steps:
        rows_t, lens_t = torch.tensor(rows), i32(lens)
        q = torch.randn(bs, hq, d, generator=gen)
        ref = ref_attention(q, k_buf, v_buf, r2t, rows_t, (lens_t - 1).clamp_min(0), i32([1] * bs),
                            torch.arange(bs), scale)
        for fused in (True, False):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, k_buf, v_buf, r2t, rows_t, lens_t, out, scale, workspace=ws, num_splits=splits,
                             fused_merge=fused)
            assert torch.equal(_counters(ws, bs * hkv), torch.zeros(bs * hkv, dtype=torch.int32))
            live = lens_t > 0
            assert rel_err(out[live], ref[live]) < 1e-3
            assert torch.equal(out[~live], torch.zeros_like(out[~live]))


def test_decode_shared_workspace_across_batch_sizes():
    """One workspace for several batch sizes (the decode graphs share one): each call's partials must miss every
    other size's counters, so calls alternating sizes all merge. A layout with the counters right after a call's
    own partials fails here: a larger batch's partials land on a smaller one's counters."""
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, max_len = 4, 2, 64, 200
    sizes = {1: 4, 2: 3, 3: 2}  # batch size -> splits (shrinking as the batch grows, as decode_num_splits does)
    numel = decode_shared_workspace_numel(sizes, hq, hkv, d, sizes.__getitem__)
    assert numel >= max(decode_workspace_numel(b, hq, d, s, hkv) for b, s in sizes.items())
    max_counters = max(sizes) * hkv
    ws = _poisoned_workspace(numel, max_counters)
    k_buf, v_buf = make_pool(4 * max_len + 1, hkv, d, torch.float32, gen)
    r2t = make_slot_table(4, max_len, 1, 4 * max_len + 1, gen)
    scale = d ** -0.5
    for bs in (3, 1, 2, 3, 1, 2):
        rows = torch.randperm(4, generator=gen)[:bs]
        lens = torch.randint(1, max_len + 1, (bs,), generator=gen).to(torch.int32)
        q = torch.randn(bs, hq, d, generator=gen)
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_buf, v_buf, r2t, rows, lens, out, scale, workspace=ws, num_splits=sizes[bs],
                         fused_merge=True)
        ref = ref_attention(q, k_buf, v_buf, r2t, rows, lens - 1, i32([1] * bs), torch.arange(bs), scale)
        assert rel_err(out, ref) < 1e-3
        assert torch.equal(_counters(ws, max_counters), torch.zeros(max_counters, dtype=torch.int32))


@pytest.mark.parametrize(
    "hq,hkv,d,page_size,num_splits,buf_dtype,new_dtype",
    [
        (4, 4, 64, 1, 1, torch.float32, torch.float32),  # GQA 1, one split writes `out` directly
        (8, 2, 64, 16, 3, torch.float32, torch.float32),  # GQA 4, splits that do not divide the lengths
        (8, 2, 128, 4, 8, torch.float16, torch.float16),  # many splits: the writer is not always the last split
        (8, 2, 64, 1, 4, torch.bfloat16, torch.float32),  # buffers narrower than k/v: the store casts
        (2, 1, 80, 2, 2, torch.float16, torch.float32),  # head_dim not a power of 2: the store is masked
    ],
)
@pytest.mark.parametrize("early_meta", [False, True, "kv"], ids=["meta_after_wait", "early_meta", "early_kv"])
@pytest.mark.parametrize("fused_merge", [True, False], ids=["fused_merge", "two_launch"])
def test_decode_fused_store_matches_store_kv(force_triton, hq, hkv, d, page_size, num_splits, buf_dtype, new_dtype,
                                             fused_merge, early_meta):
    """decode_attention storing the new K/V itself (new_kv=) against store_kv then decode_attention: the same
    output bit for bit and the same buffers, with rows of 1 key and CUDA-graph padded rows (slot 0, seq_len 1,
    pointed at a live request's row) in the batch. Both sides run the Triton kernels (the store_kv kernel under
    the interpreter), so the casts to the buffer dtype round the same way. With the kernel option
    early_metadata on the fused side (each request's length, row and slot read first), still the same; with
    early_kv too (the first key tile read before the wait, the new token's row patched in from registers), the
    same for every live row (a padded row's tile reads a live request's position 0 where the new key is patched
    in: its output, discarded, differs)."""
    gen = torch.Generator().manual_seed(hq * 100 + d + num_splits)
    max_len, rows_total = 300, 6
    num_pages = rows_total * ((max_len + page_size - 1) // page_size) + 3
    k0, v0 = make_pool(num_pages * page_size, hkv, d, buf_dtype, gen)
    r2t = make_slot_table(rows_total, max_len, page_size, num_pages - 1, gen) + page_size  # page 0 reserved
    # 1 key, one full key tile, a split boundary crossed, a full row; then two padded rows, whose stale rows are
    # live ones (they read position 0 there, which no program writes this step: only discarded outputs see it)
    rows = torch.tensor([3, 0, 4, 1, 0, 4], dtype=torch.int64)
    seq_lens = i32([1, 64, 129, max_len, 1, 1])
    live = 4
    loc = torch.cat([r2t[rows[:live], seq_lens[:live] - 1].long(), torch.zeros(2, dtype=torch.int64)])
    bs = len(rows)
    # k/v as the model hands them over: views into one qkv row per token (token stride > Hkv * D)
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen).to(new_dtype)
    q = qkv[:, : hq * d].view(bs, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(bs, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(bs, hkv, d)
    scale = d ** -0.5
    outs, bufs = [], []
    for fused_store in (True, False):
        k_buf, v_buf = k0.clone(), v0.clone()
        out = torch.full((bs, hq, d), float("nan"), dtype=new_dtype)
        if fused_store:
            with kernel_options(early_metadata=bool(early_meta), early_kv=early_meta == "kv"):
                decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                                 num_splits=num_splits, fused_merge=fused_merge, new_kv=(k, v, loc))
        else:
            ew.store_kv(k_buf, v_buf, loc, k, v)
            decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                             num_splits=num_splits, fused_merge=fused_merge)
        outs.append(out)
        bufs.append((k_buf, v_buf))
    assert torch.equal(outs[0][:live], outs[1][:live])
    if early_meta != "kv":
        assert torch.equal(outs[0], outs[1])
    (kf, vf), (ku, vu) = bufs
    assert torch.equal(kf[1:], ku[1:]) and torch.equal(vf[1:], vu[1:])
    # k/v cast to the buffer dtype as the interpreter casts (it truncates fp32 -> bf16; torch rounds to nearest)
    kc, vc = torch.empty(bs, hkv, d, dtype=buf_dtype), torch.empty(bs, hkv, d, dtype=buf_dtype)
    ew.store_kv(kc, vc, torch.arange(bs), k, v)
    torch.testing.assert_close(kc.float(), k.to(buf_dtype).float(), rtol=2 ** -7, atol=0)
    # the padded rows both target slot 0: either may win, so slot 0 holds one of their rows, per kv head
    for buf, cast in ((kf, kc), (vf, vc)):
        for h in range(hkv):
            assert any(torch.equal(buf[0, h], cast[i, h]) for i in range(live, bs))
    # only the live rows' slots (and slot 0) changed, and they hold the new k/v
    changed = (kf != k0).flatten(1).any(1) | (vf != v0).flatten(1).any(1)
    assert set(changed.nonzero().flatten().tolist()) <= set(loc.tolist())
    assert torch.equal(kf[loc[:live]], kc[:live]) and torch.equal(vf[loc[:live]], vc[:live])
    # and the answer is attention over the stored keys, the new one included (not for bf16: the interpreter's
    # bf16 tl.dot gives garbage, so there the two paths' outputs are only compared with each other)
    if buf_dtype != torch.bfloat16:
        ref = ref_attention(q, kf, vf, r2t, rows, seq_lens - 1, i32([1] * bs), torch.arange(bs), scale)
        assert rel_err(outs[0][:live], ref[:live]) < (1e-3 if buf_dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize(
    "hq,hkv,d,num_splits,dtype",
    [
        (4, 4, 64, 1, torch.float32),  # GQA 1, one split
        (8, 2, 64, 3, torch.float32),  # GQA 4, splits that do not divide the lengths
        (4, 2, 32, 2, torch.float16),  # half precision: the norm's and the rotation's roundings
    ],
)
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3_norms", "plain_rope"])
@pytest.mark.parametrize("early_meta", [False, True, "kv"], ids=["meta_after_wait", "early_meta", "early_kv"])
def test_decode_fused_rope_matches_rope_then_decode(force_triton, hq, hkv, d, num_splits, dtype, norm, early_meta):
    """decode_attention applying the RoPE (and Qwen3's per-head norms) itself (rope=) against norm_and_rope /
    apply_rope then decode_attention with the fused store: the same output bit for bit and the same K/V buffers
    (the stored key is the rotated one), with positions that are not seq_len - 1 (the table is read at the given
    position) and a CUDA-graph padded row (slot 0, seq_len 1). q and k stay as the projection left them."""
    gen = torch.Generator().manual_seed(hq * 10 + d + num_splits + norm)
    max_len, page_size = 200, 4
    num_pages = 5 * (max_len // page_size) + 2
    k0, v0 = make_pool(num_pages * page_size, hkv, d, dtype, gen)
    r2t = make_slot_table(5, max_len, page_size, num_pages - 1, gen) + page_size
    rows = torch.tensor([2, 0, 4, 1], dtype=torch.int64)
    seq_lens = i32([1, 70, max_len, 1])  # the last row: graph padding
    loc = torch.cat([r2t[rows[:3], seq_lens[:3] - 1].long(), torch.zeros(1, dtype=torch.int64)])
    positions = torch.tensor([0, 69, 150, 0], dtype=torch.int64)  # 150: a position other than seq_len - 1
    bs = len(rows)
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q = qkv[:, : hq * d].view(bs, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(bs, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(bs, hkv, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_len).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype) if norm else None
    rope = attention_kernels.DecodeRope(positions, cos_sin, qw, kw, 1e-6)
    scale = d ** -0.5
    outs, bufs = [], []
    for fused in (True, False):
        k_buf, v_buf = k0.clone(), v0.clone()
        out = torch.full((bs, hq, d), float("nan"), dtype=dtype)
        with kernel_options(early_metadata=bool(early_meta), early_kv=early_meta == "kv"):
            if fused:
                qkv_before = qkv.clone()
                decode_attention(q, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                                 num_splits=num_splits, new_kv=(k, v, loc), rope=rope)
                assert torch.equal(qkv, qkv_before)  # q and k are read, not rotated in place
            else:
                qc, kc = q.clone(), k.clone()
                if norm:
                    ew.norm_and_rope(qc, kc, positions, cos_sin, qw, kw, 1e-6)
                else:
                    ew.apply_rope(qc, kc, positions, cos_sin)
                decode_attention(qc, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                                 num_splits=num_splits, new_kv=(kc, v, loc))
        outs.append(out)
        bufs.append((k_buf, v_buf))
    assert torch.equal(outs[0][:3], outs[1][:3])
    assert torch.equal(bufs[0][0][1:], bufs[1][0][1:]) and torch.equal(bufs[0][1][1:], bufs[1][1][1:])
    assert not torch.equal(bufs[0][0][loc[1]], k[1].to(dtype))  # the stored key is the rotated one


def test_decode_fused_rope_rejects_what_it_cannot_do(force_triton):
    k_buf, v_buf = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    r2t = torch.zeros(1, 4, dtype=torch.int32)
    q, out = torch.zeros(1, 4, 16), torch.zeros(1, 4, 16)
    args = (q, k_buf, v_buf, r2t, torch.tensor([0]), i32([1]), out, 1.0)
    new_kv = (torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), torch.tensor([1]))
    whole = attention_kernels.DecodeRope(torch.tensor([0]), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="needs new_kv"):  # the rotated key is stored by the kernel
        decode_attention(*args, rope=whole)
    partial = attention_kernels.DecodeRope(torch.tensor([0]), torch.zeros(4, 8))  # Qwen3.5's partial rotary
    with pytest.raises(ValueError, match="whole-head rotary"):
        decode_attention(*args, new_kv=new_kv, rope=partial)


def test_decode_fused_store_rejects_bad_shapes():
    k_buf, v_buf = torch.zeros(8, 2, 16), torch.zeros(8, 2, 16)
    r2t = torch.zeros(1, 4, dtype=torch.int32)
    q, out = torch.zeros(1, 4, 16), torch.zeros(1, 4, 16)
    args = (q, k_buf, v_buf, r2t, torch.tensor([0]), i32([1]), out, 1.0)
    with pytest.raises(AssertionError):  # k for 3 rows in a batch of 1
        decode_attention(*args, new_kv=(torch.zeros(3, 2, 16), torch.zeros(1, 2, 16), torch.tensor([1])))
    with pytest.raises(AssertionError):  # last dim not contiguous
        decode_attention(*args, new_kv=(torch.zeros(1, 16, 2).transpose(1, 2), torch.zeros(1, 2, 16),
                                        torch.tensor([1])))


def test_decode_num_splits_is_host_only():
    assert decode_num_splits(1, 8, 32768) > 1
    assert decode_num_splits(1, 8, 100) == 1  # too short to be worth splitting
    assert decode_num_splits(512, 8, 32768) == 1  # the batch alone fills the GPU
    assert decode_num_splits(1, 1, None) == 64


def test_decode_split_waves_sets_how_many_programs_the_splits_make():
    # 16 requests x 8 kv heads = 128 programs before splitting, on 132 SMs
    assert decode_num_splits(16, 8, 40960, 132) == 3  # two waves (the default): 264 programs wanted
    with kernel_options(decode_split_waves=4):
        assert decode_num_splits(16, 8, 40960, 132) == 5  # the option in force
    assert decode_num_splits(16, 8, 40960, 132, waves=8) == 9  # or given
    assert decode_num_splits(16, 8, 600, 132, waves=8) == 3  # still no split under 256 tokens


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


MIXED_PREFIX, MIXED_EXT = [40, 7, 0, 20], [1, 1, 50, 9]  # two decode rows, then two chunks


def _mixed_step(seed: int):
    """A mixed step of four requests (MIXED_PREFIX / MIXED_EXT) over a paged fp32 pool: (q, k_buf, v_buf, table,
    rows, prefix_lens, extend_lens, extend_start, head_dim)."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, page_size, max_len = 4, 2, 32, 4, 96
    num_pages = 4 * max_len // page_size + 1
    k_buf, v_buf = make_pool(num_pages * page_size, hkv, d, torch.float32, gen)
    r2t = make_slot_table(4, max_len, page_size, num_pages, gen)
    prefix_lens, extend_lens = i32(MIXED_PREFIX), i32(MIXED_EXT)
    extend_start = torch.cumsum(extend_lens, 0, dtype=torch.int32) - extend_lens
    q = torch.randn(int(extend_lens.sum()), hq, d, generator=gen)
    return q, k_buf, v_buf, r2t, torch.tensor([2, 0, 3, 1]), prefix_lens, extend_lens, extend_start, d


def test_extend_attention_from_a_first_row():
    """first_row=n computes requests n.. only (a mixed step's decode rows go to the decode kernel): their rows
    equal the full call's, and the rows of requests 0..n-1 are left untouched."""
    q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start, d = _mixed_step(11)
    full = extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start,
                            torch.full_like(q, float("nan")), d ** -0.5, 50)
    for first in (1, 2, 3):
        part = extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start,
                                torch.full_like(q, float("nan")), d ** -0.5, 50, first_row=first)
        own = int(extend_start[first])
        assert torch.isnan(part[:own]).all()
        assert torch.equal(part[own:], full[own:])


def test_extend_tile_list_orders_pads_and_bounds():
    """One (request, block) pair per block of new tokens from first_row on, the blocks with the most keys first,
    padded with blocks past every extend; the bound holds every split of a shape's tokens."""
    tiles = attention_kernels.extend_tile_list([0, 40, 7, 0], [1, 1, 50, 9], block_m=16, first_row=2)
    pairs = tiles.reshape(-1, 2).tolist()
    # request 2: 50 new tokens over 7 cached -> blocks 0..3 seeing 23, 39, 55, 57 keys; request 3: 9 keys
    assert pairs == [[2, 3], [2, 2], [2, 1], [2, 0], [3, 0]]
    padded = attention_kernels.extend_tile_list([0, 40, 7, 0], [1, 1, 50, 9], 16, first_row=2, pad_to=8)
    assert padded.reshape(-1, 2)[:5].tolist() == pairs
    assert (padded.reshape(-1, 2)[5:, 1] * 16 > 10 ** 6).all()  # blocks past any extend: the programs exit
    with pytest.raises(ValueError, match="do not fit"):
        attention_kernels.extend_tile_list([0], [100], 16, pad_to=6)
    bound = attention_kernels.extend_tiles_bound
    for tokens, reqs in ((64, 4), (100, 7), (16, 16)):
        even = tokens // reqs
        for split in ([tokens - reqs + 1] + [1] * (reqs - 1), [even] * (reqs - 1) + [tokens - even * (reqs - 1)]):
            n = len(attention_kernels.extend_tile_list([0] * reqs, split, 16)) // 2
            assert n <= bound(tokens, reqs, 16), (tokens, reqs, split)


def test_extend_attention_from_a_tile_list_matches_the_grid():
    """The tile list's programs compute what the grid's do, to the bit: with and without a first row, padded."""
    q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start, d = _mixed_step(12)
    for first in (0, 2):
        grid = extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start,
                                torch.full_like(q, float("nan")), d ** -0.5, 50, block_m=32, first_row=first)
        for pad in (None, 12):
            tiles = torch.from_numpy(attention_kernels.extend_tile_list(MIXED_PREFIX, MIXED_EXT, 32, first,
                                                                         pad_to=pad))
            listed = extend_attention(q, k_buf, v_buf, r2t, rows, prefix_lens, extend_lens, extend_start,
                                      torch.full_like(q, float("nan")), d ** -0.5, 50, block_m=32,
                                      first_row=first, tiles=tiles)
            assert torch.equal(listed.isnan(), grid.isnan()) and torch.equal(listed.nan_to_num(), grid.nan_to_num())


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


@pytest.mark.parametrize("extend_tiles", [False, True], ids=["grid", "tiles"])
@pytest.mark.parametrize("mixed_split", [True, False], ids=["mixed_split", "mixed_one_launch"])
@pytest.mark.parametrize("fused_store", [True, False], ids=["fused_store", "store_kv"])
def test_triton_backend_matches_torch_backend(fused_store, mixed_split, extend_tiles, monkeypatch, options_for_test):
    """Extend, decode, then a mixed step (a decode row first, a chunk after it) through the backend API (the K/V
    store included), against the torch backend: the same outputs and the same pool. With the option
    decode_fused_store the decode step stores inside the decode kernel and never calls the pool's store; off, and in
    every extend step, it stores through the pool first. With mixed_decode_split the mixed step's decode row takes
    the decode kernel (one row) and the chunk the extend kernel. With extend_tiles the extend kernel runs from the
    step's tile list."""
    from minisgl.attention import triton_backend
    options_for_test(decode_fused_store=fused_store, mixed_decode_split=mixed_split, extend_tiles=extend_tiles)
    decode_rows = []  # rows of every decode-kernel launch, and whether the step was a decode step
    kernel = triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda q, *a, **kw: (decode_rows.append((meta.is_decode, q.shape[0])), kernel(q, *a, **kw))[1])
    plans = []  # every count of a step's leading decode rows: once a step (prepare), not once a layer
    leading = triton_backend.leading_decode_rows
    monkeypatch.setattr(triton_backend, "leading_decode_rows", lambda m: (plans.append(m), leading(m))[1])
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page_size, layers = 8, 2, 64, 4, 2
    num_pages, max_len = 40, 48
    caches = [KVCache(layers, num_pages, page_size, hkv, d, torch.float32, "cpu") for _ in range(2)]
    stores = []  # (is_decode, layer) of every store through the Triton backend's pool
    pool_store = caches[1].store
    monkeypatch.setattr(caches[1], "store", lambda layer, *a: (stores.append((meta.is_decode, layer)),
                                                                pool_store(layer, *a)))
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
    steps.append((_meta(rows, [22, 38], [1, 5], None, None, False), False))
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
    expected = [(False, layer) for layer in range(layers)]
    if not fused_store:
        expected += [(True, layer) for layer in range(layers)]
    expected += [(False, layer) for layer in range(layers)]
    assert stores == expected
    assert decode_rows == [(True, 2)] * layers + ([(False, 1)] * layers if mixed_split else [])
    assert len(plans) == (2 if mixed_split else 0)  # the two extend steps, each planned once for both layers


def _launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What makes Triton compile a new variant of `kernel` for a launch: the constexprs, each tensor's dtype and
    16-byte alignment, and each int's specialisation (== 1, a multiple of 16) unless marked do_not_specialize."""
    plain = kernel.kwargs.get("do_not_specialize") or []  # the interpreter's kernel keeps the jit options

    def spec(name, a):
        if isinstance(a, torch.Tensor):
            return ("tensor", a.dtype, a.data_ptr() % 16 == 0)
        if isinstance(a, bool) or not isinstance(a, int) or name in plain:
            return type(a).__name__
        return ("int", a == 1, a % 16 == 0)
    return tuple(map(spec, kernel.arg_names, args)) + tuple(sorted(kwargs.items()))


@pytest.mark.parametrize("fused_store", [True, False], ids=["fused_store", "store_kv"])
def test_mixed_decode_rows_reuse_the_decode_graph_variants(fused_store, monkeypatch, options_for_test):
    """A mixed step with any number of decode rows launches the decode kernels exactly as a decode step of one of
    the CUDA-graph batch sizes does (same constexprs, alignments and int specialisations), so serving compiles no
    kernel variant after the graphs are captured; launches are recorded, not run."""
    from minisgl.engine.cuda_graph import default_batch_sizes
    options_for_test(decode_fused_store=fused_store)
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(attention_kernels, name)

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, _launch_key(self.kernel, args, kwargs)))

    for name in ("_decode_stage1_kernel", "_decode_stage2_kernel", "_extend_kernel"):
        monkeypatch.setattr(attention_kernels, name, Recorder(name))
    hq, hkv, d, max_len, rows = 16, 8, 128, 4096, 320
    cache = KVCache(1, rows * 8 + 1, 16, hkv, d, torch.bfloat16, "cpu")
    monkeypatch.setattr(cache, "store", lambda *a: None)  # the K/V values do not matter here
    r2t = torch.zeros(rows, max_len, dtype=torch.int32)
    backend = TritonAttentionBackend(cache, r2t, hq, hkv, d, d ** -0.5, max_context_len=max_len)
    sizes = default_batch_sizes(256)
    backend.init_cuda_graph_state(max(sizes))

    def step(ext: list[int], is_decode: bool):
        t = sum(ext)
        meta = _meta(list(range(len(ext))), [100] * len(ext), ext, None, None, is_decode)
        meta.out_cache_loc = torch.arange(t, dtype=torch.int64)
        qkv = torch.zeros(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)  # q, k, v are views of it, as in the model
        q, k, v = (qkv[:, a * d:b * d].view(t, b - a, d) for a, b in ((0, hq), (hq, hq + hkv),
                                                                       (hq + hkv, hq + 2 * hkv)))
        backend.prepare(meta)
        backend.forward(q, k, v, 0)

    for bs in sizes:  # what graph capture compiles
        step([1] * bs, True)
    graph_variants = {key for name, key in launches if name.startswith("_decode")}
    launches.clear()
    for n in range(1, rows):  # mixed steps: n decode rows first, then a chunk of 40
        step([1] * n + [40], False)
    mixed = {key for name, key in launches if name.startswith("_decode")}
    assert mixed and mixed <= graph_variants
    assert len({key for name, key in launches if name == "_extend_kernel"}) == 1  # first_row is not specialised


def test_triton_backend_decode_workspaces_across_batch_sizes():
    """Split decode steps of several batch sizes through the backend: sizes up to the graph bound share the
    graph workspace, larger ones an eager one that grows; each must match the torch backend, and both
    workspaces' merge counters must be back at zero after every step."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, page_size, max_len, rows_total = 4, 2, 64, 1, 600, 6
    caches = [KVCache(1, rows_total * max_len + 1, page_size, hkv, d, torch.float32, "cpu") for _ in range(2)]
    r2t = make_slot_table(rows_total, max_len, page_size, rows_total * max_len, gen) + 1  # slot 0 reserved
    scale = d ** -0.5
    ref_be = TorchAttentionBackend(caches[0], r2t, hq, hkv, d, scale)
    tri = TritonAttentionBackend(caches[1], r2t, hq, hkv, d, scale, max_context_len=max_len)
    assert tri.num_splits_for(1) > 1 and tri.num_splits_for(rows_total) > 1  # every step here merges splits
    tri.init_cuda_graph_state(max_bs=4)
    for buf in caches:  # every key the steps read is defined (the steps store only the new token's K/V)
        buf.buffer.copy_(torch.randn(buf.buffer.shape, generator=torch.Generator().manual_seed(1)))
    for step, bs in enumerate((3, 1, 6, 4, 2, 5, 1)):
        rows = torch.randperm(rows_total, generator=gen)[:bs].tolist()
        prefix = torch.randint(0, max_len, (bs,), generator=gen).tolist()
        meta = _meta(rows, prefix, [1] * bs, None, None, True)
        meta.out_cache_loc = torch.stack([r2t[r, p] for r, p in zip(rows, prefix)]).long()
        q = torch.randn(bs, hq, d, generator=gen)
        k = torch.randn(bs, hkv, d, generator=gen)
        v = torch.randn(bs, hkv, d, generator=gen)
        ref_be.prepare(meta)
        if bs <= 4:
            tri.prepare_for_capture(meta)  # the graph path: the fixed workspace every captured size shares
        else:
            tri.prepare(meta)
        out = tri.forward(q, k, v, 0)
        assert rel_err(out, ref_be.forward(q, k, v, 0).float()) < 1e-3, (step, bs)
        for ws, bound in ((tri._graph_workspace, 4), (tri._eager_workspace, tri._eager_ws_bs)):
            if ws is not None:
                assert torch.equal(_counters(ws, bound * hkv), torch.zeros(bound * hkv, dtype=torch.int32))


# ------------------------------------------------------------------ elementwise -----------------------------


@pytest.fixture
def force_triton(options_for_test):
    options_for_test(triton_on_cpu=True)


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
    # the kernel option early_metadata (the position and its cos/sin read first) changes nothing, to the bit
    q_early, k_early = q_sep.clone(), k_sep.clone()  # any inputs: the same ones both ways
    q_plain, k_plain = q_sep.clone(), k_sep.clone()
    ew.norm_and_rope(q_plain, k_plain, positions, cos_sin, wq, wk, 1e-6)
    with kernel_options(early_metadata=True):
        ew.norm_and_rope(q_early, k_early, positions, cos_sin, wq, wk, 1e-6)
    assert torch.equal(q_early, q_plain) and torch.equal(k_early, k_plain)


def test_elementwise_cpu_path_without_force():
    """Without the option, CPU tensors take the torch reference (what CI, which has no Triton, runs)."""
    from minisgl.kernels.options import current_options
    x = torch.randn(3, 16)
    w = torch.ones(16)
    assert not current_options().triton_on_cpu
    assert torch.equal(ew.rms_norm(x, w, 1e-6), ew.rms_norm_ref(x, w, 1e-6))


# ------------------------------------------------------------------ engine ----------------------------------


def test_engine_with_the_fused_rope_matches_hf_and_the_unfused_engine(qwen3_path, make_llm, monkeypatch):
    """The kernel option decode_fused_rope: the model's rotary embedding becomes a DeferredRotary, each decode
    step's attention call gets the rotation (a `rope`) and launches no RoPE kernel of its own, prefill and mixed
    steps still rotate first; the greedy tokens are Hugging Face's, and the same as the engine's without the option
    (the Triton kernels under the interpreter, norms and RoPE included, so both rotate with the same code)."""
    from helpers import assert_parity, hf_greedy
    from triton.runtime.interpreter import InterpretedFunction

    from minisgl import SamplingParams
    from minisgl.attention import triton_backend
    from minisgl.attention.fused_rope import DeferredRotary

    calls = []  # (kernel, a rope given) in launch order
    decode, run = triton_backend.decode_attention, InterpretedFunction.run

    def recorded_decode(*args, **kwargs):
        calls.append(("decode_attention", kwargs.get("rope") is not None))
        return decode(*args, **kwargs)

    def recorded_run(self, *args, **kwargs):
        calls.append((self.fn.__name__, None))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", recorded_decode)
    monkeypatch.setattr(InterpretedFunction, "run", recorded_run)
    prompts = [[7, 3], [5, 9, 17, 3, 44, 8, 21, 60, 2, 7, 11, 13, 14, 15, 16, 19, 23]]  # a mixed step or two
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    common = dict(dtype="float32", attention_backend="triton", page_size=4, chunked_prefill_size=8,
                  triton_on_cpu=True)
    outs = {}
    for fused in (True, False):
        llm = make_llm(qwen3_path, decode_fused_rope=fused, **common)
        runner = llm.engine.runner
        deferred = [m for m in runner.model.modules() if isinstance(m, DeferredRotary)]
        assert runner.fused_rope == len(deferred) == int(fused)
        calls.clear()
        outs[fused] = llm.generate(prompts, params)
        # R: a RoPE launch; F: a decode attention call given the rotation; D: one given rotated q and k (a mixed
        # step's decode rows, or any decode step without the option)
        steps = "".join({"_rope_kernel": "R", "decode_attention": "F" if rope else "D"}.get(k, "")
                        for k, rope in calls)
        if fused:  # decode steps: one fused call a layer and no RoPE launch; mixed steps rotate all first
            assert "FF" in steps and "RF" not in steps and "RD" in steps
        else:
            assert "F" not in steps and "DD" not in steps
        assert "R" in steps  # the prompts' steps rotate first either way
    refs = hf_greedy(qwen3_path, prompts, max_new_tokens=5)
    assert_parity(outs[True], refs, prompts)
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]


@pytest.mark.parametrize("fused_store,early_kv", [(True, False), (False, False), (True, True)],
                         ids=["fused_store", "store_kv", "early_kv"])
def test_engine_on_triton_backend_matches_hf(fused_store, early_kv, qwen3_path, make_llm, monkeypatch):
    """A tiny Qwen3 (fp32) through the engine on the Triton attention backend under the interpreter, with the
    decode K/V store in the decode kernel and as a separate store (and with the early keys: the first key tile
    read before the wait): greedy tokens equal Hugging Face's, and every decode attention call stored its K/V
    itself exactly when the switch is on."""
    from helpers import assert_parity, hf_greedy

    from minisgl import SamplingParams
    from minisgl.attention import triton_backend

    fused_calls = []
    run = triton_backend.decode_attention

    def recorded(*args, **kwargs):
        fused_calls.append(kwargs.get("new_kv") is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "decode_attention", recorded)
    prompts = [[5, 9, 17, 3, 44, 8, 21, 60, 2, 7, 11], [100, 4, 4, 4, 33], [7]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = make_llm(qwen3_path, dtype="float32", attention_backend="triton", page_size=4,
                   decode_fused_store=fused_store, early_kv=early_kv)
    outs = llm.generate(prompts, params)
    assert_parity(outs, hf_greedy(qwen3_path, prompts, max_new_tokens=5), prompts)
    assert fused_calls and set(fused_calls) == {fused_store}
