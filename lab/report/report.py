"""REPORT.md: hardware and software, request sets, headline, ablation, diagnosis, each beside SGLang and the floor.

Every number is read from the lease's JSON through a `Book` (lab.report.figures), which also becomes
figures.json; the page's structure is fixed, its sentences about the numbers are built from them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from lab.models import MODELS
from lab.report import charts, floors
from lab.report.figures import BASELINE, HEADLINE, Book, Row, baseline, ceilings, hybrid, rows
from lab.report.freshness import Verdict, check
from lab.report.sources import Run, Sources, dig
from minisgl.bench.profile import kernel_kind
from minisgl.bench.workloads import WORKLOADS, sweep_cells

MODEL_NAMES = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B", "qwen3.5-0.8b": "Qwen3.5-0.8B"}
ABLATION_SECTIONS = {"qwen3-0.6b": "bench06", "qwen3-8b": "bench8"}


def fmt(x: float | None, digits: int = 0, unit: str = "") -> str:
    if x is None:
        return "—"
    return f"{x:,.{digits}f}{unit}"


def times(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


@dataclass
class Page:
    """What every writer needs: the sources, the book, the rows, and the problems found on the way."""

    sources: Sources
    out: Path  # the folder REPORT.md goes into
    book: Book = field(init=False)
    rows: list[Row] = field(init=False)
    problems: list[str] = field(default_factory=list)
    _verdicts: dict = field(default_factory=dict)

    def __post_init__(self):
        self.book = Book(self.sources)
        self.rows = rows(self.book)
        self.bandwidth, self.flops, self.ceilings_from = ceilings(self.book)

    def verdict(self, run: Run, model: str) -> Verdict:
        key = (run.commit, run.dirty, hybrid(model))
        if key not in self._verdicts:
            self._verdicts[key] = check(*key)
        return self._verdicts[key]

    def row(self, fid: str) -> Row:
        return next(r for r in self.rows if r.figure.id == fid)

    def chart(self, name: str) -> Path:
        return self.out / "charts" / f"{name}.png"


def audit(page: Page) -> None:
    """The checks a current report must pass: every headline figure measured, at a commit that has the newest
    engine change affecting it; the ablation table from the headline's commit; SGLang from the same lease."""
    stale: dict[str, list[str]] = {}
    for r in page.rows:
        f = r.figure
        if r.ours is None:
            page.problems.append(f"{f.id}: not measured in these sources ({' or '.join(f.ours)})")
            continue
        v = page.verdict(r.ours.run, f.model)
        if not v.ok:
            stale.setdefault(("cannot tell: " if v.unknown else "stale: ") + v.why, []).append(
                f"{f.id} (`{r.ours.run.file}`)")
        if f.sglang and r.sglang_from != "this lease":
            page.problems.append(f"sglang_{f.id}: SGLang was not measured beside us "
                                 f"({'the anchor of ' + BASELINE + ' stands in' if r.sglang is not None else 'none'})")
    page.problems[:0] = [f"{why}: {', '.join(ids)}" for why, ids in stale.items()]
    for model, section in ABLATION_SECTIONS.items():
        run = page.sources.result(section)
        head = page.row(f"w1_{MODELS[model].tag}").ours
        if run is None:
            page.problems.append(f"{section}: the ablation table of {model} was not measured")
        elif head is not None and run.commit != head.run.commit:
            page.problems.append(f"{section}: the ablation's commit {run.commit[:10]} is not the headline's "
                                 f"{head.run.commit[:10]}")


# --- sections of the page --------------------------------------------------------------------------------------


