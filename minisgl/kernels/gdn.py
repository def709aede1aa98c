"""Gated DeltaNet ops (Qwen3.5's linear-attention layers) over packed variable-length sequences.

Two ops, each reading and writing a per-request state held in a pool (one pool row, "slot", per request),
and the per-token gates they take (`gdn_gating`: decay g and write strength beta from the a / b projections):

- `causal_conv1d`: the depthwise causal convolution (kernel K) over the q/k/v channels, then SiLU. Each
  sequence's window starts with its slot's last K-1 inputs; the last K-1 inputs are written back.
- `gated_delta_rule`: the linear-attention recurrence. Per value head, with S the [Dk, Dv] state:
      S <- exp(g_t) * S;  S <- S + beta_t * k_t (v_t - S^T k_t)^T;  o_t = S^T q_t * Dk^-0.5
  with q and k L2-normalised first (in fp32). Each sequence starts from its slot's state and leaves its final
  state there.

A batch is T tokens of N sequences, packed: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1] and owns pool row
slots[i]. A decode step is the case T == N (one token each); padded rows of a CUDA graph point at a dummy slot.

Each op has a torch reference (`*_ref`, the semantics; a plain loop over tokens, which is also the CPU path; they
live in `gdn_ref.py`, generated from notebooks/10_hybrid_state.ipynb) and Triton kernels; the public wrappers use
Triton for CUDA tensors and the reference otherwise. As in `elementwise.py`, the kernel option `triton_on_cpu`
sends CPU tensors to Triton too, which only works under TRITON_INTERPRET=1 (how the kernels are tested without a GPU).
Without Triton this module still imports.

Kernels (none reads anything on the host, so every launch can be captured in a CUDA graph):
- conv, decode (T == N): one program per (sequence, channel block); the conv and the state shift fused.
- conv, prefill/extend: one program per (token block, channel block), each token finding its sequence by a
  binary search in `cu_seqlens`; then a second launch writes the new states (it must not race the reads).
- delta rule, recurrent: one program per (sequence, value head, Dv block), its [Dk, BLOCK_V] state tile in
  registers, looping over the sequence's tokens. The decode path (T == N, one iteration), and the fallback
  prefill path (kernel option `gdn.prefill = "recurrent"`).
- delta rule, chunked (the default prefill path): the WY/UT form over chunks of 64 tokens. A first launch,
  one program per (sequence, chunk, value head), solves each chunk's triangular system and forms its
  matrices (fp32 scratch, 320 floats per token and head); the second, on the recurrent kernel's grid, walks
  each sequence's chunks with the state in registers: dense [64, D] products on the tensor cores per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the same decorator and dispatch rule as the elementwise kernels (CUDA tensors, or the option triton_on_cpu)
from minisgl.kernels.elementwise import _jit, use_triton

# the torch references (the semantics, and the CPU path) are written in notebook 10
from minisgl.kernels.gdn_ref import causal_conv1d_ref, gated_delta_rule_ref
from minisgl.kernels.options import current_options

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch references
    triton = None
    tl = None

__all__ = ["causal_conv1d", "causal_conv1d_ref", "gated_delta_rule", "gated_delta_rule_ref", "gdn_gating",
           "gdn_gating_ref"]


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) in fp32 (A is large: fp16 would overflow) and beta = sigmoid(b)
    in b's dtype (as HF rounds it). a, b: [T, Hv] (any strides); A_log, dt_bias: [Hv]."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


# ------------------------------------------------------------ Triton kernels --------------------------------


# Launch settings: the kernel option `gdn` (GdnLaunch in minisgl/config.py, which says what each one does).
_CHUNK = 64  # tokens per chunk of the chunked delta rule


@_jit(do_not_specialize=["T"])
def _gating_kernel(A, B, ALog, DtBias, G, Beta, T, stride_at, stride_bt, stride_gt, stride_et,
                   H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    mask = (rows < T) & hmask[None, :]
    offs_h = offs_h[None, :]
    a = tl.load(A + rows * stride_at + offs_h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + rows * stride_bt + offs_h, mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(ALog + offs_h, mask=hmask[None, :], other=0.0).to(tl.float32)
    x = a + tl.load(DtBias + offs_h, mask=hmask[None, :], other=0.0).to(tl.float32)
    # torch's softplus: x itself above 20 (where log(1 + e^x) == x in fp32)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    tl.store(G + rows * stride_gt + offs_h, -tl.exp(a_log) * softplus, mask=mask)
    tl.store(Beta + rows * stride_et + offs_h, (1.0 / (1.0 + tl.exp(-b))).to(Beta.dtype.element_ty), mask=mask)


@_jit
def _conv_decode_kernel(
    X, W, Bias, State, Slots, Cu, Out, C,
    stride_x, stride_o, stride_w0, stride_w1, stride_s0, stride_s1, stride_s2,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One token per sequence: window = [state (K-1 columns) | x], y = silu(w . window + b), state <- window[1:].
    n = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    start = tl.load(Cu + n).to(tl.int64)
    end = tl.load(Cu + n + 1).to(tl.int64)
    if end > start:
        slot = tl.load(Slots + n).to(tl.int64)
        j = tl.arange(0, KP)  # state columns
        jmask = j < K - 1
        m2 = cmask[:, None] & jmask[None, :]
        sp = State + slot * stride_s0 + ch[:, None] * stride_s1 + j[None, :] * stride_s2
        s = tl.load(sp, mask=m2, other=0.0).to(tl.float32)
        # the shifted state: column j takes old column j + 1, the last one the new input
        shifted = tl.load(sp + stride_s2, mask=cmask[:, None] & (j < K - 2)[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + start * stride_x + ch, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(W + ch[:, None] * stride_w0 + j[None, :] * stride_w1, mask=m2, other=0.0).to(tl.float32)
        w_last = tl.load(W + ch * stride_w0 + (K - 1) * stride_w1, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.sum(w * s, 1) + w_last * x
        if HAS_BIAS:
            acc += tl.load(Bias + ch, mask=cmask, other=0.0).to(tl.float32)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(Out + start * stride_o + ch, y.to(Out.dtype.element_ty), mask=cmask)
        new = tl.where((j == K - 2)[None, :], x[:, None], shifted)
        tl.debug_barrier()  # every thread's reads of the old state before any write
        tl.store(sp, new.to(State.dtype.element_ty), mask=m2)


@_jit(do_not_specialize=["T", "N"])
def _conv_varlen_kernel(
    X, W, Bias, State, Slots, Cu, Out, T, N, C,
    stride_x, stride_o, stride_w0, stride_w1, stride_s0, stride_s1, stride_s2,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Tokens [BLOCK_T] x channels [BLOCK_C]; the state is only read here (a second launch writes it).
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = rows < T
    cmask = ch < C
    # Each row's sequence: the largest i < N with cu[i] <= row (of empty sequences sharing a bound, the last,
    # which is the one holding the row).
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (N - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi + 1) // 2
        up = tl.load(Cu + mid, mask=rmask & active, other=0) <= rows
        lo = tl.where(active & up, mid, lo)
        hi = tl.where(active & ~up, mid - 1, hi)
    seq_start = tl.load(Cu + lo, mask=rmask, other=0)
    slot = tl.load(Slots + lo, mask=rmask, other=0).to(tl.int64)
    rel = rows - seq_start  # position inside the sequence
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    rows64 = rows.to(tl.int64)
    for j in tl.static_range(K):
        back = K - 1 - j  # this tap reads the input `back` positions earlier
        p = rel - back
        in_x = rmask & (p >= 0)
        in_s = rmask & (p < 0)
        xv = tl.load(X + (rows64 - back)[:, None] * stride_x + ch[None, :], mask=in_x[:, None] & cmask[None, :],
                     other=0.0).to(tl.float32)
        sv = tl.load(State + slot[:, None] * stride_s0 + ch[None, :] * stride_s1 + (p + K - 1)[:, None] * stride_s2,
                     mask=in_s[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + ch * stride_w0 + j * stride_w1, mask=cmask, other=0.0).to(tl.float32)
        acc += w[None, :] * (xv + sv)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(Out + rows64[:, None] * stride_o + ch[None, :], y.to(Out.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@_jit
def _conv_state_kernel(
    X, State, Slots, Cu, C, stride_x, stride_s0, stride_s1, stride_s2,
    K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # New state of sequence n: the last K-1 entries of [old state | its inputs]; a sequence shorter than K-1
    # keeps the newest part of its old state.
    n = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    start = tl.load(Cu + n).to(tl.int64)
    length = tl.load(Cu + n + 1).to(tl.int64) - start
    slot = tl.load(Slots + n).to(tl.int64)
    j = tl.arange(0, KP)
    jmask = j < K - 1
    p = length - (K - 1) + j  # position inside the sequence of new column j (< 0: old column p + K - 1)
    in_x = jmask & (p >= 0)
    in_s = jmask & (p < 0)
    base = State + slot * stride_s0 + ch[:, None] * stride_s1
    xv = tl.load(X + (start + p)[None, :] * stride_x + ch[:, None], mask=cmask[:, None] & in_x[None, :], other=0.0)
    sv = tl.load(base + (p + K - 1)[None, :] * stride_s2, mask=cmask[:, None] & in_s[None, :], other=0.0)
    new = tl.where(in_x[None, :], xv.to(State.dtype.element_ty), sv)
    tl.debug_barrier()  # every thread's reads of the old state before any write
    tl.store(base + j[None, :] * stride_s2, new, mask=cmask[:, None] & jmask[None, :])


@_jit
def _gdr_recurrent_kernel(
    Q, K, V, G, Beta, State, Slots, Cu, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_s0, stride_s1, stride_s2, stride_ot, stride_oh, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # One (sequence, value head, Dv block): the state tile S [Dk, BLOCK_V] stays in registers over the tokens.
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    vmask = offs_v < DV
    kmask = offs_k < DK
    hk = h // GROUP
    start = tl.load(Cu + n).to(tl.int64)
    end = tl.load(Cu + n + 1).to(tl.int64)
    slot = tl.load(Slots + n).to(tl.int64)
    sp = State + slot * stride_s0 + h * stride_s1 + offs_k[:, None] * stride_s2 + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(sp, mask=smask, other=0.0).to(tl.float32)
    for t in range(start, end):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + offs_k, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + offs_k, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(V + t * stride_vt + h * stride_vh + offs_v, mask=vmask, other=0.0).to(tl.float32)
        g = tl.load(G + t * stride_gt + h * stride_gh).to(tl.float32)
        b = tl.load(Beta + t * stride_bt + h * stride_bh).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        s = s * tl.exp(g)
        pred = tl.sum(s * k[:, None], 0)
        s = s + k[:, None] * ((v - pred) * b)[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(Out + t * stride_ot + h * stride_oh + offs_v, o.to(Out.dtype.element_ty), mask=vmask)
    tl.store(sp, s.to(State.dtype.element_ty), mask=smask)


@_jit
def _dot(a, b, PRECISION: tl.constexpr):
    if PRECISION == "ieee":
        return tl.dot(a, b, input_precision="ieee")
    elif PRECISION == "tf32x3":
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b, input_precision="tf32")


# The chunked form of the recurrence, over chunks of BT tokens. With gc the cumulative log decay inside the chunk,
# gamma = exp(gc), Gam[i, j] = exp(gc_i - gc_j) (i >= j), q and k normalised (q scaled) and S0 the state
# entering the chunk:
#   (I + L) D = diag(b) V - diag(b gamma) K S0,   L = strict_tril(diag(b) (K K^T * Gam))
# so D = U - W S0 with Tinv = (I + L)^-1, U = Tinv (b V), W = Tinv (b gamma K); D's rows are b_t (v_t - the
# prediction of the state before token t). Then
#   O = (gamma Q) S0 + A D,  A = tril(Q K^T * Gam);     S = gamma_last S0 + (K * gamma_last / gamma)^T D.
# _gdr_chunk_prepare_kernel computes W, U and A of every chunk in parallel (the solve is up to 64 dependent
# steps); _gdr_chunk_kernel then walks each sequence's chunks in order: products with the state only.
#
# The prepare grid has a program per chunk *slot*: sequence s owns the slots F(s) .. F(s+1) - 1, with
# F(s) = s + cu[s] // BT. F(s+1) - F(s) = 1 + cu[s+1] // BT - cu[s] // BT is at least the sequence's chunk count
# (and at least 1: F grows strictly), so every chunk has a slot, a sequence has at most one spare, and the grid
# is N + T // BT slots: for a step of 256 sequences (decode rows of a mixed step count as sequences of one
# token) and 8k tokens, ~400 slots a head, where a (sequence, chunk of T) grid had 256 x 132 programs, nearly all
# of which only found out they had nothing to do. A program finds its sequence by binary search over F.


@_jit(do_not_specialize=["N"])
def _gdr_chunk_prepare_kernel(
    Q, K, V, G, Beta, Cu, Wt, Ut, At, N,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BT: tl.constexpr, PRECISION: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCKED: tl.constexpr,
):
    # One (chunk slot, value head); row i of W / U / A stored at token row c0 + i. Tinv by forward
    # substitution (not by (I - L)(I + L^2)(I + L^4)...: with similar keys and b ~ 1 that cancels away): over the
    # whole chunk (up to 63 dependent steps), or BLOCKED: inside each 16-token block (the four blocks' rows at once:
    # up to 15 steps), then the blocks merged by the exact 2x2 block inverse, 16 -> 32 -> 64:
    # [[A, 0], [C, B]]^-1 = D^-1 - D^-1 C' D^-1 with D = diag(A, B) and C' the lower-left block (fp32 dots).
    slot = tl.program_id(0)
    lo = 0  # the sequence: the largest s < N with F(s) <= slot (F(0) = 0)
    hi = N - 1
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        up = mid + tl.load(Cu + mid) // BT <= slot
        lo = tl.where(up, mid, lo)
        hi = tl.where(up, hi, mid - 1)
    start = tl.load(Cu + lo).to(tl.int64)
    end = tl.load(Cu + lo + 1).to(tl.int64)
    c0 = start + (slot - lo - start // BT) * BT
    if (c0 >= start) & (c0 < end):
        h = tl.program_id(1)
        hk = h // GROUP
        offs_t = tl.arange(0, BT)
        offs_k = tl.arange(0, BLOCK_K)
        offs_v = tl.arange(0, BLOCK_DV)
        rows = c0 + offs_t
        rmask = rows < end
        mk = rmask[:, None] & (offs_k < DK)[None, :]
        g = tl.load(G + rows * stride_gt + h * stride_gh, mask=rmask, other=0.0).to(tl.float32)
        b = tl.load(Beta + rows * stride_bt + h * stride_bh, mask=rmask, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)
        lower = offs_t[:, None] >= offs_t[None, :]
        strict = offs_t[:, None] > offs_t[None, :]
        gam = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))  # 0 above the diagonal
        k = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=mk,
                    other=0.0).to(tl.float32)
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        q = tl.load(Q + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=mk,
                    other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale)[:, None]
        amat = _dot(q, tl.trans(k), PRECISION) * gam
        tl.store(At + rows[:, None] * stride_at + h * stride_ah + offs_t[None, :], amat, mask=rmask[:, None])
        lmat = tl.where(strict, _dot(k, tl.trans(k), PRECISION) * gam * b[:, None], 0.0)
        eye = (offs_t[:, None] == offs_t[None, :]).to(tl.float32)
        inv = eye
        # row i = e_i - sum_{j < i} L[i, j] row j (rows j < i are final); rows past the sequence's end have
        # L = 0 (their k is 0) and stay e_i, and are never stored: a chunk of n tokens takes n - 1 steps (a
        # decode row riding in a mixed step: none)
        n_rows = tl.minimum(end - c0, BT)
        if BLOCKED:
            block = offs_t // 16
            same16 = block[:, None] == block[None, :]
            l16 = tl.where(same16, lmat, 0.0)
            # step i: row i of every 16-block at once. inv is block-diagonal, so one vector holds each block's
            # new row in that block's columns
            for i in range(1, tl.minimum(n_rows, 16)):
                is_row = (offs_t % 16)[:, None] == i
                l_i = tl.sum(tl.where(is_row, l16, 0.0), 0)
                row = tl.sum(l_i[:, None] * inv, 0)
                inv = tl.where(is_row & same16, eye - row[None, :], inv)
            if n_rows > 16:
                same32 = (offs_t // 32)[:, None] == (offs_t // 32)[None, :]
                c16 = tl.where(same32 & ~same16, lmat, 0.0)
                inv = inv - _dot(_dot(inv, c16, "ieee"), inv, "ieee")
                if n_rows > 32:
                    c32 = tl.where(same32, 0.0, lmat)
                    inv = inv - _dot(_dot(inv, c32, "ieee"), inv, "ieee")
        else:
            for i in range(1, n_rows):
                is_row = offs_t[:, None] == i
                l_i = tl.sum(tl.where(is_row, lmat, 0.0), 0)
                row = (offs_t == i).to(tl.float32) - tl.sum(l_i[:, None] * inv, 0)
                inv = tl.where(is_row, row[None, :], inv)
        w = _dot(inv, k * (b * tl.exp(gc))[:, None], PRECISION)
        tl.store(Wt + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :], w, mask=mk)
        mv = rmask[:, None] & (offs_v < DV)[None, :]
        v = tl.load(V + rows[:, None] * stride_vt + h * stride_vh + offs_v[None, :], mask=mv,
                    other=0.0).to(tl.float32)
        u = _dot(inv, v * b[:, None], PRECISION)
        tl.store(Ut + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :], u, mask=mv)


@_jit
def _gdr_chunk_kernel(
    Q, K, G, State, Slots, Cu, Wt, Ut, At, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_gh, stride_s0, stride_s1, stride_s2,
    stride_wt, stride_wh, stride_ut, stride_uh, stride_at, stride_ah, stride_ot, stride_oh, scale,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BT: tl.constexpr, PRECISION: tl.constexpr,
):
    # One (sequence, value head, Dv block): the state tile [Dk, BLOCK_V] in registers across the chunks.
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    offs_t = tl.arange(0, BT)
    vmask = offs_v < DV
    kmask = offs_k < DK
    hk = h // GROUP
    start = tl.load(Cu + n).to(tl.int64)
    end = tl.load(Cu + n + 1).to(tl.int64)
    slot = tl.load(Slots + n).to(tl.int64)
    sp = State + slot * stride_s0 + h * stride_s1 + offs_k[:, None] * stride_s2 + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(sp, mask=smask, other=0.0).to(tl.float32)
    for c0 in range(start, end, BT):
        rows = c0 + offs_t
        rmask = rows < end
        mk = rmask[:, None] & kmask[None, :]
        mv = rmask[:, None] & vmask[None, :]
        g = tl.load(G + rows * stride_gt + h * stride_gh, mask=rmask, other=0.0).to(tl.float32)
        gc = tl.cumsum(g, 0)  # padded rows add 0: gc of the last row is the chunk's total
        g_last = tl.sum(g, 0)
        w = tl.load(Wt + rows[:, None] * stride_wt + h * stride_wh + offs_k[None, :], mask=mk, other=0.0)
        u = tl.load(Ut + rows[:, None] * stride_ut + h * stride_uh + offs_v[None, :], mask=mv, other=0.0)
        d = u - _dot(w, s, PRECISION)  # [BT, BLOCK_V]
        q = tl.load(Q + rows[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=mk,
                    other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale * tl.exp(gc))[:, None]
        a = tl.load(At + rows[:, None] * stride_at + h * stride_ah + offs_t[None, :], mask=rmask[:, None],
                    other=0.0)
        o = _dot(q, s, PRECISION) + _dot(a, d, PRECISION)
        tl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_v[None, :], o.to(Out.dtype.element_ty),
                 mask=mv)
        k = tl.load(K + rows[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=mk,
                    other=0.0).to(tl.float32)
        k = k * (tl.rsqrt(tl.sum(k * k, 1) + 1e-6) * tl.exp(g_last - gc))[:, None]
        s = s * tl.exp(g_last) + _dot(tl.trans(k), d, PRECISION)
    tl.store(sp, s.to(State.dtype.element_ty), mask=smask)


# ------------------------------------------------------------ public wrappers -------------------------------


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def search_steps(n: int) -> int:
    """SEARCH_STEPS of a kernel that finds a row's or chunk's sequence among n by binary search (the varlen conv,
    the chunk prepare): enough for n, and at least the option gdn.conv_search_steps, so one variant serves every
    batch the engine makes."""
    exact = max(1, (n - 1).bit_length())
    return max(exact, current_options().gdn.conv_search_steps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv) of x [T, C] (any token stride; channels contiguous, else copied) with weight
    [C, K]; conv_state [S, C, K-1] (any strides) updated in place at rows `slots`. Returns a new [T, C].

    No host sync. T == N is taken as a decode step (one token per sequence: sequence n is row cu_seqlens[n]);
    it takes one fused launch. Otherwise two launches: the conv (each token finds its sequence in cu_seqlens),
    then the state update. Rows sharing a slot (CUDA-graph padding) leave that slot with any one's state.
    """
    if not use_triton(x):
        return causal_conv1d_ref(x, weight, bias, conv_state, slots, cu_seqlens)
    x = _last_dim_contiguous(x)
    t, c = x.shape
    kw = weight.shape[1]
    n = slots.shape[0]
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if kw < 2:  # no state to carry: not a Qwen3.5 shape, leave it to the reference
        return causal_conv1d_ref(x, weight, bias, conv_state, slots, cu_seqlens)
    cfg = current_options().gdn
    kp = triton.next_power_of_2(kw - 1)
    has_bias = bias is not None
    b_arg = bias if has_bias else weight
    common = (x.stride(0),)
    s_strides = (conv_state.stride(0), conv_state.stride(1), conv_state.stride(2))
    w_strides = (weight.stride(0), weight.stride(1))
    if t == n:
        bc = cfg.conv_decode_block_c
        _conv_decode_kernel[(n, triton.cdiv(c, bc))](
            x, weight, b_arg, conv_state, slots, cu_seqlens, out, c, *common, out.stride(0), *w_strides, *s_strides,
            K=kw, KP=kp, HAS_BIAS=has_bias, BLOCK_C=bc, num_warps=cfg.conv_decode_warps)
        return out
    bc, bt = cfg.conv_block_c, cfg.conv_block_t
    if t:
        _conv_varlen_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
            x, weight, b_arg, conv_state, slots, cu_seqlens, out, t, n, c, *common, out.stride(0), *w_strides,
            *s_strides, K=kw, HAS_BIAS=has_bias, SEARCH_STEPS=search_steps(n), BLOCK_T=bt,
            BLOCK_C=bc, num_warps=cfg.conv_warps)
    bc = cfg.conv_decode_block_c
    _conv_state_kernel[(n, triton.cdiv(c, bc))](
        x, conv_state, slots, cu_seqlens, c, *common, *s_strides, K=kw, KP=kp, BLOCK_C=bc,
        num_warps=cfg.conv_decode_warps)
    return out


