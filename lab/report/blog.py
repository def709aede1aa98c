"""Write reports/<gpu>/BLOG.md, the blog post, from the same JSON as the report (no number typed by hand).

    python scripts/make_blog.py reports/h200
"""

from __future__ import annotations

import os
import sys

from make_report import MODELS, get, h200_baseline, load_sections, w1_floor_seconds, w2_tpot_floor_ms, weight_bytes

from minisgl.bench.workloads import w1_offline


def main(folder: str) -> None:
    sections, _ = load_sections(folder)
    sg = h200_baseline()["sglang"]
    b06, b8 = sections["bench06"][0], sections["bench8"][0]
    prof = sections["profile"][0]
    par = sections["parity"][0]
    bw = sections["ceilings"][0]["copy_bytes_per_s"]
    rep = get(sections.get("w1_repeat", (None, None))[0], "rows") or []
    fi = sections.get("flashinfer", (None, None))[0]
    p8 = get(sections.get("profile8", (None, None))[0], "decode_bs1")
    w1_06, w2_06, w2_8 = b06["default"]["w1"], b06["default"]["w2"], b8["default"]["w2"]
    w3, w4 = b06["default"]["w3"], b06["default"]["w4"]
    sg06, sg8 = sg["qwen3-0.6b"]["default"], sg["qwen3-8b"]["default"]
    floor_w1 = w1_offline().total_output_tokens / w1_floor_seconds(MODELS["qwen3-0.6b"], bw)
    floor8 = w2_tpot_floor_ms(MODELS["qwen3-8b"], bw)
    d, n, g = prof["default"], prof["no_overlap"], prof["no_cuda_graph"]
    if d["gpu_busy_fraction"] >= 0.8:
        busy_text = (f"With both, the GPU is busy {100 * d['gpu_busy_fraction']:.0f}% of the time and the rest is in "
                     "the kernels themselves, mostly attention reading the KV cache.")
    else:
        busy_text = (f"With both, the GPU is busy {100 * d['gpu_busy_fraction']:.0f}% of the profiled step: with "
                     "fewer kernels per layer (below), the host's per-step work, slower still under the profiler, "
                     "is now the longer pole at 64 requests.")
    repeats = ", ".join(f"{r['label']} {r['runs'][0]['output_tok_per_s']:,.0f}" for r in rep)
    text = f"""# Building an inference engine you can read in an afternoon, and timing it against SGLang

*minisgl is the reference engine of a course in which students build an LLM inference engine one notebook at a
time. This post is what we measured when we took it to an NVIDIA H200. Every number below is read from the
JSON in this folder by `scripts/make_blog.py`; the tables with all of them are in `REPORT.md`.*

## What is in the engine

Seven small pieces, each a module a student writes: a decoder (Qwen3, Llama-3, Qwen2) that runs over a flat
batch of tokens; a KV pool cut into pages with a request→token table; attention kernels in Triton that read
keys through that table; a radix tree that shares prompt prefixes; a scheduler that mixes prefill chunks with
decode tokens in every step; a CUDA Graph runner for decode; and a loop that prepares step N+1 on the CPU
while step N runs on the GPU. Every optimisation is a switch, so the ablation table below is four flags.

## The numbers

On the same H200 and the same requests as SGLang 0.5.16 (dummy bf16 weights at the real shapes):

- **Offline throughput (W1, 256 requests at once).** Qwen3-0.6B: **{w1_06['output_tok_per_s']:,.0f}** output
  tokens/s (SGLang {sg06['w1_output_tok_per_s']:,}; reading the KV cache alone bounds it near {floor_w1:,.0f}).
  Qwen3-8B: **{b8['default']['w1']['output_tok_per_s']:,.0f}** (SGLang {sg8['w1_output_tok_per_s']:,}).
- **Latency at concurrency 1 (W2).** Qwen3-0.6B decodes a token every **{w2_06['tpot_ms_median']:.2f} ms**
  (SGLang {sg06['w2_tpot_ms']} ms); Qwen3-8B every **{w2_8['tpot_ms_median']:.2f} ms** (SGLang {sg8['w2_tpot_ms']}
  ms; the card cannot go below {floor8:.2f} ms: 15 GB of weights per token over {bw / 1e12:.2f} TB/s).
- **Shared prompts (W3).** {100 * w3['cached_prompt_share']:.0f}% of prompt tokens come from the radix cache and
  the run does **{w3['output_tok_per_s']:,.0f} tok/s** (SGLang {sg06['w3_output_tok_per_s']:,}).
- **A long prompt arrives while others decode (W4).** Eight 32k-token prompts land on 128 decoding requests.
  Because prefill chunks share each step with the decoders, the worst pause a decoding request sees is
  **{w4['worst_decode_gap_ms']:.0f} ms**; SGLang's default scheduler runs the whole prefill first and stalls
  them for {sg06['w4_worst_decode_gap_ms']:,} ms.
- **Correctness.** In fp32 on the GPU, greedy tokens equal Hugging Face transformers for
  {par['float32']['default']['exact']}/{par['float32']['default']['of']} prompts x 64 tokens, with overlap and
  CUDA Graph on or off. In bf16 the engine gives the same tokens with every switch, and, as expected with random
  weights whose top logits nearly tie, parts from transformers after a few tokens.

## Where the time goes

A torch.profiler trace of 30 decode steps at 64 requests tells the story of the two big switches:

| | step | GPU busy | kernels per step |
|---|---|---|---|
| overlap + CUDA Graph | {d['step_ms']:.2f} ms | {100 * d['gpu_busy_fraction']:.0f}% | {d['kernels_per_step']:.0f} |
| no overlap | {n['step_ms']:.2f} ms | {100 * n['gpu_busy_fraction']:.0f}% | {n['kernels_per_step']:.0f} |
| no CUDA Graph | {g['step_ms']:.2f} ms | {100 * g['gpu_busy_fraction']:.0f}% | {g['kernels_per_step']:.0f} |

Without CUDA Graph the GPU idles most of the step: {g['kernels_per_step']:.0f} kernels launched one at a time
from Python cost far more than they take to run. Without overlap, the host's work between two steps (scheduling
the batch, packing inputs, reading back tokens) sits on the critical path. {busy_text}

![timeline](timeline.png)

## Counting kernels

A decode step of a small model is hundreds of short kernels, and at batch 1 each one costs a few microseconds
whatever it does. Three changes took the per-layer count down without touching the maths: q, k and v stay views
into the fused qkv output instead of copies; Qwen3's per-head q/k norms and the rotary embedding run in one
Triton kernel; and K and V go into the pool in one launch instead of two index-puts. The step inputs are also
packed on 16-byte boundaries, because Triton compiles a kernel variant per pointer alignment and the
alignment used to depend on the batch's token count. The benchmark now records how many Triton variants were
compiled inside each timed region; W1 repeated on fresh engines (at the commit of `{sections['w1_repeat'][1]}`)
gave {repeats} tok/s.
"""
    if p8:
        gemm = p8["by_kind_per_step"].get("gemm", {"ms": 0.0})["ms"]
        gemm_bw = weight_bytes(MODELS["qwen3-8b"]) / (gemm * 1e-3) / 1e12
        text += f"""
## The gap we did not close

Qwen3-8B at batch 1 is a memory-bandwidth problem: {w2_8['tpot_ms_median']:.2f} ms per token against a
{floor8:.2f} ms floor. The profile of one step ({p8['step_ms']:.2f} ms) puts {gemm:.2f} ms in the matrix-vector
products, which already stream the weights at {gemm_bw:.2f} TB/s, {p8['step_ms'] * (1 - p8['gpu_busy_fraction']):.2f}
ms in the GPU idling between kernels, and the rest in our elementwise and attention kernels. Closing it means
folding the ~{p8['kernels_per_step'] / 36:.0f} kernels per layer into fewer (elementwise work in the GEMMs'
prologues and epilogues) or overlapping their tails, not a better scheduler.
"""
    if fi and get(fi, "bench", "flashinfer", "w1"):
        fb = fi["bench"]["flashinfer"]
        text += f"""
## FlashInfer behind the same interface

`--attention-backend flashinfer` swaps in FlashInfer's paged kernels (it plans each step on the host and runs
per layer). It matches the torch reference like our Triton kernels do. On Qwen3-0.6B it ran W1 at
{fb['w1']['output_tok_per_s']:,.0f} tok/s and W2 at {fb['w2']['tpot_ms_median']:.2f} ms per token, behind our Triton
kernels; its per-step planning runs on the host, the likely cost at batch 1 (not timed separately).
"""
    text += latest_lease_text(folder)
    with open(os.path.join(folder, "BLOG.md"), "w") as f:
        f.write(text)
    print(f"wrote {os.path.join(folder, 'BLOG.md')}")


