"""The figures a report shows, as one table, and the book that records where each number came from.

A `Figure` names where minisgl's number is (dotted paths into lab.run sections, in order of preference), where
SGLang's is in the same lease (lab.sglang sections), the anchor to fall back on for SGLang
(autograder/baselines/nvidia-h200.json, another machine and day), transformers' number where a lease measured
it, the physical floor, and our target. `Book` collects every number a generated page uses, with its file, path
and commit: it becomes figures.json beside the report, which the CI test reads back against the JSON files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from lab import REPO
from lab.models import model as model_info
from lab.report import floors
from lab.report.sources import Sources, Value, dig

BASELINE = "autograder/baselines/nvidia-h200.json"


def baseline() -> dict:
    return json.loads((REPO / BASELINE).read_text())


@dataclass(frozen=True)
class Target:
    """ours/SGLang at least (throughput) or at most (latency) `ratio`, or an absolute bound in the figure's unit."""

    value: float
    relative: bool

    def text(self, higher_is_better: bool) -> str:
        op = ">=" if higher_is_better else "<="
        return f"{op} {self.value:g}x SGLang" if self.relative else f"{op} {self.value:,.4g}"


@dataclass(frozen=True)
class Figure:
    id: str
    label: str
    model: str
    unit: str
    higher_is_better: bool
    ours: tuple[str, ...]
    sglang: tuple[str, ...] = ()
    anchor: str | None = None  # key under the baseline's sglang.<model>.default
    hf: tuple[str, ...] = ()
    floor: Callable[[str, float, float], float] | None = None  # (model, bandwidth, flops) -> floor
    target: Target | None = None

    @property
    def digits(self) -> int:
        return 0 if self.unit == "tok/s" else (1 if "TTFT" in self.label or "gap" in self.label else 3)


def _w1_floor(model: str, bw: float, flops: float) -> float:
    return floors.w1_floor_tok_per_s(model, bw)


def _tpot_floor(model: str, bw: float, flops: float) -> float:
    return floors.w2_tpot_floor_ms(model, bw)


def _ttft_floor(model: str, bw: float, flops: float) -> float:
    return floors.w2_ttft_floor_ms(model, bw, flops)


def _figures(m: str, tag: str, bench: str, *, w3w4: bool, hf: bool, targets: dict) -> list[Figure]:
    """The headline figures of one model: W1, W1 top-k/top-p, W2 TTFT/TPOT (and W3, W4)."""
    sample = "qwen35" if m == "qwen3.5-0.8b" else f"sample{tag}"
    mixed = ("mixed06",) if m == "qwen3-0.6b" else ()  # the run13 lease's split-on arm ran the defaults
    out = [
        Figure(f"w1_{tag}", "W1 offline, output tok/s", m, "tok/s", True,
               tuple(f"{s}.{k}.output_tok_per_s" for s, k in ((bench, "default.w1"), (sample, "default.w1"),
                                                              *((x, "w1") for x in mixed))),
               (f"sglang_w1_{tag}.output_tok_per_s",), "w1_output_tok_per_s", floor=_w1_floor,
               target=targets.get("w1")),
        Figure(f"w1_topkp_{tag}", "W1 with top-k 50 / top-p 0.95, output tok/s", m, "tok/s", True,
               tuple(f"{s}.{k}.output_tok_per_s" for s, k in ((bench, "default.w1_topkp"),
                                                              (sample, "default.w1_topkp"),
                                                              *((x, "w1_topkp") for x in mixed))),
               (f"sglang_w1_topkp_{tag}.output_tok_per_s",), target=targets.get("w1_topkp")),
        Figure(f"w2_ttft_{tag}", "W2 TTFT ms (batch 1, 512-token prompt)", m, "ms", False,
               (f"{bench}.default.w2.ttft_ms_median", f"{sample}.default.w2.ttft_ms_median"),
               (f"sglang_w2_{tag}.ttft_ms_median",), "w2_ttft_ms",
               (f"hf{tag}.ttft_ms_median",) if hf else (), _ttft_floor, targets.get("ttft")),
        Figure(f"w2_tpot_{tag}", "W2 TPOT ms (batch 1)", m, "ms", False,
               (f"{bench}.default.w2.tpot_ms_median", f"{sample}.default.w2.tpot_ms_median"),
               (f"sglang_w2_{tag}.tpot_ms_median",), "w2_tpot_ms",
               (f"hf{tag}.tpot_ms_median",) if hf else (), _tpot_floor, targets.get("tpot")),
    ]
    if w3w4:
        out += [Figure(f"w3_{tag}", "W3 shared prefixes, output tok/s", m, "tok/s", True,
                       (f"{bench}.default.w3.output_tok_per_s", f"w3_{tag}.default.w3.output_tok_per_s"),
                       (f"sglang_w3_{tag}.output_tok_per_s",), "w3_output_tok_per_s", target=targets.get("w3")),
                Figure(f"w4_gap_{tag}", "W4 worst decode gap ms (8 x 32k prompts arrive)", m, "ms", False,
                       (f"{bench}.default.w4.worst_decode_gap_ms",), (f"sglang_w4_{tag}.worst_decode_gap_ms",),
                       "w4_worst_decode_gap_ms", target=targets.get("w4"))]
    return out


