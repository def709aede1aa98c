"""Kernel warm-up at engine start: every Triton kernel variant the engine can launch is compiled before the first
request, so no user's first workload pays for a compile (issue 29).

Why. Triton compiles a kernel once per *variant*: its compile-time constants (the decode attention's split count
NUM_SPLITS, FUSED_STORE/FUSED_MERGE, block sizes, the sampler's CUTS, the GEMV's ROWS, ...), the dtypes of its
arguments, and its specialisation on the argument values: an integer argument equal to 1 or a multiple of 16, a
pointer 16-byte aligned or not. A compile costs 1-3 s on a fresh machine (no disk cache). The CUDA-graph captures
compile what they record (decode steps of every captured batch size and sampler, prefill steps of every token and
request bucket), serially; what launches eagerly later compiled inside the first workload that needed it.

The kernels, what varies at run time, and who compiled it before this module (G: the graph captures; E: eager,
inside a workload):

- attention `_decode_stage1_kernel`/`_decode_stage2_kernel`: NUM_SPLITS = decode_num_splits(batch, Hkv, context,
  SMs) and BLOCK_S from it, FUSED_STORE/FUSED_MERGE (kernel options), IEEE_DOT (fp32), the merge counters'
  alignment (B * Hkv elements from the workspace's end; fused merge only, since the counters of an unfused
  launch are now an aligned placeholder). G: each graph batch size; E: mixed steps' decode rows, decode beyond
  the graphs. `_extend_kernel`: tiles by head dim and dtype, first_row not specialised: G (prefill graphs).
- elementwise norms, RoPE, SiLU-and-mul, sigmoid gate, K/V store: shapes fixed by the model, row counts not
  specialised: G. GEMV `_gemv_kernel`: ROWS 1-4: G (1, 2, 4), E (3 rows: prefill graphs off, graphs off).
- Gated DeltaNet: `_gdr_recurrent_kernel`/`_gdr_chunk_kernel` BLOCK_V by batch/request count (16 or 32), the
  decode (T == N) or chunked path, the conv kernels (search steps fixed): G for the graphs' counts, E beyond.
- sampler `_stats/_init/_search/_narrow_kernel`: the row count (an integer argument: 1, a multiple of 16, other),
  PHASE/FIRST; `_draw_kernel`: CUTS: G (batch sizes 1, 2, 16...). Penalty and grammar-mask kernels: E only (the
  penalty values' rows are now on 16-byte boundaries: one variant for any count).

What the engine launches eagerly, and so is warmed here (on scratch inputs, `eager_plan`):

- mixed steps (chunked prefill with decode rows riding along; more requests than the prefill graphs hold): their
  n decode rows go through the decode kernel as a batch of the next power of two (attention/triton_backend.py),
  so a variant per split count of that batch and per alignment of the pointers n elements past an aligned one
  (the fused merge's counters): `mixed_decode_rows`;
- prefill steps beyond the prefill graphs (more tokens or requests): the sampler compiles per row count class
  (its row count is an integer argument), the Gated DeltaNet kernels pick their value block by the request count:
  `prefill_requests`, plus one step of the whole prefill budget;
- decode steps no graph serves (CUDA graphs off, or larger than the largest graph: split off, or a step whose
  logits are processed): a variant per split count (`split_groups`), GEMV row count (1-4) and size class:
  `eager_decode_sizes`;
- logits processing: the penalty, grammar-mask and logprob kernels;
- a staged decode step's boundary (kernels/staging.py): the kernel that stages its inputs, launched outside the
  graphs at every staged step, and the tokens' copy to the host (`_run_boundary`).

How, in three phases:

1. discovery: the graphs' steps and the eager steps run once with Triton's `jit_cache_hook` answering "skip" for
   every kernel not compiled yet: the kernel is neither compiled nor launched, its specialisation is recorded, and a
   placeholder that launches nothing takes its place in the JIT cache until discovery ends (`_Skipped`).
   (A kernel already compiled launches for real; it reads the skipped kernels' unwritten outputs, which only
   ever flow into values, never into addresses.)
2. compile: every recorded variant is compiled on a thread pool (`triton.AsyncCompileMode`, `JITFunction.preload`).
   Safe: it is Triton's own API for compiling on an executor. Each compile builds its own MLIR context and LLVM
   module, writes the disk cache through a temporary file and an atomic rename, and touches no GPU (a kernel's
   module is loaded at its first launch, on the engine's thread); the compiled kernels enter the JIT caches on
   this thread when the block ends. Worth it: the Python front end holds the GIL, but LLVM's code generation
   releases it and ptxas is a child process, so the threads overlap most of a compile. Then each compiled
   kernel's launcher (a C module Triton builds with gcc at a kernel's first launch, on the launching thread) is
   built on the pool too (`build_launchers`).
3. launch: the eager steps run again for real (CUDA modules loaded, cuBLAS and the memory pool warmed; anything
   phase 1 missed compiles here, and is logged as late). The graph captures that follow find their kernels
   compiled.

State. Every step reads request row 0 and writes its K/V to the reserved slot 0 (page 0) and a hybrid's
linear-attention state to the pool's dummy slot, as a graph's padded rows do; page 0 and the dummy slot are saved
before and restored after, so the engine's pools come out bit-for-bit as they went in. Nothing else is written:
the sampled tokens are dropped, the penalty counts are a scratch table.

Never fatal: any exception is logged once as a warning and the engine starts without the warm-up (what is left
compiles when first launched, as before). Off with `kernel_warmup=False` (`--disable-kernel-warmup`). On a CPU it
does nothing: the kernels there are torch ops (Triton runs only for CUDA tensors), so there is nothing to compile.
Under tensor parallelism it is skipped: every step is a collective, and a warm-up that failed on one rank only
would leave the others waiting.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from minisgl.engine.cuda_graph import default_batch_sizes
from minisgl.engine.logits_processing import LogitsProcessing, process_logits
from minisgl.engine.sampler import SamplingTensors, sample
from minisgl.kernels.attention import decode_num_splits
from minisgl.kernels.options import current_options
from minisgl.sampling_params import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

MIXED_PREFILL_TOKENS = 16  # the prefill request of a warm-up mixed step
PREFILL_TOKENS = 16  # tokens per request of a warm-up prefill step (>= 2: T == N would be a hybrid's decode)


# --- the plan: pure functions of the engine's numbers ---------------------------------------------------------


def variant_classes(sizes: Iterable[int]) -> list[int]:
    """The fewest of `sizes` covering every class Triton may compile a separate variant for when an integer
    argument, or a pointer's offset in elements of 4+ bytes, grows with the size: equal to 1, a multiple of 16,
    and each residue mod 4 (n such elements past a 16-byte aligned pointer stay aligned iff 4 divides n)."""
    seen: dict[tuple[bool, bool, int], int] = {}
    for n in sorted(set(sizes)):
        seen.setdefault((n == 1, n % 16 == 0, n % 4), n)
    return sorted(seen.values())


def split_groups(sizes: Iterable[int], num_kv_heads: int, max_context_len: int, num_sms: int) -> dict[int, list[int]]:
    """Decode batch sizes grouped by the decode kernel's split count (NUM_SPLITS, a compile-time constant):
    {split count: sizes}. The keys are every split count these sizes launch with on this model and card."""
    groups: dict[int, list[int]] = {}
    for bs in sizes:
        groups.setdefault(decode_num_splits(bs, num_kv_heads, max_context_len, num_sms), []).append(bs)
    return groups


def mixed_decode_rows(max_rows: int) -> list[int]:
    """Decode-row counts n of a mixed step to warm (n <= max_rows). The rows run as a decode batch of the next
    power of two p (one split count per p); within each (p/2, p], one n per variant class."""
    out, p = [], 1
    while p // 2 < max_rows:
        out += variant_classes(range(p // 2 + 1, min(p, max_rows) + 1))
        p *= 2
    return out


def prefill_requests(max_reqs: int) -> list[int]:
    """Request counts of the warm-up prefill steps: one per variant class (the sampler's row count), and the
    most (the Gated DeltaNet kernels' value block is chosen by the request count: the extremes cover both)."""
    return sorted(set(variant_classes(range(1, max_reqs + 1))) | {max(max_reqs, 1)})


def eager_decode_sizes(lo: int, hi: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> list[int]:
    """Batch sizes lo..hi of the decode steps no graph serves: the variant classes of each split count, every
    size up to 4 (the GEMV compiles per row count) and the largest (value block choices, as above)."""
    if hi < lo:
        return []
    sizes = range(lo, hi + 1)
    out = {n for n in sizes if n <= 4} | {hi}
    for group in split_groups(sizes, num_kv_heads, max_context_len, num_sms).values():
        out |= set(variant_classes(group))
    return sorted(out)


@dataclass(frozen=True)
class Step:
    """A warm-up step: each request's new tokens (from position 0), and whether it is a decode step."""

    label: str
    extend: tuple[int, ...]
    decode: bool = False


def eager_plan(max_rows: int, prefill_budget: int, max_model_len: int, graph_max_bs: int, num_kv_heads: int,
               max_context_len: int, num_sms: int) -> list[Step]:
    """The eager steps to warm (see the module docstring). `graph_max_bs` 0: no decode graphs."""
    steps = [Step(f"mixed{n}", (1,) * n + (MIXED_PREFILL_TOKENS,)) for n in mixed_decode_rows(max_rows - 1)]
    # a few tokens: with prefill graphs off these take the GEMV (it compiles per row count, 1-4)
    steps += [Step(f"prefill_t{t}", (t,)) for t in range(1, 5)]
    most = max(1, min(max_rows, prefill_budget // PREFILL_TOKENS))
    steps += [Step(f"prefill_r{r}", (PREFILL_TOKENS,) * r) for r in prefill_requests(most)]
    whole = min(prefill_budget, max_model_len - 1)
    if whole > 1:
        steps.append(Step(f"prefill_t{whole}", (whole,)))  # the largest step: cuBLAS and the memory pool warmed
    lo = graph_max_bs + 1 if graph_max_bs else 1
    steps += [Step(f"decode{bs}", (1,) * bs, decode=True)
              for bs in eager_decode_sizes(lo, max_rows, num_kv_heads, max_context_len, num_sms)]
    return steps


# --- running steps on scratch inputs --------------------------------------------------------------------------


def _device_ints(values, device: torch.device) -> torch.Tensor:
    """A fresh int64 device tensor (16-byte aligned, as each of ModelRunner.prepare's inputs is)."""
    return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device)


def step_inputs(runner, step: Step, graph: bool = False):
    """(input ids, positions, metadata, logit indices) of `step` as ModelRunner.prepare lays them out, with every
    request on row 0, every token's K/V to the reserved slot 0 and a hybrid's state on the dummy slot. `graph`:
    a decode graph's metadata (its bound max_seq_len and no host lists, as CudaGraphRunner._meta)."""
    dev = runner.device
    ext = np.asarray(step.extend, dtype=np.int64)
    r, t = len(ext), int(ext.sum())
    start = np.zeros(r, dtype=np.int64)
    np.cumsum(ext[:-1], out=start[1:])
    positions = np.arange(t, dtype=np.int64) - np.repeat(start, ext)
    zeros_r = _device_ints(np.zeros(r), dev)
    host = None if graph else ext.tolist()
    meta = runner.runtime.metadata_cls(
        is_decode=step.decode, req_pool_indices=zeros_r, seq_lens=_device_ints(ext, dev).int(),
        prefix_lens=zeros_r.int(), extend_lens=_device_ints(ext, dev).int(),
        extend_start=_device_ints(start, dev).int(),
        out_cache_loc=_device_ints(np.zeros(t), dev),
        max_seq_len=runner.max_model_len if graph else int(ext.max()), max_extend_len=int(ext.max()),
        seq_lens_cpu=host, prefix_lens_cpu=None if graph else [0] * r, extend_lens_cpu=host)
    # the runtime's extra inputs of requests on these "rows": a hybrid's state slot is its row, so the dummy slot
    dummy = runner.state_pool.dummy_slot if runner.state_pool is not None else 0
    extra = runner.runtime.step_arrays(np.full(r, dummy, dtype=np.int64), start, t, None)
    runner.runtime.attach(meta, [_device_ints(a, dev) for a in extra])
    return _device_ints(np.zeros(t), dev), _device_ints(positions, dev), meta, _device_ints(start + ext - 1, dev)


def scratch_sampling(n: int, device: torch.device, cuts: bool) -> SamplingTensors:
    """Sampling settings of n rows with the dtypes ModelRunner.prepare gives them."""
    def f32(v): return torch.full((n,), v, dtype=torch.float32, device=device)
    def i64(v): return torch.full((n,), v, dtype=torch.int64, device=device)
    return SamplingTensors(temperatures=f32(1.0), top_ks=i64(1), top_ps=f32(1.0), seeds=i64(0), steps=i64(0),
                           all_greedy=False, any_top_k_p=cuts, min_ps=f32(0.0))


def _run_step(runner, step: Step, graph: bool = False) -> None:
    """The forward of a step and both fused samplers (plain, cuts) on its logits; the tokens are dropped. `graph`:
    as a decode graph records it (CudaGraphRunner._step: no logit indices), else as ModelRunner._forward's eager
    path."""
    input_ids, positions, meta, logit_idx = step_inputs(runner, step, graph)
    runner.attn.prepare(meta)
    logits = runner.model(input_ids, positions, runner.attn, None if graph else logit_idx)
    n = logits.shape[0]
    for cuts in (False, True):
        sample(logits, scratch_sampling(n, runner.device, cuts))
    if graph and runner.config.graph_staged_inputs and current_options().sampler_fused_ends:
        # the staged graphs' ends (StagedCudaGraphRunner._finish) add two variants to what `sample` launched above:
        # a greedy graph's draw without noise, and the pick that writes a token table (the same pick ends a sampled
        # graph: its variant does not depend on the cuts). A scratch table here.
        from minisgl.kernels import sampling as fused
        table = torch.zeros(n, dtype=torch.int64, device=runner.device)
        fused.fused_greedy(logits, table, torch.arange(n, dtype=torch.int64, device=runner.device))


def _run_boundary(runner) -> None:
    """The kernels of a staged decode step's boundary (kernels/staging.py, kernel option zero_copy_io) on scratch
    tensors: the inputs' kernel (no integer argument specialised: one variant) and the tokens' copy."""
    from minisgl.kernels import staging
    dev = runner.device
    host, block = (torch.zeros(4, 8, dtype=torch.int64, device=dev) for _ in range(2))
    table = torch.zeros(8, dtype=torch.int32, device=dev)
    staging.stage_in(host, block, 1, (1, 2, 1), table, (3, torch.zeros(8, dtype=torch.int64, device=dev),
                                                       torch.zeros(1, dtype=torch.int64, device=dev)))
    staging.copy_to_host(torch.zeros(1, dtype=torch.int64, device=dev))


def _run_processing(runner) -> None:
    """The penalty and grammar-mask kernels (engine/logits_processing.py) on scratch logits and counts, laid out as
    ModelRunner.processing lays them out; the logprob kernels at each of their top-N sizes."""
    dev, vocab = runner.device, runner.model_config.vocab_size
    logits = torch.zeros(4, vocab, dtype=runner.dtype, device=dev)
    table = SimpleNamespace(counts=torch.zeros(4, vocab, dtype=torch.int32, device=dev))
    for p in range(1, 5):
        floats = torch.ones(3, p + (-p) % 4, dtype=torch.float32, device=dev)
        rows = _device_ints(np.arange(p), dev)
        proc = LogitsProcessing(penalty_rows=rows, penalty_slots=rows, frequency=floats[0, :p],
                                presence=floats[1, :p], repetition=floats[2, :p], mask_rows=rows, mask_rows_host=[],
                                bitmask=torch.full((p, (vocab + 31) // 32), -1, dtype=torch.int32, device=dev))
        process_logits(logits, proc, table)
    from minisgl.kernels import sampling as fused
    rows, tokens = _device_ints(np.arange(4), dev), torch.zeros(4, dtype=torch.int64, device=dev)
    for top in fused.LOGPROB_TOPS:  # top_n is not specialised: one variant per kept-per-chunk size
        fused.token_logprobs_packed(logits, rows, tokens, min(top, MAX_TOP_LOGPROBS))


# --- Triton: discovery hook and parallel compile ---------------------------------------------------------------


@dataclass
class _Record:
    skip: bool  # discovery: neither compile nor launch what is not compiled yet
    found: dict = field(default_factory=dict)  # (id(kernel), cache key) -> (name, JITFunction, specialization)
    placeholders: list = field(default_factory=list)  # (JITFunction, device, cache key) of each _SKIPPED left


class _Skipped:
    """What discovery leaves in a kernel's JIT cache for a variant it has recorded: launching it does nothing. Without
    it, every later launch of that variant (each layer's norm, each layer's GEMVs: ~300 launches a forward) misses
    the cache again, and Triton packs its arguments and serialises its specialisation for the hook every time; with
    it they are cache hits. Triton 3.6's JITFunction.run calls `launch_metadata` and `run` on what the cache holds
    and reads `function` and `packed_metadata`. Taken out again when discovery ends, before anything compiles."""

    function = packed_metadata = None

    def launch_metadata(self, *args) -> None:
        return None

    def run(self, *args) -> None:
        record = _RECORD.get()
        if record is None or not record.skip:  # a launch that must run: never pass it off as done
            raise RuntimeError("a kernel warm-up placeholder was launched outside discovery")


_SKIPPED = _Skipped()


_RECORD: contextvars.ContextVar[_Record | None] = contextvars.ContextVar("minisgl_warmup_record", default=None)


def _triton_parallel() -> str | None:
    """None when the installed Triton has every name the discovery and the compile use, as Triton 3.6 has them
    (knobs.py, runtime/jit.py, runtime/_async_compile.py): `knobs.runtime.jit_cache_hook`, called on a JIT
    cache miss with key=, fn= (a JitFunctionInfo: `.jit_function`) and compile= (with "specialization_data");
    `AsyncCompileMode(executor, *, ignore_errors)`; `JITFunction.preload`. Else why not (the eager steps then
    compile what they launch, serially)."""
    try:
        import triton
    except ImportError:
        return "Triton is not installed"
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction, JitFunctionInfo
        ok = (hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")
              and "jit_function" in JitFunctionInfo.__dataclass_fields__
              and "specialization_data" in knobs.JITHookCompileInfo.__annotations__
              and "ignore_errors" in inspect.signature(triton.AsyncCompileMode).parameters)
    except (ImportError, AttributeError, TypeError, ValueError):
        ok = False
    return None if ok else f"Triton {triton.__version__} lacks the jit_cache_hook / AsyncCompileMode / preload of 3.6"


@contextlib.contextmanager
def _hook_installed() -> Iterator[None]:
    """Triton's jit_cache_hook (process-wide) while the block runs: it acts only in a context where _RECORD is set
    (this thread's warm-up) and hands every other call to the hook that was there before."""
    from triton import knobs
    before = knobs.runtime.jit_cache_hook

    def hook(*args, **kwargs):
        record = _RECORD.get()
        if record is None:
            return before(*args, **kwargs) if before is not None else None
        fn, key, device = kwargs["fn"].jit_function, kwargs["key"], kwargs["compile"]["device"]
        record.found.setdefault((id(fn), key), (fn.__name__, fn, kwargs["compile"]["specialization_data"]))
        if record.skip:
            fn.device_caches[device][0][key] = _SKIPPED
            record.placeholders.append((fn, device, key))
        return record.skip

    knobs.runtime.jit_cache_hook = hook
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = before


@contextlib.contextmanager
def _recording(skip: bool) -> Iterator[_Record]:
    record = _Record(skip)
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)
        for fn, device, key in record.placeholders:  # no placeholder outlives discovery
            cache = fn.device_caches[device][0]
            if cache.get(key) is _SKIPPED:
                del cache[key]


def compile_workers(n: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, cores))


def _precompile(found: dict) -> tuple[Counter, int, int]:
    """Compile the recorded variants on a thread pool, then build their launchers there too; (compiled per kernel,
    failed, launchers that failed). A variant that fails here is left to compile at its first launch, where its
    error (if any) surfaces as it always did; a launcher that fails, to be built there."""
    from concurrent.futures import ThreadPoolExecutor

    import triton

    workers = compile_workers(len(found))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minisgl-compile") as pool, \
            triton.AsyncCompileMode(pool, ignore_errors=True):
        for _, fn, spec in found.values():
            with contextlib.suppress(Exception):
                fn.preload(spec)
    # what reached the kernels' JIT caches (a compile that failed in its thread is dropped by ignore_errors)
    kernels = {(fn_id, key): cache[0][key] for (fn_id, key), (_, fn, _) in found.items()
               for cache in fn.device_caches.values() if key in cache[0]}
    compiled = Counter(found[variant][0] for variant in kernels)
    from triton.runtime import driver
    launcher_cls = driver.active.launcher_cls  # the driver set up here, on the engine's thread, not in the pool's
    launcher_failures = build_launchers(list(kernels.values()), lambda k: launcher_cls(k.src, k.metadata), workers)
    return compiled, len(found) - sum(compiled.values()), launcher_failures


def build_launchers(kernels: list, build, workers: int) -> int:
    """`build(kernel)` for each compiled kernel on a thread pool; how many failed. Triton makes a kernel's launcher
    (a small C module: a gcc compile, cached on disk by its source) at the kernel's first launch, on the engine's
    thread, one after another: on an empty cache that was 8.8 s of run17's launch phase (10.5 s, against 1.7 s on
    the cache the cold run filled). Built here, in parallel (gcc is a child process), the first launch finds the
    module on disk. Building one touches no GPU: the kernel's binary is still loaded at its first launch."""
    from concurrent.futures import ThreadPoolExecutor

    def quiet(kernel) -> bool:
        try:
            build(kernel)
            return True
        except Exception:  # built again at the first launch, where an error surfaces as it always did
            return False

    if not kernels:
        return 0
    with ThreadPoolExecutor(max_workers=min(workers, len(kernels)), thread_name_prefix="minisgl-launcher") as pool:
        return sum(not ok for ok in pool.map(quiet, kernels))


# --- the warm-up -------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _pools_restored(runner) -> Iterator[None]:
    """Page 0 of the KV pool and a hybrid's dummy state slot, saved now and written back when the block ends."""
    kv = runner.kv_cache.buffer
    saved = [(kv[:, :, 0], kv[:, :, 0].clone())]
    pool = runner.state_pool
    if pool is not None:
        d = pool.dummy_slot
        saved += [(pool.conv[:, d], pool.conv[:, d].clone()), (pool.recurrent[:, d], pool.recurrent[:, d].clone())]
    meta = runner.attn.meta
    try:
        yield
    finally:
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        for dst, src in saved:
            dst.copy_(src)
        runner.attn.meta = meta


def _graph_steps(runner, graph_max_bs: int, prefill_graphs: bool):
    """What the captures will run: each decode graph's step, then each prefill graph's forward."""
    if graph_max_bs:
        from minisgl.attention.triton_backend import TritonAttentionBackend
        if isinstance(runner.attn, TritonAttentionBackend):  # its decode workspace, allocated (once) as the
            runner.attn.init_cuda_graph_state(graph_max_bs)  # capture will: the steps see the graphs' buffer
        for bs in default_batch_sizes(graph_max_bs):
            yield lambda bs=bs: _run_step(runner, Step(f"graph{bs}", (1,) * bs, decode=True), graph=True)
    if prefill_graphs:
        from minisgl.engine.prefill_graph import PrefillGraphRunner
        cfg = runner.config
        pg = PrefillGraphRunner(runner, cfg.prefill_graph_max_tokens,
                                min(cfg.prefill_graph_max_reqs, cfg.max_running_requests), capture=False)
        for shape in pg.shapes:
            yield lambda shape=shape: pg._forward(shape)


@torch.inference_mode()
def _warm_up(runner, graph_max_bs: int, prefill_graphs: bool, num_sms: int, why_not: str | None) -> dict:
    """The three phases (module docstring); `why_not`: None to discover and precompile (phases 1-2), else why
    not (then the eager steps alone run, compiling what they launch one variant after another)."""
    cfg = runner.config
    context = getattr(runner.attn, "max_context_len", runner.max_model_len)  # the split counts' bound
    plan = eager_plan(cfg.max_running_requests, cfg.prefill_budget, runner.max_model_len, graph_max_bs,
                      runner.num_kv_heads, context, num_sms)
    report = {"eager_steps": len(plan), "split_counts": sorted(split_groups(
        range(1, cfg.max_running_requests + 1), runner.num_kv_heads, context, num_sms))}
    t0 = time.perf_counter()
    with _pools_restored(runner):
        if why_not is None:
            with _hook_installed():
                with _recording(skip=True) as found:  # 1. discovery
                    for run in _graph_steps(runner, graph_max_bs, prefill_graphs):
                        run()
                    torch.cuda.synchronize(runner.device)
                    t_graphs = time.perf_counter()
                    for step in plan:
                        _run_step(runner, step)
                    _run_processing(runner)
                    _run_boundary(runner)
                torch.cuda.synchronize(runner.device)
                t1 = time.perf_counter()
                # 2. compile, in a context of its own: nothing the compile mode sets can outlive it
                compiled, failed, launcher_failures = contextvars.copy_context().run(_precompile, found.found)
                t2 = time.perf_counter()
                with _recording(skip=False) as late:  # 3. launch, noting what still compiles
                    for step in plan:
                        _run_step(runner, step)
                    _run_processing(runner)
                    _run_boundary(runner)
                torch.cuda.synchronize(runner.device)
                report["launch_s"] = time.perf_counter() - t2
            report.update(discovery_s=t1 - t0, discovery_graph_steps_s=t_graphs - t0, compile_s=t2 - t1,
                          compile_workers=compile_workers(len(found.found)),
                          precompiled=dict(compiled), precompile_failed=failed,
                          launchers_failed=launcher_failures,
                          late_compiles=dict(Counter(name for name, _, _ in late.found.values())))
        else:
            report["parallel_compile"] = why_not
            for step in plan:  # compiles what it launches, one variant after another
                _run_step(runner, step)
            _run_processing(runner)
            _run_boundary(runner)
    report["seconds"] = time.perf_counter() - t0
    return report


def warm_up_kernels(runner, graph_max_bs: int, prefill_graphs: bool) -> dict | None:
    """The engine's entry point, before the CUDA-graph captures: compile (on a thread pool) what the captures and
    the eager steps will launch, then launch the eager steps once. `graph_max_bs`: the decode graphs' largest
    batch (0: none); `prefill_graphs`: whether prefill graphs will be captured. Returns what it did (None when
    skipped); on any failure logs one warning and returns None."""
    if runner.device.type != "cuda":
        return None  # a CPU runs torch ops, nothing is compiled (module docstring)
    if runner.tp is not None:
        logger.info("kernel warm-up skipped under tensor parallelism")
        return None
    try:
        sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
        report = _warm_up(runner, graph_max_bs, prefill_graphs, sms, _triton_parallel())
    except Exception as exc:  # a warm-up failure must cost the first workload compile time, never the engine
        logger.warning("kernel warm-up failed, starting without it (kernels compile when first launched): %r", exc)
        return None
    finally:
        # the steps' activations go back to the driver: the graph captures allocate from pools of their own,
        # which cannot reuse blocks the caching allocator keeps for the default pool
        torch.cuda.empty_cache()
    pre = report.get("precompiled", {})
    logger.info("kernel warm-up: %d variants precompiled in %.1f s on %s threads (%s), %d eager steps, %d late "
                "compiles %s, %.1f s in all%s", sum(pre.values()), report.get("compile_s", 0.0),
                report.get("compile_workers", 0), ", ".join(f"{k} {v}" for k, v in sorted(pre.items())),
                report["eager_steps"], sum(report.get("late_compiles", {}).values()),
                report.get("late_compiles", {}), report["seconds"],
                f"; serial compiles: {report['parallel_compile']}" if "parallel_compile" in report else "")
    return report