def latest_lease_text(folder: str) -> str:
    """The leases from the two-engine one before the newest on (make_lease_tables.earlier_leases), oldest first:
    what each found and changed, then what is still open by the newest figures of each kind."""
    from pathlib import Path

    from make_lease_tables import RUNS, earlier_leases, later_leases, latest_lease, lease_commits, load

    run = latest_lease(folder)
    if run is None:
        return ""
    window = [*reversed(earlier_leases(folder)), run, *later_leases(folder)]
    out, runs, timelines, two_engine = [], {}, [], {}
    for lease in window:
        sec, _, tl = load(Path(lease))
        lease_runs = dict(RUNS)
        for name, rs in lease_runs.items():
            runs.setdefault(name, []).extend(rs)
        timelines += tl
        if any(k.startswith("sglang_") for k in sec):
            two_engine = sec
        out += lease_story(lease, sec, lease_commits(lease_runs), lease_runs)
    out += open_items(runs, timelines, two_engine)
    return "\n\n".join(out).replace("\n\n- ", "\n- ") + "\n"


def lease_story(lease, sec: dict, commits: str, runs: dict) -> list[str]:
    """Paragraphs for one lease folder, each written only when the sections it cites are there."""
    out = []
    if any(k.startswith("sglang_") for k in sec):
        out.append(f"\n## Both engines in one lease (`{lease.name}/`, minisgl {commits})\n")
    else:
        out.append(f"\n## minisgl alone (`{lease.name}/`, minisgl {commits})\n")
    q06, q35 = get(sec, "sample06", "default"), get(sec, "qwen35", "default")
    s = {k: sec.get(f"sglang_{k}") for k in ("w1_06", "w1_topkp_06", "w2_06", "w1_35", "w2_35")}
    if q06 and s["w1_06"] and s["w2_06"]:
        out.append(
            f"On Qwen3-0.6B minisgl ran W1 at {q06['w1']['output_tok_per_s']:,.0f} output tok/s against SGLang's "
            f"{s['w1_06']['output_tok_per_s']:,.0f}, and with top-k 50 / top-p 0.95 at "
            f"{q06['w1_topkp']['output_tok_per_s']:,.0f} against {s['w1_topkp_06']['output_tok_per_s']:,.0f} (one "
            "fused sampling kernel, no sort). Its first token came in "
            f"{q06['w2']['ttft_ms_median']:.1f} ms against {s['w2_06']['ttft_ms_median']:.1f} (prefill steps replayed "
            f"as CUDA graphs), the next ones every {q06['w2']['tpot_ms_median']:.2f} ms against "
            f"{s['w2_06']['tpot_ms_median']:.2f}.")
    if q35 and s["w1_35"] and s["w2_35"]:
        out.append(
            f"On the hybrid Qwen3.5-0.8B (Gated DeltaNet layers with a per-request state pool): W1 "
            f"{q35['w1']['output_tok_per_s']:,.0f} against {s['w1_35']['output_tok_per_s']:,.0f} tok/s, TPOT "
            f"{q35['w2']['tpot_ms_median']:.2f} against {s['w2_35']['tpot_ms_median']:.2f} ms.")
    pdl, store = sec.get("pdl_ab06", {}), sec.get("store_ab06", {})
    if "pdl_0" in pdl and "no_pdl_0" in pdl and "fused_store" in store:
        out.append(
            "Two changes went into the batch-1 step: the decode attention kernel stores the new token's K and V "
            "itself (one launch fewer per layer: "
            f"{store['store_kv']['w2']['tpot_ms_median']:.3f} -> {store['fused_store']['w2']['tpot_ms_median']:.3f}"
            " ms per token on Qwen3-0.6B), and every Triton kernel of the step is launched with programmatic "
            "dependent launch, so it is scheduled while its predecessor still runs and waits on the GPU, not "
            f"behind it ({pdl['no_pdl_0']['w2']['tpot_ms_median']:.3f} -> "
            f"{pdl['pdl_0']['w2']['tpot_ms_median']:.3f} ms; the GEMVs also start streaming their weights "
            "before the wait).")
    early = sec.get("early_ab06", {})
    if early:
        def mean(prefix):
            xs = [r["w2"]["tpot_ms_median"] for k, r in early.items() if k.startswith(prefix) and "all_gemv" not in k]
            return sum(xs) / len(xs) if xs else float("nan")
        default_w2 = [r[4]["default"]["w2"] for r in runs.get("sample06", []) if "w2" in r[4].get("default", {})]
        out.append(
            "The batch-1 step again, on Qwen3-0.6B, in interleaved A/B runs: the GEMV loading two of its weight "
            f"tiles before the PDL wait instead of one ({mean('early1_'):.3f} -> {mean('early2_'):.3f} ms per token; "
            f"three: {mean('early3_'):.3f}; means of two rounds), and the gate/up projection on the GEMV instead "
            "of cuBLAS, where the standalone tune had found no 2% win at one row; inside the step a cuBLAS launch "
            "cannot start streaming its weights before the kernel ahead of it ends (with three early tiles: "
            + ", ".join(f"{r['w2']['tpot_ms_median']:.3f}" for k, r in early.items() if "all_gemv" in k)
            + " ms). With both as defaults W2 ran at "
            + " and ".join(f"{w['tpot_ms_median']:.3f}" for w in default_w2[-1:]) + " ms per token.")
    arms: dict[bool, list] = {}  # split on / off: each arm's runs (one process each), oldest first
    for name in ("mixed06", "mixed06_long"):
        for r in runs.get(name, []):
            arms.setdefault(bool(r[4].get("mixed_decode_split")), []).append(r)
    phases = sec.get("sweep_phases06", {}).get("timed_greedy")
    if True in arms and False in arms:
        ons = [r[4] for r in sorted(arms[True], key=lambda r: r[0])]
        off = arms[False][-1][4]

        def both(key, cell=None):
            pick = (lambda x: x["sweep"][cell]) if cell else (lambda x: x[key])
            return f"{pick(off)['output_tok_per_s']:,.0f} -> " + " / ".join(
                f"{pick(x)['output_tok_per_s']:,.0f}" for x in ons if cell is None or cell in x["sweep"])
        text = "Then the prompts of 1-4k tokens. "
        if phases:
            pre = [st[4] for st in phases["steps"] if not st[0]]
            dec = [st for st in phases["steps"] if st[0]]
            top = max(dec, key=lambda st: st[1])
            text += (f"Timing every step of the 256-request mix showed its chunked-prefill steps growing from "
                     f"{pre[0]:.0f} to {max(pre):.0f} ms as more running requests rode along as decode rows, while a "
                     f"decode step of {top[1]} rows took {top[4]:.0f} ms: the extend kernel gives each request a "
                     "128-query tile, so a one-token row paid for 128 over its whole context. ")
        cells = [c for c in off["sweep"] if all(c in x["sweep"] for x in ons)]
        text += ("Sending a mixed step's decode rows to the decode kernel (`MIXED_DECODE_SPLIT`), one process per "
                 f"run, off -> on ({len(ons)} runs): W1 {both('w1')}, W1 top-k/top-p {both('w1_topkp')}, "
                 + ", ".join(f"{c} {both(None, c)}" for c in cells) + " tok/s.")
        out.append(text)
    return out


