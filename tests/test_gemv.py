"""The decode-sized GEMV (minisgl/kernels/gemv.py) under the Triton interpreter, against F.linear."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import pytest
import torch
import torch.nn.functional as F
from torch import nn

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import kernel_options, use_triton_interpreter  # noqa: E402

use_triton_interpreter("minisgl.kernels.gemv")

from minisgl.kernels import gemv as gv  # noqa: E402


@pytest.fixture
def force_triton():
    with kernel_options(triton_on_cpu=True):
        yield


def table(entries: dict) -> gv.GemvTable:
    return {shape: (*cfg, gv.GEMV_MAX_ROWS)[:4] if cfg is not None else None for shape, cfg in entries.items()}


# shapes that leave partial tiles in both directions, and one that takes several K steps
@pytest.mark.parametrize("n,k", [(1, 16), (37, 50), (96, 64), (200, 2100)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_matches_linear(force_triton, n, k, rows):
    gen = torch.Generator().manual_seed(n * 100 + k + rows)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    torch.testing.assert_close(gv.gemv(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gv.gemv(x, w, b), x @ w.T + b, rtol=1e-4, atol=1e-4)


def test_gemv_half_precision_accumulates_in_fp32(force_triton):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3000, generator=gen).to(torch.bfloat16)
    w = torch.randn(64, 3000, generator=gen).to(torch.bfloat16)
    want = (x.float() @ w.float().T).to(torch.bfloat16)  # one rounding, at the end
    got = gv.gemv(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_gemv_reads_strided_rows(force_triton):
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(3, 80, generator=gen)
    x = big[:, 10:74]  # rows 80 apart, contiguous within a row
    w = torch.randn(24, 64, generator=gen)
    torch.testing.assert_close(gv.gemv(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


def test_gemv_refuses_too_many_rows(force_triton):
    x = torch.randn(gv.GEMV_MAX_ROWS + 1, 8)
    with pytest.raises(ValueError, match="at most"):
        gv.gemv(x, torch.randn(4, 8))


def test_config_override_is_used(force_triton, tmp_path):
    assert gv.gemv_config(40, 48, table({(40, 48): (2, 16, 1)})) == (2, 16, 1)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(1, 48, generator=gen), torch.randn(40, 48, generator=gen)
    torch.testing.assert_close(gv.gemv(x, w, tiles=(2, 16, 1)), x @ w.T, rtol=1e-4, atol=1e-4)
    # the kernel option gemv_configs names the table a plain gemv() call uses
    path = tmp_path / "gemv.json"
    path.write_text('{"40,48": [2, 16, 1]}')
    with kernel_options(gemv_configs=str(path)):
        assert gv.table_for(x.device) == {(40, 48): (2, 16, 1, gv.GEMV_MAX_ROWS)}
        torch.testing.assert_close(gv.gemv(x, w), x @ w.T, rtol=1e-4, atol=1e-4)
    assert gv.table_for(x.device) == {}  # outside the block: the defaults (no table on a CPU)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_one_k_tile_wider_than_k(force_triton, silu_mul):
    # the wide tiles of lab/tune/gemv.py --wide: one masked K step covers the whole row (3000 of 4096)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2 * 3000 if silu_mul else 3000, generator=gen)
    w = torch.randn(24, 3000, generator=gen)
    from minisgl.kernels import elementwise as ew

    want = (ew.silu_and_mul(x) if silu_mul else x) @ w.T
    torch.testing.assert_close(gv.gemv(x, w, silu_mul=silu_mul, tiles=(1, 4096, 4)), want, rtol=1e-4, atol=1e-4)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 48, bias=True)
        self.block = nn.Sequential(nn.Linear(48, 16, bias=False), nn.ReLU())
        self.head = nn.Linear(16, 8, bias=False)
        self.head.weight = self.proj.weight.__class__(self.proj.weight[:8, :16].clone())

    def forward(self, x):
        return self.head(self.block(self.proj(x)))


def test_use_gemv_swaps_linears_keeping_parameters(force_triton):
    model = _Tiny()
    x_small, x_big = torch.randn(3, 32), torch.randn(9, 32)
    want_small, want_big = model(x_small), model(x_big)
    keys = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert gv.use_gemv(model, max_rows=4) == 3
    assert all(isinstance(m, gv.GemvLinear) for m in (model.proj, model.block[0], model.head))
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == keys  # same names, same storage
    torch.testing.assert_close(model(x_small), want_small, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model(x_big), want_big)  # above max_rows: F.linear, bit for bit


def test_gemv_linear_routes_by_row_count(force_triton, monkeypatch):
    lin = gv.GemvLinear(nn.Linear(8, 4), max_rows=2)
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(gv, "gemv", lambda x, w, b=None, tiles=None: calls.append(x.shape[0]) or real(x, w, b))
    lin(torch.randn(2, 8))
    lin(torch.randn(3, 8))
    lin(torch.randn(1, 2, 8))  # not 2-D: the plain path
    assert calls == [2]


def test_cpu_tensors_take_torch_without_the_force():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(gv.gemv(x, w), torch.nn.functional.linear(x, w))


def test_shapes_measured_slower_stay_cublas(force_triton, tmp_path):
    path = tmp_path / "gemv.json"
    path.write_text('{"48,32": null, "16,48": [2, 16, 1], "8,16": [1, 16, 1, 1]}')
    loaded = gv.load_table(str(path))
    assert loaded == {(48, 32): None, (16, 48): (2, 16, 1, gv.GEMV_MAX_ROWS), (8, 16): (1, 16, 1, 1)}
    model = _Tiny()
    with kernel_options(gemv_configs=str(path)):  # the table of the options in force when the modules are swapped
        assert gv.use_gemv(model) == 2  # proj (48 x 32) keeps its nn.Linear
    assert type(model.proj) is nn.Linear and isinstance(model.block[0], gv.GemvLinear)
    assert model.block[0].max_rows == gv.GEMV_MAX_ROWS and model.head.max_rows == 1  # the measured row limit
    assert model.block[0].tiles == (2, 16, 1) == gv.gemv_config(16, 48, loaded)  # kept by the module


def test_gemv_linear_keeps_the_measured_row_limit(force_triton, monkeypatch):
    lin = gv.GemvLinear(nn.Linear(8, 4), table={(4, 8): (1, 16, 1, 2)})
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(gv, "gemv", lambda x, w, b=None, tiles=None: calls.append(x.shape[0]) or real(x, w, b))
    for rows in (1, 2, 3, 4):
        lin(torch.randn(rows, 8))
    assert calls == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_folded_into_the_gemv(force_triton, dtype):
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2 * 80, generator=gen) * 2).to(dtype)
    w = torch.randn(40, 80, generator=gen).to(dtype)
    want = gv.gemv(ew.silu_and_mul(gate_up), w)  # the two-launch path, same accumulation
    torch.testing.assert_close(gv.gemv(gate_up, w, silu_mul=True), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("tiles", [(8, 32, 4), (1, 64, 4)])
def test_silu_mul_out_is_the_activation_to_the_bit(force_triton, rows, tiles):
    """gemv(silu_mul_out=True) on a [gate; up] weight: silu_and_mul of the plain GEMV's output, bit for bit (40
    pairs: the last program's partial at 8-row tiles; 1-row tiles run as pairs), and the same with the norm in
    front (gemv_rms_norm); a weight of odd rows, or an add, is refused."""
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(rows)
    x = (2 * torch.randn(rows, 96, generator=gen)).to(torch.bfloat16)
    w = torch.randn(80, 96, generator=gen).to(torch.bfloat16)
    b = torch.randn(80, generator=gen).to(torch.bfloat16)
    got = gv.gemv(x, w, b, tiles=tiles, silu_mul_out=True)
    assert got.shape == (rows, 40)
    assert torch.equal(got, ew.silu_and_mul(gv.gemv(x, w, b, tiles=tiles)))
    norm_w = (1 + 0.1 * torch.randn(96, generator=gen)).to(torch.bfloat16)
    residual = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    act, stream = gv.gemv_rms_norm(x, residual, norm_w, 1e-6, w, None, tiles=tiles, silu_mul_out=True)
    want, want_stream = gv.gemv_rms_norm(x, residual, norm_w, 1e-6, w, None, tiles=tiles)
    assert torch.equal(act, ew.silu_and_mul(want)) and torch.equal(stream, want_stream)
    with pytest.raises(ValueError, match="even number"):
        gv.gemv(x, w[:79], tiles=tiles, silu_mul_out=True)
    with pytest.raises(ValueError, match="no add"):
        gv.gemv(x, w, tiles=tiles, silu_mul_out=True, add=torch.zeros(rows, 40, dtype=torch.bfloat16))


def test_use_gemv_folds_the_decoder_mlp(force_triton):
    """The MLPs of the classes the caller names (the engine names the decoder's) fold; others are left alone."""
    from minisgl.models.layers import MLP

    torch.manual_seed(4)
    wrapper = nn.Module()
    wrapper.mlp = MLP(32, 48)
    x_small, x_big = torch.randn(2, 32), torch.randn(7, 32)
    want_small, want_big = wrapper.mlp(x_small), wrapper.mlp(x_big)
    keys = set(wrapper.state_dict())
    assert gv.use_gemv(wrapper, fold=(MLP,), max_rows=4) == 2
    assert isinstance(wrapper.mlp, gv.GemvMLP) and set(wrapper.state_dict()) == keys
    torch.testing.assert_close(wrapper.mlp(x_small), want_small, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wrapper.mlp(x_big), want_big)
    plain = nn.Module()
    plain.mlp = MLP(32, 48)
    assert gv.use_gemv(plain, max_rows=4) == 2  # no class to fold: its two linears, each on its own
    assert type(plain.mlp) is MLP and isinstance(plain.mlp.down_proj, gv.GemvLinear)


def test_mlp_fold_with_gate_up_left_to_cublas(force_triton):
    from minisgl.models.layers import MLP

    torch.manual_seed(5)
    wrapper = nn.Module()
    wrapper.mlp = MLP(32, 48)
    x = torch.randn(1, 32)
    want = wrapper.mlp(x)
    # gate_up (96 x 32) measured slower on the GEMV
    assert gv.use_gemv(wrapper, fold=(MLP,), max_rows=4, table={(96, 32): None}) == 1
    assert isinstance(wrapper.mlp, gv.GemvMLP) and type(wrapper.mlp.gate_up_proj) is nn.Linear
    torch.testing.assert_close(wrapper.mlp(x), want, rtol=1e-5, atol=1e-5)


def test_tune_times_down_projections_folded(force_triton):
    """lab/tune/gemv.py times each shape as the engine runs it: an MLP's down projection with its activation folded
    into the GEMV (the input is [gate | up]), every other linear plain."""
    from lab.models import model_path
    from lab.tune import gemv as tune

    counts, folded = tune.linear_shapes(model_path("qwen3-0.6b"))
    assert folded == {(1024, 3072)}  # hidden 1024, intermediate 3072
    assert counts[(1024, 3072)] == 28 and (4096, 1024) in counts and (4096, 1024) not in folded
    torch.manual_seed(6)
    w = torch.randn(16, 24)
    gate_up = torch.randn(3, 48)
    matmul_input, gemv_with = tune.ops(folded=True)
    want = F.linear(F.silu(gate_up[:, :24]) * gate_up[:, 24:], w)
    torch.testing.assert_close(tune.cublas(matmul_input, gate_up, w), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv_with((4, 32, 4))(gate_up, w), want, rtol=1e-5, atol=1e-5)
    matmul_input, gemv_with = tune.ops(folded=False)
    x = gate_up[:, :24]
    assert matmul_input(x) is x
    torch.testing.assert_close(gemv_with((4, 32, 4))(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


# --- the RMSNorm folded into the GEMV after it (kernel option gemv_norm_fold) -------------------------------
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_rms_norm_is_the_norm_then_the_gemv_to_the_bit(force_triton, rows, with_residual, dtype):
    """Against the two launches it replaces, bit for bit: K = 200 over 64-wide tiles (the rstd summed tile by tile,
    the last tile partial), with a bias; the residual returned is x + residual (x without one)."""
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(rows * 10 + with_residual)
    x = (3 * torch.randn(rows, 200, generator=gen)).to(dtype)
    residual = torch.randn(rows, 200, generator=gen).to(dtype) if with_residual else None
    norm_w = (1 + 0.1 * torch.randn(200, generator=gen)).to(dtype)
    w = torch.randn(40, 200, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    if with_residual:
        h, want_res = ew.fused_add_rms_norm(x, residual, norm_w, 1e-6)
    else:
        h, want_res = ew.rms_norm(x, norm_w, 1e-6), x
    want = gv.gemv(h, w, b, tiles=(8, 64, 4))
    got, got_res = gv.gemv_rms_norm(x, residual, norm_w, 1e-6, w, b, tiles=(8, 64, 4))
    assert torch.equal(got, want) and torch.equal(got_res, want_res)
    assert (got_res is x) == (residual is None)
    # the Triton norm against the torch reference: the fp64 sum of squares changes nothing beyond rounding
    ref_h = ew.fused_add_rms_norm_ref(x, residual, norm_w, 1e-6)[0] if with_residual else ew.rms_norm_ref(
        x, norm_w, 1e-6)
    torch.testing.assert_close(h.float(), ref_h.float(), rtol=2e-2, atol=2e-2)  # two roundings: an ulp or two


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_add_is_the_residual_add_to_the_bit(force_triton, rows, silu_mul):
    """gemv(add=r): the product rounded, plus r, rounded: the residual stream `ew.fused_add_rms_norm` returns for
    the product and r, bit for bit (N = 40 over 16-wide tiles: the last one partial; with a bias, or the MLP's
    activation folded in)."""
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(rows + 10 * silu_mul)
    x = (2 * torch.randn(rows, 160 if silu_mul else 80, generator=gen)).to(torch.bfloat16)
    w = torch.randn(40, 80, generator=gen).to(torch.bfloat16)
    b = None if silu_mul else torch.randn(40, generator=gen).to(torch.bfloat16)
    r = (8 * torch.randn(rows, 40, generator=gen)).to(torch.bfloat16)
    y = gv.gemv(x, w, b, silu_mul=silu_mul, tiles=(16, 32, 4))
    want = ew.fused_add_rms_norm(y, r, torch.ones(40, dtype=torch.bfloat16), 1e-6)[1]
    got = gv.gemv(x, w, b, silu_mul=silu_mul, tiles=(16, 32, 4), add=r)
    assert torch.equal(got, want)
    assert not torch.equal(got, y)  # the add happened
    with pytest.raises(ValueError, match="add must be"):
        gv.gemv(x, w, b, silu_mul=silu_mul, tiles=(16, 32, 4), add=r[:, :20])


@pytest.mark.parametrize("rows", [1, 3])
def test_sums_of_squares_handed_on_give_the_same_norm(force_triton, rows):
    """gemv(add=, sums_out=) adds up each stream row's sum of squares (over 16-wide tiles: several programs, each in
    its lane); gemv_rms_norm(sums=) takes its rstd from them: the same output as reading the row, bit for bit; a
    wrong sum changes the output (the sums are what it reads); the zeroing launch clears a buffer."""
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(rows)
    x = (2 * torch.randn(rows, 80, generator=gen)).to(torch.bfloat16)
    w = torch.randn(40, 80, generator=gen).to(torch.bfloat16)
    r = (8 * torch.randn(rows, 40, generator=gen)).to(torch.bfloat16)
    sums = torch.zeros(gv.GEMV_MAX_ROWS, gv.SUM_LANES, dtype=torch.float64)
    stream = gv.gemv(x, w, tiles=(16, 32, 4), add=r, sums_out=sums)
    assert torch.equal(stream, gv.gemv(x, w, tiles=(16, 32, 4), add=r))
    assert torch.equal(sums.sum(1)[:rows], (stream.double() ** 2).sum(1)) and not sums[rows:].any()
    assert (sums[:rows] != 0).sum(1).tolist() == [3] * rows  # 40 outputs in 16-wide tiles: three programs' lanes
    norm_w = (1 + 0.1 * torch.randn(40, generator=gen)).to(torch.bfloat16)
    w2 = torch.randn(24, 40, generator=gen).to(torch.bfloat16)
    want = gv.gemv(ew.rms_norm(stream, norm_w, 1e-6), w2, tiles=(8, 16, 4))
    got, res = gv.gemv_rms_norm(stream, None, norm_w, 1e-6, w2, tiles=(8, 16, 4), sums=sums)
    assert torch.equal(got, want) and res is stream
    wrong, _ = gv.gemv_rms_norm(stream, None, norm_w, 1e-6, w2, tiles=(8, 16, 4), sums=4 * sums)
    assert not torch.equal(wrong, want)
    dirty = torch.ones(3, gv.GEMV_MAX_ROWS, gv.SUM_LANES, dtype=torch.float64)
    gv.gemv_rms_norm(stream, None, norm_w, 1e-6, w2, tiles=(8, 16, 4), zero_sums=dirty)
    assert not dirty.any()
    with pytest.raises(ValueError, match="needs add"):
        gv.gemv(x, w, tiles=(16, 32, 4), sums_out=sums)
    with pytest.raises(ValueError, match="fp64 buffer"):
        gv.gemv(x, w, tiles=(16, 32, 4), add=r, sums_out=sums.float())
    with pytest.raises(ValueError, match="cannot include a residual"):
        gv.gemv_rms_norm(stream, r, norm_w, 1e-6, w2, sums=sums)


def test_gemv_rms_norm_refuses_mixed_dtypes(force_triton):
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        gv.gemv_rms_norm(x, None, torch.ones(16), 1e-6, torch.randn(8, 16, dtype=torch.bfloat16))


class _Attn:
    """An attention backend stand-in: the output mixes q and v, so the layer's q/k/v split and views matter."""

    def forward(self, q, k, v, layer_id):
        reps = q.shape[1] // v.shape[1]
        return q * 0.5 + v.repeat_interleave(reps, dim=1) + k.repeat_interleave(reps, dim=1).flip(-1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_norm_fold_layer_matches_the_decoder_layer_to_the_bit(force_triton, arch):
    """use_gemv(norm_fold=(DecoderLayer,)): two decoder layers in a row (the first without a residual) give the same
    residual stream, and the same final norm of it, as the layers with only their linears and MLP swapped, for 1-4
    rows; 6 rows take the layer's own forward; the parameter names do not change."""
    from minisgl.kernels import elementwise as ew
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLayer
    from minisgl.models.layers import MLP, RotaryEmbedding

    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=arch == "qwen2",
                      qk_norm=arch == "qwen3")
    torch.manual_seed(7)
    plain, folded = nn.Module(), nn.Module()
    plain.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(2)).to(torch.bfloat16)
    for p in plain.parameters():  # norms away from 1, so a skipped norm weight would show
        p.data += 0.05 * torch.randn_like(p)
    folded.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(2)).to(torch.bfloat16)
    folded.load_state_dict(plain.state_dict())
    keys = set(folded.state_dict())
    assert gv.use_gemv(plain, fold=(MLP,)) == gv.use_gemv(folded, fold=(MLP,), norm_fold=(DecoderLayer,)) == 8
    assert all(isinstance(layer, gv.GemvNormLayer) for layer in folded.layers) and set(folded.state_dict()) == keys
    rotary = RotaryEmbedding(16, 64, 10000.0, None)
    final_w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)

    def final_norm(h, residual):  # DecoderLM's: what the layers' output is for
        if residual is None:
            return ew.rms_norm(h, final_w, 1e-6), h
        return ew.fused_add_rms_norm(h, residual, final_w, 1e-6)

    for rows in (1, 4, 6):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        positions = torch.arange(rows) + 3
        outs = []
        # the folded stack, and a plain first layer handing its residual to a folded second (a layer that fell
        # back to its own forward, e.g. a projection the table left to cuBLAS)
        for layers in (plain.layers, folded.layers, [plain.layers[0], folded.layers[1]]):
            h, residual = x, None
            for layer in layers:
                h, residual = layer(h, residual, positions, rotary, _Attn())
            outs.append((residual is None, *final_norm(h, residual)))
        want_none, want_normed, want_stream = outs[0]
        assert not want_none
        for folds, normed, stream in outs[1:]:
            assert folds == (rows <= 4), rows  # a folded layer returns the stream whole, with no residual
            assert torch.equal(normed, want_normed) and torch.equal(stream, want_stream), rows



@pytest.mark.parametrize("sum_squares,act_epilogue", [(False, False), (True, False), (True, True)])
def test_decoder_lm_with_folded_layers_gives_the_same_logits(force_triton, sum_squares, act_epilogue):
    """The whole model with the norm fold (the layers hand the stream back whole, the final norm takes it
    without a residual) against the model with only its linears and MLPs swapped: the same logits, bit for bit.
    (A layer-level test passed while DecoderLM still unpacked the final norm's result as a pair: run29.) With
    the sums of squares handed on (kernel option gemv_fold_sum_squares): the same, from a buffer left dirty (the
    first launch zeroes it), and the stack's slots are written but the last layer's, which no GEMV reads. With the
    MLP's activation in the gate_up GEMV's epilogue (kernel option gemv_act_epilogue): the same again."""
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLayer, DecoderLM
    from minisgl.models.layers import MLP

    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=False, qk_norm=True)
    torch.manual_seed(0)
    plain = DecoderLM(cfg).to(torch.bfloat16)
    folded = DecoderLM(cfg).to(torch.bfloat16)
    folded.load_state_dict(plain.state_dict())
    gv.use_gemv(plain, fold=(MLP,))
    gv.use_gemv(folded, fold=(MLP,), norm_fold=(DecoderLayer,))
    ids, positions = torch.tensor([3, 7]), torch.tensor([4, 5])
    sums = folded.layers[0].sums
    assert all(layer.sums is sums for layer in folded.layers) and sums.buffer.shape[0] == 6
    sums.buffer.fill_(1e6)
    with kernel_options(triton_on_cpu=True, gemv_fold_sum_squares=sum_squares):
        want = plain(ids, positions, _Attn())
    with kernel_options(triton_on_cpu=True, gemv_fold_sum_squares=sum_squares, gemv_act_epilogue=act_epilogue):
        assert torch.equal(folded(ids, positions, _Attn()), want)
        assert torch.equal(plain(ids, positions, _Attn()), want)  # GemvMLP alone, the activation where the option says
    written = sums.buffer[:, :2].sum(-1).ne(0).all(-1).tolist()
    assert written == ([True] * 5 + [False] if sum_squares else [True] * 6), written  # 1e6 left: never zeroed


