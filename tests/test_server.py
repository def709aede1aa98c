"""The HTTP server: OpenAI client round trips, stop strings, bad input, disconnects, SIGTERM.

The server runs in-process (uvicorn on a free 127.0.0.1 port, in a thread) except for the signal test,
which starts `python -m minisgl serve` as a subprocess. The model is assets/tiny-qwen3 when it is there,
otherwise a tiny random Qwen3 built on the spot (see minisgl.server.testing).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.sampling_params import MAX_TEMPERATURE
from minisgl.server import ServerThread, build_state, engine_kwargs_from_args
from minisgl.server.testing import tiny_model_path

REPO = Path(__file__).resolve().parents[1]
ENGINE_KW = {"kv_cache_tokens": 8192}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")


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


def stats(http) -> dict:
    return http.get("/v1/internal/stats").json()


def wait_idle(http, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(http)
        if not s["has_work"] and s["active_handles"] == 0:
            return s
        assert time.monotonic() < deadline, f"engine still busy: {s}"
        time.sleep(0.05)


def assert_no_leak(s: dict) -> None:
    assert s["running"] == 0 and s["waiting"] == 0
    assert s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_capacity"], s
    assert s["kv_pages_leaked"] == 0


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# --- basics --------------------------------------------------------------------------------------------
def test_health_and_models(http, oai):
    assert http.get("/health").json() == {"status": "ok"}
    models = oai.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"


def test_completions_stream_equals_non_stream(oai):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=40, temperature=0)
    full = oai.completions.create(**kw)
    assert full.usage.prompt_tokens > 0 and full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.choices[0].finish_reason in ("stop", "length")
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_equals_non_stream(oai):
    kw = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Caf\u00e9? \u65e5\u672c\U0001f600"}],
              max_tokens=48, temperature=0)
    full = oai.chat.completions.create(**kw)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_matches_offline_llm(http, model_path):
    from minisgl import LLM, SamplingParams
    llm = LLM(model_path, **ENGINE_KW)
    ref = llm.generate("Numbers 0123", SamplingParams(temperature=0, max_tokens=30))[0]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Numbers 0123", "max_tokens": 30,
                                           "temperature": 0}).json()
    assert r["choices"][0]["text"] == ref.text
    assert r["usage"]["completion_tokens"] == len(ref.token_ids)
    ids = llm.encode("Numbers 0123")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 30,
                                           "temperature": 0}).json()
    assert r["choices"][0]["text"] == ref.text


def test_seeded_sampling_is_reproducible(http):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "temperature": 0.9, "top_p": 0.9,
            "top_k": 50, "seed": 7}
    a = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b
    # min_p is accepted on both endpoints; min_p 1 keeps only the most likely token: greedy
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    assert http.post("/v1/completions", json={**body, "min_p": 1.0}).json()["choices"][0]["text"] == greedy
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "min_p": 0.1,
            "seed": 3, "temperature": 1.0}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("endpoint,body", [
    ("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_logit_bias_takes_openai_maps(http, server, endpoint, body):
    """OpenAI's string-keyed map (tests/test_logit_bias.py checks the engine's side): +100 on token 42 makes every
    token 42; a key that is not ASCII digits, a bias out of range, a token past the vocabulary, a string bias: 400."""
    base = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, **body}
    r = http.post(f"/v1/{endpoint}", json={**base, "logit_bias": {"42": 100}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice.get("text") or choice["message"]["content"]) == server.state.tokenizer.decode([42] * 5)
    for bad, param in (({"x": 1}, "logit_bias"), ({"42": 101}, "logit_bias"), ({"99999999": 1}, "logit_bias"),
                       ({"42": "1"}, "logit_bias.42"), ({" 42": 1}, "logit_bias"), ({"+42": 1}, "logit_bias"),
                       ({"4_2": 1}, "logit_bias"), ({"\uff14\uff12": 1}, "logit_bias"), ({"": 1}, "logit_bias")):
        r = http.post(f"/v1/{endpoint}", json={**base, "logit_bias": bad})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == param, r.text
    assert http.post(f"/v1/{endpoint}", json=base).status_code == 200  # still serving
    assert_no_leak(wait_idle(http))


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(oai, stream):
    kw = dict(model="tiny", prompt="Numbers 0123456789, punctuation", max_tokens=40, temperature=0)
    full = oai.completions.create(**kw).choices[0].text
    clean = [i for i in range(4, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
    if not clean:
        pytest.skip("the model's output has no usable stop string")
    i = clean[len(clean) // 2]
    stop = full[i:i + 2]
    expected = full[:full.find(stop)]
    if stream:
        chunks = list(oai.completions.create(**kw, stop=[stop, "\x00never"], stream=True))
        pieces = [c.choices[0].text for c in chunks]
        text = "".join(pieces)
        running = ""
        for p in pieces:
            running += p
            assert stop not in running  # never streams past the stop string
        assert chunks[-1].choices[0].finish_reason == "stop"
    else:
        out = oai.completions.create(**kw, stop=stop)
        text = out.choices[0].text
        assert out.choices[0].finish_reason == "stop"
    assert text == expected


# --- bad input -----------------------------------------------------------------------------------------
GOOD_C = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _with(base, **kw):
    body = dict(base)
    for k, v in kw.items():
        if v is ...:
            body.pop(k, None)
        else:
            body[k] = v
    return body


BAD_CASES = [
    # (endpoint, body (bytes = raw), expected status)
    ("completions", b"{", 400),
    ("completions", b"", 400),
    ("completions", b"not json at all", 400),
    ("completions", b"[1, 2, 3]", 400),
    ("completions", b'"a string"', 400),
    ("completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400),
    ("completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e999}', 400),
    ("completions", b"\xff\xfe garbage", 400),
    ("completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400),  # an unpaired surrogate
    ("completions", b"[" * 100_000, 400),  # nested past the parser's recursion limit
    ("completions", b'{"model": "tiny", "prompt": ' + b"[" * 500 + b"]" * 500 + b"}", 400),
    ("completions", _with(GOOD_C, model=...), 400),
    ("completions", _with(GOOD_C, prompt=...), 400),
    ("completions", _with(GOOD_C, model="gpt-4"), 404),
    ("completions", _with(GOOD_C, model=123), 400),
    ("completions", _with(GOOD_C, prompt=42), 400),
    ("completions", _with(GOOD_C, prompt=""), 400),
    ("completions", _with(GOOD_C, prompt=[]), 400),
    ("completions", _with(GOOD_C, prompt=[1, -5]), 400),
    ("completions", _with(GOOD_C, prompt=[10**9]), 400),
    ("completions", _with(GOOD_C, prompt=[True, False]), 400),
    ("completions", _with(GOOD_C, prompt=["a", "b"]), 400),
    ("completions", _with(GOOD_C, prompt="hello " * 3000), 400),  # longer than the context
    ("completions", _with(GOOD_C, max_tokens=0), 400),
    ("completions", _with(GOOD_C, max_tokens=-3), 400),
    ("completions", _with(GOOD_C, max_tokens=10**12), 400),
    ("completions", _with(GOOD_C, max_tokens="16"), 400),
    ("completions", _with(GOOD_C, max_tokens=4.5), 400),
    ("completions", _with(GOOD_C, temperature=-1), 400),
    ("completions", _with(GOOD_C, temperature=1e6), 400),
    ("completions", _with(GOOD_C, temperature="hot"), 400),
    ("completions", _with(GOOD_C, top_p=0), 400),
    ("completions", _with(GOOD_C, top_p=1.5), 400),
    ("completions", _with(GOOD_C, top_k=-7), 400),
    ("completions", _with(GOOD_C, min_p=-0.5), 400),
    ("completions", _with(GOOD_C, min_p=1.5), 400),
    ("completions", _with(GOOD_C, min_p="0.1"), 400),
    ("completions", _with(GOOD_C, n=65), 400),
    ("completions", _with(GOOD_C, n=0), 400),
    ("completions", _with(GOOD_C, best_of=3), 400),
    ("completions", _with(GOOD_C, stream="yes"), 400),
    ("completions", _with(GOOD_C, stop=5), 400),
    ("completions", _with(GOOD_C, stop=[""]), 400),
    ("completions", _with(GOOD_C, stop=[1, 2]), 400),
    ("completions", _with(GOOD_C, stop=[f"s{i}" for i in range(40)]), 400),
    ("completions", _with(GOOD_C, seed=-1), 400),
    ("completions", _with(GOOD_C, seed=2**80), 400),
    ("completions", _with(GOOD_C, echo=True), 400),
    ("completions", _with(GOOD_C, logprobs=30), 400),
    ("completions", _with(GOOD_C, presence_penalty=2.5), 400),
    ("completions", _with(GOOD_C, frequency_penalty=-3), 400),
    ("completions", _with(GOOD_C, repetition_penalty=0), 400),
    ("completions", _with(GOOD_C, repetition_penalty="1.2"), 400),
    ("completions", _with(GOOD_C, logit_bias={"5": 101}), 400),
    ("completions", _with(GOOD_C, max_token=5), 400),  # a typo: unknown field
    ("completions", _with(GOOD_C, stream_options={"include_usage": "yes"}), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=...), 400),
    ("chat/completions", _with(GOOD_CHAT, messages="hi"), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"role": "user"}]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"content": "hi"}]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"role": "user", "content": 7}]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400),
    ("chat/completions", _with(GOOD_CHAT, messages=[{"role": "user", "content": "x " * 5000}]), 400),
    ("chat/completions", _with(GOOD_CHAT, model="nope"), 404),
    ("chat/completions", _with(GOOD_CHAT, max_completion_tokens=0), 400),
    ("chat/completions", _with(GOOD_CHAT, tools=[{"type": "function"}]), 400),
    ("chat/completions", _with(GOOD_CHAT, logprobs="yes"), 400),
    ("chat/completions", _with(GOOD_CHAT, top_logprobs=2), 400),  # without logprobs: true
    ("chat/completions", _with(GOOD_CHAT, response_format={"type": "xml"}), 400),
    ("chat/completions", _with(GOOD_CHAT, n=-4), 400),
]


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    if status is not None:
        assert r.status_code == status, r.text
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err


BAD_CASES_BOTH = [(e, b, s, False) for e, b, s in BAD_CASES] + [
    (e, {**b, "stream": True}, s, True) for e, b, s in BAD_CASES if isinstance(b, dict) and "stream" not in b]


@pytest.mark.parametrize("endpoint,body,status,stream", BAD_CASES_BOTH,
                         ids=[f"{i}{'-stream' if c[3] else ''}" for i, c in enumerate(BAD_CASES_BOTH)])
def test_bad_input(http, endpoint, body, status, stream):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(f"/v1/{endpoint}", content=content, headers={"Content-Type": "application/json"})
    assert_openai_error(r, status)


def test_bad_routes_and_methods(http):
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)
    assert_openai_error(http.get("/v1/models/gpt-4"), 404)
    err = assert_openai_error(http.post("/v1/completions", json=_with(GOOD_C, prompt="hello " * 3000)), 400)
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(http.post("/v1/completions", json=_with(GOOD_C, max_tokens="16")), 400)
    assert err["param"] == "max_tokens"


# Hypothesis: start from a valid body and break one field, or send arbitrary JSON objects.
FINITE = {"allow_nan": False, "allow_infinity": False}
SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00\ud83d"])  # sent as \\uXXXX escapes
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(**FINITE)
                    | st.text(max_size=8) | SURROGATES, lambda kids: st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)
NOT_INT = JSON.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
NOT_NUM = JSON.filter(lambda v: not isinstance(v, (int, float)) or isinstance(v, bool))
NOT_BOOL = JSON.filter(lambda v: not isinstance(v, bool) and v is not None)
KNOWN = {"model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream",
         "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
         "logit_bias", "user",
         "ignore_eos", "echo", "logprobs", "best_of", "suffix", "max_completion_tokens", "top_logprobs",
         "response_format", "tools", "tool_choice", "parallel_tool_calls"}
BREAK = st.one_of(
    st.tuples(st.just("model"), JSON.filter(lambda v: v != "tiny")),
    st.tuples(st.just("max_tokens"), NOT_INT.filter(lambda v: v is not None) | st.integers(max_value=0)
              | st.integers(min_value=10**6)),
    st.tuples(st.just("temperature"), NOT_NUM.filter(lambda v: v is not None)
              | st.floats(max_value=-1e-9, **FINITE)
              | st.floats(min_value=MAX_TEMPERATURE * 1.001, **FINITE)),
    st.tuples(st.just("top_p"), NOT_NUM.filter(lambda v: v is not None) | st.floats(max_value=0, **FINITE)
              | st.floats(min_value=1.0001, **FINITE)),
    st.tuples(st.just("top_k"), NOT_INT.filter(lambda v: v is not None) | st.integers(max_value=-2) | st.just(0)),
    st.tuples(st.just("n"), st.integers().filter(lambda v: not 1 <= v <= 64) | NOT_INT.filter(lambda v: v is not None)),
    st.tuples(st.just("stream"), NOT_BOOL),
    st.tuples(st.just("seed"), st.integers(max_value=-1) | st.integers(min_value=2**63)
              | NOT_INT.filter(lambda v: v is not None)),
    st.tuples(st.just("stop"), JSON.filter(lambda v: v is not None and not isinstance(v, str) and not (
        isinstance(v, list) and all(isinstance(s, str) and s for s in v) and len(v) <= 16)) | st.just("")),
    st.tuples(st.text(min_size=1, max_size=10).filter(lambda k: k not in KNOWN), JSON),
)




def _maybe_valid_prompt(v) -> bool:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    return (isinstance(v, str) and v != "" and "\ud800" not in v) or (
        isinstance(v, list) and bool(v) and all(isinstance(i, int) and not isinstance(i, bool) for i in v))


def _maybe_valid_messages(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and "role" in m for m in v)


BREAK_COMPLETION = BREAK | st.tuples(st.just("prompt"), JSON.filter(lambda v: not _maybe_valid_prompt(v)))
BREAK_CHAT = BREAK | st.tuples(st.just("messages"), JSON.filter(lambda v: not _maybe_valid_messages(v))
                               | st.lists(st.fixed_dictionaries({"role": JSON, "content": JSON}), max_size=2)
                               .filter(lambda ms: not ms or any(m["role"] not in ("system", "developer", "user",
                                                                                  "assistant") for m in ms)))


def post_raw(http, endpoint: str, body) -> httpx.Response:
    """JSON with ASCII escapes, so unpaired surrogates travel as \\uXXXX like any other client sends them."""
    return http.post(f"/v1/{endpoint}", content=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), chat=st.booleans())
def test_hypothesis_broken_bodies(http, data, chat):
    broken = data.draw(st.lists(BREAK_CHAT if chat else BREAK_COMPLETION, min_size=1, max_size=3))
    body = dict(GOOD_CHAT if chat else GOOD_C)
    for key, value in broken:
        body[key] = value
    assert_openai_error(post_raw(http, "chat/completions" if chat else "completions", body))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(st.text(max_size=10), JSON, max_size=5) | JSON)
def test_hypothesis_arbitrary_json(http, body):
    for endpoint in ("completions", "chat/completions"):
        assert_openai_error(post_raw(http, endpoint, body))


def test_still_serving_after_bad_input(http, oai):
    assert stats(http)["bad_requests"] >= 30
    out = oai.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200
    assert_no_leak(wait_idle(http))


# --- disconnects ---------------------------------------------------------------------------------------
def test_stream_disconnect_frees_pages(http, server):
    before = stats(http)["aborted"]
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    s = wait_idle(http, timeout=10)
    assert s["aborted"] == before + 1
    assert_no_leak(s)


def test_non_stream_disconnect_aborts(http, server):
    before = stats(http)["aborted"]
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    s = wait_idle(http, timeout=10)
    assert s["aborted"] == before + 1
    assert_no_leak(s)


# --- command line --------------------------------------------------------------------------------------
def test_request_log(model_path, tmp_path):
    """`--request-log`: the engine process writes a line per finished request, its times in order on the clock of
    time.perf_counter (the test's own, on the same machine), its token counts as the client sees them.
    `--step-log`: a line per step, on the same clock; its prompt tokens and decode rows add up to the requests'."""
    log, step_log = tmp_path / "requests.jsonl", tmp_path / "steps.jsonl"
    t0 = time.perf_counter()
    srv = ServerThread(build_state(model_path, served_model_name="tiny", request_log=str(log),
                                   step_log=str(step_log), **ENGINE_KW)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            usage = [client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(5 + i, 12 + 2 * i)),
                                                           "max_tokens": 3 + i, "temperature": 0,
                                                           "ignore_eos": True}).json()["usage"] for i in range(2)]
    finally:
        srv.stop()  # the engine process closes the log as it stops
    t1 = time.perf_counter()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["prompt_tokens"], r["output_tokens"], r["reason"]) for r in lines] == \
        [(u["prompt_tokens"], u["completion_tokens"], "length") for u in usage]
    for r in lines:
        assert t0 < r["received"] <= r["arrival"] <= r["first_token"] <= r["finish"] < t1, r
        assert r["gaps"] == r["output_tokens"] - 1 and all(r["first_token"] < end <= r["finish"] and gap > 0.01
                                                           for end, gap in r["long_gaps"]), r
    assert lines[0]["finish"] <= lines[1]["arrival"], "the requests were sent one after the other"
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    assert all(t0 < s["t"] < t1 and min(s["drain_ms"], s["step_ms"], s["news_ms"]) >= 0 for s in steps), steps
    launched = [s for s in steps if "reqs" in s]
    assert sum(s["prompt_tokens"] for s in launched) == sum(r["prompt_tokens"] - r["cached_tokens"] for r in lines)
    # the first token of each comes from its prefill
    assert sum(s["decode_rows"] for s in launched) == sum(r["output_tokens"] - 1 for r in lines) == (3 - 1) + (4 - 1)
    assert all(s["kind"] in ("eager", "prefill_graph", "graph", "graph_pieces") for s in launched)


