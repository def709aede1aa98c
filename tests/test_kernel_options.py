"""Kernel options (minisgl/config.py `KernelOptions`, applied by kernels/options.py): one frozen set per engine,
from keywords, flags or the environment's defaults, and two engines with different options in one process each
running under their own, with the tokens Hugging Face gives.

The Triton part runs the kernels under the Triton interpreter (skipped where Triton is not installed); the
CUDA-graph side (each captured graph keeps its engine's options) is checked on a GPU by
lab/checks/engine_options.py."""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("triton") is not None:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

from dataclasses import replace

import pytest
from helpers import assert_parity, hf_greedy

from minisgl import SamplingParams
from minisgl.config import EngineConfig, KernelOptions, SamplerLaunch, make_config
from minisgl.kernels.options import current_options, use_options

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_options_by_name_and_as_an_object():
    base = KernelOptions(decode_fused_merge=True, gemv_pdl_early_tiles=1)
    cfg = make_config("m", kernels=base, pdl=False)  # a field by name goes on top of kernels=
    assert cfg.kernels == replace(base, pdl=False)
    assert make_config("m").kernels == EngineConfig("m").kernels  # the defaults (the environment's, if any)
    with pytest.raises(ValueError, match="gemv_pdl_early_tiles"):
        make_config("m", gemv_pdl_early_tiles=7).validate()
    for stages in (0, 5):
        with pytest.raises(ValueError, match="gemv_stages"):
            make_config("m", gemv_stages=stages).validate()
    with pytest.raises(ValueError, match="stats block"):
        make_config("m", sampler_launch=SamplerLaunch(chunk=1000)).validate()
    with pytest.raises(TypeError):
        EngineConfig("m", pdl=False)  # EngineConfig itself has one place for them: `kernels`


def test_use_options_is_scoped():
    before = current_options()
    inner = replace(before, decode_fused_store=not before.decode_fused_store)
    with use_options(inner):
        assert current_options() is inner
        with use_options(before):
            assert current_options() is before
        assert current_options() is inner
    assert current_options() is before
    with pytest.raises(TypeError):
        with use_options({"pdl": False}):
            pass


def test_two_engines_keep_their_own_options_on_the_torch_path(make_llm, qwen3_path, monkeypatch):
    """Without Triton (CI): two engines with different options, interleaved; each step runs under its own engine's
    options and both give HF's tokens."""
    from minisgl.engine.model_runner import ModelRunner

    seen = []
    step = ModelRunner._forward

    def recording(self, batch):
        seen.append((id(self), current_options()))
        return step(self, batch)

    monkeypatch.setattr(ModelRunner, "_forward", recording)
    a = make_llm(qwen3_path, pdl=False, decode_fused_store=False, gemv_pdl_early_tiles=0)
    b = make_llm(qwen3_path, decode_fused_merge=True, sampler_top_k_bound=False)
    prompts = [[5, 9, 17, 3, 44], [100, 4, 4]]
    refs = hf_greedy(qwen3_path, prompts, max_new_tokens=6)
    for llm in (a, b, a):
        assert_parity(llm.generate(prompts, GREEDY), refs, prompts)
    options = {id(a.engine.runner): a.config.kernels, id(b.engine.runner): b.config.kernels}
    assert a.config.kernels != b.config.kernels and len({runner for runner, _ in seen}) == 2
    assert all(in_force == options[runner] for runner, in_force in seen)


@pytest.fixture
def interpreted():
    pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")
    from helpers import use_triton_interpreter
    use_triton_interpreter("minisgl.kernels.elementwise", "minisgl.kernels.attention",
                           "minisgl.attention.triton_backend")


def test_two_engines_with_different_options_on_the_triton_path(interpreted, make_llm, qwen3_path, monkeypatch):
    """Two engines on the Triton attention backend (the interpreter) in one process, interleaved: A stores a decode
    step's K/V inside the decode kernel, sends a mixed step's decode rows through the decode kernel and runs its
    norms/RoPE/SiLU as Triton kernels too; B does none of that. Every launch follows its own engine's options,
    and both engines give HF's greedy tokens."""
    from triton.runtime.interpreter import InterpretedFunction

    from minisgl.attention import triton_backend

    launches = []  # (options in force, kernel, fused K/V store or None)
    decode = triton_backend.decode_attention

    def recorded_decode(*args, **kwargs):
        launches.append((current_options(), "decode_attention", kwargs.get("new_kv") is not None))
        return decode(*args, **kwargs)

    run = InterpretedFunction.run

    def recorded_run(self, *args, **kwargs):
        launches.append((current_options(), self.fn.__name__, None))
        return run(self, *args, **kwargs)

    mixed = triton_backend.TritonAttentionBackend._mixed_decode_rows

    def recorded_mixed(self, n, *args):
        launches.append((current_options(), "mixed_decode_rows", None))
        return mixed(self, n, *args)

    monkeypatch.setattr(triton_backend, "decode_attention", recorded_decode)
    monkeypatch.setattr(InterpretedFunction, "run", recorded_run)
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "_mixed_decode_rows", recorded_mixed)
    common = dict(dtype="float32", attention_backend="triton", page_size=4, chunked_prefill_size=8)
    a = make_llm(qwen3_path, decode_fused_store=True, mixed_decode_split=True, triton_on_cpu=True, **common)
    b = make_llm(qwen3_path, decode_fused_store=False, mixed_decode_split=False, triton_on_cpu=False, **common)
    # a short prompt decodes while the long one is still in chunks of 8: mixed steps
    prompts = [[7, 3], [5, 9, 17, 3, 44, 8, 21, 60, 2, 7, 11, 13, 14, 15, 16, 19, 23, 29, 31, 37]]
    refs = hf_greedy(qwen3_path, prompts, max_new_tokens=6)
    for llm in (a, b, a, b):
        assert_parity(llm.generate(prompts, GREEDY), refs, prompts)
    by = {opts: [(kernel, fused) for o, kernel, fused in launches if o == opts]
          for opts in (a.config.kernels, b.config.kernels)}
    assert sum(map(len, by.values())) == len(launches), "every launch ran under one engine's options"
    on, off = by[a.config.kernels], by[b.config.kernels]
    assert {fused for kernel, fused in on if kernel == "decode_attention"} == {True}
    assert {fused for kernel, fused in off if kernel == "decode_attention"} == {False}
    assert ("mixed_decode_rows", None) in on and ("mixed_decode_rows", None) not in off
    elementwise = {"_rms_norm_kernel", "_rope_kernel", "_silu_and_mul_kernel"}
    assert elementwise & {kernel for kernel, _ in on} and not elementwise & {kernel for kernel, _ in off}
