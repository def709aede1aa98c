"""The engine: model runner, sampler, CUDA Graph runner and the (overlap) loop."""

from minisgl.engine.engine import Engine

__all__ = ["Engine"]
