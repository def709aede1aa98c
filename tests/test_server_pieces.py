"""The server's pieces without HTTP (issue 13.4): typed engine errors with their parameter, the mapping to
OpenAI error bodies, the raw-size bound before tokenizing (issue 15), request parsing, the detokenizer's bound
on held-back tokens, and the one stop-string module."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import TINY_QWEN3_ASSET
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.config import make_config
from minisgl.engine import Engine
from minisgl.errors import RequestError
from minisgl.llm import load_tokenizer
from minisgl.sampling_params import MAX_TEMPERATURE
from minisgl.server.app import (
    ServerState,
    check_model,
    engine_error,
    max_chars_per_token,
    parse_request,
    sampling_params_for,
    to_api_error,
)
from minisgl.server.detokenizer import MAX_HELD_TOKENS, TextStream
from minisgl.server.engine_process import EngineInfo
from minisgl.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from minisgl.server.step_outputs import Finish
from minisgl.server.testing import build_tokenizer, tiny_model_path
from minisgl.stop_strings import make_stop_check

KV_TOKENS = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")
    return Engine(make_config(path, kv_cache_tokens=KV_TOKENS))


@pytest.fixture(scope="module")
def state(engine):
    """The front's state without an engine process: only the engine's limits, as it reports them at start."""
    tok = load_tokenizer(engine.runner.model_path)
    s = ServerState(engine=SimpleNamespace(info=EngineInfo.of(engine)), tokenizer=tok, model_name="tiny")
    yield s
    s.executor.shutdown()


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "tiny", "prompt": [1, 2, 3], **kw})


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                 **kw})


# --- typed errors ----------------------------------------------------------------------------------------
def test_check_request_names_the_parameter(state, engine):
    """The engine's check, and the front's (EngineInfo, from the limits alone), refuse alike."""
    ctx, vocab = state.max_model_len, engine.model_config.vocab_size
    ok = SamplingParams(max_tokens=4)
    cases = [([], ok, "prompt", None), ([vocab], ok, "prompt", None), ([1] * ctx, ok, "prompt",
             "context_length_exceeded"), ([1] * 10, SamplingParams(max_tokens=ctx), "max_tokens",
             "context_length_exceeded"), ([1] * 10, SamplingParams(max_tokens=KV_TOKENS), "max_tokens",
             "context_length_exceeded")]
    for check in (engine.check_request, state.info.check_request):
        for ids, params, param, code in cases:
            with pytest.raises(RequestError) as info:
                check(ids, params)
            assert (info.value.param, info.value.code) == (param, code), (ids[:3], params, info.value)
            assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working
        check([1, 2], SamplingParams(max_tokens=4))  # and a good one passes


def test_llm_keeps_the_parameter_and_names_the_request(state):
    llm = LLM(state.info.model_path, kv_cache_tokens=KV_TOKENS)
    with pytest.raises(RequestError, match=r"^request 1: the prompt is empty") as info:
        llm.generate([[1, 2], []], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2)])
    assert info.value.param == "prompt"


def test_engine_errors_map_to_openai_bodies_without_reading_the_message():
    err = to_api_error(RequestError("whatever words", "prompt", "context_length_exceeded"), "messages")
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    err = to_api_error(RequestError("x", "max_tokens"), "messages", "max_completion_tokens")
    assert err.param == "max_completion_tokens"
    assert to_api_error(RequestError("x", "top_p")).param == "top_p"
    body = engine_error(Finish("error", "too long", "invalid", "prompt", "context_length_exceeded")).body()
    assert body == {"error": {"message": "too long", "type": "invalid_request_error", "param": "prompt",
                              "code": "context_length_exceeded"}}
    assert engine_error(Finish("error", "boom", "internal")).status == 500
    gone = engine_error(Finish("error", "the engine process was killed", "unavailable", code="engine_unavailable"))
    assert (gone.status, gone.code) == (503, "engine_unavailable")


def test_sampling_params_for_names_the_endpoint_parameters(state):
    ctx = state.max_model_len
    with pytest.raises(APIError) as info:
        sampling_params_for(state, chat(), [1] * ctx, None, None, "messages")
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    # fits the context but not the KV pool: the engine's RequestError, named as the chat endpoint names it
    req = chat(max_completion_tokens=KV_TOKENS)
    with pytest.raises(APIError) as info:
        sampling_params_for(state, req, [1] * 10, KV_TOKENS, None, "messages", "max_completion_tokens")
    assert (info.value.param, info.value.code) == ("max_completion_tokens", "context_length_exceeded")
    assert "KV pool" in info.value.message
    params = sampling_params_for(state, completion(temperature=0), [1, 2, 3], None, 16, "prompt")
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, -1, 16)
    # the sampling values are checked by SamplingParams alone (one validation), its RequestError a 400
    for field, value in [("temperature", MAX_TEMPERATURE * 2), ("temperature", -1.0), ("top_p", 5.0),
                         ("top_k", 0), ("min_p", 2.0), ("seed", 2**63)]:
        with pytest.raises(APIError) as info:
            sampling_params_for(state, completion(**{field: value}), [1, 2, 3], None, 16, "prompt")
        assert (info.value.status, info.value.param) == (400, field), info.value.message
    with pytest.raises(APIError) as info:
        sampling_params_for(state, chat(max_completion_tokens=0), [1, 2], 0, None, "messages", "max_completion_tokens")
    assert (info.value.status, info.value.param) == (400, "max_completion_tokens")


def test_stop_strings_without_a_tokenizer_name_stop():
    assert make_stop_check(None, ()) is None
    with pytest.raises(RequestError) as info:
        make_stop_check(None, ("\n",))
    assert info.value.param == "stop"


# --- parsing and the raw-size bound ----------------------------------------------------------------------
def test_parse_request_refuses_by_raw_size_before_tokenizing(state):
    limit, ctx = state.max_prompt_chars, state.max_model_len
    assert limit == ctx * max_chars_per_token(state.tokenizer)
    enc = lambda d: json.dumps({"model": "tiny", **d}).encode()  # noqa: E731
    for body, schema, param, unit in [
            ({"prompt": "a" * (limit + 1)}, CompletionRequest, "prompt", "characters"),
            ({"prompt": ["a" * (limit + 1)]}, CompletionRequest, "prompt", "characters"),
            ({"prompt": [5] * ctx}, CompletionRequest, "prompt", "tokens"),
            ({"messages": [{"role": "system", "content": "a" * limit},
                           {"role": "user", "content": [{"type": "text", "text": "b"}]}]}, ChatCompletionRequest,
             "messages", "characters")]:
        with pytest.raises(APIError) as info:
            parse_request(state, enc(body), schema)
        e = info.value
        assert (e.status, e.param, e.code) == (400, param, "context_length_exceeded"), e.message
        assert f"{ctx:,} tokens" in e.message and unit in e.message, e.message
    assert parse_request(state, enc({"prompt": "a" * limit}), CompletionRequest).prompt == "a" * limit
    with pytest.raises(APIError) as info:
        parse_request(state, enc({"model": "other", "prompt": "x"}), CompletionRequest)
    assert info.value.status == 404
    with pytest.raises(APIError):
        check_model(state, "nope")


def test_large_body_parse_yielding_the_gil_gives_the_same_request(state):
    raw = json.dumps({"model": "tiny", "prompt": list(range(1000)), "max_tokens": 3, "seed": 12}).encode()
    a = parse_request(state, raw, CompletionRequest)
    b = parse_request(state, raw, CompletionRequest, yield_gil=True)
    assert a == b and b.prompt == list(range(1000))
    with pytest.raises(APIError) as info:  # a bool where an int belongs is still refused
        parse_request(state, raw.replace(b'"seed": 12', b'"seed": true'), CompletionRequest, yield_gil=True)
    assert info.value.param == "seed"


TOK = build_tokenizer()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(min_size=1, max_size=300))
def test_the_raw_bound_never_refuses_a_text_that_fits(text):
    """Every token stands for at most max_chars_per_token characters, so a text of more than
    context x that many characters cannot fit: the bound refuses nothing that would."""
    ids = TOK.encode(text, add_special_tokens=False)
    assert len(text) <= len(ids) * max_chars_per_token(TOK)


# --- the detokenizer holds back a bounded tail -----------------------------------------------------------
def test_invalid_utf8_is_released_after_a_bounded_hold():
    lone = [i for i in range(len(TOK)) if TOK.decode([i]) == "\ufffd"]
    assert lone, "the byte-level vocabulary has lone continuation bytes"
    ts = TextStream(TOK)
    ids = [lone[0]] * (4 * MAX_HELD_TOKENS)
    pieces = []
    for t in ids:
        pieces.append(ts.push([t]))
        assert len(ts.detok._text_ids) - ts.detok._window_start <= MAX_HELD_TOKENS  # the window stays short
    assert "".join(pieces), "text of an invalid sequence is released, not held (and re-decoded) forever"
    assert "".join(pieces) + ts.finish() == TOK.decode(ids, skip_special_tokens=True)


def test_a_handle_merges_news_its_reader_has_not_taken_and_wakes_a_waiting_reader():
    """RequestHandle: news delivered while the reader is busy comes as one Delta (tokens and per-token extras
    in order, the finish last); a waiting reader wakes at the next delivery; nothing after the finish."""
    import asyncio

    from minisgl.server.engine_client import RequestHandle

    async def run():
        h = RequestHandle([1, 2], SamplingParams())
        h.deliver([5], None, {"output_logprobs": ["a"]})
        h.deliver([6, 7], None, {"output_logprobs": ["b", "c"]})
        events = h.events()
        first = await events.__anext__()
        waiting = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing new: the reader waits
        h.deliver([8], Finish("length"), {"output_logprobs": ["d"]})
        h.deliver([9], None, {"output_logprobs": ["e"]})  # after the finish: dropped
        last = await asyncio.wait_for(waiting, 5)
        rest = [d async for d in events]
        failed = RequestHandle([1], SamplingParams())  # tokens waiting, then the engine dies
        failed.deliver([4], None, {"output_logprobs": ["x"]})
        failed.deliver([], Finish("error", "gone", "unavailable"), None)
        return first, last, rest, await failed.events().__anext__()

    first, last, rest, failed = asyncio.run(run())
    assert (failed.token_ids, failed.finish.kind, failed.extras) == ([4], "unavailable", {"output_logprobs": ["x"]})
    assert (first.token_ids, first.finish, first.extras) == ([5, 6, 7], None, {"output_logprobs": ["a", "b", "c"]})
    assert (last.token_ids, last.finish.reason, last.extras) == ([8], "length", {"output_logprobs": ["d"]})
    assert rest == []


def test_commands_leave_early_in_a_long_turn_of_the_event_loop(monkeypatch):
    """EngineClient._send: commands queued in one turn go out as one frame at its end; in a turn longer than
    FLUSH_AFTER_S (a burst of arrivals) they go out as they pass that age, so the engine starts on them."""
    import asyncio
    import pickle

    from minisgl.server import engine_client
    from minisgl.server.engine_client import EngineClient

    frames = []
    writer = SimpleNamespace(is_closing=lambda: False, write=lambda b: frames.append(pickle.loads(b[4:])))

    clock = iter(range(10**6))  # a clock one second further at every reading
    monkeypatch.setattr(engine_client, "time", SimpleNamespace(monotonic=lambda: next(clock)))

    async def turn(flush_after: float, n: int) -> list[int]:
        monkeypatch.setattr(engine_client, "FLUSH_AFTER_S", flush_after)
        client = EngineClient(config=None)
        client.loop, client._writer = asyncio.get_running_loop(), writer
        frames.clear()
        for i in range(n):
            client._send(("abort", i, "abort"))
        await asyncio.sleep(0)  # the turn ends: the scheduled flush runs
        return [len(f) for f in frames]

    assert asyncio.run(turn(60.0, 5)) == [5]  # a short turn: one frame
    # a second between commands, over a bound of half a second: the outbox goes out with each second command
    assert asyncio.run(turn(0.5, 5)) == [2, 2, 1]


def test_serve_freezes_the_fronts_start_up_heap_under_gc_freeze(monkeypatch):
    """`serve` freezes what the front holds once started (torch, transformers, FastAPI), so the collections that
    streaming triggers skip it; --disable-gc-freeze leaves it to the collector."""
    import gc

    from minisgl.server import launch

    seen = []

    class Server:
        started, should_exit = True, False

        def run(self) -> None:
            seen.append(gc.get_freeze_count())

        def cancel_timers(self) -> None:
            pass

    monkeypatch.setattr(launch, "_make_server", lambda *args, **kwargs: Server())
    for freeze in (True, False):
        engine = SimpleNamespace(config=SimpleNamespace(gc_freeze=freeze), close=lambda: None, fatal_error=None)
        try:
            assert launch.serve(SimpleNamespace(engine=engine)) == 0
        finally:
            gc.unfreeze()
    assert seen[0] > 1000 and seen[1] == 0


def test_building_a_server_without_its_packages_says_what_to_install(monkeypatch):
    """build_state (notebook 11's way in) and `serve` refuse with the install line, before importing the app."""
    import sys

    from minisgl.server import launch

    monkeypatch.setitem(sys.modules, "fastapi", None)  # what a missing package looks like to import
    with pytest.raises(ImportError, match=r"minisgl\[serve\]"):
        launch.build_state("unused-model-path")


# --- prompt texts to ids, batched under a burst (PromptEncoder) -------------------------------------------
def burst_texts(tok, n: int, seed: int = 0) -> list[str]:
    import random
    rng = random.Random(seed)
    texts = ["hello world", "<|im_start|>user\nHi<|im_end|>", "ü∑´ 日本語 🤖 " * 3, "", " ", "\n\n\t"]
    texts += [tok.decode([rng.randrange(len(tok)) for _ in range(rng.randint(1, 300))]) for _ in range(n)]
    return texts


@pytest.mark.parametrize("which", ["asset", "word"])
def test_batched_encoding_gives_the_ids_one_text_at_a_time_gives(which, qwen3_tok_path):
    """encode_batch on the Rust tokenizer against transformers' encode of each text (special-token strings,
    multi-byte text, empty text, decoded random ids): the same ids."""
    import concurrent.futures

    from minisgl.server.app import PromptEncoder, encode_text
    tok = load_tokenizer(str(TINY_QWEN3_ASSET) if which == "asset" else qwen3_tok_path)
    encoder = PromptEncoder(tok, concurrent.futures.ThreadPoolExecutor(1), slots=1)
    assert encoder.backend is not None, "a fast tokenizer: the batched path is the one under test"
    texts = burst_texts(tok, 60)
    assert encoder.encode_all(texts) == [encode_text(tok, t) for t in texts]


def test_a_burst_is_encoded_in_batches_and_each_request_gets_its_own_ids():
    """With one slot, 200 texts at once: the first alone, the rest in batches of at most max_batch; every
    request gets its own text's ids, a lone text later waits for nobody, and a text the tokenizer refuses
    fails its request alone."""
    import asyncio
    import concurrent.futures

    from minisgl.server.app import PromptEncoder

    class Backend:
        padding = truncation = None

        def __init__(self):
            self.batches = []

        def encode_batch(self, texts, add_special_tokens):
            self.batches.append(len(texts))
            if "boom" in texts:
                raise ValueError("cannot encode")
            return [SimpleNamespace(ids=[len(t), ord(t[0])]) for t in texts]

    class Tokenizer:
        backend_tokenizer = Backend()

        def encode(self, text, add_special_tokens):
            if text == "boom":
                raise ValueError("cannot encode")
            return [len(text), ord(text[0])]

    tok = Tokenizer()
    encoder = PromptEncoder(tok, concurrent.futures.ThreadPoolExecutor(1), slots=1, max_batch=32)
    texts = [f"t{i}" for i in range(200)]

    async def main():
        got = await asyncio.gather(*(encoder.encode(t) for t in texts))
        boom = await asyncio.gather(encoder.encode("x"), encoder.encode("boom"), encoder.encode("yz"),
                                    return_exceptions=True)
        lone = await encoder.encode("later")
        return got, boom, lone

    got, boom, lone = asyncio.run(main())
    assert got == [[len(t), ord(t[0])] for t in texts]
    batches = tok.backend_tokenizer.batches
    assert max(batches) <= 32 and len(batches) < 20, batches  # not one encode a text
    assert boom[0] == [1, ord("x")] and isinstance(boom[1], ValueError) and boom[2] == [2, ord("y")]
    assert lone == [5, ord("l")] and encoder.busy == 0 and not encoder.waiting


def test_a_request_gone_while_its_text_waits_leaves_the_others_their_ids():
    """A handler cancelled (its client went away) while its text waits for a slot: the batch still encodes, the
    others get their ids, and nothing is set on the cancelled future."""
    import asyncio
    import concurrent.futures
    import threading

    from minisgl.server.app import PromptEncoder
    gate = threading.Event()

    class Tokenizer:
        backend_tokenizer = None  # the one-text-at-a-time path

        def encode(self, text, add_special_tokens):
            gate.wait(5)  # the first text holds the only slot until the others have queued
            return [len(text)]

    encoder = PromptEncoder(Tokenizer(), concurrent.futures.ThreadPoolExecutor(1), slots=1)

    async def main():
        first = asyncio.ensure_future(encoder.encode("a"))
        queued = [asyncio.ensure_future(encoder.encode(t)) for t in ("bb", "ccc", "dddd")]
        await asyncio.sleep(0.05)
        queued[1].cancel()
        gate.set()
        return await first, await queued[0], await queued[2], queued[1].cancelled()

    assert asyncio.run(main()) == ([1], [2], [4], True)
    assert encoder.busy == 0 and not encoder.waiting
