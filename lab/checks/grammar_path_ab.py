"""Which part of the grammar-mask path made batch-1 structured output slow: an A/B of the mask path on one engine.

Why: at batch 1 (W2: 8 requests one at a time, 256 output tokens each, Qwen3-0.6B shapes on the H200),
`response_format` json_object cost TPOT 0.963 ms against 0.902 ms without (1.07x); after commit cd0ef4f it costs
1.67 ms against 0.955 ms (1.75x, reports/h200/run17/api_check.json). The host's loop became the bottleneck; per
step, host ms: schedule 0.03, launch 0.95, wait 0.04, grammar_fill 0.22, sample_processed 0.41. cd0ef4f's one
change on that path: the masks are no longer built in a fresh numpy array and pinned per step
(`torch.from_numpy(a).pin_memory().to(device, non_blocking=True)`), but written by xgrammar straight into one
persistent pinned torch buffer (ModelRunner.mask_buffer), whose slice sample_processed copies with
`.to(device, non_blocking=True)`. Suspects: xgrammar's DLPack import of a pinned tensor (torch calls it
kDLCUDAHost), the H2D copy from the reused pinned slice being synchronous, or something else in that path.

The mask paths (each installed on the engine instance as `_sample_launched`, removed after; minisgl untouched):
- current: the code as it is (pinned buffer, filled by xgrammar, `.to(device, non_blocking=True)`).
- numpy_then_pin: the path before cd0ef4f (a fresh numpy array, filled through a torch.from_numpy view, then
  ModelRunner._to_device: pin_memory + non_blocking copy; sampling gets the device tensor).
- unpinned_torch_then_copy: xgrammar fills a persistent unpinned torch buffer, `copy_` into the pinned one, which
  goes on as now (is xgrammar writing into pinned memory the slow part?).
- pinned_sync_copy: as current with `non_blocking=False` (is the copy synchronous anyway?).

Per path: `--repeats` alternating runs of W2 and W2 json_object (TPOT medians, ratio json/base), one json run
under minisgl.bench.profile.timed_phases (h200_api_check.where_time_goes, plus the whole `_sample_launched`:
`mask_staging_ms` is what the path spends outside fill and sample_processed), and the json run's tokens, which
must equal current's (greedy: exit 1 if not). Then, in isolation, host microseconds per call of xgrammar's fill
into a pinned / numpy-backed / unpinned tensor and of the H2D copies, on an idle GPU and right behind a queued GPU
sleep (a forward in flight: a call that waits for the GPU shows the sleep's length). Pinned items need CUDA.

    python -m lab.checks.grammar_path_ab OUT_DIR [--model CONFIG_DIR] [--repeats 3]    # OUT_DIR/grammar_path_ab.json
    python -m lab.checks.grammar_path_ab /tmp/gpab --model assets/tiny-qwen3 --scale 0.125 --requests 2 --repeats 1
                                                                                        # CPU smoke run

It needs xgrammar importable (on the H200: the same PYTHONPATH as lab.lease.ApiCheck gives h200_api_check).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from lab import REPO
from lab.checks.h200_api_check import model_with_tokenizer, where_time_goes, with_params
from lab.engines import replaced
from minisgl import LLM, StructuredOutput
from minisgl.bench.profile import adding_seconds
from minisgl.bench.runner import environment, run_latency, write_json
from minisgl.bench.workloads import WORKLOADS, Workload
from minisgl.grammar import bitmask_words

JSON_OBJECT = StructuredOutput("json_object")
BUSY_CYCLES = 1_000_000  # torch.cuda._sleep: ~0.5 ms on an H200 (measured and recorded as busy_ms)


def _matchers(out) -> list:
    """The grammar matchers of a launched step's grammar rows, as Engine._sample_launched takes them."""
    return [out.batch.reqs[out.batch.sample_rows[k]].grammar for k in out.grammar_rows]


# Each path: engine -> a replacement for engine._sample_launched (None: the engine's own). They call
# engine.grammars().fill and engine.runner.sample_processed by attribute, so where_time_goes's timers see them.

def numpy_then_pin(engine) -> Callable:
    runner, words = engine.runner, bitmask_words(engine.model_config.vocab_size)

    def sample_launched(out) -> None:
        matchers = _matchers(out)
        mask = np.empty((len(matchers), words), dtype=np.int32)
        engine.grammars().fill(matchers, torch.from_numpy(mask))  # -1, then xgrammar through the numpy view
        runner.sample_processed(out, runner._to_device(mask))  # pin_memory + non_blocking copy (on a GPU)
    return sample_launched


