"""The student's GPU report (notebook 09 writes it; the GPU graders read it) and the SGLang baselines.

Report JSON (`reports/student/report.json`, or the path in $MINISGL_REPORT): the same metric names as
`autograder/baselines/<gpu>.json`'s `sglang.<model>` section, one row per configuration, so the ablation table
is the rows `no_*` against `default`:

    {"gpu": "NVIDIA H200", "model": "qwen3-0.6b",
     "results": {
       "default":            {"w1_output_tok_per_s": 17000, "w2_ttft_ms": 12.0, "w2_tpot_ms": 1.9,
                              "w3_output_tok_per_s": 15000, "w3_cached_prompt_share": 0.8,
                              "w4_worst_decode_gap_ms": 7000},
       "no_overlap":         {"w1_output_tok_per_s": ..., "w2_tpot_ms": ...},
       "no_cuda_graph":      {"w1_output_tok_per_s": ..., "w2_tpot_ms": ...},
       "no_radix_cache":     {"w3_output_tok_per_s": ..., "w3_cached_prompt_share": ...},
       "no_chunked_prefill": {"w4_worst_decode_gap_ms": ...}}}
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "autograder" / "baselines"
DEFAULT_REPORT = ROOT / "reports" / "student" / "report.json"

# configuration -> the metrics its row must have (the four switches of the ablation table, plus defaults)
REQUIRED = {
    "default": ["w1_output_tok_per_s", "w2_ttft_ms", "w2_tpot_ms", "w3_output_tok_per_s", "w3_cached_prompt_share",
                "w4_worst_decode_gap_ms"],
    "no_overlap": ["w1_output_tok_per_s", "w2_tpot_ms"],
    "no_cuda_graph": ["w1_output_tok_per_s", "w2_tpot_ms"],
    "no_radix_cache": ["w3_output_tok_per_s", "w3_cached_prompt_share"],
    "no_chunked_prefill": ["w4_worst_decode_gap_ms"],
}
# the bars: minisgl / SGLang on the default configuration
THROUGHPUT_BAR = 0.6  # W1 output tokens/s >= 0.6x SGLang
TPOT_BAR = 1.5  # W2 time per output token <= 1.5x SGLang


def gpu_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (the baseline file name)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def find_baseline(gpu_name: str) -> dict | None:
    """The shipped or measured SGLang baseline whose GPU name is part of this device's name."""
    best = None
    for path in sorted(BASELINES.glob("*.json")):
        data = json.loads(path.read_text())
        if gpu_slug(data.get("gpu", path.stem)) in gpu_slug(gpu_name):
            if best is None or len(data["gpu"]) > len(best["gpu"]):  # the most specific name wins
                best = data
    return best


def report_path() -> Path:
    return Path(os.environ.get("MINISGL_REPORT", DEFAULT_REPORT))


def load_report(path: Path | None = None) -> dict | None:
    path = Path(path or report_path())
    return json.loads(path.read_text()) if path.exists() else None


def report_problems(report: dict) -> list[str]:
    """What is missing or malformed in a report (empty: it holds the full ablation table)."""
    bad = []
    for key in ("gpu", "model", "results"):
        if key not in report:
            bad.append(f"missing {key!r}")
    results = report.get("results", {})
    for config, metrics in REQUIRED.items():
        row = results.get(config)
        if row is None:
            bad.append(f"no row {config!r} in results (the ablation table needs it)")
            continue
        for m in metrics:
            v = row.get(m)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or v != v:
                bad.append(f"results[{config!r}][{m!r}] is {v!r}, not a non-negative number")
    return bad
