"""Check and time minisgl's Triton kernels on a CUDA GPU (written for the H200).

Decode and extend attention in bf16 with Qwen3 head shapes (Hq 16 / 32, Hkv 8, D 128), page sizes 1 and 16,
contexts up to 32k, against an fp32 torch reference on the GPU; a CUDA-graph capture/replay of decode; the
elementwise kernels against their torch references. Timings come from triton.testing.do_bench.
Decode runs both split merges (the decode_fused_merge option's A/B: merged by the last stage-1 program, or a second
launch); each row carries both errors and times (`us`, `rel_err`, `kv_gbps` are the fused path's).
Decode's K/V store runs both ways too (the decode_fused_store option's A/B: stored by the decode kernel, or
store_kv first),
each captured in a CUDA graph, the fused side's new slots poisoned with NaN before every replay so that a key
read before its store landed shows up.

    python -m lab.checks.kernels --out results.json [--quick]
    python -m lab.checks.kernels --out results.json --decode-merge-only   # the merge A/B alone
    python -m lab.checks.kernels --out results.json --decode-store-only   # the store A/B alone

Exits non-zero if any check fails; the JSON holds every case either way.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from lab.models import attention_shape
from lab.timing import capture, time_us
from minisgl.attention.base import AttentionMetadata
from minisgl.kernels import elementwise as ew
from minisgl.kernels.attention import (
    decode_attention,
    decode_merge_counters,
    decode_num_splits,
    decode_shared_workspace_numel,
    decode_workspace_numel,
    extend_attention,
    extend_block_m,
    extend_tile_list,
    extend_tiles_bound,
)
from minisgl.kernels.options import current_options
from minisgl.kvcache.pool import KVCache

DEV = torch.device("cuda")
HEADS = {name: attention_shape(name) for name in ("qwen3-0.6b", "qwen3-8b")}  # (q heads, kv heads, dim)
MAX_CONTEXT = 32768
NUM_SMS = torch.cuda.get_device_properties(DEV).multi_processor_count if torch.cuda.is_available() else 132
# Steps as a prefill graph holds them: (name, (token bucket, request bucket), prefixes, extends). A 24/s step (one
# 1k prompt beside 30 decode rows of ~1k context), a burst's mixed step in the largest bucket (an 8k chunk of ten
# prompts beside 250 decode rows), a W1-like prefill of four prompts, and one short prompt alone in a big bucket.
EXTEND_TILE_CASES = [
    ("rate24_mixed", (2048, 64), [1000 + 7 * i for i in range(30)] + [0], [1] * 30 + [1024]),
    ("burst_mixed", (8704, 512), [900 + i for i in range(250)] + [0] * 10, [1] * 250 + [819] * 10),
    ("w1_prefill", (4096, 4), [0] * 4, [1000, 900, 1024, 700]),
    ("short_in_big", (4096, 64), [0], [40]),
]


def make_cache(lens: list[int], page_size: int, hkv: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """A pool with room for every request's pages plus slack, K/V filled with N(0,1)."""
    num_pages = sum((n + page_size - 1) // page_size for n in lens) + 8
    k = torch.randn(num_pages * page_size, hkv, d, generator=gen, device=DEV, dtype=dtype)
    v = torch.randn(num_pages * page_size, hkv, d, generator=gen, device=DEV, dtype=dtype)
    return k, v, num_pages


def make_table(lens: list[int], page_size: int, num_pages: int, width: int, gen: torch.Generator):
    """req_to_token [B, width]: each request gets shuffled pages, offsets in order inside a page."""
    b = len(lens)
    table = torch.zeros(b, width, dtype=torch.int32, device=DEV)
    perm = torch.randperm(num_pages - 1, generator=gen, device=DEV) + 1
    used = 0
    for i, n in enumerate(lens):
        pages = (n + page_size - 1) // page_size
        mine = perm[used: used + pages]
        used += pages
        pos = torch.arange(n, device=DEV)
        table[i, :n] = (mine[pos // page_size] * page_size + pos % page_size).to(torch.int32)
    return table


def ref_attention(q, k_buf, v_buf, table, rows, prefix, ext, start, scale, q_chunk=1024):
    out = torch.empty(q.shape, dtype=torch.float32, device=DEV)
    group = q.shape[1] // k_buf.shape[1]
    for row, pre, n, st in zip(rows.tolist(), prefix.tolist(), ext.tolist(), start.tolist()):
        seq = pre + n
        slots = table[row, :seq].long()
        keys = k_buf[slots].float().repeat_interleave(group, dim=1)
        vals = v_buf[slots].float().repeat_interleave(group, dim=1)
        for c in range(0, n, q_chunk):
            c_end = min(n, c + q_chunk)
            s = torch.einsum("nhd,shd->hns", q[st + c: st + c_end].float(), keys) * scale
            qpos = torch.arange(pre + c, pre + c_end, device=DEV)[:, None]
            s.masked_fill_(torch.arange(seq, device=DEV)[None, :] > qpos, float("-inf"))
            out[st + c: st + c_end] = torch.einsum("hns,shd->nhd", s.softmax(-1), vals)
    return out


def rel(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, bool]:
    nan = bool(torch.isnan(out).any())
    err = (out.float() - ref).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-6), nan


MERGES = (("fused", True), ("two_launch", False))  # decode_attention's fused_merge, both sides of the A/B


def check_decode(model: str, page_size: int, bs: int, ctx: int, gen: torch.Generator, results: list) -> None:
    hq, hkv, d = HEADS[model]
    lens = torch.randint(max(1, ctx // 2), ctx + 1, (bs,), generator=gen, device=DEV).tolist()
    lens[0] = ctx
    k_buf, v_buf, num_pages = make_cache(lens, page_size, hkv, d, torch.bfloat16, gen)
    table = make_table(lens, page_size, num_pages, MAX_CONTEXT, gen)
    rows = torch.randperm(bs, generator=gen, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)[rows]
    q = torch.randn(bs, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    scale = d ** -0.5
    splits = decode_num_splits(bs, hkv, MAX_CONTEXT, NUM_SMS)
    # zeroed: the fused merge's counters live at its end and must start at zero
    ws = torch.zeros(max(1, decode_workspace_numel(bs, hq, d, splits, hkv)), dtype=torch.float32, device=DEV)
    ref = ref_attention(q, k_buf, v_buf, table, rows, seq_lens - 1, torch.ones_like(seq_lens),
                        torch.arange(bs, device=DEV), scale)
    kv_bytes = 2 * sum(lens) * hkv * d * 2
    row = dict(kernel="decode", model=model, page_size=page_size, bs=bs, ctx=ctx, splits=splits)
    ok = True
    for name, fused in MERGES:
        out.fill_(float("nan"))
        run = functools.partial(decode_attention, q, k_buf, v_buf, table, rows, seq_lens, out, scale,
                                max_seq_len=MAX_CONTEXT, workspace=ws, num_splits=splits, fused_merge=fused)
        run()
        torch.cuda.synchronize()
        err, rerr, nan = rel(out, ref)
        # Timed as a CUDA-graph replay, as the engine runs decode: no Python launch overhead in the number.
        ms = do_bench_cudagraph(run, rep=50)
        torch.cuda.synchronize()
        # after hundreds of replays: the last one's output still right, the counters back at zero
        err2, rerr2, nan2 = rel(out, ref)
        err, rerr, nan = max(err, err2), max(rerr, rerr2), nan or nan2
        zero = splits == 1 or not bool(decode_merge_counters(ws, bs, hkv).any())
        row.update({f"{name}_us": ms * 1e3, f"{name}_rel_err": rerr, f"{name}_max_abs_err": err,
                    f"{name}_nan": nan, f"{name}_counters_zero": zero})
        ok = ok and not nan and rerr < 2e-2 and zero
    row.update(max_abs_err=row["fused_max_abs_err"], rel_err=row["fused_rel_err"], nan=row["fused_nan"],
               us=row["fused_us"], kv_gbps=kv_bytes / (row["fused_us"] * 1e-6) / 1e9,
               fused_saves_us=row["two_launch_us"] - row["fused_us"], ok=ok)
    results.append(row)


def check_decode_graph(gen: torch.Generator, results: list, replays: int = 40) -> None:
    """Capture decode (both merges) for two batch sizes on one shared workspace, as the engine's graphs share
    theirs, then replay them in turn with other rows / lengths written into the same buffers: lengths from 0
    (a padded row) and 1 up to 16k, so splits past a request's end and fully empty rows come up. Every replay is
    checked against the reference, and the fused merge's counters must be all zero after the last one."""
    hq, hkv, d = HEADS["qwen3-8b"]
    page_size, max_bs = 16, 8
    lens = [MAX_CONTEXT // 2] * 16
    k_buf, v_buf, num_pages = make_cache(lens, page_size, hkv, d, torch.bfloat16, gen)
    table = make_table(lens, page_size, num_pages, MAX_CONTEXT, gen)
    rows = torch.arange(max_bs, device=DEV)
    seq_lens = torch.full((max_bs,), 100, dtype=torch.int32, device=DEV)
    q = torch.randn(max_bs, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    out = torch.zeros_like(q)
    scale = d ** -0.5
    sizes = (max_bs, 3)
    splits_of = functools.partial(decode_num_splits, num_kv_heads=hkv, max_seq_len=MAX_CONTEXT, num_sms=NUM_SMS)
    ws = torch.zeros(decode_shared_workspace_numel(sizes, hq, hkv, d, splits_of), dtype=torch.float32,
                     device=DEV)
    graphs = {}
    for bs in sizes:
        for name, fused in MERGES:
            run = functools.partial(decode_attention, q[:bs], k_buf, v_buf, table, rows[:bs], seq_lens[:bs],
                                    out[:bs], scale, max_seq_len=MAX_CONTEXT, workspace=ws,
                                    num_splits=splits_of(bs), fused_merge=fused)
            graphs[bs, name], _ = capture(run)
    worst, ok, empty_rows_zero = 0.0, True, True
    for trial in range(replays):
        bs = sizes[trial % 2]
        name = MERGES[(trial // 2) % 2][0]
        rows.copy_(torch.randperm(16, generator=gen, device=DEV)[:max_bs])
        hi = (1, 300, MAX_CONTEXT // 2)[trial % 3]  # short, mid, long: the split count stays the same
        seq_lens.copy_(torch.randint(0, hi + 1, (max_bs,), generator=gen, device=DEV).to(torch.int32))
        seq_lens[trial % bs] = 0 if trial % 4 == 0 else 1
        q.copy_(torch.randn(max_bs, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16))
        out.fill_(float("nan"))
        graphs[bs, name].replay()
        torch.cuda.synchronize()
        live = seq_lens[:bs] > 0
        ref = ref_attention(q[:bs], k_buf, v_buf, table, rows[:bs], (seq_lens[:bs] - 1).clamp_min(0),
                            live.to(torch.int32), torch.arange(bs, device=DEV), scale)
        if live.any():
            _, rerr, nan = rel(out[:bs][live], ref[live])
            worst = max(worst, rerr)
            ok = ok and not nan and rerr < 2e-2
        empty_rows_zero = empty_rows_zero and bool((out[:bs][~live] == 0).all())
    counters_zero = not bool(decode_merge_counters(ws, max(sizes), hkv).any())
    results.append(dict(kernel="decode_cuda_graph", sizes=list(sizes), splits=[splits_of(b) for b in sizes],
                        replays=replays, rel_err=worst, empty_rows_zero=empty_rows_zero,
                        counters_zero=counters_zero, ok=ok and empty_rows_zero and counters_zero))


def _store_then(bufs, loc, k, v, attend) -> None:
    """The unfused decode layer: store_kv's launch, then attention over the stored keys."""
    ew.store_kv(*bufs, loc, k, v)
    attend()


def check_decode_store(model: str, page_size: int, bs: int, ctx: int, gen: torch.Generator, results: list,
                       trials: int = 20) -> None:
    """DECODE_FUSED_STORE's A/B at one shape: decode_attention storing the new K/V itself (new_kv=) against
    store_kv then decode_attention, each captured in a CUDA graph as the engine runs a decode layer, k/v as views
    of a qkv output. Before every replay the fused side's new slots are set to NaN: a key tile read before the
    store landed (a missing barrier) turns the row's output into NaN. The batch holds a row of one key and, from
    3 rows up, a CUDA-graph padded last row (slot 0, seq_len 1). Both sides must give the same buffers and the
    reference's output, for both split merges; times are the default merge's replays (`saves_us` = store_kv's
    launch and gap, per layer)."""
    hq, hkv, d = HEADS[model]
    lens = torch.randint(max(1, ctx // 2), ctx + 1, (bs,), generator=gen, device=DEV).tolist()
    lens[0] = ctx
    if bs > 1:
        lens[1] = 1  # the new token is the request's only key
    pad = bs >= 3
    if pad:
        lens[-1] = 1
    k0, v0, num_pages = make_cache(lens, page_size, hkv, d, torch.bfloat16, gen)  # make_table leaves page 0 free
    table = make_table(lens, page_size, num_pages, MAX_CONTEXT, gen)
    rows = torch.arange(bs, device=DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    loc = table[rows, seq_lens - 1].long()
    if pad:
        loc[-1] = 0  # a padded row: stores to the reserved slot 0, reads its stale row's position 0
    live = loc != 0
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : hq * d].view(bs, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(bs, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(bs, hkv, d)
    scale = d ** -0.5
    splits = decode_num_splits(bs, hkv, MAX_CONTEXT, NUM_SMS)
    row = dict(kernel="decode_store", model=model, page_size=page_size, bs=bs, ctx=ctx, splits=splits,
               padded_row=pad, default_fused_merge=current_options().decode_fused_merge)
    ok = True
    for merge, fused_merge in MERGES:
        bufs = {side: (k0.clone(), v0.clone()) for side in ("fused", "store_kv")}
        outs = {side: torch.empty(bs, hq, d, device=DEV, dtype=torch.bfloat16) for side in bufs}
        # zeroed: the fused merge's counters live at the end and must start at zero
        wss = {side: torch.zeros(max(1, decode_workspace_numel(bs, hq, d, splits, hkv)), dtype=torch.float32,
                                 device=DEV) for side in bufs}
        attend = {side: functools.partial(decode_attention, q, *bufs[side], table, rows, seq_lens, outs[side], scale,
                                          max_seq_len=MAX_CONTEXT, workspace=wss[side], num_splits=splits,
                                          fused_merge=fused_merge) for side in bufs}
        runs = {"fused": functools.partial(attend["fused"], new_kv=(k, v, loc)),
                "store_kv": functools.partial(_store_then, bufs["store_kv"], loc, k, v, attend["store_kv"])}
        graphs = {side: capture(fn)[0] for side, fn in runs.items()}
        worst, nan, diff, bitwise, same_bufs = 0.0, False, 0.0, True, True
        for trial in range(trials):
            qkv.copy_(torch.randn(qkv.shape, generator=gen, device=DEV, dtype=torch.bfloat16))
            kf, vf = bufs["fused"]
            kf[loc[live]] = float("nan")  # poison: only the kernel's own store can make these keys finite
            vf[loc[live]] = float("nan")
            for side in ("fused", "store_kv"):
                outs[side].fill_(float("nan"))
                graphs[side].replay()
            torch.cuda.synchronize()
            of, ou = outs["fused"][live], outs["store_kv"][live]
            nan = nan or bool(torch.isnan(of).any())
            d_abs = (of.float() - ou.float()).abs().max().item()
            diff = max(diff, d_abs / max(ou.float().abs().max().item(), 1e-6))
            bitwise = bitwise and torch.equal(of, ou)
            (ku, vu) = bufs["store_kv"]
            same_bufs = same_bufs and torch.equal(kf[1:], ku[1:]) and torch.equal(vf[1:], vu[1:])
            if pad:  # slot 0 holds the padded row's k/v
                same_bufs = same_bufs and torch.equal(kf[0], k[-1]) and torch.equal(vf[0], v[-1])
            if trial in (0, trials - 1):
                ref = ref_attention(q, kf, vf, table, rows, seq_lens - 1, torch.ones_like(seq_lens),
                                    torch.arange(bs, device=DEV), scale)
                worst = max(worst, rel(outs["fused"][live], ref[live])[1])
        counters_zero = splits == 1 or not bool(decode_merge_counters(wss["fused"], bs, hkv).any())
        row.update({f"{merge}_merge_rel_err": worst, f"{merge}_merge_nan": nan, f"{merge}_merge_vs_store_kv": diff,
                    f"{merge}_merge_bitwise_equal": bitwise, f"{merge}_merge_same_buffers": same_bufs,
                    f"{merge}_merge_counters_zero": counters_zero})
        ok = ok and not nan and worst < 2e-2 and diff < 1e-2 and same_bufs and counters_zero
        if fused_merge == current_options().decode_fused_merge:  # time the merge the engine runs
            for side, fn in runs.items():
                row[f"{side}_us"] = do_bench_cudagraph(fn, rep=50) * 1e3
            row["saves_us"] = row["store_kv_us"] - row["fused_us"]
    row["ok"] = ok
    results.append(row)


def check_backend(backend: str, model: str, page_size: int, gen: torch.Generator, results: list) -> None:
    """A GPU backend against TorchAttentionBackend: an eager mixed extend step (prefills and a decode row),
    then decode steps replayed from a CUDA graph captured through the backend's hooks (store_kv included).
    Also times one decode layer of each backend at a few batch shapes."""
    from minisgl.attention import create_backend

    hq, hkv, d = HEADS[model]
    layers, bs, max_len = 2, 4, 2048
    caches = [KVCache(layers, bs * max_len // page_size + 1, page_size, hkv, d, torch.bfloat16, DEV)
              for _ in range(2)]
    table = torch.zeros(bs, max_len, dtype=torch.int32, device=DEV)
    pos = torch.arange(max_len, device=DEV)
    pages = (torch.randperm(bs * max_len // page_size, generator=gen, device=DEV) + 1).view(bs, -1)
    table[:] = (pages[:, pos // page_size] * page_size + pos % page_size).to(torch.int32)
    scale = d ** -0.5
    kw = dict(req_to_token=table, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, scale=scale,
              max_context_len=max_len)
    ref_be = create_backend("torch", kv_cache=caches[0], **kw)
    gpu_be = create_backend(backend, kv_cache=caches[1], **kw)

    def meta_for(prefix, ext, is_decode):
        p_t = torch.tensor(prefix, dtype=torch.int32, device=DEV)
        e_t = torch.tensor(ext, dtype=torch.int32, device=DEV)
        loc = torch.cat([table[i, p: p + e] for i, (p, e) in enumerate(zip(prefix, ext))]).long()
        return AttentionMetadata(is_decode, torch.arange(bs, device=DEV), p_t + e_t, p_t, e_t,
                                 torch.cumsum(e_t, 0, dtype=torch.int32) - e_t, loc, max_len, max(ext),
                                 [p + e for p, e in zip(prefix, ext)], list(prefix), list(ext))

    worst, ok = 0.0, True
    # three steps: fresh prefills (one of a single token), then chunks over those prefixes plus a decode row, then
    # two leading decode rows, a chunk and a trailing decode row (the Triton backend's mixed split: the leading
    # rows take the decode kernel, the rest the extend kernel)
    lens = [0] * bs
    for ext in ([700, 1, 1500, 33], [300, 1, 17, 999], [1, 1, 40, 1]):
        m = meta_for(lens, ext, False)
        ref_be.prepare(m)
        gpu_be.prepare(m)
        t = sum(ext)
        for layer in range(layers):
            q, k, v = (torch.randn(t, h, d, generator=gen, device=DEV, dtype=torch.bfloat16)
                       for h in (hq, hkv, hkv))
            _, e, nan = rel(gpu_be.forward(q, k, v, layer), ref_be.forward(q, k, v, layer).float())
            worst, ok = max(worst, e), ok and not nan
        lens = [n + e for n, e in zip(lens, ext)]

    # decode through a captured graph: static buffers, refreshed in place before each replay
    gpu_be.init_cuda_graph_state(bs)
    static = meta_for(lens, [1] * bs, True)
    sq = torch.zeros(bs, hq, d, device=DEV, dtype=torch.bfloat16)
    sk = torch.zeros(bs, hkv, d, device=DEV, dtype=torch.bfloat16)
    sv = torch.zeros_like(sk)
    gpu_be.prepare_for_capture(static)
    graph, outs = capture(lambda: [gpu_be.forward(sq, sk, sv, layer) for layer in range(layers)])
    # the warm-up and capture wrote garbage K/V at the first decode slots; the steps below overwrite them
    for _ in range(3):
        m = meta_for(lens, [1] * bs, True)
        for buf, val in ((static.seq_lens, m.seq_lens), (static.prefix_lens, m.prefix_lens),
                         (static.out_cache_loc, m.out_cache_loc)):
            buf.copy_(val)
        static.seq_lens_cpu = m.seq_lens_cpu  # as the graph runner passes them
        ref_be.prepare(m)
        gpu_be.prepare_for_replay(static)
        # the graph runs every layer on the same static q/k/v, so the reference does too
        sq.copy_(torch.randn(bs, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16))
        sk.copy_(torch.randn(bs, hkv, d, generator=gen, device=DEV, dtype=torch.bfloat16))
        sv.copy_(torch.randn(bs, hkv, d, generator=gen, device=DEV, dtype=torch.bfloat16))
        refs = [ref_be.forward(sq.clone(), sk.clone(), sv.clone(), layer) for layer in range(layers)]
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            _, e, nan = rel(outs[layer], refs[layer].float())
            worst, ok = max(worst, e), ok and not nan
        lens = [n + 1 for n in lens]
    ok = ok and worst < 2e-2 and torch.equal(caches[0].buffer, caches[1].buffer)
    results.append(dict(kernel=f"{backend}_backend_vs_torch", model=model, page_size=page_size, rel_err=worst,
                        ok=ok))


def time_backends(backends: list[str], gen: torch.Generator, results: list) -> None:
    """One decode layer (KV store + attention, metadata prepared outside the timing) per backend, as a CUDA graph
    replay, at Qwen3-0.6B head shapes and page size 1; plus one prefill layer (eager)."""
    from minisgl.attention import create_backend

    hq, hkv, d = HEADS["qwen3-0.6b"]
    for bs, ctx, is_decode in ((1, 4096, True), (64, 1024, True), (256, 1024, True), (256, 4096, True),
                               (4, 2048, False)):
        ext = 1 if is_decode else ctx // 2
        prefix = ctx - ext
        lens = [ctx] * bs
        num_slots = bs * ctx + 8
        kv = KVCache(1, num_slots, 1, hkv, d, torch.bfloat16, DEV)
        kv.buffer.normal_(generator=gen)
        table = (torch.randperm(num_slots - 1, generator=gen, device=DEV)[: bs * ctx] + 1).view(bs, ctx)
        table = table.to(torch.int32)
        p_t = torch.full((bs,), prefix, dtype=torch.int32, device=DEV)
        e_t = torch.full((bs,), ext, dtype=torch.int32, device=DEV)
        loc = table[:, prefix:ctx].reshape(-1).long()
        meta = AttentionMetadata(is_decode, torch.arange(bs, device=DEV), p_t + e_t, p_t, e_t,
                                 torch.arange(bs, device=DEV, dtype=torch.int32) * ext, loc, ctx, ext,
                                 lens, [prefix] * bs, [ext] * bs)
        q = torch.randn(bs * ext, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(bs * ext, hkv, d, generator=gen, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        row = dict(kernel="backend_timing", bs=bs, ctx=ctx, phase="decode" if is_decode else "prefill")
        outs = {}
        for name in backends:
            try:
                be = create_backend(name, kv_cache=kv, req_to_token=table, num_q_heads=hq, num_kv_heads=hkv,
                                    head_dim=d, scale=d ** -0.5, max_context_len=ctx)
                fn = functools.partial(be.forward, q, k, v, 0)
                if is_decode:  # as the engine runs it: captured through the backend's graph hooks
                    be.init_cuda_graph_state(bs)
                    be.prepare_for_capture(meta)
                    graph, out = capture(fn)
                    be.prepare_for_replay(meta)
                    graph.replay()
                    run = graph.replay
                else:
                    be.prepare(meta)
                    out = fn()
                    run = fn
                torch.cuda.synchronize()
                outs[name] = out.float()
                row[f"{name}_us"] = 1e3 * do_bench(run, rep=50)
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
        if len(outs) == 2:
            a, b = outs.values()
            row["rel_diff"] = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        row["ok"] = not any(key.endswith("_error") for key in row) and row.get("rel_diff", 0.0) < 2e-2
        row["kv_bytes"] = 2 * bs * ctx * hkv * d * 2
        results.append(row)


def check_extend(model: str, page_size: int, name: str, prefix: list[int], ext: list[int],
                 gen: torch.Generator, results: list) -> None:
    hq, hkv, d = HEADS[model]
    lens = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, num_pages = make_cache(lens, page_size, hkv, d, torch.bfloat16, gen)
    table = make_table(lens, page_size, num_pages, MAX_CONTEXT, gen)
    b = len(lens)
    rows = torch.arange(b, device=DEV)
    prefix_t = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    ext_t = torch.tensor(ext, dtype=torch.int32, device=DEV)
    start_t = torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t
    total = sum(ext)
    q = torch.randn(total, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    scale = d ** -0.5
    run = lambda: extend_attention(q, k_buf, v_buf, table, rows, prefix_t, ext_t, start_t, out,  # noqa: E731
                                   scale, max(ext))
    run()
    torch.cuda.synchronize()
    ref = ref_attention(q, k_buf, v_buf, table, rows, prefix_t, ext_t, start_t, scale)
    err, rerr, nan = rel(out, ref)
    ms = do_bench(run, warmup=5, rep=30)
    # causal FLOPs: each query j of a request sees prefix + j + 1 keys; QK^T and PV, 2 FLOPs per MAC
    flops = sum(4 * hq * d * (n * p + n * (n + 1) / 2) for p, n in zip(prefix, ext))
    results.append(dict(kernel="extend", model=model, page_size=page_size, case=name, prefix=prefix[:4],
                        ext=ext[:4], batch=b, max_abs_err=err, rel_err=rerr, nan=nan,
                        ok=(not nan and rerr < 2e-2), us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12))


def check_extend_tiles(name: str, shape: tuple[int, int], prefix: list[int], ext: list[int],
                       gen: torch.Generator, results: list) -> None:
    """The extend kernel on one step laid out as a prefill graph of `shape` (tokens, requests) lays it out:
    the graph's grid (every request of the bucket x the token bucket in blocks; padded requests extend by 0)
    against its tile list padded to the bound (kernel option extend_tiles), each in a CUDA graph, and the step's own
    eager grid. Outputs equal to the bit on the real rows (the same programs compute them). Qwen3-0.6B heads."""
    hq, hkv, d = HEADS["qwen3-0.6b"]
    tokens, reqs = shape
    lens = [p + e for p, e in zip(prefix, ext)]
    k_buf, v_buf, num_pages = make_cache(lens, 1, hkv, d, torch.bfloat16, gen)
    table = make_table(lens, 1, num_pages, MAX_CONTEXT, gen)
    real, total = len(ext), sum(ext)
    pad = reqs - real
    padded_prefix, padded_ext = prefix + [0] * pad, ext + [0] * pad
    prefix_t = torch.tensor(padded_prefix, dtype=torch.int32, device=DEV)
    ext_t = torch.tensor(padded_ext, dtype=torch.int32, device=DEV)
    start_t = torch.cumsum(ext_t, 0, dtype=torch.int32) - ext_t
    start_t[real:] = tokens  # as pad_extend_step: past every real token
    rows = torch.zeros(reqs, dtype=torch.int64, device=DEV)
    rows[:real] = torch.arange(real, device=DEV)
    q = torch.randn(tokens, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    bm = extend_block_m(d, DEV)
    tiles = torch.from_numpy(extend_tile_list(padded_prefix, padded_ext, bm,
                                              pad_to=extend_tiles_bound(tokens, reqs, bm))).to(DEV)
    scale = d ** -0.5
    outs, row = {}, dict(kernel="extend_tiles", case=name, shape=list(shape), requests=real, tokens=total,
                         tiles=len(tiles) // 2, grid_programs=reqs * hq * triton.cdiv(tokens, bm))
    arms = {"graph_grid": dict(max_extend_len=tokens), "graph_tiles": dict(max_extend_len=tokens, tiles=tiles)}
    for label, kw in arms.items():
        out = torch.zeros_like(q)
        graph, _ = capture(lambda out=out, kw=kw: extend_attention(q, k_buf, v_buf, table, rows, prefix_t, ext_t,
                                                                   start_t, out, scale, **kw))
        graph.replay()
        torch.cuda.synchronize()
        outs[label] = out[:total].clone()
        row[f"{label}_us"] = time_us(graph.replay, iters=50)  # the replay itself: no graph of a graph (run24)
    out = torch.zeros_like(q)
    row["eager_grid_us"] = 1e3 * do_bench(lambda: extend_attention(q, k_buf, v_buf, table, rows[:real],
                                                                   prefix_t[:real], ext_t[:real], start_t[:real],
                                                                   out, scale, max(ext)), rep=50)
    row["same_bits"] = torch.equal(outs["graph_grid"], outs["graph_tiles"])
    row["ok"] = row["same_bits"] and not outs["graph_tiles"].isnan().any().item()
    results.append(row)


def check_sdpa_baseline(model: str, n: int, gen: torch.Generator, results: list) -> None:
    """torch's own causal SDPA (flash) on contiguous q/k/v of one prefill, for scale."""
    hq, hkv, d = HEADS[model]
    q = torch.randn(1, hq, n, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, d, generator=gen, device=DEV, dtype=torch.bfloat16)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                                 enable_gqa=True)
    ms = do_bench(f, warmup=5, rep=30)
    flops = 4 * hq * d * n * (n + 1) / 2
    results.append(dict(kernel="sdpa_baseline", model=model, n=n, us=ms * 1e3,
                        tflops=flops / (ms * 1e-3) / 1e12, ok=True))


def check_elementwise(gen: torch.Generator, results: list) -> None:
    t, h, inter = 4096, 4096, 12288
    dt = torch.bfloat16
    x = torch.randn(t, h, generator=gen, device=DEV, dtype=dt)
    r = torch.randn(t, h, generator=gen, device=DEV, dtype=dt)
    w = (1 + 0.1 * torch.randn(h, generator=gen, device=DEV)).to(dt)

    def add(name, out, ref, fn, bytes_moved, tol=2 ** -7):
        if isinstance(out, tuple):
            err = max((a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)
                      for a, b in zip(out, ref))
        else:
            err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
        ms = do_bench(fn, warmup=10, rep=50)
        results.append(dict(kernel=name, rel_err=err, ok=err < tol, us=ms * 1e3,
                            gbps=bytes_moved / (ms * 1e-3) / 1e9))

    add("rms_norm", ew.rms_norm(x, w, 1e-6), ew.rms_norm_ref(x, w, 1e-6), lambda: ew.rms_norm(x, w, 1e-6),
        2 * x.numel() * 2)
    add("fused_add_rms_norm", ew.fused_add_rms_norm(x, r, w, 1e-6), ew.fused_add_rms_norm_ref(x, r, w, 1e-6),
        lambda: ew.fused_add_rms_norm(x, r, w, 1e-6), 4 * x.numel() * 2)
    gu = torch.randn(t, 2 * inter, generator=gen, device=DEV, dtype=dt)
    add("silu_and_mul", ew.silu_and_mul(gu), ew.silu_and_mul_ref(gu), lambda: ew.silu_and_mul(gu),
        3 * t * inter * 2)
    hq, hkv, d = HEADS["qwen3-8b"]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen, device=DEV, dtype=dt)
    qn = qkv[:, : hq * d].view(t, hq, d)
    wn = torch.randn(d, generator=gen, device=DEV, dtype=dt)
    add("head_rms_norm", ew.rms_norm(qn, wn, 1e-6), ew.rms_norm_ref(qn, wn, 1e-6),
        lambda: ew.rms_norm(qn, wn, 1e-6), 2 * qn.numel() * 2)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(MAX_CONTEXT, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    pos = torch.randint(0, MAX_CONTEXT, (t,), generator=gen, device=DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    q_ref, k_ref = q.clone(), k.clone()
    ew.apply_rope_ref(q_ref, k_ref, pos, cos_sin)
    q2, k2 = q.clone(), k.clone()
    ew.apply_rope(q, k, pos, cos_sin)
    add("apply_rope", (q, k), (q_ref, k_ref), lambda: ew.apply_rope(q2, k2, pos, cos_sin),
        2 * (q.numel() + k.numel()) * 2, tol=2 ** -6)
    # K/V of the qkv views to shuffled slots of a layer buffer, against two index-puts
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    slots = 4 * t
    loc = torch.randperm(slots, generator=gen, device=DEV)[:t]
    bufs = [torch.randn(slots, hkv, d, generator=gen, device=DEV, dtype=dt) for _ in range(2)]
    refs = [b.clone() for b in bufs]
    ew.store_kv(bufs[0], bufs[1], loc, k, v)
    ew.store_kv_ref(refs[0], refs[1], loc, k, v)
    add("store_kv", tuple(bufs), tuple(refs), lambda: ew.store_kv(bufs[0], bufs[1], loc, k, v),
        4 * k.numel() * 2, tol=1e-12)  # a copy: exact


def check_qwen35_elementwise(gen: torch.Generator, results: list) -> None:
    """Qwen3.5's fused kernels at the 0.8B shapes (hidden 1024; GDN 16 heads of 128; attention 8 q / 2 kv heads
    of 256, rotary on the first 64 dims, q read from the per-head [q | gate] view) against their references."""
    from minisgl.kernels import gdn
    t, hid, dt = 4096, 1024, torch.bfloat16

    def add(name, out, ref, fn, bytes_moved, tol=2 ** -7):
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        err = max((a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)
                  for a, b in zip(outs, refs))
        ms = do_bench(fn, warmup=10, rep=50)
        results.append(dict(kernel=name, rel_err=err, ok=err < tol, us=ms * 1e3,
                            gbps=bytes_moved / (ms * 1e-3) / 1e9))

    x = torch.randn(t, hid, generator=gen, device=DEV, dtype=dt)
    r = torch.randn(t, hid, generator=gen, device=DEV, dtype=dt)
    w = (0.1 * torch.randn(hid, generator=gen, device=DEV)).to(dt)  # zero-centred: the scale is 1 + w
    add("q35_zero_centred_rms_norm", ew.rms_norm(x, w, 1e-6, zero_centred=True),
        ew.zero_centred_rms_norm_ref(x, w, 1e-6), lambda: ew.rms_norm(x, w, 1e-6, zero_centred=True),
        2 * x.numel() * 2)
    add("q35_fused_add_zero_centred", ew.fused_add_rms_norm(x, r, w, 1e-6, zero_centred=True),
        ew.fused_add_rms_norm_ref(x, r, w, 1e-6, zero_centred=True),
        lambda: ew.fused_add_rms_norm(x, r.clone(), w, 1e-6, zero_centred=True), 4 * x.numel() * 2)
    hv, dv = 16, 128
    proj = torch.randn(t, 2 * hv * dv, generator=gen, device=DEV, dtype=dt)  # [o | z], z a strided slice
    o, z = proj[:, : hv * dv].reshape(t, hv, dv).contiguous(), proj[:, hv * dv:].view(t, hv, dv)
    wg = (1 + 0.1 * torch.randn(dv, generator=gen, device=DEV)).to(dt)
    add("q35_gated_rms_norm", ew.gated_rms_norm(o, z, wg, 1e-6), ew.gated_rms_norm_ref(o, z, wg, 1e-6),
        lambda: ew.gated_rms_norm(o, z, wg, 1e-6), 3 * o.numel() * 2)
    hq, hkv, d, rot = 8, 2, 256, 64
    q_proj = torch.randn(t, hq, 2 * d, generator=gen, device=DEV, dtype=dt)  # per head [q | gate]
    attn_o = torch.randn(t, hq * d, generator=gen, device=DEV, dtype=dt)
    gate = q_proj[..., d:]
    add("q35_sigmoid_mul", ew.sigmoid_mul(attn_o, gate), ew.sigmoid_mul_ref(attn_o, gate.reshape(t, hq * d)),
        lambda: ew.sigmoid_mul(attn_o, gate), 3 * attn_o.numel() * 2)
    kv = torch.randn(t, 2 * hkv * d, generator=gen, device=DEV, dtype=dt)
    q, k = q_proj[..., :d], kv[:, : hkv * d].view(t, hkv, d)
    wq, wk = [(0.1 * torch.randn(d, generator=gen, device=DEV)).to(dt) for _ in range(2)]
    inv = 1.0 / (1e7 ** (torch.arange(0, rot, 2, device=DEV).float() / rot))
    freqs = torch.outer(torch.arange(MAX_CONTEXT, device=DEV).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)  # rot wide: the rest of each head is not turned
    pos = torch.randint(0, MAX_CONTEXT, (t,), generator=gen, device=DEV)
    q_ref, k_ref = ew.norm_and_rope_ref(q.clone(), k.clone(), pos, cos_sin, wq, wk, 1e-6, zero_centred=True)
    k_run = k.clone()
    q_out = torch.empty(t, hq, d, device=DEV, dtype=dt)
    ew.norm_and_rope(q, k_run, pos, cos_sin, wq, wk, 1e-6, zero_centred=True, q_out=q_out)
    add("q35_norm_and_partial_rope", (q_out, k_run), (q_ref, k_ref),
        lambda: ew.norm_and_rope(q, k.clone(), pos, cos_sin, wq, wk, 1e-6, zero_centred=True, q_out=q_out),
        2 * (q_out.numel() + k.numel()) * 2, tol=2 ** -6)
    ab = torch.randn(t, 2 * hv, generator=gen, device=DEV, dtype=dt)  # slices of the fused in-projection
    a, b = ab[:, :hv], ab[:, hv:]
    a_log = torch.empty(hv, device=DEV).uniform_(0.01, 16, generator=gen).log()
    dt_bias = torch.ones(hv, device=DEV)
    add("q35_gdn_gating", gdn.gdn_gating(a, b, a_log, dt_bias), gdn.gdn_gating_ref(a, b, a_log, dt_bias),
        lambda: gdn.gdn_gating(a, b, a_log, dt_bias), 4 * t * hv * 2, tol=2 ** -7)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--backends-only", default=None,
                    help="comma list (e.g. triton,flashinfer): only the backend checks and timings")
    ap.add_argument("--decode-merge-only", action="store_true",
                    help="only decode: fused vs two-launch split merge (check + time) and the graph replay check")
    ap.add_argument("--decode-store-only", action="store_true",
                    help="only decode: K/V stored by the decode kernel vs store_kv first (check + time)")
    ap.add_argument("--extend-tiles-only", action="store_true",
                    help="only the extend kernel's graph grid against its tile list, on prefill-graph shapes")
    ap.add_argument("--elementwise-only", action="store_true",
                    help="only the elementwise kernels (Qwen3's and Qwen3.5's), not attention")
    args = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: list[dict] = []
    t0 = time.time()

    def guarded(fn, *a):
        try:
            fn(*a, gen, results)
        except Exception as e:  # record and go on: one bad case should not hide the others
            results.append(dict(kernel=fn.__name__, args=repr(a), ok=False, error=f"{type(e).__name__}: {e}"))
        print(json.dumps(results[-1]), flush=True)

    if args.decode_merge_only:
        guarded(check_decode_graph)
        for model in HEADS:
            for bs in (1, 8, 64, 256):
                for ctx in (1024, 8192):
                    guarded(check_decode, model, 1, bs, ctx)
        return finish(args, results, t0)
    if args.decode_store_only:
        for model in HEADS:
            for page_size in (1, 16):
                for bs in (1, 2, 8, 64):
                    for ctx in (1024, 8192):
                        guarded(check_decode_store, model, page_size, bs, ctx)
        return finish(args, results, t0)
    if args.elementwise_only:
        guarded(check_elementwise)
        guarded(check_qwen35_elementwise)
        return finish(args, results, t0)
    if args.extend_tiles_only:
        for name, shape, prefix, ext in EXTEND_TILE_CASES:
            guarded(check_extend_tiles, name, shape, prefix, ext)
        return finish(args, results, t0)
    if args.backends_only:
        names = args.backends_only.split(",")
        for name in names:
            for page_size in (1, 16):
                guarded(check_backend, name, "qwen3-0.6b", page_size)
        guarded(time_backends, names)
        return finish(args, results, t0)

    ctxs = [512, 4096, 32768]
    batches = [1, 8, 64] if not args.quick else [1, 32]
    for model in HEADS:
        for page_size in (1, 16):
            for bs in batches:
                for ctx in ctxs if not args.quick else [4096, 32768]:
                    guarded(check_decode, model, page_size, bs, ctx)
    guarded(check_decode_graph)
    for bs in (1, 8):
        for page_size in (1, 16):
            guarded(check_decode_store, "qwen3-0.6b", page_size, bs, 4096)
    for page_size in (1, 16):
        guarded(check_backend, "triton", "qwen3-8b", page_size)
    extend_cases = [
        ("prefill_4k", [0], [4096]),
        ("prefill_32k", [0], [32768]),
        ("chunk_2k_over_8k", [8192], [2048]),
        ("mixed_decode_and_chunks", [300, 5000, 17, 1000, 0] + [700] * 6, [1, 1000, 1, 513, 777] + [1] * 6),
        ("batch_8_prefill_1k", [0] * 8, [1024] * 8),
    ]
    for model in HEADS:
        for page_size in (1, 16):
            for name, prefix, ext in extend_cases:
                if args.quick and name == "prefill_32k" and page_size == 1:
                    continue
                guarded(check_extend, model, page_size, name, prefix, ext)
    for model in HEADS:
        for n in (4096, 32768):
            guarded(check_sdpa_baseline, model, n)
    guarded(check_elementwise)
    guarded(check_qwen35_elementwise)
    return finish(args, results, t0)


def finish(args, results: list, t0: float) -> int:
    ok = all(r.get("ok", False) for r in results)
    summary = dict(ok=ok, seconds=time.time() - t0, device=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__, results=results)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"{'ALL OK' if ok else 'FAILURES'}: {sum(r.get('ok', False) for r in results)}/{len(results)} "
          f"in {summary['seconds']:.0f}s -> {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
