"""The standard workloads are exactly DESIGN.md's, and `bench` writes JSON with its settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from minisgl.bench.workloads import (
    MIXES,
    mix_workload,
    sweep_cells,
    sweep_workload,
    w1_offline,
    w1_top_k_p,
    w2_latency,
    w3_shared_prefix,
    w4_interference,
)


def test_w1_matches_the_published_convention():
    w = w1_offline()
    assert len(w.prompts) == 256 and w.total_output_tokens == 133_966
    assert all(100 <= len(p) <= 1024 for p in w.prompts)
    assert all(p.temperature == 0.6 and p.ignore_eos for p in w.params)


def test_w2_w3_w4_shapes():
    w2 = w2_latency()
    assert len(w2.prompts) == 8 and all(len(p) == 512 for p in w2.prompts)
    assert all(p.max_tokens == 256 and p.temperature == 0 for p in w2.params)
    w3 = w3_shared_prefix()
    systems = {tuple(p[:1024]) for p in w3.prompts}
    assert len(w3.prompts) == 256 and len(systems) <= 8
    assert all(32 <= len(p) - 1024 <= 256 for p in w3.prompts)
    assert all(64 <= p.max_tokens <= 256 for p in w3.params)
    w4 = w4_interference()
    assert len(w4.prompts) == 128 and all(len(p) == 256 for p in w4.prompts)
    assert len(w4.late_prompts) == 8 and all(len(p) == 32768 for p in w4.late_prompts)
    assert all(p.max_tokens == 512 for p in w4.params) and all(p.max_tokens == 16 for p in w4.late_params)


def test_workloads_are_deterministic():
    assert w1_offline().prompts == w1_offline().prompts
    assert w3_shared_prefix(scale=0.1).prompts == w3_shared_prefix(scale=0.1).prompts


def test_w1_top_k_p_is_w1_with_top_k_and_top_p():
    w1, w = w1_offline(), w1_top_k_p()
    assert w.prompts == w1.prompts and [p.max_tokens for p in w.params] == [p.max_tokens for p in w1.params]
    assert all(p.temperature == 0.6 and p.top_k == 50 and p.top_p == 0.95 and p.ignore_eos for p in w.params)


def test_sweep_cells_cover_counts_lengths_and_sampling():
    cells = sweep_cells()
    assert {c.requests for c in cells} == {64, 256, 512, 1024}
    assert max(c.prompt_hi for c in cells) == 4096 and {c.sampling for c in cells} == {"greedy", "topkp"}
    assert len({c.name for c in cells}) == len(cells)
    for cell in cells[:4]:
        w = sweep_workload(cell)
        assert len(w.prompts) == cell.requests
        assert all(cell.prompt_lo <= len(p) <= cell.prompt_hi and max(p) < 10000 for p in w.prompts)
        assert all(cell.out_lo <= p.max_tokens <= cell.out_hi and p.ignore_eos for p in w.params)
        assert all((p.top_k == 50) == (cell.sampling == "topkp") for p in w.params)
    greedy, topkp = cells[0], cells[1]  # one mix, two samplings: the same requests
    assert sweep_workload(greedy).prompts == sweep_workload(topkp).prompts == sweep_workload(greedy).prompts


def test_run_sweep_on_a_tiny_model(qwen3_path):
    from minisgl import LLM
    from minisgl.bench.runner import run_sweep
    from minisgl.bench.workloads import SweepCell

    llm = LLM(qwen3_path)
    cells = [SweepCell(3, 5, 9, 2, 4, "greedy"), SweepCell(3, 5, 9, 2, 4, "topkp")]
    res = run_sweep(llm, cells)
    assert list(res) == [c.name for c in cells]
    for r in res.values():
        assert r["output_tokens"] == r["expected_output_tokens"] > 0
        assert r["cached_prompt_tokens"] == 0  # the cache is emptied between cells sharing their prompts


def test_bench_cli_writes_json(qwen3_path, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "minisgl", "bench", "--model", str(qwen3_path), "--workload", "w1",
           "--workload", "w3", "--scale", "0.02", "--quiet", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["settings"]["scale"] == 0.02 and data["environment"]["torch"]
    assert data["environment"]["host_probe_ms"] > 0  # how fast this host ran a fixed piece of Python
    w1 = data["results"]["w1"]
    assert w1["output_tokens"] == w1["expected_output_tokens"] > 0 and w1["output_tok_per_s"] > 0


def test_host_phases_times_steps_and_puts_the_methods_back(qwen3_path):
    """The profile's undisturbed host timing: per-phase milliseconds that add up to the step, tokens unchanged,
    and the engine's own methods restored afterwards."""
    from helpers import PROMPTS, hf_greedy

    from minisgl import LLM, SamplingParams
    from minisgl.bench.profile import host_phases
    from minisgl.engine.model_runner import StepOutput

    llm = LLM(qwen3_path, page_size=4)
    engine = llm.engine
    wait = StepOutput.wait
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS[:3]]
    engine.step()
    phases = host_phases(engine, 4)
    assert set(phases) == {"schedule", "launch", "wait", "other", "step"}
    assert all(v >= 0 for k, v in phases.items() if k != "other") and phases["launch"] > 0
    assert abs(sum(v for k, v in phases.items() if k != "step") - phases["step"]) < 1e-6
    assert "schedule" not in vars(engine.scheduler) and "forward" not in vars(engine.runner)
    assert "step" not in vars(engine)
    assert StepOutput.wait is wait
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == [t[:12] for t in hf_greedy(qwen3_path, PROMPTS[:3], 12)]


