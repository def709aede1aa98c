"""Where a batch-1 greedy decode step spends its time on the GPU: kernels and the idle gaps between them.

    python scripts/decode_timeline.py --out DIR [--label NAME]      # MINISGL_ROOT=<older package> for an A/B

W2's setting (one request, greedy, a 512-token prompt) on Qwen3-0.6B with dummy bf16 weights. After warm-up,
20 decode steps run under torch.profiler; the script writes every GPU activity (kernels and copies) of the
window with its start and duration, the gaps where the GPU idles, the host calls (graph launches, copies, kernel
launches) that precede each large gap, and the unprofiled time per step. Works with any minisgl version that
has `LLM`, `engine.add_request` and `engine.step`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.environ.get("MINISGL_ROOT") or os.path.join(os.path.dirname(__file__), ".."))

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.bench.runner import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="current")
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_timeline: no CUDA device, nothing to profile")
        return
    from torch.profiler import ProfilerActivity, profile

    llm = LLM("assets/configs/qwen3-0.6b", load_format="dummy", dtype="bfloat16")
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
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
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
        "label": a.label, "root": os.environ.get("MINISGL_ROOT", "this checkout"), "environment": environment(),
        "unprofiled_ms_per_step": unprofiled_ms, "profiled_steps": a.steps,
        "window_us": window, "gpu_busy_us_sum": busy, "gpu_activities": len(gpu),
        "activities_per_step": len(gpu) / a.steps, "idle_us_per_step": sum(g["idle_us"] for g in gaps) / a.steps,
        "gaps_over_3us": gaps[:200], "host_cuda_calls": {k: [v[0], round(v[1], 1)] for k, v in by_host.items()},
        "activities": acts[:3000],
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"decode_timeline_{a.label}.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(a.label, "unprofiled ms/step", round(unprofiled_ms, 3), "idle us/step", round(out["idle_us_per_step"], 1),
          "activities/step", out["activities_per_step"], flush=True)


if __name__ == "__main__":
    main()
