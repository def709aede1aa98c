"""The measurement tooling (lab/) on a CPU: the section table, kernel options applied and restored, a bench on the
tiny model, lab.run's JSON, the lease's plan and its runner (budget, skips, logs), SGLang's wheel parts."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from lab import REPO, engines, lease, models, sections
from lab import run as lab_run
from minisgl.bench.runner import RUNNERS
from minisgl.config import EngineConfig

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def test_models_table_points_at_real_configs():
    for m in models.MODELS.values():
        assert (Path(m.path) / "config.json").is_file()
    assert models.attention_shape("qwen3-0.6b") == (16, 8, 128)
    assert models.attention_shape("qwen3-8b") == (32, 8, 128)
    assert models.model("qwen3.5-0.8b").hybrid and not models.model("qwen3-8b").hybrid
    with pytest.raises(SystemExit, match="unknown model"):
        models.model("qwen9")


def test_every_bench_arm_is_well_formed():
    """Each arm's workloads are runnable, its settings are EngineConfig fields and its kernel options known."""
    benches = [s.run for s in sections.SECTIONS.values() if isinstance(s.run, sections.Bench)]
    assert len(benches) >= 10
    for bench in benches:
        assert bench.model in models.MODELS
        for arm in bench.arms:
            assert set(arm.workloads) <= set(RUNNERS), arm
            assert set(arm.settings) <= FIELDS, arm
            assert set(arm.kernel) <= set(engines.KERNEL_OPTIONS), arm
    with pytest.raises(ValueError, match="unknown kernel options"):
        sections.Arm("x", ("w2",), kernel={"warp_speed": 9})
    with pytest.raises(ValueError):
        sections.Arm("x", ("w2",), requests={"w1": 2})  # a subset of a workload the arm does not run


def test_ablation_turns_off_the_designs_switches_and_the_newer_ones():
    arms = {a.label: a for a in sections.SECTIONS["bench06"].run.arms}
    assert arms["default"].settings == {} and set(arms["default"].workloads) == {"w1", "w1_topkp", "w2", "w3", "w4"}
    assert arms["no_overlap"].settings == {"overlap": False}
    assert arms["no_cuda_graph"].settings == {"cuda_graph": False}
    assert arms["no_radix_cache"].settings == {"radix_cache": False} and "w3" in arms["no_radix_cache"].workloads
    assert arms["no_chunked_prefill"].settings == {"chunked_prefill_size": 0}
    assert "w4" in arms["no_chunked_prefill"].workloads
    assert arms["no_gemv"].settings == {"gemv": False} and arms["no_pdl"].kernel == {"pdl": False}
    assert arms["no_prefill_graphs"].settings == {"prefill_graph_max_tokens": 0}
    assert arms["no_fused_sampler"].kernel == {"fused_sampler": False}
    assert all(a.about for a in arms.values())


def test_kernel_options_apply_for_the_block_and_restore_after():
    from minisgl.kernels import gemv, sampling
    from minisgl.kernels.options import current_options
    before, triton = current_options(), sampling.triton
    with engines.kernel_options(decode_fused_store=False, gemv_pdl_early_tiles=3, sampler_launch={"chunk": 2048},
                                gdn={"decode_warps": 2}, sampler_skip_blocks=False, fused_sampler=False,
                                gemv_table={"24,3000": [1, 4096, 4, 1], "8,16": None}) as opts:
        cur = current_options()
        assert cur is opts and not cur.decode_fused_store and cur.gemv_pdl_early_tiles == 3
        assert cur.sampler_launch.chunk == 2048 and cur.sampler_launch.stats_block == before.sampler_launch.stats_block
        assert cur.gdn.decode_warps == 2 and cur.gdn.prefill == before.gdn.prefill and not cur.sampler_skip_blocks
        table = gemv.load_table(cur.gemv_configs)
        assert table[(24, 3000)] == (1, 4096, 4, 1) and table[(8, 16)] is None
        assert sampling.triton is None  # the torch sampler for this block's engine
    assert current_options() == before and sampling.triton is triton
    with pytest.raises(ValueError, match="unknown kernel options"), engines.kernel_options(turbo=True):
        pass


@pytest.fixture
def tiny_model(monkeypatch):
    """The lab's model name 'qwen3-0.6b' pointed at the embedded tiny model (real tokenizer, 4k vocabulary)."""
    from helpers import TINY_QWEN3_ASSET
    monkeypatch.setattr(engines, "model_path", lambda name: TINY_QWEN3_ASSET)
    return "qwen3-0.6b"


def test_a_bench_runs_its_arms_on_fresh_engines_and_records_a_failed_arm(tiny_model):
    bench = sections.Bench(tiny_model, (
        sections.Arm("default", ("w2",), requests={"w2": 1}),
        sections.Arm("no_overlap", ("w2",), {"overlap": False}, requests={"w2": 1}),
        sections.Arm("early0", ("w2",), kernel={"gemv_pdl_early_tiles": 0}, requests={"w2": 1}),
        sections.Arm("broken", ("w2",), {"max_running_requests": -5}, requests={"w2": 1})))
    res = bench()
    assert list(res) == ["default", "no_overlap", "early0", "broken"]
    for label in ("default", "no_overlap", "early0"):
        w2 = res[label]["w2"]
        assert w2["requests"] == 1 and w2["tpot_ms_median"] > 0 and w2["ttft_ms_median"] > 0
        assert res[label]["startup_s"] > 0 and res[label]["kv_pool_tokens"] > 0
    assert res["no_overlap"]["settings"] == {"overlap": False}
    assert res["early0"]["kernel"] == {"gemv_pdl_early_tiles": 0}
    assert res["early0"]["kernel_options"]["gemv_pdl_early_tiles"] == 0  # the engine's own options took it
    assert res["default"]["kernel_options"]["gemv_pdl_early_tiles"] == 2
    assert "error" in res["broken"] and "max_running_requests" in res["broken"]["error"]


