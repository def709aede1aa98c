"""Triton attention kernels over the paged KV pool: split-K decode and causal extend (prefill over a prefix).

Both read keys through `req_to_token`, so the pool's page size never matters to them. Layouts:
- K/V buffers of one layer: `[num_slots, num_kv_heads, head_dim]`, slot = page * page_size + offset.
- `req_to_token[row, pos]` (int32) is the slot of token `pos` of the request that owns `row`.

Decode can also store the step's new K/V itself (`new_kv=`; the Triton backend does so unless the kernel option
`decode_fused_store` is off): the stage-1 program that owns a request's last position writes that token's K and V
into the buffers before it reads any key, so a decode step needs no separate store launch per layer. The switch
exists for the A/B: at batch 1 a decode step is a few hundred short kernels, and the store kernel (~1.2 us plus a
~0.4 us kernel-to-kernel gap, once per layer) is a measurable part of it; turning the switch off
(`--disable-decode-fused-store`) brings back the separate store_kv launch unchanged, to measure what the fusion
saves or to rule it out when chasing a bug.

Every kernel here takes `USE_PDL` (programmatic dependent launch, kernels/pdl.py): launched with it, a kernel may
start while its predecessor still runs, so its first statement, before any global load or store, is the wait.

The Triton import is guarded: this module imports on a machine without Triton; only the launchers fail.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kernels.elementwise import _jit, apply_rope, norm_and_rope, norm_rope_full  # _jit: triton.jit, if any
from minisgl.kernels.gemv import STAMP_FIELDS
from minisgl.kernels.options import current_options
from minisgl.kernels.pdl import pdl_enter, pdl_launch, pdl_launch_dependents, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here can run, but importing must not fail
    triton = None
    tl = None

try:  # the clocks read by the launch stamps (decode_attention(stamps=)), a diagnostic
    from triton.language.extra.cuda import globaltimer, smid
except ImportError:
    globaltimer = smid = None

__all__ = ["STAGE1_STAMP_FIELDS", "DecodeRope", "decode_attention", "decode_merge_counters", "decode_num_splits",
           "decode_programs", "decode_shared_workspace_numel", "decode_workspace_numel", "extend_attention",
           "extend_block_m", "extend_tile_list", "extend_tiles_bound"]

_LOG2E = 1.4426950408889634
_STAMP_FIELDS = tl.constexpr(STAMP_FIELDS) if tl is not None else STAMP_FIELDS
# Stage 1's stamps go on after gemv's four fields: when, after the wait, its q was ready (loaded, normalised and
# rotated), its early key tile was in registers (read before the wait), the tile's softmax and its products with the
# values were done (the early-keys path only; the other paths leave the wait's time there)
STAGE1_STAMP_FIELDS = STAMP_FIELDS + 4
_STAGE1_STAMP_FIELDS = tl.constexpr(STAGE1_STAMP_FIELDS) if tl is not None else STAGE1_STAMP_FIELDS
_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 256  # below this, another split costs more in the reduction than it saves
_DEFAULT_NUM_SMS = 132  # H200; used when the tensor is not on a CUDA device (interpreter tests)


def _require_triton() -> None:
    if triton is None:
        raise ImportError("minisgl.kernels.attention needs Triton (pip install triton); "
                          "use the torch attention backend instead")


@dataclass(frozen=True)
class DecodeRope:
    """What the decode kernel needs to apply the RoPE itself (the fused RoPE): each row's position, the rotary
    table `[max_pos, R]` fp32 (cos | sin; R the rotary width) and, for Qwen3, the per-head norms' weights."""

    positions: torch.Tensor
    cos_sin: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 0.0

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation as its own launch (kernels/elementwise.py), as the model would have run it."""
        if self.q_norm is None:
            return apply_rope(q, k, self.positions, self.cos_sin)
        return norm_and_rope(q, k, self.positions, self.cos_sin, self.q_norm, self.k_norm, self.eps)

    def fits(self, q: torch.Tensor) -> bool:
        """A layout the kernel takes: a whole-head rotary of a power-of-2 head dim, norms in q's dtype."""
        d = q.shape[-1]
        norms = ((self.q_norm is None) == (self.k_norm is None)
                 and (self.q_norm is None or self.q_norm.dtype == self.k_norm.dtype == q.dtype))
        return (self.cos_sin.shape[-1] == d and d & (d - 1) == 0 and self.cos_sin.stride(-1) == 1
                and self.cos_sin.dtype == torch.float32 and norms)


# ----------------------------------------------------------------------------------------------------------
# Decode: stage 1 computes, for each (request, kv head, split), the softmax-normalised partial output of the
# q heads sharing that kv head over the split's keys, plus its log-sum-exp (base 2). The splits are then merged,
# either by a second launch over (request, q head) (stage 2) or, with the fused merge, by whichever stage-1
# program of a (request, kv head) finishes last. The split length is derived per request on the device from its
# seq_len, so the grid depends only on host values and the launch can be captured in a CUDA graph; splits past
# a request's end compute nothing.
# ----------------------------------------------------------------------------------------------------------

# The fused merge (kernel option `decode_fused_merge`): True merges the splits inside stage 1 (one launch per
# layer), False keeps the separate stage-2 launch. Off by default: on an H200 the fused merge made Qwen3-0.6B's
# batch-1 decode step slower, W2 TPOT 1.187 ms fused vs 1.150 ms two-launch (reports/h200/run10/run10_merge_ab.json):
# the merging program waits for the slowest split and then merges alone, which costs more than the launch it saves.
# `decode_attention(..., fused_merge=...)` overrides the option per call.


# The early metadata (kernel option `early_metadata`, PDL launches only): a decode program may start while
# the kernels before it still run, and must wait before touching memory they write (kernels/pdl.py). A request's
# length, table row and new slot (SeqLens, ReqPoolIdx, OutLoc) and its row of the token table (ReqToToken) are no
# such memory: the step's inputs, copied and scattered before its first kernel, which is no PDL launch (an
# embedding lookup, a cuBLAS matmul), so every later kernel starts after they are complete. Stage 1 reads them, its
# first key tile's slots included, before the wait; stage 2 the length. That takes up to four dependent loads off
# the chain that runs after the wait (at batch 1 the decode kernels' ~11 us a layer are mostly such chains,
# run15's timeline). The keys and values themselves are read after it: the new token's are this step's.


