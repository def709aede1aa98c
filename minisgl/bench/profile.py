"""A torch.profiler trace of a slice of W1, reduced to the numbers that explain a step's time.

GPU busy fraction (union of kernel time over the window), the CPU gap between kernels (the rest of the
window), kernels per decode step, and the CUDA Graph hit rate. The kernel intervals are kept (trimmed)
so the report can draw a timeline.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from minisgl.bench.workloads import w1_offline


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


_KINDS = (  # (kind, name fragments), first match wins; names are lower-cased kernel names
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "cublas")),
    ("attention", ("decode_stage", "_extend_kernel", "batchdecode", "batchprefill", "flashinfer")),
    ("gdn", ("_gdr_", "_conv_")),  # Qwen3.5's Gated DeltaNet kernels (kernels/gdn.py)
    ("norm", ("rms_norm", "norm")),
    ("rope", ("rope",)),
    ("kv_store", ("store_kv",)),
    ("silu_and_mul", ("silu",)),
    ("sampling", ("gumbel", "argmax", "softmax", "topk", "sort")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, frags in _KINDS if any(f in low for f in frags)), "other")


def _time_by_kind(kernels) -> dict[str, list]:
    """{kind: [kernel count, summed kernel time in us]} of profiler kernel events."""
    by_kind: dict[str, list] = {}
    for e in kernels:
        entry = by_kind.setdefault(kernel_kind(e.name), [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    return by_kind


PHASES = ("schedule", "launch", "wait")


@dataclass
class PhaseTimes:
    """Host seconds of the engine's steps by phase: scheduling, preparing and launching the step (the runner's
    forward), waiting for the device's tokens. `steps` holds each step's (whole step, schedule, launch, wait)."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: list[tuple[float, float, float, float]] = field(default_factory=list)


