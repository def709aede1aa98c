"""max_running_requests sized from memory (engine/sizing.py), and decode steps larger than the largest CUDA
graph replayed in graph-sized pieces (engine/graph_pieces.py), on a CPU.

The pieces are checked with a stand-in for the graph runner that runs each piece eagerly (a CPU has no CUDA
graphs): what is checked is that a piece cut from a decode step is a complete decode step of its own, so the
tokens equal those of the uncut step, for a dense and a hybrid model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, VOCAB, assert_all_pages_back, assert_parity, hf_greedy
from test_qwen35 import SUBSET, qwen35_path  # noqa: F401 (a fixture)

from minisgl import SamplingParams
from minisgl.config import EngineConfig
from minisgl.engine import sizing
from minisgl.engine.graph_pieces import piece_bounds
from minisgl.engine.model_runner import ModelRunner
from minisgl.engine.sampler import sample
from minisgl.kvcache.state_pool import StatePool

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MiB, GiB = 1 << 20, 1 << 30


# --- the rule ------------------------------------------------------------------------------------------------

def test_rule_grows_with_the_kv_pool_between_the_floor_and_the_cap():
    row = sizing.row_bytes(40960)  # Qwen3's context: 12 bytes a position
    assert row == 12 * 40960
    assert sizing.auto_max_running_requests(16384, row) == 256  # a small pool keeps the old default
    assert sizing.auto_max_running_requests(300_000, row) == 300_000 // 512  # 585
    assert sizing.auto_max_running_requests(1_064_273, row, memory_budget=120 * GiB) == 1024  # run8's H200 pool
    assert sizing.auto_max_running_requests(50_000_000, row) == 1024


def test_rule_bounds_the_rows_by_memory():
    row = sizing.row_bytes(1 << 20)  # a 1M-token context: 12 MiB of request table a row
    # an eighth of 8 GiB holds 85 such rows, though the 2M-token pool would want 1024
    assert sizing.auto_max_running_requests(2_000_000, row, memory_budget=8 * GiB) == 85
    assert sizing.auto_max_running_requests(2_000_000, row, memory_budget=None) == 1024  # CPU: no memory bound
    assert sizing.auto_max_running_requests(10, row, memory_budget=1 * MiB) == 1  # never 0


def qwen35_runtime():
    """The hybrid runtime at Qwen3.5-0.8B's shapes (its config from assets/configs; no weights)."""
    from transformers import AutoConfig

    from minisgl.engine.hybrid import LinearStateRuntime
    from minisgl.models.qwen3_5 import Qwen35Config
    path = Path(__file__).resolve().parents[1] / "assets" / "configs" / "qwen3.5-0.8b"
    return LinearStateRuntime(Qwen35Config.from_hf(AutoConfig.from_pretrained(path)))


def hybrid_rows(free: int | None, monkeypatch, kv_tokens: int = 16384, **settings) -> tuple[int, int]:
    """(rows, snapshots) the rule gives Qwen3.5-0.8B with `free` bytes free after the weights (None: a CPU), as
    ModelRunner._resolve_max_running and LinearStateRuntime.allocate compute them (bf16 on a GPU, fp32 on a CPU)."""
    rt, config = qwen35_runtime(), EngineConfig("m", **settings)
    device, dtype = (torch.device("cpu"), torch.float32) if free is None else (torch.device("cuda"), torch.bfloat16)
    budget = None if free is None else free - 4 * GiB  # ModelRunner._pool_budget's reserve
    if free is not None:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, free))
        kv_tokens = int(budget * config.kv_memory_fraction) // 12288  # 6 full-attention layers: 12 KiB a token
    per_row = sizing.row_bytes(262144 + 1, *rt.row_state_bytes(config, dtype, device))
    reserved = rt.reserved_state_bytes(config, dtype, device) if budget is not None else 0
    rows = sizing.auto_max_running_requests(kv_tokens, per_row, budget, max_rows=rt.max_rows,
                                            memory_share=rt.row_memory_share, reserved=reserved)
    return rows, rt.num_snapshots(config, dtype, device, rows=rows)


