"""Programmatic dependent launch (PDL) for minisgl's Triton kernels: the switch, and what a launcher passes.

Why. At batch 1 a decode step is a few hundred short kernels in one CUDA graph (about 260 for Qwen3-0.6B, ~1.15 ms
on an H200), and every kernel boundary costs idle time on top of the kernels themselves: the next kernel is only
launched once the previous one has completely finished, then its programs must be scheduled and start loading
(reports/h200/run8/DECODE_STEP.md, last section). Hopper (sm_90) and later can launch a kernel early: a launch
carrying the attribute CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (Triton: the launch option
`launch_pdl=True`) may start while its predecessor in the stream is still running, as soon as every program of
the predecessor has executed `griddepcontrol.launch_dependents` (Triton: `gdc_launch_dependents()`) or exited.
The early kernel then runs `griddepcontrol.wait` (`gdc_wait()`), which returns once the predecessor has completed
and its memory operations are visible. Stream capture records such launches into a CUDA graph as programmatic
edges, so the decode graphs get the overlap too. What is hidden is the launch and the ramp-up of the next
kernel's programs, not any of the work.

The correctness rule. A kernel launched with `launch_pdl` may be running while its predecessor still runs, so it
must execute `gdc_wait()` before its first load or store of any global memory that another kernel writes or
reads: read-after-write (its inputs), and write-after-read too (its outputs may be buffers the predecessor is
still reading, e.g. a reused workspace). minisgl's kernels therefore open with

    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()

before touching global memory (`pdl_enter` below). Calling `gdc_launch_dependents()` first only lets the
successor be *scheduled* sooner; the successor itself waits before it touches memory, and its wait returns only
once this kernel has completed, which this kernel does only after its own wait returned, i.e. after its
predecessor completed. So ordering holds transitively along the whole chain: no kernel reads or writes memory
before every kernel launched before it has completed. Kernels launched without the attribute (torch ops, cuBLAS,
copies) keep the normal stream order: they start only when the previous kernel has finished, PDL or not.
Memory no kernel ever writes (weights) may be read before the wait.

The switch. PDL is a kernel option (`KernelOptions.pdl`, `--disable-pdl`; kernels/options.py): on by default,
applied per engine, so each engine's launches and the CUDA graphs it captures follow its own setting.
`pdl_launch(t)` is what a launcher asks: `{"launch_pdl": True}` only when the options in force have it on, `t` is a
CUDA tensor (never the CPU / Triton-interpreter path), the device is sm_90 or newer, and the installed Triton knows
the option; `{}` otherwise. A launcher passes `USE_PDL=bool(kw), **kw`, so the gdc calls are compiled in only for
PDL launches (and never reached by the interpreter). Without Triton this module still imports; `pdl_launch` then
returns `{}`.
"""

from __future__ import annotations

import dataclasses

import torch

from minisgl.kernels.options import current_options

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: nothing here launches
    triton = None
    tl = None

try:  # Triton >= 3.2 exposes grid dependency control; older versions simply never get USE_PDL=True
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

__all__ = ["pdl_enter", "pdl_launch", "pdl_launch_dependents", "pdl_wait", "triton_supports_pdl"]


def _detect_triton_pdl() -> bool:
    if triton is None or gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # no NVIDIA backend in this Triton build
        return False
    return "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}


_TRITON_PDL = _detect_triton_pdl()


def triton_supports_pdl() -> bool:
    """Whether the installed Triton has the `launch_pdl` launch option and the gdc intrinsics."""
    return _TRITON_PDL


_capable: dict[int, bool] = {}  # device index -> compute capability >= 9


def _device_capable(device: torch.device) -> bool:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ok = _capable.get(idx)
    if ok is None:
        ok = _capable[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return ok


def pdl_launch(t: torch.Tensor) -> dict:
    """The extra launch kwargs for a kernel working on `t`'s device: {"launch_pdl": True} where PDL applies
    (the options in force have it on, CUDA tensor, sm_90+, Triton supports it), else {}. Pass
    `USE_PDL=bool(kw), **kw`."""
    if not (_TRITON_PDL and t.is_cuda and current_options().pdl):
        return {}
    return {"launch_pdl": True} if _device_capable(t.device) else {}


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def pdl_launch_dependents():
    """The first half of `pdl_enter`, for a kernel that reads inputs no kernel in flight writes before its wait."""
    gdc_launch_dependents()


@_jit
def pdl_wait():
    """The second half: from here on, the predecessor has completed and its writes are visible."""
    gdc_wait()


@_jit
def pdl_enter():
    """A PDL kernel's prologue, before any global load or store: let the successor launch, then wait for the
    predecessor to complete (its writes visible). Call only under `if USE_PDL:`."""
    gdc_launch_dependents()
    gdc_wait()
