"""The API features' cost on a GPU (issue 26's bars), Qwen3-0.6B shapes with dummy weights, one command:

    python -m lab.checks.h200_api_check OUT_DIR [--scale S]     # writes OUT_DIR/api_check.json

- W2 (concurrency 1, TPOT): greedy as in the workload, against the same requests with `json_object` (structured
  output through xgrammar; the masks are built on the host while the forward runs): bar TPOT ratio <= 1.05.
  Dummy weights may close an object within a few tokens, so a second arm uses a schema whose one string is
  longer than max_tokens: all 256 tokens decode under a mask (the runs record each request's output length).
- W1 (offline throughput): as in the workload, against every request with top-5 logprobs (bar >= 0.9x),
  every request with frequency 0.5, presence 0.5 and repetition 1.1 penalties (bar >= 0.9x), and every request
  with a logit_bias of 16 tokens (a ban list at -100; bar >= 0.9x).

The arms alternate (A, B, A, B, ...) on one engine, each after a warm-up of its own kind (so the processing
kernels compile before the clock), and each ratio is taken from the medians. Structured output needs a tokenizer
of the model's vocabulary: the dummy model gets a synthetic byte-level one of 151,936 tokens (the embedded
model's tokens plus seeded concatenations of two of them), whose mask costs are like a real one's
(lab/checks/grammar_mask_bench.py). Without xgrammar installed, the json arm is skipped and the JSON says so.
`--scale` shrinks W1 for a CPU smoke run (the bars are for the GPU at scale 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import tempfile

from lab import REPO
from lab.engines import replaced
from minisgl import LLM, StructuredOutput
from minisgl.bench.profile import gc_pauses
from minisgl.bench.runner import environment, run_latency, run_throughput, write_json
from minisgl.bench.workloads import WORKLOADS, Workload

LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4000}}, "required": ["text"]}


def model_with_tokenizer(config_dir: str, out_dir: str) -> str:
    """config_dir's config plus a byte-level BPE tokenizer with the model's vocabulary size (synthetic)."""
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(config_dir, name), out_dir)
    vocab_size = json.load(open(os.path.join(config_dir, "config.json")))["vocab_size"]
    tok = json.load(open(os.path.join(str(REPO), "assets", "tiny-qwen3", "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    taken = set(vocab) | {t["content"] for t in tok.get("added_tokens", [])}
    base = list(vocab)
    rng = random.Random(0)
    next_id = max(max(vocab.values()), max((t["id"] for t in tok.get("added_tokens", [])), default=0)) + 1
    while next_id < vocab_size:
        t = rng.choice(base) + rng.choice(base)
        if t not in taken:
            taken.add(t)
            vocab[t] = next_id
            next_id += 1
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    for name in ("tokenizer_config.json",):
        shutil.copy(os.path.join(str(REPO), "assets", "tiny-qwen3", name), out_dir)
    return out_dir


def with_params(w: Workload, **changes) -> Workload:
    return dataclasses.replace(w, params=[dataclasses.replace(p, **changes) for p in w.params])


def ab(llm, run, base: Workload, other: Workload, repeats: int, key: str) -> dict:
    """Alternate the two arms `repeats` times each; the medians of `key` and every run, each with the garbage
    collections it paid (`gc`: a long one stalls the host's next launch while the device waits)."""
    runs = {"base": [], "feature": []}
    for _ in range(repeats):
        for arm, w in (("base", base), ("feature", other)):
            with gc_pauses() as pauses:
                res = run(llm, w)
            runs[arm].append({**res, "gc": pauses.as_dict()})
    med = {arm: statistics.median(r[key] for r in rs) for arm, rs in runs.items()}
    return {"median": med, "ratio": med["feature"] / med["base"], "runs": runs}


def where_time_goes(llm, w: Workload) -> dict:
    """One run of `w` (W2: batch 1, where the host's loop is as long as the device's step) with the host's
    milliseconds per step by phase (minisgl.bench.profile.timed_phases: schedule, launch, wait) and, inside them,
    the grammar masks' fill and the processed steps' sampling: where a structured request's extra TPOT goes."""
    from minisgl.bench.profile import adding_seconds, timed_phases

    engine = llm.engine
    inner = {"grammar_fill": 0.0, "sample_processed": 0.0}
    grammars = engine.grammars() if any(p.structured_output for p in w.params) else None
    with contextlib.ExitStack() as swaps:
        if grammars is not None:
            swaps.enter_context(replaced(grammars, "fill", adding_seconds(inner, "grammar_fill", grammars.fill)))
        swaps.enter_context(replaced(engine.runner, "sample_processed",
                                     adding_seconds(inner, "sample_processed", engine.runner.sample_processed)))
        with timed_phases(engine) as times:
            run_latency(llm, w)
    n = max(len(times.steps), 1)
    return {"steps": len(times.steps), "step_ms": 1e3 * sum(t[0] for t in times.steps) / n,
            **{f"{k}_ms": 1e3 * v / n for k, v in {**times.totals, **inner}.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--model", default=os.path.join(str(REPO), "assets", "configs", "qwen3-0.6b"))
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    model = model_with_tokenizer(a.model, tempfile.mkdtemp(prefix="minisgl-api-model-"))
    llm = LLM(model, load_format="dummy")
    result: dict = {"environment": environment(), "settings": {**dataclasses.asdict(llm.config), "scale": a.scale,
                                                               "repeats": a.repeats}, "bars": {}}

    vocab = min(10000, llm.engine.model_config.vocab_size)  # the workloads draw ids below 10,000
    w2 = WORKLOADS["w2"](a.scale, vocab)
    try:
        import xgrammar  # noqa: F401
        json_w2 = with_params(w2, structured_output=StructuredOutput("json_object"))
        result["w2_json_object"] = ab(llm, run_latency, w2, json_w2, a.repeats, "tpot_ms_median")
        result["bars"]["w2_tpot_json_object_le_1.05x"] = result["w2_json_object"]["ratio"] <= 1.05
        # dummy weights may close the object after a few tokens (see output_tokens in the runs): this schema's
        # string is longer than max_tokens, so every request decodes all its tokens under a grammar mask
        long_w2 = with_params(w2, structured_output=StructuredOutput("json_schema", json.dumps(LONG_SCHEMA)))
        result["w2_json_long_string"] = ab(llm, run_latency, w2, long_w2, a.repeats, "tpot_ms_median")
        result["bars"]["w2_tpot_json_long_string_le_1.05x"] = result["w2_json_long_string"]["ratio"] <= 1.05
        result["w2_where_time_goes"] = {arm: where_time_goes(llm, w) for arm, w in
                                        (("base", w2), ("json_object", json_w2), ("json_long_string", long_w2))}
    except ImportError:
        result["w2_json_object"] = result["w2_json_long_string"] = "skipped: xgrammar is not installed"

    w1 = WORKLOADS["w1"](a.scale, vocab)
    result["w1_logprobs5"] = ab(llm, run_throughput, w1, with_params(w1, logprobs=5), a.repeats, "output_tok_per_s")
    result["bars"]["w1_logprobs5_ge_0.9x"] = result["w1_logprobs5"]["ratio"] >= 0.9
    penalties = dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1)
    result["w1_penalties"] = ab(llm, run_throughput, w1, with_params(w1, **penalties), a.repeats, "output_tok_per_s")
    result["bars"]["w1_penalties_ge_0.9x"] = result["w1_penalties"]["ratio"] >= 0.9
    ban = {token: -100.0 for token in range(1000, 1016)}
    result["w1_logit_bias"] = ab(llm, run_throughput, w1, with_params(w1, logit_bias=ban), a.repeats,
                                 "output_tok_per_s")
    result["bars"]["w1_logit_bias_ge_0.9x"] = result["w1_logit_bias"]["ratio"] >= 0.9
    path = os.path.join(a.out_dir, "api_check.json")
    write_json(path, result)
    print(json.dumps({k: result[k]["ratio"] if isinstance(result[k], dict) and "ratio" in result[k] else result[k]
                      for k in ("w2_json_object", "w2_json_long_string", "w1_logprobs5", "w1_penalties",
                                "w1_logit_bias")}),
          json.dumps(result["bars"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