def test_an_arm_whose_engine_fails_is_recorded_and_the_others_still_run(monkeypatch):
    """arms_ab: an arm whose engine raises (run29: the norm fold's first GPU capture) gets its error in the tokens
    check and is left out of the timing; the other arms are compared and timed as usual."""
    def fake_engine(model, body, settings, kernel, **fixed):
        if kernel.get("gemv_norm_fold"):
            raise ValueError("too many values to unpack")
        return {"kernel_options": kernel, "tokens": {"bs1_greedy": [[1, 2, 3]]}}

    timed = []
    monkeypatch.setattr(sections, "with_engine", fake_engine)
    monkeypatch.setattr(sections, "Bench", lambda model, arms, rounds: lambda: timed.extend(a.label for a in arms))
    arms = {"off": ({"gemv_norm_fold": False}, ""), "fold": ({"gemv_norm_fold": True}, "fold"),
            "no_early_kv": ({"early_kv": False}, "early keys off")}
    res = sections.arms_ab("qwen3-0.6b", arms, rounds=2)
    for mode in ("graphs", "eager"):
        got = res["tokens"][mode]
        assert "too many values to unpack" in got["fold"]["error"] and not got["ok"]
        assert got["no_early_kv"]["same_as_off"] == {"bs1_greedy": [True]}
    assert timed == ["off", "no_early_kv"] and not res["ok"]


def test_anatomy_folds_the_layers_for_its_probe_only():
    """decode_anatomy's folded probes: inside the block the model's layers are GemvNormLayers around the same
    modules (the fold's layers, sharing every parameter); after it, the original layers, unchanged."""
    from torch import nn

    from lab.checks import decode_anatomy
    from minisgl.kernels.gemv import GemvNormLayer
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLM

    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_q_heads=2,
                      num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    model = DecoderLM(cfg)
    layers = model.layers

    def params():  # name -> the tensor object itself
        return {name: id(p) for name, p in model.named_parameters()}

    before = params()
    with decode_anatomy._folded(model, False):
        assert model.layers is layers
    with decode_anatomy._folded(model, True):
        assert isinstance(model.layers, nn.ModuleList) and model.layers is not layers
        assert all(isinstance(f, GemvNormLayer) and f.self_attn is layer.self_attn and f.mlp is layer.mlp
                   for f, layer in zip(model.layers, layers))
        assert params() == before  # the same tensors under the same names
    assert model.layers is layers and params() == before


def test_anatomy_boundary_reads_a_launch_against_the_one_before():
    """decode_anatomy's stamped chain, on hand-made stamps (ns): [began, wait returned, ended, SM] a program."""
    import torch

    from lab.checks.decode_anatomy import _boundary

    prev = torch.tensor([[0, 100, 9_000, 0], [0, 100, 10_000, 1]])
    # four programs: two resident before prev ended (at 10,000 ns), two only after; two on SM 0
    cur = torch.tensor([[4_000, 11_000, 20_000, 0], [6_000, 11_500, 21_000, 1],
                        [12_000, 12_500, 22_000, 0], [13_000, 13_500, 30_000, 2]])
    b = _boundary(prev, cur)
    assert b["first_begin_lead_us"] == 6.0 and b["began_before_prev_end"] == 0.5
    assert b["release_us"] == 1.0 and b["median_release_us"] == 2.0  # the median of 11.0, 11.5, 12.5, 13.5 us
    assert b["span_us"] == 20.0 and b["most_programs_an_sm"] == 2
    assert 0 < b["tail_us"] < 8.0  # the last program trails the 90th percentile's end
    # each program's work after its wait: 9.0, 9.5, 9.5 and 16.5 us
    assert b["work_max_us"] == 16.5 and b["work_median_us"] == 9.5


def test_anatomy_reads_stage1_phases_from_its_stamps():
    """step_stamps' phases of a stage-1 program (ns): began, wait returned, ended, SM, then q ready, early tile in
    registers, softmax done, values done. A tile that came before q was ready waited for nothing."""
    import torch

    from lab.checks.decode_anatomy import _stage1_phases
    from minisgl.kernels.attention import STAGE1_STAMP_FIELDS

    s = torch.tensor([[0, 1_000, 5_000, 3, 2_000, 2_500, 3_000, 4_000],
                      [500, 1_000, 6_000, 4, 2_000, 2_000, 3_500, 4_500]])
    assert s.shape[1] == STAGE1_STAMP_FIELDS
    phases = _stage1_phases(s)
    assert phases["lead"].tolist() == [1_000, 500] and phases["work"].tolist() == [4_000, 5_000]
    assert phases["q"].tolist() == [1_000, 1_000] and phases["early_tile"].tolist() == [500, 0]
    assert phases["softmax"].tolist() == [500, 1_500] and phases["values"].tolist() == [1_000, 1_000]
    assert phases["store"].tolist() == [1_000, 1_500]