def test_hybrid_rows_follow_memory(monkeypatch):
    """The numbers of engine/sizing.py's docstring: Qwen3.5-0.8B's rows grow with the card, where the old rule
    held every card at 256 at most (and a 24 GiB one at 55)."""
    slot = StatePool.bytes_per_slot(18, 6144, 4, 16, 128, 128, torch.bfloat16)
    assert slot == 19_537_920  # 18.6 MiB: the conv state in bf16, the recurrent state in fp32
    # an H200 (~137.5 GiB free after the weights): half of the rest would allow 2,997 rows; the cap gives 1,024
    assert hybrid_rows(int(137.5 * GiB), monkeypatch) == (sizing.MAX_ROWS, 377)
    bound = int(0.5 * (int(133.5 * GiB) - 377 * slot)) // (12 * 262145 + slot)
    assert bound == 2997
    # a 24 GiB card (~21.5 GiB free): 388 rows, each with 3 MiB of table and its own slot, beside 59 snapshots
    assert hybrid_rows(int(21.5 * GiB), monkeypatch) == (388, 59)
    # a 16 GiB card: fewer still
    assert hybrid_rows(int(13.8 * GiB), monkeypatch) == (216, 37)
    # a CPU: no memory bound; the KV pool's rule (MIN_ROWS at the default 16k tokens), a snapshot a row
    assert hybrid_rows(None, monkeypatch) == (sizing.MIN_ROWS, sizing.MIN_ROWS)
    assert hybrid_rows(None, monkeypatch, kv_tokens=10_000_000) == (sizing.MAX_ROWS, sizing.MAX_ROWS)


def test_snapshots_are_counted_before_the_rows(monkeypatch):
    """More rows never mean fewer snapshots: the snapshots are counted from the free memory first, the rows take
    their share of the rest, and the state pool is allocated with the snapshots counted then."""
    free = int(21.5 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, free))
    rt, config, cuda = qwen35_runtime(), EngineConfig("m"), torch.device("cuda")
    slot = rt.slot_bytes(torch.bfloat16)
    assert rt.row_state_bytes(config, torch.bfloat16, cuda) == (slot, 1)  # its own slot: snapshots are apart
    reserved = rt.reserved_state_bytes(config, torch.bfloat16, cuda)
    assert reserved == 59 * slot == int(free * config.state_snapshot_memory_fraction) // slot * slot
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free // 2, free))  # the rows took memory
    assert rt.num_snapshots(config, torch.bfloat16, cuda, rows=388) == 59  # allocate: the count made first
    # an explicit count: reserved as given, whatever the rows
    explicit = qwen35_runtime()
    assert explicit.reserved_state_bytes(EngineConfig("m", state_snapshots=500), torch.bfloat16, cuda) == 500 * slot
    assert hybrid_rows(free, monkeypatch, state_snapshots=500)[1] == 500
    assert hybrid_rows(free, monkeypatch, state_snapshots=500)[0] < hybrid_rows(free, monkeypatch)[0]
    # a CPU: a snapshot per row, so a row counts two slots and nothing is reserved
    cpu = torch.device("cpu")
    assert rt.row_state_bytes(config, torch.float32, cpu) == (rt.slot_bytes(torch.float32), 2)
    assert qwen35_runtime().reserved_state_bytes(config, torch.float32, cpu) == 0


def test_graphs_never_exceed_the_running_requests():
    assert sizing.graph_max_bs(256, 1024) == 256
    assert sizing.graph_max_bs(256, 8) == 8
    assert sizing.graph_max_bs(256, 256) == 256


# --- the engine resolves it ------------------------------------------------------------------------------------

@pytest.mark.parametrize("auto", [None, 0])
def test_auto_is_resolved_everywhere(auto, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, max_running_requests=auto, kv_cache_tokens=300_000, page_size=4)
    # between the floor (256) and the cap (1024): the pool decides, a row per 512 tokens
    assert llm.config.max_running_requests == 300_000 // 512
    assert llm.engine.config.max_running_requests == llm.engine.scheduler.max_running == 300_000 // 512
    assert llm.engine.runner.req_pool.max_reqs == 300_000 // 512 + 8
    outs = llm.generate(PROMPTS[:4], GREEDY)
    assert_parity(outs, hf_greedy(qwen3_path, PROMPTS[:4], 12), PROMPTS[:4])


