"""Tables of one H200 lease: minisgl beside SGLang, read from the JSON files of one folder.

    python scripts/make_lease_tables.py reports/h200/run9      # writes TABLES.md there
    python scripts/make_lease_tables.py reports/h200/run9 --sglang-from reports/h200/run8

`--sglang-from` takes SGLang's sections from another lease's folder when this one has none (its device time ran
out); the tables then say so in their heading, since figures from two leases compare less well than one's.

Every JSON file of the folder written by scripts/h200_run.py or scripts/sglang_bench.py holds
{"environment": ..., "sections": {name: {"result": ...}}}; sections are found by name whatever file they are in,
so one lease may split its work over several calls. Decode timelines (scripts/decode_timeline.py) are found by
their label. A table is written only for the sections the folder has. Every number is read from those files,
which record the commit and settings they ran with.
"""

from __future__ import annotations

import json
from pathlib import Path

COMMITS: dict[str, str] = {}  # section name -> the commit its file records
# section name -> every run of it in the folder: (time, commit, MINISGL_* settings, file, result)
RUNS: dict[str, list[tuple[str, str, dict, str, dict]]] = {}


def load(folder: Path) -> tuple[dict, dict, list[dict]]:
    """(sections by name, the environment of the first minisgl file, decode timelines). A section run in several
    calls of one lease (a re-run after a change) is taken from its first call for the main tables; RUNS has all."""
    sections, env, timelines, stamps = {}, {}, [], {}
    RUNS.clear()
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if path.name.startswith("decode_timeline_"):
            timelines.append(data)
            continue
        e = data.get("environment", {})
        for name, sec in data.get("sections", {}).items():
            if "result" not in sec:
                continue
            run = (e.get("time_utc", ""), e.get("git_commit", "?"), e.get("minisgl_env", {}), path.name, sec["result"])
            RUNS.setdefault(name, []).append(run)
            if name not in stamps or run[0] < stamps[name]:
                sections[name], COMMITS[name], stamps[name] = sec["result"], run[1], run[0]
        if e.get("git_commit") and "sglang" not in data and e.get("time_utc", "") > env.get("time_utc", ""):
            env = e  # the newest minisgl file's
    for name in RUNS:
        RUNS[name].sort(key=lambda run: run[0])
    return sections, env, timelines


def _leases(root: str | Path) -> tuple[list[tuple[str, Path, bool]], int | None]:
    """Every run folder under `root` with a TABLES.md as (time of its newest minisgl file, folder, whether it
    measured SGLang), oldest first, and the index of the newest one that measured SGLang (None if none did)."""
    found = []
    for tables in Path(root).glob("run*/TABLES.md"):
        sections, env, _ = load(tables.parent)
        found.append((env.get("time_utc", ""), tables.parent, any(k.startswith("sglang_") for k in sections)))
    found.sort()
    both = [i for i, (_, _, two_engines) in enumerate(found) if two_engines]
    return found, both[-1] if both else None


def latest_lease(root: str | Path) -> Path | None:
    """The run folder under `root` (reports/h200) whose TABLES.md covers the newest lease with SGLang in it."""
    found, best = _leases(root)
    return found[best][1] if best is not None else None


def later_leases(root: str | Path) -> list[Path]:
    """Run folders with a TABLES.md newer than latest_lease(root) that measured minisgl only (their device time
    did not stretch to SGLang), oldest first."""
    found, best = _leases(root)
    return [run for _, run, _ in found[(best + 1 if best is not None else 0):]]


def earlier_leases(root: str | Path) -> list[Path]:
    """Run folders with a TABLES.md older than latest_lease(root), newest first, down to and including the two-engine
    lease before it: what the newest two-engine lease has not re-measured (other models, kernel tables) is there."""
    found, best = _leases(root)
    out = []
    for _, run, two_engines in reversed(found[:best or 0]):
        out.append(run)
        if two_engines:
            break
    return out


