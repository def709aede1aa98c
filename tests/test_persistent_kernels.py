"""Persistent kernels under the Triton interpreter, against the engine's own kernels launched one by one: the
decode-layers kernel (minisgl/kernels/decode_layers.py, kernel option decode_megakernel) and the lab's GEMV chain
(lab/checks/persistent_gemv.py).

The interpreter runs a grid's programs one after another, so a grid barrier can only pass with a single program:
these tests run one program, which then does every phase's work items itself, in order. What they check is the
arithmetic (the same bits as the engine's launches) and the hand-offs between phases (buffers, the residual's
alternation, the weights loaded before a barrier); the barrier itself, and several programs, only a GPU can run
(the lab checks compare against the engine there before timing anything)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import dataclasses

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import kernel_options, use_triton_interpreter  # noqa: E402

use_triton_interpreter("minisgl.kernels.gemv", "minisgl.kernels.elementwise", "minisgl.kernels.attention",
                       "minisgl.kernels.decode_layers", "lab.checks.persistent_gemv")

from lab.checks import persistent_gemv as pg  # noqa: E402
from lab.checks.decode_megakernel import engine_layers  # noqa: E402
from minisgl.engine.decode_layers import DecodeLayers  # noqa: E402
from minisgl.kernels import decode_layers as dl  # noqa: E402


@pytest.fixture
def force_triton():
    with kernel_options(triton_on_cpu=True):
        yield


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_persistent_gemv_chain_is_the_engines_chain(force_triton, prefetch):
    """Every matmul of every layer in one launch: the same vector to the bit as the engine's gemv() launches,
    partial tiles and several K blocks included."""
    shapes = {"layers": 2, "qkv": (90, 32), "o": (32, 64), "gate_up": (80, 32), "down": (32, 40)}
    tiles = {"qkv": (4, 16, 4), "o": (1, 32, 4), "gate_up": (8, 32, 4), "down": (2, 16, 4)}
    ws = pg.make_weights(shapes, device="cpu")
    h0 = torch.randn(32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    want = pg.gemv_chain(ws, h0, tiles)
    got = pg.PersistentChain(ws, h0, tiles, programs=1, prefetch=prefetch).run()
    assert want.abs().sum() > 0 and torch.equal(got, want)


def _layers_and_step(dtype: torch.dtype, num_splits: int, seq_len: int):
    """Two random Qwen3-shaped layers (4 q heads, 2 kv heads of 16) and a request of seq_len tokens whose last is
    this step's, its keys scattered over a pool of 512 slots."""
    gen = torch.Generator().manual_seed(0)
    L, hidden, hq, hkv, d, inter = 2, 64, 4, 2, 16, 48

    def rnd(*shape, scale=1.0, plus=0.0):
        return (torch.randn(*shape, generator=gen) * scale + plus).to(dtype)

    w = dl.LayerStack(
        ln1=rnd(L, hidden, scale=0.1, plus=1.0), qkv=rnd(L, (hq + 2 * hkv) * d, hidden, scale=hidden ** -0.5),
        q_norm=rnd(L, d, scale=0.1, plus=1.0), k_norm=rnd(L, d, scale=0.1, plus=1.0),
        o=rnd(L, hidden, hq * d, scale=(hq * d) ** -0.5), ln2=rnd(L, hidden, scale=0.1, plus=1.0),
        gate_up=rnd(L, 2 * inter, hidden, scale=hidden ** -0.5), down=rnd(L, hidden, inter, scale=inter ** -0.5),
        eps=1e-6, qk_eps=1e-6, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    pool = torch.randn(2, L, 512, hkv, d, generator=gen).to(dtype)  # the KV pool's one tensor: [K|V, layer, slot]
    slots = torch.randperm(511, generator=gen)[:seq_len] + 1
    req_to_token = torch.zeros(4, 512, dtype=torch.int32)
    req_to_token[2, :seq_len] = slots.int()
    angles = torch.arange(1024).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None]
    step = dl.DecodeStep(
        k_buffers=[pool[0, i] for i in range(L)], v_buffers=[pool[1, i] for i in range(L)],
        req_to_token=req_to_token, req_pool_indices=torch.tensor([2]),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), out_cache_loc=slots[seq_len - 1:],
        positions=torch.tensor([seq_len - 1]), cos_sin=torch.cat([angles.cos(), angles.sin()], -1).contiguous(),
        scale=d ** -0.5, num_splits=num_splits)
    tiles = {"qkv": (4, 32, 4), "o": (2, 32, 4), "gate_up": (4, 64, 4), "down": (2, 16, 4)}
    return w, step, pool, tiles, rnd(hidden)


