# generated from notebooks/10_hybrid_state.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/10_hybrid_state.ipynb, cell 4 (id c10-004) ---
"""Per-request state of a hybrid model's linear-attention (Gated DeltaNet) layers, and its snapshots.

A full-attention layer keeps one K/V entry per token (the paged KV pool); a Gated DeltaNet layer keeps a fixed
size state per request instead: the last K-1 inputs of its causal convolution and the [Dk, Dv] recurrent
matrix of every value head. The pool holds both for every layer, one "slot" per index:

    slots 0 .. num_rows-1              one per request-table row: a request's slot is its row
    slots num_rows .. num_rows+M-1     snapshots: copies of a request's state at a page boundary, owned by the
                                       prefix cache (a radix hit restores the state from one)
    slot  num_rows + M                 the dummy slot: padded rows of a CUDA graph batch write there

Giving each row its own slot means admission (which needs a free row) never waits for a slot, and every path
that gives a row back (finish, abort, retraction, a failed step) gives its slot back with it.

The conv state is in the model dtype, the recurrent state in fp32: it accumulates over the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionMetadata


# --- notebooks/10_hybrid_state.ipynb, cell 20 (id c10-020) ---
class StatePool:
    def __init__(self, num_layers: int, num_rows: int, num_snapshots: int, conv_channels: int, conv_kernel: int,
                 num_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.num_layers, self.num_rows, self.num_snapshots = num_layers, num_rows, num_snapshots
        num_slots = num_rows + num_snapshots + 1
        self.dummy_slot = num_slots - 1
        self.conv = torch.zeros(num_layers, num_slots, conv_channels, conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, num_slots, num_heads, key_dim, value_dim, dtype=torch.float32,
                                     device=device)
        # popping from the end hands out the lowest snapshot slot first
        self._free_snapshots = list(range(num_rows + num_snapshots - 1, num_rows - 1, -1))

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_channels: int, conv_kernel: int, num_heads: int, key_dim: int,
                       value_dim: int, dtype: torch.dtype) -> int:
        conv = conv_channels * (conv_kernel - 1) * torch.empty(0, dtype=dtype).element_size()
        return num_layers * (conv + num_heads * key_dim * value_dim * 4)

    @staticmethod
    def num_snapshots_for(explicit: int | None, memory_fraction: float, bytes_per_slot: int,
                          device: torch.device, fallback: int) -> int:
        """How many snapshot slots to allocate: `explicit` when given; on a GPU, `memory_fraction` of the memory
        free now (after the weights, before the KV pool) over a slot's bytes; on a CPU, `fallback`.

        Snapshots are what make a hybrid model's prefix cache hit (a hit resumes at a node with one), and a
        workload with shared prefixes keeps one per branch point beside one per recent prompt, so they are
        sized from memory rather than from the number of running requests. At least one."""
        if explicit is not None:
            return explicit
        if device.type != "cuda":
            return fallback
        free, _ = torch.cuda.mem_get_info(device)
        return max(int(free * memory_fraction) // bytes_per_slot, 1)

    # --- snapshot slots (the prefix cache's) -----------------------------------------------------------
    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def alloc_snapshot(self) -> int | None:
        return self._free_snapshots.pop() if self._free_snapshots else None

    def free_snapshot(self, slot: int) -> None:
        if not self.num_rows <= slot < self.dummy_slot or slot in self._free_snapshots:
            raise RuntimeError(f"double free or bad snapshot slot {slot}")
        self._free_snapshots.append(slot)

    # --- moving state between slots (queued on the device in step order) -------------------------------
    def _index(self, slots: list[int]) -> torch.Tensor:
        """Slot numbers as a device tensor, uploaded without making the host wait for the GPU (a plain
        torch.tensor(..., device="cuda") would, and the overlap loop would lose its lead on that step)."""
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.conv.device.type != "cuda":
            return idx
        return idx.pin_memory().to(self.conv.device, non_blocking=True)

    def copy(self, dst: list[int], src: list[int]) -> None:
        if dst:
            d, s = self._index(dst), self._index(src)
            self.conv[:, d] = self.conv[:, s]
            self.recurrent[:, d] = self.recurrent[:, s]

    def zero(self, slots: list[int]) -> None:
        if slots:
            idx = self._index(slots)
            self.conv[:, idx] = 0
            self.recurrent[:, idx] = 0

    def start(self, inits: list[tuple[int, int | None]]) -> None:
        """Before a step: each (slot, snapshot) pair starts the request in `slot` from `snapshot`, or from zeros
        (a fresh request, no prefix hit) when snapshot is None."""
        self.zero([slot for slot, snap in inits if snap is None])
        pairs = [(slot, snap) for slot, snap in inits if snap is not None]
        self.copy([slot for slot, _ in pairs], [snap for _, snap in pairs])

    def save(self, saves: list[tuple[int, int]]) -> None:
        """After a step: copy each (slot, snapshot) request's state into its snapshot slot."""
        self.copy([snap for _, snap in saves], [slot for slot, _ in saves])


# --- notebooks/10_hybrid_state.ipynb, cell 21 (id c10-021) ---
@dataclass
class HybridAttentionMetadata(AttentionMetadata):
    """The step's attention metadata plus where each request's linear-attention state lives (device tensors).

    A decode step of B rows has `state_slots` [B] and `cu_seqlens` = 0..B: fixed shapes, so a CUDA graph can
    capture them; its padded rows point at the pool's dummy slot."""

    state_slots: torch.Tensor | None = None  # [B] int64: state slot of each request
    cu_seqlens: torch.Tensor | None = None  # [B+1] int32: request i's tokens are rows cu[i]:cu[i+1] of the step
