"""CPU decode on the torch attention backends (issue 28, item 6): the reference loop (`--attention-backend
torch_loop`, one request at a time) against decode steps as a few padded ops (`torch`, the CPU default).

    python scripts/cpu_decode_bench.py OUT_DIR [--model assets/tiny-qwen3] [--threads N] [--full]

Writes OUT_DIR/cpu_decode.json: for each backend, ms per decode step of one request at growing contexts, of a
batch of 16 similar requests, and of a skewed batch (one long request among short ones); with --full also the
issue's case, one generation of max_model_len - 8 tokens from a short prompt, timed whole.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from minisgl import LLM, SamplingParams
from minisgl.bench.runner import environment, write_json


def ms_per_step(llm, prompts: list[list[int]], steps: int) -> float:
    """Decode `steps` tokens for every prompt after its prefill: (time - the prefill's time) / steps."""
    greedy = dict(temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy))  # the prompts are now in the radix cache
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, **greedy))
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=steps + 1, **greedy))
    return (time.perf_counter() - t0 - prefill) / steps * 1e3


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
            t0 = time.perf_counter()
            out = llm.generate([tokens(4)], SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))[0]
            r["full_generation"] = {"tokens": len(out.token_ids), "seconds": time.perf_counter() - t0}
        results[backend] = r
        print(backend, r, flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "cpu_decode.json")
    write_json(path, {"environment": environment(), "threads": torch.get_num_threads(), "model": args.model,
                      "steps": args.steps, "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