@pytest.mark.parametrize("act_epilogue", [True, False])
def test_anatomy_boundaries_chains_a_layer_s_gemvs_and_reads_their_stamps(act_epilogue, monkeypatch):
    """decode_anatomy's stamped chain on a tiny model, on the CPU: the GEMV's stamps faked (the timer is a GPU's),
    the graph run eagerly. Each layer's four launches in order with the right inputs (down reads gate_up's output,
    the activation in gate_up's epilogue or in down's prologue), and a row a kind from the stamps."""
    import dataclasses
    import types

    import torch

    from lab.checks import decode_anatomy
    from minisgl.config import KernelOptions
    from minisgl.kernels import gemv as gv
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLM

    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_q_heads=2,
                      num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    model = DecoderLM(cfg)
    gv.use_gemv(model, fold=(type(model.layers[0].mlp),))
    calls, real = [], gv.gemv

    def stamped_gemv(x, w, b=None, tiles=None, silu_mul_out=False, silu_mul=False, stamps=None):
        calls.append((x.shape[1], w.shape[0], silu_mul_out, silu_mul))
        if stamps is not None:  # launch i's programs begin at 10 us * i, wait 1 us, end 5 us later, 3 SMs
            t0, n = 10_000 * len(calls), stamps.shape[0]
            stamps[:, 0], stamps[:, 1] = t0 + torch.arange(n), t0 + 1_000
            stamps[:, 2], stamps[:, 3] = t0 + 5_000, torch.arange(n) % 3
        return real(x, w, b, tiles=tiles, silu_mul_out=silu_mul_out, silu_mul=silu_mul)

    monkeypatch.setattr(gv, "gemv", stamped_gemv)
    monkeypatch.setattr(decode_anatomy, "capture", lambda fn: (types.SimpleNamespace(replay=fn), fn()))
    monkeypatch.setattr(decode_anatomy, "time_replay_us", lambda graph, iters=0: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    options = dataclasses.replace(KernelOptions(), gemv_act_epilogue=act_epilogue)
    llm = types.SimpleNamespace(engine=types.SimpleNamespace(runner=types.SimpleNamespace(model=model)),
                                config=types.SimpleNamespace(kernels=options))
    res = decode_anatomy.boundaries(llm, samples=2)
    assert "error" not in res and res["layers"] == 3 and res["act_epilogue"] is act_epilogue
    # a layer: qkv (hidden in, 64 out), o (32 in), gate_up (96 out), down (its input gate_up's output)
    down_in = 48 if act_epilogue else 96
    assert calls[:4] == [(32, 64, False, False), (32, 32, False, False), (32, 96, act_epilogue, False),
                         (down_in, 32, False, not act_epilogue)]
    assert set(res["by_kind"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    down = res["by_kind"]["down_proj"]
    # each launch began 5 us after the one before ended, its wait 1 us after that, and it ended 4 us later
    assert down["first_begin_lead_us"] == -5.0 and down["began_before_prev_end"] == 0.0
    assert down["release_us"] == 6.0 and down["span_us"] == 10.0 and down["tail_us"] == 0.0
    assert down["programs"] == gv.gemv_programs(32, model.layers[0].mlp.down_proj.tiles)
    assert res["timer_step_ns"] == 1


def test_decode_attention_stamps_are_refused_on_the_cpu_and_sized_by_its_launches():
    """decode_attention(stamps=) reads a GPU's timer too: on the CPU it refuses them. decode_programs sizes them:
    stage 1's (request, kv head, split) programs, stage 2's (request, q head) only where a second launch merges."""
    import pytest
    import torch

    from minisgl.kernels.attention import STAGE1_STAMP_FIELDS, decode_attention, decode_programs
    from minisgl.kernels.gemv import STAMP_FIELDS

    assert decode_programs(2, 16, 8, 4, fused_merge=False) == (64, 32)
    assert decode_programs(2, 16, 8, 4, fused_merge=True) == (64, 0)
    assert decode_programs(1, 16, 8, 1, fused_merge=False) == (8, 0)
    q, out = torch.randn(1, 4, 16), torch.empty(1, 4, 16)
    kv = torch.randn(8, 2, 16)
    stamps = (torch.zeros(2 * 2, STAGE1_STAMP_FIELDS, dtype=torch.int64),
              torch.zeros(4, STAMP_FIELDS, dtype=torch.int64))
    with pytest.raises(ValueError, match="CUDA"):
        decode_attention(q, kv, kv, torch.arange(8, dtype=torch.int32).view(1, 8), torch.tensor([0]),
                         torch.tensor([5], dtype=torch.int32), out, 0.25, num_splits=2, stamps=stamps)


def test_gemv_stamps_are_refused_on_the_cpu():
    """gemv(stamps=) reads a GPU's timer: on a CPU tensor it says so rather than leave the stamps unwritten."""
    import pytest
    import torch

    from minisgl.kernels.gemv import STAMP_FIELDS, gemv

    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="GPU"):
        gemv(x, w, stamps=torch.zeros(4, STAMP_FIELDS, dtype=torch.int64))
    torch.testing.assert_close(gemv(x, w), x @ w.T)


def test_mixes_section_records_throughput_batch_steps_and_resolved_rows(tiny_model, monkeypatch):
    """Issue 29's mixes section, on the tiny model with the mixes shrunk (same kinds of cells)."""
    from minisgl.bench import workloads
    monkeypatch.setitem(workloads.MIXES, "mix512", workloads.SweepCell(6, 4, 40, 2, 6, "greedy"))
    monkeypatch.setitem(workloads.MIXES, "prefix384", workloads.PrefixGroupCell(6, 2, 20, 30, 2, 5, 2, 6))
    assert set(sections.SECTIONS) >= {"mixes35", "mixes35_rows256"}
    res = sections.mixes(tiny_model, max_running_requests=4)
    assert res["max_running_requests"] == 4 and res["state_snapshots"] is None and res["kv_pool_tokens"] > 0
    assert list(res["mixes"]) == ["mix512", "prefix384"]
    for name, m in res["mixes"].items():
        assert m["output_tok_per_s"] > 0 and m["steps"] > m["decode_steps"] > 0, name
        assert 1 <= m["max_decode_batch"] <= 4 and m["run"]["requests"] == 6
        assert m["run"]["output_tokens"] == m["run"]["expected_output_tokens"]
    assert res["mixes"]["prefix384"]["run"]["cached_prompt_tokens"] > 0  # the groups share their prefixes
    assert res["mixes"]["mix512"]["cell"]["name"] == "n6_in4-40_out2-6_greedy"


def test_mix_phases_splits_host_and_device_time_of_a_mix_by_step(tiny_model, monkeypatch):
    """Issue 29's diagnosis of the Qwen3.5 mix, on the tiny model with the mix shrunk: each step's host phases and
    batch in a normal run, then each step synchronised and timed; the steps add up to the workload's tokens."""
    from minisgl.bench import workloads
    monkeypatch.setitem(workloads.MIXES, "mix512", workloads.SweepCell(6, 4, 40, 2, 6, "greedy"))
    res = sections.mix_phases(tiny_model)
    assert res["output_tok_per_s"] > 0 and set(res["host_s"]) == {"schedule", "launch", "wait"}
    assert len(res["steps_host"]) >= len(res["batches"]) > 0 and len(res["steps_host"][0]) == 4
    decode_rows = sum(size for is_decode, size, _ in res["batches"] if is_decode)
    timed = res["timed"]
    assert timed["decode_steps"] > 0 and timed["prefill_steps"] > 0 and timed["decode_s"] > 0
    assert decode_rows == timed["decode_tokens"]  # the same requests, the same decode steps
    assert sum(n for _, _, n, _, _ in timed["steps"]) == timed["prefill_tokens"] + timed["decode_tokens"]


def test_launch_profile_times_each_launch_on_an_idle_device_and_profiles_the_prefill_launches(tiny_model,
                                                                                             monkeypatch):
    """Issue 24's host-side diagnosis on the tiny model, the mix shrunk: every step of the timed pass is recorded
    with how it ran, launch and tail times, and the profiled pass's tables name the model's forward."""
    from minisgl.bench import workloads
    monkeypatch.setitem(workloads.MIXES, "mix512", workloads.SweepCell(6, 4, 40, 2, 6, "greedy"))
    assert "launch06" in sections.SECTIONS
    res = sections.launch_profile(tiny_model, top=200)
    assert res["output_tok_per_s"] > 0 and res["engine"]["steps"] > 0
    kinds = {row[0] for row in res["steps"]}
    assert kinds <= {"eager", "graph", "graph_pieces", "prefill_graph"} and kinds
    assert sum(v["steps"] for v in res["by_kind"].values()) == len(res["steps"])
    assert all(row[4] > 0 and row[5] >= 0 for row in res["steps"])
    assert sum(row[2] for row in res["steps"]) >= 6 * 2  # the prompts' tokens and then the outputs'
    cumulative = [row["function"] for row in res["profile"]["by_cumulative_time"]]
    assert any("(_forward)" in f for f in cumulative)  # the runner's step, profiled from the inside


def test_gdn_solve_ab_compares_both_solves_tokens_and_rates(tiny_model, monkeypatch):
    """The chunk prepare's A/B section on the tiny model (no Gated DeltaNet layers: the same tokens both ways),
    the mix shrunk: both arms' rates, each engine's resolved option, the requests compared one by one."""
    from minisgl.bench import workloads
    monkeypatch.setitem(workloads.MIXES, "mix512", workloads.SweepCell(6, 4, 40, 2, 6, "greedy"))
    res = sections.gdn_solve_ab(tiny_model)
    assert [res["arms"][s]["kernel_options"]["gdn"]["prepare_solve"] for s in ("rows", "blocks")] == ["rows", "blocks"]
    assert res["requests"] == 6 and res["requests_identical"] == 6 and res["first_differences"] == []
    assert res["blocks_over_rows"] > 0


def test_lab_run_writes_each_section_as_it_ends(tmp_path, monkeypatch):
    def boom():
        raise RuntimeError("kernel fell over")

    monkeypatch.setitem(sections.SECTIONS, "fake", sections.section(lambda: {"x": 1}, "a fake"))
    monkeypatch.setitem(sections.SECTIONS, "boom", sections.section(boom, "fails"))
    monkeypatch.setattr(lab_run, "SECTIONS", sections.SECTIONS)
    lab_run.run(str(tmp_path), ["fake", "boom"], "f.json")
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["sections"]["fake"]["result"] == {"x": 1} and data["sections"]["fake"]["seconds"] >= 0
    assert "kernel fell over" in data["sections"]["boom"]["error"]
    assert data["command"] == "python -m lab.run --sections fake,boom" and "git_commit" in data["environment"]
    with pytest.raises(SystemExit, match="unknown sections"):
        lab_run.run(str(tmp_path), ["nope"])


def test_lease_plan_fits_the_device_limits():
    """Each call: its steps exist, it plans inside its budget (which ends before the 540 s timeout), brings back
    at most 8 files, carries at most 8 paths; calls 1-4 fit a 27-minute lease with the machine's start (a session
    lends 30: run15 measured what they take on a fresh machine, and they take most of it)."""
    from lab import sglang
    for name, call in lease.CALLS.items():
        assert call.seconds <= call.budget_s < 540, name
        assert sum(len(s.files) for s in call.steps) + 1 <= 8 and len(call.carry) <= 8
        assert len({s.name for s in call.steps}) == len(call.steps)
        for step in call.steps:
            if isinstance(step, lease.Lab):
                assert set(step.sections) <= set(sections.SECTIONS), step
            if isinstance(step, lease.SGLang):
                assert set(step.sections) <= set(sglang.SECTIONS) and step.model in models.MODELS
            if isinstance(step, lease.Serving):
                assert set(step.loads) <= set(lease.LOADS)
            assert len(" ".join(step.argv("/tmp/out"))) < 2000
    assert sum(lease.CALLS[c].seconds for c in lease.HEADLINE_CALLS) + 120 <= 27 * 60
    planned = {s for c in lease.HEADLINE_CALLS for st in lease.CALLS[c].steps
               for s in getattr(st, "sections", ())}
    assert {"ceilings", "bench06", "bench8", "qwen35", "sweep06", "hf06", "hf8", "profile", "profile8"} <= planned


class Script(lease.Step):
    """A step that runs a line of Python (for the runner's own test)."""

    def __init__(self, name: str, seconds: int, code: str):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "files", ())
        object.__setattr__(self, "code", code)

    def argv(self, out: str) -> list[str]:
        return [sys.executable, "-c", self.code, out]


def test_lease_call_runs_steps_skips_and_stops_them_and_packs_the_logs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lease, "LOGS", tmp_path / "logs")
    write = "import sys, pathlib; pathlib.Path(sys.argv[1], 'a.json').write_text('{}'); print('wrote a')"
    call = lease.Call("test", carry=(), budget_s=4, steps=(
        Script("first", 1, write),
        Script("too_long", 60, "print('never')"),
        Script("overruns", 1, "import time; time.sleep(30)"),
        Script("after", 1, "print('after')")))
    monkeypatch.setitem(lease.CALLS, "test", call)
    earlier = tmp_path / "logs" / "earlier_call.log"  # left by an earlier call on the same warm machine
    earlier.parent.mkdir()
    earlier.write_text("old")
    os.utime(earlier, (time.time() - 600, time.time() - 600))
    out = tmp_path / "out"
    lease.run_call("test", str(out), commit="0" * 40)
    printed = capsys.readouterr().out
    assert (out / "a.json").is_file() and "first: rc 0" in printed and "wrote a" in printed
    assert "SKIPPED too_long: needs ~60 s" in printed
    assert "overruns: rc stopped at the call's budget" in printed
    assert "SKIPPED after" in printed  # nothing left of the budget
    with tarfile.open(out / "logs_test.tar.xz") as tar:
        assert "lease-logs/first.log" in tar.getnames()
        assert "lease-logs/earlier_call.log" not in tar.getnames()  # packed by its own call already
    assert os.environ["MINISGL_GIT_COMMIT"] == "0" * 40


