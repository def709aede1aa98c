"""Run the standard workloads on an engine and return plain dicts of numbers (JSON-ready)."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from minisgl.bench.host import host_probe_ms
from minisgl.bench.workloads import WORKLOADS, Workload
from minisgl.environment import git_commit_override
from minisgl.sampling_params import SamplingParams


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(llm, n: int = 8, out: int = 16) -> None:
    """Compile every kernel variant a workload will use before the clock starts: short and chunk-sized
    prompts (mixed prefill + decode steps), greedy and temperature sampling (the fused sampler), with and
    without top-k/top-p."""
    vocab = llm.engine.model_config.vocab_size
    chunk = llm.config.prefill_budget
    longest = llm.engine.max_model_len - out - 1
    # the first length is a real prefill, so warm_up(n=1) also compiles the extend kernels
    lengths = [min(n, longest) for n in (64, 1, 17, 200, 513, chunk + 100)]
    prompts = [[(7 * i + j) % vocab for j in range(lengths[i % len(lengths)])] for i in range(n)]
    # greedy, temperature, and top-k/top-p rows: every sampler variant compiles before the clock starts
    cuts = [{}, {}, {"top_k": 50, "top_p": 0.95}]
    params = [SamplingParams(temperature=0.6 if i % 2 else 0.0, max_tokens=out, ignore_eos=True, **cuts[i % 3])
              for i in range(n)]
    llm.generate(prompts, params, progress=False)


def triton_variants() -> dict[str, int]:
    """Compiled variants of each of minisgl's Triton kernels held by this process. A variant that first appears
    inside a timed region means a compile (or a disk-cache load) was timed: the runners record the difference."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return {}
    from minisgl.kernels import attention, elementwise, gdn, gemv, sampling
    counts = {}
    # gdn: Qwen3.5's linear-attention kernels (before, a compile of theirs in a timed run went unreported); gemv:
    # the decode GEMV (a variant per row count, 1-4)
    for mod in (attention, elementwise, gdn, gemv, sampling):
        for name, fn in vars(mod).items():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", {}).values()
                counts[name] = sum(len(c[0]) for c in caches if isinstance(c, tuple) and isinstance(c[0], dict))
    return counts


def _new_variants(before: dict[str, int]) -> dict[str, int]:
    after = triton_variants()
    return {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}


def _engine_stats(llm) -> dict:
    e = llm.engine
    s = dict(e.stats)
    s["cuda_graph_hit_rate"] = (s["graph_steps"] / s["decode_steps"]) if s["decode_steps"] else None
    s["retractions"] = e.scheduler.num_retractions
    # the sizes the engine chose (max_running_requests 0/None = sized from memory) and the decode graphs' sizes
    s["max_running_requests"] = e.scheduler.max_running
    graphs = e.runner.graph_runner
    s["cuda_graph_batch_sizes"] = list(graphs.batch_sizes) if graphs is not None else []
    # the kernel options the engine ran with (environment defaults included): settings of the run, in every result
    s["kernel_options"] = dataclasses.asdict(e.config.kernels)
    return s


def _reset_stats(llm) -> None:
    for k in llm.engine.stats:
        llm.engine.stats[k] = 0


def run_throughput(llm, w: Workload) -> dict:
    """All requests at once, from an empty prefix cache; output tokens per second of wall time."""
    # a workload run after another on the same engine (W1 then W1 top-k/top-p: the same prompts) must not find
    # them cached: on the H200 that made the second W1 skip 99.8% of its prefill (reports/h200/run6)
    flush_prefix_cache(llm)
    warm_up(llm)
    _reset_stats(llm)
    variants = triton_variants()
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(w.prompts, w.params)
    _sync()
    wall = time.perf_counter() - t0
    produced = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in w.prompts)
    cached = sum(o.num_cached_prompt_tokens for o in outs)
    return {
        "requests": len(w.prompts), "prompt_tokens": prompt_tokens, "output_tokens": produced,
        "expected_output_tokens": w.total_output_tokens, "wall_s": wall,
        "output_tok_per_s": w.total_output_tokens / wall, "total_tok_per_s": (prompt_tokens + produced) / wall,
        "cached_prompt_tokens": cached, "cached_prompt_share": cached / prompt_tokens,
        "ttft_ms_median": 1e3 * statistics.median(o.ttft for o in outs),
        "ttft_ms_p99": 1e3 * sorted(o.ttft for o in outs)[int(0.99 * (len(outs) - 1))],
        "engine": _engine_stats(llm), "triton_compiles_timed": _new_variants(variants),
    }


