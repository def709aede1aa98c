"""Decode steps larger than the largest captured CUDA graph, replayed as graph-sized pieces.

The decode graphs are captured up to `cuda_graph_max_bs` rows (engine/cuda_graph.py), but with the request
count sized from memory (engine/sizing.py) a decode step can hold more. Such a step is cut into consecutive
pieces of at most the largest captured size, and each piece replays its graph (forward and sampler).

Why pieces rather than one eager step: the rows of a decode step are independent (each reads only its own
KV and writes only its own new slot), so a piece is a complete decode step of its own, and the tokens are the
same (the sampler's randomness is per request: engine/sampler.py). A piece costs one more pass over the
weights, which at ~256 rows is already hidden under the GEMMs' compute on an H200-class GPU, while an eager
step pays every kernel launch from Python and allocates its activations, logits and sampler buffers outside
the graphs' memory pool. `cuda_graph_split=False` runs such steps eagerly instead (the A/B switch).
"""

from __future__ import annotations

import dataclasses

import torch

from minisgl.attention import AttentionMetadata
from minisgl.engine.sampler import SamplingTensors

_PER_ROW = ("req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "out_cache_loc", "state_slots")
_PER_ROW_HOST = ("seq_lens_cpu", "prefix_lens_cpu", "extend_lens_cpu")


def piece_bounds(n: int, max_bs: int) -> list[tuple[int, int]]:
    """[lo, hi) row ranges covering 0..n-1, each at most max_bs rows: full pieces, then the remainder."""
    return [(lo, min(lo + max_bs, n)) for lo in range(0, n, max_bs)]


def decode_piece(meta: AttentionMetadata, lo: int, hi: int) -> AttentionMetadata:
    """Rows lo..hi-1 of a decode step's metadata (views where possible), as a decode step of hi - lo rows."""
    kw = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    for name in _PER_ROW:  # a decode step has one token per row, so out_cache_loc is per row too
        if kw.get(name) is not None:
            kw[name] = kw[name][lo:hi]
    for name in _PER_ROW_HOST:
        if kw.get(name) is not None:
            kw[name] = kw[name][lo:hi]
    kw["extend_start"] = meta.extend_start[lo:hi] - lo  # token i of the piece is row i
    if kw.get("cu_seqlens") is not None:  # hybrid metadata: sequence bounds 0..B
        kw["cu_seqlens"] = meta.cu_seqlens[lo:hi + 1] - lo
    if meta.seq_lens_cpu is not None:
        kw["max_seq_len"] = max(meta.seq_lens_cpu[lo:hi])
    return type(meta)(**kw)


def sampling_piece(st: SamplingTensors, lo: int, hi: int) -> SamplingTensors:
    """Rows lo..hi-1 of the sampling settings. The batch's flags are kept: a piece of an all-greedy batch is
    all greedy, and the top-k/top-p sampler gives rows that cut nothing the same tokens as the plain one."""
    return SamplingTensors(st.temperatures[lo:hi], st.top_ks[lo:hi], st.top_ps[lo:hi], st.seeds[lo:hi],
                           st.steps[lo:hi], all_greedy=st.all_greedy, any_top_k_p=st.any_top_k_p,
                           min_ps=None if st.min_ps is None else st.min_ps[lo:hi])


def run_in_pieces(graph_runner, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  sampling: SamplingTensors) -> torch.Tensor:
    """Next tokens `[n]` of a decode step of n rows, n larger than the graphs: one replay per piece."""
    # each replay returns a view of its graph's output buffer, which the next piece's replay of the same graph
    # rewrites: copy every piece out (the caller writes the token table, as for an eager step)
    tokens = [graph_runner.run(input_ids[lo:hi], positions[lo:hi], decode_piece(meta, lo, hi),
                               sampling_piece(sampling, lo, hi)).clone()
              for lo, hi in piece_bounds(meta.batch_size, graph_runner.max_bs)]
    graph_runner.last_run_used_graph = True
    return torch.cat(tokens)
