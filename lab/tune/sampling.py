"""Time the fused sampler's launch shapes on a CUDA GPU and pick one (KernelOptions.sampler_launch).

    python -m lab.tune.sampling --out DIR

One shape serves every batch size (a row's token must not depend on its batch), so the pick minimises the
summed time over the batch sizes and settings that matter: W1's top-k 50 + top-p 0.95, top-p alone, min-p,
temperature only, at batch 1, 64, 256 and 512, on bf16 logits as the LM head gives them. The default is also
timed with the kernels' exact shortcuts (sampler_skip_blocks, sampler_top_k_bound) off: the A/B of issue 10.
Each time is the median replay of the sampler captured in a CUDA graph, as the engine runs it. Writes
DIR/gpu_sampling_tune.json as it goes. Use the pick with the kernel option `sampler_launch` (an engine's, or
`lab.engines.kernel_options`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from lab.engines import kernel_options
from lab.timing import time_graph

VOCAB = 151936
BATCHES = (1, 64, 256, 512)


def _settings(b: int, top_k: int, top_p: float, min_p: float) -> dict:
    full = lambda v, dt: torch.full((b,), v, dtype=dt, device="cuda")  # noqa: E731
    return dict(temperatures=full(0.6, torch.float32), top_ks=full(top_k, torch.int64),
                top_ps=full(top_p, torch.float32), min_ps=full(min_p, torch.float32),
                seeds=torch.arange(b, device="cuda") * 7919, steps=full(11, torch.int64),
                cuts=top_k < VOCAB or top_p < 1 or min_p > 0)


CASES = {"top_k_top_p": (50, 0.95, 0.0), "top_p": (VOCAB, 0.95, 0.0), "min_p": (VOCAB, 1.0, 0.05),
         "temperature": (VOCAB, 1.0, 0.0)}


def candidates() -> list[dict]:
    out = []
    for chunk, block, warps in itertools.product((2048, 4096, 8192), (256, 512, 1024), (4, 8)):
        out.append({"chunk": chunk, "stats_block": 1024, "search_block": block, "search_warps": warps,
                    "draw_block": 1024, "draw_warps": warps})
    return out


def main(out_dir: str | Path = ".") -> dict:
    from minisgl.kernels import sampling as fused
    from minisgl.kernels.options import current_options
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_sampling_tune.json"
    res: dict = {"device": torch.cuda.get_device_name(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "default": dataclasses.asdict(current_options().sampler_launch), "batches": BATCHES, "rows": [],
                 "errors": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = {}
    for b in BATCHES:
        x = torch.randn(b, VOCAB, generator=gen, device="cuda") * 2.5
        x[:, ::97] += 6  # a few hundred likely tokens per row, like a real model's head
        logits[b] = x.bfloat16()
    original = dataclasses.asdict(current_options().sampler_launch)

    def run(cfg: dict, label: str, inputs: dict = logits) -> dict:
        row = {"label": label, "launch": cfg, "us": {}}
        for b in BATCHES:
            for case, (k, p, mp) in CASES.items():
                st = _settings(b, k, p, mp)
                try:
                    draw = partial(fused.fused_sample, inputs[b], **st)
                    with kernel_options(sampler_launch=cfg):  # the captured graph keeps these shapes
                        row["us"][f"{case}_b{b}"] = round(time_graph(draw, iters=20), 1)
                except Exception:  # noqa: BLE001 - a shape that fails to compile just drops out
                    res["errors"].append(f"{label} {case} b{b}: {traceback.format_exc()[-600:]}")
                    row["us"][f"{case}_b{b}"] = None
        vals = row["us"].values()
        row["total_us"] = None if None in vals else round(sum(vals), 1)
        res["rows"].append(row)
        path.write_text(json.dumps(res, indent=1))
        return row

    base = run(original, "default")
    with kernel_options(sampler_skip_blocks=False, sampler_top_k_bound=False):
        run(original, "default_no_shortcuts")
    # the same default on the float32 widening: what reading the LM head's bf16 directly saves
    run(original, "default_fp32_logits", {b: x.float() for b, x in logits.items()})
    for i, cfg in enumerate(candidates()):
        run(cfg, f"candidate_{i}")
    ok = [r for r in res["rows"] if r["total_us"] is not None
          and r["label"] not in ("default_fp32_logits", "default_no_shortcuts")]
    best = min(ok, key=lambda r: r["total_us"])
    res["pick"] = {"label": best["label"], "launch": best["launch"], "total_us": best["total_us"],
                   "default_total_us": base["total_us"]}
    path.write_text(json.dumps(res, indent=1))
    print("pick", res["pick"], flush=True)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_sampling_tune: no CUDA device, nothing to time")
        sys.exit(0)
    main(a.out)
