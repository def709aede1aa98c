"""Decode-sized matmuls: `y = x @ W.T (+ b)` for a handful of rows, as a Triton GEMV that streams W once.

At batch 1 a decode step's matmuls are matrix-vector products: each weight byte is read once and used for one
multiply-add, so the step lasts as long as the weights take to stream from HBM. cuBLAS runs them with GEMM tiles
(and, for narrow outputs, split-K plus a second reduce kernel): on an H200 it streamed Qwen3-0.6B's projections
at 1.0-1.6 TB/s in a batch-1 step (`reports/h200/run9/decode_timeline_new.json`), a third of what the card
can do. Here each program owns a few output rows and the whole reduction: it loads a `[BLOCK_N, BLOCK_K]` tile
of W, multiplies it by the matching slice of every input row, and adds into fp32 accumulators; there is no
cross-program reduction, so one launch per matmul.

`GemvLinear` wraps an `nn.Linear` (sharing its parameters): up to `GEMV_MAX_ROWS` rows (fewer where the card's
tuned table says cuBLAS wins from there on) take the GEMV, more rows `F.linear`; `GemvMLP` also folds the MLP's
SiLU-and-mul into a GEMV: into the epilogue of gate_up's (kernel option `gemv_act_epilogue`, on by default: each
program owns gate rows and their up rows and writes their activation once; W2 0.92 -> 0.90 ms on Qwen3-0.6B on an
H100, reports/h100/run32), or, where gate_up stays on cuBLAS or the option is off, into the prologue of down's
(every program computes the activation of the whole row it reads). `use_gemv(model, fold=...)` swaps every plain
`nn.Linear` of a model, and every MLP of the classes it is given (the caller's: this module knows no model), for
them; the engine does that on a GPU for half-precision weights unless the `gemv` switch is off (`EngineConfig.gemv`,
`--disable-gemv`). The tile table is the kernel option `gemv_configs` or the GPU's tuned table, resolved when the
modules are swapped in, so each keeps its engine's tiles. Like the other kernel modules, CPU tensors take the torch
path unless the kernel option `triton_on_cpu` is on (then the Triton interpreter).

`GemvNormLayer` (the kernel option `gemv_norm_fold`, on by default) goes one step further: a decoder layer's
RMSNorms run inside the GEMVs around them, the residual add in the epilogue of the GEMV before (`gemv(add=)`)
and the norm in the prologue of the GEMV after (`gemv_rms_norm`), the same outputs to the bit. Batch-1 decode
(W2) on an H100: 0.962 -> 0.935 ms a token on Qwen3-0.6B (reports/h100/run29). Its first version, the add in the
next GEMV's prologue too, was 0.6-1.1% slower (run22): every program of that GEMV read the hidden row and the
residual row and added them, where now each reads the one stream row (the add made once, in the GEMV before).
The norm's rstd needs the row's sum of squares. Every program of the GEMV after computing it, reading the whole row
before its first product, made Qwen3-8B 4.3% slower than no fold (run31: at a 4,096-wide row, thousands of programs
each read it in four dependent steps). So the GEMV that writes the stream also adds its rows' squares into a small
fp64 buffer (`FoldSums`, kernel option `gemv_fold_sum_squares`, on by default), and the GEMV after reads the sums:
W2 0.932 -> 0.911 ms on Qwen3-0.6B, 5.963 -> 5.658 ms on Qwen3-8B, now 1.0% under no fold (reports/h100/run31).

The MLP's L2 prefetch (kernel option `gemv_mlp_prefetch_mb`, 0 = off). In a batch-1 step HBM idles while the
attention runs (its two launches are chains of dependent loads on a few MB of keys): only the o projection's
programs, resident early under PDL, load their first weight tiles then. With the option the o GEMV
(`gemv(l2_prefetch=)`, from `GemvNormLayer`) also asks L2 for up to that many MiB of the same layer's MLP weights,
the gate and up rows the gate_up GEMV's first programs read, then the down projection's first rows
(`mlp_prefetch_regions`): Hopper's `cp.async.bulk.prefetch.L2`, 16 KiB a request, spread over its programs and issued
before its PDL wait (weights, never written by a kernel), fire and forget. Only where the bytes come from changes,
never a sum. (run27 measured a prefetch from every GEMV of the next matmul's first MiB, where the GEMVs stream
anyway: 7-16% slower.)

With programmatic dependent launch (kernels/pdl.py) the GEMV may start while the kernel before it still runs. It
waits for it before reading x or writing y, but it loads its first weight tiles *before* the wait (up to the kernel
option `gemv_pdl_early_tiles` of them), so the weight stream overlaps the predecessor's tail: the weights are
written once at load time, long before any decode kernel runs, and never by a kernel, so reading them early is safe.
(That is a precondition on `gemv`'s `weight`: it must not be the output of a kernel that may still be in flight.)

Where a program's K loop runs on after those tiles (Qwen3-8B's down projection: six 2,048-wide tiles, four after the
wait), each iteration waits for its own load: Triton pipelines no load of a plain loop whose values feed no `tl.dot`.
The kernel option `gemv_stages` (1 by default, until timed) asks for the loop's loads to be pipelined through shared
memory, that many stages (cp.async, `stages - 1` tiles in flight ahead of the products). A tile comes back into the
registers in the layout a plain load gives it, so the products and their sums are the same; `lab.checks.pdl_ptx`
checks that on the PTX for sm_90 (the loop pipelined, nothing before the PDL wait, the reductions' layouts).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import elementwise as ew
from minisgl.kernels.options import current_options
from minisgl.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: GemvLinear is plain F.linear
    triton = None
    tl = None

try:  # the clocks read by the launch stamps (gemv(stamps=)), a diagnostic
    from triton.language.extra.cuda import globaltimer, smid
except ImportError:
    globaltimer = smid = None

__all__ = ["GEMV_MAX_ROWS", "PREFETCH_PIECE_BYTES", "STAMP_FIELDS", "SUM_LANES", "FoldSums", "GemvLinear", "GemvMLP",
           "GemvNormLayer", "device_table", "gemv", "gemv_config", "gemv_max_rows", "gemv_programs", "gemv_rms_norm",
           "link_norm_layers", "load_table", "mlp_prefetch_regions", "table_for", "use_gemv"]

# Rows (tokens) up to which the GEMV replaces cuBLAS; above it a GEMM's tiles reuse each weight load across rows.
GEMV_MAX_ROWS = 4
# A tile table: (BLOCK_N, BLOCK_K, num_warps, max_rows) by weight shape (N, K): the tiles, and up to how many rows
# the GEMV beat cuBLAS; None where it never did (use_gemv then keeps the nn.Linear). Read from the JSON that
# lab/tune/gemv.py writes ({"N,K": [bn, bk, warps, rows] or null}); shapes not in it take gemv_config's
# rule up to GEMV_MAX_ROWS rows.
GemvTable = Mapping[tuple[int, int], "tuple[int, int, int, int] | None"]
NO_TABLE: GemvTable = MappingProxyType({})

# Tables measured by lab/tune/gemv.py, one per GPU model: gemv_tuned/<device name>.json.
TUNED_DIR = Path(__file__).parent / "gemv_tuned"


@functools.cache
def load_table(path: str) -> GemvTable:
    """The tile table in the JSON file at `path` (read once per path; read-only)."""
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for key, value in raw.items():
        n, k = (int(v) for v in key.split(","))
        # a 3-entry value (tiles only) holds up to GEMV_MAX_ROWS rows
        table[(n, k)] = (*value, GEMV_MAX_ROWS)[:4] if value is not None else None
    return MappingProxyType(table)


def device_table(device_name: str) -> GemvTable:
    """The tuned table of this GPU model (kernels/gemv_tuned/), or no table."""
    path = TUNED_DIR / f"{device_name.replace(' ', '_')}.json"
    return load_table(str(path)) if path.is_file() else NO_TABLE


def table_for(device: torch.device) -> GemvTable:
    """The table a GEMV on `device` uses under the kernel options in force: `gemv_configs` when set, else the
    device's tuned table (none on a CPU)."""
    path = current_options().gemv_configs
    if path:
        return load_table(str(path))
    return device_table(torch.cuda.get_device_name(device)) if device.type == "cuda" else NO_TABLE


