# generated from notebooks/01_model.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/01_model.ipynb, cell 3 (id c01-003) ---
"""The few numbers of a Hugging Face config that our models need, read once into a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}


# --- notebooks/01_model.ipynb, cell 9 (id c01-008) ---
@dataclass(frozen=True)
class ModelConfig:
    arch: str  # qwen3 | llama | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf(cls, hf, eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        archs = getattr(hf, "architectures", None) or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = {"qwen3": "qwen3", "llama": "llama", "qwen2": "qwen2"}.get(getattr(hf, "model_type", ""))
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or hf.model_type}; minisgl runs "
                             f"{sorted(ARCHITECTURES)}")
        num_q_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_q_heads
        # transformers >= 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
        rope = dict(getattr(hf, "rope_parameters", None) or {})
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        scaling = rope if rope else (getattr(hf, "rope_scaling", None) or None)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, llama3)")
        if eos_token_ids == ():
            eos = getattr(hf, "eos_token_id", None)
            eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            arch=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_q_heads=num_q_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_q_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if rope_type == "llama3" else None,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=tuple(int(e) for e in eos_token_ids),
        )
