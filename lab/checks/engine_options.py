"""Issue 27 on the GPU: behaviour unchanged after the refactor, and per-engine kernel options on the real Triton path.

Dummy Qwen3-0.6B weights in bf16 (assets/configs/qwen3-0.6b), on a CUDA GPU:

1. W1 and W2 at the defaults (one engine), beside run13's figures from reports/h200/run13 (W1 output tok/s
   23,969 in mixed_split.json; W2 TPOT 0.895 ms, the wide-tile table in wide06.json). Within noise = unchanged.
2. Two engines in one process with different kernel options, on the Triton backend with CUDA graphs: A at the
   defaults, B with every switch flipped (PDL off, the decode K/V store as its own launch, the fused split merge
   on, mixed decode rows through the extend kernel, no early GEMV tiles, the sampler's shortcuts off). They run
   interleaved (A, B, A, B) on the same greedy prompts; each engine's tokens must be the same on both of its
   runs (the other engine's options never leak into it, eagerly or in its captured graphs), and A's and B's
   are compared (the switches change launches, not maths, except the merge order and the mixed-row kernel:
   equal tokens are expected, a difference at a near-tie is reported, not failed). Then one batch-1 decode step
   of each engine (a graph replay) is profiled: its kernel names show each graph kept its own options (A: a
   stage-2 merge kernel and no K/V-store kernel; B: a K/V-store kernel per layer and no stage-2 kernel).

    python -m lab.checks.engine_options --out DIR        # writes DIR/engine_options.json; or main(DIR)

`ok` in the JSON is the verdict of part 2 (part 1 is a measurement: compare it with run13 by eye or by the
ratios written beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "assets" / "configs" / "qwen3-0.6b")
RUN13 = REPO / "reports" / "h200" / "run13"
NUM_PAGES = 65536  # fixed KV pools (page size 1): two engines side by side, none sized from "what is left"

# B: every kernel switch away from its default (KernelOptions fields, by name)
FLIPPED = dict(pdl=False, decode_fused_store=False, decode_fused_merge=True, mixed_decode_split=False,
               gemv_pdl_early_tiles=0, sampler_skip_blocks=False, sampler_top_k_bound=False)


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def run13_reference() -> dict:
    """run13's W1 (defaults) and W2 (the table now in the repo) on Qwen3-0.6B, read from its JSON."""
    ref = {}
    try:
        mixed = json.loads((RUN13 / "mixed_split.json").read_text())
        ref["w1_output_tok_per_s"] = mixed["sections"]["mixed06"]["result"]["w1"]["output_tok_per_s"]
        wide = json.loads((RUN13 / "wide06.json").read_text())["sections"]["wide_ab06"]["result"]["runs"]
        tpots = [run["w2"]["tpot_ms_median"] for name, run in wide.items() if name.startswith("wide_")]
        ref["w2_tpot_ms_median"] = sum(tpots) / len(tpots)
    except (OSError, KeyError, ValueError, ZeroDivisionError) as exc:
        ref["error"] = repr(exc)
    return ref


def defaults_bench() -> dict:
    from minisgl import LLM
    from minisgl.bench.runner import run_workload
    llm = LLM(MODEL, load_format="dummy", dtype="bfloat16")
    try:
        out = {name: run_workload(llm, name) for name in ("w2", "w1")}
    finally:
        llm.close()
    ref = run13_reference()
    summary = {"w1_output_tok_per_s": out["w1"]["output_tok_per_s"], "w2_tpot_ms_median": out["w2"]["tpot_ms_median"],
               "w2_ttft_ms_median": out["w2"]["ttft_ms_median"], "run13": ref}
    for key in ("w1_output_tok_per_s", "w2_tpot_ms_median"):
        if key in ref:
            summary[f"{key}_over_run13"] = summary[key] / ref[key]
    return {"summary": summary, "results": out}


def decode_kernels(llm, prompt: list[int]) -> list[str]:
    """Kernel names of one batch-1 decode step (a graph replay), after the prefill of `prompt`."""
    from torch.profiler import ProfilerActivity, profile

    from minisgl import SamplingParams
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prefill
    engine.step()  # a first decode step, outside the profile
    torch.cuda.synchronize()
    graph_steps = engine.stats["graph_steps"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    while engine.has_work:
        engine.step()
    assert engine.stats["graph_steps"] == graph_steps + 1, "the profiled step was not a graph replay"
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def first_difference_at(x: list[int], y: list[int]) -> int | None:
    return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None if len(x) == len(y) else min(len(x), len(y)))


