"""Issue 29 on the GPU: does the kernel warm-up (minisgl/engine/warmup.py) take the compiles out of the workloads,
and what does engine start cost with it on and off?

Each arm is a fresh process (a child of this one) on dummy bf16 weights, with its own Triton cache folder
(TRITON_CACHE_DIR): `cold` is an empty folder, what a fresh machine has; `warm` reuses the folder an earlier cold
arm of the same model filled. Arms, in order: on_cold, off_cold, on_warm (kernel_warmup on/off). Each measures

- `startup_s`: LLM(...) built, from the call to its return (the model, the pools, the warm-up, the captures);
- the warm-up's own report (variants precompiled, compile seconds and threads, late compiles) and
  `start_compiles_outside_warmup`: variants compiled during start that the warm-up did not (what the graph
  captures compiled one after another because discovery missed them; with the warm-up off, all of them);
- `first`/`second`: W1's requests generated twice in a row, each from an empty prefix cache and timed, with the
  Triton variants each compiled (`compiles`); `first_over_second` is the wall-time ratio (target <= 1.05);
- W1 and W2 as the bench runs them (minisgl.bench.runner: its own warm-up generate, then the timed run):
  `triton_compiles_timed` as every bench JSON reports it (target: empty), and with --sweep every cell of the
  batch-mix sweep.

    python -m lab.checks.warmup --out FILE [--models qwen3-0.6b,qwen3.5-0.8b] [--arms on_cold,off_cold,on_warm]
                                [--sweep]

`targets` in the JSON holds each verdict, for each arm with the warm-up on: W1/W2 (and sweep) timed compiles
empty, no compile in the first generate, the first/second ratio <= 1.05; and a cold start <= 30 s for
Qwen3-0.6B. The default (Qwen3-0.6B's three arms, Qwen3.5-0.8B's two) takes ~6.5 min on an H200: a child is
~35 s (process start, two W1 generates, the bench's W1 and W2) plus the engine's start (estimated 20-55 s).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARMS = {"on_cold": (True, "cold"), "off_cold": (False, "cold"), "on_warm": (True, "warm")}
DEFAULT_MODELS = ("qwen3-0.6b", "qwen3.5-0.8b")
DEFAULT_ARMS = {"qwen3-0.6b": ("on_cold", "off_cold", "on_warm"), "qwen3.5-0.8b": ("on_cold", "off_cold")}
CHILD_TIMEOUT_S = 240  # an arm that hangs must not take the call's other arms with it
START_TARGET_S = {"qwen3-0.6b": 30.0}
RATIO_TARGET = 1.05


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# --- one arm, in its own process -------------------------------------------------------------------------------


def child(model: str, warmup: bool, out: str, sweep: bool) -> None:
    import torch

    from lab.models import model_path
    from lab.sections import workload
    from minisgl import LLM
    from minisgl.bench.runner import (
        _new_variants,
        flush_prefix_cache,
        run_latency,
        run_sweep,
        run_throughput,
        triton_variants,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res: dict = {"model": model, "kernel_warmup": warmup, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}

    def save() -> None:
        Path(out).write_text(json.dumps(res, indent=2, default=str))

    t0 = time.perf_counter()
    llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16", kernel_warmup=warmup)
    res["startup_s"] = time.perf_counter() - t0
    report = llm.engine.runner.warmup
    res["warmup"] = report
    started = sum(triton_variants().values())
    by_warmup = sum((report or {}).get("precompiled", {}).values()) + sum((report or {}).get("late_compiles", {})
                                                                         .values())
    res["start_variants"] = started
    res["start_compiles_outside_warmup"] = started - by_warmup
    save()
    log(model, "warmup" if warmup else "no warmup", "started in", round(res["startup_s"], 1), "s")

    w1 = workload("w1", llm.engine.model_config.vocab_size)
    for label in ("first", "second"):  # the user's first workload, then the same again
        flush_prefix_cache(llm)
        before = triton_variants()
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(w1.prompts, w1.params, progress=False)
        torch.cuda.synchronize()
        res[label] = {"wall_s": time.perf_counter() - t, "compiles": _new_variants(before)}
        log(model, label, res[label])
    res["first_over_second"] = res["first"]["wall_s"] / res["second"]["wall_s"]
    save()
    keep = ("output_tok_per_s", "wall_s", "ttft_ms_median", "tpot_ms_median", "triton_compiles_timed")
    for name, run in (("w1", run_throughput), ("w2", run_latency)):
        r = run(llm, workload(name, llm.engine.model_config.vocab_size))
        res[name] = {k: r[k] for k in keep if k in r}
        log(model, name, res[name])
        save()
    if sweep:
        cells = run_sweep(llm)
        res["sweep"] = {name: {k: r[k] for k in keep if k in r} for name, r in cells.items()}
        save()
    llm.close()


# --- the arms --------------------------------------------------------------------------------------------------


def run_arm(model: str, arm: str, cache: str, sweep: bool) -> dict:
    warmup, _ = ARMS[arm]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "arm.json")
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        argv = [sys.executable, "-m", "lab.checks.warmup", "--child", "--model", model, "--out", path]
        argv += ["--warmup" if warmup else "--no-warmup"] + (["--sweep"] if sweep else [])
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(argv, cwd=REPO, env=env, timeout=CHILD_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            res = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            res = {"error": repr(exc)}
    res.update(returncode=rc, process_s=time.perf_counter() - t0, arm=arm)
    return res


def targets(model: str, arms: dict) -> dict:
    """The issue's targets for each arm with the warm-up on (absent where the arm did not get that far)."""
    out = {}
    for arm, on in arms.items():
        if not ARMS[arm][0]:
            continue
        for name in ("w1", "w2"):
            if name in on:
                out[f"{arm}.{name}_no_timed_compiles"] = not on[name]["triton_compiles_timed"]
        if "sweep" in on:
            out[f"{arm}.sweep_no_timed_compiles"] = not any(c["triton_compiles_timed"] for c in on["sweep"].values())
        if "first_over_second" in on:
            out[f"{arm}.first_within_5pct_of_second"] = on["first_over_second"] <= RATIO_TARGET
            out[f"{arm}.first_generate_no_compiles"] = not on["first"]["compiles"]
    if model in START_TARGET_S and "startup_s" in arms.get("on_cold", {}):
        out["on_cold.start_within_target"] = arms["on_cold"]["startup_s"] <= START_TARGET_S[model]
    return out


