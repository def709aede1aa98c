"""A torch.profiler trace of a slice of W1, reduced to the numbers that explain a step's time.

GPU busy fraction (union of kernel time over the window), the CPU gap between kernels (the rest of the
window), kernels per decode step, and the CUDA Graph hit rate. The kernel intervals are kept (trimmed)
so the report can draw a timeline.
"""

from __future__ import annotations

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


def profile_w1_slice(llm, num_requests: int = 64, warm_steps: int = 40, steps: int = 30,
                     keep_intervals: int = 3000) -> dict:
    from torch.profiler import ProfilerActivity, profile

    w = w1_offline()
    engine = llm.engine
    reqs = [engine.add_request(p, sp) for p, sp in zip(w.prompts[:num_requests], w.params[:num_requests])]
    for _ in range(warm_steps):  # past the prefills, into steady decoding
        engine.step()
    before = dict(engine.stats)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    after = dict(engine.stats)
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
        "timeline_us": timeline,
    }
