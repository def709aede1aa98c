"""The decode graph runner (engine/cuda_graph.py) on a CPU, through the whole engine.

A CPU has no CUDA graphs, so `ReplayGraph` stands in for one (as in notebook 06): "capture" calls the step once
and keeps its output tensor, `replay()` calls it again on the captured views of the static buffers and writes
the result into that same tensor. Everything else is the runner's own code: the static buffers, padding, the
sampler chosen per batch, and the step a graph records (forward, sampler, token-table write). The checks:
a decode step is one replay of one graph; the tokens equal the eager engine's for greedy and seeded sampling
of every kind, with and without overlap, alone or in a batch; the graph writes each row's token into the
token table and padded rows touch only the spare cell.
"""

from __future__ import annotations

import pytest
import torch

from minisgl import SamplingParams
from minisgl.engine.cuda_graph import SAMPLERS, CudaGraphRunner
from minisgl.engine.staged_graph import StagedCudaGraphRunner
from tests.helpers import (
    VOCAB,
    assert_all_pages_back,
    capture_replay_graphs,
    capture_staged_replay_graphs,
    graph_runner_view,
)

PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 10) + 5 for j in range(n)] for i, n in enumerate([5, 17, 9, 30, 2, 12, 8, 21])]
SETTINGS = [dict(temperature=0.0), dict(temperature=0.9), dict(temperature=1.2, top_k=20, top_p=0.9),
            dict(temperature=1.0, min_p=0.05), dict(temperature=1.5, top_p=0.8), dict(temperature=0.0),
            dict(temperature=0.7, top_k=5), dict(temperature=2.0)]


class CpuGraphs(CudaGraphRunner):
    """The real runner with ReplayGraph stand-ins for the capture: one per (batch size, sampler), like the GPU's."""

    _capture_all = capture_replay_graphs


class CpuStagedGraphs(StagedCudaGraphRunner):
    """The staged runner (engine switch graph_staged_inputs, on by default) with the same stand-ins: its fixed
    buffers become the block's rows first, as on a GPU."""

    _capture_all = capture_staged_replay_graphs


@pytest.fixture(params=[CpuGraphs, CpuStagedGraphs], ids=["copies", "staged"])
def graph_cls(request):
    return request.param


def with_cpu_graphs(llm, cls, max_bs=8, batch_sizes=None):
    """Give the LLM's model runner CPU replay graphs of class `cls`; returns the graph runner."""
    r = llm.engine.runner
    r.graph_runner = cls(graph_runner_view(r), max_bs, batch_sizes)
    return r.graph_runner


def params(i, max_tokens=12):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=100 + i, **SETTINGS[i % len(SETTINGS)])


def test_one_graph_per_size_and_sampler(qwen3_path, make_llm, graph_cls):
    graphs = with_cpu_graphs(make_llm(qwen3_path), graph_cls, max_bs=8)
    assert set(graphs.graphs) == {(bs, s) for bs in (1, 2, 4, 8) for s in SAMPLERS}


def test_graph_tokens_equal_eager_and_one_replay_per_step(qwen3_path, make_llm, graph_cls):
    all_params = [params(i) for i in range(len(PROMPTS))]
    eager = [o.token_ids for o in make_llm(qwen3_path).generate(PROMPTS, all_params)]
    for switches in ({}, dict(overlap=False)):
        llm = make_llm(qwen3_path, **switches)
        graphs = with_cpu_graphs(llm, graph_cls, max_bs=8, batch_sizes=[1, 2, 4, 8])
        out = [o.token_ids for o in llm.generate(PROMPTS, all_params)]
        assert out == eager, switches
        stats = llm.engine.stats
        replays = sum(g.replays for g in graphs.graphs.values())
        assert stats["graph_steps"] > 0 and replays == stats["graph_steps"], "a decode step is one replay"
        for i in (2, 3, 5):  # alone, through the batch-1 graphs: what it drew in the batch
            assert llm.generate([PROMPTS[i]], all_params[i])[0].token_ids == eager[i], (switches, i)
        assert_all_pages_back(llm)