def lease_commits(runs: dict) -> str:
    """Every minisgl commit a lease ran (RUNS of its folder), oldest first, comma-separated."""
    ours = sorted((r for name, rs in runs.items() if not name.startswith("sglang_") for r in rs), key=lambda r: r[0])
    return ", ".join(dict.fromkeys(r[1][:7] for r in ours))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else ""


def sweep_table(ours: dict, theirs: dict, before: dict | None = None) -> list[str]:
    """The sweep beside SGLang's; `before` is the same sweep at a fixed max_running_requests (an A/B in the lease)."""
    graphs = ours.get("cuda_graph_batch_sizes")  # recorded from the sized-from-memory change on
    lines = ["## Batch-mix sweep, Qwen3-0.6B (output tok/s)", "",
             f"minisgl max_running_requests {ours['max_running_requests']}, KV pool {ours['kv_pool_tokens']:,} tokens"
             + (f", decode CUDA graphs for {len(graphs)} batch sizes up to {max(graphs)}" if graphs else "")
             + (f", engine start-up {ours['startup_s']:.1f} s" if "startup_s" in ours else "") + "."]
    if before:
        lines.append(f"The column 'minisgl, {before['max_running_requests']} rows' is the same sweep with "
                     f"max_running_requests fixed at {before['max_running_requests']}, in the same lease.")
    # per cell, where recorded: the largest decode step, and how many decode steps replayed the graphs in pieces
    split = all("max_decode_batch" in c["engine"] for c in ours["cells"].values())
    head = "| cell | minisgl | SGLang | ratio |"
    if before:
        head += f" minisgl, {before['max_running_requests']} rows | ratio |"
    if split:
        head += " max decode batch | decode steps in graph pieces |"
    lines += ["", head, "|" + "---|" * head.count(" |")]
    for name, cell in ours["cells"].items():
        a, b = cell["output_tok_per_s"], theirs[name]["output_tok_per_s"]
        row = f"| {name} | {a:,.0f} | {b:,.0f} | {ratio(a, b)} |"
        if before:
            c = before["cells"][name]["output_tok_per_s"]
            row += f" {c:,.0f} | {ratio(c, b)} |"
        if split:
            e = cell["engine"]
            row += f" {e['max_decode_batch']} | {e['graph_split_steps']} of {e['decode_steps']} |"
        lines.append(row)
    return lines


def qwen3_table(ours: dict, s: dict) -> list[str]:
    """Qwen3-0.6B W1 (temperature 0.6, and top-k/top-p) and W2, from h200_run's sample06 and SGLang's sections."""
    lines = ["## Qwen3-0.6B", "", "| figure | minisgl | SGLang | ratio | target |", "|---|---|---|---|---|"]
    rows = [("W1 out tok/s", "w1", "sglang_w1_06", "output_tok_per_s", ">= 1.1x"),
            ("W1 top-k/top-p out tok/s", "w1_topkp", "sglang_w1_topkp_06", "output_tok_per_s",
             ">= 1.1x, within 10% of W1"),
            ("W2 TTFT ms", "w2", "sglang_w2_06", "ttft_ms_median", "<= 0.8x"),
            ("W2 TPOT ms", "w2", "sglang_w2_06", "tpot_ms_median", "<= 1.0 ms")]
    for label, key, skey, metric, target in rows:
        if key in ours and skey in s:
            a, b = ours[key][metric], s[skey][metric]
            lines.append(f"| {label} | {a:,.3f} | {b:,.3f} | {ratio(a, b)} | {target} |" if "ms" in label else
                         f"| {label} | {a:,.0f} | {b:,.0f} | {ratio(a, b)} | {target} |")
    if "w1" in ours and "w1_topkp" in ours:
        drop = 1 - ours["w1_topkp"]["output_tok_per_s"] / ours["w1"]["output_tok_per_s"]
        lines.append(f"\nminisgl W1 with top-k/top-p is {drop:.1%} below temperature-only (target: at most 10%).")
    return lines


