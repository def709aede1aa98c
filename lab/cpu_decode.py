"""CPU decode on the torch attention backends (issue 28, item 6): the reference loop (`--attention-backend
torch_loop`, one request at a time) against decode steps as a few padded ops (`torch`, the CPU default).

    python -m lab.cpu_decode OUT_DIR [--model assets/tiny-qwen3] [--threads N] [--full]

Writes OUT_DIR/cpu_decode.json: for each backend, ms per decode step (wall and CPU time) of one request at
growing contexts, of a batch of 16 similar requests, and of a skewed batch (one long request among short
ones); with --full also the issue's case, one generation of max_model_len - 8 tokens from a short prompt.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from minisgl import LLM, SamplingParams
from minisgl.bench.runner import environment, write_json


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(t0: tuple[float, float]) -> dict:
    """Wall and CPU seconds since t0: on a machine shared with other work the CPU time of this (one-thread)
    process is the steadier figure; the wall time is what a user waits."""
    t1 = clocks()
    return {"wall_s": t1[0] - t0[0], "cpu_s": t1[1] - t0[1]}


def ms_per_step(llm, prompts: list[list[int]], steps: int) -> dict:
    """Decode `steps` tokens for every prompt after its prefill: (time - the prefill's time) / steps, in ms."""
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy))  # the prompts are now in the radix cache
    t0 = clocks()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy))
    prefill = since(t0)
    t0 = clocks()
    llm.generate(prompts, SamplingParams(max_tokens=steps + 1, **greedy))
    total = since(t0)
    return {"wall_ms": (total["wall_s"] - prefill["wall_s"]) / steps * 1e3,
            "cpu_ms": (total["cpu_s"] - prefill["cpu_s"]) / steps * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--model", default="assets/tiny-qwen3")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--full", action="store_true", help="also one whole generation up to the context")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokens = lambda n, seed=0: [3 + (seed * 131 + 7 * i) % 3000 for i in range(n)]  # noqa: E731
    results = {}
    for backend in ("torch_loop", "torch"):
        llm = LLM(args.model, attention_backend=backend, device="cpu", progress=False)
        ctx = llm.engine.max_model_len
        r = {"single": {}}
        for n in (16, 1000, ctx - args.steps - 8):
            r["single"][n] = ms_per_step(llm, [tokens(n)], args.steps)
        r["batch16_300"] = ms_per_step(llm, [tokens(280 + 3 * i, i) for i in range(16)], args.steps)
        r["skewed_1500_and_15x20"] = ms_per_step(llm, [tokens(1500)] + [tokens(20, i) for i in range(1, 16)],
                                                 args.steps)
        if args.full:
            n = ctx - 8
            t0 = clocks()
            out = llm.generate([tokens(4)], SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))[0]
            r["full_generation"] = {"tokens": len(out.token_ids), **since(t0)}
        results[backend] = r
        print(backend, r, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "cpu_decode.json")
    write_json(path, {"environment": environment(), "threads": torch.get_num_threads(), "model": args.model,
                      "steps": args.steps, "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
