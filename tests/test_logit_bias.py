"""OpenAI's logit_bias (engine/logits_processing.py, `apply_logit_bias`): a number in [-100, 100] added to chosen
tokens' logits before sampling, per request, after the penalties and before the grammar mask. Checked by hand,
against greedy decoding over Hugging Face's logits with the bias added at every step, beside unbiased requests in
one batch; the HTTP server's side is in tests/test_server.py (`test_logit_bias_takes_openai_maps`)."""

from __future__ import annotations

import re

import pytest
import torch

from minisgl import SamplingParams
from minisgl.engine.logits_processing import apply_logit_bias
from minisgl.errors import RequestError
from tests.helpers import PROMPTS, assert_all_pages_back, hf_next_logits


def test_hand_checked_case():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]], dtype=torch.bfloat16)
    apply_logit_bias(logits, torch.tensor([0, 0, 1]), torch.tensor([0, 2, 1]), torch.tensor([2.5, -100.0, 1.0]))
    assert logits.float().tolist() == [[3.5, 2.0, -97.0], [0.5, 1.5, 0.5]]


@pytest.mark.parametrize("bias,message", [({-1: 1.0}, "non-negative token ids"), ({3: 100.5}, "[-100, 100]"),
                                          ({3: float("nan")}, "[-100, 100]"), ({3: True}, "[-100, 100]"),
                                          ({True: 1.0}, "non-negative token ids"), ([(3, 1.0), (3, 2.0)], "twice"),
                                          ("3", "map token ids"), ({i: 1.0 for i in range(1025)}, "at most")])
def test_bad_maps_are_refused(bias, message):
    with pytest.raises(RequestError, match=re.escape(message)) as e:
        SamplingParams(logit_bias=bias)
    assert e.value.param == "logit_bias"


def test_a_map_is_stored_sorted_and_asks_for_processing():
    params = SamplingParams(logit_bias={9: 1, 2: -3.5})
    assert params.logit_bias == ((2, -3.5), (9, 1.0)) and params.processes_logits
    assert not SamplingParams(logit_bias={}).processes_logits


def _biased_reference(path, prompt, n, bias):
    """Greedy decoding over HF's logits with the bias added by hand at every step."""
    ids, out = list(prompt), []
    for _ in range(n):
        z = hf_next_logits(path, ids).double()
        for t, b in bias.items():
            z[t] += b
        tok = int(z.argmax())
        out.append(tok)
        ids.append(tok)
    return out


def test_greedy_follows_the_biased_logits(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    prompts = PROMPTS[:3]
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # ban each prompt's first greedy token and lift two others a little: the output must change, as HF's does
    for p, o in zip(prompts, plain):
        bias = {o.token_ids[0]: -100.0, 7: 2.0, 11: 1.5}
        got = llm.generate([p], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias))[0]
        assert got.token_ids == _biased_reference(qwen3_path, p, 12, bias), p
        assert got.token_ids[0] != o.token_ids[0]
    # +100 all but forces a token, in every step and every mode (greedy and sampled)
    for params in (dict(temperature=0), dict(temperature=1.0, seed=4, top_p=0.9)):
        out = llm.generate([PROMPTS[4]], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={42: 100}, **params))
        assert out[0].token_ids == [42] * 6, params


def test_biased_and_plain_requests_share_batches(qwen3_path, make_llm):
    """Each request's tokens are those of its run alone, under overlap on and off and the graphs off."""
    prompts = PROMPTS[:8]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             logit_bias={(13 * i) % 97: 5.0, 3: -100} if i % 2 else {}) for i in range(8)]
    alone = [make_llm(qwen3_path).generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    for switches in ({}, dict(overlap=False), dict(cuda_graph=False)):
        llm = make_llm(qwen3_path, **switches)
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone, switches
        assert_all_pages_back(llm)


def test_a_token_past_the_vocabulary_is_refused(qwen3_path, make_llm):
    llm = make_llm(qwen3_path)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestError, match="out of the vocabulary") as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias"
    assert llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logit_bias={vocab - 1: 1.0}))
    assert_all_pages_back(llm)
