"""Draw the profiler timeline of reports/<gpu>/*.json (section `profile`) as a plotly figure.

    python scripts/make_timeline.py reports/h200            # writes timeline.html, and timeline.png
                                                           # when headless Chromium is installed

Each bar is one GPU kernel of the profiled W1 slice (default settings), from `timeline_us`
([start µs, duration µs, name]); gaps between bars are time the GPU waited for the host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(folder: str) -> None:
    import plotly.graph_objects as go

    sys.path.insert(0, os.path.dirname(__file__))
    from make_report import load_sections

    sections, _ = load_sections(folder)
    prof, src = sections["profile"]
    spans = prof["default"]["timeline_us"]
    t_end = 12000.0  # the first 12 ms: a few decode steps
    spans = [s for s in spans if s[0] < t_end]

    def kind(name: str) -> str:
        n = name.lower()
        for key, label in (("gemm", "matmul"), ("nvjet", "matmul"), ("cublas", "matmul"), ("cutlass", "matmul"),
                           ("decode", "attention"), ("extend", "attention"), ("rms", "norm"), ("rope", "rope"),
                           ("silu", "activation"), ("gumbel", "sampling"), ("argmax", "sampling"),
                           ("index", "KV store / gather"), ("copy", "copy"), ("elementwise", "elementwise")):
            if key in n:
                return label
        return "other"

    fig = go.Figure()
    by_kind: dict[str, list] = {}
    for start, dur, name in spans:
        by_kind.setdefault(kind(name), []).append((start, dur, name))
    for label, items in sorted(by_kind.items()):
        fig.add_trace(go.Bar(
            base=[s / 1e3 for s, _, _ in items], x=[max(d, 0.5) / 1e3 for _, d, _ in items],
            y=[label] * len(items), orientation="h", name=label, hovertext=[n for _, _, n in items]))
    d = prof["default"]
    fig.update_layout(
        title=(f"GPU kernels, Qwen3-0.6B W1 slice, overlap + CUDA Graph ({src}): "
               f"step {d['step_ms']:.2f} ms, GPU busy {100 * d['gpu_busy_fraction']:.0f}%, "
               f"{d['kernels_per_step']:.0f} kernels/step"),
        xaxis_title="time (ms)", barmode="overlay", height=420, width=1300, showlegend=False,
        margin=dict(l=140, r=20, t=60, b=50))
    html = os.path.join(folder, "timeline.html")
    fig.write_html(html, include_plotlyjs="inline", config={"displayModeBar": False})
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium:
        png = os.path.join(folder, "timeline.png")
        with tempfile.TemporaryDirectory() as profile_dir:
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--disable-background-networking", "--disable-component-update", "--no-first-run",
                            f"--user-data-dir={profile_dir}", "--window-size=1320,440",
                            f"--screenshot={os.path.abspath(png)}", "file://" + os.path.abspath(html)],
                           check=True, capture_output=True, timeout=120)
        print(f"wrote {png}")
    print(f"wrote {html}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reports/h200")
