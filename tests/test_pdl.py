"""Programmatic dependent launch (minisgl/kernels/pdl.py): the switch, when launches get it, the engine flag, the
kernels' USE_PDL paths under the Triton interpreter, and the sm_90 PTX order check (lab/checks/pdl_ptx.py).

Nothing here needs a GPU: the real PDL launches are checked on an H200 by `python -m lab.run --sections pdl_check`."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import kernel_options

from minisgl.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]


def _pdl():
    from minisgl.kernels import pdl
    return pdl


def _fake_cuda_tensor(index: int = 0):
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


# ------------------------------------------------------------ the option and pdl_launch ---------------------


def test_cpu_tensors_never_get_pdl():
    with kernel_options(pdl=True):
        assert _pdl().pdl_launch(torch.zeros(3)) == {}


def test_pdl_launch_on_a_capable_device(monkeypatch):
    pdl = _pdl()
    calls = []

    def capability(idx):
        calls.append(idx)
        return {0: (9, 0), 1: (8, 0)}[idx]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(pdl, "_capable", {})
    monkeypatch.setattr(pdl, "_TRITON_PDL", True)
    with kernel_options(pdl=True):
        assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {"launch_pdl": True}
        assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {"launch_pdl": True}
        assert pdl.pdl_launch(_fake_cuda_tensor(1)) == {}  # sm_80: no PDL
        assert pdl.pdl_launch(_fake_cuda_tensor(1)) == {}
        assert calls == [0, 1], "the capability is looked up once per device"
        with kernel_options(pdl=False):  # an engine with PDL off: its launches do without
            assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {}
        assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {"launch_pdl": True}  # the block's end restores it
        monkeypatch.setattr(pdl, "_TRITON_PDL", False)  # a Triton without the launch option
        assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {}


def test_installed_triton_supports_pdl():
    pytest.importorskip("triton")
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions
    assert _pdl().triton_supports_pdl() == ("launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)})


def _in_subprocess(env_value: str | None, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_PDL"}
    if env_value is not None:
        env["MINISGL_PDL"] = env_value
    prelude = "from minisgl.config import make_config\nfrom minisgl.kernels.options import current_options\n"
    out = subprocess.run([sys.executable, "-c", prelude + code], env=env, cwd=REPO, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_environment_is_a_default_only():
    code = "print(current_options().pdl, make_config('m').kernels.pdl, make_config('m', pdl=True).kernels.pdl)"
    assert _in_subprocess(None, code) == "True True True"
    # MINISGL_PDL=0: off by default, and an engine asking for PDL gets it (the option given wins)
    assert _in_subprocess("0", code) == "False False True"


# ------------------------------------------------------------ the engine flag -------------------------------


def test_config_flag_parses():
    import argparse

    from minisgl.config import add_engine_args, engine_kwargs_from_args, make_config
    assert EngineConfig("m").kernels.pdl is True
    p = argparse.ArgumentParser()
    add_engine_args(p)
    given = engine_kwargs_from_args(p.parse_args(["--model", "m", "--disable-pdl"]))
    assert given == {"pdl": False} and make_config("m", **given).kernels.pdl is False
    assert "pdl" not in engine_kwargs_from_args(p.parse_args(["--model", "m"]))


def test_each_engine_steps_under_its_own_setting(make_llm, qwen3_path, monkeypatch):
    """Two engines, PDL off and on, in one process: every step of each runs under its own option, and nothing
    outside their steps changes (no process-wide flag)."""
    from minisgl import SamplingParams
    from minisgl.engine.model_runner import ModelRunner
    from minisgl.kernels.options import current_options

    before = current_options()
    seen = []
    step = ModelRunner._forward

    def recording(self, batch):
        seen.append((self.config.kernels.pdl, current_options().pdl))
        return step(self, batch)

    monkeypatch.setattr(ModelRunner, "_forward", recording)
    off, on = make_llm(qwen3_path, pdl=False), make_llm(qwen3_path)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = [llm.generate([[5, 6, 7]], params)[0].token_ids for llm in (off, on, off)]
    assert outs[0] == outs[1] == outs[2]  # PDL changes launches, never tokens
    assert {engine for engine, _ in seen} == {False, True}
    assert all(engine == in_force for engine, in_force in seen), seen
    assert current_options() == before


# ------------------------------------------------------------ USE_PDL paths under the interpreter ----------
# The interpreter cannot run griddepcontrol, so the gdc calls are swapped for no-ops: what is checked is that the
# USE_PDL=True code paths (the GEMV's peeled first step above all) compute exactly what USE_PDL=False does.


class _PdlKw(dict):
    """What pdl_launch returns in these tests: no launch kwargs (the interpreter has no launch_pdl), but truthy,
    so the launchers pass USE_PDL=True."""

    def __bool__(self) -> bool:
        return True


def _noop():
    pass


@pytest.fixture
def interp(monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")
    from helpers import use_triton_interpreter
    use_triton_interpreter("minisgl.kernels.elementwise", "minisgl.kernels.attention", "minisgl.kernels.gemv")
    from minisgl.kernels import attention as att
    from minisgl.kernels import elementwise as ew
    from minisgl.kernels import gemv as gv
    with kernel_options(triton_on_cpu=True):
        yield SimpleNamespace(ew=ew, att=att, gv=gv)


def _with_pdl(monkeypatch, mods, fn):
    """fn() with every launcher asking for PDL (gdc calls as no-ops), and fn() without; both results."""
    without = fn()
    for m in mods:
        monkeypatch.setattr(m, "pdl_launch", lambda t: _PdlKw())
        for name in ("pdl_enter", "pdl_launch_dependents", "pdl_wait", "gdc_wait", "gdc_launch_dependents"):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, _noop)
    return without, fn()


@pytest.mark.parametrize("early", [3, 2, 1, 0])
@pytest.mark.parametrize("rows,n,k,silu,bias", [(1, 37, 50, False, False), (3, 96, 2100, False, True),
                                                 (4, 24, 1030, True, False), (2, 8, 16, True, False)])
def test_gemv_pdl_path_is_bitwise_the_same(interp, monkeypatch, early, rows, n, k, silu, bias):
    gv = interp.gv
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, 2 * k if silu else k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    # K of 2100 and 1030 leave partial tiles after several steps; 16 fits in the peeled first step alone
    with kernel_options(gemv_pdl_early_tiles=early):
        without, with_pdl = _with_pdl(monkeypatch, [gv], lambda: gv.gemv(x, w, b, silu_mul=silu))
    assert torch.equal(without, with_pdl)
    # and it is the product: fp32 maths on the same bf16 inputs (silu_and_mul's kernel rounds as the fold does),
    # one rounding at the end
    xin = interp.ew.silu_and_mul(x) if silu else x
    ref = torch.nn.functional.linear(xin.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
    torch.testing.assert_close(with_pdl.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


def test_elementwise_and_attention_pdl_paths(interp, monkeypatch):
    ew, att = interp.ew, interp.att
    gen = torch.Generator().manual_seed(7)
    t, hq, hkv, d = 2, 4, 2, 32
    x, res, w = torch.randn(t, 64, generator=gen), torch.randn(t, 64, generator=gen), torch.randn(64, generator=gen)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    pos = torch.tensor([3, 7])
    cos_sin = torch.randn(16, d, generator=gen)
    k_buf, v_buf = torch.randn(64, hkv, d, generator=gen), torch.randn(64, hkv, d, generator=gen)
    req_to_token = torch.arange(64, dtype=torch.int32).view(2, 32)
    seq_lens = torch.tensor([9, 20], dtype=torch.int32)

    def run():
        q, k, v = (qkv.clone()[:, a * d: b * d].view(t, b - a, d) for a, b in ((0, hq), (hq, hq + hkv),
                                                                             (hq + hkv, hq + 2 * hkv)))
        kb, vb = k_buf.clone(), v_buf.clone()
        outs = [ew.rms_norm(x, w, 1e-6), *ew.fused_add_rms_norm(x, res, w, 1e-6), ew.silu_and_mul(x),
                *ew.norm_and_rope(q, k, pos, cos_sin, torch.randn(d, generator=torch.Generator().manual_seed(1)),
                                  torch.ones(d), 1e-6)]
        ew.store_kv(kb, vb, torch.tensor([5, 40]), k, v)  # slots the attention below reads
        out = torch.empty(t, hq, d)
        att.decode_attention(q.contiguous(), kb, vb, req_to_token, torch.tensor([0, 1]), seq_lens, out, d ** -0.5,
                             num_splits=2)
        return [*outs, kb, vb, out]

    without, with_pdl = _with_pdl(monkeypatch, [ew, att], run)
    for a, b in zip(without, with_pdl):
        assert torch.equal(a, b)


# ------------------------------------------------------------ the PTX order check --------------------------


def test_every_decode_kernel_waits_before_global_memory_in_its_ptx():
    """Compiles each decode-path kernel for sm_90 with USE_PDL (no GPU needed) and checks griddepcontrol.wait
    precedes every global access; the script also checks that two rule-breaking control kernels are caught, and
    that the RoPE kernel and the fused RoPE sum a head's squares in fp64 (a revert to fp32 sums fails it)."""
    pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")
    if not _pdl().triton_supports_pdl():
        pytest.skip("this Triton has no launch_pdl")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISGL_PDL")}
    out = subprocess.run([sys.executable, "-m", "lab.checks.pdl_ptx"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "0 with problems" in out.stdout
