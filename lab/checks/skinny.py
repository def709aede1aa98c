"""The skinny GEMM (minisgl/kernels/gemv.py, kernel option `gemm_rows`) on a CUDA GPU: does it beat cuBLAS for a
decode step of a few to a dozen requests, the step a server runs at a moderate request rate (run26, H100, 24/s:
~10 rows a step, 2.07 ms against 1.0 ms at batch 1)?

1. `kernels`: every linear shape of the models (bf16), at 2, 4, 8 and 16 rows: cuBLAS (`F.linear`) against the
   skinny GEMM under each candidate tile (BLOCK_N, BLOCK_K, warps, stages), timed as lab/tune/gemv.py times the
   GEMV (a CUDA graph over enough weight copies to stream past L2, per call), each candidate checked against
   F.linear in fp32 on the same bf16 inputs.
2. `engine`: B requests of 1,024-token prompts at once, greedy, at B = 4, 8, 12, 16: the decode step's time
   (100 steps after every request's first token, synchronised before and after) with `gemm_rows` 0 (cuBLAS) and
   16, interleaved `rounds` times, and each arm's tokens (a different summation order may move a near-tie: the
   count of requests whose tokens equal the cuBLAS arm's is reported, not failed).
3. `profile` (only when asked: `--parts profile`): the decode step at 1, 4 and 16 such requests at the defaults,
   under the profiler (kernel time by kind and by name).

    python -m lab.checks.skinny --out DIR [--models qwen3-0.6b,qwen3-8b] [--engine-models qwen3-0.6b] [--rounds 2]
                                [--parts kernels,engine,profile]      # writes DIR/skinny.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.models import model_path
from lab.tune.gemv import STREAM_BYTES, linear_shapes, time_op

ROWS = (2, 4, 8, 16)
CANDIDATES = ((16, 128, 4, 4), (16, 256, 4, 4), (16, 256, 4, 3), (16, 512, 4, 3), (32, 128, 4, 4),
              (32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 8, 3))
BATCHES = (4, 8, 12, 16)


def kernels(models: list[str]) -> list[dict]:
    from minisgl.kernels import gemv as gv

    shapes: dict[tuple[int, int], list[str]] = {}
    for model in models:
        counts, _ = linear_shapes(model_path(model))
        for shape, count in counts.items():
            shapes.setdefault(shape, []).append(f"{model} x{count}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for (n, k), used_by in sorted(shapes.items()):
        copies = max(1, min(48, STREAM_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, generator=gen, device="cuda").bfloat16() * 0.05 for _ in range(copies)]
        xs = {r: torch.randn(r, k, generator=gen, device="cuda").bfloat16() for r in ROWS}
        row: dict = {"n": n, "k": k, "used_by": used_by, "cublas_us": {}, "skinny_us": {}, "max_rel_err": {}}
        for r in ROWS:
            row["cublas_us"][r] = round(time_op(F.linear, xs[r], weights), 2)
        ref = {r: F.linear(xs[r].float(), weights[0].float()) for r in ROWS}
        for cfg in CANDIDATES:
            key = ",".join(map(str, cfg))
            op = partial(gv.skinny_gemm, tiles=cfg)
            try:
                row["skinny_us"][key] = {r: round(time_op(op, xs[r], weights), 2) for r in ROWS}
                row["max_rel_err"][key] = max(((op(xs[r], weights[0]).float() - ref[r]).abs().max()
                                               / ref[r].abs().max()).item() for r in ROWS)
            except Exception as exc:  # noqa: BLE001 - a tile that fails to compile drops out, named
                row.setdefault("errors", []).append(f"{key}: {exc!r}"[:300])
        default = ",".join(map(str, gv.skinny_config(n, k)))
        row["default"] = default
        timed = {c: t for c, t in row["skinny_us"].items()}
        if timed:
            best = min(timed, key=lambda c: sum(timed[c].values()))
            row["best"] = best
            row["best_over_cublas"] = {r: round(timed[best][r] / row["cublas_us"][r], 3) for r in ROWS}
            if default in timed:
                row["default_over_cublas"] = {r: round(timed[default][r] / row["cublas_us"][r], 3) for r in ROWS}
        row["ok"] = bool(row["max_rel_err"]) and max(row["max_rel_err"].values()) < 1e-2
        print(f"{n}x{k}: cuBLAS {row['cublas_us']} us; skinny best {row.get('best')} "
              f"{timed.get(row.get('best'))}; default/cuBLAS {row.get('default_over_cublas')}", flush=True)
        rows_out.append(row)
        del weights
    return rows_out


def decode_step_ms(llm, batch: int, steps: int = 100) -> tuple[float, list[list[int]]]:
    from minisgl import SamplingParams

    engine = llm.engine
    prompts = [[(97 * i + 31 * j) % 10000 for j in range(1024)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(len(r.output_ids) < 2 for r in reqs):  # every prompt prefilled, decoding together
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    while engine.has_work:
        engine.step()
    return ms, [list(r.output_ids) for r in reqs]


def engine(model: str, rounds: int) -> dict:
    from minisgl import LLM

    out: dict = {"model": model, "batches": BATCHES, "arms": {}}
    for rnd in range(rounds):
        for rows in (0, 16):
            llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16", gemm_rows=rows)
            arm = out["arms"].setdefault(f"gemm_rows{rows}", {"step_ms": {b: [] for b in BATCHES}, "tokens": {}})
            for b in BATCHES:
                ms, tokens = decode_step_ms(llm, b)
                arm["step_ms"][b].append(round(ms, 4))
                arm["tokens"][b] = tokens
            print(model, f"round {rnd} gemm_rows {rows}", {b: arm["step_ms"][b][-1] for b in BATCHES}, flush=True)
            llm.close()
            del llm
            torch.cuda.empty_cache()
    base, new = out["arms"]["gemm_rows0"], out["arms"]["gemm_rows16"]
    out["same_tokens"] = {b: sum(x == y for x, y in zip(base["tokens"][b], new["tokens"][b])) for b in BATCHES}
    out["step_ratio"] = {b: round(min(new["step_ms"][b]) / min(base["step_ms"][b]), 3) for b in BATCHES}
    for arm in out["arms"].values():
        arm["tokens"] = {b: [t[:8] for t in ts] for b, ts in arm["tokens"].items()}  # a glimpse, not the file size
    return out


def profile(model: str) -> dict:
    """Where the decode step's time goes at 1, 4 and 16 requests of 1,024-token prompts, at the defaults:
    minisgl.bench.profile's slice (kernel time by kind and by name, GPU busy fraction, host phases)."""
    from minisgl import LLM, SamplingParams
    from minisgl.bench.profile import profile_slice

    llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16")
    out = {}
    for b in (1, 4, 16):
        prompts = [[(89 * i + 13 * j) % 10000 for j in range(1024)] for i in range(b)]
        params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)] * b
        out[f"bs{b}"] = profile_slice(llm, prompts, params, warm_steps=12, steps=20, top=16)
        print(model, f"bs{b}", {k: v for k, v in out[f"bs{b}"].items() if k in ("step_ms", "by_kind_per_step")},
              flush=True)
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-8b", help="whose linear shapes the kernels part times")
    ap.add_argument("--engine-models", default="qwen3-0.6b", help="the engines the engine part runs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="kernels,engine")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("skinny: no CUDA device, nothing to measure")
        return
    from minisgl.bench.runner import environment

    models = a.models.split(",")
    res: dict = {"environment": environment(), "command": "python -m lab.checks.skinny " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if k != "out")}
    path = Path(a.out) / "skinny.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if "kernels" in a.parts:
        res["kernels"] = kernels(models)
        path.write_text(json.dumps(res, indent=1))
    if "engine" in a.parts:
        res["engine"] = {}
        for model in a.engine_models.split(","):
            res["engine"][model] = engine(model, a.rounds)
            path.write_text(json.dumps(res, indent=1))
    if "profile" in a.parts:
        res["profile"] = {model: profile(model) for model in a.engine_models.split(",")}
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
