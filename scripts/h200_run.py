"""One call on the H200 machine: check correctness, then time everything; JSON under --out.

    python scripts/h200_run.py --out $OUT --sections ceilings,parity,bench06,profile

Sections (comma separated):
  ceilings   device-to-device copy bandwidth and bf16 matmul rate, measured now
  parity     greedy tokens vs transformers on the GPU at Qwen3-0.6B shapes (dummy weights), fp32 and bf16
  kernels    Triton attention kernels vs a torch fp32 reference (scripts/gpu_kernel_check.py)
  bench06    W1-W4 on Qwen3-0.6B with defaults, then each switch off in turn (the ablation table)
  quick06    W2 then W1 on Qwen3-0.6B with defaults only (a first look)
  bench8     W1, W2 on Qwen3-8B with defaults and the overlap / CUDA Graph ablations
  hf06, hf8  Hugging Face transformers W2 peer (sdpa, dynamic cache) on the same dummy weights
  profile    torch.profiler diagnosis of a W1 slice on Qwen3-0.6B, and of batch-1/64 decode and one W2 request
  profile8   the batch-1/64 decode and W2-request profiles on Qwen3-8B
  flashinfer FlashInfer backend: kernel checks/timings vs Triton and torch, bf16 parity, W2 and W1 on Qwen3-0.6B
  w1_repeat  W1 on Qwen3-0.6B, twice per engine, default / no radix / no chunking, interleaved
  w2_8b      W2 on Qwen3-8B with defaults only
  sample06   W1, W1 with top-k/top-p and W2 on Qwen3-0.6B, defaults (one engine)
  sample8    the same on Qwen3-8B
  sweep06    the batch-mix sweep (64-1024 requests, prompts up to 4k, greedy and top-k/top-p) on Qwen3-0.6B
  sweep06_mr256  the same with max_running_requests=256 (the fixed default before it was sized from memory)
  large_decode06  decode steps of 256/512/1024 rows on Qwen3-0.6B: above the largest graph in graph-sized
             pieces (default), eagerly (--disable-cuda-graph-split), and with graphs up to 512; ms per step,
             engine start-up (graph capture) time and memory
  ab06       W2 then W1 on Qwen3-0.6B, defaults: run once with MINISGL_ROOT=<older package> for an A/B
  sampling_check, prefill_check   the GPU self-checks of the fused sampler and the prefill graphs
  tune_sampling  time the fused sampler's launch shapes (scripts/gpu_sampling_tune.py) and keep the pick for
             the sections after it in this process
  gdn_check  the Gated DeltaNet Triton kernels vs their references, timed (scripts/gpu_gdn_check.py --quick)
  decode_merge  decode attention, split merge fused into stage 1 vs a second launch: both checked against the
             reference and timed (batch 1-256, contexts 1k/8k), plus a CUDA-graph replay check of the counters
  merge_ab06 W2 on Qwen3-0.6B with the fused split merge and with the two-launch one
  decode_store  decode attention storing the step's K/V itself vs store_kv first: both checked (NaN-poisoned new
             slots, same buffers, the reference's output) and timed as CUDA-graph replays (batch 1-64, 1k/8k)
  store_ab06 W2 on Qwen3-0.6B with the decode K/V store fused into decode attention and with store_kv first
  pdl_check  programmatic dependent launch (kernels/pdl.py): a decode-like kernel chain captured with PDL on and
             off, outputs bitwise equal over fresh-input replays with NaN-poisoned new K/V slots, timed
             (scripts/gpu_pdl_check.py); then Qwen3-0.6B greedy and seeded-sampling tokens (batch 1 and 8, a few
             hundred decode steps) with PDL on, off, and on without CUDA graphs: all must equal PDL off's
  pdl_ab06   W2 on Qwen3-0.6B with PDL on / off / on without the GEMV's early weight load, interleaved twice
  pdl_ab8    W2 on Qwen3-8B with PDL on and off
  sweep_phases06  the 256-request 1-4k-prompt sweep mix on Qwen3-0.6B: greedy / top-k/top-p / greedy, then
             each with every step synchronised and timed (prefill vs decode time)
  mixed06, mixed06_long  one engine with MIXED_DECODE_SPLIT as the process has it (MINISGL_MIXED_DECODE_SPLIT):
             a mixed-step warm-up, W1, W1 top-k/top-p, and the sweep (mixed06_long: its 1-4k-prompt cells only)
  kernels_backends  the Triton backend against the torch backend on the GPU (mixed steps, graph replays)
  early_ab06 W2 on Qwen3-0.6B with 1, 3 and 2 GEMV weight tiles loaded before the PDL wait, and 3 with every
             projection on the GEMV (cuBLAS's too), interleaved twice
  early_ab8  the same on Qwen3-8B, 1 and 3 tiles, once
  wide_ab06, wide_ab8  the decode GEMV tuned again for the model's shapes with wide K tiles, then W2 with the
             repo's table / the tune's picks / every projection on the GEMV, interleaved twice (tables written
             under /tmp/lease-logs/gemv_tables for a later process's MINISGL_GEMV_CONFIGS)
  pdl_w1_06  W1 and W1 top-k/top-p on Qwen3-0.6B with PDL on and off (PDL must not cost throughput)
  qwen35     W2, W1, W3 on Qwen3.5-0.8B shapes (dummy bf16)
  qwen35_check  Qwen3.5 greedy tokens with CUDA Graph on and off, prefill graphs on and off, and a radix second
             pass (QWEN35_CHECK_DTYPES)
  w3_06      W3 on Qwen3-0.6B (the prefix-cache share to compare Qwen3.5's with)
  profile_small06  the batch-1/64 decode and W2-request profiles on Qwen3-0.6B (with MINISGL_ROOT: an A/B)
Each section's result (or its traceback) is written as soon as it ends, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch

# MINISGL_ROOT runs another copy of the package (e.g. an older commit's, for an A/B in the same lease)
sys.path.insert(0, os.environ.get("MINISGL_ROOT") or os.path.join(os.path.dirname(__file__), ".."))

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.bench.runner import environment, run_workload, write_json  # noqa: E402

CONFIGS = {"qwen3-0.6b": "assets/configs/qwen3-0.6b", "qwen3-8b": "assets/configs/qwen3-8b",
           "qwen3.5-0.8b": "assets/configs/qwen3.5-0.8b"}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def free_gpu():
    gc.collect()
    torch.cuda.empty_cache()


def ceilings() -> dict:
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    bw = 2 * n / statistics.median(times)
    del src, dst
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    free_gpu()
    return {"copy_bytes_per_s": bw, "bf16_matmul_flops": 2 * m ** 3 / statistics.median(times)}


def hf_model_like(llm_or_loaded, dtype):
    """A transformers model holding exactly our (dummy) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.loader import to_hf_state_dict
    model, cfg, path = llm_or_loaded
    hf_cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model, cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.generation_config.eos_token_id = None  # dummy weights: run every request to its length
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