def qwen35_table(q: dict, s: dict, w3_qwen3: dict | None) -> list[str]:
    lines = ["## Qwen3.5-0.8B shapes", "", "| figure | minisgl | SGLang | ratio | target |", "|---|---|---|---|---|"]
    sw = {k: s.get(f"sglang_{k}_35") for k in ("w1", "w2", "w3")}
    if sw["w1"]:
        a, b = q["w1"]["output_tok_per_s"], sw["w1"]["output_tok_per_s"]
        lines.append(f"| W1 out tok/s | {a:,.0f} | {b:,.0f} | {ratio(a, b)} | >= 1.1x |")
    if sw["w2"]:
        for label, metric, fmt, target in (("W2 TTFT ms", "ttft_ms_median", ".1f", "<= 20 ms"),
                                           ("W2 TPOT ms", "tpot_ms_median", ".3f", "<= 1.35 ms")):
            a, b = q["w2"][metric], sw["w2"][metric]
            lines.append(f"| {label} | {a:{fmt}} | {b:{fmt}} | {ratio(a, b)} | {target} |")
    if sw["w3"]:
        a, b = q["w3"]["output_tok_per_s"], sw["w3"]["output_tok_per_s"]
        lines.append(f"| W3 out tok/s | {a:,.0f} | {b:,.0f} | {ratio(a, b)} | |")
        ref = f" ({w3_qwen3['cached_prompt_share']:.1%} in this lease)" if w3_qwen3 else ""
        lines.append(f"| W3 cached prompt share | {q['w3']['cached_prompt_share']:.1%} | "
                     f"{sw['w3']['cached_prompt_share']:.1%} | | within 10 points of Qwen3's{ref} |")
    return lines


def gemv_tables(tune: dict | None, sec: dict, title: str = "scripts/gpu_gemv_tune.py, bf16") -> list[str]:
    """The decode GEMV against cuBLAS per weight shape (scripts/gpu_gemv_tune.py), and W2 with it on and off."""
    lines = []
    if tune:
        lines += [f"## Decode GEMV against cuBLAS, per weight shape ({title})", "",
                  "us per call, streaming distinct weight copies as a decode step streams its layers. The GEMV "
                  "column is the finalist tile with the least summed time; 'engine uses' is gpu_gemv_tune.pick: "
                  "the GEMV up to the row count where it beat cuBLAS by 2% at every count, else cuBLAS.", "",
                  "| N x K | used by | cuBLAS 1 / 2 / 4 rows | GEMV 1 / 2 / 4 rows "
                  "| its tiles (BLOCK_N, BLOCK_K, warps) | 1 row TB/s cuBLAS / GEMV | max rel err | engine uses |",
                  "|---|---|---|---|---|---|---|---|"]
        from gpu_gemv_tune import pick  # here: it imports torch, which the other tables do not need

        def used(r: dict) -> str:
            p = pick(r)
            return "cuBLAS" if p is None else f"GEMV {tuple(p[:3])} up to {p[3]} row{'s' if p[3] > 1 else ''}"

        for r in tune["shapes"]:
            best = ",".join(map(str, r["best"]))
            g, c = r["gemv_us"][best], r["cublas_us"]
            lines.append(f"| {r['n']} x {r['k']} | {'; '.join(r['used_by'])} | "
                         f"{' / '.join(f'{c[k]:.1f}' for k in c)} | {' / '.join(f'{g[k]:.1f}' for k in g)} | "
                         f"{tuple(r['best'])} | {r['cublas_1_row_tb_s']:.2f} / {r['best_1_row_tb_s']:.2f} | "
                         f"{r['max_rel_err']:.1e} | {used(r)} |")
        lines.append("")
    pairs = [("Qwen3-0.6B", sec.get("sample06", {}).get("default"), sec.get("gemv_ab06", {}).get("no_gemv")),
             ("Qwen3-8B", sec.get("gemv_ab8", {}).get("default"), sec.get("gemv_ab8", {}).get("no_gemv")),
             ("Qwen3.5-0.8B", sec.get("qwen35", {}).get("default"), sec.get("gemv_ab35", {}).get("no_gemv"))]
    pairs = [(m, on, off) for m, on, off in pairs if on and off and "w2" in on and "w2" in off]
    if pairs:
        lines += ["## W2 (batch 1) with the decode GEMV on and off (`--disable-gemv`), same lease", "",
                  "| model | TPOT ms, GEMV on | off | TTFT ms, on | off | linears on the GEMV |",
                  "|---|---|---|---|---|---|"]
        for m, on, off in pairs:
            lines.append(f"| {m} | {on['w2']['tpot_ms_median']:.3f} | {off['w2']['tpot_ms_median']:.3f} | "
                         f"{on['w2']['ttft_ms_median']:.2f} | {off['w2']['ttft_ms_median']:.2f} | "
                         f"{on.get('gemv_linears')} |")
        lines.append("")
    return lines


