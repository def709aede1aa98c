"""How many requests may run at once when the config leaves it to the engine (`max_running_requests` 0/None).

A running request holds a row of the request table: its KV slot and token id for every position of the
context (`12 bytes x context length`: an int32 and an int64 per position), and on a hybrid model (Qwen3.5) a
state slot for its linear-attention layers (megabytes). Rows are allocated up front, so the count is a trade:
too few and a large batch waits in the queue while the pools have room; too many and the rows take memory the
KV pool could have had, for requests the pool could never hold.

The rule, from the KV pool's size (estimated before it is allocated) and the memory per row:

    rows = clamp(kv_tokens // TOKENS_PER_ROW, MIN_ROWS, MAX_ROWS)
    rows = min(rows, share * (memory_budget - reserved) // row_bytes)     on a GPU only

- TOKENS_PER_ROW: a row per 512 tokens of KV pool. More rows than the pool can hold requests of that size
  would mostly wait for pages (and overfilled pools retract).
- MIN_ROWS: the old fixed default. Small pools keep it: a row of a dense model is cheap (under 0.5 MB at a
  40k context), and the scheduler admits by pages anyway.
- MAX_ROWS: the host does per-request work every step (scheduling, inputs, reading tokens back), and a decode
  step of ~1k rows at useful context lengths is already bound by reading the KV cache (a hybrid's: its state),
  so more rows add per-token latency rather than throughput. Dense and hybrid models share it.
- share: on a GPU the rows may take at most this share of the memory left for the pools after the weights.
  ROW_MEMORY_SHARE (an eighth) for a dense model: its rows are bookkeeping beside the KV pool, and the bound
  matters only for long contexts (a 1M-token context is 12 MB of table per row). HYBRID_ROW_MEMORY_SHARE (half)
  for a hybrid: its rows hold the state of its linear-attention layers, which is what the KV cache is to a
  dense model, traded against the KV pool of its few full-attention layers (which gets most of the other half).
  On a CPU the rows live in host memory and are not bounded.
- reserved: memory sized apart from the rows and before them, which the rows' share leaves aside: a hybrid's
  prefix-cache snapshots (`state_snapshot_memory_fraction` of the free memory, or `state_snapshots` slots). The
  snapshots are counted before the state pool is allocated, so more rows never mean fewer snapshots.

Qwen3.5-0.8B, computed from its config (not measured): 752M parameters (1.40 GiB in bf16); a state slot of 18
linear-attention layers is 18.6 MiB in bf16 (19,537,920 bytes: the conv state in bf16, the recurrent state in
fp32); the 6 full-attention layers keep 12 KiB of KV a token, so a slot weighs as much as ~1,590 tokens of KV; a
table row at its 262,144-token context is 3.0 MiB. A row costs its table row and its own slot, 21.6 MiB. The
engine keeps 8 rows beyond the count (finished requests) and 4 GiB of the free memory for activations.

- H200, ~137.5 GiB free after the weights (what run14's 8.99M-token KV pool implies): 377 snapshots (6.9 GiB);
  half of the rest allows 2,997 rows, so MAX_ROWS gives 1,024 (the old rule: 256). State 25.7 GiB, tables 3.0
  GiB, the KV pool 7.8M tokens (89 GiB; was 9.0M), still ~7,600 tokens a row.
- A 24 GiB card, ~21.5 GiB free after the weights and the CUDA context: 59 snapshots (1.1 GiB), 388 rows
  (state 8.3 GiB, tables 1.2 GiB), a KV pool of 597k tokens: ~1,540 a row, about one request of the issue-29
  mixes (prompts up to 2,048, outputs up to 512). The old rule gave 55 rows and 1.1M KV tokens.
- A CPU: no budget, so clamp(16,384 // 512) = MIN_ROWS = 256 rows as before, and a snapshot a row (fp32: 20.2
  MB a slot, 521 slots, 10.5 GB of host memory).

CUDA graphs do not follow the rows: decode graphs are captured up to min(cuda_graph_max_bs, rows) (`graph_max_bs`),
and a decode step of more rows runs as graph-sized pieces (engine/graph_pieces.py; eagerly with cuda_graph_split
off). At 1,024 rows on the H200 a full decode step is four 256-row replays.
"""

from __future__ import annotations

TOKENS_PER_ROW = 512
MIN_ROWS = 256
MAX_ROWS = 1024
ROW_MEMORY_SHARE = 0.125
HYBRID_ROW_MEMORY_SHARE = 0.5
TABLE_BYTES_PER_POSITION = 4 + 8  # ReqToTokenPool: int32 KV slot + int64 token id per position


def row_bytes(table_width: int, state_slot_bytes: int = 0, state_slots_per_row: int = 0) -> int:
    """Memory one request row costs: its request-table row plus its linear-attention state slots (hybrids)."""
    return TABLE_BYTES_PER_POSITION * table_width + state_slot_bytes * state_slots_per_row


def auto_max_running_requests(kv_tokens: int, bytes_per_row: int, memory_budget: int | None = None,
                              max_rows: int = MAX_ROWS, memory_share: float = ROW_MEMORY_SHARE,
                              reserved: int = 0) -> int:
    """Requests that may run at once (the rule in the module docstring); always >= 1.

    kv_tokens: the KV pool's capacity in tokens. bytes_per_row: `row_bytes(...)`. memory_budget: bytes the
    pools may use on the device (None on a CPU: no memory bound). max_rows: the cap (the model runtime's).
    memory_share: the rows' share of the budget (ROW_MEMORY_SHARE, or a hybrid's HYBRID_ROW_MEMORY_SHARE).
    reserved: bytes of the budget sized before the rows (a hybrid's snapshots), left out of their share."""
    rows = min(max_rows, max(MIN_ROWS, kv_tokens // TOKENS_PER_ROW))
    if memory_budget is not None and bytes_per_row > 0:
        rows = min(rows, int(memory_share * max(memory_budget - reserved, 0)) // bytes_per_row)
    return max(rows, 1)


def graph_max_bs(cuda_graph_max_bs: int, max_running_requests: int) -> int:
    """The largest decode batch worth capturing: no decode step holds more than max_running_requests rows."""
    return max(1, min(cuda_graph_max_bs, max_running_requests))
