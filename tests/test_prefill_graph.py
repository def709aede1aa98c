"""Prefill/extend CUDA graphs (minisgl/engine/prefill_graph.py) on a CPU: bucketing, host padding, and the
padded fixed-buffer forward that a graph replays, run eagerly here and checked against the unpadded forward
on the batches the scheduler really builds (prefill chunks, mixed decode + prefill steps, pending tokens)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from helpers import MAX_NEW, PROMPTS, assert_all_pages_back, assert_parity, hf_greedy

from minisgl import SamplingParams
from minisgl.config import EngineConfig
from minisgl.engine import prefill_graph as pg
from minisgl.kernels.options import use_options

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


# --- buckets and shapes -------------------------------------------------------------------------------------

def test_default_buckets():
    assert pg.default_token_buckets(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert pg.default_token_buckets(100) == [16, 32, 64, 100]
    assert pg.default_token_buckets(0) == []
    assert pg.default_request_buckets(16) == [1, 4, 16]
    assert pg.default_request_buckets(8) == [1, 4, 8]
    assert pg.default_request_buckets(1) == [1]


def test_pick_bucket_and_shape():
    tokens, reqs = [16, 32, 64], [1, 4]
    assert pg.pick_bucket(tokens, 1) == 16 and pg.pick_bucket(tokens, 16) == 16 and pg.pick_bucket(tokens, 17) == 32
    assert pg.pick_bucket(tokens, 65) is None
    assert pg.extend_shape(tokens, reqs, 7, 1, is_decode=False) == (16, 1)
    assert pg.extend_shape(tokens, reqs, 40, 3, is_decode=False) == (64, 4)
    assert pg.extend_shape(tokens, reqs, 3, 3, is_decode=True) is None  # the decode graphs' job
    assert pg.extend_shape(tokens, reqs, 65, 1, is_decode=False) is None  # too many tokens: eager
    assert pg.extend_shape(tokens, reqs, 20, 5, is_decode=False) is None  # too many requests: eager


def test_pad_extend_step_values():
    # two requests: 3 new tokens after a prefix of 5, then one decode token after a prefix of 9
    ids, pos, loc = np.array([7, 8, 9, 4]), np.array([5, 6, 7, 9]), np.array([11, 12, 13, 20])
    rows, prefix, extend = np.array([2, 5]), np.array([5, 9]), np.array([3, 1])
    start, logit_idx = np.array([0, 3]), np.array([3])
    out = pg.pad_extend_step((16, 4), ids, pos, loc, rows, prefix, extend, start, logit_idx)
    p_ids, p_pos, p_loc, p_rows, p_prefix, p_extend, p_start, p_logit = out
    assert [len(a) for a in out] == [16, 16, 16, 4, 4, 4, 4, 4]
    assert all(a.dtype == np.int64 for a in out)
    assert p_ids.tolist() == [7, 8, 9, 4] + [0] * 12
    assert p_pos.tolist() == [5, 6, 7, 9] + [0] * 12
    assert p_loc.tolist() == [11, 12, 13, 20] + [0] * 12  # padded tokens write K/V to the reserved slot 0
    assert p_rows.tolist() == [2, 5, 0, 0]
    assert (p_prefix + p_extend).tolist() == [8, 10, 0, 0]  # padded requests: empty context
    assert p_extend.tolist() == [3, 1, 0, 0]
    assert p_start.tolist() == [0, 3, 16, 16]
    assert p_logit.tolist() == [3, 0, 0, 0]
    with pytest.raises(ValueError, match="does not fit"):
        pg.pad_extend_step((2, 4), ids, pos, loc, rows, prefix, extend, start, logit_idx)


def test_config_knobs():
    cfg = EngineConfig(model="x")
    assert cfg.prefill_graph_max_tokens == 8704 and cfg.prefill_graph_max_reqs == 512
    EngineConfig(model="x", prefill_graph_max_tokens=0).validate()  # 0 = off is valid
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(model="x", prefill_graph_max_tokens=-1).validate()
    with pytest.raises(ValueError, match="prefill_graph_max_reqs"):
        EngineConfig(model="x", prefill_graph_max_reqs=0).validate()


# --- the padded forward against the eager one, inside real engine runs ------------------------------------

def attach_graph_shaped_runner(llm, max_tokens: int, max_reqs: int, **kw) -> pg.PrefillGraphRunner:
    """Give a CPU engine prefill 'graphs' that run their padded fixed-buffer forward eagerly."""
    runner = llm.engine.runner
    assert runner.prefill_graph is None  # no CUDA here: the engine made none itself
    graphs = pg.PrefillGraphRunner(runner, max_tokens, max_reqs, capture=False, **kw)
    runner.prefill_graph = graphs
    return graphs


def spy_compare(llm, seen: list) -> None:
    """Before each step the graphs serve, compute its logits both ways (eager unpadded, padded fixed-buffer)
    and record them; the step itself then runs through the graph path. Writing a step's K/V twice is
    harmless: both ways write the same values to the same slots (padding only to slot 0)."""
    runner = llm.engine.runner
    forward = runner.forward

    @torch.inference_mode()
    def spy(batch):
        shape = runner.prefill_graph.shape_for(batch)
        if shape is not None:
            with use_options(runner.config.kernels):  # as the runner's own forward runs
                compare(batch, shape)
        return forward(batch)

    def compare(batch, shape):
        if shape is not None:
            runner.req_pool.flush()
            ids, pos, meta, logit_idx, *_ = runner.prepare(batch)
            runner.attn.prepare(meta)
            eager = runner.model(ids, pos, runner.attn, logit_idx)
            ids, pos, meta, logit_idx, *_ = runner.prepare(batch, pad_to=shape)
            assert ids.shape[0] == shape[0] and meta.batch_size == shape[1]
            padded = runner.prefill_graph.run(shape, ids, pos, meta, logit_idx, len(batch.sample_rows)).clone()
            mixed = 1 in batch.extend_lens and max(batch.extend_lens) > 1
            seen.append((shape, batch.num_tokens, batch.size, mixed, eager, padded))

    runner.forward = spy


SWITCHES = {
    "chunk7": dict(chunked_prefill_size=7),  # chunks mixed into decode steps
    "chunk7-page4": dict(chunked_prefill_size=7, page_size=4),
    "no-overlap-page16-max5": dict(overlap=False, page_size=16, max_running_requests=5),
    "no-chunked-max3": dict(chunked_prefill_size=0, max_running_requests=3),
}


@pytest.mark.parametrize("switches", list(SWITCHES.values()), ids=list(SWITCHES))
def test_padded_forward_matches_eager_and_hf(switches, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, dtype="float32", **switches)
    graphs = attach_graph_shaped_runner(llm, max_tokens=256, max_reqs=8)
    seen: list = []
    spy_compare(llm, seen)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_parity(outs, hf_greedy(qwen3_path, PROMPTS), PROMPTS)  # tokens through the padded path == HF
    assert_all_pages_back(llm)
    assert seen and graphs.replays == 2 * len(seen)  # the spy's comparison run, then the step itself
    for shape, n_tok, n_req, _, eager, padded in seen:
        assert n_tok <= shape[0] and n_req <= shape[1]
        assert padded.shape == eager.shape
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    if switches.get("chunked_prefill_size") == 7:
        assert any(mixed for _, _, _, mixed, _, _ in seen)  # decodes + a prefill chunk in one graph step
    assert any(shape[0] > n_tok for shape, n_tok, *_ in seen)  # token padding was exercised
    assert any(shape[1] > n_req for shape, _, n_req, *_ in seen)  # request padding too


@pytest.fixture
def interpreted():
    pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")
    from helpers import use_triton_interpreter
    use_triton_interpreter("minisgl.kernels.elementwise", "minisgl.kernels.attention",
                           "minisgl.attention.triton_backend")


def test_padded_forward_on_the_triton_backend_reads_the_extend_tile_list(interpreted, qwen3_path, make_llm):
    """The Triton backend (through the interpreter) with the kernel option extend_tiles: the padded fixed-buffer
    forward reads the fixed tile list and decode-row lengths, which each step's host lengths refill before the run
    (a mixed step's decode rows through the decode kernel, the rest from the list); its logits equal the eager
    forward's (which makes its own list) and its tokens HF's, mixed steps included."""
    llm = make_llm(qwen3_path, dtype="float32", attention_backend="triton", triton_on_cpu=True, extend_tiles=True,
                   chunked_prefill_size=7)
    attn = llm.engine.runner.attn
    attn.init_cuda_graph_state(max_bs=8)  # the decode graphs' fixed workspace, which a GPU engine has by now
    with use_options(llm.config.kernels):  # as the engine builds its graphs: under its kernel options
        graphs = attach_graph_shaped_runner(llm, max_tokens=64, max_reqs=8)
    assert attn._graph_tiles is not None
    listed, graph_decodes = [], []
    extend, decode_rows = attn.forward, attn._mixed_decode_rows

    def forward_seeing_tiles(*args):
        listed.append(attn._tiles is not None and attn._tiles.data_ptr() == attn._graph_tiles.data_ptr())
        return extend(*args)

    def decode_rows_seen(n, *args, seq_lens=None):
        if seq_lens is not None:  # a graph's device split: every request row, the decode rows' lengths
            graph_decodes.append((n, int((seq_lens > 0).sum())))
        return decode_rows(n, *args, seq_lens=seq_lens)

    attn.forward, attn._mixed_decode_rows = forward_seeing_tiles, decode_rows_seen
    seen: list = []
    spy_compare(llm, seen)
    prompts = PROMPTS[:2]
    assert_parity(llm.generate(prompts, GREEDY), hf_greedy(qwen3_path, prompts), prompts)
    assert_all_pages_back(llm)
    assert seen and graphs.replays == 2 * len(seen) and any(listed)  # the graphs' layers read the fixed list
    assert any(mixed for *_, mixed, _, _ in seen)
    # the mixed steps' decode rows took the decode kernel inside the graph path; the other steps' none
    assert any(rows > 0 for _, rows in graph_decodes) and all(rows <= n for n, rows in graph_decodes)
    for _, _, _, _, eager, padded in seen:
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)


def test_steps_too_large_run_eagerly(qwen3_path, make_llm):
    """Steps beyond the largest buckets take the eager path and still give HF's tokens."""
    llm = make_llm(qwen3_path, dtype="float32", chunked_prefill_size=0)
    graphs = attach_graph_shaped_runner(llm, max_tokens=16, max_reqs=1)
    outs = llm.generate(PROMPTS, GREEDY)
    assert_parity(outs, hf_greedy(qwen3_path, PROMPTS), PROMPTS)
    assert graphs.replays == 0  # the first step holds every prompt: more requests and tokens than the buckets
    assert graphs.shape_for(type("B", (), dict(num_tokens=17, size=1, is_decode=False))()) is None


def test_run_rejects_unpadded_tensors(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, dtype="float32")
    graphs = attach_graph_shaped_runner(llm, max_tokens=32, max_reqs=4)
    meta_like = type("M", (), dict(batch_size=4))()
    with pytest.raises(ValueError, match="not padded"):
        graphs.run((32, 4), torch.zeros(7, dtype=torch.int64), torch.zeros(7), meta_like,
                   torch.zeros(4, dtype=torch.int64), 1)


def test_capture_failure_falls_back_to_eager(qwen3_path, make_llm, monkeypatch, caplog):
    llm = make_llm(qwen3_path, dtype="float32")

    def broken(self, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(pg.PrefillGraphRunner, "_capture_all", broken)
    with caplog.at_level(logging.WARNING, logger=pg.__name__):
        assert pg.build_prefill_graphs(llm.engine.runner, 64, 4, capture=True) is None
    assert "prefill CUDA graphs disabled" in caplog.text
    outs = llm.generate(PROMPTS[:3], GREEDY)  # the engine keeps serving, eagerly
    assert_parity(outs, hf_greedy(qwen3_path, PROMPTS[:3]), PROMPTS[:3])


def test_graph_pool_of_decode_runner():
    class FakeGraph:
        def pool(self):
            return (0, 7)

    assert pg.graph_pool_of(type("R", (), {"graphs": {8: FakeGraph(), 1: FakeGraph()}})()) == (0, 7)
    assert pg.graph_pool_of(type("R", (), {"graphs": {}})()) is None  # no decode graph: a pool of our own
    assert pg.graph_pool_of(None) is None


def test_gpu_check_script_smoke_on_cpu(tmp_path):
    """lab/checks/prefill_graphs.py end to end on a CPU (uncaptured twin, small model, tiny W2)."""
    import json

    from helpers import TINY_QWEN3_ASSET

    from lab.checks import prefill_graphs as script
    cases = {"1x7": ([7], {}), "decode+prefill": ([3, 4, 70], {"chunked_prefill_size": 32})}
    res = script.main(str(tmp_path), model=TINY_QWEN3_ASSET, cases=cases, w2=True, w2_scale=0.02)
    assert res["ok"] and not res["errors"]
    assert any(s["mixed"] for s in res["cases"]["decode+prefill"]["steps"])
    assert all(n > 0 for n in res["w2"]["on"]["prefill_graph_steps"])
    assert res["w2"]["off"]["prefill_graph_steps"] == [0, 0, 0]
    assert json.loads((tmp_path / "prefill_check.json").read_text())["ok"] is True
    # switches for every engine (a kernel option under test) reach each case's engine, beside its own
    res = script.main(str(tmp_path), model=TINY_QWEN3_ASSET, cases={"1x7": ([7], {})}, w2=False,
                      every_engine={"extend_tiles": True})
    assert res["ok"] and [json.loads(key) for key in res["engines"]] == [{"extend_tiles": True}]


def test_build_caps_requests_at_max_running(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, dtype="float32", max_running_requests=3)
    graphs = pg.build_prefill_graphs(llm.engine.runner, 64, 16, capture=False)
    assert graphs.token_buckets == [16, 32, 64] and graphs.request_buckets == [1, 3]
    assert graphs.shapes == [(16, 1), (16, 3), (32, 1), (32, 3), (64, 1), (64, 3)] and not graphs.graphs


def test_processed_steps_through_the_padded_forward(qwen3_path, make_llm):
    """Penalties and logprobs on steps the prefill graphs serve: the processing reads the graph's shared logits
    buffer (its first rows), and the tokens and logprobs equal the eager engine's."""
    from minisgl import SamplingParams

    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10, ignore_eos=True,
                             repetition_penalty=1.3 if i % 3 else 1.0, logprobs=2 if i % 2 else None)
              for i in range(len(PROMPTS))]
    eager = make_llm(qwen3_path, dtype="float32", chunked_prefill_size=7).generate(PROMPTS, params)
    llm = make_llm(qwen3_path, dtype="float32", chunked_prefill_size=7)
    graphs = attach_graph_shaped_runner(llm, max_tokens=256, max_reqs=8)
    outs = llm.generate(PROMPTS, params)
    assert graphs.replays > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    for o, e in zip(outs, eager):
        if e.logprobs is not None:
            assert all(abs(a - b) < 1e-4 for (a, _), (b, _) in zip(o.logprobs, e.logprobs))
    assert_all_pages_back(llm)
