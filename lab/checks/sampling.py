"""Check and time the fused sampler (minisgl/kernels/sampling.py) on a CUDA GPU, against the torch reference.

    python -m lab.checks.sampling --out DIR      (or: from lab.checks.sampling import main)
    python -m lab.checks.sampling --smoke --out DIR   (CPU, Triton interpreter: the checks on a
                                                             small vocabulary, to test this script)

Checks, on random [B, 151936] logits (bf16 widened to fp32, as the LM head gives them, and plain fp32) for
B in 1/64/256/512 with a per-row mix of temperatures (0 included), top-k, top-p and min-p:
- the fused kernel's tokens against the torch reference's (sort-based, same threshold semantics): counts of
  differing rows (0 expected; a rare difference can only come from a probability mass or a log rounded
  differently by the GPU's fused multiply-add and libdevice, at a threshold's exact boundary);
- a row's token does not depend on its batch (each row alone, and a shuffled sub-batch): must be exact;
- the kernels' exact shortcuts (sampler_skip_blocks, sampler_top_k_bound) off draw the same tokens: must be exact;
- a CUDA-graph replay with refreshed inputs draws what the eager call draws: must be exact;
- the engine on the embedded tiny model: 24 seeded requests (greedy, temperature, top-k, top-p, min-p) draw
  the same tokens with the decode graph (sampler inside), without it, and without overlap; alone as in a batch.
Times (CUDA graph replay, CUDA events, median), on a bf16 tensor (as the engine's LM head gives it), on bf16
values widened to fp32, and once on fp32: the sort path (the reference), the fused sampler with cuts
(top-k 50 + top-p 0.95 at T 0.6: the W1 variant), the same with top-p only (both also with the exact
shortcuts sampler_skip_blocks/sampler_top_k_bound off: the A/B of issue 10), the fused one-pass sampler
without cuts, the with-cuts graph on a batch without cuts (what a temperature-only batch pays inside the
decode graph's sampling variant), and greedy argmax.

Each check runs in its own try/except; the JSON (DIR/gpu_sampling_check.json) is rewritten after every
section, so a crash keeps what came before. Returns the results dict; `ok` is False if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--smoke" in sys.argv:  # Triton picks interpreter or compiler at import: decide before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from lab.timing import capture, time_graph
from minisgl.engine.sampler import SamplingTensors, apply_top_k_top_p, uniform_noise

VOCAB = 151936
BATCHES = (1, 64, 256, 512)
DEV = "cuda"


def reference_sample(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The torch path of minisgl.engine.sampler.sample (which on a GPU would call the kernel instead)."""
    logits = logits.float()  # the torch path widens a bf16 head's logits
    greedy_tokens = logits.argmax(dim=-1)
    inv_t = 1.0 / st.temperatures.clamp_min(1e-6)
    if st.any_top_k_p:
        logits = apply_top_k_top_p(logits, st.top_ks, st.top_ps, st.min_ps, inv_t)
    u = uniform_noise(st.seeds, st.steps, logits.shape[-1])
    sampled = (logits * inv_t[:, None] - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(st.temperatures == 0, greedy_tokens, sampled)


def fused(logits: torch.Tensor, st: SamplingTensors, shortcuts: bool = True) -> torch.Tensor:
    """The fused sampler; `shortcuts=False` turns its exact shortcuts (sampler_skip_blocks, sampler_top_k_bound)
    off for this call (a graph captured through it keeps them off)."""
    from lab.engines import kernel_options
    from minisgl.kernels import sampling
    with kernel_options(sampler_skip_blocks=shortcuts, sampler_top_k_bound=shortcuts):
        return sampling.fused_sample(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.steps,
                                     cuts=st.any_top_k_p)


def make_logits(b: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    """kind: "fp32", "bf16" (bf16 values widened to fp32) or "bf16_head" (a bf16 tensor, as the engine's LM
    head gives the sampler: 4 search passes per cut)."""
    x = torch.randn(b, VOCAB, generator=gen, device=DEV) * 2.5
    x[:, :: 97] += 6  # a few hundred likely tokens per row, like a real model's head
    if kind == "bf16_head":
        return x.bfloat16()
    return x.bfloat16().float() if kind == "bf16" else x


def mixed_settings(b: int, gen: torch.Generator) -> SamplingTensors:
    """Every row a different mix: greedy, temperature only, top-k, top-p, min-p and their combinations."""
    pick = lambda options: torch.tensor(options, device=DEV)[  # noqa: E731
        torch.randint(0, len(options), (b,), generator=gen, device=DEV)]
    temps = pick([0.0, 0.6, 1.0, 1.5])
    top_ks = pick([VOCAB, VOCAB, 1, 20, 50, 1000])
    top_ps = pick([1.0, 1.0, 0.95, 0.9, 0.5])
    min_ps = pick([0.0, 0.0, 0.05, 0.2])
    seeds = torch.randint(0, 2**31, (b,), generator=gen, device=DEV)
    steps = torch.randint(0, 4096, (b,), generator=gen, device=DEV)
    return SamplingTensors(temps, top_ks.long(), top_ps.float(), seeds, steps, all_greedy=False, any_top_k_p=True,
                           min_ps=min_ps.float())


def uniform_settings(b: int, temp: float, top_k: int, top_p: float, min_p: float = 0.0) -> SamplingTensors:
    full = lambda v, dt: torch.full((b,), v, dtype=dt, device=DEV)  # noqa: E731
    cuts = top_k < VOCAB or top_p < 1 or min_p > 0
    return SamplingTensors(full(temp, torch.float32), full(top_k, torch.int64), full(top_p, torch.float32),
                           torch.arange(b, device=DEV) * 7919, full(11, torch.int64), all_greedy=temp == 0,
                           any_top_k_p=cuts, min_ps=full(min_p, torch.float32))


def rows(st: SamplingTensors, idx: torch.Tensor) -> SamplingTensors:
    return SamplingTensors(st.temperatures[idx], st.top_ks[idx], st.top_ps[idx], st.seeds[idx], st.steps[idx],
                           st.all_greedy, st.any_top_k_p, None if st.min_ps is None else st.min_ps[idx])


def check_tokens(b: int, kind: str, gen: torch.Generator) -> dict:
    logits = make_logits(b, gen, kind)
    st = mixed_settings(b, gen)
    got, want = fused(logits, st), reference_sample(logits, st)
    diff = (got != want).nonzero().flatten().tolist()
    detail = [dict(row=i, fused=int(got[i]), ref=int(want[i]), temp=float(st.temperatures[i]),
                   top_k=int(st.top_ks[i]), top_p=float(st.top_ps[i]), min_p=float(st.min_ps[i]))
              for i in diff[:8]]
    # batch independence: a few rows alone, and a shuffled half batch
    alone = [i for i in (0, b // 3, b - 1)]
    alone_bad = sum(int(fused(logits[i:i + 1], rows(st, torch.tensor([i], device=DEV)))[0] != got[i])
                    for i in alone)
    perm = torch.randperm(b, generator=gen, device=DEV)[: max(1, b // 2)]
    sub_bad = int((fused(logits[perm], rows(st, perm)) != got[perm]).sum())
    # the shortcuts are exact: off, every row draws the same token
    shortcut_bad = int((fused(logits, st, shortcuts=False) != got).sum())
    return dict(batch=b, logits=kind, rows_differing_from_reference=len(diff), differing=detail,
                batch_dependence_rows=alone_bad + sub_bad, shortcut_rows_differing=shortcut_bad,
                ok=alone_bad + sub_bad + shortcut_bad == 0 and len(diff) <= max(1, b // 256))


def check_graph(b: int, gen: torch.Generator) -> dict:
    """Capture once, then replay with new logits and new settings copied into the static buffers."""
    logits = make_logits(b, gen, "bf16")
    st = mixed_settings(b, gen)
    graph, out = capture(lambda: fused(logits, st), warmups=2)
    bad = 0
    for _ in range(3):
        new_logits, new = make_logits(b, gen, "bf16"), mixed_settings(b, gen)
        logits.copy_(new_logits)
        for static, fresh in ((st.temperatures, new.temperatures), (st.top_ks, new.top_ks),
                              (st.top_ps, new.top_ps), (st.min_ps, new.min_ps), (st.seeds, new.seeds),
                              (st.steps, new.steps)):
            static.copy_(fresh)
        graph.replay()
        bad += int((out != fused(new_logits, new)).sum())
    return dict(batch=b, replay_rows_differing_from_eager=bad, ok=bad == 0)


def check_engine() -> dict:
    """The embedded tiny model end to end: seeded requests with every kind of sampling draw the same tokens
    with the decode CUDA graph (its sampler inside the graph) and without, with and without overlap, and a
    request alone draws what it draws in a batch."""
    from minisgl import LLM, SamplingParams
    path = str(Path(__file__).resolve().parents[1] / "assets" / "tiny-qwen3")
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 4000, (int(n),), generator=gen).tolist() for n in torch.randint(4, 60, (24,))]
    settings = [(0.0, -1, 1.0, 0.0), (0.8, -1, 1.0, 0.0), (1.0, 50, 0.95, 0.0), (1.3, -1, 0.9, 0.0),
                (0.7, 20, 1.0, 0.05), (1.0, -1, 1.0, 0.1), (1.5, 2, 1.0, 0.0), (1.0, 1000, 0.5, 0.02)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, max_tokens=40, ignore_eos=True, seed=i)
              for i, (t, k, p, mp) in enumerate(settings * 3)]
    tokens, graph_steps = {}, {}
    for name, switches in {"graph": {}, "no_graph": dict(cuda_graph=False), "graph_no_overlap":
                           dict(overlap=False)}.items():
        llm = LLM(path, num_pages=8192, cuda_graph_max_bs=32, **switches)
        tokens[name] = [o.token_ids for o in llm.generate(prompts, params)]
        tokens[name + "_alone"] = [llm.generate([prompts[i]], params[i])[0].token_ids for i in (2, 5, 9)]
        runner = llm.engine.runner.graph_runner
        graph_steps[name] = None if runner is None else sorted({k[1] for k in runner.graphs})
        del llm
        torch.cuda.empty_cache()
    base = tokens["graph"]
    differ = {name: sum(a != b for a, b in zip(base, t)) for name, t in tokens.items() if not name.endswith("alone")}
    alone = {name: sum(tokens[name + "_alone"][j] != tokens[name][i] for j, i in enumerate((2, 5, 9)))
             for name in ("graph", "no_graph", "graph_no_overlap")}
    sampled = sum(t != base[0] for t in base)
    return dict(requests=len(prompts), requests_differing_from_graph=differ, alone_differing_from_batch=alone,
                graphs=graph_steps, ok=not any(differ.values()) and not any(alone.values()) and sampled > 0)


def time_batch(b: int, kind: str, gen: torch.Generator) -> dict:
    logits = make_logits(b, gen, kind)
    w1_cuts = uniform_settings(b, 0.6, 50, 0.95)
    top_p_only = uniform_settings(b, 0.6, VOCAB, 0.95)
    temp_only = uniform_settings(b, 0.6, VOCAB, 1.0)
    temp_in_cut_graph = SamplingTensors(*[getattr(temp_only, f) for f in
                                          ("temperatures", "top_ks", "top_ps", "seeds", "steps")],
                                        all_greedy=False, any_top_k_p=True, min_ps=temp_only.min_ps)
    cases = {
        "sort_path_top_k_top_p": lambda: reference_sample(logits, w1_cuts),
        "fused_top_k_top_p": lambda: fused(logits, w1_cuts),
        "fused_top_k_top_p_no_shortcuts": lambda: fused(logits, w1_cuts, shortcuts=False),
        "fused_top_p_only": lambda: fused(logits, top_p_only),
        "fused_top_p_only_no_shortcuts": lambda: fused(logits, top_p_only, shortcuts=False),
        "fused_min_p_0.05": lambda: fused(logits, uniform_settings(b, 0.6, VOCAB, 1.0, 0.05)),
        "fused_temperature_only": lambda: fused(logits, temp_only),
        "fused_cut_graph_no_cuts": lambda: fused(logits, temp_in_cut_graph),
        "torch_temperature_only": lambda: reference_sample(logits, temp_only),
        "greedy_argmax": lambda: logits.argmax(dim=-1),
    }
    out = dict(batch=b, logits=kind)
    for name, fn in cases.items():
        try:
            out[name + "_us"] = round(time_graph(fn, warmups=2), 1)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            out[name + "_us"] = None
            out[name + "_error"] = repr(e)[:300]
    if out.get("sort_path_top_k_top_p_us") and out.get("fused_top_k_top_p_us"):
        out["speedup_vs_sort"] = round(out["sort_path_top_k_top_p_us"] / out["fused_top_k_top_p_us"], 1)
    if out.get("fused_top_k_top_p_us") and out.get("fused_temperature_only_us"):  # the issue-10 ratio
        out["top_k_top_p_over_temperature"] = round(out["fused_top_k_top_p_us"] / out["fused_temperature_only_us"], 2)
    return out


def main(out_dir: str | Path = ".", quick: bool = False, smoke: bool = False) -> dict:
    global VOCAB, DEV
    if smoke:  # no GPU: Triton's interpreter, a small vocabulary, no graphs and no timing
        VOCAB, DEV = 1500, "cpu"  # needs TRITON_INTERPRET=1 before Triton is imported (see the top)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_sampling_check.json"
    now = lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # noqa: E731
    results: dict = dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                         torch=torch.__version__, vocab=VOCAB, started=now(), checks=[], graph=[], engine=[],
                         timing=[], errors=[])
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["errors"].append("triton is not installed")

    def save():
        checks = results["checks"] + results["graph"] + results["engine"]
        results["ok"] = not results["errors"] and all(c.get("ok") for c in checks)
        path.write_text(json.dumps(results, indent=1))

    def guarded(section: str, fn, *a):
        try:
            results[section].append(fn(*a))
        except Exception:  # noqa: BLE001 - record, then go on with the next check
            results["errors"].append(f"{section}{a[:2]}: {traceback.format_exc()[-1500:]}")
        save()

    gen = torch.Generator(device=DEV).manual_seed(0)
    batches = (1, 5) if smoke else (1, 64) if quick else BATCHES
    for b in batches:
        for kind in ("bf16", "fp32"):
            guarded("checks", check_tokens, b, kind, gen)
    guarded("engine", check_engine)  # on a CPU: no graph, the same comparisons
    if not smoke:
        for b in batches:
            guarded("graph", check_graph, b, gen)
        for b in batches:
            guarded("timing", time_batch, b, "bf16_head", gen)  # what the engine gives the sampler
        for b in batches:
            guarded("timing", time_batch, b, "bf16", gen)
        guarded("timing", time_batch, batches[-1], "fp32", gen)
    results["finished"] = now()
    save()

    print(f"{'check':<28}{'batch':>6}  result")
    for c in results["checks"]:
        print(f"{'tokens vs reference ' + c['logits']:<28}{c['batch']:>6}  {c['rows_differing_from_reference']} rows "
              f"differ, {c['batch_dependence_rows']} batch-dependent  {'ok' if c['ok'] else 'FAIL'}")
    for c in results["graph"]:
        print(f"{'graph replay vs eager':<28}{c['batch']:>6}  {c['replay_rows_differing_from_eager']} rows differ  "
              f"{'ok' if c['ok'] else 'FAIL'}")
    for c in results["engine"]:
        print(f"{'engine: graph vs no graph':<28}{'':>6}  {c['requests_differing_from_graph']}, alone vs batch "
              f"{c['alone_differing_from_batch']}  {'ok' if c['ok'] else 'FAIL'}")
    cols = ["sort_path_top_k_top_p", "fused_top_k_top_p", "fused_top_k_top_p_no_shortcuts", "fused_top_p_only",
            "fused_top_p_only_no_shortcuts", "fused_min_p_0.05",
            "fused_temperature_only", "fused_cut_graph_no_cuts", "torch_temperature_only", "greedy_argmax"]
    print("\nmicroseconds per call (CUDA graph replay, median):")
    print(f"{'batch':>6} {'logits':>9} " + " ".join(f"{c[:22]:>22}" for c in cols))
    for t in results["timing"]:
        print(f"{t['batch']:>6} {t['logits']:>9} " + " ".join(f"{t.get(c + '_us') or float('nan'):>22.1f}"
                                                            for c in cols))
    for e in results["errors"]:
        print("ERROR", e)
    print(f"wrote {path}; ok={results['ok']}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 64 only")
    ap.add_argument("--smoke", action="store_true", help="CPU (TRITON_INTERPRET=1), small vocabulary, checks only")
    args = ap.parse_args()
    sys.exit(0 if main(args.out, args.quick, args.smoke)["ok"] else 1)
