"""Engine settings. Every optimisation is a named switch, so an ablation is a flag, not an edit.

Each field also carries its command-line flag (SGLang's name where SGLang has the setting), so the one flag
set of `python -m minisgl {generate,bench,serve}` is generated from this class: `add_engine_args` adds the
flags to a parser, `engine_kwargs_from_args` reads back the ones given (unset flags keep the defaults here).
`KernelOptions`, how minisgl's own kernels run, is one field of it (`kernels`), its flags generated the same way;
`make_config` also takes each kernel option by name.

Sizes left to the engine: `num_pages` None and `max_running_requests` 0/None are sized at start-up from the
device's memory (engine/model_runner.py, engine/sizing.py); an explicit value always wins. The engine's own
config (`Engine.config`, `LLM.config`) carries the resolved `max_running_requests`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field, replace

from minisgl.environment import kernel_option_defaults
from minisgl.errors import ConfigError


def _opt(default, flag: str | tuple[str, ...], help: str, *, disable: bool = False, enable: bool = False,
         choices=None):
    """A field with its command-line flag(s). disable=True: a bool switch that is on by default, turned off
    by `--disable-...` (SGLang's spelling); enable=True: one that is off by default, turned on by `--enable-...`."""
    flags = (flag,) if isinstance(flag, str) else flag
    return field(default=default, metadata={"flags": flags, "help": help, "disable": disable, "enable": enable,
                                            "choices": choices})


# --- kernel options: how minisgl's own kernels run (kernels/); one set per engine -------------------------
@dataclass(frozen=True)
class SamplerLaunch:
    """Launch shapes of the fused sampler (kernels/sampling.py). The same for every batch size on purpose: a row's
    top-p weight is summed in an order set by the chunk and block sizes, and a row's token must never depend on
    the batch it is in. lab/tune/sampling.py times the alternatives; the defaults are its pick on an H200.
    The stats block divides the chunk; the search and draw blocks divide the stats block."""

    chunk: int = 4096
    stats_block: int = 1024
    search_block: int = 256
    search_warps: int = 4
    draw_block: int = 1024
    draw_warps: int = 4


@dataclass(frozen=True)
class GdnLaunch:
    """Launch settings of the Gated DeltaNet kernels (kernels/gdn.py; lab/checks/gdn.py sweeps them).

    conv_*: channel block / token block / warps of the conv kernels; decode_block_v (0: by batch size) /
    decode_warps: the recurrent kernel on a decode step; prefill: "chunked" or "recurrent"; prepare_solve: the
    chunk prepare's triangular solve, "rows" (one row a step, up to 63 steps) or "blocks" (16-token blocks, up to
    15 steps, merged by two fp32 block products each: kernels/gdn.py); prepare_warps,
    chunk_block_v (0: by batch size) / chunk_warps / chunk_stages: the chunked path's two kernels (one stage:
    compiled for sm_90, deeper pipelining of the chunk loop took 150-260 KB of shared memory and spilled more);
    recurrent_block_v / recurrent_warps: the recurrent kernel on a prefill; dot_precision: the chunked kernels'
    fp32 tl.dot ("tf32", "tf32x3" or "ieee"); conv_search_steps: binary-search steps the varlen conv kernel
    and the chunk prepare compile in (their rows / chunks find their sequence in cu_seqlens). A compile-time
    constant, so each distinct value is a Triton compile. 0 = exactly the steps the batch needs, ceil(log2 N):
    a new compile the first time a step holds 17+, 33+, 65+, 129+, 257+ sequences (about 2 s each for sm_90 on a
    2-core CPU,
    reports/cpu/w1_host_study.json), which W1's timed run hit five times (its warm-up and the prefill graphs reach
    N = 16). A fixed count (default 16: N up to 65,536) is one variant for every batch; the extra steps are
    no-ops (`lo < hi` is false once the search converged, and their loads are masked), a few integer ops per row.
    A batch needing more steps than this takes the exact count."""

    conv_decode_block_c: int = 256
    conv_decode_warps: int = 4
    conv_block_c: int = 128
    conv_block_t: int = 32
    conv_warps: int = 4
    decode_block_v: int = 0
    decode_warps: int = 4
    prefill: str = "chunked"
    prepare_warps: int = 8
    prepare_solve: str = "rows"
    chunk_block_v: int = 0
    chunk_warps: int = 4
    chunk_stages: int = 1
    recurrent_block_v: int = 32
    recurrent_warps: int = 4
    dot_precision: str = "tf32"
    conv_search_steps: int = 16


@dataclass(frozen=True)
class KernelOptions:
    """How minisgl's Triton kernels run: the A/B switches of the GPU path and the launch tables the tuning scripts
    sweep. Each engine carries its own (`EngineConfig.kernels`) and its model runner applies them to every
    launch of that engine, its captured CUDA graphs included (kernels/context.py), so two engines with different
    options can share a process. The defaults below are the measured best; the environment may change a
    default (minisgl/environment.py), an option given to the engine always wins."""

    pdl: bool = _opt(True, "--disable-pdl", "launch minisgl's Triton kernels in plain stream order, without "
                     "programmatic dependent launch (kernels/pdl.py; sm_90+ GPUs)", disable=True)
    decode_fused_store: bool = _opt(True, "--disable-decode-fused-store",
                                    "a decode step stores its K/V with a launch of its own instead of inside the "
                                    "decode attention kernel (kernels/attention.py)", disable=True)
    decode_fused_merge: bool = _opt(False, "--enable-decode-fused-merge",
                                    "merge the decode attention's splits in its first launch (the last program "
                                    "of a request merges) instead of a second launch (kernels/attention.py)",
                                    enable=True)
    gemv_norm_fold: bool = _opt(True, "--disable-gemv-norm-fold",
                                "a decode step's RMSNorms run in launches of their own, not folded into the GEMVs "
                                "around them (folded: each residual add in the GEMV before, each norm in the GEMV "
                                "after; two launches a layer fewer, the same tokens; kernels/gemv.py, GemvNormLayer; "
                                "dense models, one GPU). Folded: W2 TPOT 0.962 -> 0.935 ms (-2.9%) on Qwen3-0.6B on an "
                                "H100 (reports/h100/run29)", disable=True)
    gemv_fold_sum_squares: bool = _opt(True, "--disable-gemv-fold-sum-squares",
                                       "with the norm fold, every program of the GEMV after a norm reads the whole "
                                       "row and sums its squares first, instead of the GEMV that writes the residual "
                                       "stream adding them up in its epilogue (fp64 atomics into a buffer the step's "
                                       "first launch zeroes; kernels/gemv.py, FoldSums; the same tokens). Handed on: "
                                       "W2 TPOT 0.932 -> 0.911 ms on Qwen3-0.6B, 5.963 -> 5.658 ms on Qwen3-8B (off: "
                                       "5.716, unfolded) on an H100 (reports/h100/run31)", disable=True)
    gemv_act_epilogue: bool = _opt(True, "--disable-gemv-act-epilogue",
                                   "a decode MLP's SiLU-and-mul in the prologue of its down GEMV, where every "
                                   "program reads the whole [gate | up] row and computes the activation of all of "
                                   "it, instead of in the epilogue of its gate_up GEMV (each program owns gate rows "
                                   "and their up rows and writes their activation once; kernels/gemv.py; the same "
                                   "tokens). Epilogue: W2 TPOT 0.929 / 0.918 -> 0.904 / 0.904 ms on Qwen3-0.6B, "
                                   "5.761 -> 5.744 ms on Qwen3-8B on an H100 (reports/h100/run32)", disable=True)
    gemv_prefetch: bool = _opt(False, "--enable-gemv-prefetch",
                               "each program of a decode GEMV whose K loop runs twice or more issues its next "
                               "weight tile's load before multiplying the current one (register double buffering; "
                               "kernels/gemv.py; the same sums in the same order; Qwen3-8B's step 2.6% slower on an "
                               "H100 at 1,024-wide tiles, reports/h100/run33)", enable=True)
    gemv_stages: int = _opt(1, "--gemv-stages",
                            "stages of the decode GEMV's K loop (the weight tiles after the early ones) pipelined "
                            "through shared memory, 1-4: with 2 or more each program keeps that many tiles' loads "
                            "in flight (Triton's cp.async pipelining) instead of waiting on each one; where the "
                            "loop runs twice or more, and not with gemv_prefetch (kernels/gemv.py; the same sums in "
                            "the same order); 1 until timed on a GPU")
    gemv_mlp_prefetch_mb: int = _opt(0, "--gemv-mlp-prefetch-mb",
                                     "MiB of a decode layer's MLP weights (gate/up, then down) its o_proj GEMV asks "
                                     "L2 for before its PDL wait, while the attention runs and HBM idles, so the "
                                     "MLP's GEMVs read them from L2; 0 = off (sm_90+, PDL launches; kernels/gemv.py, "
                                     "\"The MLP's L2 prefetch\"; the same sums)")
    mixed_decode_split: bool = _opt(True, "--disable-mixed-decode-split",
                                    "a mixed step's decode rows go through the extend kernel with the prefill "
                                    "chunks instead of the decode kernel (attention/triton_backend.py)",
                                    disable=True)
    early_metadata: bool = _opt(True, "--disable-early-metadata",
                                "the decode kernels and RoPE read the step's metadata after their PDL wait, not "
                                "before it (each request's length, table row, new slot and first key slots; each "
                                "token's position and cos/sin; kernels/attention.py). On: W2 TPOT 1.066 -> 1.017 "
                                "ms on an H100, the same tokens (reports/h100/run24)", disable=True)
    early_kv: bool = _opt(True, "--disable-early-kv",
                          "the decode kernel reads its first key tile's keys and values after its PDL wait, not "
                          "before it (on, with the early metadata and the fused store: the new token's row taken "
                          "from registers; kernels/attention.py, \"The early keys\"). On: W2 TPOT 0.869 -> 0.858 ms "
                          "on Qwen3-0.6B, 4.61 -> 4.55 ms on Qwen3-8B on an H200, the same tokens (reports/h200/run25)",
                          disable=True)
    decode_prefetch_next_kv: bool = _opt(False, "--enable-decode-prefetch-next-kv",
                                         "each decode program of a layer asks L2, before its PDL wait, for the next "
                                         "layer's keys and values at its first key tile's slots (the same positions), "
                                         "so that layer's early reads find them in L2 rather than queued behind the "
                                         "GEMVs' weight stream (with the early metadata; kernels/attention.py, \"The "
                                         "next layer's keys\"; the same sums); off until timed on a GPU", enable=True)
    decode_fused_rope: bool = _opt(True, "--disable-decode-fused-rope",
                                   "a decode step's RoPE, and Qwen3's per-head q/k norms, run in a launch of their "
                                   "own before the decode attention kernel, not inside it (on: one launch a layer "
                                   "fewer; attention/fused_rope.py; the Triton backend, whole-head rotary). With "
                                   "early_kv, on: W2 TPOT 1.011 / 1.005 -> 0.961 / 0.964 ms on Qwen3-0.6B on an "
                                   "H100, the same tokens (reports/h100/run28)", disable=True)
    decode_megakernel: bool = _opt(False, "--enable-decode-megakernel",
                                   "a one-row decode step runs every decoder layer in one persistent kernel, six "
                                   "phases a layer with grid barriers between, instead of ~9 launches a layer "
                                   "(kernels/decode_layers.py; Qwen3-style dense models, one GPU, the Triton "
                                   "backend; off: slower than the launches on an H100 and 1.3% off their output, "
                                   "reports/h100/run28)", enable=True)
    decode_megakernel_regs: int = _opt(0, "--decode-megakernel-regs",
                                       "registers a thread the decode-layers kernel may use, 0: as many as the "
                                       "compiler takes; fewer let more programs share an SM, spilling the rest "
                                       "(kernels/decode_layers.py)")
    extend_tiles: bool = _opt(True, "--disable-extend-tiles",
                              "the extend attention kernel runs a grid over every request and the longest extend "
                              "(a prefill graph's: its buckets') instead of one program per real block of new "
                              "tokens from a list the host makes each step (kernels/attention.py). On, a prefill "
                              "graph's grid grows with its tokens, not with its requests times its tokens: what "
                              "lets the defaults capture a burst's mixed steps (prefill_graph_max_tokens)",
                              disable=True)
    gemv_configs: str | None = _opt(None, "--gemv-configs",
                                    "the GEMV's tile table, a JSON file as lab/tune/gemv.py writes it "
                                    "(default: the GPU's table in kernels/gemv_tuned/, if any)")
    gemv_pdl_early_tiles: int = _opt(2, "--gemv-pdl-early-tiles",
                                     "weight tiles the GEMV loads before its PDL wait, 0-3 (kernels/gemv.py)")
    decode_split_waves: int = _opt(2, "--decode-split-waves",
                                   "waves of SMs the decode attention's (request, kv head, split) programs fill, "
                                   "1-16: more waves, more splits of each request's keys (kernels/attention.py, "
                                   "decode_num_splits)")
    sampler_skip_blocks: bool = _opt(True, "--disable-sampler-skip-blocks",
                                     "the fused sampler reads every block of logits in every pass, not only the "
                                     "blocks that can hold a kept token (kernels/sampling.py; exact either way)",
                                     disable=True)
    sampler_top_k_bound: bool = _opt(True, "--disable-sampler-top-k-bound",
                                     "the fused sampler's top-k search starts from -inf instead of the k-th "
                                     "largest block maximum (kernels/sampling.py; exact either way)", disable=True)
    sampler_fused_ends: bool = _opt(True, "--disable-sampler-fused-ends",
                                    "the fused sampler's rows' settings (flags, 1 / T, seed hashes) and its last "
                                    "reduction (with the token's write into the token table) are torch operations, "
                                    "about thirty small launches a sampled step, not two kernels; a greedy decode "
                                    "graph takes torch's argmax and table write instead of the sampler's draw pass "
                                    "and pick (kernels/sampling.py; the same tokens either way). On: W2 TPOT -1.9%, W2 "
                                    "top-k/top-p -8.1% on Qwen3-0.6B on an H100 (reports/h100/run36)", disable=True)
    sampler_fused_narrow: bool = _opt(True, "--disable-sampler-fused-narrow",
                                      "the top-k/top-p search's narrowing after each pass runs in a launch of its "
                                      "own instead of in the pass's last program to finish (a ticket per row; on: 8 "
                                      "launches fewer a sampled step with both cuts, the same tokens; "
                                      "kernels/sampling.py). On: W2 top-k/top-p TPOT 0.820 / 0.823 -> 0.817 / 0.817 "
                                      "ms on Qwen3-0.6B, 5.509 -> 5.506 ms on Qwen3-8B on an H100 "
                                      "(reports/h100/run38)", disable=True)
    zero_copy_io: bool = _opt(True, "--disable-zero-copy-io",
                              "a staged decode step's inputs reach the GPU by a copy of their pinned block, a "
                              "scatter and a gather, and a step's tokens come back by a copy, all through the copy "
                              "engine, instead of one kernel reading the pinned block and one writing the tokens "
                              "into pinned memory (kernels/staging.py: no hand-over between the copy and compute "
                              "engines at a step's boundary). On: W2 TPOT 0.758 -> 0.745 ms on Qwen3-0.6B on an H100, "
                              "the same tokens (reports/h100/run36)", disable=True)
    # launch tables (no flags: the tuning scripts set them from Python)
    norm_configs: tuple[tuple[int, int, int], ...] = ()  # (padded row length, rows per program, warps) overrides
    sampler_launch: SamplerLaunch = SamplerLaunch()
    gdn: GdnLaunch = GdnLaunch()
    # CPU tensors through the Triton kernels too; only works under TRITON_INTERPRET=1 (how the kernels are tested)
    triton_on_cpu: bool = False

    def validate(self) -> None:
        if not 0 <= self.gemv_pdl_early_tiles <= 3:
            raise ValueError(f"gemv_pdl_early_tiles must be in 0..3, got {self.gemv_pdl_early_tiles}")
        if self.decode_megakernel_regs and not 64 <= self.decode_megakernel_regs <= 255:
            raise ValueError(f"decode_megakernel_regs must be 0 or in 64..255, got {self.decode_megakernel_regs}")
        if not 1 <= self.gemv_stages <= 4:
            raise ValueError(f"gemv_stages must be in 1..4, got {self.gemv_stages}")
        if not 0 <= self.gemv_mlp_prefetch_mb <= 1024:
            raise ValueError(f"gemv_mlp_prefetch_mb must be in 0..1024, got {self.gemv_mlp_prefetch_mb}")
        if not 1 <= self.decode_split_waves <= 16:
            raise ValueError(f"decode_split_waves must be in 1..16, got {self.decode_split_waves}")
        if self.gdn.prefill not in ("chunked", "recurrent"):
            raise ValueError(f"gdn.prefill must be 'chunked' or 'recurrent', got {self.gdn.prefill!r}")
        if self.gdn.prepare_solve not in ("rows", "blocks"):
            raise ValueError(f"gdn.prepare_solve must be 'rows' or 'blocks', got {self.gdn.prepare_solve!r}")
        if self.gdn.dot_precision not in ("tf32", "tf32x3", "ieee"):
            raise ValueError(f"gdn.dot_precision must be 'tf32', 'tf32x3' or 'ieee', got {self.gdn.dot_precision!r}")
        launch = self.sampler_launch
        if launch.chunk % launch.stats_block or launch.stats_block % launch.search_block \
                or launch.stats_block % launch.draw_block:
            raise ValueError(f"sampler_launch: the stats block must divide the chunk and the search and draw "
                             f"blocks the stats block, got {launch}")


def default_kernel_options() -> KernelOptions:
    """KernelOptions() with the environment's defaults (minisgl/environment.py) applied."""
    return KernelOptions(**kernel_option_defaults())


KERNEL_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(KernelOptions))


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
        "row costs, 256..1024 (fewer where memory is short; hybrid models: their state counted; engine/sizing.py)")
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
    graph_staged_inputs: bool = _opt(True, "--disable-graph-staged-inputs",
                                     "a decode graph's inputs reach its fixed buffers by a device copy each, as "
                                     "notebook 06 writes them, not by one copy of a block the graphs read "
                                     "(engine/staged_graph.py; Qwen3.5's state slots too). Staged: W2 TPOT 0.800 "
                                     "-> 0.770 ms (median of four) on Qwen3-0.6B on an H100, the same tokens "
                                     "(reports/h100/run35)", disable=True)
    gemv: bool = _opt(True, "--disable-gemv", "matmuls of at most 4 rows (batch-1..4 decode) through cuBLAS, not "
                      "minisgl's Triton GEMV (kernels/gemv.py; GPU, bf16/fp16 weights)", disable=True)
    # prefill/extend steps as CUDA Graphs too (with cuda_graph on, Triton attention; engine/prefill_graph.py)
    # 8,704 = a full 8,192-token chunk beside 512 decode rows: a server's burst runs mixed steps of that shape, and
    # eagerly each spent 13-18 ms launching ~200 kernels from Python, 49 ms a turn in the server against 25 ms as
    # a graph (reports/h200/run25: the burst's tok/s +16%, median TTFT 1,561 -> 856 ms; on an H100 run24 +1.1%
    # and -3.6%; offline the mix ran 1% slower, the padding to a bucket). 66 graphs: 2.1 s and 296 MiB to
    # capture on Qwen3-0.6B, against 36, 1.0 s and 174 MiB at 4,096 x 64.
    prefill_graph_max_tokens: int = _opt(8192 + 512, "--prefill-graph-max-tokens",
                                         "largest prefill/extend step (tokens) replayed as a CUDA graph; token "
                                         "buckets 16, 32, ... up to it; 0 = off")
    # more than 16: a server's mixed steps carry a prompt beside every running stream, and at 24 req/s on the H200
    # more than 16 streams ran at times; those steps went eager, took 40-55 ms on a slow host and let more streams
    # pile up (reports/h200/run22: every token gap over 10 ms fell while more than 16 requests ran)
    prefill_graph_max_reqs: int = _opt(512, "--prefill-graph-max-reqs",
                                       "most requests in a prefill/extend step replayed as a CUDA graph (request "
                                       "buckets 1, 4, 16, 64, ... up to it)")
    kernel_warmup: bool = _opt(True, "--disable-kernel-warmup",
                               "engine start compiles only what the CUDA-graph captures launch, one kernel after "
                               "another; the eager steps' Triton variants compile inside the first workload "
                               "that needs them (engine/warmup.py; on: every variant compiled at start, on a "
                               "thread pool, and the eager steps launched once)", disable=True)
    gc_freeze: bool = _opt(True, "--disable-gc-freeze",
                           "leave the start-up's Python objects to the garbage collector: the first workload's "
                           "collections walk them (0.22-0.26 s of the first W1 on the H200, run16; on: the heap "
                           "collected and frozen before the kernel warm-up and the captures, and again once start-up "
                           "ends, GPU only; `serve`'s front process freezes its own start-up heap, on any device)",
                           disable=True)
    attention_backend: str = _opt("auto", "--attention-backend",
                                  "attention kernels (auto = triton on a GPU, torch on a CPU; torch runs a decode "
                                  "step as a few padded ops, torch_loop every step one request at a time)",
                                  choices=("auto", "torch", "torch_loop", "triton", "flashinfer"))
    tp_size: int = _opt(1, "--tp-size", "tensor parallelism: ranks (one GPU each; gloo processes on a CPU)")
    cpu_threads: int = _opt(0, "--cpu-threads", "torch threads of an engine on the CPU; 0 = auto: one fewer than "
                            "the cores this process may use (at least 1; split between tensor-parallel ranks), or "
                            "torch's own count when OMP_NUM_THREADS is set. Idle, a tiny model runs as fast on 1 "
                            "thread as on 2; beside a busy process, all-core threads wait on each other (bench: "
                            "lab/checks/cpu_threads_bench.py)")
    # how minisgl's kernels run (the class above; its flags are generated with these)
    kernels: KernelOptions = field(default_factory=default_kernel_options)
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
        """Raise ConfigError (a ValueError) naming the first field whose value cannot be right on any machine;
        what depends on the machine or the model (no GPU, a broken checkpoint) is found when the engine starts."""
        def need(ok: bool, name: str, problem: str) -> None:
            if not ok:
                flags = next(f.metadata.get("flags") for f in dataclasses.fields(self) if f.name == name)
                raise ConfigError(name, f"{problem}, got {getattr(self, name)!r}", "/".join(flags or ()) or None)

        def integer(name: str, low: int | None, problem: str, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            need(isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low), name,
                 problem)

        need(isinstance(self.model, str) and self.model != "", "model", "must be a folder or a hub id")
        need(isinstance(self.device, str) and _DEVICE.fullmatch(self.device) is not None, "device",
             "must be auto, cpu, cuda or cuda:N")
        for name in ("dtype", "load_format", "attention_backend"):
            choices = next(f for f in dataclasses.fields(self) if f.name == name).metadata["choices"]
            need(getattr(self, name) in choices, name, f"must be one of {', '.join(choices)}")
        integer("page_size", 1, "must be an integer >= 1")
        integer("num_pages", 0, "must be an integer >= 1 (0 or unset: sized from memory)", optional=True)
        integer("max_model_len", 2, "must be an integer >= 2 (a prompt token and an output token; unset: the "
                "model's max_position_embeddings)", optional=True)
        integer("kv_cache_tokens", 1, "must be an integer >= 1")
        need(isinstance(self.kv_memory_fraction, (int, float)) and 0 < self.kv_memory_fraction <= 1,
             "kv_memory_fraction", "must be in (0, 1]")
        integer("max_running_requests", 0, "must be an integer >= 1, or 0/unset for auto", optional=True)
        integer("chunked_prefill_size", None, "must be an integer (<= 0: chunked prefill off)")
        integer("max_prefill_tokens", 1, "must be an integer >= 1")
        integer("mixed_prefill_tokens", 0, "must be an integer >= 0 (0 = off)")
        integer("cuda_graph_max_bs", 1, "must be an integer >= 1")
        integer("prefill_graph_max_tokens", 0, "must be an integer >= 0 (0 = off)")
        integer("prefill_graph_max_reqs", 1, "must be an integer >= 1")
        integer("tp_size", 1, "must be an integer >= 1")
        integer("cpu_threads", 0, "must be an integer >= 0 (0 = auto)")
        need(isinstance(self.state_snapshot_memory_fraction, (int, float))
             and 0 <= self.state_snapshot_memory_fraction < 1, "state_snapshot_memory_fraction", "must be in [0, 1)")
        integer("state_snapshots", 0, "must be an integer >= 0", optional=True)
        integer("seed", None, "must be an integer")
        need(isinstance(self.kernels, KernelOptions), "kernels", "must be a KernelOptions")
        try:
            self.kernels.validate()
        except ValueError as e:
            raise ConfigError("kernels", f"option {e}") from None