def two_engines(lengths: tuple[int, ...] = (7, 100, 600, 1500, 3000), new_tokens: int = 48,
                profile_prompt: int = 600) -> dict:
    from minisgl import LLM, SamplingParams
    from minisgl.kernels.options import current_options
    before = current_options()
    # no radix cache: a second run of the same prompts would otherwise prefill only their last token against the
    # cached pages, a different kernel and rounding (run16, with the cache: neither engine repeated itself,
    # while A's and B's first runs agreed on every greedy token)
    common = dict(load_format="dummy", dtype="bfloat16", attention_backend="triton", num_pages=NUM_PAGES,
                  max_running_requests=64, radix_cache=False)
    a = LLM(MODEL, **common)
    b = LLM(MODEL, **common, **FLIPPED)
    try:
        vocab = a.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
        greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        sampled = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=new_tokens, ignore_eos=True, seed=i)
                   for i in range(len(prompts))]
        runs = {}
        for label, llm in (("a1", a), ("b1", b), ("a2", a), ("b2", b)):
            runs[label] = [o.token_ids for o in llm.generate(prompts, greedy)]
            runs[label + "_sampled"] = [o.token_ids for o in llm.generate(prompts, sampled)]
        same = {f"{e}_repeats{kind}": runs[f"{e}1{kind}"] == runs[f"{e}2{kind}"]
                for e in ("a", "b") for kind in ("", "_sampled")}
        first_difference = {f"{e}{kind}": [first_difference_at(x, y) for x, y in zip(runs[f"{e}1{kind}"],
                                                                                  runs[f"{e}2{kind}"])]
                            for e in ("a", "b") for kind in ("", "_sampled")}
        agree = [sum(x == y for x, y in zip(ra, rb)) / len(ra) for ra, rb in zip(runs["a1"], runs["b1"])]
        probe = torch.randint(0, vocab, (profile_prompt,), generator=gen).tolist()  # enough keys for split decode
        kernels = {"a": decode_kernels(a, probe), "b": decode_kernels(b, probe)}

        def has(label: str, fragment: str) -> bool:
            return any(fragment in name for name in kernels[label])

        graphs = {"a_fused_store": not has("a", "store_kv"), "a_stage2_merge": has("a", "decode_stage2"),
                  "b_store_kv_launch": has("b", "store_kv"), "b_fused_merge": not has("b", "decode_stage2")}
        return {
            "options": {"a": str(a.config.kernels), "b": str(b.config.kernels)},
            "engine_stats": {"a": dict(a.engine.stats), "b": dict(b.engine.stats)},
            "each_engine_repeats_itself": same,
            "first_difference_between_runs": first_difference,  # per prompt: the first output index, or None
            "greedy_token_agreement_a_vs_b": agree,
            "graphs_keep_their_options": graphs,
            "decode_step_kernels": {k: sorted(set(v)) for k, v in kernels.items()},
            "options_outside_engines_unchanged": current_options() == before,
            "ok": all(same.values()) and all(graphs.values()) and current_options() == before,
        }
    finally:
        a.close()
        b.close()


def main(out_dir: str = ".", bench: bool = True) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    from minisgl.bench.runner import environment, write_json
    results: dict = {"environment": environment(), "model": MODEL, "errors": {}}
    path = os.path.join(out_dir, "engine_options.json")
    parts = [("two_engines", two_engines)] + ([("defaults_bench", defaults_bench)] if bench else [])
    for name, part in parts:
        log(name)
        try:
            results[name] = part()
        except Exception:
            results["errors"][name] = traceback.format_exc()
            log(f"{name} failed:\n{results['errors'][name]}")
        write_json(path, results)
        torch.cuda.empty_cache()
    results["ok"] = not results["errors"] and results.get("two_engines", {}).get("ok", False)
    write_json(path, results)
    summary = results.get("defaults_bench", {}).get("summary")
    log("ok" if results["ok"] else "NOT OK", json.dumps(summary, default=str) if summary else "")
    return results


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-bench", action="store_true", help="part 2 only (no W1/W2)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this check needs one (the CPU side is tests/test_kernel_options.py)")
        return 2
    return 0 if main(a.out, bench=not a.no_bench)["ok"] else 1


if __name__ == "__main__":
    sys.exit(cli())
