"""The named sections `python -m lab.run --sections ...` can run, as one table (SECTIONS).

Most sections are a `Bench`: arms on one model, each a fresh engine with its settings (EngineConfig fields) and
kernel options (lab.engines), running some of the standard workloads. The ablation table is such a section, and
so is every A/B of a kernel switch. The rest are functions: the card's ceilings, the sweep, the profiler
diagnosis, the GPU self-checks (lab.checks, in a child process each) and transformers beside us (lab.hf).

Sections dropped from here are listed with the commit that last had them in reports/h200/HISTORY.md; their JSON
stays in reports/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab import REPO
from lab.engines import KERNEL_OPTIONS, free_gpu, log, replaced, table_json, with_engine
from lab.hf import hf_peer, parity
from lab.timing import time_us
from minisgl import SamplingParams
from minisgl.bench.runner import RUNNERS, _sync, flush_prefix_cache, run_sweep, run_throughput, warm_up
from minisgl.bench.workloads import MIXES, WORKLOADS, Workload, mix_workload, sweep_cells, sweep_workload
from minisgl.kernels.options import use_options

# --- benches: arms on one model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One engine of a bench: its label in the JSON, the workloads it runs, its settings and kernel options.
    `requests` runs only the first N requests of a workload (an eager arm's W2 takes 30x longer per token)."""

    label: str
    workloads: tuple[str, ...]
    settings: dict = field(default_factory=dict)
    kernel: dict = field(default_factory=dict)
    requests: dict = field(default_factory=dict)
    about: str = ""  # what this arm changes, for the reader of the report

    def __post_init__(self):
        unknown = set(self.kernel) - set(KERNEL_OPTIONS)
        if unknown or set(self.requests) - set(self.workloads):
            raise ValueError(f"arm {self.label}: unknown kernel options {unknown} or requests of workloads it "
                             "does not run")


@dataclass(frozen=True)
class Bench:
    """A section: each arm on a fresh engine, in order; `rounds` > 1 runs them that many times interleaved,
    labelled `<arm>_<round>`."""

    model: str
    arms: tuple[Arm, ...]
    rounds: int = 1

    def __call__(self) -> dict:
        res = {}
        for r in range(self.rounds):
            for arm in self.arms:
                res[f"{arm.label}_{r}" if self.rounds > 1 else arm.label] = run_arm(self.model, arm)
        return res


def workload(name: str, vocab: int, requests: int | None = None) -> Workload:
    """A standard workload (minisgl.bench.workloads), or its first `requests` requests. Ids beyond a small model's
    vocabulary wrap around (the real models' vocabularies hold every id the workloads draw)."""
    w = WORKLOADS[name](vocab=min(vocab, 10000))
    if requests is not None:
        w = Workload(w.name, w.prompts[:requests], w.params[:requests], w.late_prompts, w.late_params)
    if vocab < 10000:
        w = Workload(w.name, [[t % vocab for t in p] for p in w.prompts], w.params,
                     [[t % vocab for t in p] for p in w.late_prompts], w.late_params)
    return w


def kernel_record(llm) -> dict:
    """The engine's kernel options as it resolved them (environment defaults included), for the JSON."""
    return dataclasses.asdict(llm.config.kernels)


def run_arm(model: str, arm: Arm) -> dict:
    t0 = time.perf_counter()

    def body(llm) -> dict:
        runner = llm.engine.runner
        out = {"settings": arm.settings, "kernel": arm.kernel, "startup_s": time.perf_counter() - t0,
               "kv_pool_tokens": runner.kv_capacity_tokens, "kernel_options": kernel_record(llm),
               "gemv_linears": getattr(runner, "gemv_linears", None),
               "decode_megakernel": getattr(runner, "decode_megakernel", None)}
        vocab = llm.engine.model_config.vocab_size
        for name in arm.workloads:
            out[name] = RUNNERS[name](llm, workload(name, vocab, arm.requests.get(name)))
            log(model, arm.label, name, {k: v for k, v in out[name].items() if not isinstance(v, (list, dict))})
        return out

    try:
        return with_engine(model, body, arm.settings, arm.kernel)
    except Exception:
        err = traceback.format_exc()
        log(model, arm.label, "FAILED", err)
        return {"settings": arm.settings, "kernel": arm.kernel, "error": err}


# The ablation table: each switch off in turn (DESIGN.md: overlap, CUDA Graph, radix cache, chunked prefill), then
# the later ones. The eager arm's W2 runs 2 of its 8 requests (8 take ~50 s on Qwen3-0.6B, ~65 s on Qwen3-8B).
EAGER_W2 = {"w2": 2}
ABLATION = {
    "default": Arm("default", ("w1", "w1_topkp", "w2", "w3", "w4"), about="every switch on"),
    "no_overlap": Arm("no_overlap", ("w1", "w2"), {"overlap": False},
                      about="the host schedules step N+1 only after step N's tokens are back"),
    "no_cuda_graph": Arm("no_cuda_graph", ("w1", "w2"), {"cuda_graph": False}, requests=EAGER_W2,
                         about="every step's kernels launched one by one from Python"),
    "no_radix_cache": Arm("no_radix_cache", ("w1", "w3"), {"radix_cache": False},
                          about="no reuse of shared prompt prefixes"),
    "no_chunked_prefill": Arm("no_chunked_prefill", ("w1", "w4"), {"chunked_prefill_size": 0},
                              about="a long prompt's prefill runs whole, in one step"),
    "no_gemv": Arm("no_gemv", ("w2",), {"gemv": False}, about="batch-1..4 matmuls on cuBLAS, not minisgl's GEMV"),
    "no_pdl": Arm("no_pdl", ("w1", "w2"), kernel={"pdl": False},
                  about="kernels in plain stream order, without programmatic dependent launch"),
    "no_prefill_graphs": Arm("no_prefill_graphs", ("w1", "w2"), {"prefill_graph_max_tokens": 0},
                             about="prefill and mixed steps launched eagerly, not replayed as CUDA Graphs"),
    "no_fused_sampler": Arm("no_fused_sampler", ("w1_topkp",), kernel={"fused_sampler": False},
                            about="top-k/top-p sampling in torch (a sort per row), not one Triton kernel"),
    # The first W1 of a process ran 6-12% slower than W1 on every later engine of that process, switches off or
    # not, with no Triton compile timed (run14, run15): dividing the later rows by it would credit that to the
    # switch. The default again, last, is the rows' base; the first row stays the user's first run.
    "default_again": Arm("default_again", ("w1", "w2"), about="every switch on, a second engine, last: the base of "
                         "the rows above"),
}
ABLATION_06 = tuple(ABLATION.values())
ABLATION_8 = (Arm("default", ("w1", "w1_topkp", "w2"), about="every switch on"),
              Arm("no_overlap", ("w1", "w2"), {"overlap": False}, about=ABLATION["no_overlap"].about),
              Arm("no_cuda_graph", ("w2",), {"cuda_graph": False}, requests=EAGER_W2,
                  about=ABLATION["no_cuda_graph"].about),
              ABLATION["no_gemv"], Arm("no_pdl", ("w2",), kernel={"pdl": False},
                                         about=ABLATION["no_pdl"].about),
              Arm("default_again", ("w1",), about=ABLATION["default_again"].about))

# cuBLAS's projections at batch 1 taken by the GEMV (4 or 8 output rows a program, 1024-wide K tiles, one row)
GEMV_ALL = {"qwen3-0.6b": {"6144,1024": (4, 1024, 4, 1)},
            "qwen3-8b": {"6144,4096": (4, 1024, 4, 1), "24576,4096": (8, 1024, 4, 1), "4096,12288": (4, 1024, 4, 1)}}