PARITY_SWITCHES = (("default", {}), ("no_overlap", {"overlap": False}), ("no_cuda_graph", {"cuda_graph": False}))


def parity(dtypes=("float32", "bfloat16"), switches=PARITY_SWITCHES) -> dict:
    import random
    random.seed(7)
    prompts = [[random.randint(0, 150000) for _ in range(random.randint(16, 200))] for _ in range(8)]
    res = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        llm = None
        ref = None
        per_switch = {}
        for label, kw in switches:
            llm = LLM(CONFIGS["qwen3-0.6b"], load_format="dummy", dtype=dtype_name, max_model_len=4096,
                      kv_memory_fraction=0.3, **kw)
            if ref is None:  # the same seeded dummy weights in every engine: one HF reference per dtype
                r = llm.engine.runner
                hf = hf_model_like((r.model, r.model_config, r.model_path), dtype)
                ref = [hf_greedy(hf, p, 64) for p in prompts]
                del hf
                free_gpu()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            prefix = []
            for o, rf in zip(outs, ref):
                k = next((i for i, (a, b) in enumerate(zip(o.token_ids, rf)) if a != b), len(rf))
                prefix.append(k)
            per_switch[label] = {"exact": sum(p == 64 for p in prefix), "of": len(prompts),
                                 "tokens_before_first_divergence": prefix,
                                 "token_ids": [o.token_ids for o in outs],
                                 "graph_hit_rate": llm.engine.stats["graph_steps"] /
                                 max(llm.engine.stats["decode_steps"], 1)}
            log(dtype_name, label, {k: v for k, v in per_switch[label].items() if k != "token_ids"})
            llm = None
            free_gpu()
        first = next(iter(per_switch.values()))["token_ids"]
        for v in per_switch.values():  # the switches must not change the tokens
            v["same_tokens_as_first_switch"] = v.pop("token_ids") == first
        res[dtype_name] = per_switch
    return res


def kernels(*extra: str) -> dict:
    import subprocess
    path = "/tmp/kernel_check.json"
    rc = subprocess.run([sys.executable, "scripts/gpu_kernel_check.py", "--out", path, *extra]).returncode
    with open(path) as f:
        return {"returncode": rc, **json.load(f)}


def bench(model: str, runs: list[tuple[str, list[str], dict]]) -> dict:
    res = {}
    for label, workloads, kw in runs:
        t0 = time.perf_counter()
        llm = None
        try:
            llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16", **kw)
            startup = time.perf_counter() - t0
            res[label] = {"settings": kw, "startup_s": startup, "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens,
                          "sampler_launch": sampler_launch(),
                          "gemv_linears": getattr(llm.engine.runner, "gemv_linears", None)}
            for w in workloads:
                res[label][w] = run_workload(llm, w)
                log(model, label, w, {k: v for k, v in res[label][w].items() if not isinstance(v, (list, dict))})
        except Exception:
            res[label] = {"settings": kw, "error": traceback.format_exc()}
            log(model, label, "FAILED", res[label]["error"])
        llm = None
        free_gpu()
    return res


def sampler_launch() -> dict | None:
    """The fused sampler's launch shapes this process uses (older packages have none)."""
    try:
        from minisgl.kernels import sampling
        return dict(sampling.LAUNCH)
    except (ImportError, AttributeError):
        return None


def sweep(model: str, **kw) -> dict:
    from minisgl.bench.runner import run_sweep
    t0 = time.perf_counter()
    llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16", **kw)
    graphs = llm.engine.runner.graph_runner
    batch_sizes = list(graphs.batch_sizes) if graphs is not None else []
    graphs = None  # no reference may outlive the engine: free_gpu() below must get its memory back
    res = {"settings": kw, "startup_s": time.perf_counter() - t0,
           "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens,
           # the scheduler's: the resolved value where the config leaves it to the engine (0/None)
           "max_running_requests": llm.engine.scheduler.max_running,
           "cuda_graph_batch_sizes": batch_sizes, "sampler_launch": sampler_launch(), "cells": {}}
    from minisgl.bench.workloads import sweep_cells
    for cell in sweep_cells():
        res["cells"].update(run_sweep(llm, [cell]))
        r = res["cells"][cell.name]
        log("sweep", cell.name, round(r["output_tok_per_s"]),
            {k: v for k, v in r["engine"].items() if k != "cuda_graph_batch_sizes"})
    llm = None
    free_gpu()
    return res