# The next layer's keys (kernel option `decode_prefetch_next_kv`, with the early metadata): a stage-1 program also asks
# L2 for the next layer's keys and values at its first key tile's slots, before its wait (a prefetch lands nothing in
# registers, and L2 is where any store to those rows goes, so none can be read stale). The next layer's stage 1 reads
# those same positions early, and at batch 1 its early reads otherwise queue behind the qkv GEMV's weight stream:
# run40's stamps on Qwen3-8B had the new token's split wait ~5 us after its wait for its q and early tile.
#
# The early keys (kernel option `early_kv`, with the early metadata and the fused store): stage 1 also reads its first
# key tile's keys and values before the wait. Every slot in it holds a key of an earlier step, complete before this
# step's first kernel, except the new token's (position seq_len - 1), which this program stores after the wait
# (or store_kv, a predecessor, stored for a mixed step's decode rows): the early read of that slot may be stale, so
# the program puts the new key and value it holds in registers into that row of the tile, the same bits it stores.
# At batch 1 a split is often a single tile, so after the wait a program waits on no key load at all.


@_jit
def _split_plan(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How a request of seq_len keys is split: (split_len, n_valid). Even work per split, rounded to whole key
    tiles, so short requests use fewer splits: split s holds positions s * split_len up to the next split's start
    (or seq_len), and only the first n_valid splits hold any key (the rest write no partials)."""
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return split_len, tl.cdiv(seq_len, tl.maximum(split_len, 1))


@_jit
def _merge_head(
    PartO, PartLse, Out, b, h, n_valid,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """out[b, h] from the first n_valid splits' partials: a log-sum-exp weighted mean (zeros if n_valid is 0),
    summed split by split in order. Not a tl.sum over a [splits, head_dim] tile: the order of that sum follows the
    tile's layout, which the compiler picks per kernel (the decode-layers kernel, which inlines this, got another
    layout than the stage-2 kernel and merged one element in thousands a rounding apart, reports/h100/run28)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    lse_row = PartLse + b.to(tl.int64) * stride_lb + h * stride_lh
    lse = tl.load(lse_row + offs_s, mask=offs_s < n_valid, other=float("-inf"))
    m = tl.max(lse, 0)  # a max rounds nothing: any order
    m = tl.where(m == float("-inf"), 0.0, m)  # no valid split (seq_len 0): avoid inf - inf
    o_row = PartO + b.to(tl.int64) * stride_pb + h * stride_ph
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = 0.0
    for s in tl.static_range(BLOCK_S):
        valid = s < n_valid
        w = tl.where(valid, tl.exp2(tl.load(lse_row + s, mask=valid, other=0.0) - m), 0.0)
        o = tl.load(o_row + s * stride_ps + offs_d, mask=dmask & valid, other=0.0)
        num = tl.fma(o, w, num)
        den = den + w
    res = num / tl.maximum(den, 1e-30)
    tl.store(Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, res.to(Out.dtype.element_ty),
             mask=dmask)


@_jit
def _decode_tile(q, m_i, l_i, acc, K, V, slots, nmask, kvh, stride_kn, stride_kh, stride_vn, stride_vh, offs_d,
                 dmask, qk_scale, IEEE_DOT: tl.constexpr):
    """One key tile of a decode program's online softmax: its keys and values read through `slots`."""
    k = _load_kv(K, slots, nmask, kvh, stride_kn, stride_kh, offs_d, dmask)
    m_new, l_i, alpha, p = _tile_softmax(q, m_i, l_i, k, nmask, qk_scale, IEEE_DOT)
    v = _load_kv(V, slots, nmask, kvh, stride_vn, stride_vh, offs_d, dmask)
    return m_new, l_i, _tile_accumulate(acc, alpha, p, v, IEEE_DOT)


@_jit
def _decode_keys(q, m_i, l_i, acc, first, end, Slots, K, V, kvh, stride_kn, stride_kh, stride_vn, stride_vh, offs_d,
                 dmask, qk_scale, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr):
    """The online softmax over key positions first..end-1 of one request, BLOCK_N at a time, their slots read from
    its row of the token table (`Slots`): (m_i, l_i, acc) after the last tile."""
    for n0 in range(first, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        slots = tl.load(Slots + offs_n, mask=nmask, other=0).to(tl.int64)
        m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, K, V, slots, nmask, kvh, stride_kn, stride_kh, stride_vn,
                                     stride_vh, offs_d, dmask, qk_scale, IEEE_DOT)
    return m_i, l_i, acc


@_jit
def _load_kv(Buf, slots, nmask, kvh, stride_n, stride_h, offs_d, dmask):
    return tl.load(Buf + slots[:, None] * stride_n + kvh * stride_h + offs_d[None, :],
                   mask=nmask[:, None] & dmask[None, :], other=0.0)


@_jit
def _tile_softmax(q, m_i, l_i, k, nmask, qk_scale, IEEE_DOT: tl.constexpr):
    """A key tile's scores and the online softmax's running max and sum after it: (m_new, l_i, alpha, p)."""
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(nmask[None, :], qk * qk_scale, float("-inf"))
    # The first tile of a non-empty split always holds a real key, so m_new is finite from here on.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@_jit