def test_wheel_parts_are_split_staged_and_unpacked_once_complete(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / lease.WHEEL_DIR).mkdir(parents=True)
    contents = {name: bytes(range(256)) * (size // 256) + b"z" * (size % 256)
                for name, size in (("big.whl", 9000), ("mid.whl", 5000), ("small.tar.gz", 4000), ("tiny.whl", 100))}
    for name, data in contents.items():
        (repo / lease.WHEEL_DIR / name).write_bytes(data)
    (repo / lease.WHEEL_DIR / "old").mkdir()  # an earlier split's part: removed
    (repo / lease.WHEEL_DIR / "old" / lease.MANIFEST).write_text("{}")
    manifest = lease.split_wheels(repo / lease.WHEEL_DIR, root=REPO, chunk_bytes=4096)
    assert not (repo / lease.WHEEL_DIR / "old").exists()
    # big.whl and mid.whl in pieces of at most 4096 bytes: seven pieces (4096 x 3, 4000, 904, 808, 100), each,
    # largest first, into the lightest of the four parts
    assert sorted(sum(manifest.values(), [])) == ["big.whl.chunk0", "big.whl.chunk1", "big.whl.chunk2",
                                                  "mid.whl.chunk0", "mid.whl.chunk1", "small.tar.gz", "tiny.whl"]
    sizes = {h: sum((repo / lease.WHEEL_DIR / h / n).stat().st_size for n in names) for h, names in manifest.items()}
    assert sorted(sizes.values()) == [4096, 4096 + 100, 4096 + 808, 4000 + 904]
    assert json.loads((repo / lease.WHEEL_DIR / "b" / lease.MANIFEST).read_text()) == manifest
    # the kit's installer, faked: it stamps /tmp/site once every wheel is there, and records what it found
    kit = repo / lease.KIT
    kit.mkdir()
    (kit / "run_sglang.sh").write_text('mkdir -p "$SITE" && ls "$1" > "$SITE/seen" && touch "$SITE/.sglang-kit"\n')
    site = tmp_path / "site"
    monkeypatch.setenv("SITE", str(site))
    monkeypatch.setattr(lease, "REPO", repo)
    monkeypatch.setattr(lease, "WHEELS", tmp_path / "wheels")
    monkeypatch.setattr(lease, "SITE", site)
    step = lease.SGLang("s", 10, ("s.json",), "qwen3-0.6b", ("w1",))
    assert "no SGLang wheels" in step.ready()
    assert "part b/c/d is not on this machine" in lease.stage_wheels("a")
    assert "carry .sglang-whl/b, .sglang-whl/c, .sglang-whl/d" in step.ready()
    assert "part c/d is not on this machine" in lease.stage_wheels("b")
    assert not (tmp_path / "wheels" / "big.whl").exists()  # pieces are joined only once all are there
    assert "part d is not on this machine" in lease.stage_wheels("c")
    assert "unpacked every wheel" in lease.stage_wheels("d")
    assert step.ready() is None and (site / ".sglang-kit").is_file()
    for name, data in contents.items():  # the pieces joined, byte for byte, before the kit ran
        assert (tmp_path / "wheels" / name).read_bytes() == data
        assert name in (site / "seen").read_text().split()
    assert "already unpacked" in lease.stage_wheels("a")


def test_sglang_gets_minisgls_sampling_settings():
    from lab.sglang import sampling_dict
    from minisgl.bench.workloads import w1_top_k_p, w2_latency
    d = sampling_dict(w1_top_k_p().params[0])
    assert d["top_k"] == 50 and d["top_p"] == 0.95 and d["temperature"] == 0.6 and d["ignore_eos"]
    g = sampling_dict(w2_latency().params[0])
    assert g["top_k"] == -1 and g["temperature"] == 0 and g["max_new_tokens"] == 256


def test_no_sys_path_insert_in_the_lab():
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "lab").rglob("*.py") if "sys.path.insert" in p.read_text()]
    assert offenders == []