_jit = ew._jit  # triton.jit where Triton is installed


# The early weight load under PDL: each program loads up to `gemv_pdl_early_tiles` (a kernel option) of its weight
# tiles before waiting for the previous kernel (see the module docstring; the kernel holds at most 3); 0 waits
# first, as every other kernel does. Only matters for launches with PDL. 2 had the lowest batch-1 TPOT on
# Qwen3-0.6B in reports/h200/run12 (early_ab06, means of two rounds: 1.006 ms, against 1.014 with 1 and 1.035
# with 3, whose rounds were 1.060 and 1.011).
MAX_EARLY_TILES = 3

# The weight loads of a program's loop over K (after its early tiles) are not pipelined by Triton here: each tile's
# load is issued, then waited on by its products (the PTX of Qwen3-8B's down GEMV has no cp.async). With the kernel
# option `gemv_prefetch` a program issues the next tile's load before it multiplies the current one (two tiles of
# registers), where the loop runs twice or more: Qwen3-8B's down projection (K = 12,288 in 2,048-wide tiles). Off:
# on an H100 at the rule's 1,024-wide tiles (every 8B GEMV looping) it made Qwen3-8B's step 2.6% slower
# (reports/h100/run33); not yet timed where only the down projection loops.

# The folded norm's sums of squares taken in the epilogue of the GEMV that writes the residual stream (kernel option
# `gemv_fold_sum_squares`): every program adds its share of a row into one of SUM_LANES fp64 slots (program id mod
# SUM_LANES), so a thousand programs do not queue on one address; the GEMV after adds the lanes up. fp64 sums of
# half-precision squares are exact (ew.sum_squares: all but the rarest spreads of magnitude), so neither the order of
# the atomic adds nor the lanes change the rstd: it is the norm kernel's to the bit.
SUM_LANES = 16
MAX_STAGE_BYTES = 160 * 1024  # shared memory the K loop's pipeline may take (sm_90: 227 KB a block)
# gemv(stamps=): a program's row of int64s, the global timer (ns) when it began, when its PDL wait returned (its
# beginning without PDL) and when it ended, then the SM it ran on
STAMP_FIELDS = 4
# The MLP's L2 prefetch (gemv(l2_prefetch=)): each request asks for one piece this long, at most this many regions
PREFETCH_PIECE_BYTES = 16 << 10
MAX_PREFETCH_REGIONS = 3
_SUM_LANES = tl.constexpr(SUM_LANES) if tl is not None else SUM_LANES
_STAMP_FIELDS = tl.constexpr(STAMP_FIELDS) if tl is not None else STAMP_FIELDS


