"""Everything minisgl reads from, or writes to, the process environment: here and nowhere else.

The engine's settings are fields of `EngineConfig` and `KernelOptions` (minisgl/config.py). The environment only
supplies *defaults* for the kernel options, so that a shell script can run an A/B arm by exporting a variable;
it is read once, when this module is imported, and an option given to the engine (a keyword, a flag) always
wins over it. The variables:

| variable | KernelOptions field |
|---|---|
| `MINISGL_PDL=0` | `pdl=False` |
| `MINISGL_DECODE_FUSED_STORE=0` | `decode_fused_store=False` |
| `MINISGL_DECODE_FUSED_MERGE=1` | `decode_fused_merge=True` |
| `MINISGL_MIXED_DECODE_SPLIT=0` | `mixed_decode_split=False` |
| `MINISGL_GEMV_CONFIGS=PATH` | `gemv_configs=PATH` |
| `MINISGL_GEMV_PDL_EARLY_TILES=N` | `gemv_pdl_early_tiles=N` |
| `MINISGL_FORCE_TRITON=1` | `triton_on_cpu=True` (tests, under `TRITON_INTERPRET=1`) |

Besides those: `OMP_NUM_THREADS` (whether the user chose the CPU thread count: `omp_threads_set`),
`MINISGL_TEST_MODEL` (the server tests' model), `MINISGL_GIT_COMMIT` / `MINISGL_GIT_DIRTY`
(the commit a benchmark records, for a copy of the tree without .git), and what minisgl sets for the libraries
it starts (NCCL) or passes to the processes it spawns.
"""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def _flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 or 0")


def _read_kernel_defaults() -> dict:
    found = {}
    for name, field in (("MINISGL_PDL", "pdl"), ("MINISGL_DECODE_FUSED_STORE", "decode_fused_store"),
                        ("MINISGL_DECODE_FUSED_MERGE", "decode_fused_merge"),
                        ("MINISGL_MIXED_DECODE_SPLIT", "mixed_decode_split"),
                        ("MINISGL_FORCE_TRITON", "triton_on_cpu")):
        value = _flag(name)
        if value is not None:
            found[field] = value
    if os.environ.get("MINISGL_GEMV_CONFIGS"):
        found["gemv_configs"] = os.environ["MINISGL_GEMV_CONFIGS"]
    if os.environ.get("MINISGL_GEMV_PDL_EARLY_TILES"):
        found["gemv_pdl_early_tiles"] = int(os.environ["MINISGL_GEMV_PDL_EARLY_TILES"])
    return found


_KERNEL_DEFAULTS = _read_kernel_defaults()  # once, at import: later changes to the environment are not seen


def kernel_option_defaults() -> dict:
    """The KernelOptions fields the environment sets (see the table above), as keyword arguments."""
    return dict(_KERNEL_DEFAULTS)


def server_test_model() -> str | None:
    """MINISGL_TEST_MODEL: a model folder the server tests use instead of the embedded one."""
    return os.environ.get("MINISGL_TEST_MODEL") or None


def git_commit_override() -> tuple[str | None, bool | None]:
    """(MINISGL_GIT_COMMIT, MINISGL_GIT_DIRTY as a bool): what a copy of the tree without .git reports."""
    dirty = os.environ.get("MINISGL_GIT_DIRTY")
    return os.environ.get("MINISGL_GIT_COMMIT") or None, None if dirty is None else dirty == "1"


def keep_nvlink_multicast_off() -> None:
    """NCCL's NVLink multicast stays off for every communicator this process, and the ranks it spawns (they
    inherit the variable), start: NCCL reads NCCL_NVLS_ENABLE when a communicator is created."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def child_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus `extra`, for a subprocess."""
    return {**os.environ, **extra}


def omp_threads_set() -> bool:
    """Whether the user chose torch's CPU thread count with OMP_NUM_THREADS (torch already applied it)."""
    return "OMP_NUM_THREADS" in os.environ
