"""What a step between two dependent phases costs: a kernel boundary under PDL against a grid barrier inside one
persistent kernel (issue 29: a batch-1 decode step is ~250 dependent launches, and run27's anatomy put most of its
time in their chain, not in bytes).

Each phase: every program reads the whole previous phase's output (a vector of `programs` floats, as a GEMV
reads its input row), adds its program id, and writes its own element. Two ways to chain `PHASES` phases:

- `launches`: one launch per phase, PDL on (each waits for the one before, as minisgl's decode kernels do),
  captured in a CUDA graph and replayed;
- `persistent`: one launch of the same programs running every phase, separated by the decode-layers kernel's grid
  barrier (minisgl/kernels/decode_layers.py `_grid_barrier`: a CTA barrier, then one thread's release-add on a
  global counter, then a spin on an acquire-load until every program arrived, then a CTA barrier); every program
  must be resident at once, so `programs` stays within what the card holds (a spin gives up after 4M tries, and
  the values then fail the check, rather than hang).

Both compute the same values (checked); the time per phase is the figure. Also a `launches` chain whose kernel
preloads 8 KB of "weights" per program before its PDL wait (as the GEMV does), to see the boundary with a GEMV's
register footprint.

    python -m lab.checks.grid_barrier --out DIR        # writes DIR/grid_barrier.json (a CUDA GPU, sm_90+)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PHASES = 64
PROGRAMS = (132, 264, 528, 1056)
WEIGHT_ELEMS = 4096  # bf16 per program for the preloading variant: 8 KB, as a [4, 1024] GEMV tile

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.decode_layers import _grid_barrier
    from minisgl.kernels.pdl import gdc_launch_dependents, gdc_wait
except ImportError:  # a CPU install: main() says so
    triton = None


if triton is not None:
    @triton.jit
    def _phase_kernel(X, Y, W, n, BLOCK: tl.constexpr, WBLOCK: tl.constexpr, PRELOAD: tl.constexpr,
                      USE_PDL: tl.constexpr):
        pid = tl.program_id(0)
        if USE_PDL:
            gdc_launch_dependents()
        if PRELOAD:  # weights no kernel writes: loaded before the wait, as the GEMV's early tiles
            w = tl.load(W + pid.to(tl.int64) * WBLOCK + tl.arange(0, WBLOCK)).to(tl.float32)
        if USE_PDL:
            gdc_wait()
        offs = tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0)
        total = tl.sum(x, 0)
        if PRELOAD:
            total += tl.sum(w, 0) * 0.0
        tl.store(Y + pid, total * 1e-3 + pid)

    @triton.jit
    def _persistent_kernel(Buf, Counter, n, phases, BLOCK: tl.constexpr, SPIN_LIMIT: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        for p in range(phases):
            x = tl.load(Buf + (p % 2) * BLOCK + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
            total = tl.sum(x, 0)
            tl.store(Buf + ((p + 1) % 2) * BLOCK + pid, total * 1e-3 + pid)
            _grid_barrier(Counter, (p + 1) * n, SPIN_LIMIT)  # the decode-layers kernel's own barrier


def reference(n: int, phases: int) -> torch.Tensor:
    x = torch.zeros(n, dtype=torch.float32, device="cuda")
    ids = torch.arange(n, dtype=torch.float32, device="cuda")
    for _ in range(phases):
        x = x.sum() * 1e-3 + ids
    return x


def launches(n: int, preload: bool) -> dict:
    from lab.timing import capture, time_replay_us

    block = triton.next_power_of_2(n)
    bufs = [torch.zeros(n, dtype=torch.float32, device="cuda") for _ in range(2)]
    w = torch.randn(n * WEIGHT_ELEMS, device="cuda").to(torch.bfloat16)

    def chain():
        bufs[0].zero_()
        for p in range(PHASES):
            _phase_kernel[(n,)](bufs[p % 2], bufs[(p + 1) % 2], w, n, BLOCK=block, WBLOCK=WEIGHT_ELEMS,
                                PRELOAD=preload, USE_PDL=True, num_warps=4, launch_pdl=True)
        return bufs[PHASES % 2]

    graph, out = capture(chain)
    us = time_replay_us(graph, iters=20)
    ok = torch.allclose(out, reference(n, PHASES), rtol=1e-4, atol=1e-3)
    return {"us_per_phase": round(us / PHASES, 3), "ok": bool(ok)}


def persistent(n: int) -> dict:
    block = triton.next_power_of_2(n)
    buf = torch.zeros(2 * block, dtype=torch.float32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    times = []
    for _ in range(12):
        buf.zero_()
        counter.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _persistent_kernel[(n,)](buf, counter, n, PHASES, BLOCK=block, SPIN_LIMIT=1 << 22, num_warps=4)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    out = buf[(PHASES % 2) * block:(PHASES % 2) * block + n]
    ok = torch.allclose(out, reference(n, PHASES), rtol=1e-4, atol=1e-3)
    times = sorted(times[2:])
    return {"us_per_phase": round(times[len(times) // 2] / PHASES, 3), "ok": bool(ok)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if triton is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("grid_barrier: needs a CUDA GPU of sm_90 or newer, nothing to measure")
        return
    from minisgl.bench.runner import environment

    res: dict = {"environment": environment(), "command": "python -m lab.checks.grid_barrier", "phases": PHASES,
                 "programs": {}}
    for n in PROGRAMS:
        row = {"launches": launches(n, False), "launches_preload_8kb": launches(n, True),
               "persistent": persistent(n)}
        res["programs"][str(n)] = row
        print(n, row, flush=True)
    path = Path(a.out) / "grid_barrier.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
