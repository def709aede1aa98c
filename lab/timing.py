"""GPU timing for the lab: CUDA-event medians of a call or of a captured graph, and graph capture.

One helper for every check and tune (before: each script timed its own way). Each returns the median of
`iters` timings in microseconds; a timing is `per` calls between one pair of events (per > 1 for calls too short
to time one by one).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture(fn: Callable, warmups: int = 1):
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


def time_us(fn: Callable, iters: int = 50, warmups: int = 5, per: int = 1) -> float:
    """Median microseconds of one call of fn (eager), `per` calls between each pair of CUDA events."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        for _ in range(per):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    return statistics.median(times)


def time_replay_us(graph: torch.cuda.CUDAGraph, iters: int = 50, warmups: int = 3, per: int = 1) -> float:
    """Median microseconds of one replay of a captured graph."""
    return time_us(graph.replay, iters=iters, warmups=warmups, per=per)


def time_graph(fn: Callable, iters: int = 50, warmups: int = 1) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph (fn run `warmups` times first)."""
    graph, _ = capture(fn, warmups)
    return time_replay_us(graph, iters=iters, warmups=0)


def time_graph_or_eager(fn: Callable, iters: int = 50, per: int = 1) -> tuple[float, str]:
    """Median microseconds of fn captured in a CUDA graph, or, where it cannot be captured (e.g. a cooperative
    launch on a driver that refuses one in a graph), of fn called eagerly: (us, "graph" or "eager: <why>")."""
    try:
        graph, _ = capture(fn)
    except RuntimeError as e:
        torch.cuda.synchronize()
        return time_us(fn, iters=iters, per=per), f"eager: {str(e).splitlines()[0][:200]}"
    return time_replay_us(graph, iters=iters, per=per), "graph"
