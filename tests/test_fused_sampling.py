"""The fused Triton sampler draws exactly what the torch sampler draws (Triton interpreter on the CPU):
temperature, top-k, top-p and min-p, ties included, and a row's token never depends on the other rows."""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="Triton is not installed (the GPU extra); the torch sampler is used")

import torch  # noqa: E402
from helpers import kernel_options  # noqa: E402

from minisgl.config import SamplerLaunch  # noqa: E402
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


# Small launch blocks for the shortcut tests: a 600-token row spans 3 chunks (the last one partial), 19 search
# blocks (the last one partial) and 12 stats blocks (the last two past the vocabulary: their max is -inf), so
# top-k up to 12 starts from the block-max bound, above that from -inf.
SMALL_LAUNCH = SamplerLaunch(chunk=256, stats_block=64, search_block=32, search_warps=4, draw_block=64, draw_warps=4)


def _edge_rows(vocab: int, gen: torch.Generator):
    """Rows aimed at the block skip and the top-k bound: survivors packed in one block, on block and chunk
    edges, ties at the threshold in blocks of their own, -inf logits, and different cuts side by side."""
    def low():  # far below every survivor, so the survivors' blocks are the only live ones
        return torch.randn(vocab, generator=gen) - 12

    rows = []  # (logits, temperature, top_k, top_p, min_p)
    packed = low()
    packed[96:104] = 5 + torch.randn(8, generator=gen) * 0.3  # one search block (32) holds every survivor
    rows += [(packed, 0.8, 5, 1.0, 0.0), (packed, 0.8, vocab, 0.5, 0.0), (packed, 1.0, 7, 0.7, 0.0)]
    edges = low()
    edges[[0, 31, 32, 63, 64, 255, 256, 511, 512, 599]] = torch.tensor(
        [3.0, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 4.25, 3.5, 4.75])
    rows += [(edges, 1.0, 4, 1.0, 0.0), (edges, 1.0, vocab, 0.9, 0.0), (edges, 0.6, 9, 0.8, 0.0)]
    tied = low()
    tied[300] = 9.0
    tied[[31, 440, 599]] = 7.0  # tied at the cut, each in its own block and chunk
    tied[500] = 6.0
    rows += [(tied, 1.0, 2, 1.0, 0.0), (tied, 1.0, vocab, 0.8, 0.0)]
    sparse = torch.full((vocab,), float("-inf"))
    sparse[[10, 300, 577]] = torch.tensor([3.0, 2.0, 2.0])
    rows += [(sparse, 1.0, 5, 1.0, 0.0), (sparse, 1.0, 1, 0.5, 0.0), (sparse, 0.0, 2, 1.0, 0.0)]
    flat = torch.full((vocab,), 1.5)  # every token tied
    rows += [(flat, 1.0, 3, 0.5, 0.0)]
    for t, k, p, mp in ((1.0, 12, 1.0, 0.0), (1.0, 13, 0.9, 0.0), (0.7, 50, 0.9, 0.0), (1.0, vocab, 1.0, 0.1),
                        (0.9, vocab, 1.0, 0.0), (1.2, 1, 1.0, 0.0), (1.0, 3, 0.95, 0.05)):
        rows.append((torch.randn(vocab, generator=gen) * 3, t, k, p, mp))
    logits = torch.stack([r[0] for r in rows])
    t, k, p, mp = (torch.tensor([r[i] for r in rows]) for i in range(1, 5))
    b = len(rows)
    seeds = torch.randint(0, 2**31, (b,), generator=gen)
    steps = torch.randint(0, 1000, (b,), generator=gen)
    return logits, t.float(), k.long(), p.float(), mp.float(), seeds, steps


