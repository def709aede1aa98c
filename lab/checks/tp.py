"""Tensor parallelism on a multi-GPU machine (written for nvidia-h200-x2): parity, then time, as JSON.

    python -m lab.checks.tp --out $OUT/tp.json [--quick]

Sections, each written to the JSON as soon as it ends (a timeout keeps what finished):
  allreduce  NCCL all-reduce of one layer's activations [tokens, hidden] bf16 between 2 GPUs, eager and
             replayed from a CUDA Graph, against the NVLink arithmetic
  parity     Qwen3-0.6B shapes, dummy weights, fp32: TP=2 greedy tokens == TP=1 (CUDA Graph, overlap, radix and
             chunking on); bf16 agreement is reported, not required (sums in another order round differently)
  bench      Qwen3-8B dummy weights bf16: W2 (TPOT at concurrency 1) and W1 (throughput), TP=1 then TP=2;
             the ratios the issue asks for (TPOT TP=2 <= 0.6x TP=1). SGLang tp_size=2 is run separately.
Exits 1 if the parity check fails. NCCL_NVLS_ENABLE=0 (NVLink multicast off) in every rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

os.environ["NCCL_NVLS_ENABLE"] = "0"

import torch

from lab.models import model_path
from minisgl import LLM, SamplingParams
from minisgl.bench.runner import environment, run_workload, write_json


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --- all-reduce micro-benchmark --------------------------------------------------------------------------
def _allreduce_rank(rank: int, world: int, port: int, sizes: list[int], hidden: int, out) -> None:
    import torch.distributed as dist
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    for n in sizes:
        x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 200
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        eager = (time.perf_counter() - t0) / iters
        # captured: what a decode step inside a CUDA Graph pays (no launch overhead)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                dist.all_reduce(x)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        graphed = (time.perf_counter() - t0) / 400
        nbytes = x.numel() * x.element_size()
        res[n] = {"bytes": nbytes, "eager_us": 1e6 * eager, "graph_us": 1e6 * graphed,
                  "bus_GBps_graph": 2 * (world - 1) / world * nbytes / graphed / 1e9}
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def allreduce(world: int = 2, hidden: int = 4096, sizes=(1, 8, 64, 256, 1024, 8192)) -> dict:
    import socket
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, list(sizes), hidden, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(60)
    # Qwen3-8B: 36 layers x 2 all-reduces of [tokens, 4096] bf16 per step
    per_step_bs1 = 72 * res[1]["graph_us"]
    return {"hidden": hidden, "world": world, "by_tokens": res,
            "qwen3_8b_decode_bs1_allreduce_us_per_step": per_step_bs1}


# --- parity ----------------------------------------------------------------------------------------------
def _prompts(n: int, vocab: int = 10000) -> list[list[int]]:
    import random
    rng = random.Random(4)
    shared = [rng.randrange(vocab) for _ in range(300)]
    return [([*shared] if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(20, 400))]
            for i in range(n)]


def _greedy(tp: int, dtype: str, prompts, max_tokens: int) -> list[list[int]]:
    llm = LLM(model_path("qwen3-0.6b"), load_format="dummy", dtype=dtype, tp_size=tp, chunked_prefill_size=256,
              kv_memory_fraction=0.3)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        graph_steps = llm.engine.stats["graph_steps"]
    finally:
        llm.close()
        del llm
        _free()
    assert graph_steps > 0, "no decode step ran through a CUDA Graph"
    return [o.token_ids for o in outs]


def parity(n: int = 8, max_tokens: int = 32) -> dict:
    prompts = _prompts(n)
    res = {}
    for dtype in ("float32", "bfloat16"):
        one, two = _greedy(1, dtype, prompts, max_tokens), _greedy(2, dtype, prompts, max_tokens)
        same = sum(a == b for a, b in zip(one, two))
        agree = sum(x == y for a, b in zip(one, two) for x, y in zip(a, b)) / sum(len(a) for a in one)
        res[dtype] = {"requests_identical": same, "requests": n, "token_agreement": agree}
        log("parity", dtype, res[dtype])
    res["ok"] = res["float32"]["requests_identical"] == n
    return res


# --- timing ----------------------------------------------------------------------------------------------
def bench(model: str = "qwen3-8b", workloads=("w2", "w1"), tps=(1, 2), scale: float = 1.0) -> dict:
    res = {}
    for tp in tps:
        t0 = time.perf_counter()
        llm = None
        try:
            llm = LLM(model_path(model), load_format="dummy", dtype="bfloat16", tp_size=tp)
            r = {"startup_s": time.perf_counter() - t0, "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens}
            for w in workloads:
                r[w] = run_workload(llm, w, scale=scale)
                log(model, f"tp{tp}", w, {k: v for k, v in r[w].items() if not isinstance(v, (list, dict))})
            res[f"tp{tp}"] = r
        except Exception:
            res[f"tp{tp}"] = {"error": traceback.format_exc()}
            log(model, f"tp{tp}", "FAILED", res[f"tp{tp}"]["error"])
        finally:
            if llm is not None:
                llm.close()
            llm = None
            _free()
    one, two = res.get("tp1", {}), res.get("tp2", {})
    if "w2" in one and "w2" in two:
        res["tpot_ratio_tp2_over_tp1"] = two["w2"]["tpot_ms_median"] / one["w2"]["tpot_ms_median"]
        res["tpot_target_met"] = res["tpot_ratio_tp2_over_tp1"] <= 0.6
    if "w1" in one and "w1" in two:
        res["w1_throughput_ratio_tp2_over_tp1"] = two["w1"]["output_tok_per_s"] / one["w1"]["output_tok_per_s"]
    return res


SECTIONS = {"allreduce": allreduce, "parity": parity, "bench": bench}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tp_check.json")
    ap.add_argument("--sections", default="allreduce,parity,bench")
    ap.add_argument("--quick", action="store_true", help="W2 at scale 0.25 and W1 at scale 0.1")
    a = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(json.dumps({"error": f"needs 2 GPUs, {torch.cuda.device_count()} visible"}))
        return 2
    data = {"environment": environment(), "gpus": torch.cuda.device_count(), "sections": {}}
    ok = True
    for name in a.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "bench" and a.quick:
                result = {"w2": bench(workloads=("w2",), scale=0.25), "w1": bench(workloads=("w1",), scale=0.1)}
            else:
                result = SECTIONS[name]()
            data["sections"][name] = {"result": result, "seconds": time.perf_counter() - t0}
            if name == "parity":
                ok &= bool(result["ok"])
        except Exception:
            data["sections"][name] = {"error": traceback.format_exc(), "seconds": time.perf_counter() - t0}
            ok = False
            log(name, "FAILED", data["sections"][name]["error"])
        write_json(a.out, data)
    print(json.dumps({k: v.get("result", v) for k, v in data["sections"].items()}, default=str)[:4000])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
