"""Which classes build a model, by its Hugging Face `model_type`, and what the engine runs it with.

The decoder of notebook 01 (models/decoder.py: Llama-3, Qwen2, Qwen3) is every model type this registry does not
name; the loader builds it with its own functions. A family listed here brings its own config class, module,
dummy initialisation and checkpoint reader, and declares what it needs beyond a KV cache by naming its engine
*runtime* (engine/runtime.py): "kv" (nothing more) or "linear_state" (a per-request state pool, the state slots
as extra step and graph inputs, and the snapshot-aware scheduler; engine/hybrid.py). A new family is one module
under models/ plus a line in `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable

from minisgl.models.family import KV_ONLY, ModelFamily


def _qwen3_5() -> ModelFamily:
    from minisgl.models import qwen3_5  # imported when asked for: its kernels are not every model's
    return qwen3_5.FAMILY


# model_type -> the family (a function, so a family's module is imported only for its models). Qwen3.5's MoE
# types are listed so that its config refuses them with a clear message instead of the decoder misreading them.
FAMILIES: dict[str, Callable[[], ModelFamily]] = {
    "qwen3_5": _qwen3_5, "qwen3_5_text": _qwen3_5, "qwen3_5_moe": _qwen3_5, "qwen3_5_moe_text": _qwen3_5,
}


def model_family(hf_config) -> ModelFamily | None:
    """The family registered for this config's model type; None: the decoder of notebook 01."""
    make = FAMILIES.get(getattr(hf_config, "model_type", ""))
    return make() if make is not None else None


def runtime_name(hf_config) -> str:
    """The engine runtime the model declares (engine/runtime.py)."""
    family = model_family(hf_config)
    return family.runtime if family is not None else KV_ONLY
