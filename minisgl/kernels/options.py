"""The kernel options in force for a launch: the engine's own, not the process's.

Each engine carries a frozen `KernelOptions` (`EngineConfig.kernels`, minisgl/config.py). Its model runner wraps
everything that launches kernels (start-up, where the GEMV swap, warm-ups and CUDA graph captures happen, and
every step) in `use_options(config.kernels)`, and a kernel wrapper asks `current_options()` for PDL, the fused
decode store, its launch table, ... at the moment it launches. So:

- two engines with different options work in one process: each step runs under its own engine's options, and
  leaving the block restores whatever was in force before (a `contextvars.ContextVar`, so threads, e.g. a server
  worker and a test, never see each other's);
- a captured CUDA graph keeps the options it was captured with: the launches it recorded were made under them,
  and a replay launches nothing from Python;
- code that calls a kernel directly (tests, tuning scripts) gets the environment's defaults
  (minisgl/environment.py), or whatever it sets with `use_options(...)`.

Nothing here is a switch to flip: the options are immutable and scoped to the `with` block that applies them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from minisgl.config import KernelOptions, default_kernel_options

_DEFAULTS = default_kernel_options()  # without an engine: KernelOptions() with the environment's defaults
_IN_FORCE: ContextVar[KernelOptions] = ContextVar("minisgl_kernel_options", default=_DEFAULTS)


def current_options() -> KernelOptions:
    """The options of the engine whose work is running now (the defaults outside any engine)."""
    return _IN_FORCE.get()


@contextmanager
def use_options(options: KernelOptions) -> Iterator[KernelOptions]:
    """Run the block's launches under `options`; the options in force before come back when it ends."""
    if not isinstance(options, KernelOptions):
        raise TypeError(f"expected KernelOptions, got {type(options).__name__}")
    token = _IN_FORCE.set(options)
    try:
        yield options
    finally:
        _IN_FORCE.reset(token)