def _threshold(lo: torch.Tensor) -> torch.Tensor:
    """The float a search key stands for (the kernels' _key_to_float)."""
    mag = lo.abs().to(torch.int32).view(torch.float32)
    return torch.where(lo < 0, -mag, mag)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_block_skip_and_top_k_bound_are_exact(kind):
    """Each shortcut on or off, the search ends on the same keys and weights bit for bit and draws the same
    tokens, which are the torch reference's; the kept sets are the reference's. A skipped block that held a
    token at or above a row's bracket (or a top-k start above the k-th largest logit) changes a threshold here:
    the survivors of these rows sit in one or a few blocks each."""
    fused = _interpreted()
    gen = torch.Generator().manual_seed(10)
    vocab = 600
    logits, t, k, p, mp, seeds, steps = _edge_rows(vocab, gen)
    if kind == "bf16":
        logits = logits.bfloat16().float()
    given = logits.bfloat16() if kind == "bf16" else logits  # the bf16 kind reads the LM head's dtype
    inv_t = 1.0 / t.clamp_min(1e-6)
    flags = fused.row_flags(t, k, p, mp, vocab)
    searched, tokens = {}, {}
    for skip, bound in ((False, False), (True, False), (False, True), (True, True)):
        with kernel_options(sampler_launch=SMALL_LAUNCH, sampler_skip_blocks=skip, sampler_top_k_bound=bound):
            searched[skip, bound] = fused.search_cuts(given, flags, inv_t, k, p, 256)
            if skip == bound:  # the draw reads only the threshold (compared below) and the skip switch
                tokens[skip] = fused.fused_sample(given, t, k, p, mp, seeds, steps)
    lo, row_max, zk, _ = searched[False, False]
    # zk is written by the first top-p pass; a row whose top-k already cut down to its max skips top-p
    top_p_ran = ((flags & fused.TOP_P) != 0) & (_threshold(lo) < row_max)
    for key, (lo_, row_max_, zk_, _) in searched.items():
        assert torch.equal(lo_, lo), key
        assert torch.equal(row_max_, row_max), key
        assert torch.equal(zk_[top_p_ran], zk[top_p_ran]), key
    assert torch.equal(tokens[True], tokens[False])
    assert tokens[True].tolist() == _reference(logits, t, k, p, mp, seeds, steps).tolist()

    # the thresholds are the reference's: the same kept set (finite logits; -inf ones are never drawn)
    from minisgl.engine.sampler import apply_top_k_top_p
    sampling = t > 0
    kept_ref = apply_top_k_top_p(logits, k, p, None, inv_t) > float("-inf")
    kept = logits >= _threshold(lo)[:, None]
    finite = logits > float("-inf")
    assert torch.equal((kept & finite)[sampling], (kept_ref & finite)[sampling])
    kth = logits.sort(dim=-1, descending=True).values.gather(1, (k.clamp(1, vocab) - 1)[:, None])[:, 0]
    top_k_only = sampling & (k < vocab) & (p == 1)
    assert torch.equal(_threshold(lo)[top_k_only], kth[top_k_only])  # the k-th largest logit
    # the rows do what they were built for: the packed row keeps 5 tokens of one block, the tied row all 3
    # sevens, the sparse row with k past its finite logits keeps everything
    assert kept[0].sum() == 5 and kept[0, 96:104].sum() == 5
    assert kept[6].nonzero().flatten().tolist() == [31, 300, 440, 599]
    assert torch.isinf(_threshold(lo)[8]) and kept[8].all()


def _settings_rows(gen: torch.Generator, vocab: int):
    """Rows for the row-settings kernel: greedy, tiny and large temperatures, every cut, and seeds past 32 bits
    and negative ones (the hash keeps only their low 32 bits, torch's int64 lanes and the kernel's uint32 alike)."""
    t = torch.tensor([0.0, 1e-9, 1e-6, 0.3, 0.7, 1.0, 1.7, 100.0, 0.0, 0.6, 2.5, 0.9])
    b = len(t)
    k = torch.tensor([vocab, 1, 5, vocab, 40, vocab, 2, vocab, 3, vocab, vocab, 7])
    p = torch.tensor([1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 0.3, 1.0, 0.2, 1.0, 0.95, 1.0])
    mp = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0])
    seeds = torch.cat([torch.tensor([0, -1, -(2**40) - 7, 2**33 + 5, 2**62, -(2**63)]),
                       torch.randint(0, 2**31, (b - 6,), generator=gen)])
    steps = torch.randint(0, 5000, (b,), generator=gen)
    return t, k, p, mp, seeds, steps


