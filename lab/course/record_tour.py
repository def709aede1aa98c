#!/usr/bin/env python
"""Record the tour (notebooks/00_tour.ipynb) on the reference engine, for releases whose package is still stubs.

    python -m lab.course.record_tour            # writes assets/tour_trace.json (re-run after retraining the model)
    python -m lab.course.record_tour --check    # exit 1 when the recording is stale (other model or notebook)

It executes the tour notebook itself against this repository's (complete) package, so the recording is
exactly what the live tour computes: after each cell tagged `tour:<section>` it reads the cell's results
(texts, token ids, per-step batch records with timings) out of the kernel. The trace holds data only, no
code. The tour loads it through `coursekit.tour_recording()` when the live engine raises NotImplementedError.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

from lab import REPO

TOUR = REPO / "notebooks" / "00_tour.ipynb"
TRACE = REPO / "assets" / "tour_trace.json"
MODEL = REPO / "assets" / "tiny-qwen3"
MARK = "@@TOUR "

# Run in the kernel after the tagged cells; each prints one JSON line with what the recording needs.
HELPERS = '''
import json as _json
def _out(o):
    return dict(text=o.text, token_ids=list(o.token_ids), prompt_token_ids=list(o.prompt_token_ids),
                num_cached_prompt_tokens=o.num_cached_prompt_tokens, finish_reason=o.finish_reason)
def _emit(**kw):
    assert recording is None, "the reference package must run the tour live"
    print("@@TOUR " + _json.dumps(kw))
'''
CAPTURE = {
    "tour:generate": '_emit(section="generate", prompts=prompts, seconds=seconds, outputs=[_out(o) for o in outs])',
    "tour:steps": '_emit(section="steps", prompts=long_prompts, outputs=[_out(o) for o in outs], steps=steps, '
                  'seconds=sum(s["seconds"] for s in steps))',
    "tour:composition": '_emit(section="steps", composition=[list(c) for c in comp])',
    "tour:prefix": '_emit(section="prefix", prompts=[system + q for q in questions], '
                   'outputs=[_out(o) for o in first + rest], seconds=None)',
}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def fingerprint() -> dict:
    """What the recording depends on: the model's weights and the tour's code cells."""
    code = "\n".join(c.source for c in nbformat.read(TOUR, as_version=4).cells if c.cell_type == "code")
    return {"model_sha256": digest(MODEL / "model.safetensors"),
            "tour_code_sha256": hashlib.sha256(code.encode()).hexdigest()[:16]}


def record(timeout: int = 600) -> dict:
    from nbclient import NotebookClient

    nb = nbformat.read(TOUR, as_version=4)
    cells = [nbformat.v4.new_code_cell(HELPERS)]
    tags_seen = set()
    for cell in nb.cells:
        cells.append(cell)
        for tag in cell.metadata.get("tags", []):
            if tag in CAPTURE:
                cells.append(nbformat.v4.new_code_cell(CAPTURE[tag]))
                tags_seen.add(tag)
    missing = set(CAPTURE) - tags_seen
    if missing:
        raise SystemExit(f"the tour lost its tagged cells: {sorted(missing)}")
    nb.cells = cells
    env = dict(os.environ, MINISGL_COURSE_NO_EXPORT="1", PYTHONPATH=str(REPO))
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(TOUR.parent)}}).execute(env=env, cwd=str(TOUR.parent))
    sections: dict[str, dict] = {}
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for line in out.get("text", "").splitlines() if out.get("output_type") == "stream" else []:
                if line.startswith(MARK):
                    item = json.loads(line[len(MARK):])
                    sections.setdefault(item.pop("section"), {}).update(item)
    import torch
    import transformers

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "minisgl", "notebooks/00_tour.ipynb"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (1 torch thread)"
    return {
        "about": "The tour (notebooks/00_tour.ipynb) run on the reference engine; made by lab/course/record_tour.py. "
                 "Data only: the tour shows it when the student's package still raises NotImplementedError.",
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit + ("+local changes" if dirty else ""),
        "settings": {"model": "assets/tiny-qwen3", "chunked_prefill_size": 64, "temperature": 0,
                     "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "fingerprint": fingerprint(),
        "sections": sections,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(TRACE))
    ap.add_argument("--check", action="store_true", help="only check the recording matches model and tour")
    args = ap.parse_args(argv)
    if args.check:
        have = json.loads(Path(args.out).read_text()).get("fingerprint")
        ok = have == fingerprint()
        print("tour recording is current" if ok else
              f"tour recording is stale ({have} != {fingerprint()}): run python -m lab.course.record_tour")
        return 0 if ok else 1
    trace = record()
    Path(args.out).write_text(json.dumps(trace, indent=1) + "\n")
    s = trace["sections"]
    print(f"wrote {args.out} ({Path(args.out).stat().st_size // 1024} KiB): {len(s['steps']['steps'])} steps, "
          f"commit {trace['commit'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
