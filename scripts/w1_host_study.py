"""W1 (DESIGN.md) through the real schedulers, prefix caches and state-pool bookkeeping, forward faked: what the
host does per step for Qwen3.5 (hybrid) against Qwen3, on any machine (a CPU is enough).

The model's forward is replaced by a stand-in that costs nothing on the device side but keeps every piece of
host work around it: `ModelRunner.prepare` (the step's packed inputs, the request-table writes, the attention
metadata and sampling settings), the state pool's `start`/`save` (index tensors, copies between slots) and the
token-table write; the sampled tokens are seeded random ids. Configs are the real ones (assets/configs) with
their dimensions shrunk (the scheduler never sees a dimension), the settings the engine's GPU defaults:
page size 1, chunked prefill 8192, overlap on, radix cache on, max_running_requests as the H200 resolved it
(Qwen3.5 256, Qwen3 1024), snapshot slots as many as 5% of an H200's free memory holds at the 0.8B shapes.

Per model it records: steps by kind (prefill-only, mixed, decode; a decode step may carry a prompt's 1-token
tail), prompt tokens per step, the decode batch over time, prefill chunks cut short by the hybrid scheduler
(at the last page boundary below the prompt's end, or at a branch point), state inits/saves per step, host
time per step by phase, and a cProfile of a second run (top functions; those of hybrid-only code apart).

    python scripts/w1_host_study.py --out reports/cpu            # both models, W1 at full size
    python scripts/w1_host_study.py --out /tmp/x --scale 0.25    # a quick look
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from minisgl import LLM  # noqa: E402
from minisgl.bench.workloads import w1_offline  # noqa: E402
from minisgl.engine.model_runner import StepOutput  # noqa: E402

# the H200 run (reports/h200/run9/run9b.json) resolved these
MAX_RUNNING = {"qwen3.5": 256, "qwen3": 1024}
H200_FREE_BYTES = 139 * 2**30  # about what is free after the 0.8B weights; snapshots take 5% of it


def tiny_config_dir(model: str, root: str) -> str:
    """The real config with its dimensions shrunk (layers too: the scheduler sees none of them)."""
    src = os.path.join(REPO, "assets/configs", {"qwen3.5": "qwen3.5-0.8b", "qwen3": "qwen3-0.6b"}[model])
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    text = cfg["text_config"] if "text_config" in cfg else cfg
    text.update(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                vocab_size=10240, max_position_embeddings=4096)
    if model == "qwen3.5":
        text.update(layer_types=["linear_attention"] * 3 + ["full_attention"], num_hidden_layers=4,
                    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
                    linear_value_head_dim=8)
    else:
        text.update(num_hidden_layers=2)
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(text.get(k), int):
            text[k] = 2
    out = os.path.join(root, model)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2}, f)
    return out


def h200_snapshots() -> int:
    """Snapshot slots the engine gives Qwen3.5-0.8B on an H200 by default (state_snapshot_memory_fraction)."""
    from transformers import AutoConfig

    from minisgl.kvcache.state_pool import StatePool
    from minisgl.models.qwen3_5 import Qwen35Config

    mc = Qwen35Config.from_hf(AutoConfig.from_pretrained(os.path.join(REPO, "assets/configs/qwen3.5-0.8b")))
    per_slot = StatePool.bytes_per_slot(len(mc.linear_attention_layers), mc.conv_channels, mc.linear_conv_kernel,
                                        mc.linear_num_value_heads, mc.linear_key_head_dim,
                                        mc.linear_value_head_dim, torch.bfloat16)
    return int(H200_FREE_BYTES * 0.05) // per_slot


def make_llm(path: str, model: str, **switches) -> LLM:
    kw = dict(device="cpu", load_format="dummy", max_model_len=4096, kv_cache_tokens=600_000,
              max_running_requests=MAX_RUNNING[model])
    if model == "qwen3.5":
        kw["state_snapshots"] = h200_snapshots()
    kw.update(switches)
    return LLM(path, **kw)


class Probe:
    """The stand-in forward plus per-step records: the real host work of a step, no model."""

    def __init__(self, llm: LLM, record: bool) -> None:
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.sched = self.engine.scheduler
        self.record = record
        self.rng = torch.Generator().manual_seed(0)
        self.steps: list[dict] = []
        self.cur: dict = {}
        self.launched = 0
        self.in_run = False
        self.first_seen: dict[int, int] = {}  # rid -> index of the step that computed its first prompt chunk
        self.first_token: dict[int, int] = {}  # rid -> index of the step that sampled its first token
        self.runner.forward = self.forward
        if record:
            self._schedule, self._build = self.sched.schedule, self.sched._build
            self.sched.schedule, self.sched._build = self.schedule, self.build

    def schedule(self):
        t0 = time.perf_counter()
        try:
            return self._schedule()
        finally:
            self.cur["schedule_ms"] = 1e3 * (time.perf_counter() - t0)

    def build(self, plan):
        asked = [(req, n, req.kv_len) for req, n in plan]
        batch = self._build(plan)
        p = self.sched.page_size
        cuts = {"boundary": 0, "branch": 0}
        for (req, n, start), got in zip(asked, batch.extend_lens):
            if got < n:
                end = start + got
                cuts["boundary" if end == (req.num_tokens - 1) // p * p else "branch"] += 1
        self.cur["cuts"] = cuts
        return batch

    def forward(self, batch):
        runner, t = self.runner, {}
        t0 = time.perf_counter()
        *_, token_dst = runner.prepare(batch)
        t1 = time.perf_counter()
        pool = runner.state_pool
        if pool is not None:
            pool.start(batch.state_inits)
        t2 = time.perf_counter()
        # the device's work would go here: the sampled tokens are seeded random ids
        tokens = torch.randint(3, 10000, (len(batch.sample_rows),), generator=self.rng)
        if pool is not None:
            pool.save(batch.state_saves)
        t3 = time.perf_counter()
        runner.store_tokens(token_dst, tokens)
        t4 = time.perf_counter()
        for req, pre, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            self.first_seen.setdefault(req.rid, self.launched)
            if pre + n == len(req.input_ids) and req.rid not in self.first_token:
                self.first_token[req.rid] = self.launched
        self.launched += 1
        if self.record:
            t.update(prepare_ms=1e3 * (t1 - t0), state_start_ms=1e3 * (t2 - t1), state_save_ms=1e3 * (t3 - t2),
                     store_ms=1e3 * (t4 - t3))
            self.cur.update(t, **describe(batch))
            if not self.in_run:  # a step of LLM.generate (the warm-up): no step timing, its shape only
                self.steps.append(self.cur)
                self.cur = {}
        return StepOutput(batch, tokens, tokens, None)

    def run(self, prompts, params) -> float:
        engine = self.engine
        reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.in_run = True
        t0 = time.perf_counter()
        while engine.has_work:
            self.cur = {}
            s0 = time.perf_counter()
            engine.step()
            if self.record and "kind" in self.cur:
                self.cur["step_ms"] = 1e3 * (time.perf_counter() - s0)
                self.steps.append(self.cur)
            if all(r.released for r in reqs):
                break
        wall = time.perf_counter() - t0
        self.in_run = False
        assert all(len(r.output_ids) == r.params.max_tokens for r in reqs)
        return wall


def describe(batch) -> dict:
    prompt_rows = [(r, n) for r, n, pre in zip(batch.reqs, batch.extend_lens, batch.prefix_lens)
                   if pre < len(r.input_ids)]
    decode_rows = batch.size - len(prompt_rows)
    prompt_tokens = sum(n for _, n in prompt_rows)
    tails = sum(1 for _, n in prompt_rows if n == 1)  # a prompt's last token alone (after a cut)
    if not decode_rows:
        kind = "prefill"
    elif not prompt_rows or prompt_tokens == tails:
        kind = "decode"  # decodes, perhaps with prompts' 1-token tails: a decode-graph step on a GPU
    else:
        kind = "mixed"
    inits = getattr(batch, "state_inits", [])
    return {"kind": kind, "size": batch.size, "tokens": batch.num_tokens, "decode_rows": decode_rows,
            "prompt_rows": len(prompt_rows),
            "prompt_tokens": prompt_tokens, "prompt_tails": tails, "sampling": len(batch.sample_rows),
            "state_inits_zero": sum(1 for _, s in inits if s is None),
            "state_inits_snapshot": sum(1 for _, s in inits if s is not None),
            "state_saves": len(getattr(batch, "state_saves", []))}


def summarise(steps: list[dict], wall: float, engine) -> dict:
    kinds: dict[str, dict] = {}
    phases = ("schedule_ms", "prepare_ms", "state_start_ms", "state_save_ms", "store_ms", "step_ms")
    for kind in ("prefill", "mixed", "decode"):
        ss = [s for s in steps if s["kind"] == kind]
        if not ss:
            continue
        kinds[kind] = {"steps": len(ss),
                       "prompt_tokens_per_step": [s["prompt_tokens"] for s in ss] if kind != "decode" else None,
                       "mean_rows": statistics.fmean(s["size"] for s in ss),
                       **{f"mean_{p}": statistics.fmean(s[p] for s in ss) for p in phases}}
    for s in steps:
        s["other_ms"] = s["step_ms"] - s["schedule_ms"] - sum(
            s[p] for p in ("prepare_ms", "state_start_ms", "state_save_ms", "store_ms"))
    total = {p: sum(s[p] for s in steps) / 1e3 for p in (*phases, "other_ms")}
    decodes = [s for s in steps if s["kind"] == "decode"]

    def by_batch(lo, hi):  # decode steps of lo..hi rows: host time per step and per row
        ss = [s for s in decodes if lo <= s["size"] <= hi]
        if not ss:
            return None
        return {"steps": len(ss), "mean_rows": statistics.fmean(s["size"] for s in ss),
                **{f"mean_{p}": statistics.fmean(s[p] for s in ss)
                   for p in ("schedule_ms", "prepare_ms", "state_start_ms", "state_save_ms", "other_ms",
                             "step_ms")}}

    cuts = {"boundary": sum(s.get("cuts", {}).get("boundary", 0) for s in steps),
            "branch": sum(s.get("cuts", {}).get("branch", 0) for s in steps)}
    return {
        "wall_s": wall, "steps": len(steps), "engine_stats": dict(engine.stats),
        "by_kind": kinds,
        "host_s_total_by_phase": total,
        "decode_host_by_batch": {f"{lo}-{hi}": by_batch(lo, hi)
                                 for lo, hi in ((1, 63), (64, 127), (128, 191), (192, 255), (256, 1024))},
        "decode_batch_over_time": [s["size"] for s in steps],  # rows per step (decodes and prompts)
        "prompt_tokens_over_time": [s["prompt_tokens"] for s in steps],
        "cut_prefill_chunks": cuts,
        "steps_with_cuts": sum(1 for s in steps if sum(s.get("cuts", {}).values())),
        "prompt_tails": sum(s["prompt_tails"] for s in steps),
        "state_inits_zero": sum(s["state_inits_zero"] for s in steps),
        "state_inits_snapshot": sum(s["state_inits_snapshot"] for s in steps),
        "state_saves": sum(s["state_saves"] for s in steps),
        "steps_with_state_copies": sum(1 for s in steps if s["state_saves"] or s["state_inits_snapshot"]
                                       or s["state_inits_zero"]),
        "saves_per_step_max": max(s["state_saves"] for s in steps),
    }


def conv_variants(steps: list[dict], prefill_graph_max_tokens: int = 4096, prefill_graph_max_reqs: int = 16,
                  search_steps: int | None = None) -> dict:
    """The varlen GDN conv kernel's compile-time SEARCH_STEPS per step, as a GPU would launch it: not in decode
    steps (T == N, the decode kernel), the request bucket's count in a prefill-graph step (captured at start-up),
    the batch's own otherwise. `search_steps`: GDN_CONFIG["conv_search_steps"] (None: the current setting)."""
    from minisgl.engine.prefill_graph import default_request_buckets, default_token_buckets, extend_shape
    from minisgl.kernels import gdn

    old = gdn.GDN_CONFIG["conv_search_steps"]
    if search_steps is not None:
        gdn.GDN_CONFIG["conv_search_steps"] = search_steps
    try:
        tb, rb = default_token_buckets(prefill_graph_max_tokens), default_request_buckets(prefill_graph_max_reqs)
        captured = {gdn.conv_search_steps(r) for r in rb}
        eager: dict[int, int] = {}  # SEARCH_STEPS -> first step index that needs it
        for i, s in enumerate(steps):
            if s["tokens"] == s["size"]:
                continue
            shape = extend_shape(tb, rb, s["tokens"], s["size"], False, more_tokens_than_reqs=True)
            if shape is None:
                eager.setdefault(gdn.conv_search_steps(s["size"]), i)
        return {"conv_search_steps_setting": gdn.GDN_CONFIG["conv_search_steps"],
                "captured_at_start_up": sorted(captured), "eager_first_step": dict(sorted(eager.items()))}
    finally:
        gdn.GDN_CONFIG["conv_search_steps"] = old