def test_serve_args():
    """`python -m minisgl.server` and `python -m minisgl serve` share one parser's flags (SGLang's names)."""
    from minisgl.server import build_parser
    args = build_parser().parse_args(["--model", "m", "--port", "8001", "--page-size", "4",
                                      "--disable-overlap-schedule", "--context-length", "256"])
    assert (args.model, args.host, args.port) == ("m", "127.0.0.1", 8001)
    assert engine_kwargs_from_args(args) == {"page_size": 4, "overlap": False, "max_model_len": 256}


# --- signals -------------------------------------------------------------------------------------------
def _serve_cmd(model: str, port: int) -> list[str]:
    main = REPO / "minisgl" / "__main__.py"
    module = ["-m", "minisgl", "serve"] if main.exists() and "serve" in main.read_text() else \
        ["-m", "minisgl.server"]
    return [sys.executable, *module, "--model", model, "--port", str(port), "--served-model-name", "tiny",
            "--shutdown-timeout", "1", "--kv-cache-tokens", "4096", "--log-level", "warning",
            "--disable-overlap-schedule", "--chunked-prefill-size", "64"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _started_or_failed(proc, url: str, timeout: float = 120) -> str:
    """Wait until the server answers or exits; "address in use" when it could not bind its port."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return "up"
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    if proc.poll() is not None:
        out = proc.stdout.read().decode(errors="replace")
        proc.stdout = io.BytesIO(out.encode())  # the test reads it again for its assertion message
        return "address in use" if "address already in use" in out else "exited"
    return "timeout"


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_signal_mid_stream_exits_cleanly(model_path, sig):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for _attempt in range(3):  # a free port can be taken (by any process's outgoing connection) before we bind
        port = _free_port()
        proc = subprocess.Popen(_serve_cmd(model_path, port), cwd=REPO, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if _started_or_failed(proc, f"http://127.0.0.1:{port}") != "address in use":
            break
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 6:
                    t0 = time.monotonic()
                    proc.send_signal(sig)
        # the stream ended properly (finished or aborted by the shutdown), with [DONE]
        events = sse_events("\n".join(lines))
        assert events[-1]["choices"][0]["finish_reason"] in ("length", "abort")
        code = proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        out = proc.stdout.read().decode(errors="replace")
        assert code in (0, -sig), out
        assert elapsed < 10, elapsed
        assert "Traceback" not in out, out
        with pytest.raises(ProcessLookupError):  # nothing left in the server's process group
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the engine loop on its own ------------------------------------------------------------------------
def test_engine_loop_drains_commands_for_its_budget_then_steps():
    """A flood of "add" frames: with a budget the loop applies frames until it has passed, then returns to step;
    without one it reads every frame waiting. The frames left are read by the next turn, in order."""
    import pickle
    from multiprocessing import Pipe

    from minisgl import SamplingParams
    from minisgl.server.engine_process import EngineLoop

    class SlowAdds(_FakeEngine):
        def add_requests(self, ids, params):
            time.sleep(0.002)  # what a 1k-token add costs the engine loop on a slow host, a few times over
            return super().add_requests(ids, params)

    ours, theirs = Pipe(duplex=True)
    loop = EngineLoop(SlowAdds(fail_at_step=-1), theirs)
    for rid in range(40):
        ours.send_bytes(pickle.dumps([("add", rid, [1, 2, 3], SamplingParams())]))
    assert loop._drain(0.0, budget_s=0.01) and 1 <= len(loop.live) < 10
    first = len(loop.live)
    assert loop._drain(0.0) and len(loop.live) == 40  # no budget: every frame waiting
    assert list(loop.live) == list(range(40)) and first > 0


class _FakeEngine:
    """Just enough of Engine for EngineLoop: each step gives every request a token; step `fail_at_step`
    raises, the way a bug in the engine would."""

    def __init__(self, fail_at_step: int) -> None:
        from types import SimpleNamespace
        self.fail_at_step, self.steps, self.reqs = fail_at_step, 0, []
        self.scheduler = SimpleNamespace(running=self.reqs, waiting=[])
        self.allocator = SimpleNamespace(capacity=10, num_free=10)
        self.cache = SimpleNamespace(evictable_pages=0)
        self.stats = {"steps": 0}

    @property
    def has_work(self):
        return bool(self.reqs)

    def add_request(self, ids, params):
        from types import SimpleNamespace
        if not ids:
            raise ValueError("the prompt is empty")
        req = SimpleNamespace(output_ids=[], output_logprobs=[], finished=False, finish_reason=None, error=None)
        self.reqs.append(req)
        return req

    def add_requests(self, ids, params):  # what EngineLoop calls: a request's n streams (here n = 1)
        return [self.add_request(ids, params)]

    def abort(self, req):
        req.finished, req.finish_reason = True, "abort"
        self.reqs.remove(req)

    def step(self):
        self.steps += 1
        self.stats["steps"] = self.steps
        if self.steps >= self.fail_at_step:
            raise RuntimeError("simulated engine bug")
        for r in self.reqs:
            r.output_ids.append(7)
        return []


def test_engine_failure_fails_requests_instead_of_hanging():
    """The loop and the client over a real pipe (the loop on a thread here): a refused request gets an "invalid"
    error, a step that raises fails the open request with the error ("internal") and ends the loop with
    status 1, and the client refuses later requests at once ("unavailable")."""
    import asyncio
    import threading
    from multiprocessing import Pipe

    from minisgl import SamplingParams
    from minisgl.server.engine_client import EngineClient, RequestHandle
    from minisgl.server.engine_process import EngineLoop

    ours, theirs = Pipe(duplex=True)
    exit_code = []
    loop_thread = threading.Thread(target=lambda: exit_code.append(
        EngineLoop(_FakeEngine(fail_at_step=3), theirs, heartbeat_s=0.05).run()), daemon=True)
    loop_thread.start()
    client = EngineClient(config=None, watchdog_timeout=5.0, heartbeat_s=0.05)
    client.conn, client.healthy = ours, True

    async def collect(h):
        return [d async for d in h.events()]

    async def run():
        await client.attach()
        bad = RequestHandle([], SamplingParams())
        client.submit(bad)
        bad_events = await asyncio.wait_for(collect(bad), timeout=10)
        good = RequestHandle([1, 2], SamplingParams())
        client.submit(good)
        events = await asyncio.wait_for(collect(good), timeout=10)
        late = RequestHandle([1], SamplingParams())
        client.submit(late)  # the engine is gone: refused at once
        late_events = await asyncio.wait_for(collect(late), timeout=10)
        return bad_events, events, late_events

    bad_events, events, late_events = asyncio.run(run())
    assert bad_events[-1].finish.kind == "invalid" and "empty" in bad_events[-1].error
    assert sum(len(d.token_ids) for d in events) == 2  # two steps worked, the third raised
    assert events[-1].finish.kind == "internal" and "simulated engine bug" in events[-1].error
    assert late_events[-1].finish.kind == "unavailable" and "simulated engine bug" in late_events[-1].error
    assert not client.healthy and client.fatal_error is not None
    loop_thread.join(5)
    assert exit_code == [1]