def test_explicit_value_wins(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, max_running_requests=5, kv_cache_tokens=300_000)
    assert llm.config.max_running_requests == llm.engine.scheduler.max_running == 5
    assert llm.engine.runner.req_pool.max_reqs == 13


def test_small_memory_budget_gives_fewer_rows(qwen3_path, make_llm, monkeypatch):
    """A device with little memory (the budget a GPU would measure, here pretended on a CPU): the rows' share of
    it bounds them below the floor, and the engine still serves a batch larger than its row count."""
    budget = 256 * 1024  # bytes: an eighth is 32 KiB, 5 rows of a 516-position table (6,192 bytes each)
    real_kv_tokens = ModelRunner._kv_tokens
    monkeypatch.setattr(ModelRunner, "_pool_budget", lambda self: budget)
    # the KV pool on a CPU still comes from kv_cache_tokens: only the rows see the pretended budget
    monkeypatch.setattr(ModelRunner, "_kv_tokens", lambda self, b: real_kv_tokens(self, None))
    llm = make_llm(qwen3_path, page_size=4)
    per_row = sizing.row_bytes(llm.engine.runner.req_pool.max_context_len)
    assert per_row == 12 * (512 + 4)
    assert llm.config.max_running_requests == int(sizing.ROW_MEMORY_SHARE * budget) // per_row == 5
    outs = llm.generate(PROMPTS[:9], GREEDY)
    assert_parity(outs, hf_greedy(qwen3_path, PROMPTS[:9], 12), PROMPTS[:9])


def test_hybrid_rows_follow_the_hybrid_rule(qwen35_path, make_llm, monkeypatch):  # noqa: F811
    llm = make_llm(qwen35_path, page_size=4)  # a CPU: no memory bound; the KV pool's rule gives the floor
    assert llm.config.max_running_requests == sizing.MIN_ROWS == 256
    assert llm.engine.runner.state_pool.num_snapshots == 256  # a snapshot a row on a CPU
    # with a device budget: a row costs its table row and its state slot, and may take half of the budget
    budget = 4 << 20
    monkeypatch.setattr(ModelRunner, "_pool_budget", lambda self: budget)
    real = ModelRunner._kv_tokens
    monkeypatch.setattr(ModelRunner, "_kv_tokens", lambda self, b: real(self, None))
    small = make_llm(qwen35_path, page_size=4)
    pool = small.engine.runner.state_pool
    slot = pool.conv[:, 0].nbytes + pool.recurrent[:, 0].nbytes
    table = 12 * small.engine.runner.req_pool.max_context_len
    # a CPU still keeps a snapshot a row (StatePool.num_snapshots_for), so here a row counts two slots
    rows = small.config.max_running_requests
    assert rows == int(sizing.HYBRID_ROW_MEMORY_SHARE * budget) // (table + 2 * slot) == 156
    assert pool.num_rows == rows + 8 and pool.num_snapshots == rows
    outs = small.generate(SUBSET[:6], GREEDY)
    assert_parity(outs, hf_greedy(qwen35_path, SUBSET[:6], 12), SUBSET[:6])
    # snapshots given: reserved before the rows, which count their own slot only
    given = make_llm(qwen35_path, page_size=4, state_snapshots=64)
    assert given.engine.runner.state_pool.num_snapshots == 64
    assert given.config.max_running_requests == int(0.5 * (budget - 64 * slot)) // (table + slot) == 202
    # an explicit count wins over the rule
    explicit = make_llm(qwen35_path, page_size=4, max_running_requests=300)
    assert explicit.config.max_running_requests == explicit.engine.scheduler.max_running == 300
    assert explicit.engine.runner.state_pool.num_rows == 308