def compile_seconds(values: list[int]) -> dict:
    """Seconds to compile the varlen conv kernel for sm_90 here (no GPU needed: triton.compile with a target),
    one variant per SEARCH_STEPS value, in a fresh cache directory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernels import gdn

    fn, cfg = gdn._conv_varlen_kernel, gdn.GDN_CONFIG
    names = [p.name for p in fn.params]
    ptrs = {"X": "*bf16", "W": "*bf16", "Bias": "*bf16", "State": "*bf16", "Slots": "*i64", "Cu": "*i32",
            "Out": "*bf16"}
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            for v in values:
                const = dict(K=4, HAS_BIAS=False, SEARCH_STEPS=v, BLOCK_T=cfg["conv_block_t"],
                             BLOCK_C=cfg["conv_block_c"])
                sig = {n: ptrs.get(n, "constexpr" if n in const else "i32") for n in names}
                src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): x for k, x in const.items()})
                t0 = time.perf_counter()
                triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["conv_warps"]})
                out[str(v)] = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
    return out


HYBRID_FILES = ("scheduler/hybrid.py", "kvcache/state_pool.py")


def profile_run(path: str, model: str, prompts, params, top: int, switches: dict) -> dict:
    llm = make_llm(path, model, **switches)
    probe = Probe(llm, record=False)
    prof = cProfile.Profile()
    prof.enable()
    wall = probe.run(prompts, params)
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, nc, tt, ct, _) in st.stats.items():
        short = file.split("minisgl/")[-1] if "minisgl/" in file else os.path.basename(file)
        rows.append({"function": f"{short}:{line}({fn})", "calls": nc, "tottime_s": tt, "cumtime_s": ct})
    by_tot = sorted(rows, key=lambda r: -r["tottime_s"])[:top]
    by_cum = sorted((r for r in rows if "minisgl" in r["function"] or "/" in r["function"]),
                    key=lambda r: -r["cumtime_s"])[:top]
    hybrid = sorted((r for r in rows if any(h in r["function"] for h in HYBRID_FILES)),
                    key=lambda r: -r["cumtime_s"])[:top]
    return {"wall_s_profiled": wall, "top_tottime": by_tot, "top_cumtime_minisgl": by_cum,
            "hybrid_only_by_cumtime": hybrid}


def study(model: str, path: str, prompts, params, top: int, profile: bool, switches: dict,
          repeats: int = 1) -> dict:
    from minisgl.bench.runner import flush_prefix_cache, warm_up

    llm = make_llm(path, model, **switches)
    probe = Probe(llm, record=True)
    probe.run(prompts[:8], params[:8])  # warm-up (first-call costs), then the standard run on a fresh cache
    llm = make_llm(path, model, **switches)
    probe = Probe(llm, record=True)
    warm_up(llm)  # the benchmark's own warm-up (bench/runner.py), as run before the timed W1
    warm_steps, probe.steps = probe.steps, []
    probe.first_seen, probe.first_token = {}, {}
    flush_prefix_cache(llm)
    wall = probe.run(prompts, params)
    out = summarise(probe.steps, wall, llm.engine)
    # the same timed run again on fresh engines: the spread of the host totals (a shared 2-core machine is noisy)
    totals = [out["host_s_total_by_phase"]]
    for _ in range(repeats - 1):
        again = make_llm(path, model, **switches)
        p2 = Probe(again, record=True)
        w2 = p2.run(prompts, params)
        totals.append(summarise(p2.steps, w2, again.engine)["host_s_total_by_phase"])
    out["host_s_total_by_phase_repeats"] = totals
    out["host_s_total_by_phase_median"] = {k: statistics.median(t[k] for t in totals) for k in totals[0]}
    if model == "qwen3.5":  # Triton variants of the varlen conv kernel W1 needs past start-up and warm-up
        seen = {}
        for setting in (0, None):
            key = "exact" if setting == 0 else "default"
            warm = conv_variants(warm_steps, search_steps=setting)
            run = conv_variants(probe.steps, search_steps=setting)
            have = set(warm["captured_at_start_up"]) | set(warm["eager_first_step"])
            seen[key] = {"setting": run["conv_search_steps_setting"], "warm_up": warm, "w1": run,
                         "compiled_in_timed_w1": sorted(set(run["eager_first_step"]) - have)}
        out["gdn_conv_variants"] = seen
    # steps from a request's first chunk to the step that samples its first token (1 = its prompt in one step)
    spans = [probe.first_token[rid] - probe.first_seen[rid] + 1 for rid in probe.first_token]
    out["prompt_steps_per_request"] = {"mean": statistics.fmean(spans), "max": max(spans),
                                       "histogram": {str(k): spans.count(k) for k in sorted(set(spans))}}
    out["config"] = {k: getattr(llm.config, k) for k in (
        "page_size", "chunked_prefill_size", "max_prefill_tokens", "max_running_requests", "radix_cache",
        "overlap", "state_snapshots")}
    cache = llm.engine.cache
    out["snapshots_held_at_end"] = len(getattr(cache, "snapshots", {}))
    if profile:
        out["cprofile"] = profile_run(path, model, prompts, params, top, switches)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scale", type=float, default=1.0, help="W1 scale (1 = the standard workload)")
    ap.add_argument("--models", default="qwen3,qwen3.5")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs per model (host totals: each, median)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--compile-probe", action="store_true",
                    help="also time compiling the varlen GDN conv kernel for sm_90 here (Triton, no GPU needed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig switch for every model (int/float/bool parsed), e.g. page_size=16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    switches = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        switches[k] = {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
    w = w1_offline(args.scale)
    random.seed(0)
    results = {"workload": {"name": "W1", "scale": args.scale, "requests": len(w.prompts),
                            "prompt_tokens": sum(map(len, w.prompts)), "output_tokens": w.total_output_tokens},
               "switches": switches, "torch": torch.__version__, "python": sys.version.split()[0],
               "note": "forward faked (no model, no device): host work of the schedulers, caches, state pool and "
                       "ModelRunner.prepare only; tiny dimensions, real scheduler settings", "models": {}}
    with tempfile.TemporaryDirectory() as root:
        for model in args.models.split(","):
            path = tiny_config_dir(model, root)
            t0 = time.perf_counter()
            results["models"][model] = study(model, path, w.prompts, w.params, args.top, not args.no_profile,
                                             switches, args.repeats)
            print(f"{model}: {time.perf_counter() - t0:.1f} s", flush=True)
    q35 = results["models"].get("qwen3.5")
    if args.compile_probe and q35 is not None:
        need = q35["gdn_conv_variants"]["exact"]["compiled_in_timed_w1"]
        results["conv_compile_seconds_sm90_here"] = compile_seconds(need)
    os.makedirs(args.out, exist_ok=True)
    name = "w1_host_study" + "".join(f"_{k}{v}" for k, v in switches.items()) + ".json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(results, f, indent=1)
    print(os.path.join(args.out, name))


if __name__ == "__main__":
    main()
