"""minisgl: a small, fast LLM inference engine, built module by module in a Jupyter course."""

from minisgl.config import EngineConfig
from minisgl.errors import RequestError
from minisgl.sampling_params import SamplingParams, StructuredOutput

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "RequestError", "SamplingParams", "StructuredOutput", "__version__"]


def __getattr__(name):
    # LLM pulls in transformers; import it only when asked for, so `import minisgl` stays light.
    if name == "LLM":
        from minisgl.llm import LLM
        return LLM
    raise AttributeError(name)
