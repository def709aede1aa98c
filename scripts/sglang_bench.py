"""SGLang on the same card, same dummy weights and the very same requests as minisgl (minisgl.bench.workloads).

Run on the GPU machine through scripts/sglang_env.sh (it installs the carried SGLang wheels first):

    bash scripts/sglang_env.sh WHEEL_DIR... -- scripts/sglang_bench.py --model qwen3-0.6b \
        --sections w1,w1_topkp,w2,sweep --out F

Writes the same layout as scripts/h200_run.py ({"environment", "sections": {name: {"result" | "error"}}}), each
section as soon as it ends, with section names prefixed `sglang_` and suffixed by the model (`sglang_w1_06`), so
the report puts both engines of one lease side by side. SGLang is run as in shared/anchors.md: Triton attention,
torch sampling, random seed 0, everything else at its defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minisgl.bench.runner import environment  # noqa: E402
from minisgl.bench.workloads import WORKLOADS, sweep_cells, sweep_workload  # noqa: E402

CONFIGS = {"qwen3-0.6b": ("assets/configs/qwen3-0.6b", "06"), "qwen3-8b": ("assets/configs/qwen3-8b", "8"),
           "qwen3.5-0.8b": ("assets/configs/qwen3.5-0.8b", "35")}
# Qwen3.5 is a multimodal checkpoint: SGLang runs its text part only, as in shared/anchors.md
MODEL_EXTRA = {"qwen3.5-0.8b": {"enable_multimodal": False}}


def sampling_dict(p) -> dict:
    """minisgl SamplingParams -> SGLang's sampling_params dict."""
    d = {"max_new_tokens": p.max_tokens, "ignore_eos": p.ignore_eos, "temperature": p.temperature,
         "top_p": p.top_p, "top_k": p.top_k if p.top_k > 0 else -1}
    if getattr(p, "min_p", 0.0):
        d["min_p"] = p.min_p
    return d


def warm_up(llm) -> None:
    ids = [[(7 * i + j) % 10000 for j in range(n)] for i, n in enumerate((64, 200, 513))]
    sps = [{"max_new_tokens": 16, "ignore_eos": True, "temperature": t, "top_k": k, "top_p": p}
           for t, k, p in ((0.0, -1, 1.0), (0.6, -1, 1.0), (0.6, 50, 0.95))]
    llm.generate(input_ids=ids, sampling_params=sps)


def throughput(llm, w) -> dict:
    llm.flush_cache()
    warm_up(llm)
    t0 = time.perf_counter()
    outs = llm.generate(input_ids=w.prompts, sampling_params=[sampling_dict(p) for p in w.params])
    wall = time.perf_counter() - t0
    produced = sum(len(o["output_ids"]) for o in outs)
    cached = sum(o.get("meta_info", {}).get("cached_tokens", 0) or 0 for o in outs)
    prompt_tokens = sum(map(len, w.prompts))
    return {"requests": len(w.prompts), "prompt_tokens": prompt_tokens, "output_tokens": produced,
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(CONFIGS))
    ap.add_argument("--sections", default="w1,w1_topkp,w2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--extra", default="{}", help="more sglang.Engine keyword arguments, as JSON")
    args = ap.parse_args()
    path, tag = CONFIGS[args.model]
    data = {"environment": environment(), "engine": "sglang", "model": args.model, "sections": {}}
    if os.path.exists(args.out):
        data = json.load(open(args.out))
        data["sections"] = data.get("sections", {})

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, default=str)

    import sglang
    from sglang.srt.entrypoints.engine import Engine

    kw = dict(model_path=os.path.abspath(path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              attention_backend="triton", sampling_backend="pytorch", grammar_backend="none", random_seed=0,
              log_level="warning", **MODEL_EXTRA.get(args.model, {}), **json.loads(args.extra))
    t0 = time.perf_counter()
    llm = Engine(**kw)
    sa = llm.server_args
    data.setdefault("sglang", {})[args.model] = {
        "version": sglang.__version__, "engine_start_s": time.perf_counter() - t0, "kwargs": kw,
        "server_args": {k: str(getattr(sa, k, None)) for k in (
            "max_running_requests", "chunked_prefill_size", "cuda_graph_max_bs", "mem_fraction_static",
            "page_size", "disable_radix_cache", "disable_overlap_schedule", "schedule_policy")}}
    save()
    for name in args.sections.split(","):
        key = f"sglang_{name}_{tag}"
        t = time.perf_counter()
        print(f"== {key}", flush=True)
        try:
            if name == "sweep":
                result = {}
                for cell in sweep_cells():
                    result[cell.name] = {"cell": vars(cell), **throughput(llm, sweep_workload(cell))}
                    print(cell.name, round(result[cell.name]["output_tok_per_s"]), flush=True)
            elif name == "w2":
                result = latency(llm, WORKLOADS["w2"]())
            else:
                result = throughput(llm, WORKLOADS[name]())
            data["sections"][key] = {"result": result, "wall_s": time.perf_counter() - t}
            print(key, json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}), flush=True)
        except Exception:
            data["sections"][key] = {"error": traceback.format_exc(), "wall_s": time.perf_counter() - t}
            print(traceback.format_exc(), flush=True)
        save()
    llm.shutdown()


if __name__ == "__main__":
    main()
