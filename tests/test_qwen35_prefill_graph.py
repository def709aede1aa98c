"""Prefill/extend CUDA graphs of a hybrid model (Qwen3.5) on a CPU: the padded fixed-buffer forward that a graph
replays, run eagerly, checked step by step against the unpadded forward inside real engine runs: the logits and
the linear-attention state it leaves in the pool (conv and recurrent, every slot but the dummy one), over prefill
chunks carried across steps, mixed decode + prefill steps and radix hits restored from snapshots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import PROMPTS, assert_all_pages_back, assert_parity, hf_greedy
from test_qwen35 import GREEDY, SUBSET, qwen35_path  # noqa: F401 (a fixture)

from minisgl import SamplingParams
from minisgl.engine import prefill_graph as pg
from minisgl.engine.hybrid import pad_state_step

# --- shapes and host padding ---------------------------------------------------------------------------------

def test_hybrid_shapes_have_more_tokens_than_requests():
    tokens, reqs = [16, 32, 64], [1, 4, 16]
    # a plain model may pad 10 tokens of 9 requests to (16, 16); a hybrid model may not: the GDN ops would take a
    # 16-token, 16-sequence step for a decode step
    assert pg.extend_shape(tokens, reqs, 10, 9, is_decode=False) == (16, 16)
    assert pg.extend_shape(tokens, reqs, 10, 9, is_decode=False, more_tokens_than_reqs=True) == (32, 16)
    assert pg.extend_shape(tokens, reqs, 10, 3, is_decode=False, more_tokens_than_reqs=True) == (16, 4)
    assert pg.extend_shape(tokens, reqs, 64, 16, is_decode=False, more_tokens_than_reqs=True) == (64, 16)
    assert pg.extend_shape([16], [16], 10, 9, is_decode=False, more_tokens_than_reqs=True) is None


def test_pad_state_step_values():
    slots, cu = np.array([5, 2]), np.array([0, 3, 4])
    p_slots, p_cu = pad_state_step((16, 4), slots, cu, dummy_slot=99)
    assert p_slots.tolist() == [5, 2, 99, 99]  # padded requests: the dummy slot
    assert p_cu.tolist() == [0, 3, 4, 4, 4]  # empty, after the real tokens: tokens 4..15 belong to no sequence
    assert pad_state_step((16, 2), slots, cu, 99)[1].tolist() == [0, 3, 4]
    with pytest.raises(ValueError, match="do not fit"):
        pad_state_step((16, 1), slots, cu, 99)


def test_runner_shapes_and_buffers(qwen35_path, make_llm):  # noqa: F811
    llm = make_llm(qwen35_path, dtype="float32")
    runner = llm.engine.runner
    graphs = pg.PrefillGraphRunner(runner, 64, 16, capture=False)
    assert (16, 16) not in graphs.shapes and (32, 16) in graphs.shapes and (16, 4) in graphs.shapes
    meta = graphs.metas[32, 4]
    assert meta.state_slots.shape == (4,) and meta.cu_seqlens.shape == (5,)
    assert meta.state_slots.data_ptr() == graphs.inputs.state_slots.data_ptr()  # views of the fixed buffers
    assert (graphs.inputs.state_slots == runner.state_pool.dummy_slot).all()


# --- the padded forward against the eager one, inside real engine runs ------------------------------------

def spy_compare_hybrid(llm, seen: list) -> None:
    """Before each step the graphs serve, run it both ways from the same starting state (eager unpadded, then
    padded fixed-buffer) and record the logits and the state pool each leaves; then restore the pool and let the
    step itself run through the graph path (ModelRunner._forward: state start, padded forward, snapshots)."""
    runner = llm.engine.runner
    pool = runner.state_pool
    forward = runner.forward

    def run_from(before, fn):
        pool.conv.copy_(before[0])
        pool.recurrent.copy_(before[1])
        pool.start(fn.inits)
        logits = fn()
        return logits.clone(), pool.conv.clone(), pool.recurrent.clone()

    @torch.inference_mode()
    def spy(batch):
        shape = runner.prefill_graph.shape_for(batch)
        if shape is not None:
            runner.req_pool.flush()
            before = (pool.conv.clone(), pool.recurrent.clone())

            def eager():
                ids, pos, meta, logit_idx, *_ = runner.prepare(batch)
                runner.attn.prepare(meta)
                return runner.model(ids, pos, runner.attn, logit_idx)

            def padded():
                ids, pos, meta, logit_idx, *_ = runner.prepare(batch, pad_to=shape)
                assert ids.shape[0] == shape[0] and meta.batch_size == shape[1]
                assert meta.state_slots.shape[0] == shape[1] and meta.cu_seqlens.shape[0] == shape[1] + 1
                return runner.prefill_graph.run(shape, ids, pos, meta, logit_idx, len(batch.sample_rows))

            eager.inits = padded.inits = batch.state_inits
            e_logits, e_conv, e_rec = run_from(before, eager)
            p_logits, p_conv, p_rec = run_from(before, padded)
            pool.conv.copy_(before[0])
            pool.recurrent.copy_(before[1])
            seen.append(dict(shape=shape, tokens=batch.num_tokens, reqs=batch.size, rows=[r.row for r in batch.reqs],
                             mixed=1 in batch.extend_lens and max(batch.extend_lens) > 1,
                             continued=any(p > 0 and n > 1 for p, n in zip(batch.prefix_lens, batch.extend_lens)),
                             eager=(e_logits, e_conv, e_rec), padded=(p_logits, p_conv, p_rec),
                             changed=not torch.equal(e_rec, before[1])))
        return forward(batch)

    runner.forward = spy


SWITCHES = {
    "page4-chunk7": dict(page_size=4, chunked_prefill_size=7),  # chunks across steps, mixed into decode steps
    "page1-chunk5-no-overlap": dict(page_size=1, chunked_prefill_size=5, overlap=False),
    "page16-max5": dict(page_size=16, max_running_requests=5),
    "no-chunked-max3-page4": dict(chunked_prefill_size=0, max_running_requests=3, page_size=4),
}


@pytest.mark.parametrize("switches", SWITCHES.values(), ids=SWITCHES.keys())
def test_padded_forward_matches_eager_state_and_hf(switches, qwen35_path, make_llm):  # noqa: F811
    llm = make_llm(qwen35_path, dtype="float32", **switches)
    runner = llm.engine.runner
    graphs = pg.PrefillGraphRunner(runner, 128, 8, capture=False)
    runner.prefill_graph = graphs
    seen: list = []
    spy_compare_hybrid(llm, seen)
    prompts = SUBSET
    refs = hf_greedy(qwen35_path, prompts)
    for _ in range(2):  # the second pass starts requests from prefix snapshots (radix hits)
        outs = llm.generate(prompts, GREEDY)
        assert_parity(outs, refs, prompts)  # tokens through the padded path == HF
        assert_all_pages_back(llm)
    assert sum(o.num_cached_prompt_tokens for o in outs) > 0
    assert seen and graphs.replays == 2 * len(seen)  # the spy's padded run, then the step itself
    dummy = runner.state_pool.dummy_slot
    for s in seen:
        assert s["tokens"] < s["shape"][0] or s["tokens"] == s["shape"][0] > s["shape"][1]
        e_logits, e_conv, e_rec = s["eager"]
        p_logits, p_conv, p_rec = s["padded"]
        torch.testing.assert_close(p_logits, e_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(p_logits.argmax(-1), e_logits.argmax(-1))
        # every slot but the dummy one: the real requests' new states, everyone else's left alone
        torch.testing.assert_close(p_conv[:, :dummy], e_conv[:, :dummy], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(p_rec[:, :dummy], e_rec[:, :dummy], rtol=1e-4, atol=1e-5)
    assert all(s["changed"] for s in seen)  # each compared step really moved some state
    assert any(s["shape"][0] > s["tokens"] for s in seen)  # token padding was exercised
    assert any(s["shape"][1] > s["reqs"] for s in seen)  # request padding too
    if switches.get("chunked_prefill_size", 1) > 0:
        assert any(s["continued"] for s in seen)  # a prefill chunk resumed from the state of an earlier step
    if switches.get("chunked_prefill_size") == 7:
        assert any(s["mixed"] for s in seen)


def test_padded_tokens_come_out_zero():
    """Tokens of no sequence (a prefill graph's padding) get 0 from the reference ops, never uninitialised memory:
    their K/V land in slot 0, which a padded decode step of the torch backend reads (masked, but 0 * NaN is NaN).
    With `empty_like` there, page16-max5 above decoded token 0 in about one run of three."""
    from minisgl.kernels.gdn_ref import causal_conv1d_ref, gated_delta_rule_ref

    torch.manual_seed(0)
    t, c, k, h, d = 8, 6, 4, 2, 4
    slots, cu = torch.tensor([0, 2]), torch.tensor([0, 3, 3])  # 3 real tokens, an empty padded sequence
    for _ in range(3):  # fresh allocations: garbage, if any, would show in one of them
        conv = causal_conv1d_ref(torch.randn(t, c), torch.randn(c, k), None, torch.zeros(3, c, k - 1), slots, cu)
        o = gated_delta_rule_ref(torch.randn(t, h, d), torch.randn(t, h, d), torch.randn(t, h, d),
                                 -torch.rand(t, h), torch.rand(t, h), torch.zeros(3, h, d, d), slots, cu)
        assert torch.equal(conv[3:], torch.zeros(t - 3, c)) and torch.equal(o[3:], torch.zeros(t - 3, h, d))


def test_padding_writes_only_the_dummy_slot(qwen35_path, make_llm):  # noqa: F811
    """One padded step by hand: the padded requests and tokens change no slot but the dummy one."""
    llm = make_llm(qwen35_path, dtype="float32", page_size=4)
    runner = llm.engine.runner
    pool = runner.state_pool
    graphs = pg.PrefillGraphRunner(runner, 64, 4, capture=False)
    runner.prefill_graph = graphs
    pool.conv.normal_()
    pool.recurrent.normal_()
    before = (pool.conv.clone(), pool.recurrent.clone())
    seen: list = []
    spy_compare_hybrid(llm, seen)
    llm.generate([PROMPTS[3], PROMPTS[7]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    step = seen[0]  # both prompts up to their last page boundary: 16 + 8 tokens
    assert step["shape"] == (32, 4) and step["tokens"] == 24 and step["reqs"] == 2
    _, p_conv, p_rec = step["padded"]
    rows = step["rows"]  # the requests' slots: zeroed by start, then written
    others = [s for s in range(pool.dummy_slot) if s not in rows]
    assert torch.equal(p_conv[:, others], before[0][:, others])
    assert torch.equal(p_rec[:, others], before[1][:, others])
    for row in rows:
        assert not torch.equal(p_rec[:, row], before[1][:, row])
