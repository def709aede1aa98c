"""Check and time the prefill/extend CUDA graphs (minisgl/engine/prefill_graph.py) on a CUDA GPU.

Dummy Qwen3-0.6B weights in bf16. For several step shapes (one request of 7 / 100 / 512 / 2000 tokens, four
requests of mixed lengths, decodes mixed with a prefill chunk) every step the prefill graphs serve is
computed three ways: the graph replay (the real step), the same padded fixed-buffer forward run eagerly,
and the plain unpadded eager forward. Replay and padded eager run the same kernels on the same shapes, so
they must agree to rounding; against the unpadded forward the GEMMs see another M (cuBLAS may pick another
kernel), so logits agree to bf16 noise and the greedy token must match wherever eager's top-2 margin is
larger than that noise. Then W2 TTFT with prefill graphs on and off (same engine, toggled), medians.

    python -m lab.checks.prefill_graphs --out /tmp/prefill        # or: main("/tmp/prefill") from Python

Each part runs in its own try/except: a failure is recorded in the JSON and the other parts still run.
Prints a table, writes prefill_check.json, returns the results dict (and `ok`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

from lab.models import model_path
from minisgl import LLM, SamplingParams
from minisgl.bench.runner import environment, run_workload
from minisgl.engine.prefill_graph import PrefillGraphRunner

MODEL = model_path("qwen3-0.6b")
NUM_PAGES = 131072  # 131k token slots (~15 GB for 0.6B): two engines side by side, no 0.85-of-free sizing


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def build(model: str = MODEL, **kw) -> LLM:
    base = dict(load_format="dummy", dtype="bfloat16", num_pages=NUM_PAGES, max_model_len=8192)
    base.update(kw)
    return LLM(model, **base)


def eager_twin(graphs: PrefillGraphRunner) -> PrefillGraphRunner:
    """The same buckets, the same padded fixed-buffer forward, run eagerly (no capture)."""
    return PrefillGraphRunner(graphs.runner, graphs.max_tokens, graphs.max_reqs, graphs.token_buckets,
                              graphs.request_buckets, capture=False)


def _compare(graph: torch.Tensor, padded: torch.Tensor, eager: torch.Tensor) -> dict:
    g, p, e = graph.float(), padded.float(), eager.float()
    scale = e.abs().max().item()
    diff = (g - e).abs().max().item()
    top2 = e.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1])
    same = g.argmax(-1) == e.argmax(-1)
    # a token may differ only where eager's own top-2 margin is inside the observed noise
    token_ok = bool((same | (margin <= 2 * diff)).all())
    return {
        "graph_vs_padded_eager_max_abs": (g - p).abs().max().item(),
        "graph_vs_padded_eager_bitwise": bool(torch.equal(g, p)),
        "graph_vs_eager_max_abs": diff, "logit_scale": scale,
        "tokens_equal": int(same.sum().item()), "rows": int(same.numel()), "token_ok": token_ok,
    }


def check_steps(llm: LLM, prompts: list[list[int]], max_tokens: int = 3) -> dict:
    """Generate greedily; for each step the prefill graphs serve, compare graph / padded eager / eager."""
    runner = llm.engine.runner
    graphs = runner.prefill_graph
    if graphs is None:
        raise RuntimeError("the engine has no prefill graphs (capture failed or the switch is off)")
    twin = eager_twin(graphs)
    forward, graph_run = runner.forward, graphs.run
    steps: list[dict] = []
    pending: dict = {}

    def run_spy(shape, *args):
        out = graph_run(shape, *args)
        pending["graph"] = out.clone()
        return out

    @torch.inference_mode()
    def spy(batch):
        shape = graphs.shape_for(batch)
        if shape is None:
            return forward(batch)
        runner.req_pool.flush()
        ids, pos, meta, logit_idx, *_ = runner.prepare(batch)
        runner.attn.prepare(meta)
        eager = runner.model(ids, pos, runner.attn, logit_idx).clone()
        ids, pos, meta, logit_idx, *_ = runner.prepare(batch, pad_to=shape)
        padded = twin.run(shape, ids, pos, meta, logit_idx, len(batch.sample_rows)).clone()
        out = forward(batch)  # the real step: graph replay (writes the same K/V again)
        out.wait()
        row = {"shape": list(shape), "tokens": batch.num_tokens, "requests": batch.size,
               "mixed": 1 in batch.extend_lens and max(batch.extend_lens) > 1}
        if "graph" in pending and len(batch.sample_rows):
            row.update(_compare(pending.pop("graph"), padded, eager))
        pending.clear()
        steps.append(row)
        return out

    runner.forward, graphs.run = spy, run_spy
    try:
        replays = graphs.replays
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                     progress=False)
    finally:
        runner.forward, graphs.run = forward, graph_run
    compared = [s for s in steps if "token_ok" in s]
    ok = bool(compared) and all(
        s["token_ok"] and s["graph_vs_padded_eager_max_abs"] <= 1e-2 * max(s["logit_scale"], 1.0)
        and s["graph_vs_eager_max_abs"] <= 0.1 * max(s["logit_scale"], 1.0) for s in compared)
    return {"ok": ok, "graph_steps": graphs.replays - replays, "steps": steps}


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 10000), (n,), generator=g).tolist() for n in lengths]


CASES = {  # name: (prompt lengths, engine switches); all prompts arrive at once
    "1x7": ([7], {}),
    "1x100": ([100], {}),
    "1x512": ([512], {}),
    "1x2000": ([2000], {}),
    "4_mixed": ([5, 60, 300, 900], {}),
    "decode+prefill": ([9, 12, 15, 1500], {"chunked_prefill_size": 256}),  # decodes beside each chunk
}


def time_w2(llm: LLM, repeats: int = 3, scale: float = 1.0) -> dict:
    """W2 TTFT / TPOT with prefill graphs on and off (the same engine, toggled), alternating, medians."""
    runner = llm.engine.runner
    graphs = runner.prefill_graph
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(repeats):
        for label in ("on", "off"):
            runner.prefill_graph = graphs if label == "on" else None
            before = graphs.replays if graphs is not None else 0
            cache = llm.engine.cache  # every run starts cold: W2's prompts must not hit the previous run's KV
            cache.evict(cache.cached_pages)
            try:
                r = run_workload(llm, "w2", scale)
            finally:
                runner.prefill_graph = graphs
            r["prefill_graph_steps"] = (graphs.replays - before) if graphs is not None else 0
            runs[label].append(r)
    out = {}
    for label, rs in runs.items():
        out[label] = {
            "ttft_ms_median": statistics.median(r["ttft_ms_median"] for r in rs),
            "tpot_ms_median": statistics.median(r["tpot_ms_median"] for r in rs),
            "ttft_ms_runs": [r["ttft_ms_median"] for r in rs],
            "prefill_graph_steps": [r["prefill_graph_steps"] for r in rs],
        }
    out["ttft_ratio_on_over_off"] = out["on"]["ttft_ms_median"] / out["off"]["ttft_ms_median"]
    return out


def main(out_dir: str = ".", model: str = MODEL, cases: dict | None = None, w2: bool = True,
         w2_scale: float = 1.0, every_engine: dict | None = None) -> dict:
    """Run every check (cases: name -> (prompt lengths, engine switches)) and W2; `w2_scale` < 1 only for a
    CPU smoke run on a small model. `every_engine`: switches added to every engine's (e.g. a kernel option under
    test)."""
    os.makedirs(out_dir, exist_ok=True)
    results: dict = {"environment": environment(), "model": model, "errors": {}}
    cases = CASES if cases is None else cases
    engines: dict = {}

    def engine(switches: dict) -> LLM:
        switches = {**(every_engine or {}), **switches}
        key = json.dumps(switches, sort_keys=True)
        if key not in engines:
            t0 = time.perf_counter()
            engines[key] = build(model, **switches)
            runner = engines[key].engine.runner
            if runner.prefill_graph is None and runner.device.type == "cpu":  # CPU smoke run: uncaptured twin
                runner.prefill_graph = PrefillGraphRunner(runner, 4096, 16, capture=False)
            g = runner.prefill_graph
            results.setdefault("engines", {})[key] = {
                "build_s": time.perf_counter() - t0,
                "prefill_graphs": None if g is None else len(g.graphs),
                "capture_s": None if g is None else g.capture_seconds,
                "capture_mib": None if g is None else g.capture_bytes / 2**20}
        return engines[key]

    results["cases"] = {}
    for name, (lengths, switches) in cases.items():
        try:
            llm = engine(switches)
            vocab = llm.engine.model_config.vocab_size
            results["cases"][name] = check_steps(llm, prompts_of(lengths, vocab, seed=len(results["cases"])))
        except Exception:
            results["errors"][f"case {name}"] = traceback.format_exc()
            log(f"case {name} failed:\n{results['errors'][f'case {name}']}")
    if w2:
        try:
            results["w2"] = time_w2(engine({}), scale=w2_scale)
        except Exception:
            results["errors"]["w2"] = traceback.format_exc()
            log(f"w2 failed:\n{results['errors']['w2']}")
    engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    print(f"{'case':16} {'steps':>5} {'graph':>5} {'max|g-pe|':>10} {'max|g-e|':>9} {'scale':>7} {'tokens':>7}  ok")
    for name, c in results["cases"].items():
        cmp = [s for s in c["steps"] if "token_ok" in s]
        print(f"{name:16} {len(c['steps']):5d} {c['graph_steps']:5d} "
              f"{max((s['graph_vs_padded_eager_max_abs'] for s in cmp), default=float('nan')):10.3g} "
              f"{max((s['graph_vs_eager_max_abs'] for s in cmp), default=float('nan')):9.3g} "
              f"{max((s['logit_scale'] for s in cmp), default=float('nan')):7.3g} "
              f"{sum(s['tokens_equal'] for s in cmp):3d}/{sum(s['rows'] for s in cmp):<3d}  {c['ok']}")
    if "w2" in results:
        w = results["w2"]
        print(f"W2 TTFT median: graphs on {w['on']['ttft_ms_median']:.2f} ms, off {w['off']['ttft_ms_median']:.2f}"
              f" ms (x{w['ttft_ratio_on_over_off']:.2f}); TPOT on {w['on']['tpot_ms_median']:.3f} ms,"
              f" off {w['off']['tpot_ms_median']:.3f} ms; graph steps per run {w['on']['prefill_graph_steps']}")
    for key, e in results.get("engines", {}).items():
        print(f"engine {key}: build {e['build_s']:.1f} s, {e['prefill_graphs']} prefill graphs captured in "
              f"{e['capture_s'] or 0:.2f} s, {e['capture_mib'] or 0:.0f} MiB")
    results["ok"] = (not results["errors"] and bool(results["cases"])
                     and all(c["ok"] for c in results["cases"].values()))
    print("OK" if results["ok"] else f"FAILED: {sorted(results['errors']) or 'a case check'}")
    with open(os.path.join(out_dir, "prefill_check.json"), "w") as f:
        json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--no-w2", action="store_true")
    a = ap.parse_args()
    sys.exit(0 if main(a.out, w2=not a.no_w2)["ok"] else 1)
