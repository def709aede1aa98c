"""Bad requests are refused with a ValueError naming the problem, and the engine keeps serving: after every
refusal a valid request on the same LLM completes (matching HF) and every page is back."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from helpers import BROKEN_MODELS, PROMPTS, assert_all_pages_back, hf_greedy, make_broken_model

from minisgl import LLM, EngineConfig, RequestError, SamplingParams
from minisgl.errors import ConfigError
from minisgl.sampling_params import MAX_TEMPERATURE, TOP_K_OFF

CTX = 64  # max_model_len of the context-limited engine
OK = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ctx_llm(qwen3_path):
    """A short context (64 tokens), a roomy KV pool."""
    return LLM(qwen3_path, max_model_len=CTX, page_size=4)


@pytest.fixture(scope="module")
def kv_llm(qwen3_path):
    """A long context, a KV pool of 9 pages of 4 tokens (36 tokens) in all."""
    return LLM(qwen3_path, kv_cache_tokens=40, page_size=4)


def still_serves(llm, path):
    """A valid batch right after a refusal completes with HF's tokens, and every page comes back."""
    assert_all_pages_back(llm)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[7]]
    outs = llm.generate(prompts, OK)
    assert [o.token_ids for o in outs] == [r[:8] for r in hf_greedy(path, prompts)]
    assert_all_pages_back(llm)


def refused(llm, prompts, params, match, exc=ValueError):
    waiting_before = len(llm.engine.scheduler.waiting)
    with pytest.raises(exc, match=match) as info:
        llm.generate(prompts, params)
    assert len(llm.engine.scheduler.waiting) == waiting_before == 0  # nothing was queued
    return str(info.value)


def test_empty_prompt(ctx_llm, qwen3_path):
    msg = refused(ctx_llm, [[]], OK, "prompt is empty")
    assert msg.startswith("request 0:")
    assert ctx_llm.generate([], OK) == []  # no prompts at all is not an error: nothing to do
    still_serves(ctx_llm, qwen3_path)


def test_empty_text_prompt(qwen3_tok_path):
    llm = LLM(qwen3_tok_path, page_size=4)
    refused(llm, "", OK, "prompt is empty")
    refused(llm, ["w5 w6", ""], OK, "request 1: the prompt is empty")
    still_serves(llm, qwen3_tok_path)


def test_prompt_longer_than_context(ctx_llm, qwen3_path):
    refused(ctx_llm, [PROMPTS[1][:10] * 7], OK, rf"70 tokens, longer than the context of {CTX}")
    refused(ctx_llm, [[5] * CTX], SamplingParams(max_tokens=1), rf"{CTX} tokens, longer than the context")
    still_serves(ctx_llm, qwen3_path)


def test_prompt_plus_max_tokens_over_context(ctx_llm, qwen3_path):
    msg = refused(ctx_llm, [[5] * 50], SamplingParams(max_tokens=15), "exceeds the context")
    assert "50 tokens" in msg and "max_tokens (15)" in msg and str(CTX) in msg
    refused(ctx_llm, [[5] * (CTX - 1)], SamplingParams(max_tokens=2), "exceeds the context")
    # exactly the context is fine, and runs to the end of it
    prompt = PROMPTS[1][:48]
    (out,) = ctx_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=CTX - 48, ignore_eos=True))
    assert out.token_ids == hf_greedy(qwen3_path, [prompt], CTX - 48)[0]
    assert out.finish_reason == "length"
    still_serves(ctx_llm, qwen3_path)


@pytest.mark.parametrize("bad", [-1, 512, 10**9, 3.0, True, None], ids=str)
def test_token_ids_out_of_vocab(bad, ctx_llm, qwen3_path):
    prompt = [5, 6, bad, 7]
    msg = refused(ctx_llm, [PROMPTS[0], prompt], OK, r"request 1: token id .* is out of the vocabulary \[0, 512\)")
    assert repr(bad) in msg
    still_serves(ctx_llm, qwen3_path)


@pytest.mark.parametrize("bad", [np.int64(-1), np.int32(512), np.float32(3.0), np.bool_(True)], ids=repr)
def test_numpy_token_ids_out_of_vocab_or_not_integers(bad, ctx_llm, qwen3_path):
    refused(ctx_llm, [[5, 6, bad, 7]], OK, r"token id .* is out of the vocabulary")
    still_serves(ctx_llm, qwen3_path)