# fp16, not bf16: the interpreter's bf16 dots are wrong (numpy has no bf16), the engine's decode kernel's too
@pytest.mark.parametrize("dtype,num_splits,seq_len,prefetch,ahead,merge_last,arrive_first,early_kv", [
    (torch.float16, 3, 200, True, True, True, False, False),  # the new token in the second split, the third empty
    (torch.float16, 3, 200, False, True, False, False, False),  # the splits merged in a phase of their own
    (torch.float32, 1, 70, False, False, True, False, False),  # one split (the merge of one), fp32 dots
    (torch.float16, 3, 200, True, True, True, True, False),  # the next weights loaded after each arrival
    (torch.float16, 3, 200, True, True, True, False, True),  # the first item's first key tile read early
    (torch.float16, 3, 60, True, True, False, True, True),  # ... holding the new token (patched from registers)
])
def test_the_megakernel_is_the_engines_layers_to_the_bit(force_triton, dtype, num_splits, seq_len, prefetch, ahead,
                                                          merge_last, arrive_first, early_kv):
    """Every layer of a decode step in one launch: the hidden state, the residual and the K/V it stores equal the
    engine's kernels' (norm, qkv GEMV, q/k norm + RoPE, decode attention with the fused store, o GEMV, norm,
    gate_up GEMV, down GEMV) to the bit."""
    w, step, pool, tiles, x = _layers_and_step(dtype, num_splits, seq_len)
    before = pool.clone()
    parts: dict = {}
    want_h, want_r = engine_layers(w, step, x, tiles, parts)
    want_pool = pool.clone()
    assert not torch.equal(want_pool, before)  # the step's K/V went into the pool
    pool.copy_(before)
    kernel = dl.DecodeLayersKernel(w, step, tiles, programs=1, prefetch=prefetch, ahead=ahead, merge_last=merge_last,
                                   arrive_first=arrive_first, early_kv=early_kv)
    got_h, got_r = kernel.run(x)
    assert torch.isfinite(want_h.float()).all() and want_h.abs().sum() > 0
    assert torch.equal(got_h, want_h) and torch.equal(got_r, want_r)
    assert torch.equal(pool, want_pool)
    # the last layer's buffers, phase by phase (what lab.checks.decode_megakernel compares on a GPU for layer 0)
    mine = {"qkv": kernel.qkv, "att": kernel.att, "o": kernel.o, "gu": kernel.gu, "x": kernel.x, "r1": kernel.r1,
            "r0": kernel.r0}
    assert sorted(parts) == sorted(mine) and all(torch.equal(mine[k], parts[k]) for k in parts)
    # the barrier counted every phase of every layer, and each kv head's merge ticket is re-armed
    assert kernel.counter.tolist() == [(6 - merge_last) * w.ln1.shape[0]] + [0] * w.num_kv_heads


def test_first_difference_finds_none_and_finds_a_changed_layer(force_triton, monkeypatch):
    """The lab's layer-by-layer search (lab.checks.decode_megakernel.first_difference): no layer differs for the
    kernel as it is; with the second layer's down projection changed for the kernel only, layer 1 does, in its down
    output (x) and nowhere before it."""
    from lab.checks.decode_megakernel import first_difference

    w, step, pool, tiles, x = _layers_and_step(torch.float16, 3, 200)
    assert first_difference(w, step, x, tiles, 1) == {"layer": None}
    real = dl.DecodeLayersKernel.run

    def off_by_one_down(self, x):  # the kernel reads a slightly different down weight in layer 1
        self.w = dataclasses.replace(self.w, down=self.w.down.clone())
        if self.w.down.shape[0] > 1:
            self.w.down[1, 0, 0] += 1.0
        return real(self, x)

    monkeypatch.setattr(dl.DecodeLayersKernel, "run", off_by_one_down)
    got = first_difference(w, step, x, tiles, 1)
    assert got["layer"] == 1
    assert {k for k, v in got["phases"].items() if v["elements_differ"]} == {"x"}