def test_gc_pauses_counts_the_collections_inside_its_block():
    """minisgl.bench.profile.gc_pauses: each collection inside the block counted and timed (full ones apart),
    none after it; the API check's A/B records them per run."""
    import gc

    from lab.checks.h200_api_check import ab
    from minisgl.bench.profile import gc_pauses

    callbacks = len(gc.callbacks)
    with gc_pauses() as pauses:
        gc.collect(0)
        gc.collect()
    assert pauses.collections >= 2 and pauses.full >= 1 and 0 < pauses.longest_s <= pauses.seconds
    counted = pauses.collections
    gc.collect()
    assert pauses.collections == counted and len(gc.callbacks) == callbacks

    def run(llm, w):
        if w == "feature":
            gc.collect()
        return {"tok_s": 1.0}

    res = ab(None, run, "base", "feature", 2, "tok_s")
    assert [r["gc"]["full"] >= 1 for r in res["runs"]["feature"]] == [True, True]
    assert all(set(r["gc"]) == {"collections", "seconds", "full", "longest_s"} for r in res["runs"]["base"])


def test_compile_detector_sees_the_gdn_kernels():
    """run_throughput reports Triton variants compiled inside its timed run (`triton_compiles_timed`): Qwen3.5's
    Gated DeltaNet kernels are among those it counts (a compile of theirs used to go unseen). In a fresh
    process without the interpreter, so the kernels are Triton JIT functions."""
    pytest.importorskip("triton", reason="Triton is not installed")
    code = ("from minisgl.bench.runner import triton_variants; v = triton_variants(); "
            "print(sorted(k for k in v if k.startswith(('_conv', '_gdr', '_gating'))))")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISGL_FORCE_TRITON")}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=repo,
                         check=True).stdout
    for name in ("_conv_varlen_kernel", "_conv_decode_kernel", "_gdr_chunk_kernel", "_gdr_recurrent_kernel"):
        assert name in out, out


def test_issue29_mixes():
    """512 requests of 16-2,048 prompt ids and 16-512 greedy outputs; 384 requests in 24 groups of 16 sharing
    512-1,536-id prefixes (then 32-256 ids of their own), 16-512 outputs, greedy / temperature / top-k-top-p."""
    a = mix_workload("mix512")
    assert len(a.prompts) == 512 and all(16 <= len(p) <= 2048 for p in a.prompts)
    assert all(16 <= p.max_tokens <= 512 and p.temperature == 0 for p in a.params)
    assert a.name == MIXES["mix512"].name and a.prompts == sweep_workload(MIXES["mix512"]).prompts
    b = mix_workload("prefix384")
    assert len(b.prompts) == 384 and all(16 <= p.max_tokens <= 512 for p in b.params)
    groups: dict[tuple, list] = {}
    for p in b.prompts:  # a prompt's group: the prefix it shares with the others (the groups' first 512 ids)
        groups.setdefault(tuple(p[:512]), []).append(p)
    assert len(groups) == 24 and all(len(g) == 16 for g in groups.values())
    for g in groups.values():
        shared = min(len(p) for p in g)
        while any(p[:shared] != g[0][:shared] for p in g):
            shared -= 1
        assert 512 <= shared <= 1536 and all(32 <= len(p) - shared <= 256 for p in g)
    assert {(p.temperature, p.top_k) for p in b.params} == {(0.0, -1), (0.6, -1), (0.6, 50)}
    assert len({tuple(p[:512]) for p in b.prompts[:16]}) > 1  # the groups are interleaved
    assert mix_workload("prefix384").prompts == b.prompts and max(t for p in b.prompts for t in p) < 10000
