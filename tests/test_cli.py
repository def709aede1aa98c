"""The command line: one engine flag set (SGLang's names, generated from EngineConfig) for generate, bench and
serve, through the real entry points."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import minisgl
import minisgl.server.launch as launch
from minisgl.__main__ import main
from minisgl.config import EngineConfig, KernelOptions, add_engine_args, engine_kwargs_from_args, make_config

REPO = Path(__file__).resolve().parents[1]

ALL_FLAGS = ["--prefill-graph-max-tokens", "512", "--prefill-graph-max-reqs", "4", "--tp-size", "2",
             "--dtype", "float32", "--device", "cpu", "--load-format", "dummy", "--random-seed", "3",
             "--context-length", "256", "--page-size", "4", "--num-pages", "100", "--kv-memory-fraction", "0.5",
             "--kv-cache-tokens", "4096", "--max-running-requests", "8", "--chunked-prefill-size", "0",
             "--max-prefill-tokens", "64", "--disable-radix-cache", "--disable-overlap-schedule",
             "--disable-cuda-graph", "--cuda-graph-max-bs", "16", "--disable-cuda-graph-split", "--disable-gemv",
             "--disable-pdl", "--disable-decode-fused-store", "--enable-decode-fused-merge",
             "--disable-mixed-decode-split", "--gemv-configs", "t.json", "--gemv-pdl-early-tiles", "1",
             "--disable-sampler-skip-blocks", "--disable-sampler-top-k-bound",
             "--attention-backend", "torch", "--state-snapshots", "5", "--state-snapshot-memory-fraction", "0.1"]
ALL_KWARGS = dict(dtype="float32", device="cpu", load_format="dummy", seed=3, max_model_len=256, page_size=4,
                  num_pages=100, kv_memory_fraction=0.5, kv_cache_tokens=4096, max_running_requests=8,
                  chunked_prefill_size=0, max_prefill_tokens=64, radix_cache=False, overlap=False, cuda_graph=False,
                  cuda_graph_max_bs=16, cuda_graph_split=False, gemv=False, pdl=False, decode_fused_store=False,
                  decode_fused_merge=True, mixed_decode_split=False, gemv_configs="t.json", gemv_pdl_early_tiles=1,
                  sampler_skip_blocks=False, sampler_top_k_bound=False, attention_backend="torch",
                  prefill_graph_max_tokens=512, prefill_graph_max_reqs=4, tp_size=2, state_snapshots=5,
                  state_snapshot_memory_fraction=0.1)


# KernelOptions' launch tables are set from Python by the tuning scripts; triton_on_cpu is for tests
NO_FLAG = {"model", "progress", "kernels", "norm_configs", "sampler_launch", "gdn", "triton_on_cpu"}


def test_every_field_has_one_flag():
    fields = {f.name for cls in (EngineConfig, KernelOptions) for f in dataclasses.fields(cls)} - NO_FLAG
    assert set(ALL_KWARGS) == fields, "a new EngineConfig / KernelOptions field needs a flag (and a line here)"
    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--model", "m", *ALL_FLAGS])
    assert engine_kwargs_from_args(args) == ALL_KWARGS
    cfg = make_config(args.model, **engine_kwargs_from_args(args))
    assert not cfg.chunked_prefill and cfg.prefill_budget == 64
    # the kernel flags land in the engine's KernelOptions
    assert cfg.kernels == KernelOptions(pdl=False, decode_fused_store=False, decode_fused_merge=True,
                                        mixed_decode_split=False, gemv_configs="t.json", gemv_pdl_early_tiles=1,
                                        sampler_skip_blocks=False, sampler_top_k_bound=False)
    # nothing given: no keyword, so EngineConfig's defaults are the only defaults
    assert engine_kwargs_from_args(p.parse_args(["--model", "m"])) == {}


def test_chunking_is_one_field():
    cfg = EngineConfig("m")
    assert cfg.chunked_prefill and cfg.prefill_budget == 8192
    assert not cfg.with_(chunked_prefill_size=-1).chunked_prefill
    assert cfg.with_(chunked_prefill_size=0).prefill_budget == cfg.max_prefill_tokens
    with pytest.raises(TypeError, match="chunked_prefill_size=0"):
        minisgl.LLM("m", chunked_prefill=False)  # the old spelling names the new one before loading anything


class _Recorder:
    """Stands in for LLM / run_serve: records what the command line passes."""

    calls: list = []

    def __init__(self, model, **kw):
        _Recorder.calls.append((model, kw))
        raise SystemExit(0)


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["bench", "--workload", "w1"]])
def test_generate_and_bench_take_the_flags(monkeypatch, command):
    _Recorder.calls = []
    monkeypatch.setattr(minisgl, "LLM", _Recorder)
    with pytest.raises(SystemExit):
        main([command[0], "--model", "m", *ALL_FLAGS, *command[1:]])
    (model, kw), = _Recorder.calls
    assert model == "m" and {k: v for k, v in kw.items() if k != "progress"} == ALL_KWARGS


@pytest.mark.parametrize("entry", ["minisgl", "minisgl.server"])
def test_serve_takes_the_flags(monkeypatch, entry):
    seen = []
    monkeypatch.setattr(launch, "run_serve", lambda a: seen.append(a) or 0)
    argv = ["--model", "m", "--port", "8001", *ALL_FLAGS]
    assert (main(["serve", *argv]) if entry == "minisgl" else launch.main(argv)) == 0
    args, = seen
    assert args.port == 8001 and engine_kwargs_from_args(args) == ALL_KWARGS


@pytest.mark.parametrize("module", [["-m", "minisgl", "serve"], ["-m", "minisgl.server"]])
def test_real_entry_points_parse(module):
    """The processes themselves: SGLang's flags are taken, the old generated set (--no-overlap) is gone."""
    ok = subprocess.run([sys.executable, *module, "--model", "m", "--disable-overlap-schedule",
                         "--chunked-prefill-size", "0", "--help"], capture_output=True, text=True, cwd=REPO,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "--disable-overlap-schedule" in ok.stdout and "--no-overlap" not in ok.stdout
    bad = subprocess.run([sys.executable, *module, "--model", "m", "--no-overlap"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --no-overlap" in bad.stderr