# --- admission and retraction at a large row count ------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_kv_pool_fills_before_the_row_limit(overlap, qwen3_path, make_llm):
    """Rows for all 40 requests, KV for a few: admission stops at the pages, decodes retract, all tokens match."""
    prompts = [PROMPTS[i % len(PROMPTS)] + [3 + i % (VOCAB - 3)] for i in range(40)]
    llm = make_llm(qwen3_path, page_size=4, kv_cache_tokens=400, overlap=overlap)
    assert llm.engine.scheduler.max_running == 256 > len(prompts)
    outs = llm.generate(prompts, GREEDY)
    assert_parity(outs, hf_greedy(qwen3_path, prompts, 12), prompts)
    assert llm.engine.scheduler.num_retractions > 0
    assert_all_pages_back(llm)


# --- decode steps in graph-sized pieces ----------------------------------------------------------------------

def test_piece_bounds():
    assert piece_bounds(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert piece_bounds(6, 3) == [(0, 3), (3, 6)]
    assert piece_bounds(2, 256) == [(0, 2)]


class EagerGraphs:
    """Stands in for CudaGraphRunner on a CPU: the same interface, each 'replay' an eager decode step."""

    def __init__(self, runner, max_bs: int) -> None:
        self.runner, self.max_bs, self.batch_sizes = runner, max_bs, list(range(1, max_bs + 1))
        self.last_run_used_graph = False
        self.sizes_run: list[int] = []
        self.outputs: dict[int, torch.Tensor] = {}

    def can_run(self, batch) -> bool:
        self.last_run_used_graph = batch.is_decode and batch.size <= self.max_bs
        return self.last_run_used_graph

    def run(self, input_ids, positions, meta, sampling, token_dst=None):
        n = meta.batch_size
        assert n <= self.max_bs and input_ids.shape[0] == positions.shape[0] == n
        assert meta.extend_start.tolist() == list(range(n)) and meta.seq_lens_cpu == meta.seq_lens.tolist()
        self.sizes_run.append(n)
        self.runner.attn.prepare(meta)
        logits = self.runner.model(input_ids, positions, self.runner.attn, torch.arange(n))
        # like a replay: the tokens land in one output buffer per size, which the next run of that size rewrites,
        # and the token table is written when the step gives destinations
        out = self.outputs.setdefault(n, torch.empty(n, dtype=torch.int64))
        out.copy_(sample(logits, sampling))
        if token_dst is not None:
            self.runner.store_tokens(token_dst, out)
        return out


@pytest.mark.parametrize("split", [True, False], ids=["pieces", "eager"])
@pytest.mark.parametrize("model", ["qwen3", "qwen3.5"])
def test_large_decode_steps_in_pieces_match(model, split, qwen3_path, qwen35_path, make_llm):  # noqa: F811
    path, prompts = (qwen3_path, PROMPTS[:10]) if model == "qwen3" else (qwen35_path, SUBSET[:10])
    llm = make_llm(path, page_size=4, cuda_graph_split=split)
    graphs = llm.engine.runner.graph_runner = EagerGraphs(llm.engine.runner, max_bs=3)
    # greedy, and sampled rows (per-request seeds: the same tokens in any batch), with and without top-k/top-p
    params = [GREEDY, SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=11),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=12, ignore_eos=True, seed=12)]
    params = [params[i % 3] for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats
    assert stats["max_decode_batch"] == len(prompts) > graphs.max_bs
    if split:
        assert stats["graph_split_steps"] > 0 and max(graphs.sizes_run) == 3
        assert stats["graph_steps"] == stats["decode_steps"]
    else:  # larger steps ran eagerly, past the stand-in
        assert stats["graph_split_steps"] == 0 and stats["graph_steps"] < stats["decode_steps"]
    ref = make_llm(path, page_size=4)  # no graphs at all (a CPU): every step eager and whole
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref.generate(prompts, params)]
    greedy = [i for i in range(len(prompts)) if i % 3 == 0]
    assert_parity([outs[i] for i in greedy], hf_greedy(path, [prompts[i] for i in greedy], 12),
                  [prompts[i] for i in greedy])
    assert_all_pages_back(llm)