def hardware(page: Page) -> list[str]:
    ours = [r for r in page.sources.runs if r.engine == "minisgl" and r.file in page.sources.environments]
    env = page.sources.environments[ours[0].file] if ours else {}
    versions = sorted({str(v.get("version")) for v in page.sources.sglang.values() if v.get("version")})
    card = baseline()["card"]

    def measured(key: str) -> str:
        e = page.book.entries.get(key, {})
        return ("anchor, not measured in these sources" if e.get("engine") == "anchor"
                else f"measured: `{e.get('file')}`")

    return ["## Hardware and software", "", "| | |", "|---|---|",
            f"| GPU | one {env.get('gpu', '—')} |",
            f"| software | torch {env.get('torch', '—')}, Triton {env.get('triton', '—')}, "
            f"CUDA {env.get('cuda', '—')}, transformers {env.get('transformers', '—')}, "
            f"Python {env.get('python', '—')} |",
            *([f"| host speed | {env['host_probe_ms']} ms for a fixed piece of Python (`host_probe_ms`, best of 3: "
               "batch-1 steps are host-bound on a slow host) |"] if env.get("host_probe_ms") else []),
            f"| SGLang | {', '.join(versions) or '—'}: Triton attention, torch sampling, seed 0, all else default "
            "(shared/anchors.md; its FA3 kernels are too large to bring to the machine) |",
            f"| minisgl commits measured | {', '.join(c[:10] for c in page.sources.commits() if c != '?')} |",
            f"| device-to-device copy (read + write) | {page.bandwidth / 1e12:.2f} TB/s "
            f"({measured('copy_bytes_per_s')}; anchors.md {card['copy_bytes_per_s'] / 1e12:.2f}) |",
            f"| bf16 matmul 8192³ | {page.flops / 1e12:.0f} TFLOP/s ({measured('bf16_matmul_flops')}; anchors.md "
            f"{card['bf16_matmul_flops_low'] / 1e12:.0f}-{card['bf16_matmul_flops_high'] / 1e12:.0f}) |", ""]


def request_sets() -> list[str]:
    """The workloads as built by minisgl.bench.workloads (the same requests for both engines)."""
    about = {"w1": "offline throughput: all at once, temperature 0.6",
             "w1_topkp": "W1's requests sampled with top-k 50, top-p 0.95 (temperature 0.6)",
             "w2": "latency: one request at a time, greedy; TTFT and TPOT = (end-to-end - TTFT) / 255, medians",
             "w2_topkp": "W2's requests sampled with top-k 50, top-p 0.95 (temperature 0.6, seeds 0-7)",
             "w3": "8 shared 1,024-token system prompts + a unique suffix, temperature 0.6: the radix cache",
             "w4": "128 requests decoding; then 8 prompts of 32,768 tokens arrive: the worst decode gap"}
    lines = ["## Request sets", "",
             "Token ids, not text (dummy weights at the models' real shapes: `assets/configs/`, bf16); the same ids "
             "for both engines (`minisgl/bench/workloads.py`, seeded).", "",
             "| set | requests | prompt tokens | output tokens | what it measures |", "|---|---|---|---|---|"]
    for name, build in WORKLOADS.items():
        w = build()
        prompts = w.prompts + w.late_prompts
        outs = [p.max_tokens for p in w.params + w.late_params]
        lines.append(f"| {name.upper().replace('_TOPKP', ' top-k/top-p')} | {len(prompts)} | "
                     f"{min(map(len, prompts)):,}-{max(map(len, prompts)):,} (sum {sum(map(len, prompts)):,}) | "
                     f"{min(outs):,}-{max(outs):,} (sum {sum(outs):,}) | {about[name]} |")
    cells = sweep_cells()
    lines += ["", f"The batch-mix sweep: {len(cells)} cells, "
              + "; ".join(sorted({f"{c.requests} requests of {c.prompt_lo}-{c.prompt_hi} prompt tokens and "
                                  f"{c.out_lo}-{c.out_hi} output tokens" for c in cells},
                               key=lambda s: (int(s.split()[0]), s)))  # a set: ordered, so the page is stable
              + "; each greedy and with top-k/top-p, all submitted at once.", ""]
    return lines