def early_tiles(model: str, tiles: tuple[int, ...], rounds: int) -> Bench:
    """W2 with the GEMV loading n weight tiles before its PDL wait, then the most tiles with cuBLAS's projections
    on the GEMV too (GEMV_ALL)."""
    arms = [Arm(f"early{n}", ("w2",), kernel={"gemv_pdl_early_tiles": n}) for n in tiles]
    arms.append(Arm(f"early{max(tiles)}_all_gemv", ("w2",),
                    kernel={"gemv_pdl_early_tiles": max(tiles), "gemv_table": GEMV_ALL[model]}))
    return Bench(model, tuple(arms), rounds)


def w2_pair(model: str, on: str, off: str, option: str) -> Bench:
    return Bench(model, (Arm(on, ("w2",), kernel={option: True}), Arm(off, ("w2",), kernel={option: False})))


# --- the card, the sweep, the diagnosis ----------------------------------------------------------------------


def ceilings() -> dict:
    """Device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate, measured now."""
    def copy_rate(n: int = 2 << 30) -> float:
        src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
        dst = torch.empty_like(src)
        return 2 * n / (time_us(lambda: dst.copy_(src), iters=10, warmups=3) * 1e-6)

    def matmul_rate(m: int = 8192) -> float:
        a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
        return 2 * m ** 3 / (time_us(lambda: a @ b, iters=10, warmups=3) * 1e-6)

    out = {"copy_bytes_per_s": copy_rate(), "bf16_matmul_flops": matmul_rate()}
    free_gpu()
    return out


def sweep(model: str, **settings) -> dict:
    """The batch-mix sweep (minisgl.bench.workloads.sweep_cells) on one engine, cell by cell."""
    t0 = time.perf_counter()

    def body(llm) -> dict:
        graphs = llm.engine.runner.graph_runner
        res = {"settings": settings, "startup_s": time.perf_counter() - t0,
               "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens,
               # the scheduler's: the resolved value where the config leaves it to the engine (0/None)
               "max_running_requests": llm.engine.scheduler.max_running,
               "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs is not None else [],
               "kernel_options": kernel_record(llm), "cells": {}}
        for cell in sweep_cells():
            res["cells"].update(run_sweep(llm, [cell]))
            r = res["cells"][cell.name]
            log("sweep", cell.name, round(r["output_tok_per_s"]), r["triton_compiles_timed"])
        return res

    return with_engine(model, body, settings)


def mixes(model: str, **settings) -> dict:
    """Issue 29's request mixes (minisgl.bench.workloads.MIXES: 512 requests of 16-2,048 prompt tokens, 16-512
    greedy outputs; 384 requests in 24 groups sharing 512-1,536-token prefixes, mixed sampling) on one engine,
    each all at once from an empty prefix cache: output tok/s, the largest decode batch, the steps, and the
    sizes the engine resolved (running requests, snapshots, KV pool)."""
    t0 = time.perf_counter()

    def body(llm) -> dict:
        runner = llm.engine.runner
        graphs = runner.graph_runner
        res = {"settings": settings, "startup_s": time.perf_counter() - t0,
               "max_running_requests": llm.engine.scheduler.max_running,  # resolved where the config leaves it
               "state_snapshots": runner.state_pool.num_snapshots if runner.state_pool is not None else None,
               "kv_pool_tokens": runner.kv_capacity_tokens,
               "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs is not None else [],
               "kernel_options": kernel_record(llm), "mixes": {}}
        vocab = llm.engine.model_config.vocab_size
        for name, cell in MIXES.items():
            r = run_throughput(llm, mix_workload(name, vocab))
            e = r["engine"]
            res["mixes"][name] = {"cell": {"name": cell.name, **vars(cell)}, "output_tok_per_s": r["output_tok_per_s"],
                                  "max_decode_batch": e["max_decode_batch"], "steps": e["steps"],
                                  "decode_steps": e["decode_steps"], "retractions": e["retractions"], "run": r}
            log(model, "mixes", name, round(r["output_tok_per_s"]), "max batch", e["max_decode_batch"],
                "steps", e["steps"], "rows", res["max_running_requests"])
        return res

    return with_engine(model, body, settings)


def sweep_phases(model: str, requests: int = 256, prompt_lo: int = 1024) -> dict:
    """Where a long-prompt sweep cell's time goes: the greedy and top-k/top-p cells of one mix run normally
    (greedy, top-k/top-p, greedy: an order effect shows as two greedy figures), then each again with every step
    synchronised and timed, split into prefill (and mixed) steps and decode steps. Timing serialises the overlap
    loop, so those runs are slower than the cell's: they show the split, not the throughput."""
    cells = {c.sampling: c for c in sweep_cells() if c.requests == requests and c.prompt_lo == prompt_lo}

    def body(llm) -> dict:
        vocab = llm.engine.model_config.vocab_size
        res = {"cells": {c.sampling: c.name for c in cells.values()}, "runs": []}
        for sampling in ("greedy", "topkp", "greedy"):
            flush_prefix_cache(llm)
            r = run_throughput(llm, sweep_workload(cells[sampling], vocab))
            res["runs"].append({"sampling": sampling,
                                **{k: v for k, v in r.items() if not isinstance(v, (list, dict))}})
            log("sweep_phases", sampling, round(r["output_tok_per_s"]))
        for sampling in ("greedy", "topkp"):  # the engine is warm from the runs above
            res[f"timed_{sampling}"] = timed_steps(llm, sweep_workload(cells[sampling], vocab))
        return res

    return with_engine(model, body)


def generate_wall(llm, w: Workload) -> tuple[float, list]:
    """The whole workload at once: (seconds of wall time, the outputs)."""
    t0 = time.perf_counter()
    outs = llm.generate(w.prompts, w.params, progress=False)
    return time.perf_counter() - t0, outs


def timed_steps(llm, w: Workload) -> dict:
    """The workload all at once with every step synchronised and timed (the runner's forward wrapped), split into
    prefill (and mixed) steps and decode steps, each step's batch size, tokens, K/V tokens and milliseconds. Timing
    serialises the overlap loop: the wall time is not the workload's throughput, the split is what it shows."""
    runner = llm.engine.runner
    forward, steps = runner.forward, []

    def timed(batch):
        _sync()
        t0 = time.perf_counter()
        out = forward(batch)
        _sync()
        steps.append((batch.is_decode, batch.size, batch.num_tokens, sum(batch.prefix_lens) + batch.num_tokens,
                      time.perf_counter() - t0))
        return out

    flush_prefix_cache(llm)
    with replaced(runner, "forward", timed):
        wall, _ = generate_wall(llm, w)
    decode = [s for s in steps if s[0]]
    prefill = [s for s in steps if not s[0]]
    return {"wall_s": wall, "prefill_steps": len(prefill), "prefill_s": sum(s[4] for s in prefill),
            "prefill_tokens": sum(s[2] for s in prefill), "decode_steps": len(decode),
            "decode_s": sum(s[4] for s in decode), "decode_tokens": sum(s[2] for s in decode),
            "decode_kv_tokens": sum(s[3] for s in decode),  # K/V tokens the decode steps attend over
            "steps": [[int(d), b, n, kv, round(dt * 1e3, 3)] for d, b, n, kv, dt in steps],
            "steps_columns": ["is_decode", "batch_size", "tokens", "kv_tokens", "ms"]}