def sweep_phases(model: str, requests: int = 256, prompt_lo: int = 1024) -> dict:
    """Where a long-prompt sweep cell's time goes (issue 10: 1-4k prompts, greedy, behind SGLang in run10 while
    top-k/top-p was not). The greedy and top-k/top-p cells of one mix run normally in the order greedy, top-k/top-p,
    greedy (an order effect shows as two different greedy figures); then each again with every step synchronised
    and timed, split into prefill (and mixed) steps and decode steps. Timing serialises the overlap loop, so those
    runs are slower than the cell's: they show the split, not the throughput."""
    from minisgl.bench.runner import flush_prefix_cache, run_throughput
    from minisgl.bench.workloads import sweep_cells, sweep_workload
    cells = {c.sampling: c for c in sweep_cells() if c.requests == requests and c.prompt_lo == prompt_lo}
    llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16")
    vocab = llm.engine.model_config.vocab_size
    res = {"cells": {c.sampling: c.name for c in cells.values()}, "runs": []}
    for sampling in ("greedy", "topkp", "greedy"):
        flush_prefix_cache(llm)
        r = run_throughput(llm, sweep_workload(cells[sampling], vocab))
        res["runs"].append({"sampling": sampling, **{k: v for k, v in r.items() if not isinstance(v, (list, dict))}})
        log("sweep_phases", sampling, round(r["output_tok_per_s"]))
    runner = llm.engine.runner
    forward = runner.forward
    for sampling in ("greedy", "topkp"):
        steps = []

        def timed(batch, _steps=steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = forward(batch)
            torch.cuda.synchronize()
            _steps.append((batch.is_decode, batch.size, batch.num_tokens,
                           sum(batch.prefix_lens) + batch.num_tokens, time.perf_counter() - t0))
            return out

        w = sweep_workload(cells[sampling], vocab)
        flush_prefix_cache(llm)
        runner.forward = timed  # the engine is warm from the runs above
        try:
            t0 = time.perf_counter()
            llm.generate(w.prompts, w.params, progress=False)
            wall = time.perf_counter() - t0
        finally:
            runner.forward = forward
        decode = [s for s in steps if s[0]]
        prefill = [s for s in steps if not s[0]]
        res[f"timed_{sampling}"] = {
            "wall_s": wall, "prefill_steps": len(prefill), "prefill_s": sum(s[4] for s in prefill),
            "prefill_tokens": sum(s[2] for s in prefill), "decode_steps": len(decode),
            "decode_s": sum(s[4] for s in decode), "decode_tokens": sum(s[2] for s in decode),
            # K/V tokens the decode steps attend over (each read once a layer per step)
            "decode_kv_tokens": sum(s[3] for s in decode),
            "steps": [[int(d), b, n, kv, round(dt * 1e3, 3)] for d, b, n, kv, dt in steps],
            "steps_columns": ["is_decode", "batch_size", "tokens", "kv_tokens", "ms"]}
        log("sweep_phases timed", sampling, {k: v for k, v in res[f"timed_{sampling}"].items()
                                             if not isinstance(v, list)})
    llm = None
    free_gpu()
    return res


def mixed_arm(model: str, full_sweep: bool) -> dict:
    """One engine with MIXED_DECODE_SPLIT as this process has it (MINISGL_MIXED_DECODE_SPLIT): the 64-request
    1-4k-prompt greedy cell once untimed first (it compiles the kernel variants of mixed steps), then W1, W1
    top-k/top-p and the sweep (every cell with full_sweep, else the two 1-4k-prompt mixes). One arm per process, so
    neither arm starts on memory the other left cached (run12's in-process A/B at 6caa2fa, split_ab06, did: its first
    engine got a smaller KV pool)."""
    from minisgl.attention import triton_backend
    from minisgl.bench.runner import run_sweep
    from minisgl.bench.workloads import sweep_cells
    free_gpu()
    cells = [c for c in sweep_cells() if full_sweep or c.prompt_lo == 1024]
    llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16")
    res = {"mixed_decode_split": triton_backend.MIXED_DECODE_SPLIT,
           "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens,
           "max_running_requests": llm.engine.scheduler.max_running,
           "warmup": run_sweep(llm, [c for c in cells if c.prompt_lo == 1024 and c.requests == 64][:1])}
    for w in ("w1", "w1_topkp"):
        res[w] = run_workload(llm, w)
        log("mixed_arm", w, round(res[w]["output_tok_per_s"]), res[w]["triton_compiles_timed"])
    res["sweep"] = {}
    for cell in cells:
        res["sweep"].update(run_sweep(llm, [cell]))
        r = res["sweep"][cell.name]
        log("mixed_arm", cell.name, round(r["output_tok_per_s"]), r["triton_compiles_timed"])
    llm = None
    free_gpu()
    return res


LARGE_DECODE_CONFIGS = (("pieces", {}), ("eager", {"cuda_graph_split": False}),
                        ("graphs512", {"cuda_graph_max_bs": 512}))


def large_decode(model: str, sizes=(256, 512, 1024), prompt_len: int = 512, out: int = 64) -> dict:
    """Decode steps above the largest captured graph: graph-sized pieces vs eager vs larger graphs. For each
    engine setting and batch size, `bs` requests of `prompt_len` random tokens are prefilled, then the steps
    in which all of them decode together are timed (greedy, then top-k/top-p)."""
    import random

    from minisgl.bench.runner import flush_prefix_cache, warm_up
    res = {}
    for label, kw in LARGE_DECODE_CONFIGS:
        free_gpu()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        llm = None
        try:
            llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16", **kw)
            engine = llm.engine
            graphs = engine.runner.graph_runner
            r = {"settings": kw, "startup_s": time.perf_counter() - t0,
                 "max_running_requests": engine.scheduler.max_running,
                 "cuda_graph_batch_sizes": list(graphs.batch_sizes) if graphs is not None else [],
                 "kv_pool_tokens": engine.runner.kv_capacity_tokens,
                 "reserved_after_start_bytes": torch.cuda.memory_reserved(),
                 "free_after_start_bytes": torch.cuda.mem_get_info()[0], "steps": {}}
            warm_up(llm)
            vocab = min(engine.model_config.vocab_size, 10000)
            for bs in sizes:
                if bs > engine.scheduler.max_running:
                    continue
                for sampling, skw in (("greedy", {"temperature": 0.0}),
                                      ("topkp", {"temperature": 0.8, "top_k": 50, "top_p": 0.95})):
                    flush_prefix_cache(llm)
                    rng = random.Random(bs)
                    params = SamplingParams(max_tokens=out, ignore_eos=True, **skw)
                    reqs = [engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
                            for _ in range(bs)]
                    while not all(q.output_ids for q in reqs):  # prefill (chunks mixed with early decodes)
                        engine.step()
                    torch.cuda.synchronize()
                    before = dict(engine.stats)
                    t1 = time.perf_counter()
                    engine.run(reqs)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t1
                    d = {k: engine.stats[k] - before[k] for k in ("steps", "decode_steps", "graph_steps",
                                                                   "graph_split_steps")}
                    r["steps"][f"bs{bs}_{sampling}"] = {
                        "ms_per_step": 1e3 * wall / max(d["steps"], 1), "wall_s": wall,
                        "out_tok_per_s": sum(len(q.output_ids) - 1 for q in reqs) / wall, **d}
                    log("large_decode", label, bs, sampling, round(r["steps"][f"bs{bs}_{sampling}"]["ms_per_step"], 3))
            r["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            res[label] = r
        except Exception:
            res[label] = {"settings": kw, "error": traceback.format_exc()}
            log("large_decode", label, "FAILED", res[label]["error"])
        llm = None
        free_gpu()
    return res


def script_main(name: str) -> dict:
    """Another script's self-check: scripts/NAME.py main(out_dir) -> dict."""
    import importlib
    sys.path.insert(0, os.path.dirname(__file__))
    return importlib.import_module(name).main("/tmp/" + name)


def hf_peer(model: str, n_requests: int = 2) -> dict:
    import random

    from minisgl.loader import load_model
    loaded = load_model(CONFIGS[model], torch.bfloat16, torch.device("cuda"), "dummy", 0)
    hf = hf_model_like((loaded.model, loaded.config, loaded.path), torch.bfloat16)
    del loaded
    free_gpu()
    random.seed(1)  # W2's prompts
    prompts = [[random.randint(0, 9999) for _ in range(512)] for _ in range(8)][:n_requests]
    hf_greedy(hf, prompts[0][:64], 4)  # warm-up
    ttfts, tpots = [], []
    for p in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_greedy(hf, p, 1)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_greedy(hf, p, 256)
        torch.cuda.synchronize()
        e2e = time.perf_counter() - t0
        ttfts.append(ttft)
        tpots.append((e2e - ttft) / 255)
    del hf
    free_gpu()
    return {"engine": "transformers generate, sdpa, dynamic cache", "requests": n_requests,
            "ttft_ms_median": 1e3 * statistics.median(ttfts), "tpot_ms_median": 1e3 * statistics.median(tpots)}


def w1_repeat() -> dict:
    """W1 twice per engine (first and second run), for default and the two switches W1 should not feel,
    then default and no-radix again: separates warm-up effects and run-to-run spread from real costs."""
    rows = []
    plan = [("default", {}), ("no_radix_cache", {"radix_cache": False}),
            ("no_chunked_prefill", {"chunked_prefill_size": 0}), ("default", {}),
            ("no_radix_cache", {"radix_cache": False})]
    for i, (label, kw) in enumerate(plan):
        llm = LLM(CONFIGS["qwen3-0.6b"], load_format="dummy", dtype="bfloat16", **kw)
        runs = [run_workload(llm, "w1") for _ in range(2 if i < 3 else 1)]
        rows.append({"label": label, "settings": kw, "order": i, "runs": runs})
        log("w1_repeat", label, [round(r["output_tok_per_s"]) for r in runs],
            [r["triton_compiles_timed"] for r in runs])
        llm = None
        free_gpu()
    return {"rows": rows}


def flashinfer_section() -> dict:
    """The FlashInfer backend: kernel checks and timings against Triton and torch, greedy parity in bf16
    next to the Triton backend, then W2 and W1 on Qwen3-0.6B."""
    fi = {"attention_backend": "flashinfer"}
    out = {"kernels": kernels("--backends-only", "triton,flashinfer")}
    out["parity"] = parity(("bfloat16",), (("triton", {}), ("flashinfer", fi),
                                           ("flashinfer_no_cuda_graph", {**fi, "cuda_graph": False})))
    out["bench"] = bench("qwen3-0.6b", [("flashinfer", ["w2", "w1"], fi)])
    return out


def profile_w1_slices(model: str, sizes=(1, 64, 256), steps: int = 20, top: int = 30) -> dict:
    """Decode steps at several batch sizes of W1's requests (kernels by kind and by name), then one W2 request's
    prefill (host launch time against kernel time): where a model's step time goes."""
    from minisgl.bench.profile import profile_request, profile_w1_slice
    from minisgl.bench.runner import warm_up
    from minisgl.bench.workloads import w2_latency
    llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16")
    warm_up(llm)
    out = {f"decode_bs{n}": profile_w1_slice(llm, num_requests=n, warm_steps=max(8, n // 8), steps=steps,
                                             keep_intervals=0, top=top) for n in sizes}
    # W2's prompts, each used once: a repeated prompt would be served from the radix cache
    prompts = w2_latency().prompts
    out["w2_request_unprofiled"] = [profile_request(llm, p, profiled=False) for p in prompts[:3]]
    out["w2_request"] = profile_request(llm, prompts[3])
    llm = None
    free_gpu()
    return out


def profile_small_batches(model: str) -> dict:
    """Decode at batch 1 and 64 (kernel time by kind: how much of a step is GEMMs), then one W2 request:
    the prefill's host launch time against its kernel time."""
    return profile_w1_slices(model, sizes=(1, 64), steps=30, top=12)


def profile() -> dict:
    from minisgl.bench.profile import profile_w1_slice
    out = {"small_batches": profile_small_batches("qwen3-0.6b")}
    for label, kw in (("default", {}), ("no_overlap", {"overlap": False}), ("no_cuda_graph", {"cuda_graph": False})):
        llm = LLM(CONFIGS["qwen3-0.6b"], load_format="dummy", dtype="bfloat16", **kw)
        # only the default run keeps its kernel intervals: the report draws one timeline
        out[label] = profile_w1_slice(llm, keep_intervals=3000 if label == "default" else 0)
        del llm
        free_gpu()
    return out


ABLATIONS_06 = [
    ("default", ["w1", "w2", "w3", "w4"], {}),
    ("no_overlap", ["w1", "w2"], {"overlap": False}),
    ("no_cuda_graph", ["w1", "w2"], {"cuda_graph": False}),
    ("no_radix_cache", ["w1", "w3"], {"radix_cache": False}),
    ("no_chunked_prefill", ["w1", "w4"], {"chunked_prefill_size": 0}),
]
ABLATIONS_8 = [
    ("default", ["w1", "w2"], {}),
    ("no_overlap", ["w1", "w2"], {"overlap": False}),
    ("no_cuda_graph", ["w2"], {"cuda_graph": False}),
]
SECTIONS = {
    "ceilings": ceilings, "parity": parity, "kernels": kernels,
    "bench06": lambda: bench("qwen3-0.6b", ABLATIONS_06),
    "bench8": lambda: bench("qwen3-8b", ABLATIONS_8),
    "quick06": lambda: bench("qwen3-0.6b", [("default", ["w2", "w1"], {})]),
    "w1_06": lambda: bench("qwen3-0.6b", [("default", ["w1"], {})]),
    "hf06": lambda: hf_peer("qwen3-0.6b"), "hf8": lambda: hf_peer("qwen3-8b"),
    "profile": profile,
    "flashinfer": flashinfer_section,
    "w1_repeat": w1_repeat,
    "w2_8b": lambda: bench("qwen3-8b", [("default", ["w2"], {})]),
    "profile8": lambda: profile_small_batches("qwen3-8b"),
    "sample06": lambda: bench("qwen3-0.6b", [("default", ["w1", "w1_topkp", "w2"], {})]),
    "sample8": lambda: bench("qwen3-8b", [("default", ["w1", "w1_topkp", "w2"], {})]),
    "sweep06": lambda: sweep("qwen3-0.6b"),
    "sweep06_mr256": lambda: sweep("qwen3-0.6b", max_running_requests=256),
    "large_decode06": lambda: large_decode("qwen3-0.6b"),
    "ab06": lambda: bench("qwen3-0.6b", [("default", ["w2", "w1"], {})]),
    "sampling_check": lambda: script_main("gpu_sampling_check"),
    "prefill_check": lambda: script_main("gpu_prefill_check"),
    "tune_sampling": lambda: tune_sampling(),
    "gdn_check": lambda: gdn_check(),
    "qwen35": lambda: bench("qwen3.5-0.8b", [("default", ["w2", "w1", "w3"], {})]),
    "w3_06": lambda: bench("qwen3-0.6b", [("default", ["w3"], {})]),
    "qwen35_check": lambda: qwen35_check(),
    "profile_small06": lambda: profile_small_batches("qwen3-0.6b"),
    "profile35": lambda: profile_w1_slices("qwen3.5-0.8b"),
    "kernels_ew": lambda: kernels("--elementwise-only"),
    # the decode GEMV (kernels/gemv.py) on and off at batch 1, per model
    "w2_06": lambda: bench("qwen3-0.6b", [("default", ["w2"], {})]),
    "w2_35": lambda: bench("qwen3.5-0.8b", [("default", ["w2"], {})]),
    "gemv_ab06": lambda: bench("qwen3-0.6b", [("no_gemv", ["w2"], {"gemv": False})]),
    "gemv_ab8": lambda: bench("qwen3-8b", [("default", ["w2"], {}), ("no_gemv", ["w2"], {"gemv": False})]),
    "gemv_ab35": lambda: bench("qwen3.5-0.8b", [("no_gemv", ["w2"], {"gemv": False})]),
    # decode attention's split merge in stage 1 vs a second launch: kernel check + timing, then W2 end to end
    "decode_merge": lambda: kernels("--decode-merge-only"),
    "merge_ab06": lambda: decode_merge_ab("qwen3-0.6b"),
    # decode's K/V store inside the decode attention kernel vs a store_kv launch first: kernel A/B, then W2
    "decode_store": lambda: kernels("--decode-store-only"),
    "store_ab06": lambda: decode_store_ab("qwen3-0.6b"),
    # programmatic dependent launch of the Triton kernels (kernels/pdl.py): correctness, then W2 on / off
    "pdl_check": lambda: pdl_check(),
    "pdl_ab06": lambda: pdl_ab("qwen3-0.6b", rounds=2, early_weights_ab=True),
    "pdl_ab8": lambda: pdl_ab("qwen3-8b", rounds=1),
    "sweep_phases06": lambda: sweep_phases("qwen3-0.6b"),
    "mixed06": lambda: mixed_arm("qwen3-0.6b", full_sweep=True),
    "mixed06_long": lambda: mixed_arm("qwen3-0.6b", full_sweep=False),
    "kernels_backends": lambda: kernels("--backends-only", "triton"),
    # how many GEMV weight tiles to load before the PDL wait; cuBLAS's projections on the GEMV too
    "early_ab06": lambda: early_tiles_ab("qwen3-0.6b"),
    "early_ab8": lambda: early_tiles_ab("qwen3-8b", tiles=(1, 3), rounds=1),
    "wide_ab06": lambda: wide_gemv_ab("qwen3-0.6b"),
    "wide_ab8": lambda: wide_gemv_ab("qwen3-8b"),
    "pdl_w1_06": lambda: bench("qwen3-0.6b", [("pdl", ["w1", "w1_topkp"], {}),
                                              ("no_pdl", ["w1", "w1_topkp"], {"pdl": False})]),
}


@contextlib.contextmanager
def module_flag(module, name: str, value):
    """Set a module-level kernel switch (e.g. kernels/attention.py DECODE_FUSED_MERGE) for one engine's life,
    then restore it: such switches are read when an engine compiles its kernels and captures its graphs."""
    default = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, default)


def w2_flag_ab(model: str, module, name: str, runs: tuple[tuple[str, object], ...]) -> dict:
    """W2 (batch-1 decode) once per (label, value) of the module-level switch `name`."""
    res = {}
    for label, value in runs:
        with module_flag(module, name, value):
            res.update(bench(model, [(label, ["w2"], {})]))
    return res


def decode_merge_ab(model: str) -> dict:
    """W2 with the decode split merge fused into stage 1 and as a second launch (the default); the switch is
    kernels/attention.py DECODE_FUSED_MERGE, read when the graphs are captured."""
    from minisgl.kernels import attention
    return w2_flag_ab(model, attention, "DECODE_FUSED_MERGE", (("fused_merge", True), ("two_launch_merge", False)))


def decode_store_ab(model: str) -> dict:
    """W2 with the decode K/V store fused into decode attention (the default) and as a store_kv launch first; the
    switch is kernels/attention.py DECODE_FUSED_STORE, read by the Triton backend at every decode forward, so each
    engine's graphs capture the path set when it starts."""
    from minisgl.kernels import attention
    return w2_flag_ab(model, attention, "DECODE_FUSED_STORE", (("fused_store", True), ("store_kv", False)))


def pdl_check() -> dict:
    """PDL's GPU checks: the kernel chain (scripts/gpu_pdl_check.py), then engine tokens with PDL on and off."""
    import subprocess
    path = "/tmp/gpu_pdl_check.json"
    rc = subprocess.run([sys.executable, "scripts/gpu_pdl_check.py", "--out", path]).returncode
    out = {"kernels_returncode": rc}
    try:
        with open(path) as f:
            out["kernels"] = json.load(f)
    except OSError as exc:
        out["kernels"] = {"error": repr(exc)}
    out["tokens"] = pdl_tokens("qwen3-0.6b")
    out["ok"] = rc == 0 and out["tokens"]["ok"]
    return out


def pdl_tokens(model: str, new_tokens: int = 300) -> dict:
    """Tokens of Qwen3-0.6B (dummy bf16) with PDL on (graphs), on without CUDA graphs, and off: batch 1 (two
    prompts, each alone: the GEMV path) and batch 8, greedy and seeded top-k/top-p sampling, `new_tokens` each.
    PDL changes no arithmetic, so every run must give PDL off's tokens exactly."""
    import random
    rng = random.Random(10)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(50, 400))] for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=new_tokens, ignore_eos=True,
                              seed=100 + i) for i in range(len(prompts))]
    runs = {}
    for label, kw in (("no_pdl", {"pdl": False}), ("pdl", {}), ("pdl_no_graph", {"cuda_graph": False})):
        llm = LLM(CONFIGS[model], load_format="dummy", dtype="bfloat16", max_model_len=4096, kv_memory_fraction=0.3,
                  **kw)
        from minisgl.kernels import pdl
        toks = {"bs1_greedy": [llm.generate([p], greedy, progress=False)[0].token_ids for p in prompts[:2]],
                "bs8_greedy": [o.token_ids for o in llm.generate(prompts, greedy, progress=False)],
                "bs8_sampled": [o.token_ids for o in llm.generate(prompts, sampled, progress=False)]}
        runs[label] = {"pdl_enabled": pdl.PDL_ENABLED,
                       "pdl_active": bool(pdl.pdl_launch(next(llm.engine.runner.model.parameters()))),
                       "graph_steps": llm.engine.stats["graph_steps"], "decode_steps": llm.engine.stats["decode_steps"],
                       "tokens": toks}
        llm = None
        free_gpu()
    ref = runs["no_pdl"]["tokens"]
    out = {}
    for label, r in runs.items():
        same = {k: [a == b for a, b in zip(v, ref[k])] for k, v in r["tokens"].items()}
        first_diff = {k: [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                          for a, b in zip(v, ref[k])] for k, v in r["tokens"].items()}
        out[label] = {**{k: v for k, v in r.items() if k != "tokens"}, "same_as_no_pdl": same,
                      "first_divergence": first_diff}
        log("pdl_tokens", label, {k: v for k, v in out[label].items() if k != "first_divergence"})
    out["ok"] = (all(all(all(v) for v in o["same_as_no_pdl"].values()) for o in out.values())
                 and out["pdl"]["pdl_active"] and not out["no_pdl"]["pdl_enabled"])
    return out


