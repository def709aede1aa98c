"""CUDA Graph capture and timing shared by the GPU check scripts (gpu_kernel_check, gpu_sampling_check,
gpu_sampling_tune, gpu_gdn_check)."""

from __future__ import annotations

import statistics

import torch


def capture(fn, warmups: int = 1):
    """Run fn `warmups` times on a side stream (compiles, lazy initialisation, autotuning must not be
    captured), then capture it: (graph, fn's output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_graph(fn, iters: int = 50, warmups: int = 1) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph, one CUDA-event pair per replay."""
    graph, _ = capture(fn, warmups)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
