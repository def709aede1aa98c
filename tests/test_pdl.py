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

from minisgl.config import EngineConfig

REPO = Path(__file__).resolve().parents[1]


def _pdl():
    from minisgl.kernels import pdl
    return pdl


@pytest.fixture
def restore_flag():
    pdl = _pdl()
    saved = pdl.PDL_ENABLED
    yield pdl
    pdl.set_enabled(saved)


def _fake_cuda_tensor(index: int = 0):
    return SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))


# ------------------------------------------------------------ the switch and pdl_launch ---------------------


def test_cpu_tensors_never_get_pdl(restore_flag):
    pdl = restore_flag
    pdl.set_enabled(True)
    assert pdl.pdl_launch(torch.zeros(3)) == {}


def test_pdl_launch_on_a_capable_device(restore_flag, monkeypatch):
    pdl = restore_flag
    calls = []

    def capability(idx):
        calls.append(idx)
        return {0: (9, 0), 1: (8, 0)}[idx]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(pdl, "_capable", {})
    monkeypatch.setattr(pdl, "_TRITON_PDL", True)
    pdl.set_enabled(True)
    assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {"launch_pdl": True}
    assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {"launch_pdl": True}
    assert pdl.pdl_launch(_fake_cuda_tensor(1)) == {}  # sm_80: no PDL
    assert pdl.pdl_launch(_fake_cuda_tensor(1)) == {}
    assert calls == [0, 1], "the capability is looked up once per device"
    pdl.set_enabled(False)
    assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {}
    pdl.set_enabled(True)
    monkeypatch.setattr(pdl, "_TRITON_PDL", False)  # a Triton without the launch option
    assert pdl.pdl_launch(_fake_cuda_tensor(0)) == {}


def test_installed_triton_supports_pdl():
    pytest.importorskip("triton")
    import dataclasses

    from triton.backends.nvidia.compiler import CUDAOptions
    assert _pdl().triton_supports_pdl() == ("launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)})


def _flag_in_subprocess(env_value: str | None, code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_PDL"}
    if env_value is not None:
        env["MINISGL_PDL"] = env_value
    out = subprocess.run([sys.executable, "-c", "from minisgl.kernels import pdl\n" + code], env=env, cwd=REPO,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_env_turns_pdl_off_and_keeps_it_off():
    assert _flag_in_subprocess(None, "print(pdl.PDL_ENABLED, pdl.configure(True), pdl.configure(False))") \
        == "True True False"
    # MINISGL_PDL=0: off, and an engine asking for PDL does not turn it back on
    assert _flag_in_subprocess("0", "print(pdl.PDL_ENABLED, pdl.configure(True))") == "False False"


# ------------------------------------------------------------ the engine flag -------------------------------


def test_config_flag_parses():
    import argparse

    from minisgl.config import add_engine_args, engine_kwargs_from_args
    assert EngineConfig("m").pdl is True
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs_from_args(p.parse_args(["--model", "m", "--disable-pdl"])) == {"pdl": False}
    assert "pdl" not in engine_kwargs_from_args(p.parse_args(["--model", "m"]))


def test_engine_sets_the_process_flag(restore_flag, make_llm, qwen3_path):
    pdl = restore_flag
    make_llm(qwen3_path, pdl=False)
    assert pdl.PDL_ENABLED is False
    make_llm(qwen3_path)  # the default asks for PDL; the engine started last decides
    assert pdl.PDL_ENABLED is pdl._ENV_ON


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
    monkeypatch.setenv("MINISGL_FORCE_TRITON", "1")
    from minisgl.kernels import attention as att
    from minisgl.kernels import elementwise as ew
    from minisgl.kernels import gemv as gv
    return SimpleNamespace(ew=ew, att=att, gv=gv)


def _with_pdl(monkeypatch, mods, fn):
    """fn() with every launcher asking for PDL (gdc calls as no-ops), and fn() without; both results."""
    without = fn()
    for m in mods:
        monkeypatch.setattr(m, "pdl_launch", lambda t: _PdlKw())
        for name in ("pdl_enter", "gdc_wait", "gdc_launch_dependents"):
            if hasattr(m, name):
                monkeypatch.setattr(m, name, _noop)
    return without, fn()


@pytest.mark.parametrize("early", [3, 2, 1, 0])
@pytest.mark.parametrize("rows,n,k,silu,bias", [(1, 37, 50, False, False), (3, 96, 2100, False, True),
                                                 (4, 24, 1030, True, False), (2, 8, 16, True, False)])
def test_gemv_pdl_path_is_bitwise_the_same(interp, monkeypatch, early, rows, n, k, silu, bias):
    gv = interp.gv
    monkeypatch.setattr(gv, "PDL_EARLY_TILES", early)
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, 2 * k if silu else k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    # K of 2100 and 1030 leave partial tiles after several steps; 16 fits in the peeled first step alone
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
    precedes every global access; the script also checks that two rule-breaking control kernels are caught."""
    pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")
    if not _pdl().triton_supports_pdl():
        pytest.skip("this Triton has no launch_pdl")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MINISGL_PDL")}
    out = subprocess.run([sys.executable, "-m", "lab.checks.pdl_ptx"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "0 with problems" in out.stdout