def mix_phases(model: str, mix: str = "mix512") -> dict:
    """Where a mix's time goes (issue 29: Qwen3.5 on the 512-request long-prompt mix): the mix run normally with
    the host's time per step by phase (schedule, launch, wait for the device: near-zero wait means the host is
    the bottleneck) and each step's batch, then again with every step synchronised and timed (`timed_steps`:
    device time of prefill against decode steps, by batch size), then its first steps under the profiler
    (kernel time by kind: what a step of prefill chunks and joining decode rows spends its time on)."""
    from minisgl.bench.profile import profile_slice, timed_phases

    def body(llm) -> dict:
        w = mix_workload(mix, llm.engine.model_config.vocab_size)
        run_throughput(llm, w)  # warm: every batch shape of the mix once
        sched, batches = llm.engine.scheduler, []
        flush_prefix_cache(llm)
        with timed_phases(llm.engine) as times:
            schedule = sched.schedule  # timed_phases' wrapper, which its exit removes

            def schedule_seen(*args, **kwargs):
                batch = schedule(*args, **kwargs)
                if hasattr(batch, "num_tokens"):  # not None, not the scheduler's NEED_SYNC
                    batches.append((int(batch.is_decode), batch.size, batch.num_tokens))
                return batch

            with replaced(sched, "schedule", schedule_seen):
                wall, _ = generate_wall(llm, w)
        res = {"mix": mix, "output_tok_per_s": w.total_output_tokens / wall, "wall_s": wall,
               "max_running_requests": sched.max_running, "host_s": times.totals,
               "steps_host": [[round(x * 1e3, 3) for x in step] for step in times.steps],
               "steps_host_columns": ["step_ms", "schedule_ms", "launch_ms", "wait_ms"],
               "batches": batches, "batches_columns": ["is_decode", "batch_size", "tokens"],
               "timed": timed_steps(llm, w),
               # the mix's first steps under the profiler: prefill chunks of many prompts, decode rows joining
               "prefill_profile": (profile_slice(llm, w.prompts, w.params, warm_steps=8, steps=6, top=16)
                                   if torch.cuda.is_available() else "skipped: the profiler's view needs a GPU")}
        log(model, "mix_phases", mix, round(res["output_tok_per_s"]), "host", {k: round(v, 2) for k, v in
                                                                             times.totals.items()})
        return res

    return with_engine(model, body)


# The defaults before run25: a burst's mixed steps (an 8k chunk beside hundreds of decode rows) eager, past the
# largest prefill graph, and the extend kernel on its grid; the A/B arm of the mixed steps in graphs
EAGER_MIXED = dict(settings={"prefill_graph_max_tokens": 4096, "prefill_graph_max_reqs": 64},
                   kernel={"extend_tiles": False})


def launch_profile(model: str, mix: str = "mix512", top: int = 40, settings: dict | None = None,
                   kernel: dict | None = None) -> dict:
    """Where an eager mixed step's host time goes (issue 24's burst: run23 saw ~20 ms to launch a step of one 8k
    prompt chunk and hundreds of decode rows, ~383 kernels). The mix runs once to warm up, once as it runs
    (`output_tok_per_s`, `ttft_ms_median`: all requests at once, overlap on), then twice more with
    every step launched on an idle device: the runner's forward is timed from an idle device to its return
    (`launch_ms`: nothing queued ahead, so no wait on a full launch queue can hide in it) and then to the device's
    end (`tail_ms`); the first of the two passes is timed, the second runs the eager prefill launches under
    cProfile (`profile`: the functions by own time and with callees; profiling slows Python code, so only its
    shares mean something)."""
    import cProfile

    from lab.checks.warmup import profile_table

    def body(llm) -> dict:
        w = mix_workload(mix, llm.engine.model_config.vocab_size)
        run_throughput(llm, w)  # warm: every batch shape of the mix once
        throughput = run_throughput(llm, w)  # the mix as it runs (overlap on, nothing synchronised)
        runner = llm.engine.runner
        forward, steps, profiler = runner.forward, [], cProfile.Profile()
        state = {"profiling": False}

        def isolated(batch):
            _sync()
            profiling, prefill = state["profiling"], not batch.is_decode
            if profiling and prefill:
                profiler.enable()
            t0 = time.perf_counter()
            out = forward(batch)
            t1 = time.perf_counter()
            if profiling and prefill:
                profiler.disable()
            _sync()
            if not profiling:
                steps.append((runner.last_step_kind, batch.size, batch.num_tokens, batch.num_tokens - batch.size,
                              t1 - t0, time.perf_counter() - t1))
            return out

        with replaced(runner, "forward", isolated):
            for profiling in (False, True):
                state["profiling"] = profiling
                flush_prefix_cache(llm)
                generate_wall(llm, w)

        def summary(kind: str) -> dict:
            rows = [s for s in steps if s[0] == kind]
            if not rows:
                return {"steps": 0}
            return {"steps": len(rows), "launch_ms_median": round(1e3 * statistics.median(s[4] for s in rows), 3),
                    "tail_ms_median": round(1e3 * statistics.median(s[5] for s in rows), 3),
                    "tokens_median": statistics.median(s[2] for s in rows)}

        kinds = sorted({s[0] for s in steps})
        res = {"mix": mix, "output_tok_per_s": throughput["output_tok_per_s"],
               "ttft_ms_median": throughput["ttft_ms_median"], "engine": throughput["engine"],
               "by_kind": {k: summary(k) for k in kinds},
               "steps": [[k, b, n, extra, round(1e3 * lt, 3), round(1e3 * tt, 3)] for k, b, n, extra, lt, tt in steps],
               "steps_columns": ["kind", "batch_size", "tokens", "tokens_beyond_one_per_request", "launch_ms",
                                 "tail_ms"],
               "profile": {"by_own_time": profile_table(profiler, "tottime", top),
                           "by_cumulative_time": profile_table(profiler, "cumtime", top)}}
        log(model, "launch_profile", mix, settings, kernel, res["by_kind"])
        return res

    return with_engine(model, body, settings=settings, kernel=kernel)


def gdn_solve_ab(model: str = "qwen3.5-0.8b", mix: str = "mix512") -> dict:
    """The chunk prepare's two triangular solves (gdn.prepare_solve "rows" / "blocks") on the 512-request mix:
    output tok/s of each (a warm run, then the measured one), and the greedy tokens of the measured runs compared
    request by request (the first differing position of each request that differs)."""
    res: dict = {"mix": mix, "arms": {}}
    tokens = {}
    for solve in ("rows", "blocks"):
        def body(llm, solve: str = solve) -> dict:
            w = mix_workload(mix, llm.engine.model_config.vocab_size)
            run_throughput(llm, w)  # warm: every batch shape once
            flush_prefix_cache(llm)
            wall, outs = generate_wall(llm, w)
            tokens[solve] = [o.token_ids for o in outs]
            return {"output_tok_per_s": w.total_output_tokens / wall, "wall_s": wall,
                    "kernel_options": kernel_record(llm)}
        res["arms"][solve] = with_engine(model, body, kernel={"gdn": {"prepare_solve": solve}})
        log(model, "gdn_solve_ab", solve, round(res["arms"][solve]["output_tok_per_s"]))
    # a request's first differing position; one output a prefix of the other differs at the shorter's length
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                       None if len(a) == len(b) else min(len(a), len(b)))
                  for a, b in zip(tokens["rows"], tokens["blocks"])]
    res["requests_identical"] = sum(d is None for d in first_diff)
    res["requests"] = len(first_diff)
    res["first_differences"] = [d for d in first_diff if d is not None]
    res["blocks_over_rows"] = res["arms"]["blocks"]["output_tok_per_s"] / res["arms"]["rows"]["output_tok_per_s"]
    return res