def pdl_ab(model: str, rounds: int = 1, early_weights_ab: bool = False) -> dict:
    """W2 (batch-1 decode) with PDL on (the default) and off (`pdl=False`), interleaved `rounds` times; with
    early_weights_ab also PDL on with the GEMV's early weight load off (kernels/gemv.py PDL_EARLY_TILES = 0,
    module-level, read at every launch, so each engine's graphs capture the value set when it starts)."""
    from minisgl.kernels import gemv
    res = {}
    for r in range(rounds):
        runs = [("pdl", {}, gemv.PDL_EARLY_TILES), ("no_pdl", {"pdl": False}, gemv.PDL_EARLY_TILES)]
        if early_weights_ab:
            runs.append(("pdl_no_early_weights", {}, 0))
        for label, kw, early in runs:
            with module_flag(gemv, "PDL_EARLY_TILES", early):
                res.update(bench(model, [(f"{label}_{r}" if rounds > 1 else label, ["w2"], kw)]))
    return res


@contextlib.contextmanager
def gemv_shapes(configs: dict):
    """The card's tuned GEMV table with some shapes' entries replaced ((N, K) -> (BLOCK_N, BLOCK_K, warps, rows)),
    for one engine's life: e.g. a projection the table gives to cuBLAS taken by the GEMV instead."""
    from minisgl.kernels import gemv
    if not gemv.GEMV_CONFIGS:
        gemv.load_device_table(torch.cuda.get_device_name())
    saved = {shape: gemv.GEMV_CONFIGS.get(shape, "absent") for shape in configs}
    gemv.GEMV_CONFIGS.update(configs)
    try:
        yield
    finally:
        for shape, value in saved.items():
            if value == "absent":
                gemv.GEMV_CONFIGS.pop(shape, None)
            else:
                gemv.GEMV_CONFIGS[shape] = value


