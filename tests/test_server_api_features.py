"""The OpenAI server's API features (issue 26): logprobs (chat `logprobs`/`top_logprobs`, completions
`logprobs: N`, streamed and not), `n` choices, penalties, `response_format` (json_object, json_schema, and the
regex / ebnf extensions); each equal to the offline engine's, every page back afterwards, and what is still
refused refused in OpenAI's error shape."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from minisgl.server import ServerThread, build_state
from minisgl.server.testing import tiny_model_path
from tests.test_server import assert_no_leak, assert_openai_error, sse_events, wait_idle

ENGINE_KW = {"kv_cache_tokens": 8192}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_path(tmp_path_factory.getbasetemp() / "server-api-tests")


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServerThread(build_state(model_path, served_model_name="tiny", **ENGINE_KW)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(model_path):
    from minisgl import LLM
    return LLM(model_path, **ENGINE_KW)


def test_completion_logprobs_equal_offline(http, llm):
    from minisgl import SamplingParams
    ref = llm.generate("The quick brown", SamplingParams(temperature=0, max_tokens=12, logprobs=3))[0]
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    r = http.post("/v1/completions", json=body).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([x for x, _ in ref.logprobs], abs=1e-5)
    assert len(lp["tokens"]) == len(ref.token_ids) and all(len(t) <= 3 for t in lp["top_logprobs"])
    assert all(lp["top_logprobs"][j][tok] == lp["token_logprobs"][j] for j, tok in enumerate(lp["tokens"])
               if tok in lp["top_logprobs"][j]), "greedy: the chosen token's entry in its top list"
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # streamed: the same tokens and logprobs, spread over the chunks
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    streamed = [x for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-5)  # a cache hit: the same maths, other shapes
    assert_no_leak(wait_idle(http))


def test_chat_logprobs_and_top_logprobs(oai, http):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say something."}], max_tokens=10, temperature=0,
              logprobs=True, top_logprobs=4)
    full = oai.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 4 and item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.token == item.top_logprobs[0].token, "greedy: the chosen token is the most likely"
        assert abs(item.logprob - item.top_logprobs[0].logprob) < 1e-6
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    only = oai.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)
    none = oai.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert none.choices[0].logprobs is None
    assert_no_leak(wait_idle(http))


def test_n_choices_equal_their_seeds_alone(http, llm):
    from minisgl import SamplingParams
    body = {"model": "tiny", "prompt": "A server streams", "max_tokens": 16, "temperature": 1.0, "seed": 21, "n": 3}
    r = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for c in r["choices"]:
        alone = llm.generate("A server streams", SamplingParams(temperature=1.0, max_tokens=16, seed=21 + c["index"]))
        assert c["text"] == alone[0].text
    assert r["usage"]["completion_tokens"] == 3 * 16 and r["usage"]["prompt_tokens"] == len(llm.encode(
        "A server streams")), "usage counts every choice's tokens, the prompt once"
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    texts = {i: "".join(e["choices"][0]["text"] for e in events if e["choices"] and e["choices"][0]["index"] == i)
             for i in range(3)}
    assert [texts[i] for i in range(3)] == [c["text"] for c in r["choices"]]
    finals = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1, 2]
    assert_no_leak(wait_idle(http))


def test_chat_n_and_penalties(oai, http):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about servers."}], max_tokens=24,
              temperature=0.8, seed=3, n=2, frequency_penalty=0.8, presence_penalty=0.5,
              extra_body={"repetition_penalty": 1.2})
    full = oai.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    again = oai.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in full.choices]
    assert_no_leak(wait_idle(http))


def test_response_format_json_schema_and_object(oai, http):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["name", "n"], "additionalProperties": False}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "JSON please"}], max_tokens=60, temperature=0.7,
              seed=1)
    r = oai.chat.completions.create(**kw, response_format={"type": "json_schema",
                                                           "json_schema": {"name": "thing", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(**kw, stream=True, response_format={
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    r = oai.chat.completions.create(**{**kw, "temperature": 0}, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = "[a-c]{2,4}-[0-9]{2}"
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Code:", "max_tokens": 20, "temperature": 1.0,
                                           "seed": 4, "response_format": {"type": "regex", "regex": pattern}}).json()
    assert re.fullmatch(pattern, r["choices"][0]["text"]), r
    grammar = 'root ::= "yes" | "no"'
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Answer:", "max_tokens": 5,
                                           "response_format": {"type": "ebnf", "ebnf": grammar}}).json()
    assert r["choices"][0]["text"] in ("yes", "no")
    assert_no_leak(wait_idle(http))


GOOD_C = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD = [
    ("completions", {**GOOD_C, "logprobs": 21}, "logprobs"),
    ("completions", {**GOOD_C, "logprobs": -1}, "logprobs"),
    ("completions", {**GOOD_C, "n": 0}, "n"),
    ("completions", {**GOOD_C, "n": 65}, "n"),
    ("completions", {**GOOD_C, "best_of": 2}, "best_of"),
    ("completions", {**GOOD_C, "echo": True, "logprobs": 1}, "echo"),
    ("chat/completions", {**GOOD_CHAT, "top_logprobs": 3}, None),  # top_logprobs without logprobs
    ("chat/completions", {**GOOD_CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ("chat/completions", {**GOOD_CHAT, "response_format": {"type": "yaml"}}, "response_format"),
    ("chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_schema"}}, None),
    ("chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format"),
    ("chat/completions", {**GOOD_CHAT, "response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format"),
    ("completions", {**GOOD_C, "response_format": {"type": "ebnf", "ebnf": "root ::= nothing"}}, "response_format"),
    ("chat/completions", {**GOOD_CHAT, "response_format": {"type": "json_object", "schema": {}}}, "response_format"),
]


@pytest.mark.parametrize("endpoint,body,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_feature_requests(http, endpoint, body, param):
    if "response_format" in body and body["response_format"].get("type") in ("regex", "ebnf", "json_schema"):
        pytest.importorskip("xgrammar")
    err = assert_openai_error(http.post(f"/v1/{endpoint}", json=body), 400)
    if param is not None:
        assert err["param"] == param, err
    assert http.post("/v1/completions", json=GOOD_C).status_code == 200, "still serving"
