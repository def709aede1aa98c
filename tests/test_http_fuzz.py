"""A property-based fuzz test of the HTTP layer (issue 28): random bytes, and random JSON shaped like the OpenAI
schemas (the right field names with values of every kind, unknown fields, lone surrogates, truncated or
corrupted encodings), posted to the real `python -m minisgl serve` as a client would.

The properties: no answer is a 5xx; every 4xx is in the OpenAI error shape; every 200 is a well-formed
completion (or an event stream that ends with [DONE]); afterwards the engine still serves and every KV page is
back, and the server's log holds no traceback. The run is derandomized (the same cases every time), so a
failure reproduces; the number of cases and the time taken are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_http_faults import all_pages_back, start_server, still_serves, stop_server

NUM_CASES = 750

ENDPOINTS = ["/v1/completions", "/v1/chat/completions"]
SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.one_of(st.text(max_size=40), st.text(max_size=40), st.text(st.one_of(st.characters(), SURROGATES),
                                                                      max_size=12),
                 st.sampled_from(["", " ", "The function returns", "\x00", "\u2028", "\U0001f600" * 3]))
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, -1, 1, 2**63, 2**63 - 1, 2**64, 1e308, -0.0, 0.5]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
ANY_JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)


def sometimes_valid(valid, invalid=ANY_JSON):
    return st.one_of(valid, valid, invalid)


SMALL_MAX_TOKENS = st.integers(1, 2)
SAMPLING = {
    "max_tokens": sometimes_valid(SMALL_MAX_TOKENS, st.one_of(st.integers(-5, 0), st.integers(10**6, 2**70),
                                                             ANY_JSON)),
    "temperature": sometimes_valid(st.floats(0, 2), NUMBERS), "top_p": sometimes_valid(st.floats(0.01, 1)),
    "top_k": sometimes_valid(st.integers(-1, 50), NUMBERS), "min_p": sometimes_valid(st.floats(0, 1)),
    "seed": sometimes_valid(st.integers(0, 2**63 - 1), NUMBERS), "stream": st.booleans(),
    "stop": sometimes_valid(st.one_of(TEXT, st.lists(TEXT, max_size=18))), "n": ANY_JSON,
    "stream_options": sometimes_valid(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": st.booleans(), "presence_penalty": NUMBERS, "logit_bias": ANY_JSON, "user": TEXT,
    "logprobs": ANY_JSON, "echo": ANY_JSON, "response_format": ANY_JSON, "tools": ANY_JSON, "max_token": NUMBERS,
}
PROMPT = st.one_of(TEXT, st.lists(st.integers(-3, 5000), max_size=40), st.lists(st.integers(0, 300), max_size=300),
                   st.lists(TEXT, max_size=3), st.lists(st.lists(st.integers(0, 100), max_size=3), max_size=3),
                   ANY_JSON)
PART = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                 st.fixed_dictionaries({"type": TEXT, "image_url": ANY_JSON}), ANY_JSON)
MESSAGE = st.one_of(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant", "tool"]), TEXT)},
    optional={"content": st.one_of(TEXT, st.lists(PART, max_size=3), st.none(), NUMBERS), "name": TEXT,
              "tool_calls": ANY_JSON}), ANY_JSON)


VALID_TEXT = st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "Zs"]), min_size=1, max_size=30)
VALID_PROMPT = st.one_of(VALID_TEXT, st.lists(st.integers(0, 4095), min_size=1, max_size=30))
VALID_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": VALID_TEXT}), min_size=1, max_size=3)


@st.composite
def openai_shaped(draw) -> tuple[str, dict]:
    """(endpoint, body): a valid request (the model, a prompt or messages, a small max_tokens, a few sampling
    fields, each valid or not), then 0-3 wild edits: a field set to any JSON value, a field dropped, an
    unknown field added."""
    endpoint = draw(st.sampled_from(ENDPOINTS))
    body: dict = {"model": "tiny"}
    if endpoint == ENDPOINTS[0]:
        body["prompt"] = draw(sometimes_valid(VALID_PROMPT, PROMPT))
    else:
        body["messages"] = draw(sometimes_valid(VALID_MESSAGES, st.one_of(st.lists(MESSAGE, max_size=4), ANY_JSON)))
    # a chat request without a limit would generate up to the context: every body starts with a small one
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"])) if endpoint == ENDPOINTS[1]
         else "max_tokens"] = draw(SMALL_MAX_TOKENS)
    if draw(st.integers(0, 2)) == 0:
        body["stream"] = True
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=4, unique=True)):
        if name != "max_tokens":
            body[name] = draw(SAMPLING[name])
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):
        edit = draw(st.sampled_from(["set", "drop", "add"]))
        if edit == "set" and body:
            body[draw(st.sampled_from(sorted(body)))] = draw(ANY_JSON)
        elif edit == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        else:
            body[draw(TEXT)] = draw(ANY_JSON)
    return endpoint, body


def encode(draw, body: dict) -> bytes:
    """JSON in one of several spellings (escaped or raw UTF-8, with raw surrogate bytes), sometimes damaged."""
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=False)
    raw = text.encode("utf-8", "surrogatepass")
    damage = draw(st.sampled_from(["none"] * 10 + ["truncate", "flip", "utf16"]))
    if damage == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif damage == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1:]
    elif damage == "utf16":
        raw = text.encode("utf-16-le", "surrogatepass")
    return raw


@st.composite
def cases(draw) -> tuple[str, str, bytes]:
    kind = draw(st.sampled_from(["bytes", "json", "json", "json", "json", "path"]))
    if kind == "bytes":
        return "POST", draw(st.sampled_from(ENDPOINTS)), draw(st.binary(max_size=300))
    if kind == "path":
        name = draw(st.text(max_size=20)).encode("utf-8", "surrogatepass")
        return "GET", "/v1/models/" + "".join(f"%{b:02X}" for b in name), b""
    endpoint, body = draw(openai_shaped())
    return "POST", endpoint, encode(draw, body)


def check_answer(r: httpx.Response, stream_lines: list[str] | None) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
    elif stream_lines is not None:
        assert stream_lines and stream_lines[-1] == "data: [DONE]", stream_lines[-3:]
        for line in stream_lines[:-1]:
            event = json.loads(line[len("data: "):])
            assert "choices" in event or set(event.get("error", {})) == {"message", "type", "param", "code"}, event
    else:
        data = r.json()
        assert "choices" in data or data.get("object") == "model", data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("http-fuzz"))
    yield srv
    stop_server(srv)  # and no traceback in its log


def test_fuzz_http_layer(server):
    seen: Counter = Counter()
    codes: Counter = Counter()
    with httpx.Client(base_url=server.url, timeout=120, headers={"content-type": "application/json"}) as http:

        @settings(max_examples=NUM_CASES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(case=cases())
        def one(case):
            method, path, raw = case
            if method == "GET":
                r, lines = http.get(path), None
            else:
                with http.stream("POST", path, content=raw) as r:
                    lines = None
                    if r.headers.get("content-type", "").startswith("text/event-stream"):
                        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                    else:
                        r.read()
            check_answer(r, lines)
            seen[r.status_code] += 1
            kind = r.json()["error"]["code"] if r.status_code >= 400 else "stream" if lines is not None else "json"
            codes[f"{r.status_code} {kind}"] += 1

        t0 = time.monotonic()
        one()
        elapsed = time.monotonic() - t0
    print(f"\nfuzz: {sum(seen.values())} cases in {elapsed:.1f} s; statuses {dict(sorted(seen.items()))}; "
          f"answers {dict(codes.most_common())}")
    # the cases reached every layer: JSON parsing, the schema, the model check, the engine (plain and streamed)
    assert sum(seen.values()) == NUM_CASES and codes["400 invalid_json"] and codes["404 model_not_found"], codes
    assert codes["200 json"] and codes["200 stream"] and len(codes) >= 8, codes
    all_pages_back(server.url)
    still_serves(server.url)