# cuBLAS's projections at batch 1 taken by the GEMV (4 or 8 output rows a program, 1024-wide K tiles, one row)
GEMV_ALL = {"qwen3-0.6b": {(6144, 1024): (4, 1024, 4, 1)},
            "qwen3-8b": {(6144, 4096): (4, 1024, 4, 1), (24576, 4096): (8, 1024, 4, 1),
                         (4096, 12288): (4, 1024, 4, 1)}}


def early_tiles_ab(model: str, tiles=(1, 3, 2), rounds: int = 2, all_gemv: bool = True) -> dict:
    """W2 (batch-1 decode, PDL on) with the GEMV loading 1, 3 or 2 weight tiles before its wait
    (kernels/gemv.py PDL_EARLY_TILES), interleaved `rounds` times; with all_gemv also the most tiles with the
    projections the tuned table leaves to cuBLAS on the GEMV too (GEMV_ALL)."""
    from minisgl.kernels import gemv
    res = {}
    for r in range(rounds):
        for n in tiles:
            with module_flag(gemv, "PDL_EARLY_TILES", n):
                res.update(bench(model, [(f"early{n}_{r}", ["w2"], {})]))
        if all_gemv:
            with module_flag(gemv, "PDL_EARLY_TILES", max(tiles)), gemv_shapes(GEMV_ALL[model]):
                res.update(bench(model, [(f"early{max(tiles)}_all_gemv_{r}", ["w2"], {})]))
    return res


