#!/usr/bin/env python
"""Measure SGLang on this GPU with the course's workloads; write autograder/baselines/<gpu>.json.

    pip install sglang            # on the GPU machine, in the same environment as minisgl
    python autograder/measure_sglang.py                    # W1 + W2, default settings (what the bars need)
    python autograder/measure_sglang.py --ablations        # plus each switch off, like the shipped H200 file

The numbers come out in the schema of `autograder/baselines/nvidia-h200.json`, so the GPU graders
(`autograder/graders/test_performance.py`) and notebook 09 read a measured file and the shipped one alike.
How we measure, the same as for minisgl (minisgl/bench/runner.py): dummy bf16 weights at the real Qwen3-0.6B
config (`assets/configs/qwen3-0.6b`), the Triton attention backend, no tokenizer;
W1 = all 256 requests at once, output tokens / wall time; W2 = 8 requests one after another, streamed:
TTFT = first chunk, TPOT = (end-to-end - TTFT) / (outputs - 1), medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "autograder"))

import report  # noqa: E402

MODEL = "qwen3-0.6b"
# configuration -> SGLang Engine keyword arguments (on top of the common ones)
CONFIGS = {
    "default": {},
    "no_overlap": {"disable_overlap_schedule": True},
    "no_cuda_graph": {"disable_cuda_graph": True},
    "no_radix_cache": {"disable_radix_cache": True},
    "no_chunked_prefill": {"chunked_prefill_size": -1},
}
WORKLOADS_OF = {"default": ["w1", "w2"], "no_overlap": ["w1", "w2"], "no_cuda_graph": ["w1", "w2"],
                "no_radix_cache": ["w3"], "no_chunked_prefill": []}


def sglang_params(p) -> dict:
    """minisgl SamplingParams -> SGLang's sampling_params dict."""
    return {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "max_new_tokens": p.max_tokens,
            "ignore_eos": p.ignore_eos}


def make_engine(model_dir: str, **extra):
    import sglang

    return sglang.Engine(model_path=model_dir, load_format="dummy", dtype="bfloat16", attention_backend="triton",
                         sampling_backend="pytorch", random_seed=0, skip_tokenizer_init=True, log_level="error",
                         **extra)


def run_throughput(engine, w) -> dict:
    warm = [[(7 * i + j) % 1000 for j in range(64)] for i in range(4)]
    engine.generate(input_ids=warm, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=w.prompts, sampling_params=[sglang_params(p) for p in w.params])
    wall = time.perf_counter() - t0
    prompt_tokens = sum(len(p) for p in w.prompts)
    cached = sum(o.get("meta_info", {}).get("cached_tokens", 0) for o in outs)
    return {"output_tok_per_s": w.total_output_tokens / wall, "wall_s": wall,
            "cached_prompt_share": cached / prompt_tokens}


def run_latency(engine, w) -> dict:
    engine.generate(input_ids=w.prompts[0][:64], sampling_params={"temperature": 0, "max_new_tokens": 8,
                                                                   "ignore_eos": True})
    ttfts, tpots = [], []
    for prompt, p in zip(w.prompts, w.params):
        t0 = time.perf_counter()
        first = None
        for _chunk in engine.generate(input_ids=prompt, sampling_params=sglang_params(p), stream=True):
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - t0)
        tpots.append((end - first) / max(p.max_tokens - 1, 1))
    return {"ttft_ms": 1e3 * statistics.median(ttfts), "tpot_ms": 1e3 * statistics.median(tpots)}


def measure(configs=("default",), model_dir: str | None = None) -> dict:
    """{config: {metric: value}} for SGLang on this GPU, metrics named as in the baseline files."""
    from minisgl.bench.workloads import WORKLOADS

    model_dir = model_dir or str(ROOT / "assets" / "configs" / MODEL)
    rows = {}
    for config in configs:
        engine = make_engine(model_dir, **CONFIGS[config])
        row = {}
        try:
            for name in WORKLOADS_OF[config] or []:
                w = WORKLOADS[name]()
                if name == "w2":
                    r = run_latency(engine, w)
                    row.update(w2_ttft_ms=r["ttft_ms"], w2_tpot_ms=r["tpot_ms"])
                else:
                    r = run_throughput(engine, w)
                    row[f"{name}_output_tok_per_s"] = r["output_tok_per_s"]
                    if name == "w3":
                        row["w3_cached_prompt_share"] = r["cached_prompt_share"]
        finally:
            engine.shutdown()
        rows[config] = row
    return rows


def measure_and_save(gpu_name: str | None = None, configs=("default",), out: Path | None = None) -> dict:
    import sglang
    import torch

    gpu_name = gpu_name or torch.cuda.get_device_name()
    rows = measure(configs)
    data = {
        "source": f"SGLang {sglang.__version__} measured by autograder/measure_sglang.py on one {gpu_name} "
                  f"(torch {torch.__version__}), {time.strftime('%Y-%m-%d')}, dummy bf16 weights at the real "
                  f"Qwen3-0.6B config, workloads as in minisgl/bench/workloads.py.",
        "gpu": gpu_name,
        "sglang": {MODEL: {k: v for k, v in rows.items() if v}},
    }
    out = out or report.BASELINES / f"{report.gpu_slug(gpu_name)}.json"
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out}")
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ablations", action="store_true", help="also measure each switch off (slow)")
    ap.add_argument("--out", type=Path, help="JSON to write (default autograder/baselines/<gpu>.json)")
    a = ap.parse_args(argv)
    try:
        import sglang  # noqa: F401
        import torch
    except ImportError as e:
        print(f"needs sglang and torch: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    measure_and_save(configs=tuple(CONFIGS) if a.ablations else ("default",), out=a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