def test_step_tune_candidates_and_kinds(force_triton):
    """lab.tune.gemv_step: its tiles fit the weight (no K tile wider than K needs; no 1-row tiles where gate_up's
    programs hold row pairs) and hold the tuned tables' tiles; a swapped model's GEMVs grouped by kind."""
    from lab.engines import gemv_kinds
    from lab.tune import gemv_step
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLayer, DecoderLM
    from minisgl.models.layers import MLP

    for k in (1024, 2048, 3072, 4096, 12288):
        tiles = gemv_step.candidates(k, pairs=False)
        assert tiles and all(bk <= max(1024, 1 << (k - 1).bit_length()) for _, bk, _ in tiles), k
        assert all(bn > 1 for bn, _, _ in gemv_step.candidates(k, pairs=True))
    assert (4, 4096, 4) in gemv_step.candidates(4096, pairs=False)
    assert (8, 1024, 4) in gemv_step.candidates(1024, pairs=True)
    assert max(bk for _, bk, _ in gemv_step.candidates(1024, pairs=False)) == 1024
    tiles = gemv_step.candidates(12288, pairs=False)
    order = gemv_step.nearest_first(tiles, (4, 2048, 4))
    assert order[0] == (4, 2048, 4) and sorted(order) == sorted(tiles)  # each tile once, the start first
    assert set(order[1:6]) == {(2, 2048, 4), (8, 2048, 4), (4, 1024, 4), (4, 4096, 4), (4, 2048, 8)}  # one step
    assert order[-1] == (16, 512, 4)  # two doublings of rows and two of K tile away: last
    assert gemv_step.nearest_first(tiles, (3, 2048, 4))[0] == (3, 2048, 4)  # a start off the grid is timed first
    cfg = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=True)
    model = DecoderLM(cfg)
    gv.use_gemv(model, fold=(MLP,), norm_fold=(DecoderLayer,))
    kinds = gemv_kinds(model)
    assert {kind: len(mods) for kind, mods in kinds.items() if kind in gemv_step.KINDS} == {
        "qkv_proj": 2, "o_proj": 2, "gate_up_proj": 2, "down_proj": 2, "lm_head": 1}
    gemv_step.set_tiles(kinds["o_proj"], (2, 512, 4))
    assert all(m.tiles == (2, 512, 4) for m in kinds["o_proj"])