def run_latency(llm, w: Workload) -> dict:
    """One request at a time: TTFT and TPOT = (end-to-end - TTFT) / (outputs - 1), medians."""
    warm_up(llm, n=1)
    _reset_stats(llm)
    variants = triton_variants()
    ttfts, tpots, lengths = [], [], []
    for prompt, p in zip(w.prompts, w.params):
        _sync()
        out = llm.generate([prompt], p, progress=False)[0]
        lengths.append(len(out.token_ids))  # fewer than max_tokens when a stop (or a grammar's end) came first
        ttfts.append(out.ttft)
        tpots.append((out.latency - out.ttft) / max(len(out.token_ids) - 1, 1))
    return {
        "requests": len(w.prompts), "output_tokens_each": w.params[0].max_tokens,
        "ttft_ms_median": 1e3 * statistics.median(ttfts), "tpot_ms_median": 1e3 * statistics.median(tpots),
        "ttft_ms": [1e3 * x for x in ttfts], "tpot_ms": [1e3 * x for x in tpots], "output_tokens": lengths,
        "engine": _engine_stats(llm), "triton_compiles_timed": _new_variants(variants),
    }


def run_interference(llm, w: Workload) -> dict:
    """W4: long prompts arrive while short requests decode; the decoders' worst inter-token gap."""
    warm_up(llm)
    _reset_stats(llm)
    variants = triton_variants()
    engine = llm.engine
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    short = [engine.add_request(p, sp) for p, sp in zip(w.prompts, w.params)]
    while not all(r.output_ids for r in short):
        engine.step()
    t_arrive = time.perf_counter()
    long = [engine.add_request(p, sp) for p, sp in zip(w.late_prompts, w.late_params)]
    for r in long:
        r.arrival_time = t_arrive
    engine.run(short + long)
    gaps = []
    for r in short:
        times = [t for t in r.token_times if t >= t_arrive - 1.0]  # gaps around the long prompts' arrival
        gaps += [b - a for a, b in zip(times, times[1:])]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "short_requests": len(short), "long_requests": len(long), "long_prompt_tokens": len(w.late_prompts[0]),
        "worst_decode_gap_ms": 1e3 * max(gaps) if gaps else None,
        "median_decode_gap_ms": 1e3 * statistics.median(gaps) if gaps else None,
        "long_ttft_ms": [1e3 * (r.first_token_time - t_arrive) for r in long],
        "peak_gpu_memory_bytes": peak, "engine": _engine_stats(llm), "triton_compiles_timed": _new_variants(variants),
    }


RUNNERS = {"w1": run_throughput, "w1_topkp": run_throughput, "w2": run_latency, "w2_topkp": run_latency,
           "w3": run_throughput, "w4": run_interference}


def flush_prefix_cache(llm) -> None:
    """Empty the prefix cache, so the next workload finds none of the previous one's prompts."""
    cache = llm.engine.cache
    cache.evict(cache.cached_pages)


def run_sweep(llm, cells=None) -> dict:
    """Every cell of the batch-mix sweep (workloads.sweep_cells), each from an empty prefix cache."""
    from minisgl.bench.workloads import sweep_cells, sweep_workload
    vocab = llm.engine.model_config.vocab_size
    results = {}
    for cell in cells or sweep_cells():
        flush_prefix_cache(llm)
        results[cell.name] = {"cell": vars(cell), **run_throughput(llm, sweep_workload(cell, vocab))}
    return results


def run_workload(llm, name: str, scale: float = 1.0) -> dict:
    vocab = llm.engine.model_config.vocab_size
    w = WORKLOADS[name](scale=scale, vocab=min(vocab, 10000))
    return RUNNERS[name](llm, w)


def environment() -> dict:
    """What the numbers were measured with: commit, versions, hardware. (The engine's settings, kernel options
    included, are in each result's "engine" and in the CLI's "settings".)"""
    def git(*args):
        try:
            return subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL).strip()
        except Exception:
            return None
    import transformers
    # a copy of the tree without .git (the GPU machine) gets the commit from the caller
    commit, dirty = git_commit_override()
    env = {
        "git_commit": commit or git("rev-parse", "HEAD"),
        "git_dirty": dirty if dirty is not None else bool(git("status", "--porcelain")),
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host_probe_ms": host_probe_ms(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


def newest_sections(folder) -> dict[str, dict]:
    """For each section of the results files in `folder` (lab/run.py's JSON), its newest result across
    the files: {section: {"result": ..., "file": file name, "environment": that file's environment}}."""
    from pathlib import Path

    found: dict[str, dict] = {}
    for path in sorted(Path(folder).glob("*.json")):
        data = json.loads(path.read_text())
        env = data.get("environment", {})
        stamp = env.get("time_utc", "")
        for name, sec in data.get("sections", {}).items():
            if "result" in sec and (name not in found or stamp >= found[name]["environment"].get("time_utc", "")):
                found[name] = {"result": sec["result"], "file": path.name, "environment": env}
    return found


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
