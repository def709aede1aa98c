"""Engine settings. Every optimisation is a named switch, so an ablation is a flag, not an edit.

Each field also carries its command-line flag (SGLang's name where SGLang has the setting), so the one flag
set of `python -m minisgl {generate,bench,serve}` is generated from this class: `add_engine_args` adds the
flags to a parser, `engine_kwargs_from_args` reads back the ones given (unset flags keep the defaults here).

Sizes left to the engine: `num_pages` None and `max_running_requests` 0/None are sized at start-up from the
device's memory (engine/model_runner.py, engine/sizing.py); an explicit value always wins. The engine's own
config (`Engine.config`, `LLM.config`) carries the resolved `max_running_requests`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, replace


def _opt(default, flag: str | tuple[str, ...], help: str, *, disable: bool = False, choices=None):
    """A field with its command-line flag(s). disable=True: a bool switch that is on by default, turned off
    by `--disable-...` (SGLang's spelling)."""
    flags = (flag,) if isinstance(flag, str) else flag
    return field(default=default, metadata={"flags": flags, "help": help, "disable": disable, "choices": choices})


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(metadata={"flags": ("--model-path", "--model"), "help": "model folder (HF layout) or hub id"})
    # weights and numerics
    dtype: str = _opt("auto", "--dtype", "auto = bf16 on a GPU, fp32 on a CPU",
                      choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _opt("auto", "--device", "auto | cpu | cuda")
    load_format: str = _opt("auto", "--load-format", "auto (safetensors) | dummy (seeded random weights)",
                            choices=("auto", "safetensors", "dummy"))
    seed: int = _opt(0, ("--random-seed", "--seed"), "engine seed (requests without a seed draw theirs from it)")
    max_model_len: int | None = _opt(None, ("--context-length", "--max-model-len"),
                                     "context in tokens (default: the model's max_position_embeddings)")
    # KV cache
    page_size: int = _opt(1, "--page-size", "tokens per KV page")
    num_pages: int | None = _opt(None, "--num-pages", "KV pool pages (default: sized from --kv-memory-fraction "
                                 "on a GPU, --kv-cache-tokens on a CPU)")
    kv_memory_fraction: float = _opt(0.85, "--kv-memory-fraction",
                                     "share of the GPU memory left free after the weights given to the KV pool "
                                     "(not SGLang's --mem-fraction-static, which counts the weights too)")
    kv_cache_tokens: int = _opt(16384, "--kv-cache-tokens", "KV pool size on a CPU, in tokens")
    state_snapshots: int | None = _opt(None, "--state-snapshots",
                                       "hybrid models (Qwen3.5): linear-attention state snapshots the prefix cache "
                                       "may keep (default: sized by --state-snapshot-memory-fraction on a GPU, "
                                       "max running requests on a CPU)")
    state_snapshot_memory_fraction: float = _opt(0.05, "--state-snapshot-memory-fraction",
                                                 "hybrid models: share of the GPU memory left free after the "
                                                 "weights given to prefix-cache state snapshots, when "
                                                 "--state-snapshots is not given")
    # scheduler
    max_running_requests: int | None = _opt(
        None, "--max-running-requests",
        "requests running at once, at most; 0 or unset = auto: sized from the KV pool and the memory a request "
        "row costs, 256..1024 (hybrid models: at most 256; engine/sizing.py)")
    chunked_prefill_size: int = _opt(8192, "--chunked-prefill-size",
                                     "prefill tokens per step, long prompts cut into chunks of this size; "
                                     "<= 0 turns chunked prefill off")
    max_prefill_tokens: int = _opt(16384, "--max-prefill-tokens",
                                   "prefill tokens per step at most, chunked or not (a longer prompt that "
                                   "cannot be cut runs alone)")
    mixed_prefill_tokens: int = _opt(0, "--mixed-prefill-tokens",
                                     "chunked prefill: prefill tokens at most in a step that also decodes (0 = "
                                     "the prefill budget, as in a step that does not); smaller keeps the token "
                                     "gaps of running streams steady while prompts arrive, at some prompt speed")
    # the switches of the ablation table (chunked prefill is chunked_prefill_size <= 0)
    radix_cache: bool = _opt(True, "--disable-radix-cache", "no prefix reuse (the naive cache)", disable=True)
    overlap: bool = _opt(True, "--disable-overlap-schedule", "resolve each step before scheduling the next",
                         disable=True)
    cuda_graph: bool = _opt(True, "--disable-cuda-graph", "launch decode steps eagerly", disable=True)
    cuda_graph_max_bs: int = _opt(256, "--cuda-graph-max-bs",
                                  "largest decode batch captured in a CUDA Graph (at most max_running_requests)")
    cuda_graph_split: bool = _opt(True, "--disable-cuda-graph-split",
                                  "decode steps larger than the largest graph run eagerly, not as graph-sized "
                                  "pieces (engine/graph_pieces.py)", disable=True)
    gemv: bool = _opt(True, "--disable-gemv", "matmuls of at most 4 rows (batch-1..4 decode) through cuBLAS, not "
                      "minisgl's Triton GEMV (kernels/gemv.py; GPU, bf16/fp16 weights)", disable=True)
    pdl: bool = _opt(True, "--disable-pdl", "launch minisgl's Triton kernels in plain stream order, without "
                     "programmatic dependent launch (kernels/pdl.py; sm_90+ GPUs; process-wide, MINISGL_PDL=0 "
                     "also turns it off)", disable=True)
    # prefill/extend steps as CUDA Graphs too (with cuda_graph on, Triton attention; engine/prefill_graph.py)
    prefill_graph_max_tokens: int = _opt(4096, "--prefill-graph-max-tokens",
                                         "largest prefill/extend step (tokens) replayed as a CUDA graph; token "
                                         "buckets 16, 32, ... up to it; 0 = off")
    prefill_graph_max_reqs: int = _opt(16, "--prefill-graph-max-reqs",
                                       "most requests in a prefill/extend step replayed as a CUDA graph")
    attention_backend: str = _opt("auto", "--attention-backend", "attention kernels",
                                  choices=("auto", "torch", "triton", "flashinfer"))
    tp_size: int = _opt(1, "--tp-size", "tensor parallelism: ranks (one GPU each; gloo processes on a CPU)")
    progress: bool = False  # a progress bar in LLM.generate (no flag: `bench --quiet` sets it)

    @property
    def chunked_prefill(self) -> bool:
        """Whether long prompts are cut into chunks (the ablation switch, read-only)."""
        return self.chunked_prefill_size > 0

    @property
    def prefill_budget(self) -> int:
        """Prefill tokens one step may hold: the chunk size when chunking, else max_prefill_tokens."""
        if self.chunked_prefill_size > 0:
            return min(self.chunked_prefill_size, self.max_prefill_tokens)
        return self.max_prefill_tokens

    def with_(self, **kw) -> EngineConfig:
        return replace(self, **kw)

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.attention_backend not in ("auto", "torch", "triton", "flashinfer"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.prefill_graph_max_tokens < 0 or self.prefill_graph_max_reqs < 1:
            raise ValueError("prefill_graph_max_tokens must be >= 0 (0 = off) and prefill_graph_max_reqs >= 1")
        if self.max_running_requests is not None and (
                not isinstance(self.max_running_requests, int) or self.max_running_requests < 0):
            raise ValueError(f"max_running_requests must be an integer >= 1, or 0/None for auto, got "
                             f"{self.max_running_requests!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an integer >= 1, got {self.tp_size!r}")
        if not 0 <= self.state_snapshot_memory_fraction < 1:
            raise ValueError(f"state_snapshot_memory_fraction must be in [0, 1), got "
                             f"{self.state_snapshot_memory_fraction}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {self.state_snapshots}")
        if not isinstance(self.mixed_prefill_tokens, int) or self.mixed_prefill_tokens < 0:
            raise ValueError(f"mixed_prefill_tokens must be an integer >= 0 (0 = off), got "
                             f"{self.mixed_prefill_tokens!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")


RENAMED = {"chunked_prefill": "chunked_prefill was folded into chunked_prefill_size: pass chunked_prefill_size=0 "
                              "(command line: --chunked-prefill-size 0) to turn chunked prefill off"}


def make_config(model: str, **switches) -> EngineConfig:
    """EngineConfig(model, **switches), with a clear error for a switch that was renamed."""
    for old, message in RENAMED.items():
        if old in switches:
            raise TypeError(message)
    return EngineConfig(model=model, **switches)


# --- the command line, generated from the fields above ---------------------------------------------------
def _flag_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if "flags" in f.metadata]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (SGLang's names: --disable-overlap-schedule, --chunked-prefill-size,
    ...). Flags left out stay None, so EngineConfig's defaults are the only defaults."""
    group = parser.add_argument_group("engine")
    for f in _flag_fields():
        meta = f.metadata
        if f.name == "model":
            group.add_argument(*meta["flags"], dest="model", required=True, help=meta["help"])
        elif meta["disable"]:
            group.add_argument(*meta["flags"], dest=f.name, action="store_const", const=False, default=None,
                               help=meta["help"])
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            group.add_argument(*meta["flags"], dest=f.name, type=kind, default=None, choices=meta["choices"],
                               help=f"{meta['help']} (default: {f.default})")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments (all but `model`) given on the command line."""
    return {f.name: getattr(args, f.name) for f in _flag_fields()
            if f.name != "model" and getattr(args, f.name, None) is not None}