@pytest.mark.parametrize("fold", ["plain", "silu_mul", "norm"])
def test_prefetch_gives_the_same_sums(force_triton, fold):
    """Kernel option gemv_prefetch (the next weight tile loaded before the current one's products): the same output
    to the bit, over a K loop of seven tiles, the last partial (and a single-tile K, where it stays off)."""
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator().manual_seed(11)
    x = (2 * torch.randn(3, 400 if fold == "silu_mul" else 200, generator=gen)).to(torch.bfloat16)
    w = torch.randn(40, 200, generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(200, generator=gen)).to(torch.bfloat16)

    def run(tiles):
        if fold == "norm":
            return gv.gemv_rms_norm(x, None, norm_w, 1e-6, w, tiles=tiles)[0]
        return gv.gemv(x, w, silu_mul=fold == "silu_mul", tiles=tiles)

    for tiles in ((8, 32, 4), (8, 256, 4)):
        with kernel_options(triton_on_cpu=True, gemv_prefetch=False):
            want = run(tiles)
        with kernel_options(triton_on_cpu=True, gemv_prefetch=True):
            assert torch.equal(run(tiles), want), tiles
    want_ref = F.linear(ew.silu_and_mul(x) if fold == "silu_mul" else (
        ew.rms_norm(x, norm_w, 1e-6) if fold == "norm" else x), w)
    torch.testing.assert_close(want.float(), want_ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fold", ["plain", "silu_mul", "norm"])
def test_stages_give_the_same_sums(force_triton, fold):
    """Kernel option gemv_stages (the K loop pipelined through shared memory): the same output to the bit at 2-4
    stages, with and without the register prefetch (which then takes the loop alone). The interpreter runs the loop
    in order whatever the stages; that the compiled loop is pipelined and reduces in the plain loop's layouts is
    lab.checks.pdl_ptx's to check (tests/test_pdl.py), on the PTX for sm_90."""
    gen = torch.Generator().manual_seed(12)
    x = (2 * torch.randn(2, 400 if fold == "silu_mul" else 200, generator=gen)).to(torch.bfloat16)
    w = torch.randn(24, 200, generator=gen).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(200, generator=gen)).to(torch.bfloat16)

    def run():
        if fold == "norm":
            return gv.gemv_rms_norm(x, None, norm_w, 1e-6, w, tiles=(8, 32, 4))[0]
        return gv.gemv(x, w, silu_mul=fold == "silu_mul", tiles=(8, 32, 4))

    with kernel_options(triton_on_cpu=True, gemv_stages=1):
        want = run()
    for stages in (2, 3, 4):
        for prefetch in (False, True):
            with kernel_options(triton_on_cpu=True, gemv_stages=stages, gemv_prefetch=prefetch):
                assert torch.equal(run(), want), (stages, prefetch)