def open_items(runs: dict, timelines: list, two_engine: dict) -> list[str]:
    """What is still open, by the newest figures of each kind in the window."""
    from make_lease_tables import kernel_kinds

    by_label = {t["label"]: t for t in timelines if "bare_replay" in t}
    items = []
    w2 = [r["w2"]["tpot_ms_median"] for name in ("sample06", "w2_06", "merge_ab06", "store_ab06", "pdl_ab06",
                                                   "early_ab06") for rr in runs.get(name, [])
          for r in rr[4].values() if isinstance(r, dict) and "w2" in r]
    if w2 and min(w2) > 1.0:
        items.append(f"Qwen3-0.6B at batch 1: {min(w2):.3f} ms per token at best, above the 1.0 ms we aim for.")
    w8 = [(rr[0], r["w2"]) for name in ("sample8", "pdl_ab8", "early_ab8", "w2_8b", "gemv_ab8")
          for rr in runs.get(name, []) for k, r in rr[4].items() if k in ("default", "pdl", "early1_0") and "w2" in r]
    if w8:
        g8 = max(w8, key=lambda x: x[0])[1]
        why = "on its large weights cuBLAS streams as fast as our GEMV"
        if "8b" in by_label:
            kinds = kernel_kinds(by_label["8b"])
            matmul_us = kinds.get("matmul, cuBLAS", 0.0) + kinds.get("matmul, GEMV", 0.0)
            weights = weight_bytes(MODELS["qwen3-8b"])
            copy_bw = h200_baseline()["card"]["copy_bytes_per_s"]
            why = (f"{matmul_us / 1e3:.2f} ms of its {by_label['8b']['unprofiled_ms_per_step']:.2f} ms step "
                   f"(decode_timeline) are the matmuls streaming {weights / 1e9:.1f} GB of weights, "
                   f"{weights / matmul_us / 1e6:.2f} TB/s; at the card's measured copy speed "
                   f"({copy_bw / 1e12:.2f} TB/s) they would still take {weights / copy_bw * 1e3:.2f} ms, and the "
                   "rest of the step (attention, norms, launches) takes "
                   f"{by_label['8b']['unprofiled_ms_per_step'] - matmul_us / 1e3:.2f} ms")
        if runs.get("wide_ab8"):  # newer than any timeline in the window: the wide tune's standalone times
            tune = max(runs["wide_ab8"], key=lambda x: x[0])[4]["tune"]
            matmul_us = bytes_ = 0.0
            for r in tune["shapes"]:
                count = int(next(u for u in r["used_by"] if u.startswith("qwen3-8b")).split(" x")[1])
                best = r["gemv_us"][",".join(map(str, r["best"]))]
                matmul_us += count * min(best["1"], r["cublas_us"]["1"])
                bytes_ += count * r["n"] * r["k"] * 2
            copy_bw = h200_baseline()["card"]["copy_bytes_per_s"]
            why = (f"its matmuls alone, timed one by one in the GEMV tune of `wide_ab8` (the faster of GEMV and "
                   f"cuBLAS per shape), take {matmul_us / 1e3:.2f} ms a token for {bytes_ / 1e9:.1f} GB of weights "
                   f"({bytes_ / matmul_us / 1e6:.2f} TB/s); at the card's measured copy speed "
                   f"({copy_bw / 1e12:.2f} TB/s) they would take {bytes_ / copy_bw * 1e3:.2f} ms, and the rest of the "
                   f"step (attention, norms, launches) is about {g8['tpot_ms_median'] - matmul_us / 1e3:.2f} ms")
        if g8["tpot_ms_median"] > 4.1:
            items.append(f"Qwen3-8B at batch 1: {g8['tpot_ms_median']:.2f} ms per token, above the 4.1 ms we aim "
                         f"for; {why}.")
    theirs = two_engine.get("sglang_sweep_06")
    if theirs:
        # every cell's runs at the newest commit that measured it, default settings (the sweep and the split arm)
        cell_runs: dict[str, list] = {}
        for name in ("sweep06", "mixed06", "mixed06_long"):
            for t, commit, env, file, res in runs.get(name, []):
                if env or res.get("mixed_decode_split") is False:
                    continue  # a non-default setting
                for cell, r in (res.get("cells") or res.get("sweep") or {}).items():
                    cell_runs.setdefault(cell, []).append((t, commit, file, r))
        behind = []
        for cell, rs in cell_runs.items():
            last = max(rs, key=lambda x: x[0])[1]
            at_last = [x for x in rs if x[1] == last]
            b = theirs.get(cell, {}).get("output_tok_per_s")
            slow = [x for x in at_last if b and x[3]["output_tok_per_s"] < b]
            if slow:
                behind.append(f"{cell} at {last[:7]}: " + "; ".join(
                    f"{x[3]['output_tok_per_s'] / b:.2f}x in {x[2]}"
                    + (f" ({sum(x[3].get('triton_compiles_timed', {}).values())} Triton variants compiled inside "
                       "the timed run)" if x[3].get("triton_compiles_timed") else "") for x in at_last))
        if behind:
            items.append("Batch mixes where SGLang is ahead in a run at the newest commit that measured them: "
                         + "; ".join(behind) + ".")
    return ["\n## What is still open\n", *[f"- {item}" for item in items]] if items else []


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reports/h200")