def profile_slices(model: str, sizes=(1, 64), steps: int = 30, top: int = 12) -> dict:
    """Decode steps at several batch sizes of W1's requests (kernel time by kind and by name), then W2 requests'
    first tokens: three unprofiled, one profiled (host launch time against kernel time)."""
    from minisgl.bench.profile import profile_request, profile_w1_slice
    from minisgl.bench.workloads import w2_latency

    def body(llm) -> dict:
        warm_up(llm)
        out = {f"decode_bs{n}": profile_w1_slice(llm, num_requests=n, warm_steps=max(8, n // 8), steps=steps,
                                                 keep_intervals=0, top=top) for n in sizes}
        prompts = w2_latency().prompts  # each used once: a repeated prompt would be served from the radix cache
        out["w2_request_unprofiled"] = [profile_request(llm, p, profiled=False) for p in prompts[:3]]
        out["w2_request"] = profile_request(llm, prompts[3])
        return out

    return with_engine(model, body)


def profile() -> dict:
    """The diagnosis on Qwen3-0.6B: batch-1/64 decode and the W2 request (profile_slices), then 30 steps of a
    64-request W1 slice with the defaults, without overlap and without CUDA graphs (the default run keeps its
    kernel intervals for the timeline chart)."""
    from minisgl.bench.profile import profile_w1_slice
    out = {"small_batches": profile_slices("qwen3-0.6b")}
    for label, settings in (("default", {}), ("no_overlap", {"overlap": False}),
                            ("no_cuda_graph", {"cuda_graph": False})):
        keep = 3000 if label == "default" else 0
        out[label] = with_engine("qwen3-0.6b", lambda llm, keep=keep: profile_w1_slice(llm, keep_intervals=keep),
                                 settings)
    return out


# --- GPU self-checks ---------------------------------------------------------------------------------------


def child_check(module: str, *args: str, quick_json: str | None = None) -> dict:
    """Run `python -m <module> --out FILE args` in a child process (a crashed kernel cannot take the section
    runner with it) and return its JSON with the return code."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "check.json")
        rc = subprocess.run([sys.executable, "-m", module, "--out", path, *args], cwd=REPO).returncode
        try:
            with open(path) as f:
                return {"returncode": rc, **json.load(f)}
        except OSError as exc:
            return {"returncode": rc, "error": repr(exc)}


def kernels(*flags: str) -> dict:
    return child_check("lab.checks.kernels", *flags)


def same_tokens(model: str, runs: dict[str, tuple[dict, dict]], reference: str, new_tokens: int = 300,
                probe: Callable[[Any], dict] | None = None) -> dict:
    """Each run (label: (settings, kernel options)) on a fresh engine: batch 1 (two prompts, each alone: the GEMV
    path) and batch 8, greedy and seeded top-k/top-p sampling; every run's tokens against the `reference` run's,
    request by request (`ok`: all the same), with where each first differs. `probe(llm)`: more of each engine's
    record, read while it is up."""
    rng = random.Random(10)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(50, 400))] for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=new_tokens, ignore_eos=True,
                              seed=100 + i) for i in range(len(prompts))]

    def body(llm) -> dict:
        toks = {"bs1_greedy": [llm.generate([p], greedy, progress=False)[0].token_ids for p in prompts[:2]],
                "bs1_sampled": [llm.generate([p], sp, progress=False)[0].token_ids
                                for p, sp in zip(prompts[:2], sampled)],
                "bs8_greedy": [o.token_ids for o in llm.generate(prompts, greedy, progress=False)],
                "bs8_sampled": [o.token_ids for o in llm.generate(prompts, sampled, progress=False)]}
        return {"kernel_options": kernel_record(llm), "graph_steps": llm.engine.stats["graph_steps"],
                "decode_steps": llm.engine.stats["decode_steps"], **(probe(llm) if probe else {}), "tokens": toks}

    results, failed = {}, {}
    for label, (settings, kernel) in runs.items():
        try:
            results[label] = with_engine(model, body, settings, kernel, max_model_len=4096, kv_memory_fraction=0.3)
        except Exception:  # one arm's failure is its result: the others still run (run29 lost a call's arms to one)
            failed[label] = {"error": traceback.format_exc()[-3000:]}
            log("same_tokens", label, "FAILED", failed[label]["error"].splitlines()[-1])
            free_gpu()  # what the half-built engine held, now that the traceback is gone
    if reference not in results:
        return {**failed, **{label: {"error": "no reference run"} for label in results}, "ok": False}
    ref = results[reference]["tokens"]
    out = dict(failed)
    for label, r in results.items():
        same = {k: [a == b for a, b in zip(v, ref[k])] for k, v in r["tokens"].items()}
        first_diff = {k: [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                          for a, b in zip(v, ref[k])] for k, v in r["tokens"].items()}
        out[label] = {**{k: v for k, v in r.items() if k != "tokens"}, f"same_as_{reference}": same,
                      "first_divergence": first_diff}
        log("same_tokens", label, {k: v for k, v in out[label].items() if k != "first_divergence"})
    out["ok"] = not failed and all(all(all(v) for v in o[f"same_as_{reference}"].values())
                                   for o in out.values())
    return out


def same_tokens_by_mode(model: str, arms: dict[str, dict], reference: str,
                        probe: Callable[[Any], dict] | None = None) -> dict:
    """`same_tokens` under CUDA graphs and eagerly ({"graphs": ..., "eager": ...}): each arm (label: kernel
    options) against the `reference` arm in the same mode, since eager and graph steps may differ from each other
    (run22: padded prefill graphs)."""
    return {mode: same_tokens(model, {label: (settings, kernel) for label, kernel in arms.items()}, reference,
                              probe=probe)
            for mode, settings in (("graphs", {}), ("eager", {"cuda_graph": False}))}


def pdl_tokens(model: str = "qwen3-0.6b") -> dict:
    """Tokens with PDL on and off, under CUDA graphs and eagerly, each against PDL off in the same mode. PDL changes
    no arithmetic, so they must be the same (eager and graph steps may differ from each other: run22)."""
    from minisgl.kernels import pdl

    def active(llm) -> dict:
        with use_options(llm.config.kernels):  # what a launch of this engine gets
            return {"pdl_active": bool(pdl.pdl_launch(next(llm.engine.runner.model.parameters())))}

    out = same_tokens_by_mode(model, {"no_pdl": {"pdl": False}, "pdl": {}}, "no_pdl", probe=active)
    out["ok"] = all(t["ok"] and t["pdl"]["pdl_active"] and not t["no_pdl"]["kernel_options"]["pdl"]
                    for t in out.values())
    return out


FOLD_ABOUT = "RMSNorms folded into the GEMVs (the add after the one before, the norm before the one after)"
FOLD_SUMS_ABOUT = "each folded norm's sums of squares added up in the epilogue of the GEMV before"
FOLD_SUMS_ARMS = {
    "off": ({"gemv_norm_fold": False, "gemv_fold_sum_squares": False}, ""),
    "fold": ({"gemv_norm_fold": True, "gemv_fold_sum_squares": False}, FOLD_ABOUT),
    "fold_sums": ({"gemv_norm_fold": True, "gemv_fold_sum_squares": True}, f"{FOLD_ABOUT}; {FOLD_SUMS_ABOUT}")}
ACT_ABOUT = "the MLP's SiLU-and-mul in the epilogue of its gate_up GEMV, not in every program of its down GEMV"
PREFETCH_ABOUT = "each GEMV program's next weight tile loaded before the current one's products"
STAGES_ABOUT = "the GEMV's K loop pipelined through shared memory, {} stages (Triton's cp.async pipelining)"
MLP_PREFETCH_ABOUT = ("each layer's o GEMV asks L2 for the MLP's weights (gate/up, then down) before its PDL wait, "
                      "while the attention runs")
MLP_PREFETCH_ARMS = {"off": ({"gemv_mlp_prefetch_mb": 0}, ""),
                     "mb24": ({"gemv_mlp_prefetch_mb": 24}, MLP_PREFETCH_ABOUT)}
NEXT_KV_ARMS = {"off": ({"decode_prefetch_next_kv": False}, ""),
                "next_kv": ({"decode_prefetch_next_kv": True}, "each decode program asks L2 for the next layer's keys "
                            "and values at its first key tile, before its PDL wait")}
EARLY_META_ABOUT = ("the decode kernels read each request's length, row and slot, and RoPE each token's position "
                    "and its cos/sin, before their PDL wait")
FUSED_MERGE_ABOUT = "the decode splits merged by the last stage-1 program of each request and kv head"
MEGAKERNEL_ABOUT = "a one-row decode step's decoder layers in one persistent kernel (kernels/decode_layers.py)"
MEGAKERNEL_ARMS = {"off": {"decode_megakernel": False}, "on": {"decode_megakernel": True},
                   "on_168_regs": {"decode_megakernel": True, "decode_megakernel_regs": 168}}
# issue 29's next links of a batch-1 decode step's chain (kernels/attention.py)
DECODE_LINKS = {"decode_fused_rope": "the decode step's RoPE and q/k norms inside the decode attention kernel",
                "early_kv": "the decode kernel's first key tile read before its PDL wait"}


def kernel_option_ab(model: str, options: dict[str, str], rounds: int = 2, each: bool = True) -> dict:
    """Boolean kernel options that change no arithmetic (the GEMV's norm fold, the early metadata, the fused RoPE,
    the early keys; `options`: name -> what it does): tokens with all of them off, each alone on and, with more
    than one, all on, under CUDA graphs and eagerly, each against all off in the same mode (they must be the same;
    eager and graph steps may differ from each other, run22), then W2 in each of those arms, interleaved `rounds`
    times. Arms are named by their option (or "off", "all"); every option is set explicitly in every arm, since the
    default may be either. `each=False`: only "off" and "all" (half the time, for a lease's last minutes);
    `rounds=0`: the tokens alone."""
    off = {name: False for name in options}
    arms = {"off": (off, "")}
    if each or len(options) == 1:
        arms |= {name: ({**off, name: True}, about) for name, about in options.items()}
    if len(options) > 1:
        arms["all"] = ({name: True for name in options}, "; ".join(options.values()))
    return arms_ab(model, arms, rounds)


def arms_ab(model: str, arms: dict[str, tuple[dict, str]], rounds: int,
            probe: Callable[[Any], dict] | None = None) -> dict:
    """Arms (label: (kernel options, what they change)) whose tokens must equal the "off" arm's: the tokens under
    CUDA graphs and eagerly (`same_tokens_by_mode`; `probe` adds to each engine's record), then W2 in each arm,
    interleaved `rounds` times (0: the tokens alone)."""
    tokens = same_tokens_by_mode(model, {label: kernel for label, (kernel, _) in arms.items()}, "off", probe=probe)
    # an arm whose engine failed in either mode is not timed (its error is in `tokens`)
    timed = {label: arm for label, arm in arms.items() if not any("error" in t.get(label, {}) for t in tokens.values())}
    runs = Bench(model, w2_arms(timed), rounds)() if rounds and timed else {}
    return {"tokens": tokens, "runs": runs, "ok": all(t["ok"] for t in tokens.values())}


def w2_arms(arms: dict[str, tuple[dict, str]]) -> tuple[Arm, ...]:
    """W2 in each arm (label: (kernel options, what they change))."""
    return tuple(Arm(label, ("w2",), kernel=kernel, about=about) for label, (kernel, about) in arms.items())


def fold_sums_ab(model: str, rounds: int = 2) -> dict:
    """The norm fold off, on (each norm's rstd from its row, read by every program of the GEMV after), and on with
    the sums of squares added up by the GEMV before (kernel option gemv_fold_sum_squares): tokens against off, then
    W2 in each arm."""
    return arms_ab(model, FOLD_SUMS_ARMS, rounds)


def megakernel_ab(model: str, rounds: int = 2) -> dict:
    """The decode-layers kernel (kernel option decode_megakernel) off, on, and on with its registers capped at 168
    (three programs an SM instead of two): tokens against off (greedy and seeded sampling, batch 1 and 8, graphs
    and eager; each engine's record says whether the kernel applied and its grid), then W2 in each arm,
    interleaved `rounds` times."""
    def probe(llm) -> dict:
        runner = llm.engine.runner
        kernel = getattr(runner.model.layers[0], "kernel", None)  # a DecodeLayers' kernel, once it has run
        return {"decode_megakernel": runner.decode_megakernel, "programs": getattr(kernel, "programs", None)}

    arms = {label: (kernel, "" if label == "off" else MEGAKERNEL_ABOUT) for label, kernel in MEGAKERNEL_ARMS.items()}
    return arms_ab(model, arms, rounds, probe)


def pdl_check() -> dict:
    """PDL's GPU checks: the kernel chain (lab.checks.pdl), then engine tokens with PDL on and off."""
    out = {"kernels": child_check("lab.checks.pdl")}
    out["tokens"] = pdl_tokens()
    out["ok"] = out["kernels"].get("returncode") == 0 and out["tokens"]["ok"]
    return out


def qwen35_check() -> dict:
    """Qwen3.5 greedy: CUDA Graph on and off, and prefill graphs on and off, give the same tokens (fp32 and bf16),
    and a second pass over the same prompts (radix hits restored from state snapshots) gives them again. Some
    prompts share a prefix (a branch point the prefix cache snapshots on the first pass)."""
    rng = random.Random(35)
    prompts = [[rng.randint(0, 9999) for _ in range(rng.randint(100, 300))] for _ in range(6)]
    prompts += [prompts[0][:160] + [rng.randint(0, 9999) for _ in range(rng.randint(20, 80))] for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def body(llm) -> dict:
        pg = llm.engine.runner.prefill_graph
        replays = pg.replays if pg is not None else 0
        first = [o.token_ids for o in llm.generate(prompts, sp, progress=False)]
        second = llm.generate(prompts, sp, progress=False)
        return {"tokens": first, "second_pass_same": [o.token_ids for o in second] == first,
                "second_pass_cached_tokens": sum(o.num_cached_prompt_tokens for o in second),
                "graph_steps": llm.engine.stats["graph_steps"], "steps": llm.engine.stats["steps"],
                "prefill_graphs": len(pg.graphs) if pg is not None else 0,
                "prefill_graph_steps": (pg.replays - replays) if pg is not None else 0,
                "state_snapshots": llm.engine.runner.state_pool.num_snapshots}

    out = {}
    for dtype in ("float32", "bfloat16"):
        runs = {label: with_engine("qwen3.5-0.8b", body, settings, dtype=dtype)
                for label, settings in (("graph", {}), ("no_graph", {"cuda_graph": False}),
                                        ("no_prefill_graph", {"prefill_graph_max_tokens": 0}))}
        ref, no_pg = runs["graph"]["tokens"], runs["no_prefill_graph"]["tokens"]
        out[dtype] = {"graph_equals_no_graph": ref == runs["no_graph"]["tokens"],
                      "graph_equals_no_prefill_graph": ref == no_pg,
                      "prompts_equal_no_prefill_graph": sum(a == b for a, b in zip(ref, no_pg)),
                      **{k: {x: y for x, y in v.items() if x != "tokens"} for k, v in runs.items()}}
        log("qwen35_check", dtype, out[dtype])
    return out


def wide_gemv_ab(model: str, rounds: int = 2) -> dict:
    """The decode GEMV tuned again for `model`'s weight shapes with the wide K tiles (lab.tune.gemv --wide), then
    W2 with three tables, interleaved: `default` (the card's table in the repo), `wide` (the repo's table with the
    tune's picks where the GEMV beat cuBLAS standalone) and `all_gemv` (every projection on the GEMV with the
    tune's best tile, at least at one row: under PDL the GEMV streams weights while its predecessor ends, which
    a standalone time does not show). On a card other than the H200, a fourth: `h200_table`, the H200's table in
    the repo (whether another card's picks carry over, e.g. to a card the repo has no table for)."""
    from lab.tune import gemv as tune_gemv
    from minisgl.kernels import gemv

    with tempfile.TemporaryDirectory() as tmp:
        tune = tune_gemv.main(tmp, models=(model,), wide=True)
    repo = table_json(gemv.device_table(torch.cuda.get_device_name()))
    wide = dict(repo, **{shape: pick for shape, pick in tune["picks"].items() if pick is not None})
    all_gemv = dict(repo, **{f"{r['n']},{r['k']}": [*r["best"], max(1, (tune["picks"][f"{r['n']},{r['k']}"]
                                                                        or [0, 0, 0, 1])[3])]
                             for r in tune["shapes"]})
    h200 = table_json(gemv.device_table("NVIDIA H200"))
    tables = {"default": repo}
    for label, table in (("wide", wide), ("all_gemv", all_gemv), ("h200_table", h200)):
        if table not in tables.values():  # an arm the same as an earlier one would only repeat it
            tables[label] = table
    arms = tuple(Arm(label, ("w2",), kernel={"gemv_table": table}) for label, table in tables.items())
    return {"tune": tune, "tables": tables, "runs": Bench(model, arms, rounds)()}


def step_tiles(model: str, budget_s: float, rounds: int) -> dict:
    """The decode GEMV's tiles tuned inside the batch-1 step (lab.tune.gemv_step, at most `budget_s` seconds of
    candidates), then W2 with the card's table (`default`) and with the step's picks (`step_picks`), interleaved
    `rounds` times."""
    from lab.tune import gemv_step

    tune = gemv_step.tune(model, budget_s)
    arms = (Arm("default", ("w2",)), Arm("step_picks", ("w2",), kernel={"gemv_table": tune["table"]},
                                         about="the GEMV tiles picked inside the batch-1 decode step"))
    return {"tune": tune, "runs": Bench(model, arms, rounds)()}


STAGED_ABOUT = "a decode graph's inputs in one copy of a block its graphs read (engine/staged_graph.py)"


def staged_ab(model: str, workloads: tuple[str, ...], rounds: int, tokens: bool = True) -> dict:
    """The engine switch graph_staged_inputs off and on: the tokens (`same_tokens`, on against off; the graphs
    read the same values, so they must be the same), then `workloads` in each arm, interleaved `rounds` times."""
    arms = {"off": {"graph_staged_inputs": False}, "staged": {"graph_staged_inputs": True}}
    same = same_tokens(model, {label: (settings, {}) for label, settings in arms.items()}, "off") if tokens else None
    runs = Bench(model, (Arm("off", workloads, arms["off"]),
                         Arm("staged", workloads, arms["staged"], about=STAGED_ABOUT)), rounds)()
    return {"tokens": same, "runs": runs, "ok": same["ok"] if same else None}


FUSED_ENDS_ABOUT = ("the sampler's row settings in one kernel and its last reduction with the token-table write in "
                    "another; a greedy graph's argmax by the sampler's draw pass (kernels/sampling.py)")
FUSED_NARROW_ABOUT = "the top-k/top-p search's narrowing in each pass's last program, not a launch of its own"
ZERO_COPY_ABOUT = ("a staged step's inputs read from pinned memory by one kernel, its tokens written there by another: "
                   "no copy-engine hand-over at a step's boundary (kernels/staging.py)")


def kernel_switch_ab(model: str, option: str, about: str, workloads: tuple[str, ...], rounds: int,
                     tokens: bool = True) -> dict:
    """A boolean kernel option that changes no arithmetic, off and on: the tokens under CUDA graphs and eagerly
    (greedy and seeded top-k/top-p; they must be the same), then `workloads` in each arm, interleaved `rounds`
    times."""
    arms = {"off": {option: False}, "on": {option: True}}
    same = same_tokens_by_mode(model, arms, "off") if tokens else None
    runs = Bench(model, (Arm("off", workloads, kernel=arms["off"]),
                         Arm("on", workloads, kernel=arms["on"], about=about)), rounds)()
    return {"tokens": same, "runs": runs, "ok": all(t["ok"] for t in same.values()) if same else None}


def flashinfer_section() -> dict:
    """The FlashInfer backend: kernel checks and timings against Triton and torch, greedy parity in bf16 next to
    the Triton backend, then W2 and W1 on Qwen3-0.6B."""
    fi = {"attention_backend": "flashinfer"}
    return {"kernels": kernels("--backends-only", "triton,flashinfer"),
            "parity": parity(("bfloat16",), (("triton", {}), ("flashinfer", fi),
                                             ("flashinfer_no_cuda_graph", {**fi, "cuda_graph": False}))),
            "bench": Bench("qwen3-0.6b", (Arm("flashinfer", ("w2", "w1"), fi),))()}


def module_check(module: str, **kw) -> Callable[[], dict]:
    """A check whose module has main(out_dir, ...) -> dict, run in this process."""
    def run() -> dict:
        import importlib
        with tempfile.TemporaryDirectory() as tmp:
            return importlib.import_module(module).main(tmp, **kw)
    return run


# --- the table -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    run: Callable[[], dict]
    about: str


def section(run: Callable[[], dict] | Bench, about: str = "") -> Section:
    if isinstance(run, Bench):
        about = about or f"{run.model}: " + ", ".join(f"{a.label} ({'/'.join(a.workloads)})" for a in run.arms) + (
            f"; {run.rounds} rounds, interleaved" if run.rounds > 1 else "")
    return Section(run, about)


SECTIONS: dict[str, Section] = {
    # the card
    "ceilings": section(ceilings, "device-to-device copy bandwidth and bf16 matmul rate, measured now"),
    # the headline and the ablation table (DESIGN.md), Qwen3-0.6B and Qwen3-8B; Qwen3.5; the sweep
    "bench06": section(Bench("qwen3-0.6b", ABLATION_06)),
    "bench8": section(Bench("qwen3-8b", ABLATION_8)),
    "qwen35": section(Bench("qwen3.5-0.8b", (Arm("default", ("w1", "w2", "w3")),))),
    "mixes35": section(lambda: mixes("qwen3.5-0.8b"),
                       "issue 29's Qwen3.5 mixes (512 requests, 16-2k prompts, greedy; 384 in 24 shared-prefix "
                       "groups, mixed sampling), running requests sized from memory"),
    "mix_phases35": section(lambda: mix_phases("qwen3.5-0.8b"),
                            "Qwen3.5 on the 512-request mix: host time per step by phase, each step's batch, and "
                            "each step synchronised and timed (prefill against decode)"),
    "mix_phases06": section(lambda: mix_phases("qwen3-0.6b"),
                            "Qwen3-0.6B on the 512-request mix: host time per step by phase (a burst's mixed steps "
                            "of a prompt chunk and hundreds of decode rows run eagerly: host-bound or not?)"),
    "launch06": section(lambda: launch_profile("qwen3-0.6b"),
                        "Qwen3-0.6B on the 512-request mix: each step launched on an idle device (host launch time "
                        "against device time, by how the step ran), the eager prefill launches under cProfile"),
    "launch06_eager": section(lambda: launch_profile("qwen3-0.6b", **EAGER_MIXED),
                              "the same with the mixed steps eager (prefill graphs up to 4,096 tokens and 64 "
                              "requests, the extend kernel's grid: the defaults before run25)"),
    "gdn_solve35": section(gdn_solve_ab, "Qwen3.5 on the 512-request mix with the chunk prepare's two triangular "
                           "solves (rows, blocks): tok/s and greedy tokens compared"),
    "mixes35_rows256": section(lambda: mixes("qwen3.5-0.8b", max_running_requests=256),
                               "the same mixes at 256 running requests (the old hybrid cap): the sizing's A/B"),
    "sweep06": section(lambda: sweep("qwen3-0.6b"), "the batch-mix sweep on Qwen3-0.6B, defaults"),
    # the standard set alone (one engine with defaults), as earlier leases ran it
    "sample06": section(Bench("qwen3-0.6b", (Arm("default", ("w1", "w1_topkp", "w2")),))),
    "sample8": section(Bench("qwen3-8b", (Arm("default", ("w1", "w1_topkp", "w2")),))),
    "w3_06": section(Bench("qwen3-0.6b", (Arm("default", ("w3",)),))),
    # Hugging Face transformers beside us: W2 on the same weights, greedy parity
    "hf06": section(lambda: hf_peer("qwen3-0.6b"), "transformers W2 peer on Qwen3-0.6B (1 request, 128 tokens)"),
    "hf8": section(lambda: hf_peer("qwen3-8b"), "transformers W2 peer on Qwen3-8B (1 request, 128 tokens)"),
    "parity": section(parity, "greedy tokens against transformers, fp32 and bf16, overlap/CUDA Graph on and off"),
    # the profiler diagnosis
    "profile": section(profile, "Qwen3-0.6B: batch-1/64 decode and a W2 request profiled; a 64-request W1 slice "
                                "with defaults, without overlap, without CUDA graphs"),
    "profile8": section(lambda: profile_slices("qwen3-8b"), "Qwen3-8B: batch-1/64 decode and a W2 request profiled"),
    "sweep_phases06": section(lambda: sweep_phases("qwen3-0.6b"),
                              "the 256-request 1-4k-prompt sweep mix: prefill vs decode step time"),
    # kernel switches A/B'd on W2 (kernel options: lab.engines)
    "merge_ab06": section(w2_pair("qwen3-0.6b", "fused_merge", "two_launch_merge", "decode_fused_merge")),
    "store_ab06": section(w2_pair("qwen3-0.6b", "fused_store", "store_kv", "decode_fused_store")),
    "pdl_ab06": section(Bench("qwen3-0.6b", (
        Arm("pdl", ("w2",)), Arm("no_pdl", ("w2",), kernel={"pdl": False}),
        Arm("pdl_no_early_weights", ("w2",), kernel={"gemv_pdl_early_tiles": 0})), 2)),
    "pdl_ab8": section(Bench("qwen3-8b", (Arm("pdl", ("w2",)), Arm("no_pdl", ("w2",), kernel={"pdl": False})))),
    "early_ab06": section(early_tiles("qwen3-0.6b", (1, 3, 2), rounds=2)),
    "early_ab8": section(early_tiles("qwen3-8b", (1, 3), rounds=1)),
    "wide_ab06": section(lambda: wide_gemv_ab("qwen3-0.6b"),
                         "Qwen3-0.6B: the GEMV tuned with wide K tiles, then W2 with three GEMV tables"),
    "prefetch8": section(lambda: kernel_option_ab("qwen3-8b", {"gemv_prefetch": PREFETCH_ABOUT}, rounds=1),
                         "Qwen3-8B: tokens and W2 with the GEMV's next weight tile loaded before the current one's "
                         "products (the down projection's loop), off and on, one round"),
    "gemv_stages8": section(lambda: arms_ab("qwen3-8b", {"off": ({"gemv_stages": 1}, ""),
                                                          "stages3": ({"gemv_stages": 3}, STAGES_ABOUT.format(3))},
                                            rounds=1),
                            "Qwen3-8B: tokens and W2 with the GEMV's K loop (the down projection's) loaded tile by "
                            "tile and pipelined in 3 stages, one round"),
    "mlp_prefetch06": section(lambda: arms_ab("qwen3-0.6b", MLP_PREFETCH_ARMS, rounds=2),
                              "Qwen3-0.6B: tokens and W2 with the o GEMV asking L2 for the MLP's weights (24 MiB: all "
                              "of them) while the attention runs, off and on, two rounds"),
    "next_kv8": section(lambda: arms_ab("qwen3-8b", NEXT_KV_ARMS, rounds=1),
                        "Qwen3-8B: tokens and W2 with each decode program asking L2 for the next layer's first key "
                        "tile, off and on, one round"),
    "step_tiles06": section(lambda: step_tiles("qwen3-0.6b", 150, rounds=2),
                            "Qwen3-0.6B: the GEMV's tiles tuned inside the batch-1 decode step, then W2 with the "
                            "card's table and with the picks"),
    "step_tiles8": section(lambda: step_tiles("qwen3-8b", 150, rounds=1), "the same on Qwen3-8B, one round"),
    "staged06": section(lambda: staged_ab("qwen3-0.6b", ("w2", "w1"), rounds=2),
                        "Qwen3-0.6B: tokens, then W2 and W1 with a decode graph's inputs copied one by one and "
                        "staged in one copy, interleaved twice"),
    "staged8": section(lambda: staged_ab("qwen3-8b", ("w2",), rounds=1, tokens=False),
                       "the same on Qwen3-8B: W2, one round (the tokens are checked on Qwen3-0.6B)"),
    "staged35": section(lambda: staged_ab("qwen3.5-0.8b", ("w2",), rounds=1),
                        "the same on Qwen3.5-0.8B (its state slots staged too): tokens, then W2, one round"),
    "fused_ends06": section(lambda: kernel_switch_ab("qwen3-0.6b", "sampler_fused_ends", FUSED_ENDS_ABOUT,
                                                     ("w2", "w2_topkp", "w1"), rounds=2),
                            "Qwen3-0.6B: tokens (graphs and eager), then W2, W2 top-k/top-p and W1 with the sampler's "
                            "ends as torch operations and fused, interleaved twice"),
    "fused_ends8": section(lambda: kernel_switch_ab("qwen3-8b", "sampler_fused_ends", FUSED_ENDS_ABOUT,
                                                    ("w2", "w2_topkp"), rounds=1, tokens=False),
                           "the same on Qwen3-8B: W2 and W2 top-k/top-p, one round (the tokens are checked on "
                           "Qwen3-0.6B)"),
    "fused_narrow06": section(lambda: kernel_switch_ab("qwen3-0.6b", "sampler_fused_narrow", FUSED_NARROW_ABOUT,
                                                       ("w2_topkp", "w1_topkp"), rounds=2),
                              "Qwen3-0.6B: tokens (graphs and eager), then W2 and W1 with top-k/top-p, the search's "
                              "narrowing launched on its own and in each pass's last program, interleaved twice"),
    "fused_narrow8": section(lambda: kernel_switch_ab("qwen3-8b", "sampler_fused_narrow", FUSED_NARROW_ABOUT,
                                                      ("w2_topkp",), rounds=1, tokens=False),
                             "the same on Qwen3-8B: W2 top-k/top-p, one round"),
    "zero_copy06": section(lambda: kernel_switch_ab("qwen3-0.6b", "zero_copy_io", ZERO_COPY_ABOUT, ("w2", "w1"),
                                                    rounds=2),
                           "Qwen3-0.6B: tokens (graphs and eager), then W2 and W1 with a step's inputs and tokens "
                           "through the copy engine and through kernels on pinned memory, interleaved twice"),
    "zero_copy8": section(lambda: kernel_switch_ab("qwen3-8b", "zero_copy_io", ZERO_COPY_ABOUT, ("w2",), rounds=1,
                                                   tokens=False),
                          "the same on Qwen3-8B: W2, one round (the tokens are checked on Qwen3-0.6B)"),
    "fold06": section(lambda: kernel_option_ab("qwen3-0.6b", {"gemv_norm_fold": FOLD_ABOUT}),
                      "Qwen3-0.6B: tokens and W2 with the RMSNorms folded into the GEMVs, off and on"),
    "fold8": section(lambda: kernel_option_ab("qwen3-8b", {"gemv_norm_fold": FOLD_ABOUT}, rounds=1),
                     "the same on Qwen3-8B, one round"),
    "fold_sums06": section(lambda: fold_sums_ab("qwen3-0.6b"),
                           "Qwen3-0.6B: tokens and W2 unfolded, folded, and folded with each norm's sums of squares "
                           "added up by the GEMV before"),
    "fold_sums8": section(lambda: fold_sums_ab("qwen3-8b", rounds=1), "the same on Qwen3-8B, one round"),
    "fold_sums06_w2": section(Bench("qwen3-0.6b", w2_arms(FOLD_SUMS_ARMS), 1),
                              "fold_sums06's W2 alone, one round (run31's call stopped before its JSON)"),
    "act06": section(lambda: kernel_option_ab("qwen3-0.6b", {"gemv_act_epilogue": ACT_ABOUT}),
                     "Qwen3-0.6B: tokens and W2 with the MLP's activation in the gate_up GEMV's epilogue, off and on"),
    "act8": section(lambda: kernel_option_ab("qwen3-8b", {"gemv_act_epilogue": ACT_ABOUT}, rounds=1),
                    "the same on Qwen3-8B, one round"),
    "early_meta06": section(lambda: kernel_option_ab("qwen3-0.6b", {"early_metadata": EARLY_META_ABOUT}),
                            "Qwen3-0.6B: tokens and W2 with the decode kernels' and RoPE's metadata read before "
                            "their PDL wait, off and on"),
    "early_meta8": section(lambda: kernel_option_ab("qwen3-8b", {"early_metadata": EARLY_META_ABOUT},
                                                    rounds=1), "the same on Qwen3-8B, one round"),
    "fused_rope06": section(lambda: kernel_option_ab("qwen3-0.6b", DECODE_LINKS),
                            "Qwen3-0.6B: tokens and W2 with the decode step's RoPE inside the decode attention "
                            "kernel, with its first key tile read before the PDL wait, each alone and both"),
    "fused_merge06": section(lambda: kernel_option_ab("qwen3-0.6b", {"decode_fused_merge": FUSED_MERGE_ABOUT}),
                             "Qwen3-0.6B: tokens and W2 with the decode splits merged in the first launch, off and "
                             "on (run10 found it slower, before PDL's early loads)"),
    "links06": section(lambda: kernel_option_ab("qwen3-0.6b", DECODE_LINKS, each=False),
                       "Qwen3-0.6B: fused_rope06's arms both off and both on only"),
    "fused_rope8": section(lambda: kernel_option_ab("qwen3-8b", DECODE_LINKS, rounds=1),
                           "the same on Qwen3-8B, one round"),
    "megakernel06": section(lambda: megakernel_ab("qwen3-0.6b"),
                            "Qwen3-0.6B: tokens and W2 with a one-row decode step's layers in one persistent "
                            "kernel: off, on, on with 168 registers a thread"),
    "megakernel8": section(lambda: megakernel_ab("qwen3-8b", rounds=1), "the same on Qwen3-8B, one round"),
    "rope_tokens06": section(lambda: kernel_option_ab("qwen3-0.6b", {"decode_fused_rope":
                                                                     DECODE_LINKS["decode_fused_rope"]}, rounds=0),
                             "Qwen3-0.6B: tokens with the fused RoPE off and on, under CUDA graphs and eagerly "
                             "(fused_rope06's token check alone, for a lease's last minutes)"),
    "early_kv35": section(lambda: kernel_option_ab("qwen3.5-0.8b", {"early_kv": DECODE_LINKS["early_kv"]},
                                                   rounds=1),
                          "Qwen3.5-0.8B: tokens and W2 with the early keys off and on (its full-attention layers' "
                          "decode kernel; its partial rotary keeps the RoPE kernel), one round"),
    "wide_ab8": section(lambda: wide_gemv_ab("qwen3-8b"), "the same on Qwen3-8B"),
    # GPU self-checks
    "kernels": section(kernels, "Triton kernels against torch references (lab.checks.kernels)"),
    "kernels_backends": section(lambda: kernels("--backends-only", "triton"),
                                "the Triton backend against the torch backend (mixed steps, graph replays)"),
    "decode_merge": section(lambda: kernels("--decode-merge-only"), "decode split merge: fused vs two launches"),
    "extend_tiles_check": section(lambda: kernels("--extend-tiles-only"),
                                  "the extend kernel in prefill-graph shapes: the graph's grid against its tile list"),
    "decode_store": section(lambda: kernels("--decode-store-only"), "decode K/V store: fused vs store_kv first"),
    "gdn_check": section(lambda: child_check("lab.checks.gdn", "--quick"), "Gated DeltaNet kernels, timed"),
    "sampling_check": section(module_check("lab.checks.sampling"), "the fused sampler against its reference"),
    "prefill_check": section(module_check("lab.checks.prefill_graphs"), "prefill graphs against eager steps"),
    "prefill_check_grid": section(module_check("lab.checks.prefill_graphs", w2=False,
                                               every_engine={"extend_tiles": False}),
                                  "the same with the extend kernel on its grid (--disable-extend-tiles)"),
    "tiles_ab06": section(Bench("qwen3-0.6b", (
        Arm("grid", ("w1", "w3", "w4"), kernel={"extend_tiles": False},
            about="the extend kernel's grid: every request x the longest extend"),
        Arm("tiles", ("w1", "w3", "w4"), kernel={"extend_tiles": True},
            about="the extend kernel from the step's tile list (kernel option extend_tiles)")), 2)),
    "options_check": section(module_check("lab.checks.engine_options"),
                             "issue 27: W1/W2 at defaults beside run13; two engines with different kernel options "
                             "in one process, each graph keeping its own"),
    "pdl_check": section(pdl_check, "PDL: a kernel chain captured with PDL on/off, then engine tokens"),
    "warmup_check": section(lambda: child_check("lab.checks.warmup"),
                            "issue 29, ~7 min: engine start with the kernel warm-up on/off (cold and warm Triton "
                            "caches), compiles in W1/W2 and the first-vs-second W1 generate, a start under cProfile, "
                            "a process each; Qwen3-0.6B, and Qwen3.5-0.8B's cold start"),
    "warmup_sweep": section(lambda: child_check("lab.checks.warmup", "--models", "qwen3-0.6b", "--arms", "on_cold",
                                                "--sweep"),
                            "issue 29, ~2.5 min: the same on Qwen3-0.6B, warm-up on, cold cache, with the sweep"),
    "qwen35_check": section(qwen35_check, "Qwen3.5 greedy tokens with graphs on/off and a radix second pass"),
    "flashinfer": section(flashinfer_section, "the FlashInfer backend: kernel checks, parity, W2 and W1"),
    "tune_sampling": section(module_check("lab.tune.sampling"), "the fused sampler's launch shapes, timed"),
}


def describe() -> str:
    """One line per section (for --help)."""
    return "\n".join(f"  {name:16} {sec.about}" for name, sec in SECTIONS.items())