@_jit
def _prefetch_l2(ptrs, nbytes, active):
    """Ask L2 for `nbytes` from each address where `active` is non-zero (Hopper's bulk prefetch: the thread does not
    wait for it, and nothing lands in registers)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [ptrs, nbytes, active], dtype=tl.int32, is_pure=False, pack=1)


@_jit
def _prefetch_region(ptr, count, last, pid, LANES: tl.constexpr, PIECE: tl.constexpr):
    """This program's pieces of a region (pid, pid + programs, ...: `count` pieces of PIECE elements, the last one
    starting at element `last`, so none reads past the region's end) asked of L2."""
    piece = tl.arange(0, LANES) * tl.num_programs(0) + pid
    start = tl.minimum(piece.to(tl.int64) * PIECE, last)
    nbytes = tl.full((LANES,), PIECE * ptr.dtype.element_ty.primitive_bitwidth // 8, tl.int32)
    _prefetch_l2(ptr + start, nbytes, (piece < count).to(tl.int32))


@_jit
def _load_w(w_ptr, offs_n, n_mask, k, k_mask, stride_wn):
    # each weight byte is used once: keep it out of L2's way
    return tl.load(w_ptr + offs_n[:, None] * stride_wn + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                   other=0.0, eviction_policy="evict_first")


@_jit
def _x_tile(x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, k, k_mask, K, stride_xm, stride_rm,
            SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """The input rows' columns k [ROWS_PAD, BLOCK_K], in fp32, as the matmul sees them."""
    mask = m_mask[:, None] & k_mask[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    if SILU_MUL:  # x holds [gate | up] (2K wide): the input is silu(gate) * up, rounded as silu_and_mul does
        up = tl.load(x_ptrs + K, mask=mask, other=0.0).to(tl.float32)
        silu = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
        x = (silu * up).to(dt).to(tl.float32)
    if NORM:  # the RMSNorm's output, rounded where the norm kernel (kernels/elementwise.py) rounds it
        if HAS_RES:
            r = tl.load(r_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0).to(tl.float32)
            x = (x + r).to(dt).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        x = (nw[None, :] * (x * rstd[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return x


@_jit
def _gemv_tile(acc, w, x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, k, k_mask, K, stride_xm, stride_rm,
               SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """acc + the products of the weight tile w [BLOCK_N, BLOCK_K] (columns k) with every input row."""
    x = _x_tile(x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, k, k_mask, K, stride_xm, stride_rm, SILU_MUL, NORM,
                HAS_RES)
    return acc + tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@_jit
def _norm_prologue(x_ptr, r_ptr, res_ptr, offs_m, m_mask, offs_k, K, stride_xm, stride_rm, stride_om, eps,
                   ROWS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr):
    """The folded norm's first pass: each row's rstd, from its sum of squares taken tile by tile (exactly the norm
    kernel's, ew.sum_squares); with a residual, x + residual rounded, and program 0 writes it out (the layer's
    new residual stream)."""
    ss = tl.zeros((ROWS_PAD,), dtype=tl.float64)
    dt = x_ptr.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask = m_mask[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(dt)
            tl.store(res_ptr + offs_m[:, None] * stride_om + k[None, :], s, mask=mask & (tl.program_id(0) == 0))
            x = s.to(tl.float32)
        ss += ew.sum_squares(x, 1)
    return tl.rsqrt(ss.to(tl.float32) / K + eps)


@_jit
def _rstd(x_ptr, r_ptr, res_ptr, ss_ptr, offs_m, m_mask, offs_k, K, stride_xm, stride_rm, stride_om, eps,
          ROWS_PAD: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RES: tl.constexpr, SS_IN: tl.constexpr):
    """The folded norm's rstd of each row: from the sums of squares the GEMV before added up (SS_IN: its
    SUM_LANES partial sums a row), or from the row itself (`_norm_prologue`)."""
    if SS_IN:
        lanes = tl.arange(0, _SUM_LANES)
        part = tl.load(ss_ptr + offs_m[:, None] * _SUM_LANES + lanes[None, :], mask=m_mask[:, None], other=0.0)
        return tl.rsqrt(tl.sum(part, 1).to(tl.float32) / K + eps)
    return _norm_prologue(x_ptr, r_ptr, res_ptr, offs_m, m_mask, offs_k, K, stride_xm, stride_rm, stride_om, eps,
                          ROWS_PAD, BLOCK_K, HAS_RES)


@_jit
def _zero_sums(ss_ptr, pid, COUNT: tl.constexpr):
    """Program 0 zeroes the step's sums-of-squares buffer (COUNT fp64 values): its first launch does this after
    its wait, when every kernel of the step before (all that read the buffer) has finished."""
    if pid == 0:
        for z0 in range(0, COUNT, 1024):
            offs = z0 + tl.arange(0, 1024)
            tl.store(ss_ptr + offs, tl.zeros((1024,), dtype=tl.float64), mask=offs < COUNT)


@_jit
def _epilogue_inputs(b_ptr, a_ptr, offs_m, offs_n, n_mask, out_mask, stride_am, ROWS_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, ADD_OUT: tl.constexpr):
    """The epilogue's inputs, the bias and the residual to add (zeros where absent), loaded at the program's start,
    with its first input loads: after the K loop, each would be one more dependent round trip at the end of every
    program, the end the next kernel waits for."""
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if ADD_OUT:
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_n[None, :], mask=out_mask, other=0.0).to(tl.float32)
    return bias, a


@_jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, nw_ptr, res_ptr, a_ptr, ss_in_ptr, ss_out_ptr, ss_zero_ptr,
                 stamps_ptr, N, K, stride_xm, stride_wn, stride_ym, stride_rm, stride_om, stride_am, eps,
                 pf0_ptr, pf0_count, pf0_last, pf1_ptr, pf1_count, pf1_last, pf2_ptr, pf2_count, pf2_last,
                 ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 ADD_OUT: tl.constexpr, USE_PDL: tl.constexpr, EARLY_W: tl.constexpr,
                 SS_IN: tl.constexpr, SS_OUT: tl.constexpr, SS_ZERO: tl.constexpr, ACT_OUT: tl.constexpr,
                 PREFETCH: tl.constexpr, STAGES: tl.constexpr, STAMPS: tl.constexpr,
                 PF_REGIONS: tl.constexpr, PF_LANES: tl.constexpr, PF_PIECE: tl.constexpr):
    pid = tl.program_id(0)
    if STAMPS:  # a diagnostic (gemv(stamps=)): when this program began, its PDL wait returned and it ended
        t_begin = globaltimer()
        t_wait = t_begin
    if ACT_OUT:  # W is [gate; up] (N = 2I rows): this program's rows are gate rows p.. and the up rows I + p..
        offs_p = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        offs_n = tl.reshape(tl.join(offs_p, offs_p + N // 2), (BLOCK_N,))  # pairs: gate p, up p, gate p+1, ...
        n_mask = offs_n < N
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    offs_m = tl.arange(0, ROWS_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < ROWS
    acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    rstd = tl.zeros((ROWS_PAD,), dtype=tl.float32)  # read only under NORM
    out_mask = m_mask[:, None] & n_mask[None, :]
    if USE_PDL:  # launched early (kernels/pdl.py): wait before reading x or writing y
        gdc_launch_dependents()
        # EARLY_W (0-3) weight tiles before the wait: weights are never written by a kernel (module docstring).
        # The loop's first steps, peeled; the same operations in the same order, so the sums do not change.
        ka, kb, kc = offs_k, BLOCK_K + offs_k, 2 * BLOCK_K + offs_k
        if EARLY_W >= 1:
            w0 = _load_w(w_ptr, offs_n, n_mask, ka, ka < K, stride_wn)
        if EARLY_W >= 2:
            w1 = _load_w(w_ptr, offs_n, n_mask, kb, kb < K, stride_wn)
        if EARLY_W >= 3:
            w2 = _load_w(w_ptr, offs_n, n_mask, kc, kc < K, stride_wn)
        # the MLP's L2 prefetch (gemv(l2_prefetch=)): weights too, after this program's own first tiles
        if PF_REGIONS >= 1:
            _prefetch_region(pf0_ptr, pf0_count, pf0_last, pid, PF_LANES, PF_PIECE)
        if PF_REGIONS >= 2:
            _prefetch_region(pf1_ptr, pf1_count, pf1_last, pid, PF_LANES, PF_PIECE)
        if PF_REGIONS >= 3:
            _prefetch_region(pf2_ptr, pf2_count, pf2_last, pid, PF_LANES, PF_PIECE)
        gdc_wait()
        if STAMPS:
            t_wait = globaltimer()
        bias, a = _epilogue_inputs(b_ptr, a_ptr, offs_m, offs_n, n_mask, out_mask, stride_am, ROWS_PAD, BLOCK_N,
                                   HAS_BIAS, ADD_OUT)
        if SS_ZERO > 0:
            _zero_sums(ss_zero_ptr, pid, SS_ZERO)
        if NORM:
            rstd = _rstd(x_ptr, r_ptr, res_ptr, ss_in_ptr, offs_m, m_mask, offs_k, K, stride_xm, stride_rm,
                         stride_om, eps, ROWS_PAD, BLOCK_K, HAS_RES, SS_IN)
        if EARLY_W >= 1:
            acc = _gemv_tile(acc, w0, x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, ka, ka < K, K, stride_xm,
                             stride_rm, SILU_MUL, NORM, HAS_RES)
        if EARLY_W >= 2:
            acc = _gemv_tile(acc, w1, x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, kb, kb < K, K, stride_xm,
                             stride_rm, SILU_MUL, NORM, HAS_RES)
        if EARLY_W >= 3:
            acc = _gemv_tile(acc, w2, x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, kc, kc < K, K, stride_xm,
                             stride_rm, SILU_MUL, NORM, HAS_RES)
    else:
        bias, a = _epilogue_inputs(b_ptr, a_ptr, offs_m, offs_n, n_mask, out_mask, stride_am, ROWS_PAD, BLOCK_N,
                                   HAS_BIAS, ADD_OUT)
        if SS_ZERO > 0:
            _zero_sums(ss_zero_ptr, pid, SS_ZERO)
        if NORM:
            rstd = _rstd(x_ptr, r_ptr, res_ptr, ss_in_ptr, offs_m, m_mask, offs_k, K, stride_xm, stride_rm,
                         stride_om, eps, ROWS_PAD, BLOCK_K, HAS_RES, SS_IN)
    if PREFETCH:  # the next tile's load issued before this tile's products (the same sums in the same order)
        k = EARLY_W * BLOCK_K + offs_k
        w_next = _load_w(w_ptr, offs_n, n_mask, k, k < K, stride_wn)
    # STAGES > 1: Triton pipelines the loop's loads through shared memory (cp.async), STAGES - 1 tiles ahead; each
    # tile reaches the registers in the layout a plain load gives it, so the products and sums do not change
    for k0 in tl.range(EARLY_W * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        k_mask = k < K
        if PREFETCH:
            w = w_next
            w_next = _load_w(w_ptr, offs_n, n_mask, k + BLOCK_K, k + BLOCK_K < K, stride_wn)  # past K: masked off
        else:
            w = _load_w(w_ptr, offs_n, n_mask, k, k_mask, stride_wn)
        acc = _gemv_tile(acc, w, x_ptr, r_ptr, nw_ptr, rstd, offs_m, m_mask, k, k_mask, K, stride_xm, stride_rm,
                         SILU_MUL, NORM, HAS_RES)
    if HAS_BIAS:
        acc += bias[None, :]
    dt = y_ptr.dtype.element_ty
    y = acc.to(dt)
    if ACT_OUT:  # silu(gate) * up from the rounded products, rounded as ew.silu_and_mul rounds (no add, no sums)
        gate, up = tl.split(tl.reshape(y, (ROWS_PAD, BLOCK_N // 2, 2)))
        gate = gate.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        act = (silu * up.to(tl.float32)).to(dt)
        act_mask = m_mask[:, None] & (offs_p < N // 2)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_p[None, :], act, mask=act_mask)
    else:
        if ADD_OUT:  # the residual add after the matmul: its output rounded, plus the residual, rounded (a bf16 add)
            y = (y.to(tl.float32) + a).to(dt)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=out_mask)
        if SS_OUT:  # this program's share of each output row's sum of squares, for the norm in the GEMV after
            part = ew.sum_squares(tl.where(out_mask, y.to(tl.float32), 0.0), 1)
            lane = pid % _SUM_LANES
            tl.atomic_add(ss_out_ptr + offs_m * _SUM_LANES + lane, part, mask=m_mask, sem="relaxed")
    if STAMPS:
        t_end = globaltimer()
        tl.store(stamps_ptr + pid * _STAMP_FIELDS, t_begin)
        tl.store(stamps_ptr + pid * _STAMP_FIELDS + 1, t_wait)
        tl.store(stamps_ptr + pid * _STAMP_FIELDS + 2, t_end)
        tl.store(stamps_ptr + pid * _STAMP_FIELDS + 3, smid().to(tl.int64))


def gemv_config(n: int, k: int, table: GemvTable = NO_TABLE) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight of `n` outputs by `k` inputs."""
    if table.get((n, k)) is not None:
        return table[(n, k)][:3]
    # Enough programs to keep every SM streaming (a few per SM), each loading 8-16 KB a step of its loop.
    block_k = min(triton.next_power_of_2(k), 1024)
    block_n = 8
    while block_n > 1 and n // block_n < 1024:
        block_n //= 2
    return block_n, block_k, 4


def gemv_programs(n: int, tiles: tuple[int, int, int], silu_mul_out: bool = False) -> int:
    """The programs of a GEMV launch over a weight of `n` rows at these tiles (with silu_mul_out, n / 2 pairs of
    rows, half a tile's rows a program)."""
    return triton.cdiv(n, max(tiles[0], 2) if silu_mul_out else tiles[0])


def loop_tiles(k: int, block_k: int, early_tiles: int) -> int:
    """The weight tiles a program's K loop loads after its early ones (`early_tiles`, at most every tile): the loop
    the kernel options gemv_prefetch and gemv_stages act on, where it runs twice or more."""
    tiles = triton.cdiv(k, block_k)
    return tiles - min(early_tiles, MAX_EARLY_TILES, tiles)


def gemv_max_rows(n: int, k: int, table: GemvTable = NO_TABLE) -> int:
    """Up to how many rows a weight of this shape takes the GEMV (0: cuBLAS always)."""
    if (n, k) not in table:
        return GEMV_MAX_ROWS
    cfg = table[(n, k)]
    return 0 if cfg is None else min(cfg[3], GEMV_MAX_ROWS)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         silu_mul: bool = False, tiles: tuple[int, int, int] | None = None,
         add: torch.Tensor | None = None, sums_out: torch.Tensor | None = None,
         silu_mul_out: bool = False, stamps: torch.Tensor | None = None,
         l2_prefetch: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
    """`x @ weight.T + bias` for x `[rows, K]` (rows <= GEMV_MAX_ROWS) and weight `[N, K]`; fp32 accumulation.
    silu_mul=True: x is `[rows, 2K]` (gate | up) and the product is `silu_and_mul(x) @ weight.T`, the MLP's down
    projection with its activation folded in (one launch fewer per layer). `add` (`[rows, N]`, x's dtype): the
    product, rounded, plus `add`, rounded again: to the bit the residual stream's add that `ew.fused_add_rms_norm`
    does after the matmul. `tiles`: (BLOCK_N, BLOCK_K, warps), by default from `table_for(x.device)` (a GemvLinear
    passes the ones it resolved when it was swapped in). `sums_out` (`[GEMV_MAX_ROWS, SUM_LANES]` fp64, zeroed
    before this launch; with `add`): each output row's sum of squares is added into it, for a `gemv_rms_norm` after
    that takes it as `sums` (the torch path leaves it alone: its norm reads the row). `silu_mul_out=True`: weight
    is an MLP's `[gate; up]` (2I rows) and the output is `silu_and_mul(x @ weight.T)`, `[rows, I]`: the activation
    in the epilogue, once per element, where `silu_mul` computes it in every program of the down projection.
    `stamps`: a diagnostic (lab.checks.decode_anatomy), a contiguous int64 CUDA tensor of at least
    `programs x STAMP_FIELDS` values that each program writes its row of (STAMP_FIELDS); `gemv_programs` says how
    many programs a launch has. The products are the same with or without it. `l2_prefetch`: up to
    MAX_PREFETCH_REGIONS contiguous weights (views) the launch asks L2 for before its PDL wait (see "The MLP's L2
    prefetch" above; never written by a kernel, as `weight`); ignored where the launch is no PDL launch."""
    if stamps is not None and not x.is_cuda:  # the timer is a GPU register (and the interpreter has none)
        raise ValueError("gemv's stamps are a GPU launch's: x is on the CPU")
    if not ew.use_triton(x) or x.shape[0] == 0:
        y = F.linear(ew.silu_and_mul(x) if silu_mul else x, weight, bias)
        y = ew.silu_and_mul(y) if silu_mul_out else y
        return y if add is None else y + add
    if sums_out is not None and add is None:
        raise ValueError("gemv's sums_out is the residual stream's: it needs add")
    return _launch(x, weight, bias, tiles, silu_mul=silu_mul, add=add, sums_out=sums_out,
                   silu_mul_out=silu_mul_out, stamps=stamps, l2_prefetch=l2_prefetch)[0]


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiles: tuple[int, int, int] | None = None, sums: torch.Tensor | None = None,
                  zero_sums: torch.Tensor | None = None,
                  silu_mul_out: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's RMSNorm and the projection after it in one launch: `(rms_norm(x + residual) @ weight.T +
    bias, x + residual)`, to the bit what `ew.fused_add_rms_norm` then `gemv` return (residual None: `ew.rms_norm`
    then `gemv`, and the residual returned is x). Every program computes the rows' rstd itself (the rows are a few
    KB, read from L2), so the norm's own launch and its wait in the chain of kernels are gone. The norm weight and
    the residual must have x's dtype (a bf16 or fp16 model's). `sums`: x's rows' sums of squares, as a
    `gemv(sums_out=)` before added them up (no residual then): the rstd comes from them instead of every program
    reading the row first. `zero_sums`: a buffer of such sums that program 0 zeroes after the launch's wait (a
    step's first folded launch resets the step's buffer). `silu_mul_out`: the output is the MLP's activation, as
    `gemv`'s."""
    if not ew.use_triton(x) or x.shape[0] == 0:
        if residual is None:
            h = ew.rms_norm(x, norm_weight, eps)
        else:
            h, residual = ew.fused_add_rms_norm(x, residual, norm_weight, eps)
        y = F.linear(h, weight, bias)
        return (ew.silu_and_mul(y) if silu_mul_out else y), (x if residual is None else residual)
    if norm_weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        raise ValueError(f"gemv_rms_norm needs x, residual and norm weight in one dtype, got {x.dtype}, "
                         f"{None if residual is None else residual.dtype}, {norm_weight.dtype}")
    if sums is not None and residual is not None:
        raise ValueError("gemv_rms_norm's sums are x's own: they cannot include a residual added here")
    return _launch(x, weight, bias, tiles, norm=(residual, norm_weight, eps), sums=sums, zero_sums=zero_sums,
                   silu_mul_out=silu_mul_out)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: tuple[int, int, int] | None,
            silu_mul: bool = False, norm: tuple | None = None, add: torch.Tensor | None = None,
            sums: torch.Tensor | None = None, sums_out: torch.Tensor | None = None,
            zero_sums: torch.Tensor | None = None, silu_mul_out: bool = False,
            stamps: torch.Tensor | None = None,
            l2_prefetch: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, k = x.shape
    n = weight.shape[0]
    if silu_mul:
        k //= 2
    if rows > GEMV_MAX_ROWS:
        raise ValueError(f"gemv takes at most {GEMV_MAX_ROWS} rows, got {rows}")
    if silu_mul_out and (n % 2 or add is not None or sums_out is not None):
        raise ValueError(f"silu_mul_out needs an even number of weight rows ([gate; up]) and no add or sums_out, got "
                         f"{n} rows")
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert weight.stride(-1) == 1 and weight.shape[1] == k
    y = torch.empty(rows, n // 2 if silu_mul_out else n, dtype=x.dtype, device=x.device)
    if add is not None:
        if add.shape != y.shape or add.dtype != y.dtype:
            raise ValueError(f"gemv's add must be [{rows}, {n}] in {y.dtype}, got {list(add.shape)} in {add.dtype}")
        if add.stride(-1) != 1:
            add = add.contiguous()
    residual, norm_weight, eps = norm if norm is not None else (None, weight, 0.0)
    res_out = x  # the residual stream after the norm: x itself when there is no residual to add
    if residual is not None:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        res_out = torch.empty_like(x)
    block_n, block_k, warps = tiles or gemv_config(n, k, table_for(x.device))
    programs = gemv_programs(n, (block_n, block_k, warps), silu_mul_out)
    if silu_mul_out:  # a program's rows are pairs (gate row, its up row)
        block_n = max(block_n, 2)
    kw = pdl_launch(x)
    options = current_options()
    early_tiles = min(options.gemv_pdl_early_tiles, MAX_EARLY_TILES, triton.cdiv(k, block_k)) if kw else 0
    looped = loop_tiles(k, block_k, early_tiles) >= 2
    # register double buffering only where the loop after the early tiles runs twice or more
    prefetch = options.gemv_prefetch and looped
    # the loop pipelined through shared memory only there too, and not on top of the prefetch; each stage past the
    # first buffers a weight tile and the input tiles beside it (x, up or residual, the norm's weight), held within
    # what every sm_90 SM has
    stages = options.gemv_stages if looped and not prefetch else 1
    stage_bytes = (block_n + 3 * triton.next_power_of_2(rows)) * block_k * weight.element_size()
    while stages > 1 and (stages - 1) * stage_bytes > MAX_STAGE_BYTES:
        stages -= 1
    for buf in (sums, sums_out):
        if buf is not None and (buf.dtype != torch.float64 or buf.shape != (GEMV_MAX_ROWS, SUM_LANES)
                                or not buf.is_contiguous()):
            raise ValueError(f"sums of squares are a contiguous [{GEMV_MAX_ROWS}, {SUM_LANES}] fp64 buffer, "
                             f"got {list(buf.shape)} in {buf.dtype}")
    r = residual if residual is not None else x
    a = add if add is not None else y
    zero_count = zero_sums.numel() if zero_sums is not None else 0
    if stamps is not None and (stamps.dtype != torch.int64 or not stamps.is_contiguous()
                               or stamps.numel() < programs * STAMP_FIELDS):
        raise ValueError(f"gemv's stamps need a contiguous int64 tensor of >= {programs * STAMP_FIELDS} values, "
                         f"got {list(stamps.shape)} in {stamps.dtype}")
    regions, used, lanes, piece = _prefetch_plan(l2_prefetch if kw else (), programs, weight)
    _gemv_kernel[(programs,)](
        x, weight, bias if bias is not None else weight, y, r, norm_weight, res_out, a,
        *(buf if buf is not None else y for buf in (sums, sums_out, zero_sums, stamps)), n, k, x.stride(0),
        weight.stride(0), y.stride(0), r.stride(0), res_out.stride(0), a.stride(0), eps,
        *(v for region in regions for v in region),
        ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None, HAS_RES=residual is not None,
        ADD_OUT=add is not None, USE_PDL=bool(kw), EARLY_W=early_tiles, SS_IN=sums is not None,
        SS_OUT=sums_out is not None, SS_ZERO=zero_count, ACT_OUT=silu_mul_out, PREFETCH=prefetch, STAGES=stages,
        STAMPS=stamps is not None, PF_REGIONS=used, PF_LANES=lanes, PF_PIECE=piece, num_warps=warps, **kw)
    return y, (res_out if norm is not None else None)


def _prefetch_plan(weights: tuple[torch.Tensor, ...], programs: int, weight: torch.Tensor) -> tuple:
    """The L2 prefetch a launch of `programs` programs makes of the contiguous `weights`:
    (MAX_PREFETCH_REGIONS (tensor, pieces, last piece's first element), the used ones first and the rest
    (weight, 0, 0); how many are used; pieces a program asks for at most (a power of two); elements a piece). A
    weight shorter than a piece, or not contiguous and 16-byte aligned at both ends (the bulk prefetch's rule: a
    piece's start and length), is left out."""
    piece = PREFETCH_PIECE_BYTES // weight.element_size()
    used = [(t, triton.cdiv(t.numel(), piece), t.numel() - piece) for t in weights
            if t.dtype == weight.dtype and t.is_contiguous() and t.numel() >= piece and t.data_ptr() % 16 == 0
            and t.numel() * t.element_size() % 16 == 0]
    if len(used) > MAX_PREFETCH_REGIONS:
        raise ValueError(f"gemv prefetches at most {MAX_PREFETCH_REGIONS} weights, got {len(used)}")
    most = max((count for _, count, _ in used), default=0)
    lanes = triton.next_power_of_2(triton.cdiv(most, programs)) if most else 1
    return tuple(used) + ((weight, 0, 0),) * (MAX_PREFETCH_REGIONS - len(used)), len(used), lanes, piece


def mlp_prefetch_regions(gate_up: torch.Tensor, down: torch.Tensor, act_out: bool, max_bytes: int
                         ) -> tuple[torch.Tensor, ...]:
    """What a layer's o_proj GEMV asks L2 for (kernel option `gemv_mlp_prefetch_mb`): up to `max_bytes` of the MLP's
    weights in the order its GEMVs read them, as contiguous views. The gate_up GEMV's first programs read the first
    gate rows and, with the activation in its epilogue (`act_out`), the up rows beside them (a program owns pairs),
    so equal shares of both halves; without it the rows in order. Then the down projection's first rows."""
    row = gate_up.shape[1] * gate_up.element_size()
    half = gate_up.shape[0] // 2
    if act_out:
        rows = min(half, max_bytes // (2 * row))
        regions = [gate_up[:rows], gate_up[half: half + rows]]
    else:
        rows = min(2 * half, max_bytes // row)
        regions = [gate_up[:rows]]
    down_rows = min(down.shape[0], (max_bytes - rows * row * len(regions)) // (down.shape[1] * down.element_size()))
    regions.append(down[:down_rows])
    return tuple(r for r in regions if r.numel())


class GemvLinear(nn.Module):
    """An `nn.Linear` whose few-row calls take the GEMV. Holds the same parameters under the same names, and the
    tiles and row limit of the table it was built with."""

    def __init__(self, linear: nn.Linear, max_rows: int = GEMV_MAX_ROWS, table: GemvTable = NO_TABLE) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.max_rows = min(max_rows, gemv_max_rows(*linear.weight.shape, table))
        self.tiles = gemv_config(*linear.weight.shape, table) if triton is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            return gemv(x, self.weight, self.bias, tiles=self.tiles)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gemv_rows<={self.max_rows}"


class GemvMLP(nn.Module):
    """A decoder MLP (gate_up_proj, SiLU-and-mul, down_proj; models/layers.py) with its SiLU-and-mul folded into a
    GEMV when a call has few rows (the gate_up GEMV's epilogue, or the down GEMV's prologue: the module docstring);
    more rows run the MLP's own forward (with plain cuBLAS matmuls). Holds the same parameters under the same
    names."""

    def __init__(self, mlp: nn.Module, max_rows: int = GEMV_MAX_ROWS, table: GemvTable = NO_TABLE) -> None:
        super().__init__()
        # gate_up keeps cuBLAS where that measured faster; the fold rides on the down projection's GEMV
        gate_up = mlp.gate_up_proj
        self.gate_up_proj = GemvLinear(gate_up, max_rows, table) if _gemv_shape(gate_up, table) else gate_up
        self.down_proj = GemvLinear(mlp.down_proj, max_rows, table)
        self.max_rows = self.down_proj.max_rows
        # a bound method, not a submodule: the parameters stay registered once, under their own names
        self._mlp_forward = mlp.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_rows:
            gate_up, down = self.gate_up_proj, self.down_proj
            if _act_epilogue(gate_up, x.shape[0]):
                act = gemv(x, gate_up.weight, gate_up.bias, tiles=gate_up.tiles, silu_mul_out=True)
                return gemv(act, down.weight, tiles=down.tiles)
            return gemv(gate_up(x), down.weight, silu_mul=True, tiles=down.tiles)
        return self._mlp_forward(x)


class GemvNormLayer(nn.Module):
    """A decoder layer (models/decoder.py's DecoderLayer: input_layernorm, self_attn, post_attention_layernorm,
    mlp) whose few-row calls fold each RMSNorm into the GEMVs around it: the residual add into the epilogue of the
    GEMV before (o_proj, down_proj: `gemv(..., add=)`) and the norm into the prologue of the GEMV after (qkv,
    gate_up: `gemv_rms_norm`), two launches a layer fewer in a decode step with the same outputs to the bit.

    Its calls return `(stream, None)`: the residual stream with the MLP's output already added, which the next
    layer (or the model's final norm) reads as an input without a residual, exactly as a decoder layer's forward
    treats the first layer's. So each GEMV's programs read one input row, as an unfolded GEMV's do, not the hidden
    row and the residual row. Holds the same submodules under the same names; more rows, or a projection the table
    left to cuBLAS, run the layer's own forward.

    A stack of them linked by `link_norm_layers` (use_gemv does it) shares a FoldSums: with the kernel option
    `gemv_fold_sum_squares` (on by default) o_proj and down_proj add their output rows' squares into it and the
    norm after takes its rstd from those sums, in a forward that runs the stack in order from its first layer.
    A layer alone, or after one that ran its own forward, reads the row instead."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.mlp = layer.mlp
        self._layer_forward = layer.forward  # a bound method, not a submodule (as GemvMLP's)
        # set by link_norm_layers: the stack's shared sums of squares and this layer's place in it
        self.sums: FoldSums | None = None
        self.index = 0

    def forward(self, x, residual, positions, rotary, attn):
        a, mlp = self.self_attn, self.mlp
        t = x.shape[0]
        folds = (x.dim() == 2 and _takes_gemv(a.qkv_proj, t) and _takes_gemv(a.o_proj, t)
                 and isinstance(mlp, GemvMLP) and _takes_gemv(mlp.gate_up_proj, t) and t <= mlp.max_rows)
        sums = self.sums if self.sums is not None and current_options().gemv_fold_sum_squares else None
        i = self.index
        # the sums are used only in a run of the stack's layers from the first, each folded: the first zeroes them
        if sums is not None and not (i == 0 or (sums.next_layer == i and residual is None)):
            sums = None
        if self.sums is not None:
            self.sums.next_layer = None
        if not folds:
            return self._layer_forward(x, residual, positions, rotary, attn)
        norm = self.input_layernorm
        # a residual comes only from a layer before that ran its own forward (or none: the first layer's input)
        qkv, stream = gemv_rms_norm(x, residual, norm.weight, norm.eps, a.qkv_proj.weight, a.qkv_proj.bias,
                                    a.qkv_proj.tiles, sums=sums.slot(2 * i - 1) if sums and i else None,
                                    zero_sums=sums.buffer if sums and not i else None)
        # the rest of Attention.forward (models/decoder.py), after its projection
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = q.view(t, a.num_q_heads, a.head_dim)
        k = k.view(t, a.num_kv_heads, a.head_dim)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        q, k = rotary(q, k, positions, a.q_norm, a.k_norm)
        o = attn.forward(q, k, v, a.layer_id).reshape(t, a.q_size)
        act_out = _act_epilogue(mlp.gate_up_proj, t)  # else the down GEMV computes the activation
        prefetch_mb = current_options().gemv_mlp_prefetch_mb
        prefetch = mlp_prefetch_regions(mlp.gate_up_proj.weight, mlp.down_proj.weight, act_out,
                                        prefetch_mb << 20) if prefetch_mb else ()
        stream = gemv(o, a.o_proj.weight, a.o_proj.bias, tiles=a.o_proj.tiles, add=stream,
                      sums_out=sums.slot(2 * i) if sums else None, l2_prefetch=prefetch)
        norm = self.post_attention_layernorm
        gate_up, _ = gemv_rms_norm(stream, None, norm.weight, norm.eps, mlp.gate_up_proj.weight, None,
                                   mlp.gate_up_proj.tiles, sums=sums.slot(2 * i) if sums else None,
                                   silu_mul_out=act_out)
        # the last layer's stream goes to the model's own final norm: no sums for it
        last = sums is None or i + 1 == sums.layers
        out = gemv(gate_up, mlp.down_proj.weight, silu_mul=not act_out, tiles=mlp.down_proj.tiles, add=stream,
                   sums_out=None if last else sums.slot(2 * i + 1))
        if not last:
            sums.next_layer = i + 1
        return out, None


class FoldSums:
    """The sums of squares a stack of folded layers hands from GEMV to GEMV (kernel option `gemv_fold_sum_squares`):
    two slots a layer (o_proj's stream for the MLP's norm, down_proj's for the next layer's), each `[GEMV_MAX_ROWS,
    SUM_LANES]` fp64. The first layer's first launch zeroes them all, after its wait, so every step starts from
    zeros whether or not the step before finished (a CUDA graph replays that launch too). `next_layer` is which layer
    may read the slot the last one wrote (None: none), set while the layers run (or are captured) in order."""

    def __init__(self, layers: int, device: torch.device) -> None:
        self.layers = layers
        self.buffer = torch.zeros(2 * layers, GEMV_MAX_ROWS, SUM_LANES, dtype=torch.float64, device=device)
        self.next_layer: int | None = None

    def slot(self, j: int) -> torch.Tensor:
        return self.buffer[j]


def link_norm_layers(layers: list[GemvNormLayer]) -> None:
    """Give a stack of folded layers (in the order a forward runs them) one FoldSums (an empty stack: none)."""
    if not layers:
        return
    sums = FoldSums(len(layers), layers[0].input_layernorm.weight.device)
    for i, layer in enumerate(layers):
        layer.sums, layer.index = sums, i


def _takes_gemv(linear: nn.Module, rows: int) -> bool:
    return isinstance(linear, GemvLinear) and rows <= linear.max_rows


def _act_epilogue(gate_up: nn.Module, rows: int) -> bool:
    """Whether an MLP's activation goes in its gate_up GEMV's epilogue (kernel option `gemv_act_epilogue`): only
    where gate_up itself takes the GEMV (the table may leave it to cuBLAS)."""
    return current_options().gemv_act_epilogue and _takes_gemv(gate_up, rows)


def _gemv_shape(linear: nn.Module, table: GemvTable) -> bool:
    return type(linear) is nn.Linear and gemv_max_rows(*linear.weight.shape, table) > 0


def use_gemv(model: nn.Module, fold: tuple[type, ...] = (), max_rows: int = GEMV_MAX_ROWS,
             table: GemvTable | None = None, norm_fold: tuple[type, ...] = ()) -> int:
    """Swap every plain `nn.Linear` under `model` for a GemvLinear, except shapes the table gives to cuBLAS, and
    every module whose class is in `fold` (decoder MLPs: gate_up_proj, SiLU-and-mul, down_proj) for a GemvMLP;
    returns how many matmuls now take the GEMV. Modules whose class is in `norm_fold` (decoder layers) become
    GemvNormLayers around their swapped insides (the kernel option `gemv_norm_fold`). `table`: by default
    `table_for` the model's device under the kernel options in force. Subclasses of nn.Linear (e.g.
    tensor-parallel linears) are left alone: their forward does more than the matmul."""
    if table is None:
        weight = next(model.parameters(), None)
        table = table_for(weight.device) if weight is not None else NO_TABLE
    swapped = _swap(model, fold, max_rows, table, norm_fold)
    link_norm_layers([m for m in model.modules() if isinstance(m, GemvNormLayer)])
    return swapped


def _swap(model: nn.Module, fold: tuple[type, ...], max_rows: int, table: GemvTable,
          norm_fold: tuple[type, ...] = ()) -> int:
    swapped = 0
    for name, child in list(model.named_children()):
        if type(child) in norm_fold:
            swapped += _swap(child, fold, max_rows, table)
            setattr(model, name, GemvNormLayer(child))
        elif (type(child) in fold and _gemv_shape(child.down_proj, table) and child.down_proj.bias is None
                and type(child.gate_up_proj) is nn.Linear):
            mlp = GemvMLP(child, max_rows, table)
            setattr(model, name, mlp)
            swapped += 1 + isinstance(mlp.gate_up_proj, GemvLinear)
        elif _gemv_shape(child, table):
            setattr(model, name, GemvLinear(child, max_rows, table))
            swapped += 1
        else:
            swapped += _swap(child, fold, max_rows, table, norm_fold)
    return swapped