# targets: the issues' (DESIGN.md's course bars are lower: 60% of SGLang's throughput, 1.5x its TPOT)
HEADLINE: list[Figure] = [
    *_figures("qwen3-0.6b", "06", "bench06", w3w4=True, hf=True, targets={
        "w1": Target(1.1, True), "w1_topkp": Target(1.1, True), "ttft": Target(0.8, True),
        "tpot": Target(1.0, False), "w3": Target(1.1, True), "w4": Target(700, False)}),
    *_figures("qwen3-8b", "8", "bench8", w3w4=False, hf=True, targets={
        "w1": Target(1.0, True), "w1_topkp": Target(1.0, True), "tpot": Target(4.1, False)}),
    *_figures("qwen3.5-0.8b", "35", "qwen35", w3w4=False, hf=False, targets={
        "w1": Target(1.1, True), "ttft": Target(20, False), "tpot": Target(1.35, False)}),
]
HEADLINE = [f for f in HEADLINE if not (f.model == "qwen3.5-0.8b" and f.id == "w1_topkp_35")]  # not measured
FIGURES = {f.id: f for f in HEADLINE}


@dataclass
class Book:
    """Every number a page uses, by id, with where it came from."""

    sources: Sources
    entries: dict[str, dict] = field(default_factory=dict)

    def take(self, key: str, *paths: str) -> Value | None:
        v = self.sources.value(*paths)
        if v is not None:
            self.entries[key] = {"value": v.value, **v.provenance()}
        return v

    def anchor(self, key: str, *keys: str) -> float | None:
        """A figure of the anchors' file (keys into it; a model name holds a dot, so keys come apart)."""
        x = dig(baseline(), list(keys))
        if x is not None:
            self.entries[key] = {"value": x, "file": BASELINE, "keys": list(keys), "engine": "anchor"}
        return x

    def derived(self, key: str, value: float, how: str) -> float:
        self.entries[key] = {"value": value, "derived": how}
        return value


@dataclass(frozen=True)
class Row:
    """One figure of a report: ours, SGLang's (same lease, else the anchor), transformers', the floor."""

    figure: Figure
    ours: Value | None
    sglang: float | None
    sglang_from: str  # "this lease", "anchor" or ""
    hf: Value | None
    floor: float | None

    @property
    def ratio(self) -> float | None:
        return self.ours.value / self.sglang if self.ours and self.sglang else None

    def met(self) -> bool | None:
        t = self.figure.target
        if t is None or self.ours is None:
            return None
        x = self.ratio if t.relative else self.ours.value
        if x is None:
            return None
        return x >= t.value if self.figure.higher_is_better else x <= t.value

    def ahead(self) -> bool | None:
        r = self.ratio
        return None if r is None else (r >= 1 if self.figure.higher_is_better else r <= 1)


def ceilings(book: Book) -> tuple[float, float, str]:
    """(copy bytes/s, bf16 FLOP/s, where from): the lease's measurement, else the anchor's."""
    bw = book.take("copy_bytes_per_s", "ceilings.copy_bytes_per_s")
    fl = book.take("bf16_matmul_flops", "ceilings.bf16_matmul_flops")
    if bw and fl:
        return bw.value, fl.value, bw.run.file
    return (book.anchor("copy_bytes_per_s", "card", "copy_bytes_per_s"),
            book.anchor("bf16_matmul_flops", "card", "bf16_matmul_flops_low"), BASELINE)


def rows(book: Book) -> list[Row]:
    bw, flops, _ = ceilings(book)
    out = []
    for f in HEADLINE:
        ours = book.take(f.id, *f.ours)
        sg = book.take(f"sglang_{f.id}", *f.sglang) if f.sglang else None
        sglang, sfrom = (sg.value, "this lease") if sg else (None, "")
        if sg is None and f.anchor:
            a = book.anchor(f"anchor_{f.id}", "sglang", f.model, "default", f.anchor)
            sglang, sfrom = (a, "anchor") if a is not None else (None, "")
        hf = book.take(f"hf_{f.id}", *f.hf) if f.hf else None
        floor = book.derived(f"floor_{f.id}", f.floor(f.model, bw, flops), f"lab.report.floors, {f.model}") \
            if f.floor else None
        out.append(Row(f, ours, sglang, sfrom, hf, floor))
    return out


def hybrid(model: str) -> bool:
    return model_info(model).hybrid