def gdn_gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of gdn_gating_ref in one launch (ten torch ops otherwise). a, b: [T, Hv] with any token stride
    (slices of the fused in-projection's output), last dim contiguous. g [T, Hv] fp32, beta [T, Hv] in b's dtype.

    A separate kernel rather than folded into the delta-rule kernels: those keep the reference's (g, beta)
    interface, which the chunked path reads in two launches (and cumsums), the state-pool tests and the GPU
    sweep call directly.
    """
    if not use_triton(a) or a.stride(-1) != 1 or b.stride(-1) != 1 or a.dim() != 2:
        return gdn_gating_ref(a, b, a_log, dt_bias)
    t, h = a.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty(t, h, dtype=b.dtype, device=b.device)
    if t:
        block_h = triton.next_power_of_2(h)
        block_t = max(1, min(64, 1024 // block_h))
        _gating_kernel[(triton.cdiv(t, block_t),)](
            a, b, a_log, dt_bias, g, beta, t, a.stride(0), b.stride(0), g.stride(0), beta.stride(0),
            H=h, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=1 if block_t * block_h <= 256 else 4)
    return g, beta


def _block_v(configured: int, n: int, hv: int, dv: int) -> int:
    if configured:
        return configured
    # small batches: narrower tiles for more programs (about two per SM on an H200)
    return 16 if n * hv * triton.cdiv(dv, 32) < 264 else 32


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """See gated_delta_rule_ref. q/k/v may be views with any token/head strides (last dim contiguous, else
    copied); g and beta [T, Hv] any strides; the state pool needs a contiguous last dim (else the reference).

    No host sync. T == N (a decode step) takes the recurrent kernel, one token per program; a prefill/extend
    batch takes the chunked kernel (or the recurrent one, by the option gdn.prefill).
    """
    if not use_triton(v) or state.stride(-1) != 1:
        return gated_delta_rule_ref(q, k, v, g, beta, state, slots, cu_seqlens)
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    n = slots.shape[0]
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    if n == 0 or t == 0:
        return out
    cfg = current_options().gdn
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), state.stride(0), state.stride(1),
               state.stride(2), out.stride(0), out.stride(1), dk ** -0.5)
    shape = dict(GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=max(16, triton.next_power_of_2(dk)))
    args = (q, k, v, g, beta, state, slots, cu_seqlens, out)
    if t == n or cfg.prefill == "recurrent":
        bv = _block_v(cfg.decode_block_v, n, hv, dv) if t == n else cfg.recurrent_block_v
        warps = cfg.decode_warps if t == n else cfg.recurrent_warps
        _gdr_recurrent_kernel[(n, hv, triton.cdiv(dv, bv))](*args, *strides, **shape, BLOCK_V=bv, num_warps=warps)
        return out
    # Scratch, row t for token t (chunks start at each sequence's first token): W [T, Hv, Dk], U [T, Hv, Dv],
    # A [T, Hv, 64], fp32. The prepare grid: a program per chunk slot and value head (see the kernel).
    wt = torch.empty(t, hv, dk, dtype=torch.float32, device=v.device)
    ut = torch.empty(t, hv, dv, dtype=torch.float32, device=v.device)
    at = torch.empty(t, hv, _CHUNK, dtype=torch.float32, device=v.device)
    scratch = (wt.stride(0), wt.stride(1), ut.stride(0), ut.stride(1), at.stride(0), at.stride(1))
    prec = cfg.dot_precision
    _gdr_chunk_prepare_kernel[(n + t // _CHUNK, hv)](
        q, k, v, g, beta, cu_seqlens, wt, ut, at, n, *strides[:10], *scratch, strides[-1], **shape,
        BLOCK_DV=max(16, triton.next_power_of_2(dv)), BT=_CHUNK, PRECISION=prec, SEARCH_STEPS=search_steps(n),
        BLOCKED=cfg.prepare_solve == "blocks", num_warps=cfg.prepare_warps, num_stages=1)
    bv = _block_v(cfg.chunk_block_v, n, hv, dv)
    _gdr_chunk_kernel[(n, hv, triton.cdiv(dv, bv))](
        q, k, g, state, slots, cu_seqlens, wt, ut, at, out, *strides[:4], *strides[6:8], *strides[10:13],
        *scratch, *strides[13:], **shape, BLOCK_V=bv, BT=_CHUNK, PRECISION=prec, num_warps=cfg.chunk_warps,
        num_stages=cfg.chunk_stages)
    return out
