"""The fused Triton sampler draws exactly what the torch sampler draws (Triton interpreter on the CPU):
temperature, top-k, top-p and min-p, ties included, and a row's token never depends on the other rows."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch sampler is used")

import torch  # noqa: E402

from minisgl.engine.sampler import SamplingTensors, sample  # noqa: E402


def _interpreted():
    """The kernel module decorated under the interpreter: another test may have imported it without."""
    import importlib

    import minisgl.kernels.sampling as fused
    os.environ["TRITON_INTERPRET"] = "1"
    return importlib.reload(fused)


def _rows(vocab: int, gen: torch.Generator):
    """One row per combination worth telling apart: every top-k, top-p, min-p and temperature of the brief."""
    rows = []
    for k in (1, 2, 50, vocab):
        for p in (0.1, 0.9, 1.0):
            for min_p in (0.0, 0.05):
                rows.append(((0.7, 1.3, 0.0)[len(rows) % 3], k, p, min_p))
    t, k, p, mp = (torch.tensor(c) for c in zip(*rows))
    b = len(rows)
    seeds = torch.randint(0, 2**31, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    return t.float(), k.long(), p.float(), mp.float(), seeds, steps


def _logits(b: int, vocab: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    x = torch.randn(b, vocab, generator=gen) * 3
    if kind == "ties":  # a coarse grid: many exact ties, at every threshold
        x = (x * 2).round() / 2
    elif kind == "bf16":  # what the LM head gives (bf16 widened to fp32): the 4-pass search
        x = x.bfloat16().float()
    return x


def _reference(logits, t, k, p, mp, seeds, steps):
    st = SamplingTensors(t, k, p, seeds, steps, all_greedy=False, any_top_k_p=True, min_ps=mp)
    return sample(logits, st)


@pytest.mark.parametrize("kind", ["plain", "ties", "bf16"])
def test_fused_matches_reference(kind):
    fused = _interpreted()
    gen = torch.Generator().manual_seed(len(kind))
    vocab = 1200
    t, k, p, mp, seeds, steps = _rows(vocab, gen)
    logits = _logits(len(t), vocab, gen, kind)
    got = fused.fused_sample(logits, t, k, p, mp, seeds, steps, chunk=512)
    want = _reference(logits, t, k, p, mp, seeds, steps)
    assert got.tolist() == want.tolist()
    greedy = t == 0
    assert torch.equal(got[greedy], logits[greedy].argmax(-1))
    # the cuts bite: top-k 1 gives the argmax; without cuts, most sampling rows do not
    cut_to_one = ~greedy & (k == 1)
    top = logits.max(-1).values
    assert torch.equal(logits.gather(1, got[:, None])[cut_to_one, 0], top[cut_to_one])  # one of the maxima
    free = _reference(logits, t, torch.full_like(k, vocab), torch.ones_like(p), torch.zeros_like(mp), seeds, steps)
    assert (free[~greedy] != logits[~greedy].argmax(-1)).float().mean() > 0.5


def test_row_does_not_depend_on_batch_or_cuts():
    fused = _interpreted()
    gen = torch.Generator().manual_seed(7)
    vocab = 1000
    t, k, p, mp, seeds, steps = _rows(vocab, gen)
    logits = _logits(len(t), vocab, gen, "plain")
    full = fused.fused_sample(logits, t, k, p, mp, seeds, steps, chunk=256)
    for i in (3, 17, 22):  # alone, and in a batch in another order
        one = fused.fused_sample(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], mp[i:i + 1],
                                 seeds[i:i + 1], steps[i:i + 1], chunk=256)
        assert one.item() == full[i].item()
    perm = torch.randperm(len(t), generator=gen)[:9]
    sub = fused.fused_sample(logits[perm], t[perm], k[perm], p[perm], mp[perm], seeds[perm], steps[perm], chunk=256)
    assert sub.tolist() == full[perm].tolist()
    # rows without a cut draw the same token whether or not the batch runs the search (eager vs graph)
    plain = (k == vocab) & (p == 1) & (mp == 0)
    one_pass = fused.fused_sample(logits[plain], t[plain], k[plain], p[plain], mp[plain], seeds[plain],
                                  steps[plain], cuts=False, chunk=256)
    assert one_pass.tolist() == full[plain].tolist()


def test_temperature_only_matches_reference():
    fused = _interpreted()
    gen = torch.Generator().manual_seed(3000)
    b, vocab = 6, 3000
    logits = torch.randn(b, vocab, generator=gen) * 3
    temps = torch.tensor([0.0, 0.6, 1.0, 2.0, 0.6, 0.0])
    seeds = torch.randint(0, 2**31, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    st = SamplingTensors(temps, torch.full((b,), vocab), torch.ones(b), seeds, steps, False, False)
    got = fused.fused_sample(logits, temps, st.top_ks, st.top_ps, None, seeds, steps, cuts=False, chunk=1024)
    assert got.tolist() == sample(logits, st).tolist()
    assert got[0] == logits[0].argmax() and got[5] == logits[5].argmax()


def test_bf16_logits_draw_what_their_fp32_widening_draws():
    """The LM head's bf16 output goes to the sampler as is (half the bytes, 4 search passes): the same tokens
    as the float32 widening of the same values, greedy, temperature and every cut."""
    fused = _interpreted()
    gen = torch.Generator().manual_seed(16)
    vocab = 1100
    t, k, p, mp, seeds, steps = _rows(vocab, gen)
    narrow = (torch.randn(len(t), vocab, generator=gen) * 3).bfloat16()
    wide = narrow.float()
    got = fused.fused_sample(narrow, t, k, p, mp, seeds, steps, chunk=512)
    assert got.tolist() == fused.fused_sample(wide, t, k, p, mp, seeds, steps, chunk=512).tolist()
    assert got.tolist() == _reference(wide, t, k, p, mp, seeds, steps).tolist()
    st = SamplingTensors(t, k, p, seeds, steps, all_greedy=False, any_top_k_p=True, min_ps=mp)
    assert sample(narrow, st).tolist() == got.tolist()  # the torch path widens bf16 logits itself