@pytest.mark.parametrize("cuts", [True, False])
def test_row_settings_kernel_computes_what_torch_computes(cuts):
    """The one-launch row settings (kernel option sampler_fused_ends) are torch's bit for bit: flags, 1 / T and
    the seed hash that every noise value starts from."""
    fused = _interpreted()
    vocab = 1000
    t, k, p, mp, seeds, steps = _settings_rows(torch.Generator().manual_seed(5), vocab)
    want = fused.row_settings(t, k, p, mp, seeds, steps, vocab, cuts, fused=False)
    got = fused.row_settings(t, k, p, mp, seeds, steps, vocab, cuts, fused=True)
    for name, w, g in zip(("flags", "inv_t", "hash"), want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert (got[0] != 0).sum() == (t > 0).sum() and got[2].unique().numel() == len(t)  # the rows differ


@pytest.mark.parametrize("cuts", [True, False])
def test_fused_ends_draw_the_same_tokens_and_write_the_table(cuts):
    """sampler_fused_ends on and off draw the same tokens, and with a token table both write each row's token
    at its cell (padded rows of a graph all write the same spare cell)."""
    fused = _interpreted()
    gen = torch.Generator().manual_seed(11)
    vocab = 1000
    t, k, p, mp, seeds, steps = _settings_rows(gen, vocab)
    if not cuts:  # a batch the host found without cuts
        k, p, mp = torch.full_like(k, vocab), torch.ones_like(p), torch.zeros_like(mp)
    logits = _logits(len(t), vocab, gen, "ties").bfloat16()
    dst = torch.randperm(100, generator=gen)[:len(t)]
    tokens, tables = {}, {}
    for on in (True, False):
        table = torch.full((100,), -1, dtype=torch.int64)
        with kernel_options(sampler_fused_ends=on):
            tokens[on] = fused.fused_sample(logits, t, k, p, mp, seeds, steps, cuts=cuts, chunk=256, table=table,
                                            dst=dst)
        tables[on] = table
    assert torch.equal(tokens[True], tokens[False])
    assert torch.equal(tables[True], tables[False]) and torch.equal(tables[True][dst], tokens[True])
    assert (tables[True] == -1).sum() == 100 - len(t)  # nothing else written
    assert tokens[True].tolist() == _reference(logits.float(), t, k, p, mp, seeds, steps).tolist()


@pytest.mark.parametrize("kind", ["plain", "ties", "bf16", "inf"])
def test_fused_greedy_is_torch_argmax(kind):
    """The greedy graph's argmax (the draw pass without noise, then the pick): torch's argmax, ties to the lowest
    index (a tie across chunks included), rows of -inf and a row whose maximum is in the last, partial chunk."""
    fused = _interpreted()
    gen = torch.Generator().manual_seed(4)
    vocab = 1100
    logits = _logits(6, vocab, gen, "ties" if kind == "inf" else kind)
    logits[1, [5, 700, 1099]] = 100.0  # tied maxima in three chunks
    logits[2, 1099] = 100.0  # the last token, in the partial chunk
    if kind == "inf":
        logits[3] = float("-inf")
        logits[4, :900] = float("-inf")
    given = logits.bfloat16() if kind == "bf16" else logits
    table = torch.zeros(20, dtype=torch.int64)
    dst = torch.tensor([0, 3, 7, 8, 12, 19])
    got = fused.fused_greedy(given, table, dst, chunk=256)
    assert torch.equal(got, given.argmax(-1)) and torch.equal(table[dst], got)
    assert got[1] == 5 and got[2] == 1099
    assert torch.equal(fused.fused_greedy(given, chunk=256), got)


def test_staged_graph_finish_fuses_the_sampler_ends():
    """The engine's decode graphs (engine/staged_graph.py) end in the fused sampler: the same tokens into the same
    table cells as notebook 06's `_finish`, for each captured sampler; with the option off, notebook 06's own."""
    from minisgl.engine.cuda_graph import CudaGraphRunner
    from minisgl.engine.staged_graph import StagedCudaGraphRunner

    _interpreted()
    gen = torch.Generator().manual_seed(21)
    vocab, bs = 700, 5
    t, k, p, mp, seeds, steps = (x[:bs] for x in _settings_rows(gen, vocab))
    logits = _logits(bs, vocab, gen, "bf16").bfloat16()

    def runner(cls):  # just what _finish reads: the token table, each row's cell, the sampler's settings
        r = object.__new__(cls)
        r.token_table = torch.full((40,), -1, dtype=torch.int64)
        r.token_dst = torch.tensor([4, 9, 11, 30, 39])
        r.sampling = SamplingTensors(t, k, p, seeds, steps, all_greedy=False, any_top_k_p=True, min_ps=mp)
        return r

    for sampler in ("greedy", "plain", "cuts"):
        notebook = runner(CudaGraphRunner)
        want = notebook._finish(logits, bs, sampler)
        for on in (True, False):
            staged = runner(StagedCudaGraphRunner)
            with kernel_options(triton_on_cpu=True, sampler_fused_ends=on):
                got = staged._finish(logits, bs, sampler)
            assert torch.equal(got, want), (sampler, on)
            assert torch.equal(staged.token_table, notebook.token_table), (sampler, on)


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_fused_narrow_searches_and_draws_the_same(kind):
    """sampler_fused_narrow: each pass's narrowing in the search's last program, not a launch of its own. The
    brackets, the row maxima and the top-k survivors' weights are the same to the bit, and so are the tokens."""
    fused = _interpreted()
    gen = torch.Generator().manual_seed(12)
    vocab = 600
    logits, t, k, p, mp, seeds, steps = _edge_rows(vocab, gen)
    given = logits.bfloat16() if kind == "bf16" else logits
    inv_t = 1.0 / t.clamp_min(1e-6)
    flags = fused.row_flags(t, k, p, mp, vocab)
    searched, tokens = {}, {}
    for on in (False, True):
        with kernel_options(sampler_launch=SMALL_LAUNCH, sampler_fused_narrow=on):
            searched[on] = fused.search_cuts(given, flags, inv_t, k, p, 256)
            tokens[on] = fused.fused_sample(given, t, k, p, mp, seeds, steps)
    (lo0, max0, zk0, _), (lo1, max1, zk1, _) = searched[False], searched[True]
    top_p_ran = ((flags & fused.TOP_P) != 0) & (_threshold(lo0) < max0)
    assert torch.equal(lo1, lo0) and torch.equal(max1, max0) and torch.equal(zk1[top_p_ran], zk0[top_p_ran])
    assert torch.equal(tokens[True], tokens[False])
    assert tokens[True].tolist() == _reference(logits if kind == "fp32" else logits.bfloat16().float(), t, k, p, mp,
                                               seeds, steps).tolist()