@torch.inference_mode()
def test_graph_writes_tokens_to_the_table_and_padding_to_the_spare_cell(qwen3_path, make_llm, graph_cls):
    llm = make_llm(qwen3_path)
    runner = llm.engine.runner
    graphs = with_cpu_graphs(llm, graph_cls, max_bs=4, batch_sizes=[4])
    reqs = [llm.engine.add_request(p, params(i)) for i, p in enumerate(PROMPTS[:3])]
    while not all(len(r.output_ids) >= 2 for r in reqs):  # prefill (eager), then a decode step or two
        llm.engine.step()
    batch = llm.engine.scheduler.schedule()
    assert batch.is_decode and batch.size == 3
    width = runner.req_pool.max_context_len
    graphs.token_dst[3] = batch.reqs[0].row * width  # a stale destination from an earlier, larger batch
    before = runner.req_pool.token_ids.clone()
    out = runner.forward(batch)
    tokens = out.wait()
    after = runner.req_pool.token_ids
    changed = (before != after).view(-1).nonzero().view(-1).tolist()
    dst = [r.row * width + p + 1 for r, p in zip(batch.reqs, batch.prefix_lens)]
    assert [after.view(-1)[d].item() for d in dst] == tokens, "each row's token lands at (row, next position)"
    assert set(changed) <= set(dst) | {graphs.spare_cell}, "the padded row writes the spare cell only"
    assert graphs.spare_cell // width == runner.req_pool.max_reqs - 1 and graphs.spare_cell % width >= \
        runner.max_model_len, "the spare cell lies past every position a request can reach"
    # the step's tokens reach the host; let the engine resolve the step and finish
    for token, row in zip(tokens, batch.sample_rows):
        req = batch.reqs[row]
        req.num_pending -= 1
        req.output_ids.append(token)
    llm.engine.run(reqs)


def test_processed_steps_replay_the_logits_graph(qwen3_path, make_llm, graph_cls):
    """Steps with penalties or logprobs replay the forward-only "logits" graph and process and sample its logits:
    the same tokens and logprobs as the eager engine, in either loop."""
    all_params = [SamplingParams(max_tokens=12, ignore_eos=True, seed=100 + i, **SETTINGS[i % len(SETTINGS)],
                                 repetition_penalty=1.3 if i % 2 else 1.0, logprobs=2 if i % 3 == 0 else None,
                                 frequency_penalty=0.5 if i % 4 == 1 else 0.0) for i in range(len(PROMPTS))]
    eager = make_llm(qwen3_path).generate(PROMPTS, all_params)
    for switches in ({}, dict(overlap=False)):
        llm = make_llm(qwen3_path, **switches)
        graphs = with_cpu_graphs(llm, graph_cls, max_bs=8, batch_sizes=[1, 2, 4, 8])
        out = llm.generate(PROMPTS, all_params)
        assert [o.token_ids for o in out] == [o.token_ids for o in eager], switches
        for o, e in zip(out, eager):
            assert (o.logprobs is None) == (e.logprobs is None)
            if o.logprobs is not None:
                assert [t for _, t in o.logprobs] == [t for _, t in e.logprobs]
        assert sum(g.replays for (bs, s), g in graphs.graphs.items() if s == "logits") > 0
        assert_all_pages_back(llm)


