"""Qwen3-0.6B's decode step at a few to a dozen requests, the step a server runs at a moderate request rate (run26,
H100, SGLang's client at 24/s: a median 10 decode rows, 2.07 ms a turn, against ~1.0 ms for one row), on a CUDA GPU.

1. `profile`: the step at 1, 4 and 16 requests of 1,024-token prompts at the defaults, under the profiler
   (minisgl.bench.profile's slice: kernel time by kind and by name, GPU busy fraction, host phases). run26 (H100)
   found attention about 1 ms of 2.3 at 16 requests (with 3 splits a request) and the matmuls 0.8.
2. `waves`: the decode attention's split count (kernel option `decode_split_waves`: the waves of SMs its
   programs fill, 2 by default) at 2, 4 and 8: the step's time at 1, 4, 8 and 16 requests of 1,024-token and of
   4,096-token prompts (100 steps after every request's first token, synchronised before and after), the arms
   interleaved `rounds` times, and each arm's tokens against the default's (a different split count sums each
   request's keys in another order and may move a near-tie: counted, not failed).

    python -m lab.checks.decode_mid --out DIR [--model qwen3-0.6b] [--rounds 2] [--parts profile,waves]
                                   # writes DIR/decode_mid.json

The skinny GEMM that run26 measured with an earlier version of this check (5-16-row matmuls on the tensor cores
instead of cuBLAS, commit 2e85e64, reports/h100/run26/skinny) was no faster in the engine and was removed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lab.engines import with_engine

BATCHES = (1, 4, 8, 16)
PROMPT_LENS = (1024, 4096)
WAVES = (2, 4, 8)


def decode_step_ms(llm, batch: int, prompt_len: int, steps: int = 100) -> tuple[float, list[list[int]]]:
    from minisgl import SamplingParams

    engine = llm.engine
    prompts = [[(97 * i + 31 * j + prompt_len) % 10000 for j in range(prompt_len)] for i in range(batch)]
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


def waves(model: str, rounds: int) -> dict:
    cells = [(b, n) for n in PROMPT_LENS for b in BATCHES]
    out: dict = {"model": model, "cells": [f"bs{b}_in{n}" for b, n in cells], "arms": {}}
    for rnd in range(rounds):
        for w in WAVES:
            arm = out["arms"].setdefault(f"waves{w}", {"step_ms": {}, "tokens": {}})

            def body(llm, arm=arm) -> None:
                for b, n in cells:
                    ms, tokens = decode_step_ms(llm, b, n)
                    arm["step_ms"].setdefault(f"bs{b}_in{n}", []).append(round(ms, 4))
                    arm["tokens"][f"bs{b}_in{n}"] = tokens

            with_engine(model, body, kernel={"decode_split_waves": w})
            print(model, f"round {rnd} waves {w}", {c: v[-1] for c, v in arm["step_ms"].items()}, flush=True)
    base = out["arms"][f"waves{WAVES[0]}"]
    for arm in out["arms"].values():
        arm["same_tokens_as_default"] = {c: sum(x == y for x, y in zip(base["tokens"][c], arm["tokens"][c]))
                                         for c in base["tokens"]}
        arm["step_ratio_to_default"] = {c: round(min(arm["step_ms"][c]) / min(base["step_ms"][c]), 3)
                                        for c in base["step_ms"]}
    for arm in out["arms"].values():
        arm["tokens"] = {c: [t[:8] for t in ts] for c, ts in arm["tokens"].items()}  # a glimpse, not the file size
    return out


def profile(model: str) -> dict:
    """Where the decode step's time goes at 1, 4 and 16 requests of 1,024-token prompts, at the defaults:
    minisgl.bench.profile's slice (kernel time by kind and by name, GPU busy fraction, host phases)."""
    from minisgl import SamplingParams
    from minisgl.bench.profile import profile_slice

    def body(llm) -> dict:
        out = {}
        for b in (1, 4, 16):
            prompts = [[(89 * i + 13 * j) % 10000 for j in range(1024)] for i in range(b)]
            params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)] * b
            out[f"bs{b}"] = profile_slice(llm, prompts, params, warm_steps=12, steps=20, top=16)
            print(model, f"bs{b}", {k: v for k, v in out[f"bs{b}"].items() if k in ("step_ms", "by_kind_per_step")},
                  flush=True)
        return out

    return with_engine(model, body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="profile,waves")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_mid: no CUDA device, nothing to measure")
        return
    from minisgl.bench.runner import environment

    res: dict = {"environment": environment(), "command": "python -m lab.checks.decode_mid " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if k != "out")}
    path = Path(a.out) / "decode_mid.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if "profile" in a.parts:
        res["profile"] = profile(a.model)
        path.write_text(json.dumps(res, indent=1))
    if "waves" in a.parts:
        res["waves"] = waves(a.model, a.rounds)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