@pytest.mark.parametrize("act_out", [True, False])
def test_mlp_prefetch_regions_follow_the_order_the_mlp_reads(act_out):
    """Kernel option gemv_mlp_prefetch_mb: the o GEMV's L2 prefetch is the MLP's weights in the order its GEMVs read
    them, as views of the weights themselves: the gate rows and (with the activation in gate_up's epilogue, where a
    program owns a gate row and its up row) as many up rows, then down's first rows; capped at max_bytes."""
    half, k = 48, 64  # gate_up [2 * 48, 64] (128 bytes a row in bf16), down [32, 48] (96 bytes a row)
    gate_up = torch.randn(2 * half, k).to(torch.bfloat16)
    down = torch.randn(32, half).to(torch.bfloat16)
    everything = gv.mlp_prefetch_regions(gate_up, down, act_out, 1 << 20)
    assert sum(r.numel() for r in everything) == gate_up.numel() + down.numel()
    assert everything[-1].data_ptr() == down.data_ptr() and everything[-1].shape == down.shape
    assert all(r.is_contiguous() for r in everything)
    capped = gv.mlp_prefetch_regions(gate_up, down, act_out, 40 * 128 + 2 * 96)  # 40 gate_up rows, 2 of down
    if act_out:  # 20 gate rows and the 20 up rows beside them
        assert [(r.data_ptr() - gate_up.data_ptr()) // (k * 2) for r in capped[:2]] == [0, half]
        assert [r.shape[0] for r in capped] == [20, 20, 2]
    else:
        # the rows in order: 41 of them (5,248 bytes), which leaves less than a row of down
        assert capped[0].data_ptr() == gate_up.data_ptr() and [r.shape[0] for r in capped] == [41]
    assert gv.mlp_prefetch_regions(gate_up, down, act_out, 90) == ()  # less than a row of anything


def test_prefetch_plan_spreads_pieces_over_programs():
    """The launch's L2 prefetch plan: each weight in 16 KiB pieces (the last one ending at the weight's end), pieces
    over programs (a power of two a program), short or misaligned weights left out, unused regions padded."""
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    piece = gv.PREFETCH_PIECE_BYTES // 2
    big, small = torch.zeros(5 * piece + 8, dtype=torch.bfloat16), torch.zeros(piece // 2, dtype=torch.bfloat16)
    regions, used, lanes, got_piece = gv._prefetch_plan((big, small), 2, w)
    assert got_piece == piece and used == 1 and len(regions) == gv.MAX_PREFETCH_REGIONS
    assert regions[0] == (big, 6, big.numel() - piece) and regions[1] == (w, 0, 0)
    assert lanes == 4  # 6 pieces over 2 programs: 3 each, rounded up to a power of two
    assert gv._prefetch_plan((big[1:],), 2, w)[1] == 0  # 2 bytes in: not 16-byte aligned
    with pytest.raises(ValueError, match="at most"):
        gv._prefetch_plan((big,) * 4, 2, w)