def wide_tables(sec: dict) -> list[str]:
    """wide_ab06 / wide_ab8 (scripts/h200_run.py wide_gemv_ab): the wide-tile tune per shape, then each table's
    mean W2 TPOT over its rounds and the shapes where it differs from the repo's table."""
    lines = []
    for name, model in (("wide_ab06", "Qwen3-0.6B"), ("wide_ab8", "Qwen3-8B")):
        r = sec.get(name)
        if not r:
            continue
        lines += gemv_tables(r["tune"], {}, f"{model}, the wide-tile tune of `{name}`: gpu_gemv_tune.py --wide")
        lines += [f"W2 TPOT with each GEMV table, {model} (`{name}`, rounds interleaved):", "",
                  "| table | TPOT ms per round | mean | entries that differ from the repo's (N,K: tiles, rows) |",
                  "|---|---|---|---|"]
        default = r["tables"]["default"]
        for label, table in r["tables"].items():
            tpots = [run["w2"]["tpot_ms_median"] for key, run in r["runs"].items()
                     if key.rsplit("_", 1)[0] == label and "w2" in run]
            diff = "; ".join(f"{shape}: {table[shape]}" for shape in table if table[shape] != default.get(shape))
            mean = f"{sum(tpots) / len(tpots):.3f}" if tpots else "-"
            lines.append(f"| {label} | {' / '.join(f'{t:.3f}' for t in tpots)} | {mean} | {diff or '-'} |")
        lines.append("")
    return lines


def settings(env: dict, extra: dict | None = None) -> str:
    """A run's MINISGL_* environment settings and any others, for a table cell ('defaults' when none)."""
    items = {k.removeprefix("MINISGL_"): v for k, v in env.items()} | (extra or {})
    return ", ".join(f"{k}={v}" for k, v in items.items()) or "defaults"


def w2_runs_table(runs: dict) -> list[str]:
    """Every W2 run of the lease, with its section, settings and commit (runs after a change sit beside the first)."""
    rows = []
    for name in ("sample06", "gemv_ab06", "w2_06", "merge_ab06", "store_ab06", "pdl_ab06", "early_ab06", "wide_ab06",
                 "qwen35", "gemv_ab35", "w2_35", "gemv_ab8", "w2_8b", "pdl_ab8", "early_ab8", "wide_ab8", "sample8"):
        for _, commit, env, _, result in runs.get(name, []):
            for label, run in result.get("runs", result).items():
                if isinstance(run, dict) and "w2" in run:
                    rows.append(f"| {name} / {label} | {commit[:7]} | {settings(env)} | "
                                f"{run['w2']['ttft_ms_median']:.2f} | {run['w2']['tpot_ms_median']:.3f} | "
                                f"{run.get('gemv_linears')} |")
    if not rows:
        return []
    return ["## Every W2 run of the lease (batch 1, 8 requests x 256 tokens, medians)", "",
            "Sections of scripts/h200_run.py: `w2_06`/`w2_35` ran after the GEMV's per-row-count picks "
            "(minisgl/kernels/gemv_tuned/NVIDIA_H200.json); `merge_ab06` is the decode split merge fused (then "
            "the default) vs two launches (the default since); `gemv_ab*` turn the GEMV off; `store_ab06` stores "
            "the decode step's K/V inside decode attention (DECODE_FUSED_STORE) or with store_kv first; `pdl_ab*` "
            "turn programmatic dependent launch (the `pdl` switch; `no_early_weights`: without the GEMV's weight "
            "load before its wait) on and off, interleaved; `early_ab*` load 1, 2 or 3 GEMV weight tiles before the "
            "PDL wait (PDL_EARLY_TILES), and `all_gemv` also puts the projections the tuned table gave to cuBLAS on "
            "the GEMV; `wide_ab*` run the repo's GEMV table (`default`), the wide-tile tune's picks (`wide`) and "
            "every projection on the GEMV with the tune's best tile (`all_gemv`), interleaved.", "",
            "| section / run | commit | settings | TTFT ms | TPOT ms | linears on the GEMV |",
            "|---|---|---|---|---|---|", *rows, ""]


