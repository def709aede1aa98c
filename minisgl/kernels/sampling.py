"""Fused sampling on the GPU: temperature, top-k, top-p and min-p without a sort, in a fixed set of launches.

What is kept (the torch reference, `apply_top_k_top_p` in minisgl/engine/sampler.py, uses the same
definitions; x is a row's raw logits, s = x * (1 / T) its scaled logits, w = exp(s - max s)):

- top-k keeps every token with x >= the k-th largest x (tokens tied with it all stay);
- top-p (after top-k) keeps every token with x >= c, for the largest c whose kept weight
  sum(w over x >= c) reaches top_p times the weight of the top-k survivors;
- min-p keeps tokens with s - max s >= log(min_p), i.e. probability >= min_p * the largest probability.

Then the token is argmax(s + Gumbel noise) over the kept set (the counter-based noise of minisgl/kernels/hashing.py).
Every cut is a threshold on x, so the kept set is found without sorting: a 16-ary search over the 32-bit
order-preserving key of x. Each pass reads the row once and measures, for 16 candidate thresholds at once,
the count (top-k) or the weight (top-p) of the tokens at or above each; a tiny kernel keeps the bracket
between the last candidate that qualifies and the first that does not. 8 passes pin any 32-bit key; when a
row's logits are bf16 values widened to fp32 (the LM head's output), the low 16 key bits are zero and
4 passes do. Later passes of a finished row, and every pass of a row without that cut, exit at once.

Two exact shortcuts (kernel options; the tokens are bit for bit those of the option off):
- `sampler_skip_blocks`: every candidate of a pass is >= the bracket's lo, so a block of logits with no token at or
  above lo adds nothing (count 0, weight +0.0) to any candidate. The stats pass keeps each block's max, and
  a search pass neither reads nor measures (compare/accumulate tile, exp) a block whose max is below lo.
  The draw skips a block whose max is cut (its tokens' noisy values would all be -inf). After the first
  passes a row's bracket sits near its threshold: with top-k 50, about 50 of 151,936 tokens survive, so the
  later top-k passes, every top-p pass after top-k and the draw touch only the few blocks holding them.
  Skipping leaves each accumulator lane's fp32 sums, and their order, unchanged.
- `sampler_top_k_bound`: the k-th largest of the block maxima is the value of a
  token with at least k tokens at or above it, so top-k's search starts its bracket there instead of at -inf
  (rows with k above the number of blocks start at -inf). The search ends on the largest key that qualifies
  whatever valid bracket it starts from, so the threshold is the same; the bracket is just narrower, and the
  blocks below it are skipped from the first pass.

Rows are split into fixed chunks (programs) for every pass, and partial results are reduced in a fixed
order: a row's token is a function of that row alone, never of the batch size. The kernels that do
floating-point arithmetic are compiled without fused multiply-add (`enable_fp_fusion=False`): x * (1/T) + g
rounds as in torch, and the same way in the one-pass (no cuts) and the full variant of the draw kernel. No host sync, no
data-dependent launch: the whole sampler can be captured in a CUDA graph.

The ends (kernel option `sampler_fused_ends`): each row's settings (flags, 1 / T, seed hash) come from one launch
and the chunks' best are reduced by one more (`_pick_kernel`, which can also write the token into the token table),
where torch needed about thirty small launches; `fused_greedy` is the draw pass without noise and that pick.

Every kernel takes `USE_PDL` (programmatic dependent launch, kernels/pdl.py): launched with it, a kernel may start
while its predecessor still runs, so its first statement, before any global load or store, is the wait.
"""

from __future__ import annotations

import torch

from minisgl.kernels.hashing import row_hash
from minisgl.kernels.options import current_options
from minisgl.kernels.pdl import pdl_enter, pdl_launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the torch path in sampler.py is used instead
    triton = None

NUM_CANDIDATES = 16  # thresholds measured per pass
NUM_PASSES = 8  # 16 ** 8 = 2 ** 32: enough for any fp32 key
ROW_BLOCK = 256  # rows per program of the row-settings kernel
KEY_NEG_INF = -0x7F800000  # the key of -inf (keys: +-(the bits of |x|), so -0.0 and 0.0 share key 0)
# flag bits per row
SAMPLES, TOP_K, TOP_P, MIN_P = 1, 2, 4, 8

