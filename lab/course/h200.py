#!/usr/bin/env python
"""The course on a GPU, as a student runs it: every notebook in order, then the GPU graders.

    # on the GPU machine (no network): the notebook stack comes as wheels (lab/course/wheels.sh)
    python3 -m pip install --no-index --no-deps --target /tmp/site wheels/*.whl
    PYTHONPATH=/tmp/site python3 -m lab.course.h200 --out reports/h200/course

Runs the repository's notebooks (the reference solutions, against this repository's package; the notebooks'
last cells do not re-export: MINISGL_COURSE_NO_EXPORT=1) with nbclient, one kernel each, started from this
same Python (so PYTHONPATH=/tmp/site reaches it). Errors are recorded, not raised; each notebook has its own
timeout. For each notebook: seconds, errors (cell, name, message), whether its GPU cells ran their GPU branch
(a cell guarded by `coursekit.HAS_GPU` that printed the CPU fallback's "No GPU here" did not). Notebook 09
writes the report JSON (autograder/report.py; here DIR/report.json through $MINISGL_REPORT), then
`python -m pytest autograder/graders -m gpu` runs against it. Written under DIR: the executed notebooks
(`NN_topic.ipynb`, outputs included), pytest's output, and `summary.json`.

`--only 00_tour 03_attention` runs a subset and `--graders-only` just the graders: each call merges its
results into DIR/summary.json (a machine that allows 10 minutes a command runs the course in pieces; the
checks are computed over everything recorded so far). On a machine without a GPU the GPU checks report
`false` (a CPU run is the script's own test). MINISGL_BENCH_SCALE (notebook 09) shortens the workloads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lab import REPO


def _load_gate():
    """autograder/gate.py (the autograder is a folder of scripts, not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gate", REPO / "autograder" / "gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gate"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gate = _load_gate()

# Notebooks whose GPU cells must really run on a GPU (the brief of the GPU course run).
GPU_NOTEBOOKS = {"03_attention": "Triton backend demo", "06_cuda_graph": "eager vs graph",
                 "07_overlap": "overlap timeline", "08_benchmarks": "profile", "09_gpu_project": "the project"}
CPU_FALLBACK = "No GPU here"
TIMEOUTS = {"09_gpu_project": 3600, "08_benchmarks": 1800}  # seconds per cell; others use --timeout


def gpu_cells(nb) -> list[dict]:
    """The cells guarded by `coursekit.HAS_GPU`, and whether each ran its GPU branch."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "coursekit.HAS_GPU" not in cell.source:
            continue
        text = "".join(o.get("text", "") + "".join(str(v) for v in o.get("data", {}).values())
                       for o in cell.get("outputs", []))
        errored = any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        ran = cell.get("execution_count") is not None and not errored and CPU_FALLBACK not in text
        out.append({"cell": i, "ran_on_gpu": ran, "error": errored})
    return out


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "gpu": None}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    for mod in ("transformers", "triton", "nbclient", "ipykernel", "plotly", "ipywidgets"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            env[mod] = f"missing ({type(e).__name__})"
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    env["commit"] = commit.stdout.strip() or None
    return env


def run_notebooks(out: Path, names: list[str], timeout: int) -> dict:
    import nbformat

    kernels = gate.kernel_spec_dir(sys.executable)
    env = dict(os.environ, MINISGL_COURSE_NO_EXPORT="1", MINISGL_REPORT=str(out / "report.json"))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    results = {}
    try:
        for name in names:
            src = REPO / "notebooks" / f"{name}.ipynb"
            dest = out / f"{name}.ipynb"
            print(f"[course] {name} ...", flush=True)
            run = gate.execute(src, env, TIMEOUTS.get(name, timeout), kernels, save=dest)
            nb = nbformat.read(dest, as_version=4)
            cells = gpu_cells(nb)
            results[name] = {
                "seconds": run.seconds, "ok": not run.errors and not run.timed_out,
                "errors": [str(e) for e in run.errors], "timed_out": run.timed_out,
                "cells": sum(c.cell_type == "code" for c in nb.cells),
                "executed": sum(c.cell_type == "code" and c.get("execution_count") is not None for c in nb.cells),
                "gpu_cells": cells, "gpu_ran": bool(cells) and all(c["ran_on_gpu"] for c in cells),
            }
            print(f"[course] {name}: {run.seconds} s, {len(run.errors)} error(s)"
                  + (f", TIMEOUT {run.timed_out}" if run.timed_out else "")
                  + (f", GPU cells ran: {results[name]['gpu_ran']}" if name in GPU_NOTEBOOKS else ""), flush=True)
    finally:
        shutil.rmtree(kernels, ignore_errors=True)
    return results


def run_graders(out: Path, marker: str, timeout: int) -> dict:
    env = dict(os.environ, MINISGL_REPORT=str(out / "report.json"))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH")) if x)
    cmd = [sys.executable, "-m", "pytest", "autograder/graders", "-m", marker, "-rs", "-q", "-p", "no:cacheprovider",
           f"--junitxml={out / 'graders.xml'}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout} s\n{e.stdout or ''}"
    (out / "graders.txt").write_text(text)
    tests = {}
    if (out / "graders.xml").exists():  # junit: one testcase per test, a child element unless it passed
        import xml.etree.ElementTree as ET

        for case in ET.parse(out / "graders.xml").iter("testcase"):
            kids = [k.tag for k in case if k.tag in ("failure", "error", "skipped")]
            tests[f"{case.get('classname')}::{case.get('name')}"] = kids[0] if kids else "passed"
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": round(time.perf_counter() - t0, 1),
            "tests": tests, "tail": text[-3000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the executed notebooks and summary.json")
    ap.add_argument("--only", nargs="*", help="notebook names (e.g. 00_tour); default: all, in order")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per cell (09: 3600, 08: 1800)")
    ap.add_argument("--no-graders", action="store_true", help="skip `pytest autograder/graders -m gpu`")
    ap.add_argument("--graders-only", action="store_true", help="run no notebook, only the graders")
    ap.add_argument("--marker", default="gpu", help="pytest marker expression for the graders")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [p.stem for p in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))]
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            raise SystemExit(f"no such notebooks: {sorted(unknown)}")
        names = [n for n in names if n in args.only]
    if args.graders_only:
        names = []
    t0 = time.perf_counter()
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"notebooks": {}, "runs": []}
    summary["environment"] = environment()
    summary["runs"].append({"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "notebooks": names, "graders": not args.no_graders})
    summary["notebooks"].update(run_notebooks(out, names, args.timeout))
    order = sorted(summary["notebooks"])
    summary["notebooks"] = {n: summary["notebooks"][n] for n in order}
    summary["notebook_seconds"] = round(sum(r["seconds"] for r in summary["notebooks"].values()), 1)
    if not args.no_graders:
        summary["graders"] = run_graders(out, args.marker, timeout=3600)
    gpu = summary["environment"]["gpu"] is not None
    ran = summary["notebooks"]
    checks = {
        "every notebook ran": len(ran) == len([p for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")]),
        "no notebook raised": all(r["ok"] for r in ran.values()),
        "GPU cells ran on the GPU": gpu and all(ran[n]["gpu_ran"] for n in GPU_NOTEBOOKS if n in ran),
        "notebook 09 wrote the report": (out / "report.json").exists(),
    }
    if "graders" in summary:
        g = summary["graders"]
        checks["GPU graders passed"] = g["returncode"] == 0 and bool(g["tests"]) and all(
            v == "passed" for v in g["tests"].values())
    summary["checks"] = checks
    summary["ok"] = all(checks.values())
    summary["runs"][-1]["seconds"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({"ok": summary["ok"], "checks": checks, "seconds": summary["runs"][-1]["seconds"],
                      "notebooks": {n: (r["seconds"], r["ok"], r["gpu_ran"]) for n, r in summary["notebooks"].items()}},
                     indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
