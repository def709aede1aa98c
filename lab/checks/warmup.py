"""Issue 29 on the GPU: does the kernel warm-up (minisgl/engine/warmup.py) take the compiles out of the workloads,
and what does engine start cost with it on and off?

Each arm is a fresh process (a child of this one) on dummy bf16 weights, with its own Triton cache folder
(TRITON_CACHE_DIR): `cold` is an empty folder, what a fresh machine has; `warm` reuses the folder an earlier cold
arm of the same model filled. Arms, in order: on_cold, off_cold, on_warm (kernel_warmup on/off). Each measures

- `startup_s`: LLM(...) built, from the call to its return (the model, the pools, the warm-up, the captures);
  `startup_phases`: its host seconds by phase (ModelRunner.startup: device, load, pools, gc_freeze, kernel_warmup,
  decode_graphs, prefill_graphs, gc); `startup_gc`: the garbage collections during it (minisgl.bench.profile.gc_pauses);
- the warm-up's own report (variants precompiled, compile seconds and threads, late compiles) and
  `start_compiles_outside_warmup`: variants compiled during start that the warm-up did not (what the graph
  captures compiled one after another because discovery missed them; with the warm-up off, all of them);
- `first`/`second`: W1's requests generated twice in a row, each from an empty prefix cache and timed, with the
  Triton variants each compiled (`compiles`); `first_over_second` is the wall-time ratio (target <= 1.05);
- where a generate's time went, for `first` and `second` (`where`): the host's seconds by phase (scheduling,
  preparing and launching steps, waiting for the device's tokens), the slowest steps with their phases, the device
  and pinned host allocations the run made (torch's allocator counters), the garbage collections, the SM clock.
  run14 and run15 saw the first W1 of a process 6-12% slower than W1 on any later engine of that process with no
  compile timed; these say whether the host or the device took the difference, and whether allocations did;
- `next_engine`: with --next-engine (the cold arms), the engine closed and a second one built in the same process,
  W1 generated once on it: the bench's "later engine" case (against `first`: a cost of the process, not of the
  engine);
- W1 and W2 as the bench runs them (minisgl.bench.runner: its own warm-up generate, then the timed run):
  `triton_compiles_timed` as every bench JSON reports it (target: empty), and with --sweep every cell of the
  batch-mix sweep.

The arm `profile_warm` only starts an engine, on the warm cache, under cProfile: `startup_phases`
and `startup_profile`, the functions of the engine's thread that took the most time, by their own time and by
their cumulative time (the warm-up's compile threads are not profiled; profiling slows the start, so its
`startup_s` is no start-up figure and no target reads it).

    python -m lab.checks.warmup --out FILE [--models qwen3-0.6b,qwen3.5-0.8b] [--arms on_cold,off_cold,on_warm,...]
                                [--sweep]

`targets` in the JSON holds each verdict, for each arm with the warm-up on: W1/W2 (and sweep) timed compiles
empty, no compile in the first generate, the first/second and first/next-engine ratios <= 1.05; and a cold start
<= 30 s for Qwen3-0.6B. The default (Qwen3-0.6B's three arms, Qwen3.5-0.8B's two) takes ~7.5 min on an H200: a
child is ~35 s (process start, two W1 generates, the bench's W1 and W2) plus the engine's start (33-39 s on a
fresh machine in run15), and the cold arms ~25 s more for their next engine.
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
ARMS = {"on_cold": (True, "cold"), "off_cold": (False, "cold"), "on_warm": (True, "warm"),
        "profile_warm": (True, "warm")}
PROFILE_ARMS = ("profile_warm",)  # arms whose child only starts an engine, under cProfile (`startup_profile`)
PROFILE_TOP = 40  # functions kept of the profile, by own time and by cumulative time
DEFAULT_MODELS = ("qwen3-0.6b", "qwen3.5-0.8b")
# Qwen3.5's start without the warm-up was measured in run16 and run17 (69.8 s against 60.5 s with it); its cold arm
# with the warm-up is kept, for the first-run targets
DEFAULT_ARMS = {"qwen3-0.6b": ("on_cold", "off_cold", "on_warm", "profile_warm"), "qwen3.5-0.8b": ("on_cold",)}
NEXT_ENGINE_ARMS = ("on_cold",)  # arms that also build a second engine in their process (`next_engine`)
CHILD_TIMEOUT_S = 240  # an arm that hangs must not take the call's other arms with it
START_TARGET_S = {"qwen3-0.6b": 30.0}
RATIO_TARGET = 1.05


def log(*args) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


# --- one arm, in its own process -------------------------------------------------------------------------------


def _alloc_counters() -> dict[str, int]:
    import torch

    if not torch.cuda.is_available():
        return {}
    dev = torch.cuda.memory_stats()
    out = {k: int(dev.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries",
                                           "num_sync_all_streams")}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        h = host()
        out.update({f"host_{k}": int(h.get(k, 0)) for k in ("num_host_alloc", "num_host_free")})
    return out


def _sm_clock_mhz() -> int | None:
    import torch

    try:
        return torch.cuda.clock_rate() if torch.cuda.is_available() else None
    except Exception:  # no NVML on this machine: the clock is unknown, not an error of the check
        return None


def timed_generate(llm, w) -> dict:
    """One generate of `w` from an empty prefix cache, timed, and where its time went (the module's docstring)."""
    import torch

    from minisgl.bench.profile import gc_pauses, timed_phases
    from minisgl.bench.runner import _new_variants, flush_prefix_cache, triton_variants

    flush_prefix_cache(llm)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    before, allocs, clock = triton_variants(), _alloc_counters(), _sm_clock_mhz()
    with gc_pauses() as pauses, timed_phases(llm.engine) as times:
        sync()
        t = time.perf_counter()
        llm.generate(w.prompts, w.params, progress=False)
        sync()
        wall = time.perf_counter() - t
    phases, steps = times.totals, times.steps
    after = _alloc_counters()
    slowest = sorted(steps, reverse=True)[:10]
    return {
        "wall_s": wall, "compiles": _new_variants(before), "steps": len(steps),
        "where": {
            "host_s": {k: round(v, 4) for k, v in phases.items()},
            "steps_s": round(sum(x[0] for x in steps), 4),
            "slowest_steps_ms": [[round(1e3 * v, 3) for v in x] for x in slowest],  # step, schedule, launch, wait
            "allocations": {k: after[k] - allocs.get(k, 0) for k in after},
            "gc": pauses.as_dict(),
            "sm_clock_mhz": [clock, _sm_clock_mhz()],
        },
    }



def profile_table(profile, key: str, top: int = PROFILE_TOP) -> list[dict]:
    """The `top` functions of a cProfile.Profile by `key` ("tottime": own time, "cumtime": with callees)."""
    import pstats

    stats = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls": nc, "tottime_s": round(tt, 4),
             "cumtime_s": round(ct, 4)} for (f, line, name), (_, nc, tt, ct, _) in rows]


