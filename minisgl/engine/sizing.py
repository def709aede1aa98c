"""How many requests may run at once when the config leaves it to the engine (`max_running_requests` 0/None).

A running request holds a row of the request table: its KV slot and token id for every position of the
context (`12 bytes x context length`: an int32 and an int64 per position), and on a hybrid model (Qwen3.5)
state slots for its linear-attention layers (megabytes each). Rows are allocated up front, so the count is a
trade: too few and a large batch waits in the queue while the KV pool has room; too many and the rows take
memory the KV pool could have had, for requests the pool could never hold.

The rule, from the KV pool's size (estimated before it is allocated) and the memory per row:

    rows = clamp(kv_tokens // TOKENS_PER_ROW, MIN_ROWS, cap)        cap = MAX_ROWS, or MAX_ROWS_HYBRID
    rows = min(rows, ROW_MEMORY_SHARE * memory_budget // row_bytes)   on a GPU only

- TOKENS_PER_ROW: a row per 512 tokens of KV pool. More rows than the pool can hold requests of that size
  would mostly wait for pages (and overfilled pools retract).
- MIN_ROWS: the old fixed default. Small pools keep it: a row of a dense model is cheap (under 0.5 MB at a
  40k context), and the scheduler admits by pages anyway.
- MAX_ROWS: the host does per-request work every step (scheduling, inputs, reading tokens back), and a decode
  step of ~1k rows at useful context lengths is already bound by reading the KV cache, so more rows add
  per-token latency rather than throughput.
- MAX_ROWS_HYBRID: a hybrid model's row carries linear-attention state (~18 MB per slot for Qwen3.5-0.8B,
  two slots per row with the default snapshots), so hybrids keep the old default at most.
- ROW_MEMORY_SHARE: on a GPU the rows may take at most this share of the memory left for the pools after the
  weights; the bound that matters for long contexts (a 1M-token context is 12 MB of table per row) and for
  hybrid state on small cards. On a CPU the tables live in host memory and are not bounded.
"""

from __future__ import annotations

TOKENS_PER_ROW = 512
MIN_ROWS = 256
MAX_ROWS = 1024
MAX_ROWS_HYBRID = 256
ROW_MEMORY_SHARE = 0.125
TABLE_BYTES_PER_POSITION = 4 + 8  # ReqToTokenPool: int32 KV slot + int64 token id per position


def row_bytes(table_width: int, state_slot_bytes: int = 0, state_slots_per_row: int = 0) -> int:
    """Memory one request row costs: its request-table row plus its linear-attention state slots (hybrids)."""
    return TABLE_BYTES_PER_POSITION * table_width + state_slot_bytes * state_slots_per_row


def auto_max_running_requests(kv_tokens: int, bytes_per_row: int, memory_budget: int | None = None,
                              max_rows: int = MAX_ROWS) -> int:
    """Requests that may run at once (the rule in the module docstring); always >= 1.

    kv_tokens: the KV pool's capacity in tokens. bytes_per_row: `row_bytes(...)`. memory_budget: bytes the
    pools may use on the device (None on a CPU: no memory bound). max_rows: the cap, MAX_ROWS or the model
    runtime's own (MAX_ROWS_HYBRID)."""
    rows = min(max_rows, max(MIN_ROWS, kv_tokens // TOKENS_PER_ROW))
    if memory_budget is not None and bytes_per_row > 0:
        rows = min(rows, int(ROW_MEMORY_SHARE * memory_budget) // bytes_per_row)
    return max(rows, 1)


def graph_max_bs(cuda_graph_max_bs: int, max_running_requests: int) -> int:
    """The largest decode batch worth capturing: no decode step holds more than max_running_requests rows."""
    return max(1, min(cuda_graph_max_bs, max_running_requests))
