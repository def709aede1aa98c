"""n > 1 (SamplingParams.n): the prompt is prefilled once and its KV shared through the prefix cache; stream i
draws with seed + i and is token for token the run of that seed alone."""

from __future__ import annotations

import pytest

from minisgl import SamplingParams
from minisgl.errors import RequestError
from tests.helpers import PROMPTS, assert_all_pages_back


def _alone(make_llm, path, prompt, params, seed):
    q = SamplingParams(**{**_fields(params), "n": 1, "seed": seed})
    return make_llm(path).generate([prompt], q)[0].token_ids


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_k", "top_p", "min_p", "max_tokens", "ignore_eos",
                                       "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs")}


@pytest.mark.parametrize("switches", [{}, dict(overlap=False), dict(page_size=4), dict(chunked_prefill_size=16)])
def test_streams_equal_their_seed_alone_and_share_the_prefill(qwen3_path, make_llm, switches):
    prompt = PROMPTS[1]  # 60 tokens
    params = SamplingParams(n=4, seed=40, temperature=0.9, top_k=50, max_tokens=20, ignore_eos=True)
    llm = make_llm(qwen3_path, **switches)
    outs = llm.generate([prompt], params)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in outs}) > 1, "four seeds, four streams: not all the same"
    for i, o in enumerate(outs):
        assert o.token_ids == _alone(make_llm, qwen3_path, prompt, params, 40 + i), (switches, i)
    # prefilled once: the first stream computes the prompt; the others find all of it but the last token (and
    # the partial page) in the cache
    page = switches.get("page_size", 1)
    assert outs[0].num_cached_prompt_tokens == 0
    assert all(o.num_cached_prompt_tokens == (len(prompt) - 1) // page * page for o in outs[1:]), \
        [o.num_cached_prompt_tokens for o in outs]
    assert_all_pages_back(llm)


def test_n_with_several_prompts_logprobs_and_penalties(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[6]]
    params = [SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(n=1, seed=9, temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5)]
    outs = llm.generate(prompts, params)
    assert [(o.prompt_token_ids == prompts[k], o.index) for o, k in zip(outs, [0, 0, 0, 1, 2, 2])] == \
        [(True, 0), (True, 1), (True, 2), (True, 0), (True, 0), (True, 1)]
    for o, (k, i) in zip(outs, [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]):
        alone = make_llm(qwen3_path).generate([prompts[k]], SamplingParams(**{**_fields(params[k]),
                                                                             "seed": params[k].seed + i}))[0]
        assert o.token_ids == alone.token_ids, (k, i)
        assert (o.logprobs is None) == (alone.logprobs is None)
        for (a, top_a), (b, top_b) in zip(o.logprobs or [], alone.logprobs or []):  # batch shapes differ: fp32 noise
            assert abs(a - b) < 1e-5 and [t for t, _ in top_a] == [t for t, _ in top_b]


def test_streams_without_a_radix_cache_and_unseeded(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, radix_cache=False)
    outs = llm.generate([PROMPTS[5]], SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert len(outs) == 3 and all(len(o.token_ids) == 10 for o in outs)
    assert all(o.num_cached_prompt_tokens == 0 for o in outs)  # nothing to share through: each prefills
    again = make_llm(qwen3_path, radix_cache=False).generate(
        [PROMPTS[5]], SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs], "the engine seed decides every stream"


def test_abort_a_stream_before_it_is_queued(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    engine = llm.engine
    reqs = engine.add_requests(PROMPTS[1], SamplingParams(n=3, seed=1, max_tokens=8, ignore_eos=True))
    engine.abort(reqs[2])  # still waiting for stream 0's prefill
    assert reqs[2].released and reqs[2].finish_reason == "abort"
    engine.run(reqs)
    assert [r.finish_reason for r in reqs] == ["length", "length", "abort"]
    assert_all_pages_back(llm)


def test_bad_n_is_refused(qwen3_path, make_llm):
    for v in (0, -1, 65, 2.0, True):
        with pytest.raises(RequestError) as e:
            SamplingParams(n=v)
        assert e.value.param == "n"