def test_numpy_integer_token_ids_are_accepted(ctx_llm, qwen3_path):
    """A tokenizer's numpy ids run like Python ints: one prompt as a list, several, and as an engine request."""
    prompt = PROMPTS[0]
    expect = hf_greedy(qwen3_path, [prompt], 8)[0]
    as_np = [np.int64(t) for t in prompt]
    assert ctx_llm.generate(as_np, OK)[0].token_ids == expect
    assert [o.token_ids for o in ctx_llm.generate([as_np, list(np.asarray(prompt, dtype=np.int32))], OK)] \
        == [expect, expect]
    req = ctx_llm.engine.add_request(np.asarray(prompt, dtype=np.int32), OK)
    assert all(type(t) is int for t in req.input_ids)
    ctx_llm.engine.run([req])
    assert req.output_ids == expect
    still_serves(ctx_llm, qwen3_path)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])
def test_an_exception_inside_a_step_ends_every_request_and_the_engine_serves_on(overlap, qwen3_path):
    """A request's stop check raises mid-run: the exception reaches the caller, every request (running, waiting,
    in flight) ends with "error", every page and row comes back, and the next requests match HF (so the prefix
    cache kept no KV from the failed steps)."""
    llm = LLM(qwen3_path, page_size=4, overlap=overlap, max_running_requests=3)
    engine = llm.engine

    def broken_check(req):
        if len(req.output_ids) >= 3:
            raise RuntimeError("stop check failed")
        return False

    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reqs = [engine.add_request(PROMPTS[i], long) for i in (0, 2)]
    reqs.append(engine.add_request(PROMPTS[7], OK, stop_check=broken_check))
    reqs.append(engine.add_request(PROMPTS[4], OK))  # waits: 3 running at most
    with pytest.raises(RuntimeError, match="stop check failed"):
        engine.run()
    assert [r.finish_reason for r in reqs] == ["error"] * 4
    assert not engine.has_work and all(r.row is None and r.released for r in reqs)
    assert engine.cache.cached_pages == 0, "nothing of the failed steps stays in the prefix cache"
    still_serves(llm, qwen3_path)


BAD_PARAMS = [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=MAX_TEMPERATURE * 1.01), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=5), "top_p"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=True), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(min_p=False), "min_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=[-4]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
]


@pytest.mark.parametrize("kw,field", BAD_PARAMS, ids=[f"{k}={v!r}" for (d, _) in BAD_PARAMS for k, v in d.items()])
def test_invalid_sampling_values_are_refused_when_built(kw, field):
    """One validation, at construction: a bad value never reaches an engine, whichever front end built it."""
    with pytest.raises(RequestError, match=rf"^{field}\b") as info:
        SamplingParams(**kw)
    assert info.value.param == field
    value = next(iter(kw.values()))
    if field not in ("stop", "stop_token_ids"):
        assert repr(value) in info.value.message, info.value.message


def test_sampling_params_one_encoding_per_field():
    """Each field has one type once built (1 and 1.0 are one temperature) and top-k off is spelled one way."""
    p = SamplingParams(temperature=1, top_p=1, min_p=0, top_k=np.int64(5), stop="x", stop_token_ids=[np.int32(3)])
    assert (type(p.temperature), type(p.top_p), type(p.min_p), type(p.top_k)) == (float, float, float, int)
    assert p == SamplingParams(temperature=1.0, top_k=5, stop=("x",), stop_token_ids=(3,))
    assert p.stop == ("x",) and type(p.stop_token_ids[0]) is int
    assert SamplingParams().top_k == TOP_K_OFF == -1
    # the k a sampler uses: the whole vocabulary when off, never more than the vocabulary
    assert [SamplingParams(top_k=k).top_k_within(100) for k in (TOP_K_OFF, 1, 100, 10**6)] == [100, 1, 100, 100]
    assert not SamplingParams().cuts(100) and not SamplingParams(top_k=100).cuts(100)
    assert SamplingParams(top_k=99).cuts(100) and SamplingParams(top_p=0.9).cuts(100)
    assert SamplingParams(min_p=0.1).cuts(100)