def _compiles(r: dict) -> int:
    return sum(r.get("triton_compiles_timed", {}).values())


def throughput_runs_table(runs: dict) -> list[str]:
    """Every W1 / W1 top-k/top-p run of the lease: the standard sets, the PDL and mixed-step A/Bs."""
    rows = []
    for name in ("sample06", "pdl_w1_06", "split_ab06", "mixed06", "mixed06_long", "sample8"):
        for _, commit, env, file, result in runs.get(name, []):
            arms = {"": result} if "w1" in result else result
            for label, run in arms.items():
                if not isinstance(run, dict) or "w1" not in run:
                    continue
                extra = {"MIXED_DECODE_SPLIT": run["mixed_decode_split"]} if "mixed_decode_split" in run else {}
                extra |= run.get("settings") or {}
                w = [run.get(k) for k in ("w1", "w1_topkp")]
                eng = w[0]["engine"]
                rows.append(f"| {name}{' / ' + label if label else ''} | {file} | {commit[:7]} | "
                            f"{settings(env, extra)} | "
                            + " | ".join(f"{x['output_tok_per_s']:,.0f}" if x else "" for x in w)
                            + f" | {sum(_compiles(x) for x in w if x)} | "
                            f"{eng.get('retractions', '')} / {eng.get('max_running_requests', '')} |")
    if not rows:
        return []
    return ["## Every W1 run of the lease (output tok/s)", "",
            "Qwen3-0.6B except `sample8` (Qwen3-8B). 'compiles' counts Triton kernel variants compiled inside the "
            "timed runs (minisgl.bench.runner records them); 'retractions / max running' shows an engine short of KV "
            "memory.", "",
            "| section / arm | file | commit | settings | W1 | W1 top-k/top-p | compiles | retractions / max running |",
            "|---|---|---|---|---|---|---|---|", *rows, ""]


def sweep_runs_table(runs: dict, theirs: dict | None) -> list[str]:
    """Every run of the batch-mix sweep's cells in the lease (sweep06 and the mixed-step arms) beside SGLang's."""
    cols = []
    for name in ("sweep06", "mixed06", "mixed06_long"):
        for _, commit, env, file, result in runs.get(name, []):
            cells = result.get("cells") or result.get("sweep") or {}
            extra = {"MIXED_DECODE_SPLIT": result["mixed_decode_split"]} if "mixed_decode_split" in result else {}
            cols.append((f"{name}, {file}, {commit[:7]}, {settings(env, extra)}", cells))
    if len(cols) < 2:
        return []
    names = list(dict.fromkeys(c for _, cells in cols for c in cells))
    theirs = theirs or {}
    lines = ["## Every run of the sweep's cells (output tok/s; ratio to SGLang; * = Triton compiles in the timed run)",
             "", "Columns: " + "; ".join(f"({i + 1}) {head}" for i, (head, _) in enumerate(cols)) + ".", "",
             "| cell | SGLang | " + " | ".join(f"({i + 1})" for i in range(len(cols))) + " |",
             "|---|---|" + "---|" * len(cols)]
    for cell in names:
        b = theirs.get(cell, {}).get("output_tok_per_s")
        vals = []
        for _, cells in cols:
            r = cells.get(cell)
            vals.append("" if r is None else f"{r['output_tok_per_s']:,.0f}{'*' if _compiles(r) else ''}"
                        + (f" ({ratio(r['output_tok_per_s'], b)})" if b else ""))
        lines.append(f"| {cell} | {f'{b:,.0f}' if b else ''} | " + " | ".join(vals) + " |")
    return lines + [""]


