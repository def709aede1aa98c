# generated from notebooks/06_cuda_graph.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/06_cuda_graph.ipynb, cell 3 (id c06-003) ---
"""CUDA Graph runner for decode steps.

A decode step of a small model is a few hundred short kernels; launching them one by one from Python costs
more than running them. So we record ("capture") the whole step once per batch size and sampler and replay it
with one call: the forward, the sampler and the write of the tokens into the token-id table, so a step is one
launch and a replay hands back the next tokens. A graph replays fixed addresses, so every input (the sampling
settings included) lives in a fixed buffer that is refreshed in place before each replay; a batch is padded
up to the next captured size, with padded rows writing their K/V to the reserved slot 0, sampling greedily
and writing their token to a cell of the table no request uses.
"""

from __future__ import annotations

import torch

from minisgl.attention import AttentionMetadata
from minisgl.engine.sampler import SamplingTensors, sample


# --- notebooks/06_cuda_graph.ipynb, cell 7 (id c06-007) ---
def default_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


# --- notebooks/06_cuda_graph.ipynb, cell 10 (id c06-010) ---
def padded_size(batch_sizes: list[int], n: int) -> int:
    """The smallest captured batch size that holds `n` rows (`batch_sizes` ascending)."""
    return next(s for s in batch_sizes if s >= n)


# --- notebooks/06_cuda_graph.ipynb, cell 11 (id c06-011) ---
def fill_padding(n: int, bs: int, out_cache_loc: torch.Tensor, seq_lens: torch.Tensor,
                 positions: torch.Tensor) -> None:
    """Make rows n..bs-1 of the static buffers harmless: K/V to the reserved slot 0, a one-token context."""
    if bs > n:  # padded rows: slot 0 is reserved, a one-token context reads a valid slot
        out_cache_loc[n:bs].zero_()
        seq_lens[n:bs].fill_(1)
        positions[n:bs].zero_()


# --- notebooks/06_cuda_graph.ipynb, cell 17 (id 8fd6626a) ---
# argmax; temperature only (one pass); top-k / top-p / min-p search; and "logits": no sampler, the forward's logits
# copied to a buffer all sizes share, for steps whose logits are processed before sampling (notebook 12)
SAMPLERS = ("greedy", "plain", "cuts", "logits")


def sampler_of(st: SamplingTensors) -> str:
    """Which captured sampler a batch needs: the host knows it from the requests, with no sync."""
    if st.processed:
        return "logits"
    return "greedy" if st.all_greedy else "cuts" if st.any_top_k_p else "plain"