def unpinned_torch_then_copy(engine) -> Callable:
    runner, words = engine.runner, bitmask_words(engine.model_config.vocab_size)
    staging: list[torch.Tensor] = []  # one persistent unpinned buffer, grown like mask_buffer

    def sample_launched(out) -> None:
        matchers = _matchers(out)
        if not staging or staging[0].shape[0] < len(matchers):
            staging[:] = [torch.empty((max(len(matchers), 8), words), dtype=torch.int32)]
        host = staging[0][:len(matchers)]
        engine.grammars().fill(matchers, host)
        mask = runner.mask_buffer(len(matchers))
        mask.copy_(host)
        runner.sample_processed(out, mask)
    return sample_launched


def pinned_sync_copy(engine) -> Callable:
    runner = engine.runner

    def sample_launched(out) -> None:
        matchers = _matchers(out)
        mask = runner.mask_buffer(len(matchers))
        engine.grammars().fill(matchers, mask)
        runner.sample_processed(out, mask.to(runner.device, non_blocking=False))  # a device tensor passes through
    return sample_launched


PATHS: dict[str, Callable | None] = {"current": None, "numpy_then_pin": numpy_then_pin,
                                     "unpinned_torch_then_copy": unpinned_torch_then_copy,
                                     "pinned_sync_copy": pinned_sync_copy}


@contextlib.contextmanager
def captured_outputs(llm) -> Iterator[list[list[int]]]:
    """The token ids of every request llm.generate finishes inside the block, in order."""
    seen: list[list[int]] = []
    generate = llm.generate

    def recording(*args, **kwargs):
        outs = generate(*args, **kwargs)
        seen.extend(list(o.token_ids) for o in outs)
        return outs
    with replaced(llm, "generate", recording):
        yield seen


def profiled(llm, w: Workload) -> dict:
    """where_time_goes (host ms per step by phase) plus the whole of `_sample_launched`, of which the part outside
    grammar_fill and sample_processed (staging, pinning, a copy made outside sample_processed) is mask_staging_ms."""
    engine = llm.engine
    outer = {"sample_launched": 0.0}
    with replaced(engine, "_sample_launched", adding_seconds(outer, "sample_launched", engine._sample_launched)):
        phases = where_time_goes(llm, w)
    launched = 1e3 * outer["sample_launched"] / max(phases["steps"], 1)
    return {**phases, "sample_launched_ms": launched,
            "mask_staging_ms": launched - phases["grammar_fill_ms"] - phases["sample_processed_ms"]}


def measure(llm, path: str, w2: Workload, json_w2: Workload, repeats: int) -> dict:
    """Alternating runs (base, json, base, json, ...) with `path` installed, then one profiled json run."""
    engine, make = llm.engine, PATHS[path]
    runs: dict[str, list[dict]] = {"base": [], "json_object": []}
    tokens: list[list[int]] | None = None
    with replaced(engine, "_sample_launched", make(engine)) if make is not None else contextlib.nullcontext():
        for _ in range(repeats):
            runs["base"].append(run_latency(llm, w2))
            with captured_outputs(llm) as outs:
                runs["json_object"].append(run_latency(llm, json_w2))
            tokens = tokens or outs[-len(json_w2.prompts):]  # after warm_up's request
        profile = profiled(llm, json_w2)
    med = {arm: statistics.median(r["tpot_ms_median"] for r in rs) for arm, rs in runs.items()}
    return {"tpot_ms_median": med, "ratio_json_over_base": med["json_object"] / med["base"],
            "tpot_ms_runs": {arm: [r["tpot_ms_median"] for r in rs] for arm, rs in runs.items()},
            "json_output_tokens": runs["json_object"][0]["output_tokens"], "where_time_goes_json": profile,
            "json_token_ids": tokens}


def host_us(fn: Callable[[], object], calls: int, busy: bool = False) -> float:
    """Median host microseconds of one call; `busy`: each call right behind a GPU sleep just queued."""
    times = []
    for _ in range(calls):
        if busy:
            torch.cuda.synchronize()
            torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def dlpack_facts(pinned: torch.Tensor | None) -> dict:
    """How xgrammar (through tvm_ffi) receives a torch tensor here: torch's C exchange API (fast) or the Python
    __dlpack__ fallback, and the device type a pinned tensor reports (3 = kDLCUDAHost, 1 = kDLCPU)."""
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None
    return {"xgrammar": v("xgrammar"), "apache-tvm-ffi": v("apache-tvm-ffi"),
            "torch_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
            "pinned_dlpack_device": None if pinned is None else [int(x) for x in pinned.__dlpack_device__()]}


