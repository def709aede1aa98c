"""Models: one decoder covering Qwen3, Llama-3 and Qwen2, plus the config it reads. The hybrid Qwen3.5 has its
own module, `minisgl.models.qwen3_5`, which the loader imports when a checkpoint asks for it."""

from minisgl.models.config import ARCHITECTURES, ModelConfig
from minisgl.models.decoder import DecoderLM

__all__ = ["ARCHITECTURES", "ModelConfig", "DecoderLM"]