def sweep_phases_table(r: dict) -> list[str]:
    """Where the 1-4k-prompt 256-request mix's time goes (h200_run sweep_phases06)."""
    lines = ["## The 1-4k-prompt, 256-request sweep mix: prefill vs decode (sweep_phases06)", "",
             "Untimed-step runs in order: " + ", ".join(f"{x['sampling']} {x['output_tok_per_s']:,.0f} tok/s"
                                                        for x in r["runs"]) + ".", "",
             "Then each with every step synchronised and timed (serialises the overlap loop, so slower in all):", "",
             "| sampling | wall s | prefill steps | prefill s | prefill tokens | decode steps | decode s | "
             "decode ms/step | mixed-step ms, first / largest |", "|---|---|---|---|---|---|---|---|---|"]
    for sampling in ("greedy", "topkp"):
        t = r.get(f"timed_{sampling}")
        if not t:
            continue
        pre = [step[4] for step in t["steps"] if not step[0]]
        lines.append(f"| {sampling} | {t['wall_s']:.2f} | {t['prefill_steps']} | {t['prefill_s']:.2f} | "
                     f"{t['prefill_tokens']:,} | {t['decode_steps']} | {t['decode_s']:.2f} | "
                     f"{1e3 * t['decode_s'] / max(t['decode_steps'], 1):.1f} | {pre[0]:.1f} / {max(pre):.1f} |")
    return lines + [""]


def main(folder: str, sglang_from: str | None = None) -> None:
    d = Path(folder)
    sec, env, timelines = load(d)
    runs = dict(RUNS)  # before another folder's load() refills it
    commits = lease_commits(runs)
    title = f"# One H200 lease: minisgl {commits or env.get('git_commit', '?')[:7]} and SGLang 0.5.16"
    note = ""
    if sglang_from:
        theirs, their_env, _ = load(Path(sglang_from))
        borrowed = {k: v for k, v in theirs.items() if k.startswith("sglang_") and k not in sec}
        sec.update(borrowed)
        if borrowed:
            title = f"# H200: minisgl {commits or env.get('git_commit', '?')[:7]}; SGLang 0.5.16 from another lease"
            note = (f" SGLang's figures are those of `{sglang_from}` (its lease of {their_env.get('time_utc', '?')}, "
                    f"minisgl {their_env.get('git_commit', '?')[:7]} beside it there), not measured in this lease: "
                    "ratios across two leases carry the card-to-card and run-to-run spread (a few percent).")
    lines = [title, "",
             "Generated by scripts/make_lease_tables.py from the JSON files beside this one (dummy bf16 weights, "
             "the same requests from minisgl.bench.workloads for both engines)." + note, ""]
    if "sweep06" in sec and "sglang_sweep_06" in sec:
        lines += sweep_table(sec["sweep06"], sec["sglang_sweep_06"], sec.get("sweep06_mr256")) + [""]
    if "sample06" in sec:
        lines += qwen3_table(sec["sample06"]["default"], sec) + [""]
    if "qwen35" in sec:
        w3 = sec.get("w3_06", {}).get("default", {}).get("w3")
        lines += qwen35_table(sec["qwen35"]["default"], sec, w3) + [""]
    lines += w2_runs_table(runs)
    lines += throughput_runs_table(runs)
    lines += sweep_runs_table(runs, sec.get("sglang_sweep_06"))
    if "sweep_phases06" in sec:
        lines += sweep_phases_table(sec["sweep_phases06"])
    tune_path = d / "gpu_gemv_tune.json"
    lines += gemv_tables(json.loads(tune_path.read_text()) if tune_path.is_file() else None, sec)
    lines += wide_tables(sec)
    for dtype, r in sec.get("qwen35_check", {}).items():
        lines.append(f"Qwen3.5 greedy on the GPU, {dtype}: CUDA Graph on equals off: {r['graph_equals_no_graph']}; "
                     f"radix second pass same tokens: {r['graph']['second_pass_same']} "
                     f"({r['graph']['second_pass_cached_tokens']} cached tokens).")
    if timelines:
        lines += timeline_tables(timelines)
    (d / "TABLES.md").write_text("\n".join(lines).rstrip() + "\n")
    print((d / "TABLES.md").read_text())