if triton is not None:
    _SAMPLES, _TOP_K, _TOP_P, _MIN_P = (tl.constexpr(SAMPLES), tl.constexpr(TOP_K), tl.constexpr(TOP_P),
                                        tl.constexpr(MIN_P))
    _KEY_NEG_INF = tl.constexpr(KEY_NEG_INF)

    @triton.jit
    def _mix32(x):
        # hashing.mix32 in native uint32 lanes: a uint32 multiply wraps modulo 2**32, which is exactly the
        # torch version's masked int64 product, and shifts of unsigned values are logical. (int64 lanes, as
        # torch uses, made this the costliest part of the draw: 64-bit multiplies are emulated on the GPU.)
        m1 = tl.full([], 0x7FEB352D, tl.uint32)
        m2 = tl.full([], 0x846CA68B, tl.uint32)
        x = (x ^ (x >> 16)) * m1
        x = (x ^ (x >> 15)) * m2
        return x ^ (x >> 16)

    @triton.jit
    def _key_to_float(key):
        """int64 key -> the fp32 value it stands for (sign and magnitude bits)."""
        mag = tl.abs(key).to(tl.int32).to(tl.float32, bitcast=True)
        return tl.where(key < 0, -mag, mag)

    @triton.jit
    def _float_to_key(x):
        bits = x.to(tl.int32, bitcast=True)
        mag = (bits & 0x7FFFFFFF).to(tl.int64)
        return tl.where(bits < 0, -mag, mag)

    @triton.jit
    def _candidates(lo, hi, unit, NC: tl.constexpr):
        """NC keys from lo (included) up to hi (excluded), evenly spaced in multiples of unit."""
        j = tl.arange(0, NC).to(tl.int64)
        return lo + unit * (((hi - lo) // unit) * j // NC)

    @triton.jit
    def _bracket(flags_ptr, lo_ptr, hi_ptr, unit_ptr, row, num_rows, PHASE: tl.constexpr):
        """A row's bracket [lo, hi) in this phase (0: top-k, 1: top-p), its search unit, and whether the row
        still searches: it has this cut and the bracket is wider than one unit."""
        lo = tl.load(lo_ptr + row)
        hi = tl.load(hi_ptr + PHASE * num_rows + row)
        unit = tl.load(unit_ptr + row)
        wanted = (tl.load(flags_ptr + row) & (_TOP_K << PHASE)) != 0
        return lo, hi, unit, wanted & (hi - lo > unit)

    @triton.jit
    def _stats_kernel(logits_ptr, stride, vocab, flags_ptr, pmax_ptr, plow_ptr, num_chunks,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        # grid (rows, chunks): each block's max logit, and whether any logit of the chunk has low 16 key bits set
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if tl.load(flags_ptr + row) > _SAMPLES:  # a row with a cut
            blocks_per_chunk: tl.constexpr = CHUNK // BLOCK
            low = tl.zeros([BLOCK], tl.int32)
            for off in range(0, CHUNK, BLOCK):
                idx = chunk * CHUNK + off + tl.arange(0, BLOCK)
                x = tl.load(logits_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
                block = chunk * blocks_per_chunk + off // BLOCK
                tl.store(pmax_ptr + row * num_chunks * blocks_per_chunk + block, tl.max(x, axis=0))
                low = tl.maximum(low, x.to(tl.int32, bitcast=True) & 0xFFFF)
            tl.store(plow_ptr + row * num_chunks + chunk, tl.max(low, axis=0))

    @triton.jit
    def _init_kernel(flags_ptr, top_k_ptr, pmax_ptr, plow_ptr, max_ptr, unit_ptr, lo_ptr, hi_ptr, num_rows,
                     num_chunks, num_blocks, NC_PAD: tl.constexpr, NB_PAD: tl.constexpr,
                     TOP_K_BOUND: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        # grid (rows,): the row max; the search unit (2**16 when every logit is a widened bf16); the brackets
        row = tl.program_id(0)
        lo = tl.full([], _KEY_NEG_INF, tl.int64)  # -inf: every token qualifies
        tl.store(lo_ptr + row, lo)
        tl.store(hi_ptr + row, lo)
        tl.store(hi_ptr + num_rows + row, lo)
        flags = tl.load(flags_ptr + row)
        if flags > _SAMPLES:
            c = tl.arange(0, NC_PAD)
            b = tl.arange(0, NB_PAD)
            in_row = b < num_blocks
            bmax = tl.load(pmax_ptr + row * num_blocks + b, mask=in_row, other=float("-inf"))
            m = tl.max(bmax, axis=0)
            low = tl.max(tl.load(plow_ptr + row * num_chunks + c, mask=c < num_chunks, other=0), axis=0)
            unit = tl.where(low == 0, 65536, 1).to(tl.int64)
            top = _float_to_key(m) + unit  # just above the max: no token qualifies
            tl.store(max_ptr + row, m)
            tl.store(unit_ptr + row, unit)
            tl.store(hi_ptr + row, top)  # top-k bracket
            tl.store(hi_ptr + num_rows + row, top)  # top-p bracket (its lo is where top-k ends)
            if TOP_K_BOUND:
                if (flags & _TOP_K) != 0:
                    # the largest block max with at least k block maxima at or above it: k distinct tokens are
                    # >= it, so it qualifies for top-k (a valid lo). A block max is a logit: a multiple of unit.
                    k = tl.load(top_k_ptr + row)
                    bound = tl.full([], float("-inf"), tl.float32)
                    for i0 in range(0, NB_PAD, 16):
                        i = i0 + tl.arange(0, 16)
                        v = tl.load(pmax_ptr + row * num_blocks + i, mask=i < num_blocks, other=float("-inf"))
                        ge = (bmax[None, :] >= v[:, None]) & in_row[None, :] & (i < num_blocks)[:, None]
                        count = tl.sum(ge.to(tl.int32), axis=1)
                        bound = tl.maximum(bound, tl.max(tl.where(count >= k, v, float("-inf")), axis=0))
                    tl.store(lo_ptr + row, _float_to_key(bound))

    @triton.jit
    def _measure(acc, logits_ptr, row_start, start, vocab, cand, inv_t, s_max, PHASE: tl.constexpr,
                 SPAN: tl.constexpr, BLOCK: tl.constexpr):
        """Add the count (top-k) or weight (top-p) at or above each candidate of the tokens [start, start + SPAN)
        to the [BLOCK, NC] accumulator lanes."""
        for off in range(0, SPAN, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < vocab
            x = tl.load(logits_ptr + row_start + idx, mask=mask, other=float("-inf")).to(tl.float32)
            above = (x[:, None] >= cand[None, :]) & mask[:, None]
            if PHASE == 0:
                acc += above.to(tl.float32)  # counts: exact in fp32 up to 2**24 per lane
            else:
                w = tl.exp(x * inv_t - s_max)
                acc += tl.where(above, w[:, None], 0.0)
        return acc

    @triton.jit
    def _search_kernel(logits_ptr, stride, vocab, flags_ptr, lo_ptr, hi_ptr, unit_ptr, max_ptr, inv_t_ptr,
                       pmax_ptr, part_ptr, num_rows, num_chunks, zk_ptr, top_k_ptr, top_p_ptr, ticket_ptr,
                       PHASE: tl.constexpr, NC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                       STATS_BLOCK: tl.constexpr, SKIP: tl.constexpr, NARROW: tl.constexpr, FIRST: tl.constexpr,
                       NC_PAD: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        # grid (rows, chunks): count (top-k) or weight (top-p) of the chunk's tokens at or above each candidate
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        lo, hi, unit, searching = _bracket(flags_ptr, lo_ptr, hi_ptr, unit_ptr, row, num_rows, PHASE)
        if searching:
            cand = _key_to_float(_candidates(lo, hi, unit, NC))
            lo_f = _key_to_float(lo)  # candidate 0, the smallest
            inv_t = tl.load(inv_t_ptr + row)
            s_max = tl.load(max_ptr + row) * inv_t
            acc = tl.zeros([BLOCK, NC], tl.float32)
            row_start = row * stride
            blocks_per_row = num_chunks * (CHUNK // STATS_BLOCK)
            for sb in range(0, CHUNK, STATS_BLOCK):  # one stats block at a time
                start = chunk * CHUNK + sb
                if SKIP:
                    # the stats pass's block max: below lo, no token counts for any candidate (the tile would
                    # add exact zeros to every lane), so the block is neither read nor measured. A NaN max
                    # compares false both ways: the block is measured.
                    bm = tl.load(pmax_ptr + row * blocks_per_row + start // STATS_BLOCK)
                    if (bm >= lo_f) | (bm != bm):
                        acc = _measure(acc, logits_ptr, row_start, start, vocab, cand, inv_t, s_max, PHASE,
                                       STATS_BLOCK, BLOCK)
                else:
                    acc = _measure(acc, logits_ptr, row_start, start, vocab, cand, inv_t, s_max, PHASE,
                                   STATS_BLOCK, BLOCK)
            out = part_ptr + (row * num_chunks + chunk) * NC + tl.arange(0, NC)
            tl.store(out, tl.sum(acc, axis=0))
            if NARROW:  # kernel option sampler_fused_narrow: the row's last program to finish narrows
                # Every program of a searching row draws a ticket after its partials; the one drawing
                # num_chunks - 1 draws it after all the others, and narrows. The order as in the decode kernel's
                # fused merge (kernels/attention.py): a CTA barrier so every thread's stores precede thread 0's
                # release, the acquire, a barrier again before every thread's loads. The ticket is put back to 0
                # for the next pass (stream-ordered after this launch; a PDL successor waits before touching it).
                tl.debug_barrier()
                ticket = tl.atomic_add(ticket_ptr + row, 1, sem="acq_rel", scope="gpu")
                if ticket == num_chunks - 1:
                    tl.debug_barrier()
                    tl.store(ticket_ptr + row, 0)
                    _narrow_row(row, flags_ptr, lo_ptr, hi_ptr, unit_ptr, zk_ptr, top_k_ptr, top_p_ptr, part_ptr,
                                num_rows, num_chunks, PHASE, FIRST, NC, NC_PAD)

    @triton.jit
    def _narrow_row(row, flags_ptr, lo_ptr, hi_ptr, unit_ptr, zk_ptr, top_k_ptr, top_p_ptr, part_ptr, num_rows,
                    num_chunks, PHASE: tl.constexpr, FIRST: tl.constexpr, NC: tl.constexpr, NC_PAD: tl.constexpr):
        """Sum a row's chunk partials and keep the bracket [last qualifying, first failing candidate). The chunks
        are added one after another in chunk order (elementwise adds, no cross-lane reduction), so the totals are
        the same to the bit in whichever kernel this runs (its own launch, or the search's last program)."""
        lo, hi, unit, searching = _bracket(flags_ptr, lo_ptr, hi_ptr, unit_ptr, row, num_rows, PHASE)
        if searching:
            j = tl.arange(0, NC)
            total = tl.zeros([NC], tl.float32)  # non-increasing along the candidates
            for c in tl.static_range(NC_PAD):
                total += tl.load(part_ptr + (row * num_chunks + c) * NC + j, mask=(j < NC) & (c < num_chunks),
                                 other=0.0)
            if PHASE == 0:
                ok = total >= tl.load(top_k_ptr + row).to(tl.float32)
            else:
                if FIRST:  # candidate 0 is where top-k ended: its weight is the top-k survivors' weight
                    zk = tl.sum(tl.where(j == 0, total, 0.0), axis=0)
                    tl.store(zk_ptr + row, zk)
                else:
                    zk = tl.load(zk_ptr + row)
                ok = total >= tl.load(top_p_ptr + row) * zk
            ok = ok | (j == 0)  # lo qualifies by construction
            keys = _candidates(lo, hi, unit, NC)
            tl.store(lo_ptr + row, tl.max(tl.where(ok, keys, lo), axis=0))
            tl.store(hi_ptr + PHASE * num_rows + row, tl.min(tl.where(ok, hi, keys), axis=0))

    @triton.jit
    def _narrow_kernel(flags_ptr, lo_ptr, hi_ptr, unit_ptr, zk_ptr, top_k_ptr, top_p_ptr, part_ptr, num_rows,
                       num_chunks, PHASE: tl.constexpr, FIRST: tl.constexpr, NC: tl.constexpr,
                       NC_PAD: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        # grid (rows,): one row's narrowing after a search pass
        _narrow_row(tl.program_id(0), flags_ptr, lo_ptr, hi_ptr, unit_ptr, zk_ptr, top_k_ptr, top_p_ptr, part_ptr,
                    num_rows, num_chunks, PHASE, FIRST, NC, NC_PAD)

    @triton.jit
    def _draw_span(best_val, best_idx, logits_ptr, row_start, start, vocab, inv_t, greedy, h, threshold, s_max,
                   min_p_floor, CUTS: tl.constexpr, SPAN: tl.constexpr, BLOCK: tl.constexpr, NOISE: tl.constexpr):
        """Fold the tokens [start, start + SPAN) into each lane's best (value, index): the raw logit for greedy
        rows, else s + Gumbel noise over the kept tokens (no noise at all without NOISE: a greedy batch)."""
        for off in range(0, SPAN, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            mask = idx < vocab
            x = tl.load(logits_ptr + row_start + idx, mask=mask, other=float("-inf")).to(tl.float32)
            s = x * inv_t
            if NOISE:
                bits = _mix32(h ^ (idx.to(tl.uint32) * tl.full([], 0x85EBCA77, tl.uint32)))
                u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                g = -tl.log(-tl.log(u))
                val = tl.where(greedy, x, s + g)
            else:
                val = x
            keep = mask
            if CUTS:
                keep = keep & (x >= threshold) & (s - s_max >= min_p_floor)
            val = tl.where(keep, val, float("-inf"))
            better = val > best_val
            best_val = tl.where(better, val, best_val)
            best_idx = tl.where(better, idx, best_idx)
        return best_val, best_idx

    @triton.jit
    def _draw_kernel(logits_ptr, stride, vocab, flags_ptr, lo_ptr, max_ptr, inv_t_ptr, log_min_p_ptr,
                     row_hash_ptr, pmax_ptr, partial_val_ptr, partial_idx_ptr, num_chunks, CUTS: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr, STATS_BLOCK: tl.constexpr, SKIP: tl.constexpr,
                     NOISE: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        # grid (rows, chunks): the chunk's best (value, index); greedy rows (T == 0) take the raw argmax
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        if NOISE:
            flags = tl.load(flags_ptr + row)
            inv_t = tl.load(inv_t_ptr + row)
            h = tl.load(row_hash_ptr + row).to(tl.uint32)  # stored as int64, < 2**32
        else:  # a greedy batch: no row settings to read (flags, inv_t and hashes are not passed)
            flags = tl.full([], 0, tl.int32)
            inv_t = tl.full([], 1.0, tl.float32)
            h = tl.full([], 0, tl.uint32)
        greedy = (flags & _SAMPLES) == 0
        threshold = tl.full([], float("-inf"), tl.float32)  # rows keep everything unless CUTS says otherwise
        s_max = tl.full([], 0.0, tl.float32)
        min_p_floor = tl.full([], float("-inf"), tl.float32)
        if CUTS:
            threshold = _key_to_float(tl.load(lo_ptr + row))
            # rows without min-p (greedy ones included: their max is not computed) keep everything
            min_p_floor = tl.where((flags & _MIN_P) != 0, tl.load(log_min_p_ptr + row), float("-inf"))
            s_max = tl.load(max_ptr + row) * inv_t
        best_val = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.zeros([BLOCK], tl.int32)
        row_start = row * stride
        blocks_per_row = num_chunks * (CHUNK // STATS_BLOCK)
        for sb in range(0, CHUNK, STATS_BLOCK):
            start = chunk * CHUNK + sb
            if CUTS and SKIP:
                # a block whose max is cut (below the threshold, or under the min-p floor: s - s_max only grows
                # with x) has every token cut: all its values would be -inf and beat no lane's best. Only rows
                # with a cut have block maxima; the others (threshold -inf) read +inf here and draw every block.
                bm = tl.load(pmax_ptr + row * blocks_per_row + start // STATS_BLOCK, mask=flags > _SAMPLES,
                             other=float("inf"))
                if (bm >= threshold) & (bm * inv_t - s_max >= min_p_floor) | (bm != bm):
                    best_val, best_idx = _draw_span(best_val, best_idx, logits_ptr, row_start, start, vocab, inv_t,
                                                    greedy, h, threshold, s_max, min_p_floor, CUTS, STATS_BLOCK,
                                                    BLOCK, NOISE)
            else:
                best_val, best_idx = _draw_span(best_val, best_idx, logits_ptr, row_start, start, vocab, inv_t,
                                                greedy, h, threshold, s_max, min_p_floor, CUTS, STATS_BLOCK, BLOCK,
                                                NOISE)
        m = tl.max(best_val, axis=0)
        # lowest index among the maxima, as torch.argmax does
        i = tl.min(tl.where(best_val == m, best_idx, 2147483647), axis=0)
        tl.store(partial_val_ptr + row * num_chunks + chunk, m)
        tl.store(partial_idx_ptr + row * num_chunks + chunk, i)

    @triton.jit
    def _row_settings_kernel(temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, flags_ptr, inv_t_ptr,
                             hash_ptr, num_rows, vocab, CUTS: tl.constexpr, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr):
        """Each row's flags (`row_flags`, or T > 0 without CUTS), 1 / max(T, 1e-6) and `row_hash(seed, step)`, as
        the torch expressions in `fused_sample` compute them, in one launch instead of about thirty."""
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = rows < num_rows
        t = tl.load(temp_ptr + rows, mask=mask, other=0.0)
        # IEEE division, as torch's `1.0 / x` (Triton's `/` on fp32 may round differently)
        tl.store(inv_t_ptr + rows, tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.maximum(t, 1e-6)),
                 mask=mask)
        samples = (t > 0).to(tl.int32)
        if CUTS:
            k = tl.load(top_k_ptr + rows, mask=mask, other=0)
            p = tl.load(top_p_ptr + rows, mask=mask, other=1.0)
            mp = tl.load(min_p_ptr + rows, mask=mask, other=0.0)
            cuts = (_TOP_K * (k < vocab).to(tl.int32) + _TOP_P * (p < 1).to(tl.int32)
                    + _MIN_P * (mp > 0).to(tl.int32))
            tl.store(flags_ptr + rows, samples * (_SAMPLES + cuts), mask=mask)
        else:
            tl.store(flags_ptr + rows, samples, mask=mask)
        # hashing.row_hash in uint32 lanes: its int64 sums and products are masked to 32 bits before each use, so
        # only their low 32 bits matter, and those are what uint32 arithmetic keeps
        seed = tl.load(seed_ptr + rows, mask=mask, other=0).to(tl.int64)
        step = tl.load(step_ptr + rows, mask=mask, other=0).to(tl.int64)
        x = ((seed * 0x9E3779B1 + step) & 0xFFFFFFFF).to(tl.uint32)
        h = _mix32(_mix32(x) + tl.full([], 0x632BE5AB, tl.uint32))
        tl.store(hash_ptr + rows, h.to(tl.int64), mask=mask)

    @triton.jit
    def _pick_kernel(partial_val_ptr, partial_idx_ptr, num_chunks, out_ptr, table_ptr, dst_ptr,
                     NC_PAD: tl.constexpr, TABLE: tl.constexpr, USE_PDL: tl.constexpr):
        """grid (rows,): a row's token from its chunks' best (value, index), as `vals.argmax` then `idxs.gather`
        would (the first chunk among the maxima holds the lowest index); with TABLE also written to the token
        table at the row's destination, as notebook 06's `_finish` does."""
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        row = tl.program_id(0)
        offs = tl.arange(0, NC_PAD)
        live = offs < num_chunks
        vals = tl.load(partial_val_ptr + row * num_chunks + offs, mask=live, other=float("-inf"))
        idxs = tl.load(partial_idx_ptr + row * num_chunks + offs, mask=live, other=2147483647)
        best = tl.max(vals, axis=0)
        token = tl.min(tl.where(live & (vals == best), idxs, 2147483647), axis=0).to(tl.int64)
        tl.store(out_ptr + row, token)
        if TABLE:
            dst = tl.load(dst_ptr + row)
            tl.store(table_ptr + dst, token.to(table_ptr.dtype.element_ty))


if triton is not None:
    # The logits processing of engine/logits_processing.py (penalties, a grammar's token mask), in place on the
    # rows that ask for it: grid (rows, vocabulary blocks), one read and one write of each such row. Rows that do
    # not ask are not in the grid, so a step pays for the requests that use them only.

    @triton.jit
    def _penalty_kernel(logits_ptr, stride, vocab, rows_ptr, slots_ptr, counts_ptr, counts_stride, freq_ptr,
                        pres_ptr, rep_ptr, COUNT_MASK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        i = tl.program_id(0)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < vocab
        row = tl.load(rows_ptr + i)
        slot = tl.load(slots_ptr + i)
        f = tl.load(freq_ptr + i)
        p = tl.load(pres_ptr + i)
        r = tl.load(rep_ptr + i)
        c = tl.load(counts_ptr + slot * counts_stride + idx, mask=mask, other=0)
        ptr = logits_ptr + row * stride + idx
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        n = (c & COUNT_MASK).to(tl.float32)
        x = tl.where(c != 0, tl.where(x < 0, x * r, x / r), x)  # the same operations, in the same order, as torch
        x = x - n * f
        x = x - (n > 0).to(tl.float32) * p
        tl.store(ptr, x.to(logits_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bitmask_kernel(logits_ptr, stride, vocab, rows_ptr, mask_ptr, mask_stride, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr):
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        i = tl.program_id(0)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = idx < vocab
        row = tl.load(rows_ptr + i)
        words = tl.load(mask_ptr + i * mask_stride + idx // 32, mask=inside, other=0)
        allowed = ((words >> (idx % 32)) & 1) != 0
        tl.store(logits_ptr + row * stride + idx, float("-inf"), mask=inside & ~allowed)


if triton is not None:
    # Logprobs (issue 26) of the rows that ask, in one read of each such row: the log-sum-exp and the top-N of the
    # processed logits (before temperature), split into vocabulary chunks and merged in a fixed order. The torch
    # reference is engine/logits_processing.token_logprobs (a float copy, logsumexp and topk: three more passes
    # over every row, which cost W1 with top-5 logprobs 21% of its throughput on the H200, run16).

    @triton.jit(do_not_specialize=["num_chunks"])
    def _logprob_chunk_kernel(logits_ptr, stride, vocab, rows_ptr, part_max_ptr, part_sum_ptr, part_val_ptr,
                              part_idx_ptr, num_chunks, CHUNK: tl.constexpr, TOP: tl.constexpr,
                              USE_PDL: tl.constexpr):
        """grid (rows, chunks): a chunk's max, sum of exp(x - max) and its TOP largest (value, index)."""
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        i = tl.program_id(0)
        c = tl.program_id(1)
        row = tl.load(rows_ptr + i).to(tl.int64)
        idx = c * CHUNK + tl.arange(0, CHUNK)
        inside = idx < vocab
        x = tl.load(logits_ptr + row * stride + idx, mask=inside, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a chunk masked out entirely sums to 0, not NaN
        out = i * num_chunks + c
        tl.store(part_max_ptr + out, m)
        tl.store(part_sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
        alive = inside
        for j in tl.static_range(TOP):  # the largest left, ties to the lowest index (as the merge below)
            v = tl.max(tl.where(alive, x, float("-inf")), axis=0)
            k = tl.min(tl.where(alive & (x == v), idx, 2147483647), axis=0)
            tl.store(part_val_ptr + out * TOP + j, v)
            tl.store(part_idx_ptr + out * TOP + j, k)
            alive = alive & (idx != k)

    @triton.jit(do_not_specialize=["num_chunks", "top_n", "out_stride"])
    def _logprob_merge_kernel(logits_ptr, stride, rows_ptr, tokens_ptr, part_max_ptr, part_sum_ptr, part_val_ptr,
                              part_idx_ptr, out_ptr, out_stride, num_chunks, top_n, CHUNKS: tl.constexpr,
                              TOP: tl.constexpr, USE_PDL: tl.constexpr):
        """grid (rows,): the row's log-sum-exp from its chunks, then [logprob of its token, top_n logprobs, top_n
        token ids (int32 bits)] into its row of `out`."""
        if USE_PDL:  # before any global access (kernels/pdl.py)
            pdl_enter()
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i).to(tl.int64)
        c = tl.arange(0, CHUNKS)
        pm = tl.load(part_max_ptr + i * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
        ps = tl.load(part_sum_ptr + i * num_chunks + c, mask=c < num_chunks, other=0.0)
        big = tl.max(pm, axis=0)
        lse = big + tl.log(tl.sum(ps * tl.exp(pm - big), axis=0))
        token = tl.load(tokens_ptr + row)
        base = out_ptr + i * out_stride
        tl.store(base, tl.load(logits_ptr + row * stride + token).to(tl.float32) - lse)
        q = tl.arange(0, CHUNKS * TOP)
        ok = q < num_chunks * TOP
        v = tl.load(part_val_ptr + i * num_chunks * TOP + q, mask=ok, other=float("-inf"))
        ids = tl.load(part_idx_ptr + i * num_chunks * TOP + q, mask=ok, other=2147483647)
        alive = ok
        for j in tl.static_range(TOP):
            best = tl.max(tl.where(alive, v, float("-inf")), axis=0)
            k = tl.min(tl.where(alive & (v == best), ids, 2147483647), axis=0)
            if j < top_n:
                tl.store(base + 1 + j, best - lse)
                tl.store(base + 1 + top_n + j, k.to(tl.float32, bitcast=True))
            alive = alive & (ids != k)


PROCESS_BLOCK = 2048  # vocabulary entries per program of the processing kernels


def apply_penalties_(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor, repetition: torch.Tensor,
                     count_mask: int) -> None:
    """engine/logits_processing.apply_penalties in one launch, reading the count table's rows `slots` in place."""
    vocab = logits.shape[1]
    kw = pdl_launch(logits)
    _penalty_kernel[(rows.numel(), triton.cdiv(vocab, PROCESS_BLOCK))](
        logits, logits.stride(0), vocab, rows, slots, counts, counts.stride(0), frequency, presence, repetition,
        COUNT_MASK=count_mask, BLOCK=PROCESS_BLOCK, USE_PDL=bool(kw), enable_fp_fusion=False, **kw)


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """engine/logits_processing.apply_token_bitmask in one launch."""
    vocab = logits.shape[1]
    kw = pdl_launch(logits)
    _bitmask_kernel[(rows.numel(), triton.cdiv(vocab, PROCESS_BLOCK))](
        logits, logits.stride(0), vocab, rows, bitmask, bitmask.stride(0), BLOCK=PROCESS_BLOCK, USE_PDL=bool(kw),
        **kw)


LOGPROB_CHUNK = 2048  # vocabulary entries per program of the logprob chunk kernel
LOGPROB_TOPS = (8, 32)  # the top-N kept per chunk: 8 for top_n <= 8 (OpenAI's usual 0-5), 32 up to the limit 20


def token_logprobs_packed(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, top_n: int) -> torch.Tensor:
    """engine/logits_processing.token_logprobs of `logits[rows]` and `tokens[rows]` in two launches, packed as
    `[L, 1 + 2 * top_n]` float32: each row's token logprob, its top_n logprobs, then the top_n token ids as int32
    bits (`packed[:, 1 + top_n:].view(torch.int32)`): one copy to the host. Ties: the lowest token id first."""
    num, vocab = rows.numel(), logits.shape[1]
    top = next(t for t in LOGPROB_TOPS if top_n <= t)
    chunks = triton.cdiv(vocab, LOGPROB_CHUNK)
    f32 = dict(dtype=torch.float32, device=logits.device)
    part_max, part_sum = torch.empty(num, chunks, **f32), torch.empty(num, chunks, **f32)
    part_val = torch.empty(num, chunks, top, **f32)
    part_idx = torch.empty(num, chunks, top, dtype=torch.int32, device=logits.device)
    out = torch.empty(num, 1 + 2 * top_n, **f32)
    kw = pdl_launch(logits)
    _logprob_chunk_kernel[(num, chunks)](logits, logits.stride(0), vocab, rows, part_max, part_sum, part_val,
                                         part_idx, chunks, CHUNK=LOGPROB_CHUNK, TOP=top, USE_PDL=bool(kw), **kw)
    _logprob_merge_kernel[(num,)](logits, logits.stride(0), rows, tokens, part_max, part_sum, part_val, part_idx,
                                  out, out.stride(0), chunks, top_n, CHUNKS=triton.next_power_of_2(chunks), TOP=top,
                                  USE_PDL=bool(kw), **kw)
    return out


def row_flags(temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
              vocab: int) -> torch.Tensor:
    """int32 [B]: which steps each row needs (no bit for a greedy row: it takes the argmax)."""
    cuts = TOP_K * (top_ks < vocab).int() + TOP_P * (top_ps < 1).int() + MIN_P * (min_ps > 0).int()
    return (temperatures > 0).int() * (SAMPLES + cuts)


def _launch_blocks(chunk: int) -> tuple[int, int, int]:
    """The stats, search and draw block sizes for a chunk (launch shapes: the kernel option `sampler_launch`).
    The stats block divides the chunk and the other two divide the stats block: the search and the draw walk a
    chunk one stats block at a time (its max says whether the block can be skipped), and a block never straddles
    two."""
    cfg = current_options().sampler_launch
    stats, search, draw = (min(size, chunk) for size in (cfg.stats_block, cfg.search_block, cfg.draw_block))
    assert chunk % stats == 0 and stats % search == 0 and stats % draw == 0, (chunk, stats, search, draw)
    return stats, search, draw


def search_cuts(logits: torch.Tensor, flags: torch.Tensor, inv_t: torch.Tensor, top_ks: torch.Tensor,
                top_ps: torch.Tensor, chunk: int, phases: tuple[int, ...] = (0, 1),
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The search alone: (lo, row_max, zk, block_max) per row. lo is the int64 key of the row's cut threshold
    (top-k's, then top-p's over it; -inf's key for a row without a cut), zk the weight of the top-k survivors
    (rows with top-p), block_max the max of each stats block (rows with a cut). `phases=(0,)` stops after
    top-k. fused_sample uses it; tests compare its results switch by switch."""
    b, vocab = logits.shape
    dev = logits.device
    opts = current_options()
    stats_block, search_block, _ = _launch_blocks(chunk)
    num_chunks = triton.cdiv(vocab, chunk)
    num_blocks = num_chunks * (chunk // stats_block)
    passes = NUM_PASSES // 2 if logits.dtype == torch.bfloat16 else NUM_PASSES
    nc_pad = triton.next_power_of_2(num_chunks)
    lo = torch.empty(b, dtype=torch.int64, device=dev)
    row_max = torch.zeros(b, dtype=torch.float32, device=dev)
    hi = torch.empty(2, b, dtype=torch.int64, device=dev)
    unit = torch.empty(b, dtype=torch.int64, device=dev)
    zk = torch.empty(b, dtype=torch.float32, device=dev)
    pmax = torch.empty(b, num_blocks, dtype=torch.float32, device=dev)
    plow = torch.empty(b, num_chunks, dtype=torch.int32, device=dev)
    part = torch.empty(b, num_chunks, NUM_CANDIDATES, dtype=torch.float32, device=dev)
    kw = pdl_launch(logits)
    pdl = bool(kw)
    _stats_kernel[(b, num_chunks)](logits, logits.stride(0), vocab, flags, pmax, plow, num_chunks,
                                   CHUNK=chunk, BLOCK=stats_block, USE_PDL=pdl, **kw)
    _init_kernel[(b,)](flags, top_ks, pmax, plow, row_max, unit, lo, hi, b, num_chunks, num_blocks, NC_PAD=nc_pad,
                       NB_PAD=max(16, triton.next_power_of_2(num_blocks)), TOP_K_BOUND=opts.sampler_top_k_bound,
                       USE_PDL=pdl, **kw)
    top_ps = top_ps.float()
    narrow = opts.sampler_fused_narrow
    # the fused narrowing's tickets, one per row, zero between passes (each pass's last program puts its back);
    # without it nothing reads them, and `flags` (int32 too) stands in rather than a zeroing launch
    tickets = torch.zeros(b, dtype=torch.int32, device=dev) if narrow else flags
    for phase in phases:  # top-k, then top-p over the top-k survivors
        for p in range(passes):
            _search_kernel[(b, num_chunks)](logits, logits.stride(0), vocab, flags, lo, hi, unit, row_max,
                                            inv_t, pmax, part, b, num_chunks, zk, top_ks, top_ps, tickets,
                                            PHASE=phase, NC=NUM_CANDIDATES, CHUNK=chunk, BLOCK=search_block,
                                            STATS_BLOCK=stats_block, SKIP=opts.sampler_skip_blocks, NARROW=narrow,
                                            FIRST=narrow and p == 0, NC_PAD=nc_pad, USE_PDL=pdl,
                                            num_warps=opts.sampler_launch.search_warps, enable_fp_fusion=False,
                                            **kw)
            if not narrow:
                _narrow_kernel[(b,)](flags, lo, hi, unit, zk, top_ks, top_ps, part, b, num_chunks,
                                     PHASE=phase, FIRST=p == 0, NC=NUM_CANDIDATES, NC_PAD=nc_pad, USE_PDL=pdl,
                                     **kw)
    return lo, row_max, zk, pmax


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                 min_ps: torch.Tensor | None, seeds: torch.Tensor, steps: torch.Tensor, cuts: bool = True,
                 chunk: int | None = None, table: torch.Tensor | None = None,
                 dst: torch.Tensor | None = None) -> torch.Tensor:
    """Next tokens [B] (int64). `cuts=False` (no row uses top-k, top-p or min-p) skips the search: one pass.

    `logits` may be float32 or the LM head's bfloat16 (widened in the kernels, half the bytes per pass, and
    4 search passes per cut instead of 8: a bf16 key has only 16 bits). A row's token depends neither on
    `cuts` (as long as that row has no cut) nor on the other rows. With `table` and `dst` (the flat token table
    and each row's cell in it, int64 [B]) the tokens are also written there (notebook 06's `_finish`).

    With the kernel option `sampler_fused_ends` the rows' settings (flags, 1 / T, the seed hash) come from one
    launch and the chunks' results are reduced, and written to the table, by one more; off, by torch operations
    (about thirty small launches a step, a few microseconds each at batch 1). The tokens are the same.
    """
    b, vocab = logits.shape
    dev = logits.device
    opts = current_options()
    chunk = chunk or opts.sampler_launch.chunk
    num_chunks = triton.cdiv(vocab, chunk)
    stats_block, _, draw_block = _launch_blocks(chunk)
    temps = temperatures.float()
    if min_ps is None:
        min_ps = torch.zeros_like(temps)
    flags, inv_t, hashes = row_settings(temps, top_ks, top_ps, min_ps, seeds, steps, vocab, cuts,
                                        fused=opts.sampler_fused_ends)
    if cuts:
        lo, row_max, _, block_max = search_cuts(logits, flags, inv_t, top_ks, top_ps, chunk)
        log_min_p = torch.log(min_ps.float())  # log(0) = -inf: no min-p cut
    else:
        lo = row_max = log_min_p = block_max = inv_t  # not read by the one-pass draw
    vals = torch.empty(b, num_chunks, dtype=torch.float32, device=dev)
    idxs = torch.empty(b, num_chunks, dtype=torch.int32, device=dev)
    kw = pdl_launch(logits)
    _draw_kernel[(b, num_chunks)](logits, logits.stride(0), vocab, flags, lo, row_max, inv_t, log_min_p,
                                  hashes, block_max, vals, idxs, num_chunks, CUTS=cuts, CHUNK=chunk,
                                  BLOCK=draw_block, STATS_BLOCK=stats_block, SKIP=opts.sampler_skip_blocks,
                                  NOISE=True, USE_PDL=bool(kw), num_warps=opts.sampler_launch.draw_warps,
                                  enable_fp_fusion=False, **kw)
    return _pick(vals, idxs, table, dst, fused=opts.sampler_fused_ends)


def row_settings(temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                 seeds: torch.Tensor, steps: torch.Tensor, vocab: int, cuts: bool, fused: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's flags (int32: `row_flags`, or just T > 0 without cuts), 1 / max(T, 1e-6) (float32) and seed
    hash (`row_hash`, int64): by one kernel with `fused`, else by torch (the same values)."""
    if not fused:
        flags = row_flags(temperatures, top_ks, top_ps, min_ps, vocab) if cuts else (temperatures > 0).int()
        return flags, 1.0 / temperatures.float().clamp_min(1e-6), row_hash(seeds, steps)
    b, dev = temperatures.shape[0], temperatures.device
    flags = torch.empty(b, dtype=torch.int32, device=dev)
    inv_t = torch.empty(b, dtype=torch.float32, device=dev)
    hashes = torch.empty(b, dtype=torch.int64, device=dev)
    kw = pdl_launch(temperatures)
    _row_settings_kernel[(triton.cdiv(b, ROW_BLOCK),)](
        temperatures.float(), top_ks, top_ps.float(), min_ps.float(), seeds, steps, flags, inv_t, hashes, b, vocab,
        CUTS=cuts, BLOCK=ROW_BLOCK, USE_PDL=bool(kw), **kw)
    return flags, inv_t, hashes


def fused_greedy(logits: torch.Tensor, table: torch.Tensor | None = None, dst: torch.Tensor | None = None,
                 chunk: int | None = None) -> torch.Tensor:
    """`logits.argmax(-1)` (int64 [B]; ties: the lowest index) in two launches, the draw's chunk pass without noise
    and the pick, and with `table` and `dst` also written to the token table (see `fused_sample`)."""
    b, vocab = logits.shape
    opts = current_options()
    chunk = chunk or opts.sampler_launch.chunk
    num_chunks = triton.cdiv(vocab, chunk)
    stats_block, _, draw_block = _launch_blocks(chunk)
    vals = torch.empty(b, num_chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(b, num_chunks, dtype=torch.int32, device=logits.device)
    kw = pdl_launch(logits)
    # the row settings' pointers are not read without NOISE: any tensor stands in for them
    _draw_kernel[(b, num_chunks)](logits, logits.stride(0), vocab, vals, vals, vals, vals, vals, vals, vals, vals,
                                  idxs, num_chunks, CUTS=False, CHUNK=chunk, BLOCK=draw_block,
                                  STATS_BLOCK=stats_block, SKIP=False, NOISE=False, USE_PDL=bool(kw),
                                  num_warps=opts.sampler_launch.draw_warps, enable_fp_fusion=False, **kw)
    return _pick(vals, idxs, table, dst, fused=True)


def _pick(vals: torch.Tensor, idxs: torch.Tensor, table: torch.Tensor | None, dst: torch.Tensor | None,
          fused: bool) -> torch.Tensor:
    """The rows' tokens from their chunks' best (value, index), and into `table` at `dst` when given."""
    b, num_chunks = vals.shape
    if not fused:
        tokens = idxs.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1).long()
        if table is not None:
            table[dst] = tokens.to(table.dtype)
        return tokens
    tokens = torch.empty(b, dtype=torch.int64, device=vals.device)
    kw = pdl_launch(vals)
    _pick_kernel[(b,)](vals, idxs, num_chunks, tokens, tokens if table is None else table,
                       tokens if dst is None else dst, NC_PAD=max(2, triton.next_power_of_2(num_chunks)),
                       TABLE=table is not None, USE_PDL=bool(kw), **kw)
    return tokens