def test_warmup_check_runs_its_arms_on_their_caches_and_judges_the_targets(tmp_path, monkeypatch):
    """lab.checks.warmup (issue 29) without a GPU: each cold arm gets an empty Triton cache folder, the warm arm
    the first cold one's; the targets are judged on the arms with the warm-up on."""
    from lab.checks import warmup as check

    calls = []

    def fake_arm(model, arm, cache, sweep):
        calls.append((model, arm, cache))
        on = check.ARMS[arm][0]
        return {"startup_s": 25.0 if on else 52.0, "first_over_second": 1.02 if on else 1.2,
                "first": {"compiles": {} if on else {"_extend_kernel": 1}},
                "w1": {"triton_compiles_timed": {}}, "w2": {"triton_compiles_timed": {} if on else {"_x": 1}}}

    monkeypatch.setattr(check, "run_arm", fake_arm)
    res = check.main(str(tmp_path / "w.json"), ["qwen3-0.6b", "qwen3.5-0.8b"], None, False)
    assert [(m, a) for m, a, _ in calls] == [("qwen3-0.6b", "on_cold"), ("qwen3-0.6b", "off_cold"),
                                             ("qwen3-0.6b", "on_warm"), ("qwen3-0.6b", "profile_warm"),
                                             ("qwen3.5-0.8b", "on_cold")]
    caches = {(m, a): c for m, a, c in calls}
    assert caches["qwen3-0.6b", "on_warm"] == caches["qwen3-0.6b", "profile_warm"] == caches["qwen3-0.6b", "on_cold"]
    assert len({caches["qwen3-0.6b", "on_cold"], caches["qwen3-0.6b", "off_cold"],
                caches["qwen3.5-0.8b", "on_cold"]}) == 3
    assert not any(k.startswith("profile_warm") for k in res["models"]["qwen3-0.6b"]["targets"])
    targets = res["models"]["qwen3-0.6b"]["targets"]
    assert targets["on_cold.start_within_target"] and not any(k.startswith("off_cold") for k in targets)
    # every arm with the warm-up on is judged on its first generate, with a next engine or without one
    assert targets["on_warm.first_generate_no_compiles"] and targets["on_cold.first_generate_no_compiles"]
    assert res["ok"] and json.loads((tmp_path / "w.json").read_text())["ok"]
    assert "warmup_check" in sections.SECTIONS and "warmup" in lease.CALLS