def main(out: str, models: list[str], arm_names: list[str] | None, sweep: bool) -> dict:
    from minisgl.bench.runner import environment
    results: dict = {"environment": environment(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="warmup-check-") as root:
        for model in models:
            caches = {}  # arm kind -> folder: each cold arm gets an empty one; warm reuses the first cold one
            arms = {}
            for arm in arm_names or DEFAULT_ARMS.get(model, ("on_cold",)):
                warmup, kind = ARMS[arm]
                if kind == "cold":
                    cache = os.path.join(root, f"{model}-{arm}")
                    caches.setdefault("warm", cache)
                else:
                    cache = caches.get("warm") or os.path.join(root, f"{model}-{arm}")
                log(model, arm, "cache", cache)
                try:
                    arms[arm] = run_arm(model, arm, cache, sweep and warmup)
                except Exception:
                    arms[arm] = {"error": traceback.format_exc()}
                log(model, arm, {k: v for k, v in arms[arm].items() if k in (
                    "startup_s", "first_over_second", "start_compiles_outside_warmup", "returncode")})
                results["models"][model] = {"arms": arms, "targets": targets(model, arms)}
                Path(out).write_text(json.dumps(results, indent=2, default=str))
    verdicts = [v for m in results["models"].values() for v in m["targets"].values()]
    results["ok"] = bool(verdicts) and all(verdicts)
    Path(out).write_text(json.dumps(results, indent=2, default=str))
    log("ok" if results["ok"] else "NOT OK", json.dumps({m: r["targets"] for m, r in results["models"].items()}))
    return results


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--arms", help=f"comma-separated, of {', '.join(ARMS)} (default: {DEFAULT_ARMS})")
    ap.add_argument("--sweep", action="store_true", help="also the batch-mix sweep (arms with the warm-up on)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", dest="warmup", action="store_true", default=True, help=argparse.SUPPRESS)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU: this check needs one (the CPU side is tests/test_warmup.py)")
        return 2
    if a.child:
        child(a.model, a.warmup, a.out, a.sweep)
        return 0
    arms = a.arms.split(",") if a.arms else None
    unknown = set(arms or ()) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}")
    return 0 if main(a.out, a.models.split(","), arms, a.sweep)["ok"] else 1


if __name__ == "__main__":
    sys.exit(cli())
