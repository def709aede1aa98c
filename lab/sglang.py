"""SGLang on the same card, dummy weights and the very same requests as minisgl (minisgl.bench.workloads).

Runs under the SGLang kit's wheels (shared/sglang-kit, copied into .sglang-kit/); lab.lease starts it, e.g.

    python -m lab.lease sglang --model qwen3-0.6b --sections w1,w1_topkp,w2,w3,w4,sweep --out $OUT/sglang_06.json

Writes the layout of lab.run ({"environment", "sections": {name: {"result" | "error"}}}), each section as soon as
it ends, named `sglang_<workload>_<model tag>` (`sglang_w1_06`), so a report finds both engines of one lease by
name. SGLang runs as in shared/anchors.md: Triton attention, torch sampling, random seed 0, all else default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
import traceback

from lab.models import MODELS, model
from minisgl.bench.runner import environment
from minisgl.bench.workloads import MIXES, WORKLOADS, mix_workload, sweep_cells, sweep_workload

SECTIONS = ("w1", "w1_topkp", "w2", "w3", "w4", "sweep", "mixes")


def sampling_dict(p) -> dict:
    """minisgl SamplingParams -> SGLang's sampling_params dict (top-k off is -1 there)."""
    top_k = p.top_k if isinstance(p.top_k, int) and p.top_k > 0 else -1
    d = {"max_new_tokens": p.max_tokens, "ignore_eos": p.ignore_eos, "temperature": p.temperature,
         "top_p": p.top_p, "top_k": top_k}
    if getattr(p, "min_p", 0.0):
        d["min_p"] = p.min_p
    return d


def warm_up(llm) -> None:
    ids = [[(7 * i + j) % 10000 for j in range(n)] for i, n in enumerate((64, 200, 513))]
    sps = [{"max_new_tokens": 16, "ignore_eos": True, "temperature": t, "top_k": k, "top_p": p}
           for t, k, p in ((0.0, -1, 1.0), (0.6, -1, 1.0), (0.6, 50, 0.95))]
    llm.generate(input_ids=ids, sampling_params=sps)


def throughput(llm, w) -> dict:
    """All requests at once from an empty prefix cache: output tokens per second of wall time."""
    llm.flush_cache()
    warm_up(llm)
    t0 = time.perf_counter()
    outs = llm.generate(input_ids=w.prompts, sampling_params=[sampling_dict(p) for p in w.params])
    wall = time.perf_counter() - t0
    cached = sum(o.get("meta_info", {}).get("cached_tokens", 0) or 0 for o in outs)
    prompt_tokens = sum(map(len, w.prompts))
    return {"requests": len(w.prompts), "prompt_tokens": prompt_tokens,
            "output_tokens": sum(len(o["output_ids"]) for o in outs),
            "expected_output_tokens": w.total_output_tokens, "wall_s": wall,
            "output_tok_per_s": w.total_output_tokens / wall, "cached_prompt_tokens": cached,
            "cached_prompt_share": cached / prompt_tokens}


def latency(llm, w) -> dict:
    """Concurrency 1, streamed: TTFT = first chunk, TPOT = (end-to-end - TTFT) / (outputs - 1)."""
    warm_up(llm)
    ttfts, tpots = [], []
    for prompt, p in zip(w.prompts, w.params):
        t0, first = time.perf_counter(), None
        for _ in llm.generate(input_ids=prompt, sampling_params=sampling_dict(p), stream=True):
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - t0)
        tpots.append((end - first) / (p.max_tokens - 1))
    return {"requests": len(w.prompts), "ttft_ms_median": 1e3 * statistics.median(ttfts),
            "tpot_ms_median": 1e3 * statistics.median(tpots), "ttft_ms": [1e3 * x for x in ttfts],
            "tpot_ms": [1e3 * x for x in tpots]}


