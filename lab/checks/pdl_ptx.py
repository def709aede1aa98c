"""Check, without a GPU, that every decode-path Triton kernel waits before touching global memory under PDL.

Each public wrapper (RMSNorm variants, RoPE, K/V store, SiLU-and-mul, sigmoid-mul, decode and extend attention,
the GEMV, the fused sampler) is called on small CPU tensors with MINISGL_FORCE_TRITON=1 but *without* the
interpreter, its kernels replaced by recorders: that yields each launch's arguments exactly as the wrapper builds
them. Every recorded kernel is then compiled for sm_90 with USE_PDL=True and launch_pdl=True (Triton compiles to
PTX on any machine) and its PTX read: `griddepcontrol.wait` must sit in the entry block, before the first branch
or block label, and no global memory instruction (ld/st/atom/red/cp.async on .global, or a generic ld/st/atom)
may come before it; two control kernels that break the rule must be flagged. That is the rule of kernels/pdl.py
checked on what the compiler emits, not on the source. The GEMV with the early
weight load (EARLY_W, 1-3 tiles) may load before the wait (its first weight tiles) but not store or use atomics;
its strict variant (EARLY_W 0) is held to the full rule. So may the decode kernels and RoPE with the early
metadata (EARLY_META: each request's length, row, slot and first key slots; each token's position and its
cos/sin; with EARLY_KV, stage 1's first key tile too), compiled both ways, up to exactly those loads. L2 prefetches
of memory no kernel in flight writes may come first too, and must be there where asked for: the GEMV's of the MLP's
weights (PF_REGIONS, kernel option gemv_mlp_prefetch_mb) and stage 1's of the next layer's first key tile
(PREFETCH_NEXT, kernel option decode_prefetch_next_kv); an inline-asm block is read statement by statement. Every
`*_kernel` of the four modules must take USE_PDL and be among the compiled ones (a new kernel left out of this
check fails it). One rule of another kind rides along, since the PTX is at hand: the RoPE kernel and the decode
kernel's fused RoPE sum a head's squares for Qwen3's q/k norm in fp64 (exact, whatever order each kernel's layout
adds them in: on the H200 an fp32 sum made the two round apart, run25), so their PTX must hold fp64 adds; and every
compiled variant of the decode kernel must give its dots the same operand kWidth (read from the TTGIR: the fused
RoPE's q once came as a join of halves, kWidth 4 against 2, and summed q·k in another order, run27); and the GEMV's
K loop at 3 stages (kernel option gemv_stages), compiled with a launch's alignment, must be pipelined (cp.async,
none before the wait) and reduce in the 1-stage loop's layouts (`gemv_stages_check`).

    python -m lab.checks.pdl_ptx [--json out.json]

Exits non-zero if a kernel breaks the rule; tests/test_pdl.py runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # real JIT functions: they are compiled, not interpreted
os.environ["MINISGL_FORCE_TRITON"] = "1"  # CPU tensors take the Triton launch (which is recorded, not run)

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minisgl.kernels import attention as att
from minisgl.kernels import elementwise as ew
from minisgl.kernels import gemv as gv
from minisgl.kernels import sampling as smp
from minisgl.kernels.options import current_options, use_options
from minisgl.kernels.pdl import pdl_enter

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
           torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_COMPILE_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kw)` records the call instead of launching it."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.kernel, args, kw))


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value)}")


def dot_kwidths(ttgir: str) -> list[int]:
    """The operand kWidth of each tt.dot in a kernel's TTGIR, in order: the dots of the decode kernel must not
    change it with the fused RoPE (a wider kWidth sums q·k's products in another order: run27's rope_bits)."""
    return [int(m.group(1)) for line in ttgir.splitlines() if "tt.dot" in line
            for m in [re.search(r"kWidth = (\d+)", line)] if m]


def compile_asm(kernel, args: tuple, kw: dict, aligned: bool = False, **constexpr_overrides) -> dict:
    """The sm_90 compilation stages of `kernel` (`ttgir`, `ptx`, ...) for a recorded call, launch_pdl on and the
    given constexprs overridden. Compiled without a launch's divisibility specialisation (16-byte aligned pointers
    and strides), so no load is vectorised: a thread loads each element it holds with a load of its own, which
    makes the loads before the wait countable exactly (the bounds in `main`). The order of loads and the wait is
    the launched kernel's. `aligned`: with that specialisation (every tensor, and every integer divisible by 16),
    as a launch on the engine's buffers gets it: what Triton's loop pipelining needs (cp.async)."""
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kw.items() if k in names})
    values.update(constexpr_overrides)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = values[p.name]
        if p.is_constexpr or value is None:  # a None argument is a constexpr, as a launch makes it
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = _arg_type(value)
            if aligned and (isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)):
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: v for k, v in kw.items() if k in _COMPILE_OPTIONS}
    options["launch_pdl"] = True
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def _is_global_access(opcode: str) -> bool:
    if not opcode.startswith(("ld.", "ldu.", "st.", "atom.", "red.", "cp.", "prefetch.", "multimem.")):
        return False
    if ".global" in opcode:
        return True
    return not any(space in opcode for space in (".param", ".shared", ".local", ".const"))


def check_ptx(ptx: str, allow_loads_before_wait: bool = False, max_early_loads: int | None = None,
              allow_prefetch_before_wait: bool = False) -> list[str]:
    """Problems with the order of `griddepcontrol.wait` and global accesses in the kernel's PTX ([] if none).
    `max_early_loads`: with loads allowed before the wait, at most this many (the early metadata's own).
    `allow_prefetch_before_wait`: L2 bulk prefetches (of weights, which no kernel writes) come first too, and must."""
    lines = ptx.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "{") + 1
    before = []
    for line in lines[start:]:
        s = line.strip()
        if not s or s.startswith(("//", ".reg", ".loc", ".file", ".shared", ".local")):
            continue
        if s.startswith("$L__BB"):  # a basic block (the $L__func_begin / $L__tmp labels are debug info)
            return [f"a block label ({s}) before griddepcontrol.wait: the wait is not in the entry block"]
        if s.endswith(":") or s in ("{", "}"):
            continue
        # an inline asm block on one line ("{ .reg .pred p; setp...; @p cp.async...; }"): each statement in turn
        statements = s.strip("{} ").split(";") if s.startswith("{") and s.endswith("}") else [s]
        opcodes = []
        for statement in filter(None, (st.strip() for st in statements)):
            instr = re.sub(r"^@!?%?\w+\s+", "", statement)  # drop a predicate guard
            opcodes.append(instr.split()[0].rstrip(";"))
        if any(op.startswith("griddepcontrol.wait") for op in opcodes):
            break
        if any(op.startswith(("bra", "ret", "exit")) for op in opcodes):
            return [f"control flow ({s}) before griddepcontrol.wait"]
        before.extend((op, s) for op in opcodes if not op.startswith("."))
    else:
        return ["no griddepcontrol.wait"]
    problems = []
    for opcode, s in before:
        if _is_global_access(opcode):
            if allow_loads_before_wait and opcode.startswith(("ld.global", "ldu.global")):
                continue
            if allow_prefetch_before_wait and opcode.startswith(("cp.async.bulk.prefetch.L2", "prefetch.global.L2")):
                continue
            problems.append(f"global access before griddepcontrol.wait: {s}")
    if allow_prefetch_before_wait and not any(op.startswith(("cp.async.bulk.prefetch.L2", "prefetch.global.L2"))
                                              for op, _ in before):
        problems.append("PF_REGIONS / PREFETCH_NEXT: expected L2 prefetches before griddepcontrol.wait, found none")
    early_loads = sum(op.startswith(("ld.global", "ldu.global")) for op, _ in before)
    if allow_loads_before_wait and not early_loads:
        problems.append("EARLY_W / EARLY_META: expected loads before griddepcontrol.wait, found none")
    if allow_loads_before_wait and max_early_loads is not None and early_loads > max_early_loads:
        problems.append(f"EARLY_META: {early_loads} loads before griddepcontrol.wait, more than the metadata's "
                        f"{max_early_loads}")
    if "griddepcontrol.launch_dependents" not in ptx:
        problems.append("no griddepcontrol.launch_dependents")
    return problems


def _record(module, names: list[str], fn, calls: list) -> None:
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, k in saved.items():
            setattr(module, n, _Recorder(k, calls))
        fn()
    finally:
        for n, k in saved.items():
            setattr(module, n, k)


def record_launches() -> list[tuple]:
    """(kernel, args, kwargs) of every Triton launch of the decode-path wrappers on small bf16 inputs."""
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, dtype=bf):
        return torch.randn(*shape, generator=gen).to(dtype)

    calls: list = []
    t, hq, hkv, d = 2, 16, 8, 128
    hidden = 1024
    x, res, w = rnd(t, hidden), rnd(t, hidden), rnd(hidden)
    qkv = rnd(t, (hq + 2 * hkv) * d)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    pos = torch.tensor([5, 9])
    cos_sin = torch.randn(64, d, generator=gen)
    cos_sin_partial = torch.randn(64, d // 4, generator=gen)
    num_slots = 256
    k_buf, v_buf = rnd(num_slots, hkv, d), rnd(num_slots, hkv, d)
    loc = torch.tensor([17, 40])

    def elementwise():
        ew.rms_norm(x, w, 1e-6)
        ew.fused_add_rms_norm(x, res, w, 1e-6)
        ew.fused_add_rms_norm(x, res, w, 1e-6, zero_centred=True)
        ew.rms_norm(q, rnd(d), 1e-6)  # per-head norm over a strided view
        ew.gated_rms_norm(rnd(t, 4, d), rnd(t, 4, d), rnd(d), 1e-6)
        ew.sigmoid_mul(rnd(t, hq * d), rnd(t, hq, d))
        ew.silu_and_mul(rnd(t, 2 * 3072))
        ew.apply_rope(q, k, pos, cos_sin)
        ew.norm_and_rope(q, k, pos, cos_sin, rnd(d), rnd(d), 1e-6)
        ew.norm_and_rope(q, k, pos, cos_sin_partial, rnd(d), rnd(d), 1e-6, zero_centred=True,
                         q_out=torch.empty(t, hq, d, dtype=bf))
        ew.store_kv(k_buf, v_buf, loc, k, v)

    _record(ew, ["_rms_norm_kernel", "_gated_rms_norm_kernel", "_sigmoid_mul_kernel", "_silu_and_mul_kernel",
                 "_rope_kernel", "_store_kv_kernel"], elementwise, calls)

    req_to_token = torch.arange(4 * 128, dtype=torch.int32).view(4, 128)
    rows = torch.tensor([0, 2])
    seq_lens = torch.tensor([70, 3], dtype=torch.int32)
    out = torch.empty(t, hq, d, dtype=bf)
    qd = rnd(t, hq, d)

    def attention():
        for fused_merge in (False, True):
            att.decode_attention(qd, k_buf, v_buf, req_to_token, rows, seq_lens, out, d ** -0.5, num_splits=4,
                                 fused_merge=fused_merge, new_kv=(k, v, loc))
        att.decode_attention(qd, k_buf, v_buf, req_to_token, rows, seq_lens, out, d ** -0.5, num_splits=1)
        for norms in ((rnd(d), rnd(d)), (None, None)):  # the fused RoPE, Qwen3's norms and a plain rotation
            att.decode_attention(q, k_buf, v_buf, req_to_token, rows, seq_lens, out, d ** -0.5, num_splits=4,
                                 new_kv=(k, v, loc), rope=att.DecodeRope(pos, cos_sin, *norms, 1e-6))
        # the extend kernel with the tiles it gets on an H200 (the CPU path picks small interpreter tiles)
        saved = att._extend_blocks
        att._extend_blocks = lambda *a, **kw: (128, 128, 8, 3)
        try:
            att.extend_attention(rnd(5, hq, d), k_buf, v_buf, req_to_token, rows, torch.tensor([3, 0]),
                                 torch.tensor([2, 3]), torch.tensor([0, 2]), rnd(5, hq, d), d ** -0.5, 3)
            att.extend_attention(rnd(5, hq, d), k_buf, v_buf, req_to_token, rows, torch.tensor([3, 0]),
                                 torch.tensor([2, 3]), torch.tensor([0, 2]), rnd(5, hq, d), d ** -0.5, 3,
                                 tiles=torch.from_numpy(att.extend_tile_list([3, 0], [2, 3], 128)))
        finally:
            att._extend_blocks = saved

    _record(att, ["_decode_stage1_kernel", "_decode_stage2_kernel", "_extend_kernel"], attention, calls)

    def gemv():
        gv.gemv(rnd(1, hidden), rnd(3 * hidden, hidden))
        gv.gemv(rnd(4, hidden), rnd(512, hidden), rnd(512))
        gv.gemv(rnd(1, 2 * 3072), rnd(hidden, 3072), silu_mul=True)
        # the norm fold's two ends: the residual add after a GEMV, the norm before one
        gv.gemv(rnd(1, 2 * 3072), rnd(hidden, 3072), silu_mul=True, add=rnd(1, hidden))
        gv.gemv_rms_norm(rnd(1, hidden), rnd(1, hidden), rnd(hidden), 1e-6, rnd(3 * hidden, hidden))
        # the default fold's launches (FoldSums): o's add handing its stream's sums of squares on, the step's first
        # qkv taking them and zeroing the buffer, gate_up taking them with the activation in its epilogue
        sums = torch.zeros(gv.GEMV_MAX_ROWS, gv.SUM_LANES, dtype=torch.float64)
        gv.gemv(rnd(1, 2 * hidden), rnd(hidden, 2 * hidden), add=rnd(1, hidden), sums_out=sums)
        gv.gemv_rms_norm(rnd(1, hidden), None, rnd(hidden), 1e-6, rnd(3 * hidden, hidden), sums=sums,
                         zero_sums=sums)
        gv.gemv_rms_norm(rnd(1, hidden), None, rnd(hidden), 1e-6, rnd(6 * hidden, hidden), sums=sums,
                         silu_mul_out=True)

    _record(gv, ["_gemv_kernel"], gemv, calls)

    vocab = 5000
    logits = rnd(2, vocab)
    temps, top_ks, top_ps = torch.tensor([0.7, 0.0]), torch.tensor([50, vocab]), torch.tensor([0.9, 1.0])
    seeds, steps = torch.tensor([1, 2]), torch.tensor([3, 4])

    def sampling():
        smp.fused_sample(logits, temps, top_ks, top_ps, torch.tensor([0.05, 0.0]), seeds, steps, cuts=True)
        smp.fused_sample(logits, temps, top_ks, top_ps, None, seeds, steps, cuts=False)
        # a decode graph's ends: the pick writes the token table; a greedy graph draws without noise
        table, dst = torch.zeros(8, dtype=torch.int64), torch.tensor([3, 5])
        smp.fused_sample(logits, temps, top_ks, top_ps, None, seeds, steps, cuts=False, table=table, dst=dst)
        smp.fused_greedy(logits, table, dst)
        with use_options(dataclasses.replace(current_options(), sampler_fused_narrow=False)):  # own launch
            smp.fused_sample(logits, temps, top_ks, top_ps, None, seeds, steps, cuts=True)

    _record(smp, ["_row_settings_kernel", "_stats_kernel", "_init_kernel", "_search_kernel", "_narrow_kernel",
                  "_draw_kernel", "_pick_kernel"], sampling, calls)

    def logits_processing():  # penalties, a grammar's token mask, logprobs: the rows that ask (issue 26)
        rows, slots = torch.tensor([1]), torch.tensor([0])
        counts = torch.randint(0, 4, (2, vocab), generator=gen, dtype=torch.int32)
        smp.apply_penalties_(logits, rows, slots, counts, torch.tensor([0.5]), torch.tensor([0.5]),
                             torch.tensor([1.1]), (1 << 30) - 1)
        smp.apply_token_bitmask_(logits, rows, torch.randint(-2**31, 2**31 - 1, (1, (vocab + 31) // 32),
                                                             generator=gen, dtype=torch.int32))
        smp.token_logprobs_packed(logits, rows, torch.tensor([0, 3]), 5)

    _record(smp, ["_penalty_kernel", "_bitmask_kernel", "_logprob_chunk_kernel", "_logprob_merge_kernel"],
            logits_processing, calls)
    return calls


def reduce_operand_types(ttgir: str) -> list[str]:
    """The operand type of every reduction in a TTGIR, in order, each layout alias replaced by its definition."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    types = re.findall(r"\}\) : \((tensor<[^)]*)\) -> tensor<", ttgir)
    for alias in sorted(aliases, key=len, reverse=True):  # #blocked10 before #blocked1
        types = [t.replace(alias, aliases[alias]) for t in types]
    return types


