"""A model family: the classes that build and load one kind of model, and the engine runtime it declares
(models/registry.py picks the family by Hugging Face model type)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

KV_ONLY = "kv"  # the runtime of a model that needs nothing beyond its KV cache


@dataclass(frozen=True)
class ModelFamily:
    name: str
    config_cls: type  # a ModelConfig subclass: from_hf(hf_config, eos_ids)
    model_cls: type  # model_cls(config, max_positions) -> nn.Module
    init_dummy: Callable[[Any, int], None]  # (model, seed): seeded random weights
    load_weights: Callable[[Any, Any, str], None]  # (model, config, folder): the checkpoint's tensors
    runtime: str = KV_ONLY  # what the engine runs it with beyond a KV cache (engine/runtime.py's RUNTIMES)