def interference(llm, w) -> dict:
    """W4 as minisgl.bench.runner measures it: the short requests decode, then the long prompts arrive; the
    decoders' worst gap between two streamed chunks from the arrival on, and the long prompts' first tokens."""
    warm_up(llm)
    llm.flush_cache()

    async def one(prompt, params, times: list, started: list | None = None):
        gen = await llm.async_generate(input_ids=prompt, sampling_params=sampling_dict(params), stream=True)
        async for _ in gen:
            times.append(time.perf_counter())
            if started is not None and len(times) == 1:
                started.append(1)

    async def run() -> dict:
        times: list[list[float]] = [[] for _ in w.prompts]
        started: list = []
        tasks = [asyncio.create_task(one(p, sp, times[i], started)) for i, (p, sp) in enumerate(zip(w.prompts,
                                                                                                    w.params))]
        t0 = time.perf_counter()
        while len(started) < len(w.prompts) and time.perf_counter() - t0 < 120:
            await asyncio.sleep(0.005)
        t_arrive = time.perf_counter()
        late: list[list[float]] = [[] for _ in w.late_prompts]
        tasks += [asyncio.create_task(one(p, sp, late[i])) for i, (p, sp) in enumerate(zip(w.late_prompts,
                                                                                           w.late_params))]
        await asyncio.gather(*tasks)
        gaps = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b >= t_arrive - 1.0]
        return {"short_requests": len(w.prompts), "long_requests": len(w.late_prompts),
                "long_prompt_tokens": len(w.late_prompts[0]),
                "worst_decode_gap_ms": 1e3 * max(gaps) if gaps else None,
                "median_decode_gap_ms": 1e3 * statistics.median(gaps) if gaps else None,
                "long_ttft_ms": [1e3 * (ts[0] - t_arrive) for ts in late if ts]}

    return asyncio.get_event_loop().run_until_complete(run())


def server_info(llm) -> dict:
    """What SGLang resolved at start-up that bounds a batch (running requests, token and state pools), as far as
    its get_server_info tells (its keys differ between versions: anything naming them, else the error)."""
    words = ("max_running_requests", "max_total_num_tokens", "mamba", "max_req")
    try:
        info = llm.get_server_info()
        found = {}
        for part in [info, *info.get("internal_states", [])]:
            found.update({k: v for k, v in part.items() if any(w in k for w in words) and not isinstance(v, dict)})
        return found
    except Exception as e:
        return {"error": repr(e)}


def run_section(llm, name: str) -> dict:
    if name == "sweep":
        out = {}
        for cell in sweep_cells():
            out[cell.name] = {"cell": vars(cell), **throughput(llm, sweep_workload(cell))}
            print(cell.name, round(out[cell.name]["output_tok_per_s"]), flush=True)
        return out
    if name == "mixes":  # issue 29's mixes, as lab.sections.mixes runs them on minisgl
        out = {"server_info": server_info(llm)}
        for mix, cell in MIXES.items():
            out[mix] = {"cell": {"name": cell.name, **vars(cell)}, **throughput(llm, mix_workload(mix))}
            print(mix, round(out[mix]["output_tok_per_s"]), flush=True)
        return out
    w = WORKLOADS[name]()
    return {"w2": latency, "w4": interference}.get(name, throughput)(llm, w)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    ap.add_argument("--sections", default="w1,w1_topkp,w2", help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="{}", help="more sglang.Engine keyword arguments, as JSON")
    args = ap.parse_args(argv)
    names = args.sections.split(",")
    if set(names) - set(SECTIONS):
        raise SystemExit(f"unknown sections {sorted(set(names) - set(SECTIONS))}")
    m = model(args.model)
    data = {"environment": environment(), "engine": "sglang", "model": args.model,
            "command": f"python -m lab.sglang --model {args.model} --sections {args.sections}", "sections": {}}
    if os.path.exists(args.out):  # a second call adds to the file
        data = json.load(open(args.out))
        data.setdefault("sections", {})

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)

    import sglang
    from sglang.srt.entrypoints.engine import Engine

    kw = dict(model_path=m.path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend="triton", sampling_backend="pytorch", grammar_backend="none", random_seed=0,
              log_level="warning", **m.sglang_extra, **json.loads(args.extra))
    t0 = time.perf_counter()
    llm = Engine(**kw)
    sa = llm.server_args
    data.setdefault("sglang", {})[args.model] = {
        "version": sglang.__version__, "engine_start_s": time.perf_counter() - t0, "kwargs": kw,
        "server_args": {k: str(getattr(sa, k, None)) for k in (
            "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs", "mem_fraction_static",
            "page_size", "disable_radix_cache", "disable_overlap_schedule", "schedule_policy")}}
    save()
    for name in names:
        key = f"sglang_{name}_{m.tag}"
        t = time.perf_counter()
        print(f"== {key}", flush=True)
        try:
            result = run_section(llm, name)
            data["sections"][key] = {"result": result, "wall_s": time.perf_counter() - t}
            print(key, json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}), flush=True)
        except Exception:
            data["sections"][key] = {"error": traceback.format_exc(), "wall_s": time.perf_counter() - t}
            print(traceback.format_exc(), flush=True)
        save()
    llm.shutdown()


if __name__ == "__main__":
    main()