def gemv_stages_check() -> list[str]:
    """Kernel option gemv_stages: Qwen3-8B's down projection as the engine launches it at batch 1 (a 4 x 2,048 tile,
    the residual add and the sums of squares in the epilogue, two tiles before the wait, a loop of four), compiled
    as a launch specialises it, at 1 and 3 stages. At 3 the loop's loads must be pipelined (cp.async), none before
    the PDL wait, and every reduction must take the 1-stage loop's operand layouts (the products and their sums in
    the same order: the same bits). Returns what went wrong, [] if fine."""
    gen = torch.Generator().manual_seed(1)
    calls: list = []

    def down():
        sums = torch.zeros(gv.GEMV_MAX_ROWS, gv.SUM_LANES, dtype=torch.float64)
        add = torch.randn(1, 4096, generator=gen).to(torch.bfloat16)
        gv.gemv(torch.randn(1, 12288, generator=gen).to(torch.bfloat16),
                torch.randn(4096, 12288, generator=gen).to(torch.bfloat16), tiles=(4, 2048, 4), add=add,
                sums_out=sums)

    _record(gv, ["_gemv_kernel"], down, calls)
    (kernel, a, kw), = calls
    plain, staged = (compile_asm(kernel, a, kw, aligned=True, USE_PDL=True, EARLY_W=2, STAGES=n) for n in (1, 3))
    failures = []
    lines = staged["ptx"].splitlines()
    wait = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), len(lines))
    copies = [i for i, line in enumerate(lines) if re.search(r"\bcp\.async\.(?:ca|cg)\b", line)]
    if not copies:
        failures.append("_gemv_kernel at 3 stages: no cp.async, the K loop is not pipelined")
    if any(i < wait for i in copies):
        failures.append("_gemv_kernel at 3 stages: a cp.async before the PDL wait")
    if re.search(r"\bcp\.async\.(?:ca|cg)\b", plain["ptx"]):
        failures.append("_gemv_kernel at 1 stage: cp.async, the plain loop is pipelined")
    reductions = reduce_operand_types(staged["ttgir"])
    if not reductions or reductions != reduce_operand_types(plain["ttgir"]):
        failures.append("_gemv_kernel: its reductions take other layouts at 3 stages than at 1: the sums would "
                        "round apart")
    print(("ok  " if not failures else "BAD ") + "_gemv_kernel at 3 stages (aligned):",
          f"{len(copies)} cp.async, reductions {reductions}", *failures, sep="  ")
    return failures