def child(model: str, warmup: bool, out: str, sweep: bool, next_engine: bool = False,
          profile_start: bool = False) -> None:
    import torch

    from lab.models import model_path
    from lab.sections import workload
    from minisgl import LLM
    from minisgl.bench.profile import gc_pauses
    from minisgl.bench.runner import run_latency, run_sweep, run_throughput, triton_variants

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res: dict = {"model": model, "kernel_warmup": warmup, "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}

    def save() -> None:
        Path(out).write_text(json.dumps(res, indent=2, default=str))

    profiler = None
    if profile_start:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    with gc_pauses() as pauses:
        llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16", kernel_warmup=warmup)
    res["startup_s"] = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
    res["startup_phases"] = llm.engine.runner.startup  # device, load, pools, gc_freeze, warm-up, graphs, gc (host s)
    res["startup_gc"] = pauses.as_dict()  # the collections during the start
    report = llm.engine.runner.warmup
    res["warmup"] = report
    if profiler is not None:  # a profiled start: no workload runs on it
        res["startup_profile"] = {key: profile_table(profiler, key) for key in ("tottime", "cumtime")}
        save()
        llm.close()
        return
    started = sum(triton_variants().values())
    by_warmup = sum((report or {}).get("precompiled", {}).values()) + sum((report or {}).get("late_compiles", {})
                                                                         .values())
    res["start_variants"] = started
    res["start_compiles_outside_warmup"] = started - by_warmup
    save()
    log(model, "warmup" if warmup else "no warmup", "started in", round(res["startup_s"], 1), "s")

    w1 = workload("w1", llm.engine.model_config.vocab_size)
    for label in ("first", "second"):  # the user's first workload, then the same again
        res[label] = timed_generate(llm, w1)
        log(model, label, res[label])
    res["first_over_second"] = res["first"]["wall_s"] / res["second"]["wall_s"]
    save()
    if next_engine:  # a second engine in the same process, its first W1: what the bench's later rows are
        llm.close()
        del llm
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16", kernel_warmup=warmup)
        res["next_engine"] = {"startup_s": time.perf_counter() - t0, "first": timed_generate(llm, w1)}
        res["first_over_next_engine"] = res["first"]["wall_s"] / res["next_engine"]["first"]["wall_s"]
        log(model, "next engine", res["next_engine"])
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
        argv += ["--next-engine"] if arm in NEXT_ENGINE_ARMS else []
        argv += ["--profile-start"] if arm in PROFILE_ARMS else []
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
        if not ARMS[arm][0] or arm in PROFILE_ARMS:
            continue
        for name in ("w1", "w2"):
            if name in on:
                out[f"{arm}.{name}_no_timed_compiles"] = not on[name]["triton_compiles_timed"]
        if "sweep" in on:
            out[f"{arm}.sweep_no_timed_compiles"] = not any(c["triton_compiles_timed"] for c in on["sweep"].values())
        if "first_over_second" in on:
            out[f"{arm}.first_within_5pct_of_second"] = on["first_over_second"] <= RATIO_TARGET
            out[f"{arm}.first_generate_no_compiles"] = not on["first"]["compiles"]
        if "first_over_next_engine" in on:
            out[f"{arm}.first_within_5pct_of_next_engine"] = on["first_over_next_engine"] <= RATIO_TARGET
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
    ap.add_argument("--next-engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile-start", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU: this check needs one (the CPU side is tests/test_warmup.py)")
        return 2
    if a.child:
        child(a.model, a.warmup, a.out, a.sweep, a.next_engine, a.profile_start)
        return 0
    arms = a.arms.split(",") if a.arms else None
    unknown = set(arms or ()) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}")
    return 0 if main(a.out, a.models.split(","), arms, a.sweep)["ok"] else 1


if __name__ == "__main__":
    sys.exit(cli())
