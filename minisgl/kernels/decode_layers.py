"""Every decoder layer of a batch-1 decode step in one persistent kernel (the kernel option `decode_megakernel`).

Why. At batch 1 a decode step of a small model is a chain of ~260 short kernels, and each link costs its own
latency whatever work it does: run27's anatomy of Qwen3-0.6B's step on an H100 (1,016 us) found ~60% of it in the
links, not in the bytes. Here the decoder layers run in one launch of resident programs, six phases a layer with
a grid barrier after each (five where phases 2 and 3 share one):

1. input RMSNorm + qkv projection (the GEMV with the norm folded in: every program computes the row's rstd from
   its exact sum of squares, kernels/gemv.py; program 0 writes the new residual);
2. attention, one work item per (kv head, split): Qwen3's q/k norms and the RoPE on q and on the new key (the
   fused RoPE's `norm_rope_full`), the new K/V stored, the split's keys read through the token table (the decode
   kernel's online softmax), the partial output and log-sum-exp written;
3. the splits merged, one item per q head (`_merge_head`, as the decode kernel's second launch); or (`merge_last`,
   the default) inside phase 2, by whichever program finishes a kv head's last split (a barrier a layer fewer);
4. o projection;
5. post-attention RMSNorm + gate_up projection (folded as in 1);
6. down projection with the SiLU-and-mul folded in.

Before a GEMV phase's barrier each program loads its first weight block of that phase (weights are never written, as
the GEMV's early tiles under PDL); with `early_kv` (off; a lab arm) also, before the attention phase's, its first
work item's first key tile (the decode kernel's early keys, the new token's row patched in from registers). The
arithmetic is the engine's own helpers' with the engine's tiles and split count, so the hidden state, the residual
and the stored K/V are meant to equal the one-launch-per-op path to the bit: so they do under the interpreter
(tests/test_persistent_kernels.py). On an H100 (reports/h100/run28) layers 0-13 did and layer 14's attention was one
element in 2,048 a rounding apart: the merge's sum over splits followed a layout the compiler chose per kernel; it
now adds the splits in order (kernels/attention.py, `_merge_head`), and on an H100 (reports/h100/run39) every arm
gave the engine's bits (lab.checks.decode_megakernel). Measured there, the kernel was slower than the launches
(run28: 906-1,111 us against 827-909 for Qwen3-0.6B's layers; run39, with each program's whole share of a matmul
loaded across the barrier too: 857-998 us against 719): its grid barriers cost ~1-2.6 us each, as much as the kernel
boundaries they replace, and its GEMV phases streamed at 1.7-2.2 TB/s in run28; hence the option stays off.

The grid barrier. A CTA barrier, then thread 0 adds 1 to a global counter with release semantics at GPU scope
and spins on acquire loads until every program has arrived, then a CTA barrier: the cooperative-groups grid sync,
in Triton. It needs every program resident at once: the launcher sizes the grid from the compiled kernel's
registers and shared memory (`resident_per_sm`), launches eagerly as a cooperative launch (the driver refuses a
grid that does not fit) and, inside a CUDA graph, as a plain one (a replay runs alone on its stream, and the kernel
after it is no PDL dependent, so nothing else holds an SM). A spin gives up after SPIN_LIMIT tries rather than
hang; the output is then wrong, so the lab check compares before it times anything.

In the engine (engine/decode_layers.py, when the option is on) `LayerStack.of` stacks each kind of layer weight
into one tensor, the layers' parameters becoming views of it (no second copy), and a `DecodeLayers` takes the
place of the model's layer list: a one-row decode step goes through the kernel, every other step through the
layers one by one, as before. Qwen3-style dense models only (per-head q/k norms, no biases, a whole-head rotary),
one GPU, the Triton attention backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.kernels.elementwise import _jit  # triton.jit where Triton is installed

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.attention import (
        _LOG2E,
        _decode_block_n,
        _decode_keys,
        _load_kv,
        _merge_head,
        _rope_cos_sin,
        _rope_heads_tile,
        _split_plan,
        _tile_accumulate,
        _tile_softmax,
    )
    from minisgl.kernels.gemv import _gemv_tile, _load_w, _norm_prologue
except ImportError:  # CPU-only installs: the layers run one by one
    triton = None
    tl = None

__all__ = ["SPIN_LIMIT", "DecodeLayersKernel", "DecodeStep", "LayerStack", "resident_per_sm"]

SPIN_LIMIT = 1 << 16  # tries: ms at worst per barrier, where a legitimate wait is microseconds
MAX_PER_SM = 4  # programs an SM at most (more only where registers allow)


@_jit
def _first_w(W, t, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight block (tile t, k 0) of W [N, K]: masked to zeros when t is past the last tile."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return _load_w(W, offs_n, offs_n < N, offs_k, offs_k < K, K)


@_jit
def _tile(W, X, R, NW, rstd, Y, N, K, t, w0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
          NORM: tl.constexpr, HAS_W0: tl.constexpr):
    """Y[tile t] = X @ W[tile t].T for one row, the engine's GEMV arithmetic (with NORM, X is first added to the
    residual R and RMS-normed with weight NW and the row's rstd, as the GEMV's folded norm does); w0 is the
    tile's first weight block when HAS_W0 (loaded earlier)."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, 1)
    m_mask = offs_m < 1
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    if HAS_W0:
        acc = _gemv_tile(acc, w0, X, R, NW, rstd, offs_m, m_mask, offs_k, offs_k < K, K, 0, 0, SILU, NORM, NORM)
    for k0 in range(BLOCK_K if HAS_W0 else 0, K, BLOCK_K):
        k = k0 + offs_k
        w = _load_w(W, offs_n, n_mask, k, k < K, K)
        acc = _gemv_tile(acc, w, X, R, NW, rstd, offs_m, m_mask, k, k < K, K, 0, 0, SILU, NORM, NORM)
    tl.store(Y + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=n_mask[None, :])