@pytest.mark.parametrize("seq_len,early_kv", [(200, False), (60, True)])
def test_the_megakernel_reads_the_key_it_stored(force_triton, seq_len, early_kv):
    """The attention phase reads the new token's key from the pool after storing it (or, read early, patches it
    in): a stale key there (the engine's forward never ran) must not change the result."""
    w, step, pool, tiles, x = _layers_and_step(torch.float16, 3, seq_len)
    want_h, _ = engine_layers(w, step, x, tiles)
    slot = int(step.out_cache_loc)
    pool[:, :, slot] = 100.0  # what a stale slot would hold
    got_h, _ = dl.DecodeLayersKernel(w, step, tiles, programs=1, early_kv=early_kv).run(x)
    assert torch.equal(got_h, want_h)


def test_the_engine_runs_one_row_decode_steps_through_the_kernel(qwen3_path, llama_path, make_llm, monkeypatch):
    """The kernel option decode_megakernel: a tiny Qwen3 (fp32) on the Triton backend under the interpreter takes
    the kernel for its one-row decode steps only (prefills and two-row steps run the layers one by one), with the
    layers' weights held once (views of the stacks); its greedy tokens equal Hugging Face's, and on a two-request
    batch the engine's without the option. A model the kernel does not fit (Llama: no q/k norms) keeps its layers
    and says why."""
    from helpers import assert_parity, hf_greedy

    from minisgl import SamplingParams

    runs = []
    run = dl.DecodeLayersKernel.run

    def recorded(self, x):
        runs.append(x.shape)
        return run(self, x)

    monkeypatch.setattr(dl.DecodeLayersKernel, "run", recorded)
    common = dict(dtype="float32", attention_backend="triton", page_size=4, triton_on_cpu=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 9, 17, 3, 44, 8, 21, 60, 2, 7, 11]]
    llm = make_llm(qwen3_path, decode_megakernel=True, **common)
    runner = llm.engine.runner
    assert runner.decode_megakernel == "on" and isinstance(runner.model.layers[0], DecodeLayers)
    inner = runner.model.layers[0].layers
    assert inner[1].self_attn.qkv_proj.weight.data_ptr() - inner[0].self_attn.qkv_proj.weight.data_ptr() == (
        inner[0].self_attn.qkv_proj.weight.numel() * 4)  # consecutive slices of one stack
    one = llm.generate(prompts, params)
    assert len(runs) == 3  # the three decode steps after the prefill
    two = llm.generate(prompts + [[100, 4, 4, 4, 33]], params)  # two rows a step: the layers one by one
    assert len(runs) == 3
    assert_parity(one, hf_greedy(qwen3_path, prompts, max_new_tokens=4), prompts)
    plain = make_llm(qwen3_path, **common)  # the same engine without the option, on the two-request batch
    assert [o.token_ids for o in two] == [o.token_ids for o in plain.generate(prompts + [[100, 4, 4, 4, 33]], params)]
    assert one[0].token_ids == two[0].token_ids
    llama = make_llm(llama_path, decode_megakernel=True, **common)
    assert llama.engine.runner.decode_megakernel == "its attention has no per-head q/k norms (Qwen3's)"


def test_phase_times_reads_the_barrier_stamps():
    """`phase_times` from hand-made stamps: two programs, one layer with the merge phase (six barriers); each phase
    lasts until its last arrival, each wait from there to the first departure."""
    w, step, _, tiles, _ = _layers_and_step(torch.float16, 3, 200)
    w = dl.LayerStack(**{**{f: getattr(w, f) for f in w.__dataclass_fields__},
                         **{f: getattr(w, f)[:1] for f in ("ln1", "qkv", "q_norm", "k_norm", "o", "ln2", "gate_up",
                                                           "down")}})
    kernel = dl.DecodeLayersKernel(w, step, tiles, programs=2, merge_last=False, times=True)
    assert kernel.times.shape == (2, 7, 2)
    for b in range(7):  # program 0 arrives at 10b, program 1 at 10b + 3; departures at 10b + 5 and 10b + 6
        kernel.times[0, b] = torch.tensor([10 * b, 10 * b + 5])
        kernel.times[1, b] = torch.tensor([10 * b + 3, 10 * b + 6])
    got = kernel.phase_times()
    assert got.shape == (6, 3)
    # phase: last arrival 10b + 3 less the earliest departure 10(b - 1) + 5; wait: 10b + 5 - (10b + 3); spread 1
    assert got.tolist() == [[8.0, 2.0, 1.0]] * 6