# --- notebooks/06_cuda_graph.ipynb, cell 18 (id c06-017) ---
class CudaGraphRunner:
    def __init__(self, runner, max_bs: int, batch_sizes: list[int] | None = None) -> None:
        self.runner = runner
        self.model, self.attn = runner.model, runner.attn
        self.batch_sizes = batch_sizes or default_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev, n = runner.device, self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.prefix_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.extend_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.extend_start = torch.arange(n, dtype=torch.int32, device=dev)
        f32, i64 = dict(dtype=torch.float32, device=dev), dict(dtype=torch.int64, device=dev)
        self.sampling = SamplingTensors(  # the sampler's settings: views of these are what the graphs read
            temperatures=torch.zeros(n, **f32), top_ks=torch.ones(n, **i64), top_ps=torch.ones(n, **f32),
            seeds=torch.zeros(n, **i64), steps=torch.zeros(n, **i64), all_greedy=False, any_top_k_p=True,
            min_ps=torch.zeros(n, **f32))
        # Where each row's token goes in the token-id table (flat index row * width + position; notebook 02),
        # written by the graph itself. Padded rows write to the table's last cell: its column lies past every
        # position a request reaches (the table is a page wider than the context), so no one ever reads it.
        pool = getattr(runner, "req_pool", None)
        self.token_table = None if pool is None else pool.token_ids.view(-1)
        self.spare_cell = 0 if pool is None else self.token_table.numel() - 1
        self.token_dst = torch.full((n,), self.spare_cell, dtype=torch.int64, device=dev)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}  # (batch size, sampler): a whole step
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}  # the tokens each graph writes
        self.logits: torch.Tensor | None = None  # [max_bs, vocab]: what the "logits" graphs write
        self.last_run_used_graph = False
        self.attn.init_cuda_graph_state(n)
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True, req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
            extend_start=self.extend_start[:bs], out_cache_loc=self.out_cache_loc[:bs],
            max_seq_len=self.runner.max_model_len, max_extend_len=1)

    def _sampling(self, bs: int, cuts: bool) -> SamplingTensors:
        s = self.sampling
        return SamplingTensors(s.temperatures[:bs], s.top_ks[:bs], s.top_ps[:bs], s.seeds[:bs], s.steps[:bs],
                               all_greedy=False, any_top_k_p=cuts, min_ps=s.min_ps[:bs])

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, bs: int, sampler: str) -> torch.Tensor:
        """What one graph records: the forward, then `_finish` on its logits."""
        return self._finish(self.model(input_ids, positions, self.attn), bs, sampler)

    def _finish(self, logits: torch.Tensor, bs: int, sampler: str) -> torch.Tensor:
        """The sampler on the logits and the tokens into the token table (or, for "logits", the copy)."""
        if sampler == "logits":  # into the shared buffer (allocated by the warm-up, outside any graph)
            if self.logits is None:
                self.logits = torch.empty(self.max_bs, logits.shape[-1], dtype=logits.dtype, device=logits.device)
            self.logits[:bs].copy_(logits)
            return self.logits[:bs]
        if sampler == "greedy":
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample(logits, self._sampling(bs, cuts=sampler == "cuts"))
        if self.token_table is not None:  # the next step reads its input ids from there (notebook 07)
            self.token_table[self.token_dst[:bs]] = tokens.long()
        return tokens

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory
            self.attn.prepare_for_capture(self._meta(bs))
            args = (self.input_ids[:bs], self.positions[:bs], bs)
            self._warm_up(stream, *args)
            for sampler in SAMPLERS:
                self._record((bs, sampler), pool, stream, self._step, *args, sampler)
        torch.cuda.synchronize()

    def _warm_up(self, stream, input_ids: torch.Tensor, positions: torch.Tensor, bs: int) -> None:
        """Run the step once outside any graph: a kernel's first launch compiles or loads it, and lazy
        initialisation allocates, neither of which may be recorded. The forward is the same for every sampler,
        so it runs once and each sampler's `_finish` once on its logits."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.model(input_ids, positions, self.attn)
            for sampler in SAMPLERS:
                self._finish(logits, bs, sampler)
        torch.cuda.current_stream().wait_stream(stream)

    def _record(self, key: tuple[int, str], pool, stream, fn, *args) -> torch.Tensor:
        """Capture fn(*args) (warmed up already) as graph `key`; its output tensor."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = fn(*args)
        self.graphs[key], self.outputs[key] = graph, out
        return out

    def can_run(self, batch) -> bool:
        # every row must sample: a graph samples a token for each row and writes it to the row's destination.
        # A step of 1-token extends may hold a prefill chunk that samples nothing (a short prefill budget, a
        # hybrid model's cut at a page boundary): it runs eagerly.
        ok = batch.is_decode and len(batch.sample_rows) == batch.size and batch.size <= self.max_bs
        self.last_run_used_graph = ok
        return ok

    def _load_sampling(self, st: SamplingTensors, n: int, bs: int) -> None:
        s = self.sampling
        for static, new in ((s.temperatures, st.temperatures), (s.top_ks, st.top_ks), (s.top_ps, st.top_ps),
                            (s.seeds, st.seeds), (s.steps, st.steps)):
            static[:n].copy_(new)
        if st.min_ps is None:
            s.min_ps[:n].zero_()
        else:
            s.min_ps[:n].copy_(st.min_ps)
        s.temperatures[n:bs].zero_()  # padding rows: greedy, no search

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sampling: SamplingTensors, token_dst: torch.Tensor | None = None) -> torch.Tensor:
        """Next tokens `[n]` of a decode batch of n rows, every row sampling: one replay, one launch.
        (With `sampling.processed`, the logits `[n, vocab]` instead, and no token is written.)

        With `token_dst` (flat token-table indices, one per row) the replay also writes the tokens there.
        The result is a view of the graph's output, valid until the next replay: copy it to keep it."""
        n = meta.batch_size
        bs = padded_size(self.batch_sizes, n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_cache_loc[:n].copy_(meta.out_cache_loc)
        self.req_pool_indices[:n].copy_(meta.req_pool_indices)
        self.seq_lens[:n].copy_(meta.seq_lens)
        fill_padding(n, bs, self.out_cache_loc, self.seq_lens, self.positions)
        if token_dst is not None:
            self.token_dst[:n].copy_(token_dst)
        if token_dst is None or bs > n:  # rows without a destination write to the spare cell
            self.token_dst[0 if token_dst is None else n:bs].fill_(self.spare_cell)
        sampler = sampler_of(sampling)
        if sampler in ("plain", "cuts"):
            self._load_sampling(sampling, n, bs)
        static = self._meta(bs)
        if meta.seq_lens_cpu is not None:  # host copies for backends that plan on the CPU (FlashInfer): no sync
            static.seq_lens_cpu = list(meta.seq_lens_cpu) + [1] * (bs - n)
        self.attn.prepare_for_replay(static)
        self.graphs[bs, sampler].replay()
        return self.outputs[bs, sampler][:n]
