"""The engine's torch backend (`PaddedDecodeTorchBackend`, issue 28): a decode step as one padded op, checked
against the reference loop (`TorchAttentionBackend`, the course's exercise) on random pools: grouped-query and
multi-query heads, page sizes 1 and 4, contexts of 1 to 300 tokens in one batch, fp32 and bf16 pools, rows grouped
by length; prefill and mixed steps go through the loop untouched; the engine runs the padded backend."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import PROMPTS, assert_parity, hf_greedy

from minisgl import SamplingParams
from minisgl.attention import AttentionMetadata, PaddedDecodeTorchBackend, TorchAttentionBackend
from minisgl.kvcache import KVCache


def random_step(seed: int, lens: list[tuple[int, int]], hq: int, hkv: int, d: int, page_size: int, dtype):
    """A pool with random K/V for every request's prefix (slots scattered over shuffled pages, stale slots in
    the table past each request's length), the step's metadata, and random q/k/v for its new tokens."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    max_len = max(p + e for p, e in lens) + page_size
    pages_needed = sum(-(-(p + e) // page_size) for p, e in lens)
    num_pages = pages_needed + 8
    kv = KVCache(2, num_pages, page_size, hkv, d, dtype, "cpu")
    kv.buffer.copy_(torch.randn(kv.buffer.shape, generator=gen).to(dtype))  # stale values everywhere
    pages = list(range(1, num_pages))
    rng.shuffle(pages)
    table = torch.randint(0, num_pages * page_size, (len(lens) + 3, max_len), generator=gen, dtype=torch.int32)
    rows = rng.sample(range(len(lens) + 3), len(lens))
    locs = []
    for row, (prefix, ext) in zip(rows, lens):
        n = -(-(prefix + ext) // page_size)
        mine, pages = pages[:n], pages[n:]
        slots = [mine[i // page_size] * page_size + i % page_size for i in range(prefix + ext)]
        table[row, :prefix + ext] = torch.tensor(slots, dtype=torch.int32)
        locs += slots[prefix:]
    ext = [e for _, e in lens]
    t32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        is_decode=all(e == 1 for e in ext), req_pool_indices=torch.tensor(rows), seq_lens=t32([p + e for p, e in lens]),
        prefix_lens=t32([p for p, _ in lens]), extend_lens=t32(ext),
        extend_start=t32([sum(ext[:i]) for i in range(len(ext))]), out_cache_loc=torch.tensor(locs),
        max_seq_len=max(p + e for p, e in lens), max_extend_len=max(ext))
    total = sum(ext)
    qkv = [torch.randn(total, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv)]
    return kv, table, meta, qkv


def run(backend_cls, kv, table, meta, qkv, hq, hkv, d, **attrs):
    """Both layers of one step on a copy of the pool; returns the outputs and the pool after the step."""
    kv = _copy(kv)
    backend = backend_cls(kv, table, hq, hkv, d, d ** -0.5)
    for name, value in attrs.items():
        setattr(backend, name, value)
    backend.prepare(meta)
    outs = torch.stack([backend.forward(*qkv, layer) for layer in range(2)])
    return outs, kv.buffer


def _copy(kv: KVCache) -> KVCache:
    out = KVCache(kv.num_layers, kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim, kv.buffer.dtype, "cpu")
    out.buffer.copy_(kv.buffer)
    return out


DECODE_CASES = [  # (hq, hkv, d, page_size, context lengths before the step)
    (4, 2, 16, 4, [3, 10, 0, 17]), (8, 1, 8, 1, [40, 0, 7]), (6, 6, 32, 4, [299]), (4, 2, 16, 1, [0]),
    (16, 4, 64, 4, [5 * i for i in range(24)]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_padded_decode_equals_the_loop(case, dtype):
    hq, hkv, d, page_size, contexts = DECODE_CASES[case]
    kv, table, meta, qkv = random_step(case, [(c, 1) for c in contexts], hq, hkv, d, page_size, dtype)
    assert meta.is_decode
    ref, ref_pool = run(TorchAttentionBackend, kv, table, meta, qkv, hq, hkv, d)
    out, pool = run(PaddedDecodeTorchBackend, kv, table, meta, qkv, hq, hkv, d)
    assert out.dtype == dtype and torch.equal(pool, ref_pool)  # the same K/V stored
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the last rounding to q's dtype may differ by an ulp
    assert torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol), (out.float() - ref.float()).abs().max()


def test_row_groups_equal_one_group():
    """A batch whose gathered keys would pass max_gather_elements is cut into more groups: same result."""
    hq, hkv, d = 8, 2, 16
    kv, table, meta, qkv = random_step(7, [(c, 1) for c in (12, 9, 13, 7, 10)], hq, hkv, d, 4, torch.float32)
    whole, _ = run(PaddedDecodeTorchBackend, kv, table, meta, qkv, hq, hkv, d)
    cut, _ = run(PaddedDecodeTorchBackend, kv, table, meta, qkv, hq, hkv, d, max_gather_elements=2 * 14 * hkv * d)
    assert torch.allclose(cut, whole, atol=1e-6)


def test_groups_bound_the_padding():
    """Rows sorted by length and cut where the longest passes twice the shortest: one 300-token request among
    short ones is its own group, so the padded op reads at most twice the keys the loop reads."""
    hq, hkv, d = 4, 2, 8
    contexts = [299, 3, 5, 2, 40, 9, 0, 35]
    kv, table, meta, qkv = random_step(11, [(c, 1) for c in contexts], hq, hkv, d, 4, torch.float32)
    backend = PaddedDecodeTorchBackend(_copy(kv), table, hq, hkv, d, d ** -0.5)
    backend.prepare(meta)
    lens = [c + 1 for c in contexts]
    groups = [(rows.tolist(), valid.shape[1]) for rows, _, valid in backend.decode_groups]
    assert sorted(r for rows, _ in groups for r in rows) == list(range(len(lens)))  # every row once
    for rows, width in groups:
        assert width == max(lens[r] for r in rows) and width <= 2 * min(lens[r] for r in rows)
    assert sum(len(rows) * width for rows, width in groups) <= 2 * sum(lens)
    ref, _ = run(TorchAttentionBackend, kv, table, meta, qkv, hq, hkv, d)
    assert torch.allclose(torch.stack([backend.forward(*qkv, layer) for layer in range(2)]), ref, atol=1e-5)


def test_prefill_and_mixed_steps_take_the_loop():
    hq, hkv, d = 4, 2, 16
    for lens in ([(5, 3), (0, 6), (9, 1)], [(0, 12)]):
        kv, table, meta, qkv = random_step(1, lens, hq, hkv, d, 4, torch.float32)
        assert not meta.is_decode
        ref, _ = run(TorchAttentionBackend, kv, table, meta, qkv, hq, hkv, d)
        out, _ = run(PaddedDecodeTorchBackend, kv, table, meta, qkv, hq, hkv, d)
        assert torch.equal(out, ref)


def test_the_engine_decodes_through_the_padded_op(qwen3_path, make_llm, monkeypatch):
    """The engine's torch backend is the padded one, its decode steps take the padded path, and its tokens are
    Hugging Face's (the parity tests elsewhere run it on every CPU engine too)."""
    calls = {"padded": 0}
    padded_forward = PaddedDecodeTorchBackend.forward

    def counting(self, q, k, v, layer_id):
        calls["padded"] += self.decode_groups is not None
        return padded_forward(self, q, k, v, layer_id)

    monkeypatch.setattr(PaddedDecodeTorchBackend, "forward", counting)
    llm = make_llm(qwen3_path, page_size=4, dtype="float32")
    assert type(llm.engine.runner.attn) is PaddedDecodeTorchBackend
    prompts = [PROMPTS[i] for i in (0, 1, 3, 6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert_parity(outs, hf_greedy(qwen3_path, prompts, 12), prompts)
    assert calls["padded"] >= 11 * 2  # 11 decode steps at least, 2 layers each
