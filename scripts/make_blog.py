"""Write reports/<gpu>/BLOG.md, the blog post, from the same JSON as the report (no number typed by hand).

    python scripts/make_blog.py reports/h200
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from make_report import MODELS, load_sections, w1_floor_seconds, w2_tpot_floor_ms  # noqa: E402

from minisgl.bench.workloads import w1_offline  # noqa: E402


def main(folder: str) -> None:
    sections, _ = load_sections(folder)
    root = os.path.join(os.path.dirname(__file__), "..")
    with open(os.path.join(root, "autograder", "baselines", "nvidia-h200.json")) as f:
        sg = json.load(f)["sglang"]
    b06, b8 = sections["bench06"][0], sections["bench8"][0]
    w1_runs = [sections[s][0]["default"]["w1"]["output_tok_per_s"] for s in ("bench06", "w1_06") if s in sections]
    prof = sections["profile"][0]
    par = sections["parity"][0]
    bw = sections["ceilings"][0]["copy_bytes_per_s"]
    w2_06, w2_8 = b06["default"]["w2"], b8["default"]["w2"]
    w3, w4 = b06["default"]["w3"], b06["default"]["w4"]
    sg06, sg8 = sg["qwen3-0.6b"]["default"], sg["qwen3-8b"]["default"]
    floor_w1 = w1_offline().total_output_tokens / w1_floor_seconds(MODELS["qwen3-0.6b"], bw)
    d, n, g = prof["default"], prof["no_overlap"], prof["no_cuda_graph"]
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

- **Latency at concurrency 1.** Qwen3-0.6B decodes a token every **{w2_06['tpot_ms_median']:.2f} ms**
  (SGLang {sg06['w2_tpot_ms']} ms); Qwen3-8B every **{w2_8['tpot_ms_median']:.2f} ms** (SGLang {sg8['w2_tpot_ms']} ms,
  and the card cannot go below {w2_tpot_floor_ms(MODELS['qwen3-8b'], bw):.2f} ms: 15 GB of weights per token
  over {bw / 1e12:.2f} TB/s).
- **Offline throughput (W1, 256 requests at once).** Qwen3-8B: **{b8['default']['w1']['output_tok_per_s']:,.0f}**
  output tokens/s (SGLang {sg8['w1_output_tok_per_s']:,}). Qwen3-0.6B: {', '.join(f'{v:,.0f}' for v in w1_runs)}
  tok/s in our two runs with defaults (SGLang {sg06['w1_output_tok_per_s']:,}); the floor set by reading the KV
  cache is about {floor_w1:,.0f}. That spread between runs is the open question of this post (below).
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
the batch, packing inputs, reading back tokens) sits on the critical path. With both, the GPU is busy
{100 * d['gpu_busy_fraction']:.0f}% of the time and the remaining time is in the kernels themselves, mostly
attention reading the KV cache.

![timeline](timeline.png)

## What we did not get to

- The Qwen3-0.6B throughput runs disagree: runs with the radix cache or chunked prefill switched off (which
  should not matter to W1's unshared prompts) measured
  {b06['no_radix_cache']['w1']['output_tok_per_s']:,.0f} and {b06['no_chunked_prefill']['w1']['output_tok_per_s']:,.0f}
  tok/s, faster than the defaults. Until repeated, shuffled runs settle it, we report the defaults as measured.
- Time to first token ({w2_06['ttft_ms_median']:.1f} ms vs SGLang's {sg06['w2_ttft_ms']} ms on Qwen3-0.6B) is
  launch-bound: prefill steps run eagerly.
- The FlashInfer backend is written but has not yet run on the GPU.
"""
    with open(os.path.join(folder, "BLOG.md"), "w") as f:
        f.write(text)
    print(f"wrote {os.path.join(folder, 'BLOG.md')}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "reports/h200")
