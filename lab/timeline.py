"""Where a batch-1 greedy decode step spends its time on the GPU: kernels and the idle gaps between them.

    python -m lab.timeline --out DIR [--model qwen3-8b] [--label NAME] [--set SWITCH=VALUE ...]
    cd /tmp && PYTHONPATH=$OLD:$REPO python -m lab.timeline --out DIR --label base    # an older package's step

W2's setting (one request, greedy, a 512-token prompt) on Qwen3-0.6B (or --model: a name of lab.models or a
config folder) with dummy bf16 weights; writes DIR/decode_timeline_<label>.json.
After warm-up, 20 decode steps run under torch.profiler; the script writes every GPU activity (kernels and
copies) of the window with its start and duration, the gaps where the GPU idles, the host calls (graph
launches, copies, kernel launches) that precede each large gap, and the unprofiled time per step.
Besides (issue 13's 0.12 ms):
- `host_phases`: the host's time per step by phase, unprofiled (schedule / launch / wait for the tokens), from
  the package's own minisgl.bench.profile when it has one;
- `kernel_gap_us`: the mean gap between two kernels that follow each other within 3 us (inside a graph), in the
  engine's window and in `bare_replay`: the graphs a greedy batch-1 step replays, replayed back to back with
  nothing else on the host (timed unprofiled, then profiled). A slower bare replay means the graph itself runs
  slower (its kernels further apart), whatever the host does around it;
- `--set` passes engine switches (e.g. `--set prefill_graph_max_tokens=0 --set cuda_graph_max_bs=8`: fewer graphs).
Works with any minisgl version that has `LLM`, `engine.add_request` and `engine.step`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time

import torch

import minisgl
from lab.models import MODELS, model_path
from lab.timing import time_us
from minisgl import LLM, SamplingParams
from minisgl.bench.runner import environment


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="current")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="qwen3-0.6b", help=f"one of {', '.join(MODELS)}, or a config folder")
    ap.add_argument("--set", action="append", default=[], metavar="SWITCH=VALUE",
                    help="an engine switch (EngineConfig field), e.g. prefill_graph_max_tokens=0; repeatable")
    a = ap.parse_args()
    switches = {}
    for item in a.set:
        key, value = item.split("=", 1)
        try:
            switches[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            switches[key] = value
    if not torch.cuda.is_available():
        print("decode_timeline: no CUDA device, nothing to profile")
        return
    from torch.profiler import ProfilerActivity, profile

    t_start = time.perf_counter()
    llm = LLM(model_path(a.model) if a.model in MODELS else a.model, load_format="dummy", dtype="bfloat16", **switches)
    startup_s = time.perf_counter() - t_start  # weights, KV pool and every graph's capture
    engine = llm.engine
    prompt = [(31 * i) % 10000 for i in range(512)]
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # warm-up
    req = engine.add_request(list(reversed(prompt)), params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    unprofiled_ms = (time.perf_counter() - t0) * 1e3 / 100
    phases = host_phases(engine, 100)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
    bare = bare_replay(engine)  # the request's last step is still in the graphs' buffers
    engine.abort(req)
    while engine.has_work:
        engine.step()
    events = prof.events()
    gpu = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    host = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")),
                  key=lambda e: e.time_range.start)
    t_first = gpu[0].time_range.start
    acts = [[round(e.time_range.start - t_first, 2), round(e.time_range.end - e.time_range.start, 2), e.name[:70]]
            for e in gpu]
    gaps = []
    end = gpu[0].time_range.end
    for prev, e in zip(gpu, gpu[1:]):
        idle = e.time_range.start - max(end, prev.time_range.end)
        end = max(end, e.time_range.end)
        if idle > 3:
            # the host calls issued in the 40 us before the kernel that ends the gap
            calls = [h.name for h in host if e.time_range.start - 40 <= h.time_range.start <= e.time_range.start]
            gaps.append({"at_us": round(e.time_range.start - t_first, 1), "idle_us": round(idle, 1),
                         "after": prev.name[:60], "before": e.name[:60], "host_calls": calls[-6:]})
    window = gpu[-1].time_range.end - t_first
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    by_host: dict[str, list] = {}
    for h in host:
        s = by_host.setdefault(h.name, [0, 0.0])
        s[0] += 1
        s[1] += h.time_range.end - h.time_range.start
    out = {
        "label": a.label, "model": a.model, "root": package_root(),
        "environment": environment(), "command": "python -m lab.timeline " + " ".join(sys.argv[1:]),
        "switches": switches, "graphs": graph_counts(engine), "startup_s": round(startup_s, 2),
        # how full the card is: one hypothesis for the wider kernel-to-kernel gap is address translation over a
        # nearly full memory (test with --set kv_memory_fraction=0.3)
        "memory_gib": {"allocated": round(torch.cuda.memory_allocated() / 2**30, 2),
                       "reserved": round(torch.cuda.memory_reserved() / 2**30, 2),
                       "free_on_card": round(torch.cuda.mem_get_info()[0] / 2**30, 2)},
        "unprofiled_ms_per_step": unprofiled_ms, "host_phases": phases, "profiled_steps": a.steps,
        "window_us": window, "gpu_busy_us_sum": busy, "gpu_activities": len(gpu),
        "activities_per_step": len(gpu) / a.steps, "idle_us_per_step": sum(g["idle_us"] for g in gaps) / a.steps,
        "kernel_gap_us": kernel_gap_us(gpu), "bare_replay": bare,
        "gaps_over_3us": gaps[:200], "host_cuda_calls": {k: [v[0], round(v[1], 1)] for k, v in by_host.items()},
        "activities": acts[:3000],
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"decode_timeline_{a.label}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(a.label, "unprofiled ms/step", round(unprofiled_ms, 3), "idle us/step", round(out["idle_us_per_step"], 1),
          "activities/step", out["activities_per_step"], "kernel gap us", out["kernel_gap_us"], flush=True)
    print(a.label, "host phases ms/step", phases, flush=True)
    print(a.label, "bare replay", {k: v for k, v in bare.items() if k != "keys"}, "graphs", out["graphs"],
          "startup s", out["startup_s"], flush=True)


def package_root() -> str:
    """"this checkout" when the minisgl measured is this repository's, else the folder it came from (an A/B)."""
    from lab import REPO
    root = os.path.dirname(os.path.dirname(os.path.abspath(minisgl.__file__)))
    return "this checkout" if os.path.samefile(root, REPO) else root


