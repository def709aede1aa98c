"""Notebook 10: the gated delta rule and the causal conv (torch references), the state pool's slots, and the
engine on a tiny Qwen3.5 with prefix-cache hits restored from snapshots (greedy tokens equal to transformers)."""

from __future__ import annotations

import itertools
import math
import random

import adapters
import pytest
import torch
import torch.nn.functional as F


def cu_of(lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def naive_delta_rule(q, k, v, g, beta, s0):
    """One sequence, one head at a time, with explicit matrices: (outputs [T, Hv, Dv], final state [Hv, Dk, Dv])."""
    n_tok, hv, dv = v.shape
    per_key = hv // k.shape[1]
    outs, final = torch.zeros(n_tok, hv, dv), []
    for head in range(hv):
        mem = s0[head].clone()
        for t in range(n_tok):
            key = F.normalize(k[t, head // per_key], dim=0)
            query = F.normalize(q[t, head // per_key], dim=0) / math.sqrt(k.shape[-1])
            mem *= math.exp(g[t, head])
            mem += beta[t, head] * torch.outer(key, v[t, head] - key @ mem)
            outs[t, head] = query @ mem
        final.append(mem)
    return outs, torch.stack(final)


@pytest.mark.parametrize("seed", range(4))
def test_delta_rule_against_naive(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hk = rng.choice([1, 2])
    hv, dk, dv = hk * rng.choice([1, 2]), rng.choice([4, 8]), rng.choice([2, 4])
    lens = [rng.randint(0, 6) for _ in range(rng.randint(1, 4))]
    n, t = len(lens), sum(lens)
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen), torch.rand(t, hv, generator=gen)
    state = torch.randn(n + 2, hv, dk, dv, generator=gen)
    slots = torch.tensor(rng.sample(range(n + 2), n))
    before = state.clone()
    out = adapters.gated_delta_rule_ref(q, k, v, g, beta, state, slots, cu_of(lens))
    assert out.shape == v.shape and out.dtype == v.dtype
    bounds = cu_of(lens).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        want_o, want_s = naive_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], before[slots[i]])
        assert torch.allclose(out[a:b], want_o, atol=1e-4), f"outputs of sequence {i} differ"
        assert torch.allclose(state[slots[i]], want_s, atol=1e-4), f"the state left in sequence {i}'s slot differs"
    untouched = sorted(set(range(n + 2)) - set(slots.tolist()))
    assert torch.equal(state[untouched], before[untouched])


def test_delta_rule_chunks_equal_one_step():
    gen = torch.Generator().manual_seed(7)
    t, hk, hv, dk, dv = 13, 2, 4, 8, 4
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g, beta = -torch.rand(t, hv, generator=gen), torch.rand(t, hv, generator=gen)
    one, many = torch.zeros(1, hv, dk, dv), torch.zeros(1, hv, dk, dv)
    slot = torch.tensor([0])
    whole = adapters.gated_delta_rule_ref(q, k, v, g, beta, one, slot, cu_of([t]))
    parts = [adapters.gated_delta_rule_ref(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], many, slot, cu_of([b - a]))
             for a, b in ((0, 5), (5, 6), (6, 7), (7, 13))]
    assert torch.allclose(torch.cat(parts), whole, atol=1e-5)
    assert torch.allclose(many, one, atol=1e-5)


def padded_conv(x, weight, bias=None):
    c, kw = weight.shape
    return F.silu(F.conv1d(F.pad(x.t()[None], (kw - 1, 0)), weight[:, None, :], bias, groups=c))[0].t()


@pytest.mark.parametrize("seed", range(4))
def test_conv_against_padded_conv(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    c, kw = rng.choice([3, 8]), rng.choice([2, 3, 4])
    lens = [rng.randint(1, 7) for _ in range(rng.randint(1, 4))]
    n = len(lens)
    x = torch.randn(sum(lens), c, generator=gen)
    weight = torch.randn(c, kw, generator=gen)
    bias = torch.randn(c, generator=gen) if seed % 2 else None
    state = torch.randn(n + 1, c, kw - 1, generator=gen)
    slots = torch.tensor(rng.sample(range(n + 1), n))
    before = state.clone()
    out = adapters.causal_conv1d_ref(x, weight, bias, state, slots, cu_of(lens))
    bounds = cu_of(lens).tolist()
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        seq = torch.cat([before[slots[i]].t(), x[a:b]])
        assert torch.allclose(out[a:b], padded_conv(seq, weight, bias)[kw - 1:], atol=1e-5), f"sequence {i}"
        assert torch.equal(state[slots[i]], seq[len(seq) - (kw - 1):].t()), f"sequence {i}: the new window"
    untouched = sorted(set(range(n + 1)) - set(slots.tolist()))
    assert torch.equal(state[untouched], before[untouched])


def test_state_bytes_per_slot():
    assert adapters.state_bytes_per_slot(18, 6144, 4, 16, 128, 128, torch.bfloat16) == \
        18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4)
    assert adapters.state_bytes_per_slot(2, 5, 3, 2, 3, 4, torch.float32) == 2 * (5 * 2 * 4 + 2 * 3 * 4 * 4)


@pytest.mark.parametrize("seed", range(3))
def test_snapshot_slots_against_a_set(seed):
    rng = random.Random(seed)
    rows, snaps = rng.randint(1, 5), rng.randint(0, 6)
    pool = adapters.state_pool(1, rows, snaps, 2, 2, 1, 1, 1, torch.float32)
    assert pool.dummy_slot == rows + snaps
    held: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            slot = held.pop(rng.randrange(len(held)))
            pool.free_snapshot(slot)
        else:
            slot = pool.alloc_snapshot()
            if len(held) == snaps:
                assert slot is None
            else:
                assert slot is not None and rows <= slot < rows + snaps and slot not in held
                held.append(slot)
        assert pool.num_free_snapshots == snaps - len(held)
    for bad in [*range(rows), rows + snaps, rows + snaps + 1, *[s for s in range(rows, rows + snaps) if s not in held]]:
        with pytest.raises(RuntimeError):
            pool.free_snapshot(bad)


def test_start_and_save_move_states():
    pool = adapters.state_pool(3, 4, 3, 2, 3, 2, 2, 2, torch.float32)
    gen = torch.Generator().manual_seed(0)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen))
    conv, rec = pool.conv.clone(), pool.recurrent.clone()
    pool.save([(0, 4), (2, 6)])
    assert torch.equal(pool.recurrent[:, 4], rec[:, 0]) and torch.equal(pool.conv[:, 6], conv[:, 2])
    pool.start([(1, 4), (3, None), (0, 6)])
    assert torch.equal(pool.recurrent[:, 1], rec[:, 0]) and torch.equal(pool.conv[:, 1], conv[:, 0])
    assert torch.equal(pool.recurrent[:, 0], rec[:, 2]) and torch.equal(pool.conv[:, 0], conv[:, 2])
    assert not pool.recurrent[:, 3].any() and not pool.conv[:, 3].any()
    assert torch.equal(pool.recurrent[:, 2], rec[:, 2]) and torch.equal(pool.recurrent[:, 5], rec[:, 5])
    pool.recurrent[:, 1] += 1
    assert torch.equal(pool.recurrent[:, 4], rec[:, 0]), "start copies the snapshot; it does not alias it"


# --- the engine on a tiny Qwen3.5 --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(3)
    model = Qwen3_5ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith("A_log"):  # slow decay: the state carries the prefix
                w.copy_(torch.empty(w.shape).uniform_(0.01, 0.3, generator=gen).log())
            elif w.ndim >= 2:
                w.normal_(0.0, 0.15, generator=gen)
    path = str(tmp_path_factory.mktemp("tiny-qwen35"))
    model.save_pretrained(path)
    return model, path


def test_qwen35_prefix_hits_restore_the_state(tiny_qwen35):
    model, path = tiny_qwen35
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(20)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 6, 11)] + \
        [[rng.randrange(3, 512) for _ in range(9)]]
    with torch.no_grad():
        refs = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = adapters.llm(path, device="cpu", dtype="float32", page_size=4, chunked_prefill_size=6)
    for _ in range(2):  # the second pass hits the cache and starts from the snapshots
        outs = llm.generate(prompts, adapters.greedy(12))
        assert [o.token_ids for o in outs] == refs
    assert sum(o.num_cached_prompt_tokens for o in outs) > 0, "the second pass reused no cached prefix"