def headline(page: Page) -> list[str]:
    lines = ["## Headline", "",
             "Ratios are ours / SGLang's: above 1 is better for throughput, below 1 for latency. Floor: the bytes a "
             "step must move over the copy bandwidth above (the FLOPs over the matmul rate for a prefill, when "
             "larger): `lab/report/floors.py`.", "",
             "| model | figure | minisgl | SGLang | ours / SGLang | floor | ours / floor | transformers | target "
             "| met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in page.rows:
        f = r.figure
        sg = fmt(r.sglang, f.digits) + (" (anchor)" if r.sglang_from == "anchor" else "")
        met = {True: "yes", False: "**no**", None: "—"}[r.met()]
        lines.append(f"| {MODEL_NAMES[f.model]} | {f.label} | {fmt(r.ours.value if r.ours else None, f.digits)} "
                     f"| {sg} | {times(r.ratio)} | {fmt(r.floor, f.digits)} "
                     f"| {times(r.ours.value / r.floor if r.ours and r.floor else None)} "
                     f"| {fmt(r.hf.value if r.hf else None, f.digits)} "
                     f"| {f.target.text(f.higher_is_better) if f.target else '—'} | {met} |")
    hf = page.sources.value("hf06.requests")
    w3 = page.book.take("w3_cached_06", "bench06.default.w3.cached_prompt_share",
                        "w3_06.default.w3.cached_prompt_share")
    sw3 = page.book.take("sglang_w3_cached_06", "sglang_w3_06.cached_prompt_share")
    notes = []
    if w3:
        notes.append(f"W3 served {100 * w3.value:.1f}% of its prompt tokens from the radix cache"
                     + (f" (SGLang {100 * sw3.value:.1f}%)." if sw3 else "."))
    if hf:
        tok = page.sources.value("hf06.output_tokens_each")
        notes.append(f"transformers: `generate` with sdpa attention and its dynamic cache on the same weights, "
                     f"{hf.value} of W2's requests with {tok.value if tok else 256} output tokens (it takes tens of "
                     "ms a token).")
    notes.append("(anchor): SGLang's figure of shared/anchors.md (`autograder/baselines/nvidia-h200.json`, "
                 "another H200 and day), where this lease has none.")
    lines += ["", *notes, ""]
    pairs = [(f"{MODEL_NAMES[r.figure.model]} {r.figure.label.split(',')[0].split(' (')[0]}",
              r.ratio if r.figure.higher_is_better else 1 / r.ratio) for r in page.rows if r.ratio]
    if pairs:
        charts.speedups([p[0] for p in pairs], [p[1] for p in pairs], page.chart("headline"),
                        "minisgl against SGLang, same H200")
        lines += ["![minisgl against SGLang per headline figure](charts/headline.png)", ""]
    return lines


def ablation(page: Page) -> list[str]:
    from lab.sections import ABLATION
    lines = ["## Ablation: each switch off in turn", "",
             "Every optimisation is an engine switch (README: the `LLM(...)` keyword and its CLI flag), so each row "
             "is one flag; a fresh engine per row, defaults otherwise. 'vs default' divides by the default row "
             "(throughput: below 1 is a loss; TPOT: above 1 is a loss). The eager row's W2 ran 2 of the 8 "
             "requests. SGLang's column: the same switch off in SGLang (shared/anchors.md, another H200 and day).",
             ""]
    sg_anchor = baseline()["sglang"]
    for model, section in ABLATION_SECTIONS.items():
        run = page.sources.result(section)
        if run is None:
            continue
        res = run.result
        d = res.get("default", {})
        lines += [f"### {MODEL_NAMES[model]} (`{run.file}`, commit {run.commit[:10]})", "",
                  "| setting | what it changes | W1 tok/s | vs default | W1 top-k/top-p | W2 TPOT ms | vs default "
                  "| W2 TTFT ms | W3 tok/s (cached) | W4 worst gap ms | SGLang, same switch off |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        again = res.get("default_again", {})
        base = again if "w1" in again else d  # the rows' base: the default measured again, last, when it was
        arms, w1s, tpots = [], [], []
        for label, r in res.items():
            if "error" in r:
                lines.append(f"| {label} | failed: see the JSON | | | | | | | | | |")
                continue
            key = f"{section}.{label}"
            w1 = page.book.take(f"{key}.w1", f"{key}.w1.output_tok_per_s")
            tk = page.book.take(f"{key}.w1_topkp", f"{key}.w1_topkp.output_tok_per_s")
            tpot = page.book.take(f"{key}.w2.tpot", f"{key}.w2.tpot_ms_median")
            ttft = page.book.take(f"{key}.w2.ttft", f"{key}.w2.ttft_ms_median")
            w3 = page.book.take(f"{key}.w3", f"{key}.w3.output_tok_per_s")
            w4 = page.book.take(f"{key}.w4", f"{key}.w4.worst_decode_gap_ms")
            dw1 = dig(base, ["w1", "output_tok_per_s"])
            dtpot = dig(base, ["w2", "tpot_ms_median"]) or dig(d, ["w2", "tpot_ms_median"])
            rw1 = w1.value / dw1 if w1 and dw1 else None
            rtpot = tpot.value / dtpot if tpot and dtpot else None
            cached = dig(r, ["w3", "cached_prompt_share"])
            sg = sg_anchor.get(model, {}).get(label, {})
            sg_txt = ", ".join(f"{k.replace('_output_tok_per_s', '').replace('_ms', ' ms').replace('_', ' ')} "
                               f"{v:,}" for k, v in sg.items() if "share" not in k) if label != "default" else "—"
            about = ABLATION[label].about if label in ABLATION else ""
            lines.append(
                f"| {label} | {about} | {fmt(w1.value if w1 else None)} | {times(rw1) if r is not base else ''} "
                f"| {fmt(tk.value if tk else None)} | {fmt(tpot.value if tpot else None, 3)} "
                f"| {times(rtpot) if r is not base else ''} | {fmt(ttft.value if ttft else None, 1)} "
                f"| {fmt(w3.value if w3 else None)}{f' ({100 * cached:.0f}%)' if cached is not None else ''} "
                f"| {fmt(w4.value if w4 else None)} | {sg_txt or '—'} |")
            if label not in ("default", "default_again"):
                arms.append(label)
                w1s.append(rw1)
                tpots.append(1 / rtpot if rtpot else None)
        lines.append("")
        note = first_run_note(res)
        if note:
            lines += [note, ""]
        if model == "qwen3-0.6b" and arms:
            charts.ablation(arms, [("W1 throughput vs default", w1s), ("W2 decode speed (1/TPOT) vs default", tpots)],
                            page.chart("ablation"), f"{MODEL_NAMES[model]}: each switch off, relative to all on")
            lines += ["![Each switch off in turn, relative to the defaults](charts/ablation.png)", ""]
    return lines


# rows whose switch slows W1 by design; every other row's W1 tells whether the first W1 of a process was slower
SLOWER_BY_DESIGN = ("no_overlap", "no_cuda_graph")


def first_run_cost(res: dict) -> tuple[float, float] | None:
    """(lowest, highest) ratio of the later rows' W1 to the default's, when every row that need not slow W1 ran
    it more than 3% faster than the default: then the default's W1, the first of its process, paid a cost of being
    first rather than the rows a gain of their switch. None when the rows do not show it."""
    d = dig(res.get("default", {}), ["w1", "output_tok_per_s"])
    later = [dig(r, ["w1", "output_tok_per_s"]) / d for label, r in res.items()
             if d and label not in ("default", *SLOWER_BY_DESIGN) and dig(r, ["w1", "output_tok_per_s"])]
    if not later or min(later) < 1.03:
        return None
    return min(later), max(later)


def first_run_note(res: dict) -> str | None:
    """What the ablation's base is, when the first W1 of the process ran slower than the rest."""
    again, d = dig(res, ["default_again", "w1", "output_tok_per_s"]), dig(res, ["default", "w1", "output_tok_per_s"])
    if again and d:
        return (f"'vs default' divides by `default_again`, the defaults on a second engine after the other rows: the "
                f"first engine's W1, the first of its process, ran at {times(d / again)} of it.")
    cost = first_run_cost(res)
    if cost is None:
        return None
    return (f"Read the W1 column with care: every row after the default that need not slow W1 ran it "
            f"{times(cost[0])}-{times(cost[1])} of the default, whichever switch it turned off. The default's W1 "
            f"was the first of its process, and that first run pays a cost the engine's warm-up does not remove "
            f"(no Triton compile was timed in it): every W1 ratio here is that much too high, so the gains are "
            f"the first run's cost, not the switch's, and the losses (overlap, CUDA graphs) are larger than shown. "
            f"Leases after this one measure the defaults again, last (`default_again`), and divide by that.")


def kinds_per_step(t: dict) -> dict[str, float]:
    """GPU time per decode step by kernel kind (minisgl.bench.profile.kernel_kind), from a timeline's activities
    (the first few thousand are kept: the steps they span, not the steps profiled)."""
    acts = t["activities"]
    steps = len(acts) / t["activities_per_step"]
    out: dict[str, float] = {}
    for _, dur, name in acts:
        k = kernel_kind(name)
        out[k] = out.get(k, 0.0) + dur / steps
    return out


def step_breakdown(page: Page) -> list[str]:
    """The batch-1 decode step of each model with a timeline: ms per step, GPU time by kernel kind, the floor."""
    found = []
    for model in MODELS:
        t = page.book.take(f"timeline_{model}", f"timeline:{model}.unprofiled_ms_per_step")
        if t:
            found.append((model, t, t.run.result))
    if not found:
        return []
    names = sorted({k for *_, tl in found for k in kinds_per_step(tl)})
    lines = ["### The batch-1 decode step (`lab.timeline`: W2's setting, 20 steps profiled)", "",
             "GPU time per step by kernel kind, microseconds (summed kernel durations: under PDL a kernel's span "
             "includes its wait for the one before, so the kinds can add up to more than the step).", "",
             "| model | ms per step (unprofiled) | floor ms | kernels per step | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    bars, floors_us = [], []
    for model, t, tl in found:
        k = kinds_per_step(tl)
        floor = floors.w2_tpot_floor_ms(model, page.bandwidth)
        page.book.derived(f"timeline_{model}.floor_ms", floor, "lab.report.floors.w2_tpot_floor_ms")
        lines.append(f"| {MODEL_NAMES[model]} (`{t.run.file}`) | {t.value:.3f} | {floor:.3f} | "
                     f"{tl['activities_per_step']:.0f} | " + " | ".join(f"{k.get(n, 0):.0f}" for n in names) + " |")
        # kernel spans overlap under PDL (their sum can pass the step): each kind's share of the summed spans,
        # scaled to the step's busy time; idle is what the step takes beyond its graphs replayed back to back
        # (the profile's own gaps, which the profiler widens, where there is no such replay)
        step_us = 1e3 * t.value
        bare = (tl.get("bare_replay") or {}).get("us_per_step")
        idle = min(step_us, max(0.0, step_us - bare) if bare else tl.get("idle_us_per_step", 0.0))
        total = sum(k.values()) or 1.0
        bars.append({**{n: v / total * (step_us - idle) for n, v in k.items()}, "idle": idle})
        floors_us.append(1e3 * floor)
    charts.step_kinds([MODEL_NAMES[m] for m, *_ in found], bars, floors_us, page.chart("step"),
                      "Where a batch-1 decode step goes")
    lines += ["", "![GPU time of a batch-1 decode step by kernel kind](charts/step.png)", ""]
    model, t, tl = found[0]
    spans = []
    per = tl["activities_per_step"]
    for start, dur, name in tl["activities"][: int(2 * per)]:
        spans.append((start, dur, kernel_kind(name)))
    if spans:
        charts.timeline(spans, page.chart("timeline"), f"{MODEL_NAMES[model]}: two batch-1 decode steps on the GPU")
        lines += ["![Two batch-1 decode steps, kernels by kind](charts/timeline.png)", ""]
    return lines


def profile_table(page: Page) -> list[str]:
    prof = page.sources.result("profile")
    if prof is None:
        return []
    p = prof.result
    lines = [f"### A 64-request W1 slice, 30 decode steps under torch.profiler (Qwen3-0.6B, `{prof.file}`)", "",
             "| setting | step ms | GPU busy | kernels / step | host gap per step ms |", "|---|---|---|---|---|"]
    for label in ("default", "no_overlap", "no_cuda_graph"):
        r = p.get(label)
        if not r:
            continue
        step = page.book.take(f"profile.{label}.step_ms", f"profile.{label}.step_ms")
        busy = page.book.take(f"profile.{label}.busy", f"profile.{label}.gpu_busy_fraction")
        kps = page.book.take(f"profile.{label}.kernels", f"profile.{label}.kernels_per_step")
        lines.append(f"| {label} | {step.value:.2f} | {100 * busy.value:.0f}% | {kps.value:.0f} | "
                     f"{r['cpu_gap_ms'] / max(r['profiled_steps'], 1):.2f} |")
    host = dig(p, ["default", "host_ms_per_step_unprofiled"])
    if host:
        lines += ["", "Host time per step in the same steady state, unprofiled (defaults): "
                  + ", ".join(f"{k} {v:.3f} ms" for k, v in host.items())
                  + ". Under the overlap loop `wait` is how far the GPU runs ahead of the host."]
    return lines + [""]


def diagnose(page: Page, r: Row) -> str:
    """Why a figure misses, from the profiles of the same sources."""
    f = r.figure
    if "tpot" in f.id:
        t = page.sources.result(f"timeline:{f.model}")
        if t is None:
            return "no timeline of this model's batch-1 step in these sources."
        tl = t.result
        gemm = kinds_per_step(tl).get("gemm", 0.0)
        bare = (tl.get("bare_replay") or {}).get("us_per_step")
        shape = floors.shape(f.model)
        text = f"a step takes {tl['unprofiled_ms_per_step']:.2f} ms (`{t.file}`)"
        if bare:
            text += (f"; its CUDA graphs replayed back to back, nothing else on the host, take {bare / 1e3:.2f} ms: "
                     f"the GPU sets the pace, running {tl['activities_per_step']:.0f} kernels and copies a step, "
                     f"{bare / tl['activities_per_step']:.1f} us each on average")
        return (text + f". The floor is {r.floor:.2f} ms ({shape.weight_bytes / 1e9:.2f} GB of weights and the "
                f"request's KV over {page.bandwidth / 1e12:.2f} TB/s); the matmul kernels' spans add up to "
                f"{gemm / 1e3:.2f} ms a step (under PDL a span includes the kernel's wait for the one before).")
    if "ttft" in f.id:
        where = {"qwen3-0.6b": "profile.small_batches.w2_request", "qwen3-8b": "profile8.w2_request"}.get(f.model)
        req = page.sources.value(where) if where else None
        if req is None:
            return "no profile of a W2 request in these sources."
        w = req.value
        return (f"a profiled W2 request (`{req.run.file}`): TTFT {w['ttft_ms']:.1f} ms, of which the host spends "
                f"{w['prefill_host_launch_ms']:.1f} ms scheduling and launching the prefill; its kernels keep the "
                f"GPU busy {w['gpu_busy_ms']:.1f} ms.")
    if f.unit == "tok/s":
        return throughput_notes(page, r)
    return "not profiled in these sources."


def throughput_notes(page: Page, r: Row) -> str:
    """What the timed run itself recorded (Triton compiles inside it, retractions, graph hits, prefix hits), and
    for Qwen3-0.6B the profiled W1 slice."""
    run = r.ours.run
    keys = r.ours.path[len(run.section) + 1:].split(".")[:-1]
    w = dig(run.result, keys) or {}
    eng = w.get("engine", {})
    notes = []
    compiles = sum((w.get("triton_compiles_timed") or {}).values())
    if compiles:
        notes.append(f"{compiles} Triton kernel variants were compiled inside the timed run (a compile costs seconds)")
    if eng.get("retractions"):
        notes.append(f"the engine retracted {eng['retractions']} requests for lack of KV memory")
    if eng.get("cuda_graph_hit_rate") is not None and eng["cuda_graph_hit_rate"] < 0.99:
        notes.append(f"only {100 * eng['cuda_graph_hit_rate']:.0f}% of decode steps replayed a CUDA graph")
    if r.figure.id.startswith("w3") and "cached_prompt_share" in w:
        theirs = page.sources.value(f"sglang_w3_{MODELS[r.figure.model].tag}.cached_prompt_share")
        notes.append(f"{100 * w['cached_prompt_share']:.0f}% of prompt tokens came from the prefix cache"
                     + (f" (SGLang {100 * theirs.value:.0f}%)" if theirs else ""))
    prof = page.sources.result("profile")
    if prof and r.figure.model == "qwen3-0.6b" and r.figure.id.startswith("w1"):
        d = prof.result["default"]
        notes.append(f"in a profiled 64-request W1 slice (`{prof.file}`) a step takes {d['step_ms']:.2f} ms with the "
                     f"GPU busy {100 * d['gpu_busy_fraction']:.0f}% of it")
    return ("the timed run (`" + run.file + "`): " + "; ".join(notes) + ".") if notes else (
        f"the timed run (`{run.file}`) recorded no compiles, retractions or graph misses, and no profile of it is "
        "in these sources.")


def diagnosis(page: Page) -> list[str]:
    lines = ["## Diagnosis", ""]
    misses = [r for r in page.rows if r.ours and (r.ahead() is False or r.met() is False)]
    if misses:
        lines += ["Where minisgl is behind SGLang or short of its target, and what the profiles say:", ""]
        for r in misses:
            f = r.figure
            what = []
            if r.ahead() is False:
                what.append(f"behind SGLang ({times(r.ratio)})")
            if r.met() is False:
                what.append(f"short of the target {f.target.text(f.higher_is_better)}")
            lines.append(f"- **{MODEL_NAMES[f.model]} {f.label}: {fmt(r.ours.value, f.digits)}**, "
                         f"{' and '.join(what)}: {diagnose(page, r)}")
        lines.append("")
    else:
        lines += ["Every headline figure is ahead of SGLang and meets its target.", ""]
    return lines + profile_table(page) + step_breakdown(page)


def sweep(page: Page) -> list[str]:
    ours = page.sources.value("sweep06.cells", "mixed06.sweep")
    theirs = page.sources.value("sglang_sweep_06")
    if not ours or not theirs:
        return []
    cells = [c for c in ours.value if c in theirs.value]
    lines = [f"## The batch-mix sweep, Qwen3-0.6B (`{ours.run.file}`; SGLang `{theirs.run.file}`)", "",
             "| cell | minisgl tok/s | SGLang tok/s | ratio |", "|---|---|---|---|"]
    a_s, b_s = [], []
    for c in cells:
        a = page.book.take(f"sweep.{c}", f"{ours.path}.{c}.output_tok_per_s").value
        b = page.book.take(f"sglang_sweep.{c}", f"sglang_sweep_06.{c}.output_tok_per_s").value
        a_s.append(a)
        b_s.append(b)
        lines.append(f"| {c} | {a:,.0f} | {b:,.0f} | {a / b:.2f}x |")
    ahead = sum(a > b for a, b in zip(a_s, b_s))
    page.book.derived("sweep.ahead", ahead, "cells where minisgl's tok/s > SGLang's")
    lines += ["", f"minisgl ahead in {ahead} of {len(cells)} cells (geometric mean "
              f"{statistics.geometric_mean([a / b for a, b in zip(a_s, b_s)]):.2f}x).", ""]
    charts.paired([c.replace("_", " ") for c in cells], a_s, b_s, page.chart("sweep"),
                  "Batch-mix sweep, Qwen3-0.6B", "output tok/s")
    return lines + ["![The sweep's cells, both engines](charts/sweep.png)", ""]


def mixes35(page: Page) -> list[str]:
    """Qwen3.5 away from W1 (issue 29): many long prompts, and shared prefixes with mixed sampling; minisgl with its
    request rows sized from memory and at the former fixed 256, SGLang on the same requests."""
    theirs = page.sources.result("sglang_mixes_35")
    ours = page.sources.result("mixes35")
    if not ours or not theirs:
        return []
    fixed = page.sources.result("mixes35_rows256")
    lines = [f"## Qwen3.5-0.8B under other mixes (`{ours.file}`; SGLang `{theirs.file}`)", "",
             "All requests at once. minisgl sizes its running requests from memory "
             f"({ours.result.get('max_running_requests')} here; SGLang: "
             f"{dig(theirs.result, ['server_info', 'effective_max_running_requests_per_dp'])}); the 256 column is the "
             "same engine held to the 256 it ran before.", "",
             "| mix | minisgl tok/s | largest decode batch | minisgl at 256 requests | SGLang tok/s | ours / SGLang "
             "| prompt tokens from the cache (ours, SGLang) |", "|---|---|---|---|---|---|---|"]
    for mix, cell in ours.result.get("mixes", {}).items():
        a = page.book.take(f"mixes35.{mix}", f"mixes35.mixes.{mix}.output_tok_per_s")
        b = page.book.take(f"sglang_mixes35.{mix}", f"sglang_mixes_35.{mix}.output_tok_per_s")
        c = page.book.take(f"mixes35_rows256.{mix}", f"mixes35_rows256.mixes.{mix}.output_tok_per_s") if fixed else None
        if a is None or b is None:
            continue
        share = (f"{100 * cell['run']['cached_prompt_share']:.0f}%, "
                 f"{100 * dig(theirs.result, [mix, 'cached_prompt_share']):.0f}%")
        lines.append(f"| {cell['cell']['name']} | {fmt(a.value)} | {cell['max_decode_batch']} | "
                     f"{fmt(c.value if c else None)} | {fmt(b.value)} | {times(a.value / b.value)} | {share} |")
    return lines + [""]


# the client's figures a serving table shows: (bench_serving key, label, digits); the chart's are the latencies
SERVING_FIGURES = (("median_ttft_ms", "median TTFT ms", 1), ("p99_ttft_ms", "P99 TTFT ms", 1),
                   ("median_tpot_ms", "median TPOT ms", 2), ("median_itl_ms", "median ITL ms", 2),
                   ("p99_itl_ms", "P99 ITL ms", 1), ("output_throughput", "output tok/s", 0))
SERVING_CHART = ("median_ttft_ms", "median_tpot_ms", "p99_itl_ms")
# the lease calls whose serve-bench runs both servers on the same machine (lab/lease.py): the newest one is shown
SERVING_SECTIONS = ("serving", "settle24")


def serving(page: Page) -> list[str]:
    """Online serving (issue 24): each server of the lease's serving call at each load, SGLang's bench_serving
    client, the latency-against-rate curve, and the server's all-at-once rate against the offline engine's on the
    same requests. The server's code counts here, so the section says when it changed after the run (the
    headline's freshness check leaves the server out)."""
    runs = [r for r in map(page.sources.result, SERVING_SECTIONS) if r is not None]
    if not runs:
        return []
    run = max(runs, key=lambda r: r.time_utc)
    servers = {name: s["results"] for name, s in run.result.get("servers", {}).items() if s.get("results")}
    loads = run.result.get("loads", {})
    names = sorted(servers, key=lambda n: n != "minisgl")  # minisgl first: the ratio column is minisgl / SGLang
    loads = {load: spec for load, spec in loads.items() if any(load in r for r in servers.values())}
    if not loads:
        return []
    lines = [f"## Serving: minisgl's server and SGLang's under SGLang's client (`{run.file}`, commit "
             f"{run.commit[:10]})", "",
             "Each load: 1,024-token prompts (random ids, seed 1), `sglang.bench_serving --backend vllm` "
             "(streaming completions); the request rate, and all at once (`burst`). A dash: that load did not "
             "run. " + ("Ratio: minisgl / SGLang." if "sglang" in names else ""), ""]
    verdict = check(run.commit, run.dirty, hybrid=False, paths=["minisgl"])  # the server counts here
    if not verdict.ok and not verdict.unknown:
        lines += [f"Not current: {verdict.why}. These figures are of the commit measured.", ""]
    theirs = names.index("sglang") if "sglang" in names else None
    head = "| load | figure | " + " | ".join("SGLang" if n == "sglang" else n for n in names) + " |"
    lines += [head + (" ratio |" if theirs is not None else ""),
              "|" + "---|" * (len(names) + 2 + (theirs is not None))]
    for load in loads:
        for key, label, digits in SERVING_FIGURES:
            vals = []
            for name in names:
                v = page.book.take(f"serving.{name}.{load}.{key}",
                                   f"{run.section}.servers.{name}.results.{load}.{key}")
                vals.append(v.value if v else None)
            row = f"| {load} | {label} | " + " | ".join(fmt(v, digits) for v in vals) + " |"
            if theirs is not None:
                row += f" {times(vals[0] / vals[theirs]) if vals[0] and vals[theirs] else ''} |"
            lines.append(row)
    lines.append("")
    rated = [load for load in loads if loads[load][0] != "inf"]
    if len(rated) >= 2:
        rates = [float(loads[load][0]) for load in rated]
        series = {name: {label: [dig(servers[name], [load, key]) for load in rated]
                         for key, label, _ in SERVING_FIGURES if key in SERVING_CHART}
                  for name in names}
        charts.latency_vs_rate(rates, series, page.chart("serving"), "Latency against request rate")
        lines += ["![Latency against request rate](charts/serving.png)", ""]
    offline = page.book.take("serving.offline.output_tok_s", f"{run.section}.offline.output_tok_s")
    share = page.book.take("serving.server_over_offline", f"{run.section}.server_over_offline")
    if offline and share:
        lines += [f"The same {fmt(dig(run.result, ['offline', 'requests']), 0)} all-at-once requests through the "
                  f"offline engine (`minisgl.LLM`, the server stopped): {fmt(offline.value, 0)} output tok/s; "
                  f"minisgl's server delivered **{share.value:.0%}** of that.", ""]
    return lines


def provenance(page: Page) -> list[str]:
    used = {}
    for e in page.book.entries.values():
        if "file" in e and e.get("engine") != "anchor":
            used.setdefault(e["file"], e.get("commit", "?"))
    lines = ["## Where every number comes from", "",
             "`figures.json` beside this page lists each number with its file, the path inside it and the commit "
             "(the CI test `tests/test_lab_report.py` reads them back). Files used:", "",
             "| file | commit |", "|---|---|"]
    lines += [f"| `{f}` | {c[:10]} |" for f, c in sorted(used.items())]
    lines += ["", "Earlier leases, one line each: [HISTORY.md](HISTORY.md). Regenerate this page and the blog: "
              "`python -m lab.report` (the lease plan: `python -m lab.lease plan`).", ""]
    return lines


def write(page: Page, draft: bool) -> str:
    newest = page.sources.runs[0] if page.sources.runs else None
    intro = ["# minisgl on an NVIDIA H200: performance report", "",
             "minisgl is the reference engine of a course in which students build an LLM inference engine, one "
             "notebook per module. This page measures it against SGLang 0.5.16 on one H200: the same dummy "
             "weights at the real model shapes, the same requests, one lease. Generated by `python -m lab.report` "
             "from the lease's JSON" + (f" (newest file {newest.time_utc[:10]})." if newest else "."), ""]
    if page.problems:
        intro += [f"> **{'DRAFT' if draft else 'NOT CURRENT'}: this page does not meet the report's checks.** "
                  "It is generated from the newest result of each section across earlier leases, to review the "
                  "layout; the lease at the current commit (`python -m lab.lease plan`) replaces it. Problems:", ">"]
        intro += [f"> - {p}" for p in page.problems] + [""]
    else:
        intro += ["Every minisgl figure below was measured at a commit that contains the newest change to the "
                  "engine code it depends on (checked by the generator and in CI).", ""]
    body = (hardware(page) + request_sets() + headline(page) + ablation(page) + diagnosis(page) + sweep(page)
            + mixes35(page) + serving(page))
    return "\n".join(intro + body + provenance(page)) + "\n"


__all__ = ["HEADLINE", "Page", "audit", "write"]
