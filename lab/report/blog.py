"""BLOG.md: the post in blog.md (prose written by hand) with its numbers filled in from the report's book.

Every `{name}` of blog.md is a fact below, read from the same JSON as the report (and recorded in figures.json);
a block between `<!-- if NAME -->` and `<!-- end -->` appears only when that fact is true. The prose also makes
claims about the numbers ("CUDA Graphs matter most"): CLAIMS checks each one against the data, and a claim the
data no longer supports fails the generator, naming the sentence to rewrite.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from lab import REPO
from lab.models import text_config
from lab.report import floors
from lab.report.report import MODEL_NAMES, Page, diagnose, first_run_cost, fmt, kinds_per_step, times

TEMPLATE = Path(__file__).with_name("blog.md")


def course_bars() -> tuple[float, float]:
    """The autograder's bars (autograder/report.py: THROUGHPUT_BAR, TPOT_BAR)."""
    spec = importlib.util.spec_from_file_location("autograder_report", REPO / "autograder" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("autograder_report", module)
    spec.loader.exec_module(module)
    return module.THROUGHPUT_BAR, module.TPOT_BAR


class Facts(dict):
    """Formatted numbers by name; a missing one renders as a visible gap and is listed."""

    def __init__(self):
        super().__init__()
        self.missing: set[str] = set()

    def __missing__(self, key: str) -> str:
        self.missing.add(key)
        return f"[{key}: not measured]"


def facts(page: Page) -> tuple[Facts, list[tuple[str, bool | None]]]:
    f, book = Facts(), page.book
    val = {r.figure.id: r for r in page.rows}

    def ours(fid):
        r = val.get(fid)
        return r.ours.value if r and r.ours else None

    def put(name, x, digits=0, unit=""):
        if x is not None:
            f[name] = fmt(x, digits, unit)

    def vs(fid) -> str | None:
        """'1.19x' for throughput (ours/theirs), 'at 0.52x' for latency, from the row's ratio."""
        r = val.get(fid)
        return None if r is None or r.ratio is None else f"{r.ratio:.2f}x"

    env = page.sources.environments
    f["gpu"] = next((e["gpu"] for e in env.values() if e.get("gpu")), "H200")
    f["sglang_version"] = next((str(v.get("version")) for v in page.sources.sglang.values() if v.get("version")),
                               "0.5.16")
    f["bandwidth"] = f"{page.bandwidth / 1e12:.2f}"
    for fid, r in val.items():
        put(fid.replace("w2_", ""), ours(fid), r.figure.digits)
        if r.sglang is not None:
            put("sg_" + fid.replace("w2_", ""), r.sglang, r.figure.digits)
        if r.floor is not None:
            put("floor_" + fid.replace("w2_", ""), r.floor, r.figure.digits)
        if vs(fid):
            f[fid.replace("w2_", "") + "_vs"] = vs(fid)
    put("w4_06", ours("w4_gap_06"))
    put("sg_w4_06", val["w4_gap_06"].sglang)
    if ours("w2_tpot_06") and val["w2_tpot_06"].floor:
        f["tpot_06_x_floor"] = times(ours("w2_tpot_06") / val["w2_tpot_06"].floor)
    compared = [r for r in page.rows if r.ahead() is not None]
    f["ahead"], f["compared"] = str(sum(r.ahead() for r in compared)), str(len(compared))

    # the ablation (bench06 on Qwen3-0.6B)
    abl = page.sources.result("bench06")
    arms = abl.result if abl else {}

    def arm(label, *keys):
        x = book.take(f"bench06.{label}.{'.'.join(keys)}", f"bench06.{label}.{'.'.join(keys)}") if abl else None
        return x.value if x else None

    # the rows' base: the defaults measured again, last, when the lease did (report.first_run_note says why)
    again = arm("default_again", "w1", "output_tok_per_s")
    d_w1 = again or arm("default", "w1", "output_tok_per_s")
    for name, label, keys, digits in (("eager_w1", "no_cuda_graph", ("w1", "output_tok_per_s"), 0),
                                      ("eager_tpot", "no_cuda_graph", ("w2", "tpot_ms_median"), 1),
                                      ("no_overlap_w1", "no_overlap", ("w1", "output_tok_per_s"), 0),
                                      ("no_overlap_tpot", "no_overlap", ("w2", "tpot_ms_median"), 3),
                                      ("no_radix_w3", "no_radix_cache", ("w3", "output_tok_per_s"), 0),
                                      ("no_chunk_w4", "no_chunked_prefill", ("w4", "worst_decode_gap_ms"), 0),
                                      ("no_gemv_tpot", "no_gemv", ("w2", "tpot_ms_median"), 3),
                                      ("no_pdl_tpot", "no_pdl", ("w2", "tpot_ms_median"), 3),
                                      ("no_pg_ttft", "no_prefill_graphs", ("w2", "ttft_ms_median"), 1),
                                      ("no_fused_w1_topkp", "no_fused_sampler", ("w1_topkp", "output_tok_per_s"), 0)):
        put(name, arm(label, *keys), digits)
    w1_ratio = {label: arm(label, "w1", "output_tok_per_s") / d_w1 for label in arms
                if label not in ("default", "default_again") and d_w1 and arm(label, "w1", "output_tok_per_s")}
    # the first W1 of the process slower than every later engine's, when the lease has no second default to
    # divide by: the W1 ratios then measure being first, and the prose says so instead of reading the switch
    cost = first_run_cost(arms) if not again else None
    if cost:
        f["first_run"] = "yes"
        f["later_lo"], f["later_hi"] = times(cost[0]), times(cost[1])
        if ours("w1_06") and ours("w1_topkp_06"):
            f["topkp_vs_w1"] = times(ours("w1_topkp_06") / ours("w1_06"))
    else:
        f["no_first_run"] = "yes"
    for name, label in (("eager_w1_x", "no_cuda_graph"), ("no_overlap_w1_x", "no_overlap"),
                        ("no_radix_w1_x", "no_radix_cache")):
        if label in w1_ratio:
            f[name] = times(w1_ratio[label])
    w3c = book.take("w3_cached_06", "bench06.default.w3.cached_prompt_share", "w3_06.default.w3.cached_prompt_share")
    if w3c:
        f["w3_cached"] = f"{100 * w3c.value:.0f}%"

    # the profiles
    prof = page.sources.result("profile")
    if prof:
        g, d = prof.result.get("no_cuda_graph", {}), prof.result.get("default", {})
        put("eager_kernels", g.get("kernels_per_step"))
        if g.get("gpu_busy_fraction") is not None:
            f["eager_busy"] = f"{100 * g['gpu_busy_fraction']:.0f}%"
        put("prof_step", d.get("step_ms"), 2)
        if d.get("gpu_busy_fraction") is not None:
            f["prof_busy"] = f"{100 * d['gpu_busy_fraction']:.0f}%"
    t06, t8 = page.sources.result("timeline:qwen3-0.6b"), page.sources.result("timeline:qwen3-8b")
    if t06:
        put("kernels_06", t06.result["activities_per_step"])
    if t8:
        put("kernels_8", t8.result["activities_per_step"])
    shape06, shape8 = floors.shape("qwen3-0.6b"), floors.shape("qwen3-8b")
    f["weights_06"], f["weights_8"] = f"{shape06.weight_bytes / 1e9:.2f}", f"{shape8.weight_bytes / 1e9:.1f}"
    f["vocab_06"] = f"{text_config('qwen3-0.6b')['vocab_size']:,}"
    kinds35 = text_config("qwen3.5-0.8b")["layer_types"]
    f["linear_layers_35"], f["layers_35"] = str(kinds35.count("linear_attention")), str(len(kinds35))

    # the sweep
    ahead = book.entries.get("sweep.ahead")
    if ahead:
        cells = [k for k in book.entries if k.startswith("sweep.n")]
        ratios = [book.entries[c]["value"] / book.entries["sglang_" + c]["value"] for c in cells]
        f["sweep_ahead"], f["sweep_cells"] = str(ahead["value"]), str(len(cells))
        f["sweep_min"], f["sweep_max"] = times(min(ratios)), times(max(ratios))

    # where it loses
    r8 = val["w2_tpot_8"]
    f["miss_tpot_8"] = bool(r8.met() is False)
    f["target_tpot_8"] = fmt(r8.figure.target.value, 1)
    misses = [r for r in page.rows if r.ours and (r.ahead() is False or r.met() is False)]
    f["misses"] = "\n".join(
        f"- **{MODEL_NAMES[r.figure.model]}, {r.figure.label}: {fmt(r.ours.value, r.figure.digits)}**"
        + (f" against SGLang's {fmt(r.sglang, r.figure.digits)}" if r.sglang else "")
        + (f", target {r.figure.target.text(r.figure.higher_is_better)}" if r.met() is False else "")
        + f". {diagnose(page, r)[0].upper()}{diagnose(page, r)[1:]}" for r in misses) or (
        "On these numbers, nowhere: every headline figure is ahead of SGLang and meets its target.")
    bar_w1, bar_tpot = course_bars()
    f["bar_throughput"], f["bar_tpot"] = f"{bar_w1:g}x", f"{bar_tpot:g}x"

    # the prose's claims, each against the data (None: cannot tell from these sources)
    def ratio_order(label):
        return sorted(w1_ratio, key=w1_ratio.get).index(label) if label in w1_ratio else None

    gemm8 = kinds_per_step(t8.result).get("gemm", 0.0) / (1e3 * t8.result["unprofiled_ms_per_step"]) if t8 else None
    claims = [
        ("'CUDA Graphs matter most': the eager arm loses the most W1", None if not w1_ratio else
         ratio_order("no_cuda_graph") == 0),
        ("'Overlapping ... is next': no_overlap loses the second most W1", None if not w1_ratio else
         ratio_order("no_overlap") == 1),
        ("the radix cache 'costs almost nothing' on W1: within 5% (said only when W1's first run is not slower)",
         True if cost else None if "no_radix_cache" not in w1_ratio else abs(w1_ratio["no_radix_cache"] - 1) < 0.05),
        ("chunked prefill bounds W4's gap below the unchunked one",
         None if arm("no_chunked_prefill", "w4", "worst_decode_gap_ms") is None or ours("w4_gap_06") is None else
         ours("w4_gap_06") < arm("no_chunked_prefill", "w4", "worst_decode_gap_ms")),
        ("SGLang's decoders wait longer in W4", None if val["w4_gap_06"].ratio is None else
         val["w4_gap_06"].ratio < 1),
        ("'took the step under a millisecond': Qwen3-0.6B TPOT < 1 ms",
         None if ours("w2_tpot_06") is None else ours("w2_tpot_06") < 1.0),
        ("the 8B step is 'mostly the matmuls' (said only when its TPOT misses the target)",
         True if not f["miss_tpot_8"] else (None if gemm8 is None else gemm8 > 0.5)),
        ("the course's bars are below this engine's results",
         None if val["w1_06"].ratio is None or val["w2_tpot_06"].ratio is None else
         val["w1_06"].ratio > bar_w1 and val["w2_tpot_06"].ratio < bar_tpot),
    ]
    return f, claims


def render(page: Page, draft: bool = False) -> tuple[str, list[str]]:
    """The post, and its problems: facts the sources lack and claims the data does not support. A draft (numbers
    from several leases) says so above its title."""
    f, claims = facts(page)
    text = TEMPLATE.read_text()

    def block(m: re.Match) -> str:
        return m.group(2) if f.get(m.group(1)) else ""

    text = re.sub(r"<!-- if (\w+) -->\n(.*?)<!-- end -->\n", block, text, flags=re.S)
    text = text.format_map(f)
    if draft:
        text = ("> **DRAFT**: the numbers below come from several earlier leases, not from one lease at the current "
                "commit; REPORT.md lists what is missing. The lease of `python -m lab.lease plan` replaces them.\n\n"
                + text)
    problems = [f"blog: no figure for {{{k}}}" for k in sorted(f.missing)]
    problems += [f"blog: claim not supported by the data: {c}" for c, ok in claims if ok is False]
    problems += [f"blog: claim not checkable from these sources: {c}" for c, ok in claims if ok is None]
    return text, problems


def words(text: str) -> int:
    """Words of prose: tables, images and code left out."""
    keep = [ln for ln in text.splitlines() if not ln.startswith(("|", "!", "```", "<!--"))]
    return len(re.findall(r"[A-Za-z0-9][\w'.,/%-]*", "\n".join(keep)))
