"""CUDA Graphs for prefill / extend steps (token-count buckets), the sibling of the decode runner.

An eager prefill of a small model is ~350 kernel launches from Python; on a 0.6B model the host time of those
launches is larger than the GPU work. So we capture the forward once per *shape* and replay it:

- a shape is (tokens, requests): the step's tokens padded up to a token bucket (16, 32, ... max_tokens) and
  its requests padded up to a request bucket (1, 4, 16, ...). A step with more tokens or requests than the
  largest buckets runs eagerly. Decode-only steps belong to the decode runner (engine/cuda_graph.py).
- padding is laid out on the host (`pad_extend_step`, called from ModelRunner.prepare), so the one H2D
  upload of the step already has the graph's shapes. Padded tokens have id 0, position 0 and write their K/V
  to the reserved slot 0 (like padded decode rows); no request owns them, so attention leaves their rows
  alone and no real row ever reads them. Padded requests extend by 0 tokens: the extend kernel skips them.
- the extend attention grid is sized by `max_extend_len`, fixed to the token bucket per graph; the kernel
  masks each request on the device from its extend_len, so one graph serves any split of its tokens.
- logits are computed for `requests` rows only (`logit_idx`, padded with row 0) and copied inside the graph
  into one shared logits buffer, so no graph keeps a private output alive in the memory pool.

A model with more than a KV cache (a hybrid's state slots and sequence bounds) declares the extra inputs a graph
reads through its runtime (engine/runtime.py: `graph_inputs`, fixed buffers refreshed before each replay; how a
hybrid pads them: engine/hybrid.py), and whether a shape may have as many tokens as requests.

Every graph shares the decode graphs' memory pool (captured largest first, so smaller ones reuse its blocks).
On a CPU (or with `capture=False`) `run` executes the very same padded, fixed-buffer forward eagerly: the
unit tests compare that with the unpadded eager forward. If capture fails on the GPU the engine logs once and
keeps running eagerly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from minisgl.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Shape = tuple[int, int]  # (padded tokens, padded requests)


def default_token_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Powers of two from `smallest` up to `max_tokens`, and `max_tokens` itself."""
    if max_tokens <= 0:
        return []
    sizes, n = [], smallest
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def default_request_buckets(max_reqs: int) -> list[int]:
    """1, 4, 16, ... up to `max_reqs`, and `max_reqs` itself: few graphs, at most 4x request padding."""
    if max_reqs <= 0:
        return []
    sizes, n = [], 1
    while n < max_reqs:
        sizes.append(n)
        n *= 4
    return sizes + [max_reqs]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket that holds `n` (`buckets` ascending), or None when none does."""
    return next((b for b in buckets if b >= n), None)


def extend_shape(token_buckets: list[int], request_buckets: list[int], num_tokens: int, num_reqs: int,
                 is_decode: bool, more_tokens_than_reqs: bool = False) -> Shape | None:
    """The captured shape a step runs in, or None (eager). Decode-only steps are the decode graphs' job.
    `more_tokens_than_reqs` (a runtime without `tokens_may_equal_requests`): only shapes with more tokens than
    requests."""
    if is_decode or num_tokens == 0:
        return None
    reqs = pick_bucket(request_buckets, num_reqs)
    if reqs is None:
        return None
    tokens = pick_bucket(token_buckets, max(num_tokens, reqs + 1) if more_tokens_than_reqs else num_tokens)
    if tokens is None:
        return None
    return tokens, reqs


def pad_array(a: np.ndarray, n: int, value: int) -> np.ndarray:
    """`a` as int64, grown to `n` entries with `value`."""
    out = np.full(n, value, dtype=np.int64)
    out[:len(a)] = a
    return out


def pad_extend_step(shape: Shape, input_ids: np.ndarray, positions: np.ndarray, out_cache_loc: np.ndarray,
                    rows: np.ndarray, prefix: np.ndarray, extend: np.ndarray, start: np.ndarray,
                    logit_idx: np.ndarray) -> tuple[np.ndarray, ...]:
    """Pad one step's host arrays to `shape`, in the order given.

    Token arrays grow to `tokens`: id 0, position 0, K/V slot 0 (reserved). Request arrays grow to `requests`:
    row 0, prefix 0, extend 0 (the kernels skip them; seq_len = prefix + extend = 0), start = tokens (past
    every real token). logit_idx grows to `requests` with row 0: those logits are computed and dropped.
    """
    tokens, reqs = shape
    if len(input_ids) > tokens or len(rows) > reqs or len(logit_idx) > reqs:
        raise ValueError(f"a step of {len(input_ids)} tokens / {len(rows)} requests does not fit {shape}")
    return (pad_array(input_ids, tokens, 0), pad_array(positions, tokens, 0), pad_array(out_cache_loc, tokens, 0),
            pad_array(rows, reqs, 0), pad_array(prefix, reqs, 0), pad_array(extend, reqs, 0),
            pad_array(start, reqs, tokens), pad_array(logit_idx, reqs, 0))


class PrefillGraphRunner:
    """Captured extend forwards, one per (token bucket, request bucket); `run` replays the step's shape."""

    def __init__(self, runner, max_tokens: int, max_reqs: int, token_buckets: list[int] | None = None,
                 request_buckets: list[int] | None = None, capture: bool | None = None,
                 pool=None) -> None:
        self.runner = runner
        self.model, self.attn = runner.model, runner.attn
        self.token_buckets = sorted(token_buckets or default_token_buckets(max_tokens))
        self.request_buckets = sorted(request_buckets or default_request_buckets(max_reqs))
        if not self.token_buckets or not self.request_buckets:
            raise ValueError("prefill graphs need at least one token bucket and one request bucket")
        self.max_tokens, self.max_reqs = self.token_buckets[-1], self.request_buckets[-1]
        dev, t, r = runner.device, self.max_tokens, self.max_reqs
        # the fixed buffers every graph reads; `run` refreshes them in place (dtypes as ModelRunner.prepare's)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(t, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(r, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(r, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(r, dtype=torch.int32, device=dev)
        self.extend_lens = torch.zeros(r, dtype=torch.int32, device=dev)
        self.extend_start = torch.zeros(r, dtype=torch.int32, device=dev)
        self.logit_idx = torch.zeros(r, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(r, runner.model_config.vocab_size, dtype=runner.dtype, device=dev)
        # the model's extra inputs beyond a KV cache, if any (a hybrid's state slots and sequence bounds)
        self.inputs = runner.runtime.graph_inputs(r, dev, decode=False)
        self.tokens_may_equal_requests = runner.runtime.tokens_may_equal_requests
        self.metas = {shape: self._meta(shape) for shape in self.shapes}  # built once: no per-step host work
        # a backend's own fixed inputs beyond the metadata (the Triton backend's extend tile list), refreshed from
        # each step's host lengths by load_graph_step
        init_state = getattr(self.attn, "init_prefill_graph_state", None)
        if init_state is not None:
            init_state(self.max_tokens, self.max_reqs)
        self.graphs: dict[Shape, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served by this runner (graph replays, or padded eager runs on a CPU)
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.captured = runner.device.type == "cuda" if capture is None else capture
        if self.captured:
            self._capture_all(pool)

    @property
    def shapes(self) -> list[Shape]:
        return [(t, r) for t in self.token_buckets for r in self.request_buckets
                if t > r or self.tokens_may_equal_requests]

    def shape_for(self, batch) -> Shape | None:
        return extend_shape(self.token_buckets, self.request_buckets, batch.num_tokens, batch.size,
                            batch.is_decode, more_tokens_than_reqs=not self.tokens_may_equal_requests)

    def _meta(self, shape: Shape) -> AttentionMetadata:
        t, r = shape
        # max_extend_len = the token bucket: the extend kernel's grid is fixed per graph, the kernel masks per
        # request. max_seq_len is an upper bound only (the Triton extend kernel does not read it).
        meta = AttentionMetadata(
            is_decode=False, req_pool_indices=self.req_pool_indices[:r], seq_lens=self.seq_lens[:r],
            prefix_lens=self.prefix_lens[:r], extend_lens=self.extend_lens[:r],
            extend_start=self.extend_start[:r], out_cache_loc=self.out_cache_loc[:t],
            max_seq_len=self.runner.max_model_len, max_extend_len=t)
        return self.inputs.metadata(meta, r)

    def _forward(self, shape: Shape) -> None:
        t, r = shape
        self.attn.prepare(self.metas[shape])
        out = self.model(self.input_ids[:t], self.positions[:t], self.attn, self.logit_idx[:r])
        self.logits[:r].copy_(out)

    @torch.inference_mode()
    def _capture_all(self, pool) -> None:
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(self.runner.device)
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        # largest first, so the smaller graphs reuse its blocks of the pool
        for shape in sorted(self.shapes, key=lambda s: (s[0], s[1]), reverse=True):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(shape)  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._forward(shape)
            self.graphs[shape] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved(self.runner.device) - before

    def run(self, shape: Shape, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logit_idx: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Logits `[num_rows, vocab]` of a step whose tensors ModelRunner.prepare padded to `shape`."""
        t, r = shape
        if input_ids.shape[0] != t or meta.batch_size != r or logit_idx.shape[0] != r:
            raise ValueError(f"step tensors are not padded to {shape}: call prepare(batch, pad_to=shape)")
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.out_cache_loc[:t].copy_(meta.out_cache_loc)
        self.req_pool_indices[:r].copy_(meta.req_pool_indices)
        self.seq_lens[:r].copy_(meta.seq_lens)
        self.prefix_lens[:r].copy_(meta.prefix_lens)
        self.extend_lens[:r].copy_(meta.extend_lens)
        self.extend_start[:r].copy_(meta.extend_start)
        self.logit_idx[:r].copy_(logit_idx)
        self.inputs.load(meta, r)
        load_step = getattr(self.attn, "load_graph_step", None)
        if load_step is not None:
            load_step(meta, shape)
        self.replays += 1
        if self.captured:
            self.attn.prepare(self.metas[shape])  # the backend's meta must not point at a freed step's tensors
            self.graphs[shape].replay()
        else:
            self._forward(shape)
        return self.logits[:num_rows]


def graph_pool_of(graph_runner) -> object | None:
    """The memory pool of the decode graphs (any of them: they share one), to capture ours into it."""
    for graph in (getattr(graph_runner, "graphs", None) or {}).values():
        return graph.pool()
    return None


def build_prefill_graphs(runner, max_tokens: int, max_reqs: int, pool=None,
                         capture: bool | None = None) -> PrefillGraphRunner | None:
    """The engine's entry point: capture on the GPU; on any failure log once and return None (eager)."""
    max_reqs = min(max_reqs, runner.config.max_running_requests)  # no step holds more: no graph for more
    try:
        graphs = PrefillGraphRunner(runner, max_tokens, max_reqs, pool=pool, capture=capture)
    except Exception as exc:  # a capture failure must cost speed, never the engine
        logger.warning("prefill CUDA graphs disabled, running prefill eagerly: capture failed with %r", exc)
        if runner.device.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:
                pass
        return None
    logger.info("captured %d prefill graphs in %.2f s, %.0f MiB", len(graphs.graphs), graphs.capture_seconds,
                graphs.capture_bytes / 2**20)
    return graphs