def test_one_token_prefill_chunks_beside_decodes_run_eagerly(qwen3_path, make_llm, graph_cls):
    """A step whose every row extends by one token is not always a decode step: with a small mixed prefill budget
    a prompt advances one token per step beside the decoders, and that chunk samples nothing. The graphs sample
    and write a token for every row, so such a step must run eagerly. Before, it replayed a graph: with one
    sampling row its token destination was broadcast to both rows, the chunk's garbage token overwrote the
    decoder's input in the token table (wrong tokens from then on); with two it raised. Found by
    tests/fuzz_engine.py."""
    from helpers import hf_greedy

    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]  # 1, 2 and 17 tokens (tests/helpers.py's PROMPTS)
    sampling_rows = set()  # in steps of 1-token extends where some row samples nothing
    for switches in (dict(chunked_prefill_size=8, mixed_prefill_tokens=1), dict(chunked_prefill_size=1)):
        llm = make_llm(qwen3_path, dtype="float32", max_running_requests=4, **switches)
        graphs = with_cpu_graphs(llm, graph_cls, max_bs=4, batch_sizes=[1, 2, 4])
        engine, steps = llm.engine, []
        forward = engine.runner.forward
        engine.runner.forward = lambda batch, steps=steps, forward=forward: steps.append(batch) or forward(batch)
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        reqs = [engine.add_request(p, params) for p in prompts[:2]]
        engine.step()  # the short prompts first, then the long one arrives while they decode
        reqs.append(engine.add_request(prompts[2], params))
        engine.run(reqs)
        assert [r.output_ids for r in reqs] == hf_greedy(qwen3_path, prompts, 8), switches
        odd = [len(b.sample_rows) for b in steps if b.is_decode and len(b.sample_rows) < b.size]
        assert odd, switches
        sampling_rows |= set(odd)
        assert sum(g.replays for g in graphs.graphs.values()) == engine.stats["graph_steps"] > 0
        assert_all_pages_back(llm)
    assert {1, 2} <= sampling_rows  # one sampling row (the broadcast) and two (the error) were both exercised


def test_staged_steps_take_the_block_and_fall_back_for_other_writes(qwen3_path, make_llm):
    """A staged decode step (engine switch graph_staged_inputs) writes its table slots from the block; a step with
    more slot writes than the block holds, or with token ids to write (a prompt's), uploads them first as every
    other step does. Every decode step is one replay of a staged run either way, with the eager engine's tokens."""
    all_params = [params(i) for i in range(len(PROMPTS))]
    eager = [o.token_ids for o in make_llm(qwen3_path).generate(PROMPTS, all_params)]
    for capacity in (None, 0):
        llm = make_llm(qwen3_path)
        graphs = with_cpu_graphs(llm, CpuStagedGraphs, max_bs=8, batch_sizes=[1, 2, 4, 8])
        if capacity is not None:
            graphs.write_capacity = capacity
        staged = []

        def counted(arrays, writes, table, staged=staged, run_staged=graphs.run_staged):
            staged.append(writes)
            return run_staged(arrays, writes, table)

        graphs.run_staged = counted
        assert [o.token_ids for o in llm.generate(PROMPTS, all_params)] == eager, capacity
        assert len(staged) == llm.engine.stats["graph_steps"] > 0, "every graph step went through run_staged"
        assert sum(g.replays for g in graphs.graphs.values()) == len(staged)
        if capacity is None:
            assert all(w is not None and w.shape[1] > 0 for w in staged), "decode steps' slots travel in the block"
        else:
            assert all(w is None for w in staged), "over the capacity: the usual upload"
        assert_all_pages_back(llm)
    # token ids queued for a row the step does not run (as a prompt's would be) reach the table before the replay
    llm = make_llm(qwen3_path)
    graphs = with_cpu_graphs(llm, CpuStagedGraphs, max_bs=4, batch_sizes=[1, 2, 4])
    runner = llm.engine.runner
    req = llm.engine.add_request(PROMPTS[1], params(0))
    while len(req.output_ids) < 2:
        llm.engine.step()
    row = runner.req_pool.alloc()
    runner.req_pool.write_tokens(row, 3, [11, 12, 13])
    batch = llm.engine.scheduler.schedule()
    assert batch.is_decode and batch.size == 1
    token = runner.forward(batch).wait()
    assert runner.req_pool.token_ids[row, 3:6].tolist() == [11, 12, 13] and graphs.last_run_used_graph
    runner.req_pool.free(row)
    batch.reqs[0].num_pending -= 1
    batch.reqs[0].output_ids.extend(token)
    llm.engine.run([req])
    assert_all_pages_back(llm)

