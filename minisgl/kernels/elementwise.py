"""Elementwise ops of the decoder: RMSNorm (plain, fused with the residual add, per head), SiLU-and-mul, RoPE
(alone, or after Qwen3's per-head q/k norms in the same pass), and the K/V store into the paged pool.

Qwen3.5 adds variants: the zero-centred RMSNorm (scale (1 + w) in fp32, `zero_centred=True` on the norms and on
`norm_and_rope`), partial rotary (a cos/sin table narrower than the head), the gated RMSNorm of the Gated
DeltaNet's output (`gated_rms_norm`: norm(x) * w * silu(z)) and the attention's output gate (`sigmoid_mul`).

Each op has a torch reference (`*_ref`, the semantics) and a fused Triton kernel. The public wrappers use
Triton for CUDA tensors and the reference otherwise; the kernel option `triton_on_cpu` (MINISGL_FORCE_TRITON=1)
sends CPU tensors to Triton too, which only works under TRITON_INTERPRET=1 (how the kernels are tested without a
GPU).
Triton is optional: without it this module still imports and everything runs the torch path.

Every kernel takes `USE_PDL` (programmatic dependent launch, kernels/pdl.py): launched with it, a kernel may start
while its predecessor still runs, so its first statement, before any global load or store, is the wait.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernels.options import current_options
from minisgl.kernels.pdl import pdl_enter, pdl_launch, pdl_launch_dependents, pdl_wait

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch references
    triton = None
    tl = None

__all__ = ["apply_rope", "fused_add_rms_norm", "gated_rms_norm", "norm_and_rope", "rms_norm", "sigmoid_mul",
           "silu_and_mul", "store_kv"]


def _jit(fn=None, **options):
    if fn is None:  # used as @_jit(do_not_specialize=...)
        return lambda f: _jit(f, **options)
    return triton.jit(fn, **options) if triton is not None else fn


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` takes its Triton kernel: a CUDA tensor, or any under the kernel option
    `triton_on_cpu` (the interpreter, for tests); else the torch reference. Every kernel module asks this."""
    if triton is None:
        return False
    return x.is_cuda or current_options().triton_on_cpu


def _norm_config(block: int) -> tuple[int, int]:
    """(rows per program, warps) for a padded row length: the options' `norm_configs` (scripts sweep them on
    the GPU), else the rule below."""
    for length, rows, warps in current_options().norm_configs:
        if length == block:
            return rows, warps
    # From a noisy sweep on an H200: several short rows per program, 4-8 warps.
    rows = 16 if block <= 256 else (4 if block <= 4096 else 1)
    return rows, (4 if rows * block <= 4096 else 8)


# ------------------------------------------------------------ references ------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, cast back before the weight multiply (as HF's Llama/Qwen RMSNorm does).
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def zero_centred_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Qwen3.5 (HF's Qwen3_5RMSNorm): scale by (1 + w), everything in fp32, one rounding at the end.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    norm = zero_centred_rms_norm_ref if zero_centred else rms_norm_ref
    return norm(new_residual, weight, eps), new_residual


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's Qwen3_5RMSNormGated: the normed x rounded to x's dtype, times w (rounded), times silu(z) in fp32.
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(z.float())).to(x.dtype)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The table's width is the rotary dim: partial rotary (Qwen3.5 turns the first quarter of each head) keeps
    # the dims past it as they are.
    rotary_dim = cos_sin.shape[-1]
    half = rotary_dim // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half].to(q.dtype), cs[:, None, half:].to(q.dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return torch.cat(turned + [x[..., rotary_dim:]] if rotary_dim < x.shape[-1] else turned, dim=-1)

    q.copy_(rot(q))
    k.copy_(rot(k))
    return q, k


def norm_and_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    norm = zero_centred_rms_norm_ref if zero_centred else rms_norm_ref
    return apply_rope_ref(norm(q, q_weight, eps), norm(k, k_weight, eps), positions, cos_sin)


