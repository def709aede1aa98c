"""Gated DeltaNet Triton kernels (minisgl/kernels/gdn.py) under the Triton interpreter, on CPU, against the
torch references: causal_conv1d (decode and varlen, sequences shorter than K-1) and gated_delta_rule (decode,
recurrent and chunked prefill, head sharing, slots out of order, strided q/k/v views), fp32 and bf16.

Skipped when Triton is not installed (CI without it). Shapes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import use_triton_interpreter  # noqa: E402

use_triton_interpreter("minisgl.kernels.gdn")  # numpy patch; re-decorate the module if imported before

from minisgl.kernels import gdn  # noqa: E402

LENS = [1, 2, 3, 7, 17]  # mixed extend batch: two shorter than K - 1 = 3


@pytest.fixture
def force_triton(options_for_test):
    options_for_test(triton_on_cpu=True)


@pytest.fixture
def gdn_launch(options_for_test):
    """`gdn_launch(**changes)`: GdnLaunch fields for the rest of the test (over the options in force)."""
    from dataclasses import replace

    from minisgl.kernels.options import current_options
    return lambda **changes: options_for_test(gdn=replace(current_options().gdn, **changes))


def _tol(dtype: torch.dtype) -> float:
    # The interpreter rounds fp32 -> bf16 by truncation (the GPU rounds to nearest): allow 2 bf16 ulps.
    return 1e-5 if dtype == torch.float32 else 2 ** -6


def _batch(lens: list[int], num_slots: int, gen: torch.Generator):
    """cu_seqlens for the lengths and distinct slots in a shuffled order (never slot 0, kept as a witness)."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    slots = torch.randperm(num_slots - 1, generator=gen)[: len(lens)] + 1
    return cu, slots


# ------------------------------------------------------------------ causal_conv1d ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [LENS, [1] * 5, [2, 1]], ids=["varlen", "decode", "short"])
def test_causal_conv1d(force_triton, dtype, lens):
    gen = torch.Generator().manual_seed(0)
    c, kw, num_slots = 32, 4, 9
    t = sum(lens)
    big = torch.randn(t, 3 * c, generator=gen).to(dtype)
    x = big[:, c: 2 * c]  # a strided view, as a slice of a projection output
    weight = torch.randn(c, kw, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype)
    state = torch.randn(num_slots, c, kw - 1, generator=gen).to(dtype)
    cu, slots = _batch(lens, num_slots, gen)
    ref_state = state.clone()
    ref = gdn.causal_conv1d_ref(x, weight, bias, ref_state, slots, cu)
    out = gdn.causal_conv1d(x, weight, bias, state, slots, cu)
    tol = _tol(dtype)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    # the new states are copies of inputs / old state (exact), and rows not in the batch are untouched
    assert torch.equal(state, ref_state)


def test_causal_conv1d_no_bias_fp32_state_bf16_input(force_triton):
    gen = torch.Generator().manual_seed(1)
    c, kw, num_slots = 48, 4, 6  # C not a multiple of the channel block
    lens = [5, 1, 2]
    x = torch.randn(sum(lens), c, generator=gen).to(torch.bfloat16)
    weight = torch.randn(c, kw, generator=gen)
    state = torch.randn(num_slots, c, kw - 1, generator=gen)
    cu, slots = _batch(lens, num_slots, gen)
    ref_state = state.clone()
    ref = gdn.causal_conv1d_ref(x, weight, None, ref_state, slots, cu)
    out = gdn.causal_conv1d(x, weight, None, state, slots, cu)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -6)
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("search_steps", [0, 16, 2], ids=["exact", "fixed", "below-need"])
def test_causal_conv1d_search_steps(force_triton, gdn_launch, search_steps):
    """The varlen conv's binary search compiled with more steps than the batch needs (gdn.conv_search_steps,
    one Triton variant for every batch) gives the reference's outputs and states; a count below the need
    falls back to the exact one. 37 sequences (6 steps needed), empty ones among them (the search must land
    on the last of several sequences sharing a bound)."""
    gdn_launch(conv_search_steps=search_steps)
    gen = torch.Generator().manual_seed(2)
    c, kw, num_slots = 16, 4, 41
    lens = [int(n) for n in torch.randint(0, 4, (37,), generator=gen)]
    lens[0], lens[-1] = 0, 5
    x = torch.randn(sum(lens), c, generator=gen)
    weight, bias = torch.randn(c, kw, generator=gen), torch.randn(c, generator=gen)
    state = torch.randn(num_slots, c, kw - 1, generator=gen)
    cu, slots = _batch(lens, num_slots, gen)
    assert gdn.search_steps(len(lens)) == max(6, search_steps)
    ref_state = state.clone()
    ref = gdn.causal_conv1d_ref(x, weight, bias, ref_state, slots, cu)
    out = gdn.causal_conv1d(x, weight, bias, state, slots, cu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(state, ref_state)


def test_conv_search_steps_one_variant_for_engine_batches():
    """With the default fixed count every batch an engine builds (up to 1,024 running requests plus a chunk's
    prefills) compiles the same variant; 0 restores one per power of two (the W1 compiles in a timed run)."""
    from minisgl.config import GdnLaunch
    assert {gdn.search_steps(n) for n in range(1, 2048)} == {GdnLaunch().conv_search_steps}
    exact = {max(1, (n - 1).bit_length()) for n in range(1, 300)}
    assert exact == set(range(1, 10))


# ------------------------------------------------------------------ gated_delta_rule ------------------------


def _gdr_inputs(lens, hk, hv, d, dtype, num_slots, gen):
    t = sum(lens)
    # q, k, v as views into one projection output (token stride > row width)
    proj = torch.randn(t, (2 * hk + hv) * d + 8, generator=gen).to(dtype)
    q = proj[:, : hk * d].view(t, hk, d)
    k = proj[:, hk * d: 2 * hk * d].view(t, hk, d)
    v = proj[:, 2 * hk * d: (2 * hk + hv) * d].view(t, hv, d)
    g = (-torch.rand(t, hv, generator=gen) * 0.5).to(dtype)  # log decays in (-0.5, 0]
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    state = torch.randn(num_slots, hv, d, d, generator=gen) * 0.1
    cu, slots = _batch(lens, num_slots, gen)
    return q, k, v, g, beta, state, slots, cu


def _both(q, k, v, g, beta, state, slots, cu):
    """The kernel's output (its state updated in place in `state`) and the reference's, on a copy of the state."""
    ref_state = state.clone()
    ref = gdn.gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, cu)
    return gdn.gated_delta_rule(q, k, v, g, beta, state, slots, cu), ref, ref_state


