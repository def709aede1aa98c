"""The command line: one engine flag set (SGLang's names, generated from EngineConfig) for generate, bench and
serve, through the real entry points."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import BROKEN_MODELS, make_broken_model

import minisgl
import minisgl.server.launch as launch
from minisgl.__main__ import main
from minisgl.config import EngineConfig, KernelOptions, add_engine_args, engine_kwargs_from_args, make_config

REPO = Path(__file__).resolve().parents[1]

ALL_FLAGS = ["--prefill-graph-max-tokens", "512", "--prefill-graph-max-reqs", "4", "--disable-kernel-warmup",
             "--disable-gc-freeze",
             "--tp-size", "2",
             "--dtype", "float32", "--device", "cpu", "--load-format", "dummy", "--random-seed", "3",
             "--context-length", "256", "--page-size", "4", "--num-pages", "100", "--kv-memory-fraction", "0.5",
             "--kv-cache-tokens", "4096", "--max-running-requests", "8", "--chunked-prefill-size", "0",
             "--max-prefill-tokens", "64", "--mixed-prefill-tokens", "32",
             "--disable-radix-cache",
             "--disable-overlap-schedule",
             "--disable-cuda-graph", "--cuda-graph-max-bs", "16", "--disable-cuda-graph-split",
             "--disable-graph-staged-inputs", "--disable-gemv",
             "--disable-pdl", "--disable-decode-fused-store", "--enable-decode-fused-merge",
             "--disable-mixed-decode-split", "--gemv-configs", "t.json", "--gemv-pdl-early-tiles", "1",
             "--decode-split-waves", "4",
             "--disable-sampler-skip-blocks", "--disable-sampler-top-k-bound", "--disable-sampler-fused-ends",
             "--disable-zero-copy-io", "--disable-sampler-fused-narrow", "--disable-gemv-norm-fold",
             "--disable-gemv-fold-sum-squares", "--disable-gemv-act-epilogue", "--enable-gemv-prefetch",
             "--gemv-stages", "3", "--gemv-mlp-prefetch-mb", "8", "--enable-decode-prefetch-next-kv",
             "--disable-extend-tiles", "--disable-early-metadata", "--disable-early-kv", "--disable-decode-fused-rope",
             "--enable-decode-megakernel", "--decode-megakernel-regs", "168", "--attention-backend", "torch",
             "--state-snapshots", "5",
             "--state-snapshot-memory-fraction", "0.1", "--cpu-threads", "3"]
ALL_KWARGS = dict(dtype="float32", device="cpu", load_format="dummy", seed=3, max_model_len=256, page_size=4,
                  num_pages=100, kv_memory_fraction=0.5, kv_cache_tokens=4096, max_running_requests=8,
                  chunked_prefill_size=0, max_prefill_tokens=64, mixed_prefill_tokens=32,
                  radix_cache=False,
                  overlap=False, cuda_graph=False,
                  cuda_graph_max_bs=16, cuda_graph_split=False, graph_staged_inputs=False,
                  gemv=False, pdl=False, decode_fused_store=False,
                  decode_fused_merge=True, mixed_decode_split=False, gemv_configs="t.json", gemv_pdl_early_tiles=1,
                  decode_split_waves=4, gemv_norm_fold=False, gemv_fold_sum_squares=False, gemv_act_epilogue=False,
                  gemv_prefetch=True, gemv_stages=3, gemv_mlp_prefetch_mb=8, extend_tiles=False, early_metadata=False,
                  early_kv=False, decode_prefetch_next_kv=True, decode_fused_rope=False,
                  decode_megakernel=True,
                  decode_megakernel_regs=168,
                  sampler_skip_blocks=False, sampler_top_k_bound=False, sampler_fused_ends=False,
                  zero_copy_io=False, sampler_fused_narrow=False, attention_backend="torch",
                  prefill_graph_max_tokens=512, prefill_graph_max_reqs=4, kernel_warmup=False, gc_freeze=False,
                  tp_size=2,
                  state_snapshots=5,
                  state_snapshot_memory_fraction=0.1, cpu_threads=3)


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
                                        decode_split_waves=4, gemv_norm_fold=False, gemv_fold_sum_squares=False,
                                        gemv_act_epilogue=False, gemv_prefetch=True, gemv_stages=3,
                                        gemv_mlp_prefetch_mb=8, decode_prefetch_next_kv=True, extend_tiles=False,
                                        early_metadata=False,
                                        early_kv=False,
                                        decode_fused_rope=False, decode_megakernel=True, decode_megakernel_regs=168,
                                        sampler_skip_blocks=False, sampler_top_k_bound=False,
                                        sampler_fused_ends=False, zero_copy_io=False, sampler_fused_narrow=False)
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
    # a "%" in a flag's help is text: argparse once printed the action's dict in its place ("'dest': ...")
    assert "0.935 ms (-2.9%) on" in " ".join(ok.stdout.split()) and "'dest'" not in ok.stdout
    bad = subprocess.run([sys.executable, *module, "--model", "m", "--no-overlap"], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --no-overlap" in bad.stderr


# --- errors: one line on stderr, exit status 2 (the command line is wrong) or 1 (it cannot run here) -----------
def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def _one_line_error(err: str, prog: str = "minisgl generate") -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


BAD_FLAGS = [  # (flags, exit status, words of the message, skip reason or None)
    (["--num-pages", "-3"], 2, "--num-pages must be an integer >= 1", None),
    (["--max-model-len", "-1"], 2, "--context-length/--max-model-len must be an integer >= 2", None),
    (["--device", "bogus"], 2, "--device must be auto, cpu, cuda or cuda:N, got 'bogus'", None),
    (["--kv-memory-fraction", "0"], 2, "--kv-memory-fraction must be in (0, 1]", None),
    (["--max-tokens", "0"], 2, "max_tokens must be a positive integer", None),
    (["--temperature", "-1"], 2, "temperature must be", None),
    (["--device", "cuda"], 1, "torch sees no CUDA GPU", "a GPU is visible" if torch.cuda.is_available() else None),
    (["--attention-backend", "triton"], 1, "needs Triton", "Triton is installed" if _has("triton") else None),
    (["--attention-backend", "flashinfer"], 1, "needs FlashInfer",
     "FlashInfer is installed" if _has("flashinfer") and torch.cuda.is_available() else None),
]


@pytest.mark.parametrize("flags, status, words, skip", BAD_FLAGS, ids=[" ".join(c[0]) for c in BAD_FLAGS])
def test_bad_flag_is_one_line(flags, status, words, skip, qwen3_tok_path, capsys):
    if skip:
        pytest.skip(skip)
    assert main(["generate", "--model", qwen3_tok_path, "--prompt", "w5 w6", "--max-tokens", "2", *flags]) == status
    out, err = capsys.readouterr()
    assert words in _one_line_error(err) and out == ""


@pytest.mark.parametrize("kind", sorted(BROKEN_MODELS))
def test_broken_model_folder_is_one_line(kind, qwen3_tok_path, tmp_path, capsys):
    path = make_broken_model(qwen3_tok_path, str(tmp_path / kind), kind)
    assert main(["generate", "--model", path, "--prompt", "w5 w6", "--max-tokens", "2"]) == 1
    line = _one_line_error(capsys.readouterr().err)
    assert BROKEN_MODELS[kind] in line and path in line


def test_top_k_past_int64_generates(qwen3_tok_path, capsys):
    """--top-k 9223372036854775808 keeps every token, like --top-k -1 (it was an OverflowError traceback)."""
    common = ["generate", "--model", qwen3_tok_path, "--prompt", "w5 w6", "--max-tokens", "6", "--ignore-eos",
              "--temperature", "1", "--random-seed", "3"]
    assert main([*common, "--top-k", str(2**63)]) == 0
    huge = capsys.readouterr()
    assert main([*common, "--top-k", "-1"]) == 0
    assert huge.out == capsys.readouterr().out and huge.out.startswith("w5 w6") and huge.err == ""


def test_traceback_flag_shows_the_traceback(qwen3_tok_path, tmp_path, capsys):
    path = make_broken_model(qwen3_tok_path, str(tmp_path / "m"), "weights_empty")
    assert main(["generate", "--model", path, "--prompt", "w5", "--traceback"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("minisgl generate: error: ")


@pytest.mark.parametrize("module, flags, status, words", [
    (["-m", "minisgl", "generate", "--prompt", "w5"], ["--num-pages", "-3"], 2, "--num-pages must be"),
    (["-m", "minisgl.server"], ["--device", "bogus"], 2, "--device must be"),
    (["-m", "minisgl", "generate", "--prompt", "w5"], ["weights_random"], 1, "is not a readable safetensors file"),
    (["-m", "minisgl", "serve", "--port", "0"], ["config_truncated"], 1, "is not valid JSON"),
], ids=["generate-usage", "server-usage", "generate-runtime", "serve-runtime"])
def test_real_process_errors(module, flags, status, words, qwen3_tok_path, tmp_path):
    """The processes themselves: one line on stderr, no traceback, the exit status."""
    model = qwen3_tok_path
    if flags[0] in BROKEN_MODELS:
        model, flags = make_broken_model(qwen3_tok_path, str(tmp_path / "m"), flags[0]), []
    run = subprocess.run([sys.executable, *module, "--model", model, *flags], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert run.returncode == status, run.stderr
    prog = "minisgl serve" if "serve" in module or module[-1] == "minisgl.server" else "minisgl generate"
    assert words in _one_line_error(run.stderr, prog)


def test_cpu_threads_default_leaves_a_core_free(monkeypatch):
    """--cpu-threads 0 (auto): one fewer than the usable cores, split between TP ranks, at least 1; an explicit
    OMP_NUM_THREADS is kept (torch applied it at start-up); a positive value is taken as given."""
    import torch

    from minisgl.engine.model_runner import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cores, tp, want in ((2, 1, 1), (1, 1, 1), (16, 1, 15), (16, 2, 7), (2, 2, 1)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert cpu_threads(EngineConfig("m", tp_size=tp)) == want, (cores, tp)
    assert cpu_threads(EngineConfig("m", cpu_threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads(EngineConfig("m")) == torch.get_num_threads()
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig("m", cpu_threads=-1).validate()


def test_cpu_engine_sets_its_threads(qwen3_path, make_llm):
    import torch

    before = torch.get_num_threads()
    try:
        make_llm(qwen3_path, device="cpu", cpu_threads=2, kv_cache_tokens=256)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