def test_warmup_check_profiles_a_start_on_the_warm_cache_without_judging_it(tmp_path, monkeypatch):
    """The warm-up check's profiled start: the cold arm fills a cache, the profile arm starts on that one with
    --profile-start; a profiled start (slowed by the profiler) is judged by no target. profile_table ranks a real
    cProfile's functions by own and by cumulative time."""
    import cProfile
    import subprocess

    from lab.checks import warmup as check

    argvs = []

    def fake_run(argv, cwd, env, timeout):
        argvs.append((argv, env["TRITON_CACHE_DIR"]))
        out = argv[argv.index("--out") + 1]
        Path(out).write_text(json.dumps({"startup_s": 99.0 if "--profile-start" in argv else 25.0}))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    res = check.main(str(tmp_path / "p.json"), ["qwen3-0.6b"], ["on_cold", "profile_warm"], False)
    (cold, cold_cache), (prof, prof_cache) = argvs
    assert "--profile-start" in prof and "--profile-start" not in cold and prof_cache == cold_cache
    targets = res["models"]["qwen3-0.6b"]["targets"]
    assert targets == {"on_cold.start_within_target": True}

    def busy(n):
        return sum(i * i for i in range(n))

    profile = cProfile.Profile()
    profile.enable()
    busy(20000)
    profile.disable()
    rows = check.profile_table(profile, "cumtime", top=5)
    assert len(rows) <= 5 and any("busy" in r["function"] for r in rows)
    assert rows == sorted(rows, key=lambda r: r["cumtime_s"], reverse=True)
    assert "profile_warm" in check.DEFAULT_ARMS["qwen3-0.6b"]


def test_timed_generate_says_where_a_generates_time_went_and_restores_the_engine(qwen3_path, make_llm):
    """The warm-up check's first-run diagnosis on a CPU: every step timed with its phases, the slowest listed, the
    engine's own methods back afterwards (a second call times again from zero)."""
    from lab.checks.warmup import timed_generate
    from minisgl import SamplingParams
    from minisgl.bench.workloads import Workload

    llm = make_llm(qwen3_path)
    w = Workload("tiny", [[5 + i, 9, 11 + i] for i in range(4)],
                 [SamplingParams(max_tokens=6, ignore_eos=True) for _ in range(4)])
    first = timed_generate(llm, w)
    where = first["where"]
    assert first["steps"] >= 6 and first["wall_s"] > 0
    assert set(where["host_s"]) == {"schedule", "launch", "wait"} and where["host_s"]["launch"] > 0
    assert where["steps_s"] <= first["wall_s"] and len(where["slowest_steps_ms"]) == min(10, first["steps"])
    assert all(len(s) == 4 and s[0] + 0.002 >= s[1] + s[2] for s in where["slowest_steps_ms"])  # ms, rounded
    assert "step" not in vars(llm.engine) and "schedule" not in vars(llm.engine.scheduler)
    assert timed_generate(llm, w)["steps"] == first["steps"]


def test_api_check_step_unzips_the_carried_wheels_onto_its_path(tmp_path, monkeypatch):
    """The `checks` call's API step: the wheels carried in .sglang-whl/api are unzipped once into its site folder,
    which leads the step's PYTHONPATH (xgrammar for the structured-output arms)."""
    import zipfile
    wheels = tmp_path / "repo" / lease.API_WHEELS
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "xgrammar-0-py3-none-any.whl", "w") as z:
        z.writestr("xgrammar/__init__.py", "VERSION = 'test'\n")
    monkeypatch.setattr(lease, "REPO", tmp_path / "repo")
    monkeypatch.setattr(lease, "API_SITE", tmp_path / "site-api")
    step = lease.ApiCheck("api", 200, ("api_check.json",))
    step.prepare()
    assert (tmp_path / "site-api" / "xgrammar" / "__init__.py").read_text() == "VERSION = 'test'\n"
    assert step.env()["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site-api")
    assert step.argv("/o")[-2:] == ["lab.checks.h200_api_check", "/o"] and step.ready() is None


FAKE_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def serve_bench_here(tmp_path, monkeypatch):
    """serve-bench without the device: no model folder, the kit's serve wheels marked unpacked, logs in tmp_path."""
    monkeypatch.setattr(lease, "write_serve_model", lambda: None)
    (tmp_path / "site-serve").mkdir()
    (tmp_path / "site-serve" / ".done").write_text("")
    monkeypatch.setattr(lease, "SERVE_SITE", tmp_path / "site-serve")
    monkeypatch.setattr(lease, "LOGS", tmp_path / "logs")
    (tmp_path / "logs").mkdir()


# SGLang's client module as lab.serve_client imports it: cli_main reads sys.argv, calls get_dataset and benchmark
# by their global names, writes bench_serving's line; a rate of 99 makes it give up as the real one does (sys.exit)
FAKE_CLIENT = """
import asyncio, json, sys
from types import SimpleNamespace

def get_dataset(args, tokenizer, model_id=None):
    return [SimpleNamespace(prompt="two words", output_len=4), SimpleNamespace(prompt=[5, 6, 7], output_len=2)]

async def request(row, i):
    return SimpleNamespace(start_time=1000.0 + i, ttft=0.01 * (i + 1))

ASYNC_REQUEST_FUNCS = {"vllm": request}

async def benchmark(rows, rate):
    request_func = ASYNC_REQUEST_FUNCS["vllm"]  # looked up per run, as the real client does
    outs = [await request_func(row, i) for i, row in enumerate(rows)]
    return {"completed": len(rows), "ttfts": [o.ttft for o in outs],
            "input_lens": [2, 3], "output_lens": [r.output_len for r in rows], "itls": [[0.001]] * len(rows)}

def cli_main():
    a = sys.argv
    rate = float(a[a.index("--request-rate") + 1])
    rows = get_dataset(None, None)
    if rate == 99:
        sys.exit(1)
    result = asyncio.run(benchmark(rows, rate))
    with open(a[a.index("--output-file") + 1], "a") as f:
        f.write(json.dumps({"request_rate": rate, "completed": result["completed"], "median_ttft_ms": 20.0 + rate,
                            "p99_itl_ms": 30.0, "output_throughput": 4700.0}) + "\\n")
"""