# where wide_gemv_ab writes its GEMV tables (whole tables, for MINISGL_GEMV_CONFIGS in a later process)
GEMV_TABLES_DIR = "/tmp/lease-logs/gemv_tables"


def wide_gemv_ab(model: str, rounds: int = 2) -> dict:
    """The GEMV tuned again for `model`'s weight shapes with the wide K tiles (scripts/gpu_gemv_tune.py --wide),
    then W2 (batch-1 decode) with three tables, interleaved `rounds` times: `default` (the card's table in the
    repo), `wide` (the repo's table with this tune's picks where the GEMV beat cuBLAS standalone) and `all_gemv`
    (every projection of the model on the GEMV with the tune's best tile, at least at one row: in a step with PDL
    the GEMV streams weights while its predecessor ends, which a standalone time does not show). Each whole table
    is written to GEMV_TABLES_DIR/<model>_<label>.json."""
    import tempfile

    sys.path.insert(0, os.path.dirname(__file__))
    import gpu_gemv_tune

    from minisgl.kernels import gemv

    saved = dict(gemv.GEMV_CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        tune = gpu_gemv_tune.main(tmp, models=(model,), wide=True)
    gemv.GEMV_CONFIGS.clear()
    gemv.GEMV_CONFIGS.update(saved)
    if not gemv.GEMV_CONFIGS:
        gemv.load_device_table(torch.cuda.get_device_name())
    repo = {f"{n},{k}": (list(v[:4]) if v is not None else None) for (n, k), v in gemv.GEMV_CONFIGS.items()}
    wide = dict(repo, **{shape: pick for shape, pick in tune["picks"].items() if pick is not None})
    all_gemv = dict(repo, **{f"{r['n']},{r['k']}": [*r["best"], max(1, (tune["picks"][f"{r['n']},{r['k']}"]
                                                                        or [0, 0, 0, 1])[3])]
                             for r in tune["shapes"]})
    tables = {"default": repo}
    for label, table in (("wide", wide), ("all_gemv", all_gemv)):
        if table not in tables.values():  # an arm the same as an earlier one would only repeat it
            tables[label] = table
    os.makedirs(GEMV_TABLES_DIR, exist_ok=True)
    for label, table in tables.items():
        with open(os.path.join(GEMV_TABLES_DIR, f"{model}_{label}.json"), "w") as f:
            json.dump(table, f, indent=1)
    runs = {}
    for r in range(rounds):
        for label, table in tables.items():
            overrides = {tuple(map(int, shape.split(","))): (tuple(v) if v is not None else None)
                         for shape, v in table.items()}
            with gemv_shapes(overrides):
                runs.update(bench(model, [(f"{label}_{r}", ["w2"], {})]))
    return {"tune": tune, "tables": tables, "runs": runs}


def qwen35_check() -> dict:
    """Qwen3.5 on the GPU, greedy: CUDA Graph on and off, and prefill graphs on and off, give the same tokens (fp32
    and bf16), and a second pass over the same prompts (radix hits restored from state snapshots) gives them
    again. Some prompts share a prefix (a branch point the prefix cache snapshots on the first pass)."""
    import random
    rng = random.Random(35)
    prompts = [[rng.randint(0, 9999) for _ in range(rng.randint(100, 300))] for _ in range(6)]
    prompts += [prompts[0][:160] + [rng.randint(0, 9999) for _ in range(rng.randint(20, 80))] for _ in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = {}
    for dtype in os.environ.get("QWEN35_CHECK_DTYPES", "float32,bfloat16").split(","):
        runs = {}
        for label, kw in (("graph", {}), ("no_graph", {"cuda_graph": False}),
                          ("no_prefill_graph", {"prefill_graph_max_tokens": 0})):
            llm = LLM(CONFIGS["qwen3.5-0.8b"], load_format="dummy", dtype=dtype, **kw)
            pg = llm.engine.runner.prefill_graph
            replays = pg.replays if pg is not None else 0
            first = [o.token_ids for o in llm.generate(prompts, sp, progress=False)]
            second = llm.generate(prompts, sp, progress=False)
            runs[label] = {"tokens": first, "second_pass_same": [o.token_ids for o in second] == first,
                           "second_pass_cached_tokens": sum(o.num_cached_prompt_tokens for o in second),
                           "graph_steps": llm.engine.stats["graph_steps"], "steps": llm.engine.stats["steps"],
                           "prefill_graphs": len(pg.graphs) if pg is not None else 0,
                           "prefill_graph_steps": (pg.replays - replays) if pg is not None else 0,
                           "state_snapshots": llm.engine.runner.state_pool.num_snapshots}
            llm = None
            free_gpu()
        ref, no_pg = runs["graph"]["tokens"], runs["no_prefill_graph"]["tokens"]
        out[dtype] = {"graph_equals_no_graph": ref == runs["no_graph"]["tokens"],
                      "graph_equals_no_prefill_graph": ref == no_pg,
                      "prompts_equal_no_prefill_graph": sum(a == b for a, b in zip(ref, no_pg)),
                      **{k: {x: y for x, y in v.items() if x != "tokens"} for k, v in runs.items()}}
        log("qwen35_check", dtype, out[dtype])
    return out


def gdn_check() -> dict:
    """The Gated DeltaNet kernels against their torch references at Qwen3.5-0.8B shapes, timed."""
    import subprocess
    path = "/tmp/gdn_check.json"
    rc = subprocess.run([sys.executable, "scripts/gpu_gdn_check.py", "--out", path, "--quick"]).returncode
    with open(path) as f:
        return {"returncode": rc, **json.load(f)}


def tune_sampling() -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    import gpu_sampling_tune
    return gpu_sampling_tune.main("/tmp/gpu_sampling_tune", apply=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", required=True)
    ap.add_argument("--file", default="results.json", help="JSON file name under --out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    data = {"environment": environment(), "sections": {}}
    path = os.path.join(a.out, a.file)
    for name in a.sections.split(","):
        log("section", name)
        t0 = time.perf_counter()
        try:
            data["sections"][name] = {"result": SECTIONS[name]()}
        except Exception:
            data["sections"][name] = {"error": traceback.format_exc()}
            log(name, "FAILED\n", data["sections"][name]["error"])
        data["sections"][name]["seconds"] = time.perf_counter() - t0
        write_json(path, data)
    log("done", {k: round(v["seconds"], 1) for k, v in data["sections"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
