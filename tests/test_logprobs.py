"""Logprobs (SamplingParams.logprobs): every output token's log-probability and the top-N, equal to the
log-softmax of Hugging Face's logits at that position (fp32, within 1e-4), greedy and sampled; temperature is
not applied (the logits the sampler draws from, before temperature and the cuts), the penalties are."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from minisgl import SamplingParams
from tests.helpers import PROMPTS, assert_all_pages_back, hf_model

TOL = 1e-4


def _hf_logprobs(path, prompt, outputs, repetition=None):
    """log_softmax of HF's logits for each output position (one forward over prompt + outputs)."""
    ids = torch.tensor([list(prompt) + list(outputs)])
    with torch.no_grad():
        logits = hf_model(path)(ids).logits[0, len(prompt) - 1:-1].float()
    if repetition is not None:
        proc = RepetitionPenaltyLogitsProcessor(repetition)
        logits = torch.stack([proc(ids[:, :len(prompt) + j], logits[j:j + 1])[0] for j in range(len(outputs))])
    return torch.log_softmax(logits, dim=-1)


def _check(path, out, top_n, repetition=None):
    ref = _hf_logprobs(path, out.prompt_token_ids, out.token_ids, repetition)
    assert len(out.logprobs) == len(out.token_ids)
    for j, (tok, (lp, top)) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp - ref[j, tok].item()) < TOL, (j, lp, ref[j, tok].item())
        assert len(top) == top_n
        ids = [t for t, _ in top]
        vals, ref_ids = ref[j].topk(top_n)
        assert ids == ref_ids.tolist(), (j, ids, ref_ids.tolist())
        assert all(abs(v - r) < TOL for (_, v), r in zip(top, vals.tolist()))


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.7, seed=3),
                                      dict(temperature=1.3, seed=4, top_k=30, top_p=0.9)])
def test_logprobs_equal_hf_log_softmax(qwen3_path, make_llm, settings):
    llm = make_llm(qwen3_path)
    prompts = PROMPTS[:5]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=5, **settings))
    for o in outs:
        _check(qwen3_path, o, 5)
        if settings["temperature"] == 0:
            assert all(t == top[0][0] for t, (_, top) in zip(o.token_ids, o.logprobs)), "greedy takes the top token"
    # logprobs change nothing about the tokens
    plain = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **settings))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_logprobs_after_penalties(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                                                    repetition_penalty=1.4))
    for o in outs:
        _check(qwen3_path, o, 3, repetition=1.4)


def test_logprobs_zero_and_mixed_batches(qwen3_path, make_llm):
    """logprobs=0 gives the sampled token's only; requests without logprobs get None, in the same batches, and
    every switch (overlap off, retraction, chunked prefill) hands the same values."""
    prompts = PROMPTS[:10]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i,
                             logprobs=(None, 0, 4)[i % 3]) for i in range(10)]
    ref = make_llm(qwen3_path).generate(prompts, params)
    for o, p in zip(ref, params):
        if p.logprobs is None:
            assert o.logprobs is None
        else:
            _check(qwen3_path, o, p.logprobs)
    for switches in (dict(overlap=False), dict(kv_cache_tokens=150, max_running_requests=6),
                     dict(chunked_prefill_size=8)):
        llm = make_llm(qwen3_path, **switches)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], switches
        for o, r in zip(outs, ref):
            if r.logprobs is not None:
                assert [t for _, t in o.logprobs] == [t for _, t in r.logprobs] or all(
                    abs(a - b) < TOL for (a, _), (b, _) in zip(o.logprobs, r.logprobs)), switches
        if "kv_cache_tokens" in switches:
            assert llm.engine.scheduler.num_retractions > 0
        assert_all_pages_back(llm)


def test_bad_logprobs_are_refused():
    from minisgl.errors import RequestError
    for v in (-1, 21, 2.5, True):
        with pytest.raises(RequestError) as e:
            SamplingParams(logprobs=v)
        assert e.value.param == "logprobs"


def test_token_logprobs_store_entries_without_an_object_per_token():
    """Req.output_logprobs reads back exactly what was appended (float32 values, int32 ids, -inf kept), by
    index, negative index and slice; and appending adds no object the garbage collector tracks (a tuple and a
    list per token would: 256 requests a step, walked again and again as they pile up)."""
    import gc

    from minisgl.scheduler.req import TokenLogprobs

    rows = [(-0.25, [7, 3], [-0.25, -1.5]), (float("-inf"), [2, 9], [-0.125, float("-inf")]),
            (-3.0, [1, 0], [-2.0, -3.0])]
    lps = TokenLogprobs()
    for lp, ids, values in rows:
        lps.append(lp, ids, values)
    expected = [(lp, list(zip(ids, values))) for lp, ids, values in rows]
    assert len(lps) == 3 and list(lps) == expected and lps == expected
    assert lps[-1] == expected[-1] and lps[1:] == expected[1:] and lps[::2] == expected[::2]
    with pytest.raises(IndexError):
        lps[3]
    assert TokenLogprobs() == [] and lps != expected[:2]

    ids, values = list(range(5)), [-1.0] * 5

    def tracked_objects_added() -> tuple[TokenLogprobs, int]:
        many = TokenLogprobs()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for _ in range(2000):
                many.append(-0.5, ids, values)
            return many, len(gc.get_objects()) - before
        finally:
            gc.enable()

    # gc.get_objects() counts the whole process, and CI runs have counted 11 in each of three tries (objects of
    # pytest-xdist's threads, not of the appends). One object per token would add 2,000 to every try, so the
    # bound is a tenth of that: far above the process's noise, far below any per-token allocation.
    many, grown = min((tracked_objects_added() for _ in range(3)), key=lambda tried: tried[1])
    assert len(many) == 2000 and many[1999] == (-0.5, list(zip(ids, values)))
    assert grown < 200, f"{grown} new tracked objects for 2000 tokens"
