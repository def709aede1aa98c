"""Decode graphs whose inputs arrive in one host-to-device copy (engine switch `graph_staged_inputs`).

Notebook 06's runner refreshes its fixed buffers with a device copy each: input ids, positions, KV slots, rows,
lengths, token destinations, the sampler's settings. With the step's own upload, the table writes and the gather
of the input ids, that is about ten small operations between two replays. Each is a launch the GPU runs on its
own, a couple of microseconds at batch 1, where Qwen3-0.6B's whole step is ~0.75 ms on an H200.

Here the fixed buffers are rows of one device block, and a decode step writes its host arrays straight into a
pinned copy of that block. Between two replays the GPU then runs one copy, one scatter (the table writes) and
one gather (the input ids, into their fixed buffer), or with the kernel option `zero_copy_io` one kernel that
reads the pinned block itself and does all three (kernels/staging.py). The graphs are notebook 06's, captured on
the block's rows, and they end in the fused sampler's last launch, which also writes the token table
(`_finish`, kernel option `sampler_fused_ends`).
`run` still works as notebook 06 wrote it: it copies into the same rows. Graph pieces and processed logits go
through it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from minisgl.engine.cuda_graph import CudaGraphRunner, padded_size, sampler_of
from minisgl.engine.sampler import SamplingTensors
from minisgl.kernels import sampling, staging
from minisgl.kernels.elementwise import use_triton
from minisgl.kernels.options import current_options

# The block's rows, each `width` int64 elements; an int32 or float32 field uses the first half of its row.
_I64 = ("positions", "out_cache_loc", "req_pool_indices", "token_dst", "token_src", "top_ks", "seeds", "steps",
        "write_at", "state_slots")  # state_slots: a hybrid model's (engine/hybrid.py), unused by a dense one
_I32 = ("seq_lens", "write_val")
_F32 = ("temperatures", "top_ps", "min_ps")
ROWS = {name: i for i, name in enumerate(_I64 + _I32 + _F32)}
_NP = {name: np.int64 for name in _I64} | {name: np.int32 for name in _I32} | {name: np.float32 for name in _F32}
_TORCH = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


class StagedCudaGraphRunner(CudaGraphRunner):
    """Notebook 06's runner with its fixed buffers as rows of one block, and `run_staged`: a decode step from its
    host arrays in one copy."""

    def _capture_all(self) -> None:
        self._stage_buffers()
        super()._capture_all()

    def _stage_buffers(self) -> None:
        """Move the fixed buffers into one device block (before any capture: the graphs read its rows)."""
        width = self.max_bs + (-self.max_bs) % 4  # every row on a 32-byte boundary: Triton's alignment variants
        dev, cuda = self.input_ids.device, self.input_ids.device.type == "cuda"
        self.block = torch.zeros(len(ROWS), width, dtype=torch.int64, device=dev)
        # two host copies, used in turn, each with the event of the copy that last read it
        self._host = [torch.zeros(len(ROWS), width, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._host_np = [{name: self._row(h.numpy(), name) for name in ROWS} for h in self._host]
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0
        self.write_capacity = width  # table writes a staged step makes in the block (more: the usual upload)
        rows = {name: self._row(self.block, name) for name in ROWS}
        s = self.sampling
        for name, old in (("positions", self.positions), ("out_cache_loc", self.out_cache_loc),
                          ("req_pool_indices", self.req_pool_indices), ("seq_lens", self.seq_lens),
                          ("token_dst", self.token_dst), ("temperatures", s.temperatures), ("top_ks", s.top_ks),
                          ("top_ps", s.top_ps), ("seeds", s.seeds), ("steps", s.steps), ("min_ps", s.min_ps)):
            rows[name][:old.shape[0]].copy_(old)  # the values notebook 06 starts its buffers with
        self.positions, self.out_cache_loc = rows["positions"], rows["out_cache_loc"]
        self.req_pool_indices, self.seq_lens, self.token_dst = rows["req_pool_indices"], rows["seq_lens"], rows[
            "token_dst"]
        self.sampling = SamplingTensors(
            temperatures=rows["temperatures"], top_ks=rows["top_ks"], top_ps=rows["top_ps"], seeds=rows["seeds"],
            steps=rows["steps"], all_greedy=False, any_top_k_p=True, min_ps=rows["min_ps"])

    def _finish(self, logits: torch.Tensor, bs: int, sampler: str) -> torch.Tensor:
        """Notebook 06's `_finish`, with the sampler's ends fused (kernel option `sampler_fused_ends`): the token
        table write happens in the sampler's last launch, and a greedy graph's argmax is the sampler's draw pass
        without noise. Between the LM head and the next step that is two launches, not four for a greedy step
        or about thirty-five for a sampled one. The tokens are notebook 06's."""
        if sampler == "logits" or not (use_triton(logits) and current_options().sampler_fused_ends):
            return super()._finish(logits, bs, sampler)
        table = self.token_table
        dst = None if table is None else self.token_dst[:bs]
        if sampler == "greedy":
            return sampling.fused_greedy(logits, table, dst)
        st = self._sampling(bs, cuts=sampler == "cuts")
        return sampling.fused_sample(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.steps,
                                     cuts=st.any_top_k_p, table=table, dst=dst)

    def _stage_extra(self, host: dict, arrays, n: int, bs: int) -> None:
        """A subclass's own rows of the host block for a step of n rows padded to bs (none here)."""

    @staticmethod
    def _row(block, name: str):
        """Row `name` of a block (a tensor or its numpy view) in the field's dtype, `width` elements."""
        row, dtype = block[ROWS[name]], _NP[name]
        width = block.shape[1]
        if isinstance(row, np.ndarray):
            return row.view(dtype)[:width]
        return row.view(_TORCH[dtype])[:width]

    def run_staged(self, arrays, writes: np.ndarray | None, table: torch.Tensor) -> torch.Tensor:
        """Next tokens `[n]` of a decode batch whose every row samples, from its host arrays (`HostArrays`):
        one copy of the block, the table writes (`writes`, `[2, k]` flat table index and KV slot, at most
        `write_capacity`; None: applied already) scattered into `table`, the input ids gathered, one replay.
        The result is a view of the graph's output, valid until the next replay."""
        n = len(arrays.rows)
        sampler = sampler_of(replace(self.sampling, all_greedy=arrays.all_greedy, any_top_k_p=arrays.any_top_k_p))
        seq_lens = arrays.prefix + arrays.extend
        bs = padded_size(self.batch_sizes, n)
        turn, self._turn = self._turn, self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy that read this host block two staged steps ago
        h = self._host_np[turn]
        # real rows, then padding: K/V to the reserved slot 0, a one-token context, the token to the spare cell,
        # greedy (notebook 06's fill_padding and _load_sampling)
        for name, values, pad in (("positions", arrays.positions, 0), ("out_cache_loc", arrays.out_cache_loc, 0),
                                  ("req_pool_indices", arrays.rows, 0), ("seq_lens", seq_lens, 1),
                                  ("token_dst", arrays.token_dst, self.spare_cell),
                                  ("token_src", arrays.token_src, self.spare_cell),
                                  ("temperatures", arrays.temperatures, 0.0), ("top_ks", arrays.top_ks, 1),
                                  ("top_ps", arrays.top_ps, 1.0), ("min_ps", arrays.min_ps, 0.0),
                                  ("seeds", arrays.seeds, 0), ("steps", arrays.steps, 0)):
            h[name][:n] = values
            h[name][n:bs] = pad
        self._stage_extra(h, arrays, n, bs)
        k = 0 if writes is None else writes.shape[1]
        if k:
            h["write_at"][:k], h["write_val"][:k] = writes
        # the block's used columns, the table writes (values int32 in the block already), the input ids: one
        # kernel reading the pinned block, or a copy of it, a scatter and a gather (kernel option zero_copy_io)
        staging.stage_in(self._host[turn], self.block, max(bs, k), (ROWS["write_at"], ROWS["write_val"], k), table,
                         (ROWS["token_src"], self.token_table, self.input_ids[:bs]))
        if self._copied[turn] is not None:
            self._copied[turn].record()
        static = self._meta(bs)
        static.seq_lens_cpu = seq_lens.tolist() + [1] * (bs - n)  # backends that plan on the CPU
        self.attn.prepare_for_replay(static)
        self.last_run_used_graph = True
        self.graphs[bs, sampler].replay()
        return self.outputs[bs, sampler][:n]
