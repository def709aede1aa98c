"""One device call's measurements: named sections (lab.sections), one JSON file under --out.

    python -m lab.run --out DIR --sections ceilings,bench06,sweep06 [--file results.json]
    python -m lab.run --list

Each section's result (or its traceback) is written as soon as it ends, so a call stopped at its time limit keeps
what finished. The file holds {"environment": (commit, versions, GPU), "sections": {name: {"result" | "error",
"seconds"}}}. On a machine without .git, set MINISGL_GIT_COMMIT and MINISGL_GIT_DIRTY (lab.lease does).

An A/B against another copy of the package (an older commit's checkout in OLD): run from outside both trees with
OLD first on the path, e.g. `cd /tmp && PYTHONPATH=$OLD:$REPO python -m lab.run --out ...` (the sections use the
minisgl the path finds first; their model configs come from this checkout).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

from lab.engines import log
from lab.sections import SECTIONS, describe
from minisgl.bench.runner import environment, write_json


def run(out: str, sections: list[str], file: str = "results.json") -> dict:
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; `python -m lab.run --list` lists them")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, file)
    data = {"environment": environment(), "command": "python -m lab.run --sections " + ",".join(sections),
            "sections": {}}
    for name in sections:
        log("section", name)
        t0 = time.perf_counter()
        try:
            data["sections"][name] = {"result": SECTIONS[name].run()}
        except Exception:
            data["sections"][name] = {"error": traceback.format_exc()}
            log(name, "FAILED\n", data["sections"][name]["error"])
        data["sections"][name]["seconds"] = time.perf_counter() - t0
        write_json(path, data)
    log("done", {k: round(v["seconds"], 1) for k, v in data["sections"].items()})
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__ + "\nsections:\n" + describe(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--sections", help="comma-separated section names")
    ap.add_argument("--file", default="results.json", help="JSON file name under --out")
    ap.add_argument("--list", action="store_true", help="list the sections and exit")
    a = ap.parse_args(argv)
    if a.list:
        print(describe())
        return 0
    if not a.out or not a.sections:
        ap.error("--out and --sections are required")
    run(a.out, a.sections.split(","), a.file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
