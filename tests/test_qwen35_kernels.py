"""Qwen3.5's fused Triton kernels under the Triton interpreter, on CPU, against their torch references: the
zero-centred RMSNorm (plain and with the residual add), the gated RMSNorm * silu(z), the attention's sigmoid
output gate, the GDN gates (g, beta), the zero-centred q/k norm with partial RoPE; then a tiny Qwen3.5 run
through the engine with every kernel on (Triton attention backend included) against Hugging Face's greedy tokens.

Skipped when Triton is not installed. Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import use_triton_interpreter  # noqa: E402

use_triton_interpreter("minisgl.kernels.elementwise", "minisgl.kernels.gdn", "minisgl.kernels.attention",
                       "minisgl.attention.triton_backend")

from minisgl.kernels import elementwise as ew  # noqa: E402
from minisgl.kernels import gdn  # noqa: E402


@pytest.fixture
def force_triton(options_for_test):
    options_for_test(triton_on_cpu=True)


def _tol(dtype: torch.dtype) -> float:
    # The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): allow 2 bf16 ulps.
    return 1e-5 if dtype == torch.float32 else 2 ** -6


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norm_and_fused_add(force_triton, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 200, generator=gen).to(dtype)
    res = torch.randn(6, 200, generator=gen).to(dtype)
    w = (0.3 * torch.randn(200, generator=gen)).to(dtype)  # around 0: the scale is (1 + w)
    _close(ew.rms_norm(x, w, 1e-6, zero_centred=True), ew.zero_centred_rms_norm_ref(x, w, 1e-6), _tol(dtype))
    x0, res0 = x.clone(), res.clone()
    y, new_res = ew.fused_add_rms_norm(x, res, w, 1e-6, zero_centred=True)
    y_ref, res_ref = ew.fused_add_rms_norm_ref(x, res, w, 1e-6, zero_centred=True)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    # the sum is rounded to the model dtype as the bf16 add rounds it (to nearest on a GPU; the interpreter
    # truncates, hence the tolerance; fp32 is exact)
    if dtype == torch.float32:
        assert torch.equal(new_res, res_ref)
    _close(new_res, res_ref, _tol(dtype))
    _close(y, y_ref, _tol(dtype))
    # and it is not the plain norm (the offset and the single rounding are really applied)
    assert not torch.allclose(y.float(), ew.rms_norm_ref(x + res, w, 1e-6).float(), atol=0.1)


def test_zero_centred_per_head_norm_on_strided_view(force_triton):
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(5, 3, 2 * 32, generator=gen)
    x = big[..., :32]  # [T, H, D] with head stride 2D, as q in Qwen3.5's [q | gate] heads
    w = 0.3 * torch.randn(32, generator=gen)
    _close(ew.rms_norm(x, w, 1e-6, zero_centred=True), ew.zero_centred_rms_norm_ref(x, w, 1e-6), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_with_strided_gate(force_triton, dtype):
    gen = torch.Generator().manual_seed(2)
    t, h, d = 5, 4, 16
    x = torch.randn(t, h, d, generator=gen).to(dtype)
    proj = (2 * torch.randn(t, 3 * h * d + 7, generator=gen)).to(dtype)
    z = proj[:, h * d: 2 * h * d].view(t, h, d)  # a slice of the fused in-projection's output
    w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
    out = ew.gated_rms_norm(x, z, w, 1e-6)
    _close(out, ew.gated_rms_norm_ref(x, z, w, 1e-6), _tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_mul_with_strided_gate(force_triton, dtype):
    gen = torch.Generator().manual_seed(3)
    t, h, d = 5, 4, 16
    o = torch.randn(t, h * d, generator=gen).to(dtype)
    q_gate = (3 * torch.randn(t, h, 2 * d, generator=gen)).to(dtype)
    gate = q_gate[..., d:]  # per head [q | gate]
    _close(ew.sigmoid_mul(o, gate), ew.sigmoid_mul_ref(o, gate.reshape(t, h * d)), _tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gdn_gating(force_triton, dtype):
    gen = torch.Generator().manual_seed(4)
    t, hv = 7, 6
    proj = (8 * torch.randn(t, 20 + 2 * hv, generator=gen)).to(dtype)
    proj[0, 20 + hv] = 30.0  # softplus's linear branch (x > 20)
    proj[1, 20 + hv] = -40.0  # and its far tail
    b, a = proj[:, 20: 20 + hv], proj[:, 20 + hv:]
    a_log = torch.empty(hv).uniform_(0.01, 16, generator=gen).log().to(dtype)
    dt_bias = torch.randn(hv, generator=gen).to(dtype)
    g, beta = gdn.gdn_gating(a, b, a_log, dt_bias)
    g_ref, beta_ref = gdn.gdn_gating_ref(a, b, a_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    _close(beta, beta_ref, _tol(dtype))


def _cos_sin(rotary_dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_zero_centred_norm_and_partial_rope(force_triton, dtype, rotary_dim):
    """Qwen3.5's q/k path: q a strided view (per head [q | gate]) written to a packed q_out, k a view into the
    qkv output turned in place, only the first rotary_dim dims of each head rotated (64: the full head)."""
    gen = torch.Generator().manual_seed(5)
    t, hq, hkv, d, max_pos = 5, 4, 2, 64, 40
    cos_sin = _cos_sin(rotary_dim, max_pos)
    qkv = (3 * torch.randn(t, 2 * hq * d + 2 * hkv * d, generator=gen)).to(dtype)
    q = qkv[:, : 2 * hq * d].view(t, hq, 2 * d)[..., :d]
    k = qkv[:, 2 * hq * d: (2 * hq + hkv) * d].view(t, hkv, d)
    wq = (0.3 * torch.randn(d, generator=gen)).to(dtype)
    wk = (0.3 * torch.randn(d, generator=gen)).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen)
    q_ref, k_ref = ew.norm_and_rope_ref(q.clone(), k.clone(), positions, cos_sin, wq, wk, 1e-6, zero_centred=True)
    before = qkv.clone()
    q_out = torch.empty(t, hq, d, dtype=dtype)
    q2, k2 = ew.norm_and_rope(q, k, positions, cos_sin, wq, wk, 1e-6, zero_centred=True, q_out=q_out)
    assert q2.data_ptr() == q_out.data_ptr() and k2.data_ptr() == k.data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -4  # the reference rotates in bf16 arithmetic, the kernel in fp32
    _close(q_out, q_ref, tol)
    _close(k, k_ref, tol)
    # the dims past the rotary width are the norm's output alone
    if rotary_dim < d:
        ref_norm = ew.zero_centred_rms_norm_ref(before[:, 2 * hq * d: (2 * hq + hkv) * d].view(t, hkv, d), wk, 1e-6)
        _close(k[..., rotary_dim:], ref_norm[..., rotary_dim:], _tol(dtype))
    # q's source and everything after k in the qkv buffer are untouched
    assert torch.equal(qkv[:, : 2 * hq * d], before[:, : 2 * hq * d])
    assert torch.equal(qkv[:, (2 * hq + hkv) * d:], before[:, (2 * hq + hkv) * d:])


def test_partial_rope_without_norm(force_triton):
    gen = torch.Generator().manual_seed(6)
    t, hq, hkv, d = 4, 2, 1, 32
    cos_sin = _cos_sin(8, 20)
    q, k = torch.randn(t, hq, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    positions = torch.randint(0, 20, (t,), generator=gen)
    q_ref, k_ref = ew.apply_rope_ref(q.clone(), k.clone(), positions, cos_sin)
    ew.apply_rope(q, k, positions, cos_sin)
    _close(q, q_ref, 1e-5)
    _close(k, k_ref, 1e-5)


def test_qwen35_engine_on_triton_kernels_matches_hf(models_dir, make_llm, monkeypatch):
    """A tiny Qwen3.5 (fp32) through the engine with every Triton kernel under the interpreter: prefill in chunks
    (the chunked delta rule and the varlen conv), then decode steps; greedy tokens equal Hugging Face's."""
    from helpers import assert_parity, hf_greedy
    from test_qwen35 import make_state_sensitive, tiny_text_config
    from transformers import Qwen3_5ForCausalLM

    from minisgl import SamplingParams

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_text_config()).eval()
    make_state_sensitive(model, seed=1)
    path = str(models_dir / "qwen3.5-triton")
    model.save_pretrained(path)
    prompts = [[5, 9, 17, 3, 44, 8, 21, 60, 2, 7, 11], [100, 4, 4, 4, 33]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    from triton.runtime.interpreter import InterpretedFunction

    launched = set()
    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        launched.add(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    # the engine's own kernel option sends its CPU tensors through the Triton kernels (the interpreter)
    llm = make_llm(path, dtype="float32", attention_backend="triton", page_size=4, chunked_prefill_size=8,
                   triton_on_cpu=True)
    outs = llm.generate(prompts, params)
    assert_parity(outs, hf_greedy(path, prompts, max_new_tokens=4), prompts)
    fused = {"_rms_norm_kernel", "_gated_rms_norm_kernel", "_sigmoid_mul_kernel", "_gating_kernel", "_rope_kernel",
             "_gdr_chunk_kernel", "_gdr_recurrent_kernel", "_conv_varlen_kernel", "_conv_decode_kernel"}
    assert fused <= launched, fused - launched
