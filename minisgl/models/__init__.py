"""Models: one decoder covering Qwen3, Llama-3 and Qwen2, plus the config it reads."""

from minisgl.models.config import ARCHITECTURES, ModelConfig
from minisgl.models.decoder import DecoderLM

__all__ = ["ARCHITECTURES", "ModelConfig", "DecoderLM"]
