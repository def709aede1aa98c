"""The report's charts, rendered headless to PNG with matplotlib (Agg): each function takes plain numbers and a path.

The PNGs are committed beside the report and embedded by relative path, so GitHub's Markdown view shows them.
"""

from __future__ import annotations

from pathlib import Path

OURS, THEIRS, GREY = "#1f6f8b", "#d98c3f", "#9a9a9a"
KIND_COLOURS = {"gemm": "#1f6f8b", "attention": "#d98c3f", "norm": "#6a994e", "rope": "#a7c957",
                "kv_store": "#bc4749", "silu_and_mul": "#8e7dbe", "sampling": "#f2cc8f", "gdn": "#386641",
                "other": "#9a9a9a", "idle": "#e5e5e5"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})  # no version stamp: the same data, the same bytes
    _plt().close(fig)
    return path


def speedups(labels: list[str], values: list[float], path: Path, title: str) -> Path:
    """Horizontal bars of 'how many times better than SGLang' (>1: minisgl ahead), with the 1.0 line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(labels) + 1.2))
    ys = list(range(len(labels)))[::-1]
    ax.barh(ys, values, color=[OURS if v >= 1 else THEIRS for v in values])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(ys, labels)
    for y, v in zip(ys, values):
        ax.text(v, y, f" {v:.2f}x", va="center", fontsize=8)
    ax.set_xscale("log")  # a 40x (W4's decode gap) beside 1.1x ones
    ticks = [t for t in (0.5, 1, 2, 5, 10, 20, 50) if min(values) / 1.5 <= t <= max(values) * 1.5]
    ax.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ax.set_xlim(min(0.5, min(values) / 1.2), max(values) * 2)
    ax.set_xlabel("minisgl vs SGLang, log scale (throughput: ours / theirs; latency: theirs / ours)")
    ax.set_title(title)
    return _save(fig, path)


def ablation(arms: list[str], panels: list[tuple[str, list[float | None]]], path: Path, title: str) -> Path:
    """One panel per metric: each arm's value relative to the default arm's (1.0 = no change)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1.5, 0.3 * len(arms) + 1.4),
                             sharey=True)
    axes = axes if len(panels) > 1 else [axes]
    ys = list(range(len(arms)))[::-1]
    for ax, (name, vals) in zip(axes, panels):
        for y, v in zip(ys, vals):
            if v is None:
                continue
            ax.barh(y, v, color=OURS if v >= 1 else THEIRS)
            ax.text(v, y, f" {v:.2f}x", va="center", fontsize=7)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(name, fontsize=9)
        ax.set_xlim(0, max([v for v in vals if v] + [1]) * 1.35)
    axes[0].set_yticks(ys, arms)
    fig.suptitle(title)
    return _save(fig, path)


def paired(cells: list[str], ours: list[float], theirs: list[float], path: Path, title: str, unit: str) -> Path:
    """Grouped horizontal bars: minisgl and SGLang per cell."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.42 * len(cells) + 1.2))
    ys = [2.2 * i for i in range(len(cells))][::-1]
    ax.barh([y + 0.45 for y in ys], ours, height=0.9, color=OURS, label="minisgl")
    ax.barh([y - 0.45 for y in ys], theirs, height=0.9, color=THEIRS, label="SGLang")
    for y, a, b in zip(ys, ours, theirs):
        ax.text(a, y + 0.45, f" {a / b:.2f}x", va="center", fontsize=7)
    ax.set_yticks(ys, cells, fontsize=7)
    ax.set_xlabel(unit)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def step_kinds(models: list[str], kinds: list[dict[str, float]], floors_us: list[float], path: Path,
               title: str) -> Path:
    """One stacked bar per model: a batch-1 decode step's microseconds split by kernel kind (and the GPU's idle
    time), with the step's physical floor marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 0.6 * len(models) + 1.6))
    names = [k for k in KIND_COLOURS if any(k in d for d in kinds)]
    ys = list(range(len(models)))[::-1]
    for y, d, floor in zip(ys, kinds, floors_us):
        left = 0.0
        for k in names:
            w = d.get(k, 0.0)
            ax.barh(y, w, left=left, color=KIND_COLOURS[k], label=k if y == ys[0] else None)
            left += w
        ax.plot([floor, floor], [y - 0.45, y + 0.45], color="black", lw=1.5)
        ax.text(floor, y + 0.47, "floor", fontsize=7, ha="center")
        ax.text(left, y, f" {left:,.0f} us", va="center", fontsize=8)
    ax.set_yticks(ys, models)
    ax.set_xlabel("microseconds per decode step (batch 1); kinds in proportion to their summed kernel time")
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title(title)
    return _save(fig, path)


def timeline(spans: list[tuple[float, float, str]], path: Path, title: str) -> Path:
    """GPU activities over time (start us, duration us, kind), one row per kind: gaps are the GPU idle."""
    plt = _plt()
    kinds = [k for k in KIND_COLOURS if any(s[2] == k for s in spans)]
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(kinds) + 1.3))
    for i, k in enumerate(kinds):
        bars = [(s[0], max(s[1], 0.3)) for s in spans if s[2] == k]
        ax.broken_barh(bars, (len(kinds) - 1 - i - 0.4, 0.8), color=KIND_COLOURS[k])
    ax.set_yticks(range(len(kinds))[::-1], kinds)
    ax.set_xlabel("microseconds")
    ax.set_title(title)
    return _save(fig, path)


def latency_vs_rate(rates: list[float], series: dict[str, dict[str, list[float | None]]], path: Path,
                    title: str) -> Path:
    """One panel per latency figure, a line per server: the figure against the request rate (issue 24's curve)."""
    plt = _plt()
    panels = list(next(iter(series.values())))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels) + 0.8, 3.0))
    axes = axes if len(panels) > 1 else [axes]
    colours = [OURS, THEIRS, GREY, "#6a994e", "#8e7dbe"]
    for ax, panel in zip(axes, panels):
        for colour, (server, figures) in zip(colours, series.items()):
            pts = [(r, v) for r, v in zip(rates, figures[panel]) if v is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colour, label=server)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("requests per second")
        ax.set_xticks(rates)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)