def test_serve_bench_runs_the_client_once_a_server_and_the_offline_engine_on_the_same_requests(
        tmp_path, monkeypatch, serve_bench_here):
    """serve-bench (issue 24) without the kit: a stand-in server that answers /health and a stand-in for SGLang's
    client module, run by the real lab.serve_client (one process for every load, the all-at-once load's requests
    kept); the summary is a lab section (commit, each load's figures by rate, return codes), and the offline run
    gets the very requests the client generated."""
    fake = tmp_path / "fake-sglang"
    (fake / "sglang" / "benchmark").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "benchmark" / "__init__.py").write_text("")
    (fake / "sglang" / "benchmark" / "serving.py").write_text(FAKE_CLIENT)
    monkeypatch.setattr(lease, "client_env", lambda: {"PYTHONPATH": os.pathsep.join([str(fake), str(REPO)])})
    monkeypatch.setitem(lease.SERVERS, "minisgl", [sys.executable, "-c", FAKE_SERVER, "{port}"])
    monkeypatch.setitem(lease.LOADS, "rate99", ("99", 2, 4, 0.5))
    offline_got = []

    def offline(kept):
        offline_got.append(json.loads(Path(kept).read_text()))
        return {"requests": 2, "output_tok_s": 5000.0}

    monkeypatch.setattr(lease, "offline_same_requests", offline)
    lease.serve_bench(str(tmp_path), ["rate24", "rate99", "burst"], ["minisgl"], "serving_x")
    data = json.loads((tmp_path / "serving_x.json").read_text())
    assert data["environment"]["git_commit"] and "--servers minisgl" in data["command"]
    result = data["sections"]["serving_x"]["result"]
    server = result["servers"]["minisgl"]
    assert server["ready_s"] is not None, server.get("error")
    assert server["runs"] == [{"load": "rate24", "returncode": 0}, {"load": "rate99", "returncode": 1},
                              {"load": "burst", "returncode": 0}]
    assert server["results"]["rate24"]["median_ttft_ms"] == 44.0 and "rate99" not in server["results"]
    assert offline_got == [[{"prompt": "two words", "output_len": 4}, {"prompt": [5, 6, 7], "output_len": 2}]]
    assert result["offline"]["output_tok_s"] == 5000.0 and result["server_over_offline"] == 4700.0 / 5000.0
    assert (tmp_path / "serving_x_minisgl.jsonl").is_file() and not lease.port_answers(30001)
    # each load's TTFTs, request by request, in the call's logs (the JSONL line has only percentiles)
    details = json.loads((tmp_path / "logs" / "client_minisgl_burst.json").read_text())
    started, ended = details.pop("started"), details.pop("ended")
    assert details.pop("starts") == [[1000.0, 0.01], [1001.0, 0.02]]  # each request's clock and TTFT
    assert details == {"ttfts": [0.01, 0.02], "input_lens": [2, 3], "output_lens": [4, 2]} and started <= ended
    assert not (tmp_path / "logs" / "client_minisgl_rate99.json").exists()


def test_engine_side_splits_the_request_log_by_the_clients_runs(tmp_path):
    """minisgl's --request-log lines go to the load whose client run holds their arrival; each load says when its
    requests reached the engine and how long the engine took to their first token, by arrival eighths too."""
    log = tmp_path / "requests.jsonl"
    lines = [{"rid": i, "arrival": 100.0 + 0.01 * i, "first_token": 100.0 + 0.01 * i + 0.001 * (i + 1)}
             for i in range(16)]  # the burst's: the engine's wait grows by 1 ms a request
    lines[3].update(gaps=100, long_gaps=[[100.12, 0.05], [100.3, 0.04]])  # requests 8-11 arrived in the first
    lines[4].update(gaps=100, long_gaps=[[100.5, 0.02]])
    lines += [{"rid": 16, "arrival": 200.5, "first_token": 200.52}, {"rid": 17, "arrival": 300.0,
                                                                        "first_token": None}]  # rate24's; an error
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "client_x_burst.json").write_text(json.dumps({"started": 99.9, "ended": 110.0}))
    (tmp_path / "client_x_rate24.json").write_text(json.dumps({"started": 200.0, "ended": 210.0}))
    got = lease.engine_side(log, tmp_path / "client_x", ["rate24", "burst", "rate48"])
    assert set(got) == {"rate24", "burst"}
    assert got["rate24"]["requests"] == 1 and got["rate24"]["arrival_ms_max"] == pytest.approx(500.0)
    assert got["rate24"]["engine_ttft_ms_median"] == pytest.approx(20.0)
    burst = got["burst"]
    assert burst["requests"] == 16 and burst["arrival_ms_max"] == pytest.approx(250.0)
    assert burst["engine_ttft_ms_median_by_arrival_eighth"] == pytest.approx([1.5 + 2 * k for k in range(8)])
    assert burst["engine_ttft_ms_p99"] == pytest.approx(16.0)
    # 200 gaps, 3 long: the two longest are above the P99, the third is it; one had an arrival inside it
    assert burst["engine_itl_ms_p99"] == pytest.approx(20.0) and burst["long_gap_ms_max"] == pytest.approx(50.0)
    assert (burst["long_gaps"], burst["long_gaps_with_an_arrival"]) == (3, 1)
    assert got["rate24"]["engine_itl_ms_p99"] is None and got["rate24"]["long_gaps"] == 0


def test_the_client_side_and_the_engine_side_share_the_first_measured_send_as_origin(tmp_path):
    """The client's starts (the warm-up's first, dropped) give the origin: when the requests started their clocks
    and got their first tokens on the client, and when they reached the engine and got them there."""
    starts = [[90.0, 0.01]] + [[100.0 + 0.01 * i, 0.5] for i in range(4)]  # the warm-up, then 4 sent 10 ms apart
    (tmp_path / "client_x_burst.json").write_text(json.dumps({"started": 89.0, "ended": 110.0, "starts": starts}))
    (tmp_path / "client_x_rate24.json").write_text(json.dumps({"started": 200.0, "ended": 210.0}))  # no starts
    got = lease.client_side(tmp_path / "client_x", ["burst", "rate24"])
    assert set(got) == {"burst"} and got["burst"]["requests"] == 4
    burst = got["burst"]
    assert burst["sends_ms_median"] == pytest.approx(15.0) and burst["sends_ms_max"] == pytest.approx(30.0)
    assert burst["first_token_ms_median"] == pytest.approx(515.0)
    log = tmp_path / "requests.jsonl"
    lines = [{"rid": 0, "arrival": 90.001, "first_token": 90.005}]  # the warm-up's
    lines += [{"rid": i + 1, "received": 100.1 + 0.01 * i, "arrival": 100.2 + 0.01 * i, "first_token": 100.4 + 0.01 * i}
              for i in range(4)]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    side = lease.engine_side(log, tmp_path / "client_x", ["burst"])["burst"]["from_first_send_ms"]
    assert side == pytest.approx({"received_first": 100.0, "received_median": 115.0, "received_max": 130.0,
                                  "arrival_first": 200.0, "arrival_median": 215.0, "arrival_max": 230.0,
                                  "first_token_median": 415.0})