@_jit
def _matmul(W, X, Y, N, K, pid, P, w0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
            PREFETCH: tl.constexpr, R=None, NW=None, RES_OUT=None, eps=0.0, NORM: tl.constexpr = False,
            AHEAD: tl.constexpr = False):
    """This program's share of one matmul: tiles pid, pid + P, ...; with PREFETCH the first tile's first weight
    block is w0, loaded before the barrier. With AHEAD each tile's first block is loaded while the tile before it
    is computed (two tiles' loads in flight a program, not one). With NORM, the input is rms_norm(X + R) * NW,
    computed in every program from the row's exact sum of squares (the GEMV's folded norm, kernels/gemv.py), and
    program 0 writes X + R to RES_OUT. The same arithmetic, in the same order, either way."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    if pid < n_tiles:
        rstd = tl.zeros((1,), dtype=tl.float32)
        if NORM:
            offs_m = tl.arange(0, 1)
            rstd = _norm_prologue(X, R, RES_OUT, offs_m, offs_m < 1, tl.arange(0, BLOCK_K), K, 0, 0, 0, eps, 1,
                                  BLOCK_K, True)
        if AHEAD:
            w_cur = w0 if PREFETCH else _first_w(W, pid, N, K, BLOCK_N, BLOCK_K)
            for t in range(pid, n_tiles, P):
                w_next = _first_w(W, t + P, N, K, BLOCK_N, BLOCK_K)  # all masked past the last tile: no load
                _tile(W, X, R, NW, rstd, Y, N, K, t, w_cur, BLOCK_N, BLOCK_K, SILU, NORM, True)
                w_cur = w_next
        else:
            _tile(W, X, R, NW, rstd, Y, N, K, pid, w0, BLOCK_N, BLOCK_K, SILU, NORM, PREFETCH)
            for t in range(pid + P, n_tiles, P):
                _tile(W, X, R, NW, rstd, Y, N, K, t, w0, BLOCK_N, BLOCK_K, SILU, NORM, False)


@_jit
def _now():
    """The GPU's global nanosecond timer (the same clock on every SM)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@_jit
def _arrive(Counter, Times=None, slot=0, TIMES: tl.constexpr = False):
    """This program's arrival at a grid barrier (with TIMES, its time goes to Times[slot]'s first int64)."""
    if TIMES:
        tl.store(Times + 2 * slot, _now())
    # every thread's stores before thread 0's release; its acquire (in _wait) before every thread's loads after
    tl.debug_barrier()
    tl.atomic_add(Counter, 1, sem="release", scope="gpu")