def test_request_that_cannot_fit_the_kv_pool_even_alone(kv_llm, qwen3_path):
    assert kv_llm.engine.runner.kv_capacity_tokens == 36
    msg = refused(kv_llm, [[5] * 30], SamplingParams(max_tokens=16), "KV pool")
    assert "46" in msg and "36" in msg
    refused(kv_llm, [PROMPTS[0], [5] * 36], OK, "request 1: .*cannot run even alone")
    # a request that fits exactly runs, even though the batch around it must be retracted to make room
    prompt = PROMPTS[1][:28]
    (out,) = kv_llm.generate([prompt], OK)
    assert out.token_ids == hf_greedy(qwen3_path, [prompt])[0][:8]
    batch = [prompt, PROMPTS[0], PROMPTS[2], PROMPTS[5], PROMPTS[7], prompt[:20]]
    outs = kv_llm.generate(batch, OK)
    assert [o.token_ids for o in outs] == [r[:8] for r in hf_greedy(qwen3_path, batch)]
    assert kv_llm.engine.scheduler.num_retractions > 0
    still_serves(kv_llm, qwen3_path)


def test_mismatched_prompt_and_params_lengths(ctx_llm, qwen3_path):
    refused(ctx_llm, [PROMPTS[0], PROMPTS[2]], [OK, OK, OK], "2 prompts but 3 sampling params")
    refused(ctx_llm, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [OK], "3 prompts but 1 sampling params")
    still_serves(ctx_llm, qwen3_path)


def test_wrong_params_type(ctx_llm, qwen3_path):
    refused(ctx_llm, [PROMPTS[0]], [{"temperature": 0}], "SamplingParams", exc=TypeError)
    still_serves(ctx_llm, qwen3_path)


def test_a_bad_request_in_a_batch_runs_nothing(ctx_llm, qwen3_path):
    steps = ctx_llm.engine.stats["steps"]
    refused(ctx_llm, [PROMPTS[0], PROMPTS[2], [7, 600]], OK, "request 2: token id 600")
    assert ctx_llm.engine.stats["steps"] == steps and ctx_llm.engine._next_rid >= 0
    still_serves(ctx_llm, qwen3_path)


@pytest.mark.parametrize("kw,match", [(dict(page_size=0), "page_size"), (dict(dtype="float8"), "dtype"),
                                      (dict(load_format="pickle"), "load_format"),
                                      (dict(attention_backend="magic"), "attention_backend"),
                                      (dict(max_running_requests=-1), "max_running_requests"),
                                      (dict(cuda_graph_max_bs=0), "cuda_graph_max_bs"),
                                      (dict(num_pages=-3), "num_pages"), (dict(max_model_len=-1), "max_model_len"),
                                      (dict(max_model_len=1), "max_model_len"), (dict(device="bogus"), "device"),
                                      (dict(device="cuda:x"), "device"), (dict(kv_cache_tokens=0), "kv_cache_tokens"),
                                      (dict(kv_memory_fraction=1.5), "kv_memory_fraction"),
                                      (dict(page_size=2.0), "page_size"), (dict(tp_size=True), "tp_size")])
def test_bad_engine_config(kw, match, qwen3_path):
    """A setting out of range is a ConfigError (a ValueError) naming the field, before anything loads."""
    with pytest.raises(ConfigError, match=match) as info:
        EngineConfig(model=qwen3_path, **kw).validate()
    assert info.value.field == match
    with pytest.raises(ConfigError, match=match):
        LLM(qwen3_path, **kw)


def test_cuda_device_without_a_gpu(qwen3_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: device 'cuda' is fine here")
    with pytest.raises(RuntimeError, match="torch sees no CUDA GPU here"):
        LLM(qwen3_path, device="cuda")


@pytest.mark.parametrize("kind", sorted(BROKEN_MODELS))
def test_broken_model_folder(kind, qwen3_path, tmp_path):
    """A broken folder is refused with a message that names the file and what is wrong with it (issue 28:
    these were tracebacks from transformers and safetensors); a good folder loads and serves right after."""
    path = make_broken_model(qwen3_path, str(tmp_path / kind), kind)
    with pytest.raises((ValueError, OSError), match=BROKEN_MODELS[kind]) as info:
        LLM(path)
    assert path in str(info.value) and "\n" not in str(info.value)
    still_serves(LLM(qwen3_path, page_size=4), qwen3_path)


def test_top_k_past_the_vocabulary_is_no_cut(ctx_llm, qwen3_path):
    """top_k of 2**63 (past int64) keeps every token, as top_k -1 does (issue 28: an OverflowError ended the
    step); the server already answered such a top_k as "off"."""
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)
    huge = ctx_llm.generate([PROMPTS[3]], dataclasses.replace(sampled, top_k=2**63))[0]
    off = ctx_llm.generate([PROMPTS[3]], sampled)[0]
    assert huge.token_ids == off.token_ids and len(off.token_ids) == 8
    still_serves(ctx_llm, qwen3_path)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="not a local folder"):
        LLM(str(tmp_path / "nope"))