def adding_seconds(totals: dict[str, float], name: str, fn: Callable) -> Callable:
    """`fn`, each call of which adds its seconds to totals[name]."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


@contextlib.contextmanager
def timed_phases(engine) -> Iterator[PhaseTimes]:
    """Time every `engine.step()` inside the block by phase, without the profiler (wrappers on the scheduler's
    schedule, the runner's forward, StepOutput.wait and the engine's step; the class's methods come back after)."""
    from minisgl.engine.model_runner import StepOutput

    times, current = PhaseTimes(), dict.fromkeys(PHASES, 0.0)

    def step_timed(fn):
        def wrapper(*args, **kwargs):
            for k in current:
                current[k] = 0.0
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.steps.append((time.perf_counter() - t0, *(current[k] for k in PHASES)))
                for k in PHASES:
                    times.totals[k] += current[k]
        return wrapper

    sched, runner, original_wait = engine.scheduler, engine.runner, StepOutput.wait
    sched.schedule = adding_seconds(current, "schedule", sched.schedule)
    runner.forward = adding_seconds(current, "launch", runner.forward)
    StepOutput.wait = adding_seconds(current, "wait", original_wait)
    engine.step = step_timed(engine.step)
    try:
        yield times
    finally:  # back to the class's methods
        del sched.schedule, runner.forward, engine.step
        StepOutput.wait = original_wait


@dataclass
class GcPauses:
    """Python's garbage collections inside a block: how many, their seconds, the longest, and each full one
    (generation 2: when, in seconds from the block's start, and its ms). A long one holds up the host's next
    launch, and the device waits."""

    collections: int = 0
    seconds: float = 0.0
    longest_s: float = 0.0
    full_collections: list[tuple[float, float]] = field(default_factory=list)

    @property
    def full(self) -> int:
        return len(self.full_collections)

    def as_dict(self) -> dict:
        return {"collections": self.collections, "seconds": round(self.seconds, 4), "full": self.full,
                "longest_s": round(self.longest_s, 4)}


@contextlib.contextmanager
def gc_pauses() -> Iterator[GcPauses]:
    """Count and time the garbage collections that run inside the block (gc.callbacks)."""
    import gc

    pauses, started, t0 = GcPauses(), [], time.perf_counter()

    def on_gc(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            now = time.perf_counter()
            took = now - started.pop()
            pauses.collections += 1
            pauses.seconds += took
            pauses.longest_s = max(pauses.longest_s, took)
            if info["generation"] == 2:
                pauses.full_collections.append((round(now - t0, 3), round(1e3 * took, 1)))

    gc.callbacks.append(on_gc)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on_gc)


def host_phases(engine, steps: int) -> dict:
    """Host time per step by phase (`timed_phases`), in ms, with the rest of a step (handing tokens to requests,
    releasing finished ones) as `other`. Under the overlap loop `wait` is the device's lead over the host: near
    zero means the host is the bottleneck."""
    with timed_phases(engine) as times:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    per_step = {k: 1e3 * v / steps for k, v in times.totals.items()}
    per_step["other"] = 1e3 * total / steps - sum(per_step.values())
    per_step["step"] = 1e3 * total / steps
    return per_step


def profile_w1_slice(llm, num_requests: int = 64, warm_steps: int = 40, steps: int = 30,
                     keep_intervals: int = 3000, top: int = 12) -> dict:
    """`profile_slice` of W1's first `num_requests` requests: past their prefills, into steady decoding."""
    w = w1_offline()
    return profile_slice(llm, w.prompts[:num_requests], w.params[:num_requests], warm_steps, steps,
                         keep_intervals, top)


def profile_slice(llm, prompts: list, params: list, warm_steps: int, steps: int, keep_intervals: int = 0,
                  top: int = 12) -> dict:
    """The requests added at once, `warm_steps` steps unprofiled, then `steps` steps under the profiler (kernel
    time by kind and name, GPU busy fraction, graph hits) and as many again timed by host phase; then every
    request is aborted and the engine drained."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    num_requests = len(reqs)
    for _ in range(warm_steps):  # past the prefills, into steady decoding
        engine.step()
    before = dict(engine.stats)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    after = dict(engine.stats)
    host = host_phases(engine, steps)  # the same steady state, without the profiler's overhead
    for r in reqs:
        engine.abort(r)
    while engine.has_work:
        engine.step()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    window = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    busy = _union_length(intervals)
    n_steps = after["steps"] - before["steps"]
    n_decode = after["decode_steps"] - before["decode_steps"]
    n_graph = after["graph_steps"] - before["graph_steps"]
    by_kind = _time_by_kind(kernels)
    by_name: dict[str, float] = {}
    counts: dict[str, int] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.time_range.end - e.time_range.start
        counts[e.name[:80]] = counts.get(e.name[:80], 0) + 1
    per_step = max(n_steps, 1)
    t0 = min((s for s, _ in intervals), default=0.0)
    timeline = [[round(e.time_range.start - t0, 2), round(e.time_range.end - e.time_range.start, 2), e.name[:60]]
                for e in sorted(kernels, key=lambda e: e.time_range.start)[:keep_intervals]]
    return {
        "requests": num_requests, "profiled_steps": n_steps, "decode_steps": n_decode, "graph_steps": n_graph,
        "window_ms": window / 1e3, "gpu_busy_ms": busy / 1e3,
        "gpu_busy_fraction": busy / window if window else None,
        "cpu_gap_ms": (window - busy) / 1e3, "kernels": len(kernels),
        "kernels_per_step": len(kernels) / n_steps if n_steps else None,
        "step_ms": window / 1e3 / n_steps if n_steps else None,
        "cuda_graph_hit_rate": n_graph / n_decode if n_decode else None,
        "host_ms_per_step_unprofiled": host,
        # per step: kernel count and summed kernel time (ms) of each kind, e.g. how much of a step is GEMMs
        "by_kind_per_step": {k: {"kernels": n / per_step, "ms": t / 1e3 / per_step} for k, (n, t) in by_kind.items()},
        "top_kernels_ms_per_step": {k: t / 1e3 / per_step
                                    for k, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]},
        "kernel_counts_per_step": {k: n / per_step for k, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]},
        "timeline_us": timeline,
    }


def profile_request(llm, prompt: list[int], max_tokens: int = 2, profiled: bool = True) -> dict:
    """One request alone (W2's shape): where its time to first token goes. Host time of the prefill step
    (schedule + prepare + launching every kernel) against the device's kernel time, by kind. The profiler
    slows the host down: `profiled=False` gives the undisturbed host and TTFT times (no kernel breakdown)."""
    import contextlib
    import time

    from torch.profiler import ProfilerActivity, profile

    from minisgl.sampling_params import SamplingParams

    engine = llm.engine
    torch.cuda.synchronize()
    ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profiled else contextlib.nullcontext()
    with ctx as prof:
        req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()  # schedules and launches the prefill
        t_launched = time.perf_counter()
        while engine.has_work:
            engine.step()
        torch.cuda.synchronize()
    timing = {"prompt_tokens": len(prompt), "cached_prompt_tokens": req.num_cached_prompt_tokens,
              "ttft_ms": 1e3 * (req.first_token_time - req.arrival_time),
              "prefill_host_launch_ms": 1e3 * (t_launched - t0)}
    if not profiled:
        return timing
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_kind = _time_by_kind(kernels)
    host_ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    return {**timing,
        "gpu_busy_ms": _union_length(intervals) / 1e3,
        "top_host_ops_ms": {a.key[:80]: a.self_cpu_time_total / 1e3 for a in host_ops},
        "kernels": len(kernels),
        "by_kind": {k: {"kernels": n, "ms": t / 1e3} for k, (n, t) in by_kind.items()},
    }