_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


RENAMED = {"chunked_prefill": "chunked_prefill was folded into chunked_prefill_size: pass chunked_prefill_size=0 "
                              "(command line: --chunked-prefill-size 0) to turn chunked prefill off"}


def make_config(model: str, **switches) -> EngineConfig:
    """EngineConfig(model, **switches), with a clear error for a switch that was renamed. A KernelOptions field
    may be given by name too (`pdl=False`): it goes into `kernels`, on top of `kernels=` if that is given."""
    for old, message in RENAMED.items():
        if old in switches:
            raise TypeError(message)
    kernel = {k: switches.pop(k) for k in list(switches) if k in KERNEL_OPTION_NAMES}
    if kernel:
        switches["kernels"] = replace(switches.get("kernels") or default_kernel_options(), **kernel)
    return EngineConfig(model=model, **switches)


# --- the command line, generated from the fields above ---------------------------------------------------
def _flag_fields() -> list[dataclasses.Field]:
    return [f for cls in (EngineConfig, KernelOptions) for f in dataclasses.fields(cls) if "flags" in f.metadata]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig and KernelOptions field that has one (SGLang's names: --disable-overlap-schedule,
    --chunked-prefill-size, ...). Flags left out stay None, so the classes' defaults are the only defaults."""
    group = parser.add_argument_group("engine")
    for f in _flag_fields():
        meta = f.metadata
        text = meta["help"].replace("%", "%%")  # argparse %-formats help: "1.1% slower" must stay text
        if f.name == "model":
            group.add_argument(*meta["flags"], dest="model", required=True, help=text)
        elif meta["disable"] or meta.get("enable"):
            group.add_argument(*meta["flags"], dest=f.name, action="store_const", const=bool(meta.get("enable")),
                               default=None, help=text)
        else:
            kind = int if "int" in str(f.type) else float if "float" in str(f.type) else str
            group.add_argument(*meta["flags"], dest=f.name, type=kind, default=None, choices=meta["choices"],
                               help=f"{text} (default: {f.default})")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """The keyword arguments of `make_config` (all but `model`) given on the command line; kernel options by
    their field names (make_config puts them in `kernels`)."""
    return {f.name: getattr(args, f.name) for f in _flag_fields()
            if f.name != "model" and getattr(args, f.name, None) is not None}