def host_phases(engine, steps: int) -> dict | None:
    """The package's own host-phase timer (minisgl.bench.profile.host_phases), when it has one."""
    try:
        from minisgl.bench.profile import host_phases as phases
    except ImportError:
        return None
    return {k: round(v, 4) for k, v in phases(engine, steps).items()}


def kernel_gap_us(gpu) -> float | None:
    """Mean gap between consecutive GPU activities that follow within 3 us: the spacing inside a graph."""
    gaps = [b.time_range.start - a.time_range.end for a, b in zip(gpu, gpu[1:])]
    close = [g for g in gaps if 0 <= g <= 3]
    return round(sum(close) / len(close), 4) if close else None


def graph_counts(engine) -> dict:
    runner = engine.runner
    decode = getattr(getattr(runner, "graph_runner", None), "graphs", None) or {}
    prefill = getattr(getattr(runner, "prefill_graph", None), "graphs", None) or {}
    return {"decode": len(decode), "prefill": len(prefill)}


def step_graphs(graph_runner) -> list:
    """The graphs a greedy batch-1 step replays, in order, in any version of the runner: keyed by batch size
    (the forward alone), by (batch size, "forward") and (batch size, "greedy"), or by (batch size, "greedy")."""
    graphs = graph_runner.graphs
    if 1 in graphs:
        return [(1, graphs[1])]
    return [(k, graphs[k]) for k in ((1, "forward"), (1, "greedy")) if k in graphs]


def bare_replay(engine, n: int = 200, profiled: int = 20) -> dict:
    """Replay the batch-1 step's graphs back to back, nothing else on the host: GPU time per step and the gap
    between the graphs' kernels. Safe on the engine's state: the replays recompute the last step's K/V and
    token into the very slots that step wrote."""
    from torch.profiler import ProfilerActivity, profile

    runner = getattr(engine.runner, "graph_runner", None)
    graphs = step_graphs(runner) if runner is not None else []
    if not graphs:
        return {"keys": [], "note": "no batch-1 decode graph"}

    def replay(k):
        for _ in range(k):
            for _, g in graphs:
                g.replay()

    replayed_us = time_us(lambda: replay(1), iters=1, warmups=10, per=n)
    t0 = time.perf_counter()  # one step at a time, the GPU idle at each launch (no replay queued behind another)
    for _ in range(50):
        replay(1)
        torch.cuda.synchronize()
    synced_us = (time.perf_counter() - t0) * 1e6 / 50
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay(profiled)
        torch.cuda.synchronize()
    gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    span = (gpu[-1].time_range.end - gpu[0].time_range.start) / profiled if gpu else None
    busy = sum(e.time_range.end - e.time_range.start for e in gpu) / profiled if gpu else None
    return {"keys": [str(k) for k, _ in graphs], "us_per_step": round(replayed_us, 2),
            "us_per_step_synced": round(synced_us, 2),
            "profiled_span_us_per_step": span and round(span, 2), "profiled_busy_us_per_step": busy and round(busy, 2),
            "activities_per_step": len(gpu) / profiled, "kernel_gap_us": kernel_gap_us(gpu)}


if __name__ == "__main__":
    main()