def _check_gdr(lens, hk, hv, d, dtype, mode, gdn_launch, seed=0):
    gdn_launch(prefill=mode, dot_precision="ieee")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta, state, slots, cu = _gdr_inputs(lens, hk, hv, d, dtype, 8, gen)
    out, ref, ref_state = _both(q, k, v, g, beta, state, slots, cu)
    assert out.shape == v.shape and out.dtype == v.dtype
    tol = 1e-4 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(state[untouched], ref_state[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_gated_delta_rule_varlen(force_triton, gdn_launch, dtype, mode):
    _check_gdr(LENS, 2, 4, 16, dtype, mode, gdn_launch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_rule_decode(force_triton, gdn_launch, dtype):
    _check_gdr([1] * 5, 2, 4, 16, dtype, "chunked", gdn_launch)


def test_gated_delta_rule_chunks_cross(force_triton, gdn_launch):
    """Sequences over one chunk of 64 (and one ending on its boundary), no head sharing, Dk = Dv = 32."""
    _check_gdr([70, 64, 3], 2, 2, 32, torch.float32, "chunked", gdn_launch, seed=3)


@pytest.mark.parametrize("solve", ["rows", "blocks"])
@pytest.mark.parametrize("search_steps", [0, 16])
def test_gated_delta_rule_chunk_slots_of_a_mixed_step(force_triton, gdn_launch, search_steps, solve):
    """A mixed step's layout: decode rows (sequences of one token) beside prefill chunks that start off the
    64-token grid and span several chunks, an empty sequence among them. The prepare kernel's program per chunk
    slot (sequence s owns slots s + cu[s] // 64 ..) finds every chunk by binary search, with exactly the steps
    the batch needs (0) or more (the engine's one variant)."""
    lens = [1] * 9 + [130, 0, 64, 65, 3, 1, 200, 1]
    gdn_launch(prefill="chunked", dot_precision="ieee", conv_search_steps=search_steps, prepare_solve=solve)
    gen = torch.Generator().manual_seed(11)
    q, k, v, g, beta, state, slots, cu = _gdr_inputs(lens, 1, 2, 16, torch.float32, len(lens) + 2, gen)
    out, ref, ref_state = _both(q, k, v, g, beta, state, slots, cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lens", [[70, 64, 3], [1, 1, 130, 0, 200, 1, 3], [17, 33, 48, 15, 16, 64]],
                         ids=["cross", "mixed-step", "block-edges"])
def test_gated_delta_rule_blocked_solve(force_triton, gdn_launch, lens):
    """The chunk prepare's other triangular solve (gdn.prepare_solve "blocks": 16-token blocks, merged by block
    products): the same outputs and states as the reference, chunks ending on and between the 16-token blocks."""
    gdn_launch(prepare_solve="blocks")
    _check_gdr(lens, 1, 2, 16, torch.float32, "chunked", gdn_launch, seed=12)


@pytest.mark.parametrize("solve", ["rows", "blocks"])
def test_gated_delta_rule_chunked_similar_keys(force_triton, gdn_launch, solve):
    """Near-identical keys, beta = 1, no decay: the chunk's triangular solve must stay stable (a Neumann-series
    inverse loses everything here), either way it is solved."""
    gdn_launch(dot_precision="ieee", prepare_solve=solve)
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta, state, slots, cu = _gdr_inputs([66, 5], 1, 2, 16, torch.float32, 4, gen)
    k = (k + 5 * k[:1]).contiguous()
    g, beta = torch.zeros_like(g), torch.ones_like(beta)
    out, ref, ref_state = _both(q, k, v, g, beta, state, slots, cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
def test_gated_delta_rule_dk_ne_dv_and_empty_sequence(force_triton, gdn_launch, mode):
    gdn_launch(prefill=mode, dot_precision="ieee")
    gen = torch.Generator().manual_seed(6)
    t, hk, hv, dk, dv = 12, 1, 2, 16, 32
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen), torch.rand(t, hv, generator=gen)
    state = torch.randn(5, hv, dk, dv, generator=gen)
    cu = torch.tensor([0, 3, 3, 12], dtype=torch.int32)  # the second sequence is empty: its state stays
    slots = torch.tensor([4, 1, 2])
    out, ref, ref_state = _both(q, k, v, g, beta, state, slots, cu)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, ref_state, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["chunked", "recurrent"])
@pytest.mark.parametrize("pad_reqs", [0, 3], ids=["tokens-only", "tokens-and-requests"])
def test_prefill_graph_padding_touches_only_the_dummy_slot(force_triton, gdn_launch, mode, pad_reqs):
    """A hybrid prefill graph's padded layout (engine/hybrid.pad_state_step): padded requests empty, on the
    dummy slot, at the end of the real tokens; padded tokens past cu_seqlens[N] belong to none. The real rows'
    outputs and states equal the unpadded run's, and no slot but the dummy one changes otherwise."""
    gdn_launch(prefill=mode, dot_precision="ieee")
    gen = torch.Generator().manual_seed(7)
    lens, pad_tokens, num_slots, dummy = [5, 1, 9], 11, 8, 7
    t = sum(lens)
    q, k, v, g, beta, state, slots, cu = _gdr_inputs(lens, 2, 4, 16, torch.float32, num_slots - 1, gen)
    state = torch.cat([state, torch.randn(1, *state.shape[1:], generator=gen)])  # + the dummy slot
    c, kw = 24, 4
    x = torch.randn(t, c, generator=gen)
    weight = torch.randn(c, kw, generator=gen)
    conv = torch.randn(num_slots, c, kw - 1, generator=gen)
    ref_conv, ref_state = conv.clone(), state.clone()
    ref_x = gdn.causal_conv1d_ref(x, weight, None, ref_conv, slots, cu)
    ref_o = gdn.gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, cu)

    def pad(a, scale=100.0):  # padded tokens carry large values: any leak into a real row or state would show
        return torch.cat([a, scale * torch.randn(pad_tokens, *a.shape[1:], generator=gen)])

    p_slots = torch.cat([slots, torch.full((pad_reqs,), dummy)])
    p_cu = torch.cat([cu, torch.full((pad_reqs,), t, dtype=cu.dtype)])
    out_x = gdn.causal_conv1d(pad(x), weight, None, conv, p_slots, p_cu)
    p_g, p_beta = pad(g, 1.0).clamp(max=0), pad(beta, 1.0).abs().clamp(max=1)  # no-ops on the real rows
    out_o = gdn.gated_delta_rule(pad(q), pad(k), pad(v), p_g, p_beta, state, p_slots, p_cu)
    torch.testing.assert_close(out_x[:t], ref_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_o[:t], ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv[:dummy], ref_conv[:dummy], rtol=0, atol=0)
    torch.testing.assert_close(state[:dummy], ref_state[:dummy], rtol=1e-4, atol=1e-4)
    # an empty sequence keeps its state, so even the dummy slot is left as it was
    assert torch.equal(conv[dummy], ref_conv[dummy]) and torch.equal(state[dummy], ref_state[dummy])


def test_gdn_cpu_path_without_force():
    """Without the option, CPU tensors take the torch reference."""
    from minisgl.kernels.options import current_options
    assert not current_options().triton_on_cpu
    gen = torch.Generator().manual_seed(4)
    q, k, v, g, beta, state, slots, cu = _gdr_inputs([3, 1], 1, 2, 16, torch.float32, 4, gen)
    ref_state = state.clone()
    assert torch.equal(gdn.gated_delta_rule(q, k, v, g, beta, state, slots, cu),
                       gdn.gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, cu))
    assert torch.equal(state, ref_state)