def _tile_accumulate(acc, alpha, p, v, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@_jit
def _rope_cos_sin(Pos, CosSin, b, stride_cs, D: tl.constexpr):
    """Row b's cos and sin [1, D] (fp32) from its position, each half table repeated over the whole head, and the
    rotation's sign (-1 on the first half, +1 on the second): what norm_rope_full takes."""
    pos = tl.load(Pos + b).to(tl.int64)
    offs = tl.arange(0, D) % (D // 2)
    cos = tl.load(CosSin + pos * stride_cs + offs).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + D // 2 + offs).to(tl.float32)[None, :]
    sign = tl.where(tl.arange(0, D) < D // 2, -1.0, 1.0)[None, :]
    return cos, sin, sign


@_jit
def _rope_heads_load(X, stride_h, W, H, live, BLOCK_H: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """What `norm_rope_full` takes for the H heads at X (rows of a BLOCK_H tile; the rest zero): the heads and each
    element's rotary partner [BLOCK_H, D], and with NORM the norm's weights W at both [1, D] (all fp32). Nothing but
    weights is read unless `live` (a scalar)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, D)
    partner = (offs + D // 2) % D
    mask = (offs_h < H)[:, None] & live
    p = X + offs_h[:, None] * stride_h
    x = tl.load(p + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(p + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.zeros((1, D), dtype=tl.float32)
    wp = tl.zeros((1, D), dtype=tl.float32)
    if NORM:
        w = tl.load(W + offs).to(tl.float32)[None, :]
        wp = tl.load(W + partner).to(tl.float32)[None, :]
    return x, xp, w, wp


@_jit
def _rope_heads_tile(X, stride_h, W, cos, sin, sign, eps, H, BLOCK_H: tl.constexpr, D: tl.constexpr,
                     NORM: tl.constexpr):
    """The H heads at X (rows of a BLOCK_H tile; the rest zero) as the RoPE kernel leaves them (kernels/elementwise.py:
    Qwen3's per-head norm first with NORM, then the rotation over the whole head), as a [BLOCK_H, D] tile."""
    x, xp, w, wp = _rope_heads_load(X, stride_h, W, H, True, BLOCK_H, D, NORM)
    return norm_rope_full(x, xp, w, wp, cos, sin, sign, eps, X.dtype.element_ty, D, NORM)


@_jit
def _stamp_after(x):
    """The global timer once every element of x (fp32) is computed: each thread's read is predicated on its
    elements, so none can issue before them; the latest read. (The max is a reduction: a stamp delays what follows.)"""
    t = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.f32 p, $1, 0f7F7FFFFF; @p mov.u64 $0, 0; @!p mov.u64 $0, %globaltimer; }",
        "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(t)


@_jit
def _prefetch_rows(Buf, slots, mask, kvh, stride_n, stride_h, HEAD_DIM: tl.constexpr):
    """Ask L2 for the rows of one kv head at `slots` (a [BLOCK_N] tile; masked rows not): every 128-byte line."""
    rows = Buf + slots * stride_n + kvh * stride_h
    for d in tl.static_range(0, HEAD_DIM, 1024 // Buf.dtype.element_ty.primitive_bitwidth):  # 128 bytes a step
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [rows + d, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@_jit
def _store_stamps(row, t_begin, t_wait):
    """A program's launch stamps at `row` (gemv's fields: kernels/gemv.py STAMP_FIELDS), its end now."""
    t_end = globaltimer()
    tl.store(row, t_begin)
    tl.store(row + 1, t_wait)
    tl.store(row + 2, t_end)
    tl.store(row + 3, smid().to(tl.int64))


@_jit
def _decode_stage1_kernel(
    Q, K, V, ReqToToken, ReqPoolIdx, SeqLens, PartO, PartLse, Counters, Out, KNew, VNew, OutLoc,
    Pos, CosSin, WQ, WK,  # the fused RoPE's inputs (ROPE only)
    Stamps,  # STAMPS only: a program's row of STAGE1_STAMP_FIELDS int64s (gemv's four, then its phases)
    KNext, VNext,  # PREFETCH_NEXT only: the next layer's buffers (this layer's strides)
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    rope_eps,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, IEEE_DOT: tl.constexpr, FUSED_MERGE: tl.constexpr,
    BLOCK_S: tl.constexpr, FUSED_STORE: tl.constexpr, EARLY_META: tl.constexpr, EARLY_KV: tl.constexpr,
    ROPE: tl.constexpr, ROPE_NORM: tl.constexpr, USE_PDL: tl.constexpr, STAMPS: tl.constexpr,
    PREFETCH_NEXT: tl.constexpr,
):
    if STAMPS:  # a diagnostic (decode_attention(stamps=)): when this program began, its wait returned, it ended
        t_begin = globaltimer()
    if USE_PDL:  # before any global access, the K/V store and the shared counters included (kernels/pdl.py)
        if EARLY_META:  # ... except the step's metadata, read first (see "The early metadata" above); the wait follows
            pdl_launch_dependents()
        else:
            pdl_enter()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    split_len, _ = _split_plan(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_DIM
    if EARLY_META:  # the table is the step's input too: the first key tile's slots (none if the split is empty)
        row = tl.load(ReqPoolIdx + b).to(tl.int64)
        if FUSED_STORE:
            slot = tl.load(OutLoc + b).to(tl.int64)
        offs_n0 = start + tl.arange(0, BLOCK_N)
        slots0 = tl.load(ReqToToken + row * stride_r2t + offs_n0, mask=offs_n0 < end, other=0).to(tl.int64)
        if EARLY_KV:  # and that tile's keys and values (see "The early keys" above; the new token's is patched in)
            k0 = _load_kv(K, slots0, offs_n0 < end, kvh, stride_kn, stride_kh, offs_d, dmask)
            v0 = _load_kv(V, slots0, offs_n0 < end, kvh, stride_vn, stride_vh, offs_d, dmask)
        if ROPE:  # the token's position is the step's input, its cos/sin a constant table
            cos, sin, sign = _rope_cos_sin(Pos, CosSin, b, stride_cs, HEAD_DIM)
        if PREFETCH_NEXT:  # the next layer's rows at the same slots, into L2 ("The next layer's keys" above)
            _prefetch_rows(KNext, slots0, offs_n0 < end, kvh, stride_kn, stride_kh, HEAD_DIM)
            _prefetch_rows(VNext, slots0, offs_n0 < end, kvh, stride_vn, stride_vh, HEAD_DIM)
        if USE_PDL:
            pdl_wait()
    elif ROPE:
        cos, sin, sign = _rope_cos_sin(Pos, CosSin, b, stride_cs, HEAD_DIM)
    if STAMPS:  # (without the early metadata the wait came first: pdl_enter)
        t_wait = globaltimer()
        t_q = t_wait
        t_kv = t_wait
        t_s = t_wait
        t_o = t_wait

    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_g
    hmask = offs_g < GROUP

    if start < end:
        # Every load this program makes before its first products goes out first, in one round trip: the group's
        # q heads, the new token's key and value (read in every split, kept by the one that stores them) and the
        # q/k norms' weights. Written after the store's CTA barrier or the norm's cross-warp sum, which no load
        # crosses, each would be a round trip of its own, in the program that owns the new token: the split the
        # merge waits for at batch 1.
        q_row = Q + b.to(tl.int64) * stride_qb
        if ROPE:  # the group's q heads as they come from the projection: normalised and rotated below
            qx, qxp, wq, wqp = _rope_heads_load(q_row + kvh * GROUP * stride_qh, stride_qh, WQ, GROUP, True,
                                                BLOCK_H, HEAD_DIM, ROPE_NORM)
        else:
            q = tl.load(q_row + heads[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None] & dmask[None, :],
                        other=0.0)
        if FUSED_STORE:
            new_token = end == seq_len  # this split holds position seq_len - 1, the new token
            k_new = KNew + b.to(tl.int64) * stride_knb + kvh * stride_knh
            if ROPE:
                kx, kxp, wk, wkp = _rope_heads_load(k_new, 0, WK, 1, new_token, 1, HEAD_DIM, ROPE_NORM)
            else:
                kn = tl.load(k_new + offs_d, mask=dmask & new_token)
            vn = tl.load(VNew + b.to(tl.int64) * stride_vnb + kvh * stride_vnh + offs_d, mask=dmask & new_token)
        if not EARLY_META:  # the step's metadata, where it was not read before the wait
            row = tl.load(ReqPoolIdx + b).to(tl.int64)
            if FUSED_STORE:
                slot = tl.load(OutLoc + b).to(tl.int64)
        if ROPE:
            q = norm_rope_full(qx, qxp, wq, wqp, cos, sin, sign, rope_eps, Q.dtype.element_ty, HEAD_DIM, ROPE_NORM)
        q = q.to(K.dtype.element_ty)
        if FUSED_STORE:
            if new_token:  # store the new token's K/V first
                # Visibility. No other program reads this slot: the other splits of this row read only their
                # own positions, and a new token's slot is freshly allocated, so no other request's table
                # points at it. This program is the only reader to order the store against. Its threads store
                # the row in one layout and load key tiles (through req_to_token, which points position
                # seq_len - 1 at OutLoc[b]) in another, so a thread may load an element another thread stored:
                # the CTA barrier (bar.sync) makes every thread's global stores before it visible to every
                # thread of the block after it, as __syncthreads does. The branch is uniform (scalars only), so
                # every thread reaches the barrier. The key loads after it, the pipelined ones included, are
                # plain or cp.async gathers issued after the barrier in program order (not TMA, whose async
                # proxy would need a proxy fence). Padded CUDA-graph rows (slot 0, seq_len 1) store to the
                # reserved slot 0 here, as store_kv would; no live request ever reads it.
                if ROPE:  # this kv head's new key, normalised and rotated as the RoPE kernel would have
                    kn = tl.reshape(norm_rope_full(kx, kxp, wk, wkp, cos, sin, sign, rope_eps,
                                                   KNew.dtype.element_ty, HEAD_DIM, ROPE_NORM), (BLOCK_D,))
                tl.store(K + slot * stride_kn + kvh * stride_kh + offs_d, kn.to(K.dtype.element_ty), mask=dmask)
                tl.store(V + slot * stride_vn + kvh * stride_vh + offs_d, vn.to(V.dtype.element_ty), mask=dmask)
                tl.debug_barrier()
                if EARLY_KV:  # the early tile read this slot before the store: the new row, from registers
                    new_row = (offs_n0 == seq_len - 1)[:, None]
                    k0 = tl.where(new_row, kn.to(K.dtype.element_ty)[None, :], k0)
                    v0 = tl.where(new_row, vn.to(V.dtype.element_ty)[None, :], v0)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if EARLY_KV:  # the first key tile's keys and values were read before the wait
            if STAMPS:
                t_q = _stamp_after(tl.max(q.to(tl.float32), 1))
                t_kv = _stamp_after(tl.max(k0.to(tl.float32), 1) + tl.max(v0.to(tl.float32), 1))
            m_i, l_i, alpha, p = _tile_softmax(q, m_i, l_i, k0, offs_n0 < end, qk_scale, IEEE_DOT)
            if STAMPS:
                t_s = _stamp_after(l_i)
            acc = _tile_accumulate(acc, alpha, p, v0, IEEE_DOT)
            if STAMPS:
                t_o = _stamp_after(tl.max(acc, 1))
            first = start + BLOCK_N
        elif EARLY_META:  # the first key tile's slots were read before the wait
            m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, K, V, slots0, offs_n0 < end, kvh, stride_kn, stride_kh,
                                         stride_vn, stride_vh, offs_d, dmask, qk_scale, IEEE_DOT)
            first = start + BLOCK_N
        else:
            first = start
        m_i, l_i, acc = _decode_keys(q, m_i, l_i, acc, first, end, ReqToToken + row * stride_r2t, K, V, kvh,
                                     stride_kn, stride_kh, stride_vn, stride_vh, offs_d, dmask, qk_scale, BLOCK_N,
                                     IEEE_DOT)

        o = acc / l_i[:, None]
        omask = hmask[:, None] & dmask[None, :]
        if NUM_SPLITS == 1:  # no reduction needed: write the answer directly
            o_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=omask)
        else:
            p_ptrs = (PartO + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                      + offs_d[None, :])
            tl.store(p_ptrs, o, mask=omask)
            tl.store(PartLse + b.to(tl.int64) * stride_lb + heads * stride_lh + split, m_i + tl.log2(l_i),
                     mask=hmask)
    elif NUM_SPLITS == 1:  # empty request (seq_len 0, e.g. a padded row): define the output as zeros
        o_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, tl.zeros([BLOCK_H, BLOCK_D], dtype=Out.dtype.element_ty),
                 mask=hmask[:, None] & dmask[None, :])

    if FUSED_MERGE:  # only launched with NUM_SPLITS > 1
        # "Last program merges": every split program of this (request, kv head) draws a ticket, empty splits
        # too, so exactly one draws NUM_SPLITS - 1, and it draws it after every other program's ticket.
        #
        # Memory ordering. Triton (3.6) lowers a scalar atomic to one instruction issued by thread 0 alone,
        # then broadcasts the old value through shared memory with a bar.sync. Thread 0's release covers only
        # what thread 0 has seen, but the partials above were stored by all the program's threads: the
        # barrier before the ticket makes every thread's stores happen-before thread 0's release (the
        # cooperative-groups grid-sync order: CTA barrier, then one thread publishes at gpu scope). The
        # acquire in the last program is also thread 0's; the barrier inside the branch (the branch is
        # uniform, the ticket being the same in every thread) orders it before every thread's partial loads.
        # Triton's broadcast already ends in a bar.sync, but that is how it lowers today, not a promise;
        # this barrier costs one bar.sync in NUM_SPLITS-th of the programs.
        counter = Counters + b * tl.num_programs(1) + kvh
        tl.debug_barrier()
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            tl.debug_barrier()
            # Every ticket is drawn: no program of this launch touches the counter again, and the next launch
            # (or CUDA-graph replay) is stream-ordered after this one, so a plain store re-arms it. With PDL the
            # next stage-1 launch (the next layer's) may start early, but it waits before touching memory, and
            # that wait returns only after every kernel before it, this one included, has completed.
            tl.store(counter, 0)
            _, n_valid = _split_plan(seq_len, NUM_SPLITS, BLOCK_N)  # only these splits wrote partials
            for g in tl.static_range(GROUP):
                _merge_head(PartO, PartLse, Out, b, kvh * GROUP + g, n_valid,
                            stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                            BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    if STAMPS:
        row = Stamps + ((b * tl.num_programs(1) + kvh) * NUM_SPLITS + split) * _STAGE1_STAMP_FIELDS
        _store_stamps(row, t_begin, t_wait)
        tl.store(row + _STAMP_FIELDS, t_q)
        tl.store(row + _STAMP_FIELDS + 1, t_kv)
        tl.store(row + _STAMP_FIELDS + 2, t_s)
        tl.store(row + _STAMP_FIELDS + 3, t_o)


@_jit
def _decode_stage2_kernel(
    PartO, PartLse, SeqLens, Out, Stamps,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, EARLY_META: tl.constexpr, USE_PDL: tl.constexpr, STAMPS: tl.constexpr,
):
    if STAMPS:
        t_begin = globaltimer()
    if USE_PDL:
        if EARLY_META:  # the request's length is the step's metadata ("The early metadata" above): read before the wait
            pdl_launch_dependents()
        else:
            pdl_enter()
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    if EARLY_META and USE_PDL:
        pdl_wait()
    if STAMPS:
        t_wait = globaltimer()
    _, n_valid = _split_plan(seq_len, NUM_SPLITS, BLOCK_N)  # stage 1's splits: only these wrote partials
    _merge_head(PartO, PartLse, Out, b, h, n_valid,
                stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                BLOCK_S=BLOCK_S, BLOCK_D=BLOCK_D, HEAD_DIM=HEAD_DIM)
    if STAMPS:
        _store_stamps(Stamps + (b * tl.num_programs(1) + h) * _STAMP_FIELDS, t_begin, t_wait)


_num_sms_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _num_sms_cache:
        _num_sms_cache[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _num_sms_cache[idx]


def decode_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int | None,
                      num_sms: int = _DEFAULT_NUM_SMS, waves: int | None = None) -> int:
    """Splits per request for flash-decoding, from host values only (so a captured graph keeps its grid).

    Enough (request, kv head, split) programs to fill about `waves` waves of SMs (default: the kernel option
    `decode_split_waves`), but no split shorter than _MIN_TOKENS_PER_SPLIT tokens of the longest possible request,
    and at most _MAX_SPLITS.
    """
    if waves is None:
        waves = current_options().decode_split_waves
    programs = max(1, batch_size * num_kv_heads)
    want = math.ceil(waves * num_sms / programs)
    if max_seq_len is not None:
        want = min(want, math.ceil(max(1, max_seq_len) / _MIN_TOKENS_PER_SPLIT))
    return int(max(1, min(want, _MAX_SPLITS)))


def decode_programs(batch_size: int, num_q_heads: int, num_kv_heads: int, num_splits: int,
                    fused_merge: bool) -> tuple[int, int]:
    """Programs of a decode call's two launches: stage 1's (request, kv head, split) and stage 2's (request, q head),
    0 where there is no stage 2 (one split, or the splits merged in stage 1)."""
    merge = num_splits > 1 and not fused_merge
    return batch_size * num_kv_heads * num_splits, batch_size * num_q_heads if merge else 0


def decode_workspace_numel(batch_size: int, num_q_heads: int, head_dim: int, num_splits: int,
                           num_kv_heads: int) -> int:
    """4-byte elements of one decode call's workspace: fp32 partial outputs [B, Hq, S, D] then log-sum-exps
    [B, Hq, S] from the start, and B * Hkv int32 merge counters at the very end of the buffer (zero between
    launches). A buffer shared by calls of several batch sizes needs `decode_shared_workspace_numel`."""
    if num_splits <= 1:
        return 0
    return batch_size * num_q_heads * num_splits * (head_dim + 1) + batch_size * num_kv_heads


def decode_shared_workspace_numel(batch_sizes: Iterable[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                                  num_splits: Callable[[int], int]) -> int:
    """Elements of one workspace that decode calls of every batch size in `batch_sizes` may share (the CUDA
    graphs of several batch sizes do), `num_splits(bs)` giving each call's split count.

    Partials grow from the start of the buffer and counters sit at its end, so sharing is safe only when no
    call's partials reach any call's counters: room for the largest partials plus the largest counter block.
    (The counters of different batch sizes overlap; that is fine, as each launch leaves its own at zero.)"""
    partials = counters = 0
    for bs in batch_sizes:
        splits = num_splits(bs)
        if splits > 1:
            partials = max(partials, bs * num_q_heads * splits * (head_dim + 1))
            counters = max(counters, bs * num_kv_heads)
    return partials + counters


def decode_merge_counters(workspace: torch.Tensor, batch_size: int, num_kv_heads: int) -> torch.Tensor:
    """The fused merge's int32 counters, one per (request, kv head): the workspace's last batch_size * num_kv_heads
    elements, at the end of the buffer rather than after this call's partials (see decode_shared_workspace_numel)."""
    return workspace[workspace.numel() - batch_size * num_kv_heads:].view(torch.int32)


def _decode_block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scale: float,
                     max_seq_len: int | None = None, workspace: torch.Tensor | None = None,
                     num_splits: int | None = None, fused_merge: bool | None = None,
                     new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     rope: DecodeRope | None = None,
                     stamps: tuple[torch.Tensor, torch.Tensor | None] | None = None,
                     next_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One new token per request: out[b] = softmax(q[b] K_b^T * scale) V_b over keys 0..seq_lens[b]-1.

    q, out: [B, Hq, D] (last dim contiguous); k_buf, v_buf: [num_slots, Hkv, D]; req_pool_indices: [B];
    seq_lens: [B] (already counting the new token). Without `new_kv` the new token's K/V must already be stored;
    with `new_kv = (k, v, loc)` (k, v: [B, Hkv, D], any token/head strides, last dim contiguous; loc: [B] slots,
    the slots req_to_token holds at position seq_lens[b] - 1) the kernel stores k[b], v[b] at loc[b] itself,
    cast to the buffers' dtype, before it reads any key (the fused store); rows of seq_len 0 store nothing,
    and rows sharing a slot (CUDA-graph padding on slot 0) store in no defined order. `max_seq_len` is a host-side
    bound on seq_lens used only to pick the split count (pass a fixed bound when capturing a CUDA graph);
    `workspace` is an optional flat 4-byte (fp32) buffer of at least `decode_workspace_numel(...)` elements,
    ZEROED when allocated (its tail holds the merge counters, which every launch leaves at zero), so a captured
    graph reuses the same memory. `fused_merge` (default: the kernel option decode_fused_merge) merges the splits
    in the stage-1 launch instead of a second one. Rows with seq_len 0 get zeros. With `rope` (and `new_kv`), q
    and the new k come straight from the projection: the kernel applies the RoPE (and Qwen3's per-head norms)
    itself, as `norm_and_rope` / `apply_rope` would have, before it uses q and stores k (the fused RoPE).
    `stamps`: a diagnostic (lab.checks.decode_anatomy), contiguous int64 CUDA tensors (stage 1's, stage 2's: None
    where there is no stage 2) of at least `decode_programs(...)` x STAGE1_STAMP_FIELDS and x STAMP_FIELDS values,
    each program's row the global timer when it began, its PDL wait returned and it ended, and its SM, as
    `gemv(stamps=)` writes them, then stage 1's phases (STAGE1_STAMP_FIELDS). The output is the same with or
    without them. `next_kv`: the next layer's K and V buffers (k_buf's and v_buf's layouts), whose rows at each
    program's first key tile it asks L2 for before its PDL wait (the caller passes them under the kernel option
    `decode_prefetch_next_kv`; only a PDL launch with the early metadata prefetches). The output is the same too.
    """
    _require_triton()
    B, Hq, D = q.shape
    Hkv = k_buf.shape[1]
    assert Hq % Hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    if B == 0:
        return out
    if new_kv is not None:
        k_new, v_new, out_loc = new_kv
        assert k_new.shape == (B, Hkv, D) and v_new.shape == (B, Hkv, D) and out_loc.shape == (B,)
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1
    else:  # placeholders for the unused pointer arguments (FUSED_STORE is off)
        k_new, v_new, out_loc = k_buf, v_buf, seq_lens
    if rope is not None:
        if new_kv is None or not rope.fits(q):
            raise ValueError("the fused RoPE needs new_kv and a whole-head rotary of a power-of-2 head dim, "
                             "with norm weights in q's dtype")
        positions, cos_sin = rope.positions, rope.cos_sin
        q_norm, k_norm = (rope.q_norm, rope.k_norm) if rope.q_norm is not None else (q, q)  # q: placeholders
    else:  # placeholders (ROPE is off)
        positions, cos_sin, q_norm, k_norm = seq_lens, q, q, q
    group = Hq // Hkv
    if num_splits is None:
        num_splits = decode_num_splits(B, Hkv, max_seq_len, _num_sms(q.device))
    if fused_merge is None:
        fused_merge = current_options().decode_fused_merge
    block_n = _decode_block_n(D)
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16
    block_d = max(16, triton.next_power_of_2(D))
    block_s = max(2, triton.next_power_of_2(num_splits))
    ieee = k_buf.dtype == torch.float32  # q is cast to the cache dtype; fp32 dots must not drop to tf32

    fused = bool(fused_merge) and num_splits > 1
    if num_splits > 1:
        need = decode_workspace_numel(B, Hq, D, num_splits, Hkv)
        if workspace is None:
            workspace = torch.zeros(need, dtype=torch.float32, device=q.device)  # zero counters
        if workspace.dtype != torch.float32 or workspace.numel() < need:
            raise ValueError(f"decode workspace too small: need {need} fp32 elements")
        n_parts = B * Hq * num_splits * D
        part_o = workspace[:n_parts].view(B, Hq, num_splits, D)
        part_lse = workspace[n_parts: n_parts + B * Hq * num_splits].view(B, Hq, num_splits)
        # Without the fused merge the counters are never touched: pass the workspace's (aligned) start instead.
        # Triton compiles a variant per pointer alignment, and the counters, B * Hkv elements from the end, are
        # 16-byte aligned or not by B: with Qwen3.5's Hkv = 2, a mixed step of an odd number of decode rows
        # compiled a variant the decode graphs had not (likely run14's compiles inside a timed Qwen3.5 W1).
        counters = decode_merge_counters(workspace, B, Hkv) if fused else workspace[:1].view(torch.int32)
    else:  # stage 1 writes `out` directly; these are placeholders for unused pointer arguments
        part_o = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
        counters = out.new_empty((1,), dtype=torch.int32)

    stage1_programs, stage2_programs = decode_programs(B, Hq, Hkv, num_splits, fused)
    stamps1, stamps2 = stamps if stamps is not None else (None, None)
    stamps2 = stamps2 if stage2_programs else None  # no stage 2 to stamp
    if stamps is not None and not all(
            buf is not None and buf.is_cuda and buf.dtype == torch.int64 and buf.is_contiguous()
            and buf.numel() >= programs * fields
            for buf, programs, fields in ((stamps1, stage1_programs, STAGE1_STAMP_FIELDS),
                                          (stamps2, stage2_programs, STAMP_FIELDS)) if programs):
        raise ValueError(f"decode_attention's stamps are contiguous int64 CUDA tensors of >= "
                         f"{stage1_programs * STAGE1_STAMP_FIELDS} and {stage2_programs * STAMP_FIELDS} values")
    kw = pdl_launch(q)
    options = current_options()
    early = options.early_metadata  # without PDL: only the order of its loads
    # the early keys need the early metadata's slots, and the new token's K/V in registers (the fused store)
    early_kv = early and options.early_kv and new_kv is not None
    if next_kv is not None and any(t.shape != buf.shape or t.stride() != buf.stride() or t.dtype != buf.dtype
                                   for t, buf in zip(next_kv, (k_buf, v_buf))):
        raise ValueError("decode_attention's next_kv must be buffers of k_buf's and v_buf's shapes, strides, dtype")
    prefetch_next = next_kv is not None and early and bool(kw)
    k_next, v_next = next_kv if prefetch_next else (k_buf, v_buf)
    _decode_stage1_kernel[(B, Hkv, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, part_o, part_lse, counters, out,
        k_new, v_new, out_loc, positions, cos_sin, q_norm, k_norm, stamps1 if stamps1 is not None else seq_lens,
        k_next, v_next,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos_sin.stride(0),
        scale * _LOG2E, rope.eps if rope is not None else 0.0,
        GROUP=group, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d, HEAD_DIM=D, NUM_SPLITS=num_splits,
        IEEE_DOT=ieee, FUSED_MERGE=fused, BLOCK_S=block_s, FUSED_STORE=new_kv is not None, EARLY_META=early,
        EARLY_KV=early_kv, ROPE=rope is not None, ROPE_NORM=rope is not None and rope.q_norm is not None,
        USE_PDL=bool(kw), STAMPS=stamps1 is not None, PREFETCH_NEXT=prefetch_next, num_warps=4, num_stages=2,
        **kw,
    )
    if num_splits > 1 and not fused:
        _decode_stage2_kernel[(B, Hq)](
            part_o, part_lse, seq_lens, out, stamps2 if stamps2 is not None else seq_lens,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_D=block_d, HEAD_DIM=D, NUM_SPLITS=num_splits,
            EARLY_META=early, USE_PDL=bool(kw), STAMPS=stamps2 is not None, num_warps=4, **kw,
        )
    return out


# ----------------------------------------------------------------------------------------------------------
# Extend: one program per (request, q head, block of BLOCK_M new tokens). Keys 0..seq_len-1 of the request are
# read through req_to_token (the new tokens' K/V are already stored); query j sits at position prefix + j and
# sees keys at positions <= prefix + j. Online softmax over BLOCK_N key tiles.
#
# Which (request, block) pairs get a program: either a grid over every request and as many blocks as the longest
# extend (the plain grid), or a tile list the host made for the step (`extend_tile_list`, kernel option
# `extend_tiles`): one program per real block and q head. The plain grid is sized by host values the step's
# requests need not fill; a prefill CUDA graph sizes it by its buckets (its requests times its token bucket in
# blocks, e.g. 64 x 16 x 16 = 16,384 programs for a 1k-token prompt beside a few decode rows), and every program
# beyond a request's end still has to be scheduled and exit. With ~200 KB of shared memory a program on Hopper,
# one runs per SM at a time, so those empty programs queue up behind each other. A tile list holds only the real
# blocks, padded to a bound a graph can fix (`extend_tiles_bound`) with blocks that start past every extend.
# ----------------------------------------------------------------------------------------------------------


@_jit
def _load_tile(ptrs, rmask, cmask, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    # Masks only where they can bite: full key tiles and power-of-2 head dims load unpredicated.
    if MASK_R and MASK_C:
        return tl.load(ptrs, mask=rmask[:, None] & cmask[None, :], other=0.0)
    elif MASK_R:
        return tl.load(ptrs, mask=rmask[:, None], other=0.0)
    elif MASK_C:
        return tl.load(ptrs, mask=cmask[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@_jit
def _extend_tile(
    q, m_i, l_i, acc, K, V, ReqToToken, row, stride_r2t, kvh, stride_kn, stride_kh, stride_vn, stride_vh,
    n0, kv_end, q_pos, qk_scale, offs_d, dmask,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    """One BLOCK_N key tile of online softmax. CAUSAL tiles may hold keys past kv_end or past some rows'
    positions; the others are full tiles every row of the block may see."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < kv_end
    if CAUSAL:
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=nmask, other=0).to(tl.int64)
    else:
        slots = tl.load(ReqToToken + row * stride_r2t + offs_n).to(tl.int64)
    k = _load_tile(K + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], nmask, dmask, CAUSAL,
                   MASK_D)
    if IEEE_DOT:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if CAUSAL:
        qk = tl.where(nmask[None, :] & (offs_n[None, :] <= q_pos[:, None]), qk, float("-inf"))
    # Key 0 is visible to every row and comes first, so every row's max is finite after the first tile.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_tile(V + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], nmask, dmask, CAUSAL,
                   MASK_D)
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# first_row is a plain runtime int (no specialisation on 1 or on multiples of 16): any first row runs the one
# compiled variant
@_jit(do_not_specialize=["first_row"])
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqPoolIdx, PrefixLens, ExtendLens, ExtendStart, Tiles,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_r2t,
    qk_scale, first_row,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr, IEEE_DOT: tl.constexpr, USE_TILES: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl_enter()
    if USE_TILES:  # grid (q heads, tiles): every head's first tiles (the host put the longest first) start first
        h = tl.program_id(0)
        tile = tl.program_id(1)
        b = tl.load(Tiles + 2 * tile)
        mblk = tl.load(Tiles + 2 * tile + 1)
    else:
        b = tl.program_id(0) + first_row
        h = tl.program_id(1)
        # Last query blocks first: under the causal mask they have the most keys, so the short ones fill the tail.
        mblk = tl.num_programs(2) - 1 - tl.program_id(2)
    ext_len = tl.load(ExtendLens + b).to(tl.int32)
    m_start = mblk * BLOCK_M
    if m_start < ext_len:  # the grid is sized for the longest request; shorter ones skip the extra blocks
        kvh = h // GROUP
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        tok0 = tl.load(ExtendStart + b).to(tl.int64)
        row = tl.load(ReqPoolIdx + b).to(tl.int64)

        offs_m = m_start + tl.arange(0, BLOCK_M)
        mmask = offs_m < ext_len
        offs_d = tl.arange(0, BLOCK_D)
        dmask = offs_d < HEAD_DIM
        q_ptrs = Q + (tok0 + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mmask[:, None] & dmask[None, :], other=0.0).to(K.dtype.element_ty)
        q_pos = prefix + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys before prefix + m_start are visible to every row here: whole tiles of them need no mask.
        full_end = (prefix + m_start) // BLOCK_N * BLOCK_N
        # Causal: the last row of this block (or of the request) bounds the keys any row here may see.
        kv_end = prefix + tl.minimum(m_start + BLOCK_M, ext_len)
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _extend_tile(
                q, m_i, l_i, acc, K, V, ReqToToken, row, stride_r2t, kvh, stride_kn, stride_kh, stride_vn,
                stride_vh, n0, kv_end, q_pos, qk_scale, offs_d, dmask,
                BLOCK_N=BLOCK_N, CAUSAL=False, MASK_D=BLOCK_D != HEAD_DIM, IEEE_DOT=IEEE_DOT)
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _extend_tile(
                q, m_i, l_i, acc, K, V, ReqToToken, row, stride_r2t, kvh, stride_kn, stride_kh, stride_vn,
                stride_vh, n0, kv_end, q_pos, qk_scale, offs_d, dmask,
                BLOCK_N=BLOCK_N, CAUSAL=True, MASK_D=BLOCK_D != HEAD_DIM, IEEE_DOT=IEEE_DOT)

        o = acc / l_i[:, None]
        o_ptrs = Out + (tok0 + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _extend_blocks(head_dim: int, device: torch.device, elem_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the extend kernel."""
    if device.type != "cuda":
        return 32, 32, 4, 1  # interpreter: small tiles keep the CPU tests quick
    if elem_size > 2:
        return 64, 64, 4, 2  # fp32 tiles take twice the shared memory: 128x128x3 stages does not fit
    if head_dim <= 128:
        # Swept on an H200 with Qwen3 shapes: 128x128 tiles, 8 warps lead on Hopper (they need ~200 KB of
        # shared memory for 3 stages); 128x64 with 4 warps is within a few percent and fits smaller GPUs.
        if _capability(device)[0] == 9:
            return 128, 128, 8, 3
        return 128, 64, 4, 3
    return 64, 32, 4, 2


_capability_cache: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _capability_cache:
        _capability_cache[idx] = torch.cuda.get_device_capability(idx)
    return _capability_cache[idx]


def extend_block_m(head_dim: int, device: torch.device, elem_size: int = 2) -> int:
    """BLOCK_M, the new tokens one extend program takes: what a tile list is cut by."""
    return _extend_blocks(head_dim, device, elem_size)[0]


# A tile past every extend (BLOCK_M * _PAD_BLOCK is past any step's tokens): the program exits at once.
_PAD_BLOCK = 1 << 20


def extend_tile_list(prefix_lens: Sequence[int], extend_lens: Sequence[int], block_m: int, first_row: int = 0,
                     pad_to: int | None = None) -> np.ndarray:
    """The extend kernel's work list for a step (host values): int32 pairs (request, query block), one per block
    of `block_m` new tokens of each request from `first_row` on, the blocks with the most keys first (a block
    sees its request's prefix and the new tokens up to its end), so the shortest fill the tail. `pad_to` pads
    the list to that many tiles with blocks past every extend (a CUDA graph's fixed tile count)."""
    req_list, blk_list, keys = [], [], []
    for i in range(first_row, len(extend_lens)):
        ext, prefix = int(extend_lens[i]), int(prefix_lens[i])
        for blk in range(-(-ext // block_m)):
            req_list.append(i)
            blk_list.append(blk)
            keys.append(prefix + min((blk + 1) * block_m, ext))
    n = len(req_list)
    size = n if pad_to is None else pad_to
    if n > size:
        raise ValueError(f"{n} extend tiles do not fit a list of {size}")
    tiles = np.zeros((size, 2), dtype=np.int32)
    tiles[n:, 1] = _PAD_BLOCK
    if n:
        order = np.argsort(-np.asarray(keys, dtype=np.int64), kind="stable")
        tiles[:n, 0] = np.asarray(req_list, dtype=np.int32)[order]
        tiles[:n, 1] = np.asarray(blk_list, dtype=np.int32)[order]
    return tiles.reshape(-1)


def extend_tiles_bound(num_tokens: int, num_reqs: int, block_m: int) -> int:
    """The most tiles a step of `num_tokens` new tokens over `num_reqs` requests can have: each request's last
    block may be partial."""
    return -(-(num_tokens + num_reqs * (block_m - 1)) // block_m)


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     extend_start: torch.Tensor, out: torch.Tensor, scale: float, max_extend_len: int,
                     block_m: int | None = None, block_n: int | None = None, first_row: int = 0,
                     tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the new tokens of a batch over each request's cached prefix and themselves.

    q, out: [T, Hq, D]; request i owns rows extend_start[i] : extend_start[i] + extend_lens[i] of q, at
    positions prefix_lens[i] + j. All keys 0 .. prefix_lens[i] + extend_lens[i] - 1 must already be stored.
    `max_extend_len` (host int) bounds extend_lens and sizes the grid. Only requests first_row.. are computed
    (the per-request tensors are indexed from 0, not sliced: a slice at an odd offset would be a differently
    aligned pointer, for which Triton compiles another variant). Rows of q owned by no computed request are left
    untouched in `out`. `tiles` (int32 on q's device, as `extend_tile_list` makes it with the same `block_m` and
    first_row): one program per listed block and head instead of the grid; `max_extend_len` and `first_row` are
    then not read by the kernel.
    """
    _require_triton()
    T, Hq, D = q.shape
    Hkv = k_buf.shape[1]
    B = req_pool_indices.shape[0]
    assert Hq % Hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    assert req_to_token.stride(-1) == 1
    if T == 0 or B <= first_row or max_extend_len <= 0 or (tiles is not None and tiles.numel() == 0):
        return out
    bm, bn, num_warps, num_stages = _extend_blocks(D, q.device, k_buf.element_size())
    bm = block_m or bm
    bn = block_n or bn
    block_d = max(16, triton.next_power_of_2(D))
    ieee = k_buf.dtype == torch.float32  # q is cast to the cache dtype; fp32 dots must not drop to tf32
    use_tiles = tiles is not None
    if use_tiles:
        assert tiles.dtype == torch.int32 and tiles.numel() % 2 == 0
        grid = (Hq, tiles.numel() // 2)
    else:
        grid = (B - first_row, Hq, triton.cdiv(max_extend_len, bm))
        tiles = extend_start  # a placeholder for the unread pointer
    kw = pdl_launch(q)
    _extend_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start, tiles,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        scale * _LOG2E, first_row,
        GROUP=Hq // Hkv, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, HEAD_DIM=D, IEEE_DOT=ieee,
        USE_TILES=use_tiles, USE_PDL=bool(kw),
        num_warps=num_warps, num_stages=num_stages, **kw,
    )
    return out
