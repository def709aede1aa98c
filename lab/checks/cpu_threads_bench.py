#!/usr/bin/env python
"""The CPU engine's torch thread count, measured end to end: `python -m minisgl generate` on the embedded
model, as a user runs it, with `--cpu-threads N` for N = 1 .. all cores and with no flag (the default, auto),
each on its own and beside one busy process (`yes > /dev/null`, one core's worth of work). Wall seconds per
run, median of --repeat, the settings taking turns. Writes OUT_DIR/cpu_threads.json.

    python -m lab.checks.cpu_threads_bench OUT_DIR [--repeat 3] [--max-tokens 40]

The machine's own load is recorded too (load average before and after): a shared machine inflates every
figure, so compare settings within one run, never across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lab import REPO


def one_run(threads: int | None, max_tokens: int) -> float:
    cmd = [sys.executable, "-m", "minisgl", "generate", "--model", str(REPO / "assets" / "tiny-qwen3"),
           "--prompt", "The function returns", "--max-tokens", str(max_tokens)]
    if threads is not None:
        cmd += ["--cpu-threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH")) if x)
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    settings: list[int | None] = [None, *sorted({1, max(1, cores // 2), cores})]
    load_before = os.getloadavg()
    rows = []
    for beside in ("nothing", "one busy process"):
        busy = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if beside != "nothing" else None
        try:
            one_run(None, 4)  # warm the file cache (model, python modules) before timing
            times: dict = {threads: [] for threads in settings}
            for _ in range(args.repeat):  # settings interleaved: a change in the machine's load hits them alike
                for threads in settings:
                    times[threads].append(one_run(threads, args.max_tokens))
            for threads, ts in times.items():
                rows.append({"beside": beside, "cpu_threads": "auto (default)" if threads is None else threads,
                             "seconds": [round(t, 2) for t in ts], "median_s": round(statistics.median(ts), 2)})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"what": "wall seconds of `python -m minisgl generate --model assets/tiny-qwen3 --max-tokens "
                    f"{args.max_tokens}` (process start to exit), median of {args.repeat}",
            "cores": cores, "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "rows": rows}
    (out / "cpu_threads.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out / 'cpu_threads.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
