"""How a measurement builds an engine: settings (EngineConfig fields) and kernel options, applied in one place.

Settings are the engine's own switches (`overlap=False`, `gemv=False`, ...): keyword arguments of `LLM`.
Kernel options are the Triton path's switches that are not (yet) per-engine on main: module-level values that an
engine reads when it compiles its kernels and captures its graphs (the kernel checks and tunes of lab.checks and
lab.tune set them through here too). Until they are engine options, `kernel_options` sets them for one engine's
life and restores them afterwards. Every result records both, so a JSON says what ran.

When the engine takes them (issue 27's `KernelOptions`, `EngineConfig.kernels`), this module is the one to change:
the option names here are that class's fields (`decode_fused_store`, `gemv_pdl_early_tiles`, `sampler_launch`,
`gdn`, ...); `with_engine` then passes `kernel` to `LLM` with the settings (a `gemv_table` dict written to a JSON
file for `gemv_configs`), and `kernel_options` becomes `use_options(replace(current_options(), ...))` for the
checks that call kernels directly. `fused_sampler` has no such field yet: its arm needs one or keeps this patch.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from lab.models import model_path

T = TypeVar("T")


def log(*args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _module_value(module: str, name: str, value: Any) -> Iterator[None]:
    mod = importlib.import_module(module)
    saved = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, saved)


@contextlib.contextmanager
def dict_entries(module: str, name: str, updates: dict) -> Iterator[None]:
    """Some entries of a module-level dict replaced (None as a value: the entry removed) for one engine's life."""
    table = getattr(importlib.import_module(module), name)
    saved = dict(table)
    for key, value in updates.items():
        table[key] = value
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


@contextlib.contextmanager
def _gemv_table(updates: dict) -> Iterator[None]:
    """The card's tuned GEMV table ((N, K) -> (BLOCK_N, BLOCK_K, warps, rows) or None for cuBLAS) with some
    shapes' entries replaced. Keys may be "N,K" strings (as the tune writes them) or (N, K) tuples."""
    from minisgl.kernels import gemv
    if not gemv.GEMV_CONFIGS and torch.cuda.is_available():
        gemv.load_device_table(torch.cuda.get_device_name())
    parsed = {(tuple(int(v) for v in k.split(",")) if isinstance(k, str) else tuple(k)):
              (tuple(v) if v is not None else None) for k, v in updates.items()}
    with dict_entries("minisgl.kernels.gemv", "GEMV_CONFIGS", parsed):
        yield


def _fused_sampler(on: bool):
    """Off: the sampler takes its torch path (a sort per row for top-k/top-p) where it would take the fused
    Triton kernel; the sampler picks the kernel when `minisgl.kernels.sampling.triton` is set."""
    return contextlib.nullcontext() if on else _module_value("minisgl.kernels.sampling", "triton", None)


# option name -> (what it does, a function value -> context manager that applies it to engines built inside)
KERNEL_OPTIONS: dict[str, tuple[str, Callable[[Any], contextlib.AbstractContextManager]]] = {
    "decode_fused_merge": ("decode attention merges its splits inside its first kernel (else a second launch)",
                           lambda v: _module_value("minisgl.kernels.attention", "DECODE_FUSED_MERGE", bool(v))),
    "decode_fused_store": ("decode attention writes the step's K/V itself (else a K/V-store launch first)",
                           lambda v: _module_value("minisgl.kernels.attention", "DECODE_FUSED_STORE", bool(v))),
    "mixed_decode_split": ("a mixed step's decode rows take the decode kernel (else the extend kernel)",
                           lambda v: _module_value("minisgl.attention.triton_backend", "MIXED_DECODE_SPLIT", bool(v))),
    "gemv_pdl_early_tiles": ("weight tiles the decode GEMV loads before waiting for the kernel ahead (0-3)",
                             lambda v: _module_value("minisgl.kernels.gemv", "PDL_EARLY_TILES", int(v))),
    "gemv_table": ("entries of the decode GEMV's tuned table replaced ({'N,K': [tiles..., rows] or None})",
                   _gemv_table),
    "sampler_launch": ("the fused sampler's launch shapes (entries of minisgl.kernels.sampling.LAUNCH)",
                       lambda v: dict_entries("minisgl.kernels.sampling", "LAUNCH", v)),
    "fused_sampler": ("sampling with top-k/top-p/temperature in one Triton kernel (else torch, with a sort)",
                      _fused_sampler),
    "sampler_skip_blocks": ("the fused sampler reads only the blocks of logits that can hold a kept token (exact)",
                            lambda v: _module_value("minisgl.kernels.sampling", "SKIP_BLOCKS", bool(v))),
    "sampler_top_k_bound": ("the fused sampler's top-k search starts from the k-th largest block maximum (exact)",
                            lambda v: _module_value("minisgl.kernels.sampling", "TOP_K_BOUND", bool(v))),
    "gdn": ("launch settings of the Gated DeltaNet kernels (entries of minisgl.kernels.gdn.GDN_CONFIG)",
            lambda v: dict_entries("minisgl.kernels.gdn", "GDN_CONFIG", v)),
}


@contextlib.contextmanager
def kernel_options(**options: Any) -> Iterator[None]:
    """Apply kernel options to every engine built inside the block; unknown names are an error."""
    unknown = set(options) - set(KERNEL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}; known: {sorted(KERNEL_OPTIONS)}")
    with contextlib.ExitStack() as stack:
        for name, value in options.items():
            stack.enter_context(KERNEL_OPTIONS[name][1](value))
        yield


def build(model: str, settings: dict | None = None, **fixed: Any):
    """An engine on `model`'s dummy bf16 weights: `fixed` are the caller's own LLM arguments (e.g. a smaller
    KV pool for a check), `settings` the ones a result records. Build it inside `kernel_options` for those."""
    from minisgl import LLM
    kw = {"load_format": "dummy", "dtype": "bfloat16", **fixed, **(settings or {})}
    return LLM(model_path(model), **kw)


def with_engine(model: str, body: Callable[[Any], T], settings: dict | None = None, kernel: dict | None = None,
                **fixed: Any) -> T:
    """Build an engine, run body(llm), drop the engine and give its GPU memory back before returning: nothing
    keeps a reference to it, so the next engine of the section starts on the same free memory."""
    with kernel_options(**(kernel or {})):
        llm = build(model, settings, **fixed)
        try:
            return body(llm)
        finally:
            llm.close()
            del llm
            free_gpu()
