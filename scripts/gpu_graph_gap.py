#!/usr/bin/env python
"""Does a fuller card space out the kernels of a CUDA graph? A bare test of one hypothesis, no engine.

The batch-1 decode step's kernels start ~0.46 us after one another in this engine against ~0.12 us at 0d384c4
(reports/h200/run8/DECODE_STEP.md); the number of graphs was ruled out (run10). The engine now leaves the card
fuller (a larger KV pool). Here one graph of `--kernels` tiny kernels (an in-place add on 4 KB) is timed by
replaying it back to back, on a card that holds: nothing else; then more and more memory in the chunks the KV pool
uses (one K and one V buffer per layer); re-capturing the graph at each fill as well. Per kernel = replay time /
kernels (duration + launch gap; the kernel itself is ~1 us). JSON under --out.

    python scripts/gpu_graph_gap.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from minisgl.bench.runner import environment  # noqa: E402


def capture(n: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1.0)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(n):
            x.add_(1.0)
    return graph


def us_per_kernel(graph: torch.cuda.CUDAGraph, n: int, replays: int) -> float:
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # best of three runs of `replays` back-to-back replays
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=56, help="allocations the fill is split into (K and V x 28)")
    ap.add_argument("--fills", default="0,0.25,0.5,0.75,0.9", help="fractions of the free memory to fill")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    x = torch.zeros(1024, device="cuda")
    first = capture(args.kernels, x)
    free0, total = torch.cuda.mem_get_info()
    held: list[torch.Tensor] = []
    rows = []
    for fill in (float(f) for f in args.fills.split(",")):
        want = int(free0 * fill) - sum(t.numel() for t in held)
        if want > 0:
            per = want // args.chunks
            held += [torch.empty(per, dtype=torch.uint8, device="cuda") for _ in range(args.chunks)]
            for t in held[-args.chunks:]:
                t.zero_()  # touch every page
        torch.cuda.synchronize()
        fresh = capture(args.kernels, x)
        free, _ = torch.cuda.mem_get_info()
        row = {"fill": fill, "held_gib": sum(t.numel() for t in held) / 2**30, "free_gib": free / 2**30,
               "first_graph_us_per_kernel": us_per_kernel(first, args.kernels, args.replays),
               "fresh_graph_us_per_kernel": us_per_kernel(fresh, args.kernels, args.replays)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del fresh
    result = {"environment": environment(), "kernels": args.kernels, "replays": args.replays,
              "chunks": args.chunks, "total_gib": total / 2**30, "rows": rows,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph_gap.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