# Kernel kinds of a decode step, by a piece of the kernel's name (first match wins).
KERNEL_KINDS = (("matmul, cuBLAS", ("nvjet", "gemm", "splitKreduce")), ("matmul, GEMV", ("_gemv",)),
                ("attention", ("decode_stage",)), ("RMSNorm", ("rms_norm",)), ("q/k norm + RoPE", ("rope",)),
                ("SiLU-and-mul", ("silu",)), ("K/V store", ("store_kv",)))


def kernel_kinds(t: dict) -> dict[str, float]:
    """GPU time per step by kernel kind, from a timeline's recorded activities (the script keeps the first few
    thousand, so the step count is what they span, not the steps profiled)."""
    acts = t["activities"]
    steps = len(acts) / t["activities_per_step"]
    out: dict[str, float] = {}
    for _, dur, name in acts:
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other (torch ops, copies)")
        out[kind] = out.get(kind, 0.0) + dur / steps
    return out


def timeline_tables(timelines: list[dict]) -> list[str]:
    """The decode-timeline tables: one row per timeline, then GPU time per step by kernel kind."""
    bare = all("bare_replay" in t for t in timelines)  # recorded by the script from this session on
    lines = ["", "## Batch-1 greedy decode step (scripts/decode_timeline.py; Qwen3-0.6B unless the label "
              "says 8b)", "",
              "| package | ms per step, unprofiled | GPU busy us per step (profiled) | GPU activities per step |"
              + (" bare graph replay us per step | mean kernel-to-kernel gap us | graphs (decode + prefill) |"
                 if bare else ""),
              "|---|---|---|---|" + ("---|---|---|" if bare else "")]
    for t in timelines:
        # an A/B against an older package (MINISGL_ROOT) records the checkout's commit, not the package's
        own = t.get("root", "this checkout") == "this checkout"
        commit = t.get("environment", {}).get("git_commit", "?")[:7] if own else "older package"
        row = (f"| {t['label']} ({commit}) | {t['unprofiled_ms_per_step']:.3f} | "
               f"{t['gpu_busy_us_sum'] / t['profiled_steps']:.0f} | {t['activities_per_step']:.0f} |")
        if bare:
            b, g = t["bare_replay"], t["graphs"]
            row += f" {b['us_per_step']:.0f} | {b['kernel_gap_us']:.2f} | {g['decode']} + {g['prefill']} |"
        lines.append(row)
    kinds = [kernel_kinds(t) for t in timelines]
    names = [k for k, _ in KERNEL_KINDS if any(k in x for x in kinds)] + ["other (torch ops, copies)"]
    lines += ["", "GPU time per step by kernel kind, us (summed kernel durations; under PDL a kernel's span "
              "includes the time it waits for its predecessor, so the sum exceeds the step):", "",
              "| kind | " + " | ".join(t["label"] for t in timelines) + " |",
              "|---|" + "---|" * len(timelines)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{x.get(name, 0.0):.0f}" for x in kinds) + " |")
    return lines


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?", default="reports/h200/run9")
    ap.add_argument("--sglang-from", default=None, help="a lease folder to take SGLang's sections from")
    a = ap.parse_args()
    main(a.folder, a.sglang_from)
