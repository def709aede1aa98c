"""The models the lab measures: one table from a short name to its config folder and how each engine runs it.

Every measurement uses dummy bf16 weights at the real shapes (the config folders under assets/configs), so a
name here is all a section, the SGLang driver, a tune or a check needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lab import REPO


@dataclass(frozen=True)
class Model:
    name: str  # the short name used on command lines and in JSON
    tag: str  # the suffix of section names (`sample06`, `sglang_w1_06`)
    config: str  # folder under assets/configs with config.json
    sglang_extra: dict = field(default_factory=dict)  # sglang.Engine keyword arguments this model needs
    hybrid: bool = False  # per-request state beside the KV cache (Gated DeltaNet layers)

    @property
    def path(self) -> str:
        """The config folder, absolute: commands may run from another directory (an A/B of an older package)."""
        return str(REPO / "assets" / "configs" / self.config)


MODELS = {m.name: m for m in (
    Model("qwen3-0.6b", "06", "qwen3-0.6b"),
    Model("qwen3-8b", "8", "qwen3-8b"),
    # a multimodal checkpoint: SGLang runs its text part only (shared/anchors.md)
    Model("qwen3.5-0.8b", "35", "qwen3.5-0.8b", sglang_extra={"enable_multimodal": False}, hybrid=True),
)}


def model(name: str) -> Model:
    try:
        return MODELS[name]
    except KeyError:
        raise SystemExit(f"unknown model {name!r}; the lab knows {', '.join(MODELS)}") from None


def model_path(name: str) -> str:
    return model(name).path


def text_config(name: str) -> dict:
    """The model's config.json as a dict; for a multimodal checkpoint (Qwen3.5) its text part."""
    cfg = json.loads((Path(model(name).path) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def attention_shape(name: str) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of the model's full-attention layers."""
    c = text_config(name)
    return c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim") or c["hidden_size"] // c[
        "num_attention_heads"]