@_jit
def _wait(Counter, target, SPIN: tl.constexpr, Times=None, slot=0, TIMES: tl.constexpr = False):
    """Wait until `target` arrivals (every program's, this barrier and all before; with TIMES, the departure time
    goes to Times[slot]'s second int64)."""
    seen = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
    tries = 0
    while (seen < target) & (tries < SPIN):  # a program never resident would hang it
        seen = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
        tries += 1
    tl.debug_barrier()
    if TIMES:
        tl.store(Times + 2 * slot + 1, _now())


@_jit
def _grid_barrier(Counter, target, SPIN: tl.constexpr, Times=None, slot=0, TIMES: tl.constexpr = False):
    """Arrive, then wait until `target` arrivals."""
    _arrive(Counter, Times, slot, TIMES)
    _wait(Counter, target, SPIN, Times, slot, TIMES)


@_jit
def _barrier_loading(Counter, target, SPIN: tl.constexpr, Times, slot, TIMES: tl.constexpr, W, t, N, K, w_else,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                     ARRIVE_FIRST: tl.constexpr):
    """A grid barrier with the next matmul's first weight block (tile t of W [N, K]) loaded across it (PREFETCH;
    else w_else is returned): before this program's arrival, or, with ARRIVE_FIRST, after it, while it waits. A
    release orders the loads before it too, so a load issued first may hold the arrival back until it lands;
    weights are never written by a kernel, so reading them on either side of the barrier is safe."""
    w = w_else
    if PREFETCH and not ARRIVE_FIRST:
        w = _first_w(W, t, N, K, BLOCK_N, BLOCK_K)
    _arrive(Counter, Times, slot, TIMES)
    if PREFETCH and ARRIVE_FIRST:
        w = _first_w(W, t, N, K, BLOCK_N, BLOCK_K)
    _wait(Counter, target, SPIN, Times, slot, TIMES)
    return w