def isolated(engine, calls: int) -> dict:
    """xgrammar's fill into each kind of host tensor and the H2D copies, timed alone (host us per call)."""
    runner, words = engine.runner, bitmask_words(engine.model_config.vocab_size)
    cuda = torch.cuda.is_available() and runner.device.type == "cuda"
    no_cuda = "skipped: no CUDA (pinned memory and H2D copies need it)"
    matcher = engine.grammars().matcher(JSON_OBJECT)  # a fresh one: the start state's mask
    numpy_mask = np.full((1, words), -1, dtype=np.int32)
    unpinned = torch.full((1, words), -1, dtype=torch.int32)
    pinned = runner.mask_buffer(1) if cuda else None  # the engine's own pinned slice
    items: dict[str, Callable[[], object] | None] = {
        "fill_pinned_slice": (lambda: matcher.fill_next_token_bitmask(pinned, 0)) if cuda else None,
        "fill_numpy_backed": lambda: matcher.fill_next_token_bitmask(torch.from_numpy(numpy_mask), 0),
        "fill_unpinned_torch": lambda: matcher.fill_next_token_bitmask(unpinned, 0),
        "h2d_pinned_slice_non_blocking": (lambda: pinned.to(runner.device, non_blocking=True)) if cuda else None,
        "h2d_numpy_pin_memory_non_blocking": (
            lambda: torch.from_numpy(numpy_mask).pin_memory().to(runner.device, non_blocking=True)) if cuda else None,
        "h2d_unpinned_copy_into_pinned_non_blocking": (
            lambda: pinned.copy_(unpinned).to(runner.device, non_blocking=True)) if cuda else None,
        "h2d_pinned_slice_blocking": (lambda: pinned.to(runner.device, non_blocking=False)) if cuda else None,
    }
    result: dict = {"calls": calls, "busy_calls": calls // 10, "dlpack": dlpack_facts(pinned)}
    if cuda:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.cuda._sleep(BUSY_CYCLES)
        torch.cuda.synchronize()
        result["busy_ms"] = 1e3 * (time.perf_counter() - t0)
    else:
        result["busy"] = no_cuda
    for name, fn in items.items():
        if fn is None:
            result[name] = no_cuda
            continue
        fn()  # first call (allocations) untimed
        result[name] = {"idle_us": host_us(fn, calls)}
        if cuda:
            result[name]["behind_busy_gpu_us"] = host_us(fn, calls // 10, busy=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--model", default=os.path.join(str(REPO), "assets", "configs", "qwen3-0.6b"),
                    help="a config folder (dummy weights; a synthetic tokenizer of its vocabulary is added)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="W2's prompt and output lengths (CPU smoke: 0.125)")
    ap.add_argument("--requests", type=int, default=8, help="the first N of W2's 8 requests")
    ap.add_argument("--calls", type=int, default=2000, help="calls per isolated timing")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    model = model_with_tokenizer(a.model, tempfile.mkdtemp(prefix="minisgl-gpab-model-"))
    llm = LLM(model, load_format="dummy")
    vocab = min(10000, llm.engine.model_config.vocab_size)  # the workload draws ids below 10,000
    w2 = WORKLOADS["w2"](a.scale, vocab)
    # the first N requests; ids below a small model's vocabulary (W2 maps them only when scaled)
    w2 = dataclasses.replace(w2, prompts=[[t % vocab for t in p] for p in w2.prompts[:a.requests]],
                             params=w2.params[:a.requests])
    json_w2 = with_params(w2, structured_output=JSON_OBJECT)
    result: dict = {"environment": environment(),
                    "settings": {**dataclasses.asdict(llm.config), "scale": a.scale, "requests": a.requests,
                                 "output_tokens_each": w2.params[0].max_tokens, "repeats": a.repeats,
                                 "calls": a.calls, "cuda": torch.cuda.is_available()},
                    "paths": {}}
    for path in PATHS:
        result["paths"][path] = measure(llm, path, w2, json_w2, a.repeats)
    reference = result["paths"]["current"]["json_token_ids"]
    for r in result["paths"].values():
        r["json_tokens_equal_current"] = r.pop("json_token_ids") == reference
    result["isolated"] = isolated(llm.engine, a.calls)
    ok = all(r["json_tokens_equal_current"] for r in result["paths"].values())
    result["tokens_equal"] = ok
    path = os.path.join(a.out_dir, "grammar_path_ab.json")
    write_json(path, result)
    print(json.dumps({"tokens_equal": ok, **{
        p: {"base_ms": round(r["tpot_ms_median"]["base"], 3), "json_ms": round(r["tpot_ms_median"]["json_object"], 3),
            "ratio": round(r["ratio_json_over_base"], 3),
            "staging_ms": round(r["where_time_goes_json"]["mask_staging_ms"], 3)}
        for p, r in result["paths"].items()}}))
    print(f"wrote {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