def test_step_side_splits_the_step_log_into_prefill_and_decode_turns(tmp_path):
    """--step-log lines in the client's run window: two prefill steps of 8192 prompt tokens 50 ms apart, then decode
    steps 10 ms apart; a turn that launched nothing is skipped; the steps before the run are not its."""
    log = tmp_path / "steps.jsonl"

    def step(t, prompt, rows, kind):
        return {"t": t, "drain_ms": 0.1, "step_ms": 1.0, "news_ms": 0.4, "running": rows, "waiting": 0,
                "reqs": rows + (prompt > 0), "decode_rows": rows, "prompt_tokens": prompt, "kind": kind}

    lines = [step(5.0, 100, 0, "eager"), step(100.0, 8192, 10, "eager"), step(100.05, 8192, 20, "eager")]
    lines += [step(100.1 + 0.01 * i, 0, 30, "graph") for i in range(5)]
    lines.insert(4, {"t": 100.105, "drain_ms": 0.0, "step_ms": 0.0, "news_ms": 0.1, "running": 0, "waiting": 0})
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "client_x_burst.json").write_text(json.dumps({"started": 99.0, "ended": 101.0}))
    got = lease.step_side(log, tmp_path / "client_x", ["burst", "rate24"])["burst"]
    assert got["steps"] == 6 and got["kinds"] == {"eager": 2, "graph": 4}  # the last step has no next turn
    assert got["prompt_steps"] == 2 and got["prompt_turn_ms_median"] == pytest.approx(50.0)
    assert got["prompt_tok_s"] == pytest.approx(2 * 8192 / 0.1) and got["prompt_step_decode_rows_median"] == 15
    assert got["decode_turn_ms_median"] == pytest.approx(10.0, abs=0.01) and got["host_ms_median"] == pytest.approx(0.5)


def test_the_offline_run_takes_the_kept_requests_text_or_ids(tmp_path, monkeypatch, qwen3_tok_path):
    """What the offline half of serve-bench runs: the kept requests (random-ids prompts come as text, which the
    engine tokenizes as the server does), greedy, each to its length; every output token counted."""
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps([{"prompt": "hello there", "output_len": 3}, {"prompt": [5, 6, 7], "output_len": 2}]))
    monkeypatch.setattr(lease, "SERVE_MODEL", str(qwen3_tok_path))
    got = lease.offline_same_requests(str(kept))
    assert got["requests"] == 2 and got["output_tokens"] == 5 and got["output_tok_s"] > 0
    assert got["prompt_tokens"] > 3 and 0 < got["ttft_median_ms"] <= got["ttft_max_ms"]


def test_serve_bench_never_measures_a_server_it_did_not_start_and_stops_its_own_when_stopped(tmp_path, monkeypatch,
                                                                                               serve_bench_here):
    """run16: a serving step stopped at its call's budget left SGLang's server running, and the next call's
    client, on the same port, measured it as minisgl's. Now a port that already answers is refused (the server
    is recorded as not run), and a step stopped mid-client (SIGTERM, which serve-bench's main turns into
    SystemExit) still stops its server and keeps the summary of what ran."""
    import subprocess as sp
    import time as _time
    for name in ("first", "second"):
        monkeypatch.setitem(lease.SERVERS, name, [sys.executable, "-c", FAKE_SERVER, "{port}"])
    squatter = sp.Popen([sys.executable, "-c", FAKE_SERVER, "30001"], start_new_session=True)
    try:
        for _ in range(100):
            if lease.port_answers(30001):
                break
            _time.sleep(0.1)

        def client(*args, **kwargs):
            raise SystemExit(143)  # the step's SIGTERM arrives while the client runs

        monkeypatch.setattr(lease, "run_client", client)
        with pytest.raises(SystemExit):
            lease.serve_bench(str(tmp_path), ["rate24"], ["first", "second"], "serving_y")
    finally:
        squatter.kill()
        squatter.wait()
        for _ in range(100):  # the next test takes port 30001 again: leave it free (a CI run once found it taken)
            if not lease.port_answers(30001):
                break
            _time.sleep(0.1)
    servers = json.loads((tmp_path / "serving_y.json").read_text())["sections"]["serving_y"]["result"]["servers"]
    assert "already answers" in servers["first"]["error"] and servers["first"]["runs"] == []
    assert servers["second"]["ready_s"] is not None and servers["second"]["results"] == {}
    assert not lease.port_answers(30002)  # the server serve-bench started is gone


def test_serve_bench_says_why_a_server_never_became_healthy(tmp_path, monkeypatch, serve_bench_here):
    """A server that dies at start (a bad flag, a port taken) is recorded with its exit code and its last log
    lines, not only as ready_s None (a CI simulation once had the stand-in server above never answer, and nothing
    said why)."""
    monkeypatch.setitem(lease.SERVERS, "broken", [sys.executable, "-c", "import sys; print('no such flag'); "
                                                                        "sys.exit(3)", "{port}"])
    lease.serve_bench(str(tmp_path), ["rate24"], ["broken"], "serving_z")
    server = json.loads((tmp_path / "serving_z.json").read_text())["sections"]["serving_z"]["result"]["servers"][
        "broken"]
    assert server["ready_s"] is None and server["runs"] == []
    assert "exit code 3" in server["error"] and "no such flag" in server["error"]


def test_serve_summary_rebuilds_a_stopped_steps_summary_from_the_client_lines(tmp_path):
    (tmp_path / "serving_minisgl.jsonl").write_text(json.dumps({"request_rate": 24.0, "median_ttft_ms": 14.1}) + "\n")
    (tmp_path / "env.json").write_text(json.dumps({"environment": {"git_commit": "abc", "gpu": "NVIDIA H200"}}))
    assert lease.main(["serve-summary", "--out", str(tmp_path), "--servers", "minisgl,sglang", "--loads",
                       "rate24,rate48", "--environment-from", str(tmp_path / "env.json"), "--time-utc", "T"]) == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    assert data["environment"]["git_commit"] == "abc" and data["environment"]["time_utc"] == "T"
    assert "rebuilt" in data["environment"]
    servers = data["sections"]["serving"]["result"]["servers"]
    assert servers["minisgl"]["results"] == {"rate24": {**dict.fromkeys(lease.SERVING_KEYS), "median_ttft_ms": 14.1}}
    assert servers["sglang"]["results"] == {}