@_jit
def _first_keys(KL, VL, ReqToToken, ReqPoolIdx, SeqLens, item, stride_kn, stride_kh, stride_r2t,
                HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys and values of work item `item`'s first key tile (all masked when there is no such item): what
    `_attend` with EARLY takes, read before the barrier into the attention phase (the decode kernel's early keys:
    every slot but the new token's holds a key of an earlier step; `_attend` patches that row in from registers)."""
    seq_len = tl.load(SeqLens).to(tl.int32)
    split_len, _ = _split_plan(seq_len, SPLITS, BLOCK_N)
    start = (item % SPLITS) * split_len
    end = tl.minimum(start + split_len, seq_len)
    kvh = item // SPLITS
    offs_n = start + tl.arange(0, BLOCK_N)
    nmask = (offs_n < end) & (item < HKV * SPLITS)
    row = tl.load(ReqPoolIdx).to(tl.int64)
    slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=nmask, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    dmask = offs_d < D
    return (_load_kv(KL, slots, nmask, kvh, stride_kn, stride_kh, offs_d, dmask),
            _load_kv(VL, slots, nmask, kvh, stride_kn, stride_kh, offs_d, dmask))


@_jit
def _attend(QKV, KL, VL, PartO, PartLse, WQN, WKN, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin,
            kvh, split, row0, qk_scale, eps, stride_cs, stride_kn, stride_kh, stride_r2t,
            HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, IEEE_DOT: tl.constexpr,
            k0=None, v0=None, EARLY: tl.constexpr = False):
    """One (kv head, split) of the decode kernel's stage 1 for request row 0, with the fused store and the fused
    RoPE (kernels/attention.py's `_decode_stage1_kernel`, ROPE and FUSED_STORE on, no PDL); with EARLY, its first
    key tile's keys and values are k0, v0 (`_first_keys`), as the decode kernel's EARLY_KV."""
    GROUP: tl.constexpr = HQ // HKV
    seq_len = tl.load(SeqLens).to(tl.int32)
    split_len, _ = _split_plan(seq_len, SPLITS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_n0 = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    dmask = offs_d < D
    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_g
    hmask = offs_g < GROUP
    if start < end:
        cos, sin, sign = _rope_cos_sin(Pos, CosSin, row0, stride_cs, D)
        if end == seq_len:  # this split holds the new token: store its K/V before reading any key
            slot = tl.load(OutLoc).to(tl.int64)
            kn = tl.reshape(_rope_heads_tile(QKV + (HQ + kvh) * D, 0, WKN, cos, sin, sign, eps, 1, 1, D, True),
                            (D,))
            tl.store(KL + slot * stride_kn + kvh * stride_kh + offs_d, kn.to(KL.dtype.element_ty))
            vn = tl.load(QKV + (HQ + HKV + kvh) * D + offs_d)
            tl.store(VL + slot * stride_kn + kvh * stride_kh + offs_d, vn.to(VL.dtype.element_ty))
            tl.debug_barrier()  # every thread's store before any thread's key loads (the decode kernel's reason)
            if EARLY:  # the early tile read this slot before the store: the new row, from registers
                new_row = (offs_n0 == seq_len - 1)[:, None]
                k0 = tl.where(new_row, kn.to(KL.dtype.element_ty)[None, :], k0)
                v0 = tl.where(new_row, vn.to(VL.dtype.element_ty)[None, :], v0)
        row = tl.load(ReqPoolIdx).to(tl.int64)
        q = _rope_heads_tile(QKV + kvh * GROUP * D, D, WQN, cos, sin, sign, eps, GROUP, BLOCK_H, D, True)
        q = q.to(KL.dtype.element_ty)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
        first = start
        if EARLY:
            m_i, l_i, alpha, p = _tile_softmax(q, m_i, l_i, k0, offs_n0 < end, qk_scale, IEEE_DOT)
            acc = _tile_accumulate(acc, alpha, p, v0, IEEE_DOT)
            first = start + BLOCK_N
        m_i, l_i, acc = _decode_keys(q, m_i, l_i, acc, first, end, ReqToToken + row * stride_r2t, KL, VL, kvh,
                                     stride_kn, stride_kh, stride_kn, stride_kh, offs_d, dmask, qk_scale, BLOCK_N,
                                     IEEE_DOT)
        o = acc / l_i[:, None]
        tl.store(PartO + heads[:, None] * (SPLITS * D) + split * D + offs_d[None, :], o,
                 mask=hmask[:, None] & dmask[None, :])
        tl.store(PartLse + heads * SPLITS + split, m_i + tl.log2(l_i), mask=hmask)


@_jit
def _merge_if_last(Ticket, PartO, PartLse, ATT, row0, kvh, n_valid, HQ: tl.constexpr, HKV: tl.constexpr,
                   D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """After a (kv head, split) item: draw the kv head's ticket; the program that draws the last merges the kv
    head's q heads. The decode kernel's fused merge (kernels/attention.py) explains the ordering: a CTA barrier
    before the ticket so every thread's partials precede thread 0's release, one after it so the merging
    program's loads follow its acquire. Every split draws a ticket, empty ones too, and the merging program
    re-arms the counter (no program of this layer touches it again; the next layer's come after a barrier)."""
    GROUP: tl.constexpr = HQ // HKV
    tl.debug_barrier()
    ticket = tl.atomic_add(Ticket, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLITS - 1:
        tl.debug_barrier()
        tl.store(Ticket, 0)
        for g in tl.static_range(GROUP):
            _merge_head(PartO, PartLse, ATT, row0, kvh * GROUP + g, n_valid, 0, SPLITS * D, D, 0, SPLITS, 0, D,
                        BLOCK_S=BLOCK_S, BLOCK_D=D, HEAD_DIM=D)


@_jit
def _attend_item(item, QKV, KL, VL, PartO, PartLse, WQN, WKN, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin,
                 row0, qk_scale, eps, stride_cs, stride_kn, stride_kh, stride_r2t, Tickets, ATT, n_valid,
                 HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, IEEE_DOT: tl.constexpr, MERGE_LAST: tl.constexpr,
                 k0=None, v0=None, EARLY: tl.constexpr = False):
    """Work item `item` of the attention phase: its (kv head, split) through `_attend` (EARLY: with k0, v0 as its
    first key tile), then, with MERGE_LAST, the kv head's ticket from Tickets (`_merge_if_last`)."""
    kvh = item // SPLITS
    _attend(QKV, KL, VL, PartO, PartLse, WQN, WKN, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin, kvh,
            item % SPLITS, row0, qk_scale, eps, stride_cs, stride_kn, stride_kh, stride_r2t, HQ, HKV, D, SPLITS,
            BLOCK_N, BLOCK_H, IEEE_DOT, k0, v0, EARLY)
    if MERGE_LAST:
        _merge_if_last(Tickets + kvh, PartO, PartLse, ATT, row0, kvh, n_valid, HQ, HKV, D, SPLITS, BLOCK_S)


@_jit
def _decode_layers_kernel(
    X, R0, R1, QKV, ATT, OUT_O, GU, PartO, PartLse, Counter,
    WLN1, WQKV, WQN, WKN, WO, WLN2, WGU, WD,
    KBuf, VBuf, layer_kv, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin,
    layers, eps, qk_eps, qk_scale, stride_cs, stride_kn, stride_kh, stride_r2t, HIDDEN, INTER,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, IEEE_DOT: tl.constexpr,
    BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
    BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
    PREFETCH: tl.constexpr, AHEAD: tl.constexpr, MERGE_LAST: tl.constexpr, SPIN: tl.constexpr,
    Times=None, TIMES: tl.constexpr = False, ARRIVE_FIRST: tl.constexpr = False, EARLY_KV: tl.constexpr = False,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    NB: tl.constexpr = 6 - MERGE_LAST  # barriers a layer
    slots = pid * (layers * NB + 1)  # this program's first Times slot: its start, then one a barrier
    if TIMES:
        tl.store(Times + 2 * slots, _now())
        tl.store(Times + 2 * slots + 1, _now())
    row0 = pid * 0  # request row 0, as a tensor: the decode helpers index with it
    N_QKV: tl.constexpr = (HQ + 2 * HKV) * D
    Q_SIZE: tl.constexpr = HQ * D
    hidden64 = tl.cast(HIDDEN, tl.int64)
    s_qkv = hidden64 * N_QKV
    s_o = hidden64 * Q_SIZE
    s_gu = hidden64 * 2 * INTER
    s_d = hidden64 * INTER
    # The residual stream alternates between R0 and R1 (a norm's programs read one while program 0 writes the
    # other): the input norm reads R0 (zeros before layer 0: x + 0 is x) and writes R1, the post-attention
    # norm reads R1 and writes R0. X holds the layer's input, then the down projection's output.
    w = _first_w(WQKV, pid, N_QKV, HIDDEN, BN_QKV, BK_QKV)
    done = 0  # barriers passed
    for layer in range(layers):
        lay = tl.cast(layer, tl.int64)
        # 1. input norm + qkv
        _matmul(WQKV + lay * s_qkv, X, QKV, N_QKV, HIDDEN, pid, P, w, BN_QKV, BK_QKV, False, PREFETCH,
                R0, WLN1 + lay * HIDDEN, R1, eps, True, AHEAD)
        done += 1
        KL = KBuf + lay * layer_kv
        VL = VBuf + lay * layer_kv
        if EARLY_KV:  # this program's first item's first key tile, read across the barrier as the weights are
            if not ARRIVE_FIRST:
                k0, v0 = _first_keys(KL, VL, ReqToToken, ReqPoolIdx, SeqLens, pid, stride_kn, stride_kh,
                                     stride_r2t, HKV, D, SPLITS, BLOCK_N)
            _arrive(Counter, Times, slots + done, TIMES)
            if ARRIVE_FIRST:
                k0, v0 = _first_keys(KL, VL, ReqToToken, ReqPoolIdx, SeqLens, pid, stride_kn, stride_kh,
                                     stride_r2t, HKV, D, SPLITS, BLOCK_N)
            _wait(Counter, done * P, SPIN, Times, slots + done, TIMES)
        else:
            _grid_barrier(Counter, done * P, SPIN, Times, slots + done, TIMES)
        # 2. attention, one (kv head, split) an item; 3. the splits merged, one q head an item: with MERGE_LAST
        # in the same phase, by whichever program finishes a kv head's last split (one barrier a layer fewer)
        _, n_valid = _split_plan(tl.load(SeqLens).to(tl.int32), SPLITS, BLOCK_N)  # the splits that saw keys
        later = pid  # the items left for the loop below
        if EARLY_KV:
            later = pid + P
            if pid < HKV * SPLITS:
                _attend_item(pid, QKV, KL, VL, PartO, PartLse, WQN + lay * D, WKN + lay * D, ReqToToken,
                             ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin, row0, qk_scale, qk_eps, stride_cs, stride_kn,
                             stride_kh, stride_r2t, Counter + 1, ATT, n_valid, HQ, HKV, D, SPLITS, BLOCK_N,
                             BLOCK_H, BLOCK_S, IEEE_DOT, MERGE_LAST, k0, v0, True)
        for item in range(later, HKV * SPLITS, P):
            _attend_item(item, QKV, KL, VL, PartO, PartLse, WQN + lay * D, WKN + lay * D, ReqToToken, ReqPoolIdx,
                         SeqLens, OutLoc, Pos, CosSin, row0, qk_scale, qk_eps, stride_cs, stride_kn, stride_kh,
                         stride_r2t, Counter + 1, ATT, n_valid, HQ, HKV, D, SPLITS, BLOCK_N, BLOCK_H, BLOCK_S,
                         IEEE_DOT, MERGE_LAST)
        if not MERGE_LAST:
            done += 1
            _grid_barrier(Counter, done * P, SPIN, Times, slots + done, TIMES)
            for h in range(pid, HQ, P):
                _merge_head(PartO, PartLse, ATT, row0, h, n_valid, 0, SPLITS * D, D, 0, SPLITS, 0, D,
                            BLOCK_S=BLOCK_S, BLOCK_D=D, HEAD_DIM=D)
        done += 1
        w_o = _barrier_loading(Counter, done * P, SPIN, Times, slots + done, TIMES, WO + lay * s_o, pid, HIDDEN,
                               Q_SIZE, w, BN_O, BK_O, PREFETCH, ARRIVE_FIRST)
        # 4. o projection
        _matmul(WO + lay * s_o, ATT, OUT_O, HIDDEN, Q_SIZE, pid, P, w_o, BN_O, BK_O, False, PREFETCH, AHEAD=AHEAD)
        done += 1
        w_gu = _barrier_loading(Counter, done * P, SPIN, Times, slots + done, TIMES, WGU + lay * s_gu, pid,
                                2 * INTER, HIDDEN, w, BN_GU, BK_GU, PREFETCH, ARRIVE_FIRST)
        # 5. post-attention norm + gate_up
        _matmul(WGU + lay * s_gu, OUT_O, GU, 2 * INTER, HIDDEN, pid, P, w_gu, BN_GU, BK_GU, False, PREFETCH,
                R1, WLN2 + lay * HIDDEN, R0, eps, True, AHEAD)
        done += 1
        w_d = _barrier_loading(Counter, done * P, SPIN, Times, slots + done, TIMES, WD + lay * s_d, pid, HIDDEN,
                               INTER, w, BN_D, BK_D, PREFETCH, ARRIVE_FIRST)
        # 6. down projection, SiLU-and-mul folded in
        _matmul(WD + lay * s_d, GU, X, HIDDEN, INTER, pid, P, w_d, BN_D, BK_D, True, PREFETCH, AHEAD=AHEAD)
        nxt = tl.cast(tl.minimum(layer + 1, layers - 1), tl.int64)
        done += 1
        w = _barrier_loading(Counter, done * P, SPIN, Times, slots + done, TIMES, WQKV + nxt * s_qkv, pid, N_QKV,
                             HIDDEN, w, BN_QKV, BK_QKV, PREFETCH, ARRIVE_FIRST)


def resident_per_sm(kernel, device: torch.device | int = 0) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, shared memory, threads, 32 blocks)."""
    props = torch.cuda.get_device_properties(device)
    threads = kernel.metadata.num_warps * 32
    regs = -(-max(1, kernel.n_regs) // 8) * 8 * threads  # registers are allocated 8 a thread at a time
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs
    smem = kernel.metadata.shared
    by_smem = getattr(props, "shared_memory_per_multiprocessor", 228 << 10) // smem if smem else 32
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    return max(0, min(by_regs, by_smem, by_threads, 32))


@dataclass(frozen=True)
class LayerStack:
    """A Qwen3 model's decoder-layer weights stacked by layer, and the shapes the kernel needs."""

    ln1: torch.Tensor  # [L, hidden]
    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, hidden]
    q_norm: torch.Tensor  # [L, D]
    k_norm: torch.Tensor
    o: torch.Tensor  # [L, hidden, Hq D]
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [L, 2 inter, hidden]
    down: torch.Tensor  # [L, hidden, inter]
    eps: float
    qk_eps: float
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, layers, share: bool = True) -> LayerStack:
        """From a model's DecoderLayers (models/decoder.py, whatever the GEMV swap made of their modules): each
        kind of weight copied into one [L, ...] tensor. With `share`, each layer's parameter becomes a view of its
        slice, so the weights are held once and the layers, run one by one, read the same memory; only before
        anything captured the old addresses (a CUDA graph would replay reads of freed memory). Without, copies."""
        def stack(get) -> torch.Tensor:
            params = [get(layer) for layer in layers]
            out = torch.empty((len(params), *params[0].shape), dtype=params[0].dtype, device=params[0].device)
            for i, p in enumerate(params):
                out[i].copy_(p.detach())
                if share:
                    p.data = out[i]  # the old storage goes once nothing else holds it
            return out

        a = layers[0].self_attn
        return cls(ln1=stack(lambda m: m.input_layernorm.weight), qkv=stack(lambda m: m.self_attn.qkv_proj.weight),
                   q_norm=stack(lambda m: m.self_attn.q_norm.weight), k_norm=stack(lambda m: m.self_attn.k_norm.weight),
                   o=stack(lambda m: m.self_attn.o_proj.weight), ln2=stack(lambda m: m.post_attention_layernorm.weight),
                   gate_up=stack(lambda m: m.mlp.gate_up_proj.weight), down=stack(lambda m: m.mlp.down_proj.weight),
                   eps=layers[0].input_layernorm.eps, qk_eps=a.q_norm.eps, num_q_heads=a.num_q_heads,
                   num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)


@dataclass
class DecodeStep:
    """What the attention phase reads for request row 0: the pool's K and V buffers of every layer ([slots, Hkv, D]
    each, equally spaced in memory, as the pool's one tensor holds them), the token table, and the step's metadata
    tensors (one element each)."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor  # [max_pos, D] fp32
    scale: float
    num_splits: int


def layer_spacing(buffers: list[torch.Tensor]) -> int:
    """Elements from one layer's buffer to the next's, the same for every layer (else an error)."""
    if len(buffers) < 2:
        return 0
    size = buffers[0].element_size()
    gaps = {(b.data_ptr() - a.data_ptr()) // size for a, b in zip(buffers, buffers[1:])}
    if len(gaps) != 1:
        raise ValueError("the layers' buffers are not equally spaced in memory")
    return gaps.pop()


class DecodeLayersKernel:
    """The kernel's buffers and launch: `run(x)` takes the embedding row x [hidden] and returns (hidden state,
    residual) after the last layer, what the model's final norm receives."""

    def __init__(self, w: LayerStack, step: DecodeStep, tiles: dict, programs: int | None = None,
                 prefetch: bool = True, maxnreg: int | None = None, cooperative: bool = False,
                 ahead: bool = True, merge_last: bool = True, times: bool = False,
                 arrive_first: bool = False, early_kv: bool = False) -> None:
        """`programs`: the grid (default: as many as the compiled kernel lets every SM hold, up to MAX_PER_SM, or 1
        on a CPU, where the interpreter runs programs one after another); `maxnreg`: a cap on registers a thread
        (Triton's option), so more programs fit an SM, spilling the rest; `prefetch` / `ahead`: `_matmul`'s
        PREFETCH / AHEAD (weights loaded before a barrier / a tile ahead); `merge_last`: the splits merged by the
        program that finishes a kv head's last one, not in a phase of their own; `cooperative`: launch as a cooperative
        grid, which the driver refuses when it cannot all be resident (not inside a CUDA graph capture); `times`:
        every program stamps its start and each barrier's arrival and departure (`phase_times`); `arrive_first`: the
        next matmul's first weights loaded after this program's arrival at a barrier, not before it; `early_kv`: each
        program's first attention item's first key tile read across the barrier before the attention phase (after
        the arrival with `arrive_first`), as the decode kernel's early keys. Always 4
        warps: the decode helpers' dots must keep the decode kernel's operand layout (the same bits)."""
        self.w, self.step, self.tiles, self.prefetch, self.ahead, self.merge_last = (w, step, tiles, prefetch, ahead,
                                                                                    merge_last)
        self.arrive_first, self.early_kv = arrive_first, early_kv
        self.options = {"num_warps": 4} | ({"maxnreg": maxnreg} if maxnreg else {})
        if cooperative:
            self.options["launch_cooperative_grid"] = True
        hidden, dev, dt = w.ln1.shape[1], w.ln1.device, w.ln1.dtype
        inter = w.down.shape[2]
        hq, d, splits = w.num_q_heads, w.head_dim, step.num_splits
        self.x, self.r0, self.r1 = (torch.zeros(hidden, dtype=dt, device=dev) for _ in range(3))
        self.qkv = torch.zeros(w.qkv.shape[1], dtype=dt, device=dev)
        self.att = torch.zeros(hq * d, dtype=dt, device=dev)
        self.o = torch.zeros(hidden, dtype=dt, device=dev)
        self.gu = torch.zeros(2 * inter, dtype=dt, device=dev)
        self.part_o = torch.zeros(hq * splits * d, dtype=torch.float32, device=dev)
        self.part_lse = torch.zeros(hq * splits, dtype=torch.float32, device=dev)
        self.counter = torch.zeros(1 + w.num_kv_heads, dtype=torch.int32, device=dev)  # the barrier's, the tickets
        self.times = None  # sized once the grid is known
        self.programs = programs or 1
        if programs is None and dev.type == "cuda":
            self.programs = 1
            per_sm = min(resident_per_sm(self.compile()), MAX_PER_SM)
            if per_sm < 1:
                raise ValueError("the decode-layers kernel does not fit an SM")
            self.programs = torch.cuda.get_device_properties(dev).multi_processor_count * per_sm
        self.barriers = w.ln1.shape[0] * (6 - merge_last)
        if times:
            self.times = torch.zeros((self.programs, self.barriers + 1, 2), dtype=torch.int64, device=dev)

    def _launch(self, warmup: bool = False):
        w, s, t = self.w, self.step, self.tiles
        group = w.num_q_heads // w.num_kv_heads
        k0, v0 = s.k_buffers[0], s.v_buffers[0]
        layer_stride = layer_spacing(s.k_buffers)
        if layer_spacing(s.v_buffers) != layer_stride or v0.stride() != k0.stride():
            raise ValueError("the K and V buffers must share one layout")
        args = (self.x, self.r0, self.r1, self.qkv, self.att, self.o, self.gu, self.part_o, self.part_lse,
                self.counter, w.ln1, w.qkv, w.q_norm, w.k_norm, w.o, w.ln2, w.gate_up, w.down,
                k0, v0, layer_stride, s.req_to_token, s.req_pool_indices, s.seq_lens, s.out_cache_loc,
                s.positions, s.cos_sin, w.ln1.shape[0], w.eps, w.qk_eps, s.scale * _LOG2E, s.cos_sin.stride(0),
                k0.stride(0), k0.stride(1), s.req_to_token.stride(0), w.ln1.shape[1], w.down.shape[2])
        kw = dict(HQ=w.num_q_heads, HKV=w.num_kv_heads, D=w.head_dim, SPLITS=s.num_splits,
                  BLOCK_N=_decode_block_n(w.head_dim), BLOCK_H=max(16, triton.next_power_of_2(group)),
                  BLOCK_S=max(2, triton.next_power_of_2(s.num_splits)), IEEE_DOT=k0.dtype == torch.float32,
                  BN_QKV=t["qkv"][0], BK_QKV=t["qkv"][1], BN_O=t["o"][0], BK_O=t["o"][1],
                  BN_GU=t["gate_up"][0], BK_GU=t["gate_up"][1], BN_D=t["down"][0], BK_D=t["down"][1],
                  PREFETCH=self.prefetch, AHEAD=self.ahead, MERGE_LAST=self.merge_last, SPIN=SPIN_LIMIT,
                  Times=self.times, TIMES=self.times is not None, ARRIVE_FIRST=self.arrive_first,
                  EARLY_KV=self.early_kv, **self.options)
        if warmup:
            return _decode_layers_kernel.warmup(*args, grid=(self.programs,), **kw)
        return _decode_layers_kernel[(self.programs,)](*args, **kw)

    def compile(self):
        """The compiled kernel, loaded but not launched (its registers say how many programs fit an SM)."""
        kernel = self._launch(warmup=True)
        kernel._init_handles()
        return kernel

    def phase_times(self) -> torch.Tensor:
        """After a run with `times`: [barriers, 3] ns, for each barrier (in order; `6 - merge_last` a layer) the
        phase before it (the last arrival less the earliest departure from the barrier before), the wait after the
        last arrival until the first departure, and the spread of departures."""
        t = self.times.double()
        arrive, leave = t[:, 1:, 0], t[:, :, 1]
        last_in = arrive.max(0).values
        phase = last_in - leave[:, :-1].min(0).values
        return torch.stack([phase, leave[:, 1:].min(0).values - last_in,
                            leave[:, 1:].max(0).values - leave[:, 1:].min(0).values], 1)

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x.reshape(-1))
        self.r0.zero_()
        self.counter.zero_()
        self._launch()
        return self.x, self.r0
