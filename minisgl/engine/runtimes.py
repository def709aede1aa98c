"""The engine runtimes by the name a model family declares (models/registry.py; engine/runtime.py says what a
runtime is)."""

from __future__ import annotations

from minisgl.engine.hybrid import LinearStateRuntime
from minisgl.engine.runtime import ModelRuntime

RUNTIMES: dict[str, type[ModelRuntime]] = {"kv": ModelRuntime, "linear_state": LinearStateRuntime}


def make_runtime(name: str, model_config) -> ModelRuntime:
    if name not in RUNTIMES:
        raise ValueError(f"unknown model runtime {name!r}; known: {sorted(RUNTIMES)}")
    return RUNTIMES[name](model_config)