@triton.jit
def _control_load_first(X, Y, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs)  # a global load before the wait: the check must flag it
    if USE_PDL:
        pdl_enter()
    tl.store(Y + offs, x)


@triton.jit
def _control_no_wait(X, Y, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs))


def controls() -> list[str]:
    """The checker itself: kernels that break the rule must be flagged (returns what went wrong, [] if fine)."""
    x = torch.zeros(128, dtype=torch.bfloat16)
    failures = []
    for kernel in (_control_load_first, _control_no_wait):
        ptx = compile_asm(kernel, (x, x), {"BLOCK": 128, "num_warps": 4}, USE_PDL=True)["ptx"]
        if not check_ptx(ptx):
            failures.append(f"control {kernel.__name__} passed the check but breaks the rule")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the per-kernel results here")
    args = parser.parse_args()
    results, seen = [], set()
    stage1_kwidths: set[int] = set()  # one value if no switch (the fused RoPE) changes the dots' operand layout
    prefetch_compiled = False  # the GEMV with the MLP's L2 prefetch (gemv(l2_prefetch=)): one variant is enough
    for kernel, a, kw in record_launches():
        variants = [{}]
        params = [p.name for p in kernel.params]
        if "EARLY_W" in params:
            variants = [{"EARLY_W": 3}, {"EARLY_W": 1}, {"EARLY_W": 0}]
            if not prefetch_compiled:  # a CPU launch prefetches nothing (no PDL): ask for three regions
                variants.append({"EARLY_W": 2, "PF_REGIONS": 3, "PF_LANES": 2})
                prefetch_compiled = True
        if "EARLY_META" in params:
            variants = [{"EARLY_META": True}, {"EARLY_META": False}]
        if "EARLY_KV" in params and kw.get("FUSED_STORE"):  # the early keys: with the early metadata only
            variants = [{"EARLY_META": True, "EARLY_KV": True}, {"EARLY_META": True, "EARLY_KV": False},
                        {"EARLY_META": False, "EARLY_KV": False},
                        # the next layer's keys asked of L2 (decode_prefetch_next_kv), with the early metadata
                        {"EARLY_META": True, "EARLY_KV": True, "PREFETCH_NEXT": True}]
        elif "EARLY_KV" in params:
            variants = [dict(v, EARLY_KV=False) for v in variants]
        for overrides in variants:
            key = (kernel.__name__,
                   repr([(k, v) for k, v in kw.items()
                         if k not in ("USE_PDL", "EARLY_W", "EARLY_META", "EARLY_KV", "PF_REGIONS", "PF_LANES",
                                      "PREFETCH_NEXT")]),
                   tuple(_arg_type(v) if not isinstance(v, torch.Tensor) else str(v.dtype) for v in a),
                   repr(overrides))
            if key in seen:
                continue
            seen.add(key)
            asm = compile_asm(kernel, a, kw, USE_PDL=True, **overrides)
            ptx = asm["ptx"]
            if kernel.__name__ == "_decode_stage1_kernel":
                stage1_kwidths.update(dot_kwidths(asm["ttgir"]))
            early = overrides.get("EARLY_W", 0) > 0 or overrides.get("EARLY_META", False)
            # the early metadata: a decode row's length, (stage 1) its table row, its new slot with the fused store
            # and its first key tile's slots (at most one load per slot: every thread may hold them all); RoPE's
            # position and its cos and sin (the fused RoPE's in stage 1 too); with the early keys, their tile
            stage1 = 2 + bool(kw.get("FUSED_STORE")) + kw.get("BLOCK_N", 0) + 3 * bool(kw.get("ROPE"))
            if overrides.get("EARLY_KV"):  # and the first key tile's keys and values, an element a load
                stage1 += 2 * kw["BLOCK_N"] * kw["BLOCK_D"] // (32 * kw["num_warps"])
            if overrides.get("PREFETCH_NEXT"):  # the slots again, in the layout of the next layer's prefetch
                stage1 += kw["BLOCK_N"]
            metadata = ({"_decode_stage1_kernel": stage1, "_decode_stage2_kernel": 1,
                         "_rope_kernel": 3}[kernel.__name__] if overrides.get("EARLY_META") else None)
            problems = check_ptx(ptx, allow_loads_before_wait=early, max_early_loads=metadata,
                                 allow_prefetch_before_wait=overrides.get("PF_REGIONS", 0) > 0
                                 or overrides.get("PREFETCH_NEXT", False))
            if (kw.get("NORM") or kw.get("ROPE_NORM")) and not re.search(r"\b(?:add|fma)(?:\.rn)?\.f64\b", ptx):
                problems.append("no fp64 add: a q/k norm's head sum must be exact (sum_squares), or the fused RoPE "
                                "and the RoPE kernel round apart (run25)")
            consts = {k: v for k, v in kw.items() if k.isupper() and k != "USE_PDL"} | overrides
            results.append({"kernel": kernel.__name__, "constexprs": {k: str(v) for k, v in consts.items()},
                            "problems": problems})
            print(("ok  " if not problems else "BAD ") + kernel.__name__, consts, *problems, sep="  ")
    bad_controls = controls() + gemv_stages_check()
    compiled = {r["kernel"] for r in results}
    for module in (ew, att, gv, smp):
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                if "USE_PDL" not in [p.name for p in obj.params]:
                    bad_controls.append(f"{module.__name__}.{name} takes no USE_PDL")
                elif name not in compiled:
                    bad_controls.append(f"{module.__name__}.{name} is not exercised by record_launches")
    if len(stage1_kwidths) > 1:  # every switch of the decode kernel must keep its dots' summation order
        bad_controls.append(f"_decode_stage1_kernel: the dots' operand kWidth differs between variants "
                            f"{sorted(stage1_kwidths)}: their q·k sums would round apart (run27, rope_bits)")
    for failure in bad_controls:
        print("BAD ", failure)
    kernels = {r["kernel"] for r in results}
    print(f"{len(results)} compiled variants of {len(kernels)} kernels; "
          f"{sum(bool(r['problems']) for r in results)} with problems")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad_controls or any(r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