def store_kv_ref(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    k_buf[loc] = k.to(k_buf.dtype)
    v_buf[loc] = v.to(v_buf.dtype)


# ------------------------------------------------------------ Triton kernels --------------------------------


@_jit
def _row_tile(n_rows, n_inner, N, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's BLOCK_R rows of a norm kernel, addressed as (outer i0, inner i1) of a [T, H, D] view, and
    its column offsets [1, BLOCK]: (i0, i1, offs, column mask, [BLOCK_R, BLOCK] mask)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    i0 = (rows // n_inner).to(tl.int64)[:, None]
    i1 = (rows % n_inner).to(tl.int64)[:, None]
    offs = tl.arange(0, BLOCK)
    cmask = offs < N
    return i0, i1, offs[None, :], cmask, rmask[:, None] & cmask[None, :]


@_jit
def sum_squares(xf, axis: tl.constexpr):
    """Sums of squares along `axis`, in fp64. A half-precision value's square is exact in fp32, and a sum of a few
    thousand such squares is exact in fp64 (all but the rarest spreads of magnitude), so the sum does not depend
    on the order of its terms: a kernel that adds a row tile by tile (the GEMV with its norm folded in,
    kernels/gemv.py) gets the same rstd, to the bit, as the norm kernel that reduces the row at once."""
    x64 = xf.to(tl.float64)
    return tl.sum(x64 * x64, axis)


# n_rows follows the step's token count: one compiled variant for all counts, not one per count % 16.
@_jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    X, R, W, Y, RES_OUT, n_rows, n_inner,
    stride_x0, stride_x1, stride_r0, stride_r1, stride_y0, stride_y1, stride_o0, stride_o1,
    N, eps, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, HAS_RES: tl.constexpr, ZERO_CENTRED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # before any global access: the predecessor may still be running (kernels/pdl.py)
        pdl_enter()
    # BLOCK_R rows per program (short rows, e.g. per-head norms over 128 values, would leave a program mostly
    # idle). Rows are addressed as (outer, inner) so a [T, H, D] view with any token/head strides (Qwen3's
    # per-head q/k norm on a slice of the fused qkv output) needs no copy.
    i0, i1, offs, cmask, mask = _row_tile(n_rows, n_inner, N, BLOCK, BLOCK_R)
    x = tl.load(X + i0 * stride_x0 + i1 * stride_x1 + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + i0 * stride_r0 + i1 * stride_r1 + offs, mask=mask, other=0.0)
        # Round the sum to the residual dtype first: the norm must see exactly the residual it returns.
        s = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + i0 * stride_o0 + i1 * stride_o1 + offs, s, mask=mask)
        xf = s.to(tl.float32)
        norm_dtype = RES_OUT.dtype.element_ty
    else:
        xf = x.to(tl.float32)
        norm_dtype = X.dtype.element_ty
    rstd = tl.rsqrt(sum_squares(xf, 1).to(tl.float32) / N + eps)
    w = tl.load(W + offs, mask=cmask[None, :], other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # Qwen3.5: (1 + w), all in fp32, rounded once
        y = xf * rstd[:, None] * (1.0 + w)
    else:  # Llama / Qwen3: the normed value rounded to the activation dtype before the weight multiply
        y = w * (xf * rstd[:, None]).to(norm_dtype).to(tl.float32)
    tl.store(Y + i0 * stride_y0 + i1 * stride_y1 + offs, y.to(Y.dtype.element_ty), mask=mask)


@_jit(do_not_specialize=["n_rows"])
def _gated_rms_norm_kernel(
    X, Z, W, Y, n_rows, n_inner, stride_x0, stride_x1, stride_z0, stride_z1, stride_y0, stride_y1,
    N, eps, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl_enter()
    # Rows as in _rms_norm_kernel. Rounded where the torch reference rounds: the normed value, its product with
    # the weight, and the result (silu(z) stays fp32).
    i0, i1, offs, cmask, mask = _row_tile(n_rows, n_inner, N, BLOCK, BLOCK_R)
    dt = X.dtype.element_ty
    xf = tl.load(X + i0 * stride_x0 + i1 * stride_x1 + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + i0 * stride_z0 + i1 * stride_z1 + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)
    w = tl.load(W + offs, mask=cmask[None, :], other=0.0).to(tl.float32)
    wn = (w * (xf * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(Y + i0 * stride_y0 + i1 * stride_y1 + offs, (wn * (z / (1.0 + tl.exp(-z)))).to(dt), mask=mask)


@_jit(do_not_specialize=["n_tokens"])
def _sigmoid_mul_kernel(X, G, Y, n_tokens, stride_xt, stride_gt, stride_gh, stride_yt, D: tl.constexpr,
                        WIDTH: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl_enter()
    # Row t of x [T, H * D] times sigmoid(gate[t]), the gate a [T, H, D] view with any token / head stride.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < WIDTH
    dt = Y.dtype.element_ty
    x = tl.load(X + t * stride_xt + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + t * stride_gt + (offs // D) * stride_gh + offs % D, mask=mask, other=0.0).to(tl.float32)
    # sigmoid rounded to the activation dtype before the product, as torch's two ops round
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(Y + t * stride_yt + offs, (x * s).to(dt), mask=mask)


@_jit
def _silu_and_mul_kernel(GU, Out, stride_g, stride_o, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(GU + t * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + t * stride_g + inter + offs, mask=mask, other=0.0).to(tl.float32)
    # Round silu(gate) to the activation dtype before the product, as the two-op torch version does.
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


@_jit
def head_norm_halves(x1, x2, W, rstd, offs_d, dmask, dt, HALF: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """The two rotary halves [heads, HALF] of each head (fp32) after its RMSNorm (rstd [heads, 1]), rounded where
    rms_norm then apply_rope round: times W (or (1 + W) with ZERO_CENTRED)."""
    w1 = tl.load(W + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if ZERO_CENTRED:  # Qwen3.5: (1 + w) in fp32, the norm's output rounded once, then rope
        x1 = (x1 * rstd * (1.0 + w1)).to(dt).to(tl.float32)
        x2 = (x2 * rstd * (1.0 + w2)).to(dt).to(tl.float32)
    else:  # the normed value rounded, then its product with the weight
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x1, x2


@_jit
def rotate_halves(x1, x2, cos, sin, dt):
    """NeoX RoPE of the halves (fp32), rounded to dt: (x1 cos - x2 sin, x2 cos + x1 sin). The fused multiply-adds
    are spelled out: left to the compiler, which product a kernel fuses may differ between kernels (the decode
    kernel's fused RoPE against the RoPE kernel's), and with it the last bit."""
    return tl.fma(x1, cos, -(x2 * sin)).to(dt), tl.fma(x2, cos, x1 * sin).to(dt)


@_jit
def norm_rope_full(x, xp, w, wp, cos, sin, sign, eps, dt, D: tl.constexpr, NORM: tl.constexpr):
    """`norm_rope_halves` on whole heads [heads, D] (fp32) instead of their halves: xp holds each element's rotary
    partner (x[(d + D/2) % D]), w and wp [1, D] (fp32, read with NORM only) the norm's weight at each element and at
    its partner, cos and sin [1, D] repeat the half tables, sign is -1 on the first half and +1 on the second.
    Every element goes through the same operations as in the halves version (the exact fp64 head sums, the same
    roundings, fma(x1, cos, -(x2 sin)) and fma(x2, cos, x1 sin)), so the results are the same to the bit; the tile
    needs no join of halves, which made the decode kernel's fused RoPE hand its q·k dot a different operand layout
    (kWidth 4, not 2), i.e. another order of the products' sum (run27, rope_bits). Every input comes loaded: the
    caller issues its loads together, before the sum's cross-warp barrier, which no load crosses."""
    if NORM:
        rstd = tl.rsqrt(sum_squares(x, 1).to(tl.float32) / D + eps)[:, None]
        x = (w * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return tl.fma(x, cos, sign * (xp * sin)).to(dt)


@_jit
def norm_rope_halves(x1, x2, W, cos, sin, offs_d, dmask, eps, dt, HALF: tl.constexpr, NORM: tl.constexpr,
                     ZERO_CENTRED: tl.constexpr):
    """A whole-head rotary (no REST dims) of the halves x1, x2 [heads, HALF] (fp32): with NORM, RMSNorm each head
    first (Qwen3's q/k norms), then rotate; both halves rounded to dt. The decode kernel's fused RoPE
    (kernels/attention.py) does the same operations on whole heads (`norm_rope_full`)."""
    if NORM:
        # exact sums (sum_squares): a head's rstd must not depend on how a kernel's layout orders the terms
        rstd = tl.rsqrt((sum_squares(x1, 1) + sum_squares(x2, 1)).to(tl.float32) / (2 * HALF) + eps)[:, None]
        x1, x2 = head_norm_halves(x1, x2, W, rstd, offs_d, dmask, dt, HALF, ZERO_CENTRED)
    return rotate_halves(x1, x2, cos, sin, dt)


@_jit
def _rope_heads(X, stride_h, Y, stride_yh, W, cos, sin, offs_d, dmask, eps, H: tl.constexpr,
                BLOCK_H: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr,
                NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr):
    """Rotate the first 2 * HALF dims of the H heads at X, writing them to Y (Y may be X: in place); the REST
    dims after them (partial rotary) are not turned. With NORM, RMSNorm each whole head (times W, or (1 + W)
    with ZERO_CENTRED) first."""
    offs_h = tl.arange(0, BLOCK_H)
    hmask = (offs_h < H)[:, None]
    mask = hmask & dmask[None, :]
    p1 = X + offs_h[:, None] * stride_h + offs_d[None, :]
    y1 = Y + offs_h[:, None] * stride_yh + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    if REST > 0:
        offs_r = tl.arange(0, BLOCK_REST)
        rmask = offs_r < REST
        mask3 = hmask & rmask[None, :]
        p3 = X + offs_h[:, None] * stride_h + 2 * HALF + offs_r[None, :]
        x3 = tl.load(p3, mask=mask3, other=0.0).to(tl.float32)
        if NORM:
            ss = (sum_squares(x1, 1) + sum_squares(x2, 1) + sum_squares(x3, 1)).to(tl.float32)
            rstd = tl.rsqrt(ss / (2 * HALF + REST) + eps)[:, None]
            x1, x2 = head_norm_halves(x1, x2, W, rstd, offs_d, dmask, dt, HALF, ZERO_CENTRED)
            w3 = tl.load(W + 2 * HALF + offs_r, mask=rmask, other=0.0).to(tl.float32)[None, :]
            if ZERO_CENTRED:
                x3 = x3 * rstd * (1.0 + w3)
            else:
                x3 = w3 * (x3 * rstd).to(dt).to(tl.float32)
        r1, r2 = rotate_halves(x1, x2, cos, sin, dt)
        tl.store(Y + offs_h[:, None] * stride_yh + 2 * HALF + offs_r[None, :], x3.to(dt), mask=mask3)
    else:
        r1, r2 = norm_rope_halves(x1, x2, W, cos, sin, offs_d, dmask, eps, dt, HALF, NORM, ZERO_CENTRED)
    tl.store(y1, r1, mask=mask)
    tl.store(y1 + HALF, r2, mask=mask)


@_jit
def _rope_kernel(
    Q, K, QOut, Pos, CosSin, WQ, WK, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_cs,
    eps, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    NORM: tl.constexpr, ZERO_CENTRED: tl.constexpr, EARLY_META: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        if EARLY_META:  # the position and its cos/sin are the step's input and a constant: read before the wait
            pdl_launch_dependents()
        else:
            pdl_enter()
    # One program per token: its q heads (to QOut, which may be Q) and k heads (in place), (normalised and)
    # rotated.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = tl.load(CosSin + pos * stride_cs + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(CosSin + pos * stride_cs + HALF + offs_d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if EARLY_META and USE_PDL:
        pdl_wait()
    _rope_heads(Q + t * stride_qt, stride_qh, QOut + t * stride_ot, stride_oh, WQ, cos, sin, offs_d, dmask, eps,
                HQ, BLOCK_HQ, HALF, REST, BLOCK_REST, NORM, ZERO_CENTRED)
    kp = K + t * stride_kt
    _rope_heads(kp, stride_kh, kp, stride_kh, WK, cos, sin, offs_d, dmask, eps, HKV, BLOCK_HKV, HALF, REST,
                BLOCK_REST, NORM, ZERO_CENTRED)


@_jit
def _store_kv_kernel(
    K, V, Loc, KBuf, VBuf, stride_kt, stride_kh, stride_vt, stride_vh, stride_kbn, stride_kbh, stride_vbn,
    stride_vbh, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl_enter()
    # One program per token: its K and V rows (all kv heads) go to slot Loc[t] of the layer's buffers.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < H) & (offs_d < D)
    k = tl.load(K + t * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    tl.store(KBuf + slot * stride_kbn + offs_h * stride_kbh + offs_d, k.to(KBuf.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    tl.store(VBuf + slot * stride_vbn + offs_h * stride_vbh + offs_d, v.to(VBuf.dtype.element_ty), mask=mask)


# ------------------------------------------------------------ public wrappers -------------------------------


def _rows_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """x as (tensor, n_outer, n_inner, stride_outer, stride_inner) over its leading dims, copying only if
    those dims cannot be described by two strides."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, x.shape[0], 1, x.stride(0), 0


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape, n = x.shape, x.shape[-1]
    xv, n0, n1, sx0, sx1 = _rows_view(x)
    if residual is not None:
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        rv, _, _, sr0, sr1 = _rows_view(residual.expand_as(x))
        res_out = torch.empty(shape, dtype=res_dtype, device=x.device)
        ro = res_out.view(n0, n1, n)
        norm_dtype = res_dtype
    else:
        rv, sr0, sr1, res_out, ro, norm_dtype = xv, 0, 0, None, None, x.dtype
    # the zero-centred norm returns the activation dtype; the plain one weight * normed's promoted dtype
    y_dtype = norm_dtype if zero_centred else torch.promote_types(weight.dtype, norm_dtype)
    y = torch.empty(shape, dtype=y_dtype, device=x.device)
    yv = y.view(n0, n1, n)
    if n0 * n1 == 0:
        return y, res_out
    block = triton.next_power_of_2(n)
    block_r, num_warps = _norm_config(block)
    n_rows = n0 * n1
    kw = pdl_launch(x)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        xv, rv, weight, yv, ro if ro is not None else yv, n_rows, n1,
        sx0, sx1, sr0, sr1, yv.stride(0), yv.stride(1),
        ro.stride(0) if ro is not None else 0, ro.stride(1) if ro is not None else 0,
        n, eps, BLOCK=block, BLOCK_R=block_r, HAS_RES=residual is not None, ZERO_CENTRED=zero_centred,
        USE_PDL=bool(kw), num_warps=num_warps, **kw,
    )
    return y, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x ([T, H], or [T, heads, D] for per-head norms; any leading strides).
    zero_centred: Qwen3.5's norm, scale (1 + w) in fp32, output in x's dtype."""
    if not use_triton(x):
        return (zero_centred_rms_norm_ref if zero_centred else rms_norm_ref)(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps, zero_centred)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       zero_centred: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; inputs are not modified. The sum is rounded to the
    residual's dtype (as a bf16 add rounds) before the norm reads it."""
    if not use_triton(x):
        return fused_add_rms_norm_ref(x, residual, weight, eps, zero_centred)
    y, res = _launch_rms_norm(x, residual, weight, eps, zero_centred)
    return y, res


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(z) over the last dim (the Gated DeltaNet's output norm), in x's dtype, one pass.
    x, z: [T, H, D] or [T, D], any leading strides (z is typically a slice of a projection output)."""
    if not use_triton(x) or weight.dtype != x.dtype or z.shape != x.shape:
        return gated_rms_norm_ref(x, z, weight, eps)
    n = x.shape[-1]
    xv, n0, n1, sx0, sx1 = _rows_view(x)
    zv, _, _, sz0, sz1 = _rows_view(z)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    yv = y.view(n0, n1, n)
    if n0 * n1 == 0:
        return y
    block = triton.next_power_of_2(n)
    block_r, num_warps = _norm_config(block)
    kw = pdl_launch(x)
    _gated_rms_norm_kernel[(triton.cdiv(n0 * n1, block_r),)](
        xv, zv, weight, yv, n0 * n1, n1, sx0, sx1, sz0, sz1, yv.stride(0), yv.stride(1), n, eps,
        BLOCK=block, BLOCK_R=block_r, USE_PDL=bool(kw), num_warps=num_warps, **kw)
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in one pass: Qwen3.5's attention output gate. x: [T, H * D] (last dim contiguous);
    gate: [T, H, D] with any token / head strides (the gate half of q_proj's per-head [q | gate] output).
    Returns [T, H * D] in x's dtype."""
    t, width = x.shape
    if (not use_triton(x) or gate.dim() != 3 or gate.stride(-1) != 1 or x.stride(-1) != 1
            or gate.dtype != x.dtype):
        return sigmoid_mul_ref(x, gate.reshape(t, width))
    y = torch.empty(t, width, dtype=x.dtype, device=x.device)
    if t:
        block = min(1024, triton.next_power_of_2(width))
        kw = pdl_launch(x)
        _sigmoid_mul_kernel[(t, triton.cdiv(width, block))](
            x, gate, y, t, x.stride(0), gate.stride(0), gate.stride(1), y.stride(0), D=gate.shape[-1],
            WIDTH=width, BLOCK=block, USE_PDL=bool(kw), num_warps=4, **kw)
    return y


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim: [T, 2I] -> [T, I]."""
    if not use_triton(gate_up):
        return silu_and_mul_ref(gate_up)
    shape = gate_up.shape
    gu = gate_up.reshape(-1, shape[-1])
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    inter = shape[-1] // 2
    out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] and inter:
        block = min(1024, triton.next_power_of_2(inter))
        kw = pdl_launch(gu)
        _silu_and_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, gu.stride(0), out.stride(0), inter, BLOCK=block, USE_PDL=bool(kw), num_warps=4, **kw)
    return out.view(*shape[:-1], inter)


def _launch_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                 zero_centred: bool = False, q_out: torch.Tensor | None = None) -> None:
    t, hq, d = q.shape
    hkv, half = k.shape[1], cos_sin.shape[-1] // 2
    rest = d - 2 * half
    norm = q_weight is not None
    q_out = q if q_out is None else q_out
    kw = pdl_launch(q)
    _rope_kernel[(t,)](
        q, k, q_out, positions, cos_sin, q_weight if norm else cos_sin, k_weight if norm else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), cos_sin.stride(0),
        eps, HQ=hq, HKV=hkv, HALF=half, REST=rest, BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HKV=triton.next_power_of_2(hkv), BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)), NORM=norm, ZERO_CENTRED=zero_centred,
        EARLY_META=current_options().early_metadata, USE_PDL=bool(kw), num_warps=4, **kw,
    )


def _rope_fits(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    """The kernel's layout: an even rotary width up to the head's, last dims contiguous, q and k one dtype."""
    r = cos_sin.shape[-1]
    return (0 < r <= q.shape[-1] and r % 2 == 0 and q.shape[-1] == k.shape[-1] and q.stride(-1) == 1
            and k.stride(-1) == 1 and cos_sin.stride(-1) == 1 and q.dtype == k.dtype)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding in place. q: [T, Hq, D], k: [T, Hkv, D] (token/head strides free, last dim
    contiguous, e.g. slices of a fused qkv output); cos_sin: [max_pos, R] fp32 = [cos | sin], R = the rotary dim
    (R < D: partial rotary, only the first R dims of each head turn)."""
    if not use_triton(q) or not _rope_fits(q, k, cos_sin):
        return apply_rope_ref(q, k, positions, cos_sin)
    if q.shape[0]:
        _launch_rope(q, k, positions, cos_sin, None, None, 0.0)
    return q, k


def norm_and_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                  q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, zero_centred: bool = False,
                  q_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's; zero_centred: Qwen3.5's, scale (1 + w) in fp32), then NeoX RoPE over
    the table's width R (R < head dim: partial rotary, the rest of each head normalised only): one launch
    instead of three. k (a view into the qkv output) is updated in place on a GPU; q too, unless `q_out` (a
    [T, Hq, D] tensor, e.g. a contiguous one when q is a strided view) is given: then q is left as it is and
    the result written there. Returns (q or q_out, k); the torch path returns new tensors (or q_out, filled)."""
    if not use_triton(q) or not _rope_fits(q, k, cos_sin) or q_weight.dtype != q.dtype:
        q_ref, k_ref = norm_and_rope_ref(q, k, positions, cos_sin, q_weight, k_weight, eps, zero_centred)
        if q_out is None:
            return q_ref, k_ref
        return q_out.copy_(q_ref), k_ref
    if q.shape[0]:
        _launch_rope(q, k, positions, cos_sin, q_weight, k_weight, eps, zero_centred, q_out)
    return (q if q_out is None else q_out), k


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_buf[loc] = k and v_buf[loc] = v in one launch (two index-puts otherwise).

    k, v: [T, Hkv, D] with free token/head strides (views into the qkv output); k_buf, v_buf: one layer's
    [num_slots, Hkv, D]; loc: [T] slots. Several rows may target slot 0 (CUDA Graph padding): any one wins.
    """
    if not use_triton(k) or k.stride(-1) != 1 or v.stride(-1) != 1 or k_buf.stride(-1) != 1:
        store_kv_ref(k_buf, v_buf, loc, k, v)
        return
    t, h, d = k.shape
    if t == 0:
        return
    kw = pdl_launch(k)
    _store_kv_kernel[(t,)](
        k, v, loc, k_buf, v_buf, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        H=h, D=d, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), USE_PDL=bool(kw),
        num_warps=4, **kw,
    )
