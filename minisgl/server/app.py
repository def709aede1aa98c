"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health.

This is the front process: HTTP, JSON, tokenization, incremental detokenization and stop strings. The engine
runs in a process of its own (`engine_process`), reached through `EngineClient`, so none of this work competes
with the step loop for a GIL.

Every request is checked before the engine sees it (JSON, schema, model name, prompt size, context length,
sampling ranges), so a bad request is a 4xx with an OpenAI-style error body and never reaches the engine
thread. A request the engine accepts is streamed back as its tokens resolve; a client that goes away has its
request aborted at once, which frees its KV pages on the engine's next loop iteration.

The event loop never does work that grows with the size of a request's text: a prompt longer than the
context could possibly hold is refused by its length in characters before it is tokenized, and the chat
template, tokenization (batched under a burst: `PromptEncoder`) and the final detokenization run on a small
thread pool (`ServerState.executor`; the Rust tokenizer releases the GIL while it works), so `/health` and
other streams keep being answered while a large prompt is encoded.

The pieces are module-level functions of a `ServerState` (parse_request, sampling_params_for, render_chat,
to_api_error, ...), testable without HTTP; `create_app` only wires them to routes and error handlers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minisgl.errors import RequestError
from minisgl.sampling_params import SamplingParams
from minisgl.server.detokenizer import TextStream
from minisgl.server.engine_client import EngineClient, RequestHandle
from minisgl.server.logprobs import chat_logprobs, completion_logprobs
from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_json_object,
    structured_output_of,
    validation_error,
)
from minisgl.server.step_outputs import Finish
from minisgl.stop_strings import StopStringScanner

logger = logging.getLogger("minisgl.server")

MAX_BODY_BYTES = 8 << 20
# Tokenization, chat templates, final decodes and large bodies of concurrent requests. The Rust tokenizer releases
# the GIL: encoding 256 prompts of 256-1024 tokens took 0.98 ms a prompt on one thread and 0.52 on two (2 cores).
# A quarter of the cores, 2 to 8, leaves the rest to the event loop, the engine process and its ranks.
TOKENIZER_THREADS = max(2, min(8, (os.cpu_count() or 2) // 4))
PARSE_INLINE_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop (well under a millisecond)


def max_chars_per_token(tokenizer) -> int:
    """At most how many characters of text one token stands for: the longest token string of the vocabulary
    (byte-level and SentencePiece token strings have at least one character per character of text they
    cover), doubled when the tokenizer normalizes text first (NFC can fold several characters into one)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest * (1 if backend is not None and backend.normalizer is None else 2)


@dataclass
class ServerState:
    engine: EngineClient  # the engine process (tests: anything with `info`, `submit`, `healthy`, ...)
    tokenizer: Any  # read-only use on the event loop and the executor's threads; None: token ids only
    model_name: str
    model_aliases: frozenset = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    bad_requests: int = 0
    max_prompt_chars: int | None = None  # None: the context times max_chars_per_token (a sure refusal)
    executor: concurrent.futures.ThreadPoolExecutor = field(default_factory=lambda: (
        concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="minisgl-tokenize")))
    prompts: PromptEncoder | None = None  # prompt texts to ids, batched under load (None: no tokenizer)

    def __post_init__(self) -> None:
        if self.max_prompt_chars is None and self.tokenizer is not None:
            self.max_prompt_chars = self.max_model_len * max_chars_per_token(self.tokenizer)
        if self.prompts is None and self.tokenizer is not None:
            self.prompts = PromptEncoder(self.tokenizer, self.executor, TOKENIZER_THREADS)

    @property
    def info(self):
        """The engine's limits (EngineInfo): context length, KV capacity, vocabulary, check_request."""
        return self.engine.info

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    async def run_blocking(self, fn: Callable, *args):
        """fn(*args) on the tokenizer threads, so the event loop keeps serving meanwhile (inline once the pool
        has been shut down, at the very end of a shutdown)."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))
        except RuntimeError:  # cannot schedule new futures after shutdown
            return fn(*args)
        return await future


# --- checking a request (no HTTP needed) -----------------------------------------------------------------
def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name and name not in state.model_aliases:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")


def _prompt_too_long(state: ServerState, n: int, unit: str, limit: int, why: str, param: str) -> APIError:
    return APIError(400, f"the prompt is {n:,} {unit} long; this model's maximum context length is "
                         f"{state.max_model_len:,} tokens, so at most {limit:,} {unit} are accepted{why}",
                    param=param, code="context_length_exceeded")


def _text_length(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # text parts
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def check_prompt_size(state: ServerState, body: dict, schema) -> None:
    """Refuse a prompt that cannot fit in the context by its raw size, before it is validated or tokenized:
    a token-id list of max_model_len or more ids, or text longer than max_prompt_chars characters."""
    ctx, limit = state.max_model_len, state.max_prompt_chars
    why = f" (the context times {limit // ctx} characters per token at most)" if limit else ""
    if schema is CompletionRequest:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and len(prompt) >= ctx and not any(isinstance(t, (str, list)) for t in prompt[:2]):
            raise _prompt_too_long(state, len(prompt), "tokens", ctx - 1, "", "prompt")
        if isinstance(prompt, str) and limit and len(prompt) > limit:
            raise _prompt_too_long(state, len(prompt), "characters", limit, why, "prompt")
    elif limit and isinstance(body.get("messages"), list):
        n = sum(_text_length(m.get("content")) for m in body["messages"] if isinstance(m, dict))
        if n > limit:
            raise _prompt_too_long(state, n, "characters", limit, why, "messages")


def _body_too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")


def parse_request(state: ServerState, raw: bytes, schema, yield_gil: bool = False):
    """The request body as a checked CompletionRequest / ChatCompletionRequest, or APIError."""
    if len(raw) > MAX_BODY_BYTES:
        raise _body_too_large()
    body = parse_json_object(raw, yield_gil)
    check_prompt_size(state, body, schema)
    try:
        req = schema.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    check_model(state, req.model)
    return req


def to_api_error(err: RequestError, prompt_param: str = "prompt", max_tokens_param: str = "max_tokens"
                 ) -> APIError:
    """An engine RequestError as a 400, its parameter named as this endpoint names it."""
    param = {"prompt": prompt_param, "max_tokens": max_tokens_param}.get(err.param, err.param)
    return APIError(400, err.message, param=param, code=err.code)


def sampling_params_for(state: ServerState, req, ids: list[int], max_tokens: int | None, default_max: int | None,
                        prompt_param: str, max_tokens_param: str = "max_tokens", logprobs: int | None = None
                        ) -> SamplingParams:
    """The request's SamplingParams, checked by the engine (without running anything), or APIError(400)."""
    n, ctx = len(ids), state.max_model_len
    if n >= ctx:
        raise APIError(400, f"this model's maximum context length is {ctx} tokens, but the prompt has "
                            f"{n} tokens", param=prompt_param, code="context_length_exceeded")
    room = min(ctx, state.info.kv_capacity_tokens) - n
    if max_tokens is None:
        max_tokens = room if default_max is None else max(1, min(default_max, room))
    elif max_tokens > ctx - n:
        raise APIError(400, f"max_tokens={max_tokens} is too large: the prompt has {n} tokens and the "
                            f"context holds {ctx}, so at most {ctx - n} new tokens fit",
                       param=max_tokens_param, code="context_length_exceeded")
    given = {name: getattr(req, name) for name in ("temperature", "top_p", "top_k", "min_p", "seed", "n",
                                                 "frequency_penalty", "presence_penalty", "repetition_penalty",
                                                 "logit_bias")}
    try:  # SamplingParams checks every value (the one validation); a field left out keeps its default
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), stop=tuple(req.stop or ()),
                                logprobs=logprobs, structured_output=structured_output_of(req.response_format),
                                **{name: v for name, v in given.items() if v is not None})
        state.info.check_request(ids, params)
    except RequestError as e:
        err = to_api_error(e, prompt_param, max_tokens_param)
        if err.param == "logprobs" and isinstance(req, ChatCompletionRequest):
            err.param = "top_logprobs"  # chat's count of them
        raise err from None
    return params


async def checked_params(state: ServerState, req, *args, **kw) -> SamplingParams:
    """sampling_params_for, on the tokenizer threads when the request has a grammar: compiling one (checked and
    cached here, before the request is queued) can take a good part of a second on a large vocabulary."""
    if req.response_format is None or req.response_format.get("type") == "text":
        return sampling_params_for(state, req, *args, **kw)
    return await state.run_blocking(functools.partial(sampling_params_for, state, req, *args, **kw))


def engine_error(finish: Finish) -> APIError:
    """A failed request's Finish (the engine refused it, failed it, or is gone) as an APIError."""
    if finish.kind == "invalid":
        return APIError(400, finish.error, param=finish.param, code=finish.code)
    if finish.kind == "unavailable":
        return APIError(503, finish.error, type="server_error", code=finish.code or "unavailable")
    return APIError(500, finish.error or "internal error", type="server_error", code="internal_error")


# --- text <-> tokens (blocking: run them with state.run_blocking) ---------------------------------------
TRIM_AFTER_CHARS = 256 << 10  # after encoding this much text, hand freed heap memory back to the OS


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


def release_freed_memory() -> None:
    """Return the heap's free pages to the OS (glibc's malloc_trim; nothing elsewhere).

    Why: encoding a long text makes about a million small allocations (the Rust tokenizer's per-token data,
    Python's int objects). Once freed they sit in holes of the malloc heap that glibc never gives back, so
    the server's RSS rose with every large prompt (372 MB -> 1,041 MB in issue 15); MALLOC_ARENA_MAX and
    a fixed mmap threshold do not help (these are small blocks), malloc_trim does. It costs a few ms,
    paid only after a large input, on the tokenizer thread."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def encode_text(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(text) >= TRIM_AFTER_CHARS:
        release_freed_memory()
    return ids


def batch_backend(tokenizer):
    """The Rust tokenizer under a transformers fast tokenizer, when `encode_batch` on it gives what
    `tokenizer.encode(text, add_special_tokens=False)` gives (no padding or truncation set on it); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(backend, "padding", None) or getattr(backend, "truncation", None):
        return None
    return backend


class PromptEncoder:
    """Prompt texts to token ids on the tokenizer threads, batched under load.

    A text starts encoding at once while fewer than `slots` encodes are under way; the texts that arrive while
    every slot is busy wait, and the next slot to free encodes all of them with one `encode_batch` (the Rust
    tokenizer's own threads, the GIL released). A lone prompt waits for nobody; a burst of 512 prompts is
    encoded in a few large batches, on every core, instead of one prompt at a time on a few threads (on 2 cores:
    0.23 s for 512 prompts of ~700 tokens, against 0.46 s on two threads). Runs on the event loop's thread."""

    def __init__(self, tokenizer, executor: concurrent.futures.Executor, slots: int, max_batch: int = 32) -> None:
        self.tokenizer, self.executor, self.slots, self.max_batch = tokenizer, executor, slots, max_batch
        self.backend = batch_backend(tokenizer)
        self.waiting: list[tuple[str, asyncio.Future]] = []
        self.busy = 0

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((text, future))
        if self.busy < self.slots:
            self._start(loop)
        return await future

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        batch, self.waiting = self.waiting[:self.max_batch], self.waiting[self.max_batch:]
        self.busy += 1
        try:
            job = loop.run_in_executor(self.executor, self.encode_all, [text for text, _ in batch])
        except RuntimeError:  # the pool has been shut down (the very end of a shutdown): inline
            job = loop.create_future()
            job.set_result(self.encode_all([text for text, _ in batch]))
        job.add_done_callback(lambda done: self._finish(loop, batch, done))

    def _finish(self, loop: asyncio.AbstractEventLoop, batch: list, job: asyncio.Future) -> None:
        self.busy -= 1
        if job.cancelled():  # the pool was shut down with the job queued (the end of a shutdown)
            for _, future in batch:
                future.cancel()
            return
        results = job.exception() or job.result()
        for i, (_, future) in enumerate(batch):
            if future.done():  # its request has gone (the client disconnected)
                continue
            outcome = results if isinstance(results, BaseException) else results[i]
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if self.waiting and self.busy < self.slots:
            self._start(loop)

    def encode_all(self, texts: list[str]) -> list:
        """Each text's ids, or the exception encoding it raised (so one bad text fails only its request)."""
        if self.backend is not None and len(texts) > 1:
            try:
                ids = [list(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=False)]
            except Exception:
                ids = None  # find the culprit one text at a time
            if ids is not None:
                if max(map(len, texts)) >= TRIM_AFTER_CHARS:
                    release_freed_memory()
                return ids
        out: list = []
        for text in texts:
            try:
                out.append(encode_text(self.tokenizer, text))
            except Exception as e:
                out.append(e)
        return out


def render_chat(tokenizer, req: ChatCompletionRequest) -> str:
    """The conversation through the chat template, as text; APIError when the template refuses it."""
    try:
        return tokenizer.apply_chat_template(req.conversation(), tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None


class _NoTokenizerStream:
    """For a model without a tokenizer: no text, only token counts."""

    stopped = False

    def __init__(self) -> None:
        self.num_tokens = 0

    def push(self, ids) -> str:
        self.num_tokens += len(ids)
        return ""

    def finish(self) -> str:
        return ""


# --- responses -------------------------------------------------------------------------------------------
def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of strings; calls `on_disconnect` when the client leaves.

    A task listens for `http.disconnect` while the body streams, so a client that vanishes while its
    request is still queued (nothing to send yet) is noticed at once, not at the next write.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], on_disconnect: Callable[[], None]) -> None:
        self.body_iterator = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.on_disconnect()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away mid-write
            self.on_disconnect()
        finally:
            watcher.cancel()
            await self.body_iterator.aclose()


async def _watch_disconnect(request: Request, cancel: Callable[[], None]) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel()
            return


async def generate(state: ServerState, handle: RequestHandle, ts, stops: StopStringScanner | None = None):
    """Run one (submitted) request: yields (text piece, None, token ids, logprob entries) as text settles or
    tokens with logprobs arrive, then (tail, finish_reason, [], []) once.

    Stop strings are found here, not in the engine: `stops` runs the offline engine's per-token check on the
    tokens as they arrive, and the output ends at the token where it first fires (the same tokens, text and
    usage as `LLM.generate`); the engine, told to stop, may have run a step or two further, which is dropped."""
    reason = None
    try:
        async for delta in handle.events():
            if delta.error is not None:
                raise engine_error(delta.finish)
            ids = delta.token_ids
            entries = (delta.extras or {}).get("output_logprobs") or []
            if stops is not None and ids:
                hit = stops.feed(ids)
                if hit >= 0:
                    ids, entries, reason = ids[:hit + 1], entries[:hit + 1], "stop"
            piece = ts.push(ids)
            if piece or entries:
                yield piece, None, ids, entries
            if reason is not None or ts.stopped:  # a stop string: end here, and stop the engine
                handle.cancel("stop")
                reason = "stop"
                break
            if delta.finish is not None:
                reason = delta.finish.reason
                break
        tail = await state.run_blocking(ts.finish)  # decodes the whole output once
        if ts.stopped:
            reason = "stop"
        yield tail, reason or "abort", [], []
    finally:
        handle.cancel()  # no-op once the request has finished


@dataclass
class Choice:
    """One stream's answer, gathered (non-streamed responses)."""

    text: str = ""
    reason: str | None = None
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


async def _gather(state: ServerState, handle: RequestHandle, ts, stops, choice: Choice) -> None:
    parts = []
    async for piece, finish, token_ids, entries in generate(state, handle, ts, stops):
        parts.append(piece)
        choice.token_ids += token_ids
        choice.logprobs += entries
        choice.reason = finish or choice.reason
    choice.text = "".join(parts)


async def respond(state: ServerState, request: Request, req, ids: list[int], params: SamplingParams, chunk, full,
                  first: Callable[[int], dict] | None = None, received: float | None = None):
    """Submit the request's `params.n` streams (one engine group: the prompt is prefilled once) and answer
    them: one JSON body, or server-sent events when req.stream, the choices' events interleaved as they come.
    chunk(index, text, reason, token_ids, logprob entries) -> one event; full(choices, usage) -> the body.
    `received`: when its handler began (time.perf_counter), for the engine's request log."""
    def scanner():
        return StopStringScanner(state.tokenizer, params.stop) if params.stop else None

    try:
        stops = [scanner() for _ in range(params.n)]
    except RequestError as e:
        raise to_api_error(e) from None
    handles = [RequestHandle(ids, params, received) for _ in range(params.n)]
    streams = [TextStream(state.tokenizer, params.stop) if state.tokenizer is not None else _NoTokenizerStream()
               for _ in handles]

    def cancel_all() -> None:
        for h in handles:
            h.cancel()

    def usage() -> dict:
        return _usage(len(ids), sum(ts.num_tokens for ts in streams))

    if not req.stream:
        watcher = asyncio.ensure_future(_watch_disconnect(request, cancel_all))
        state.engine.submit(handles)
        choices = [Choice() for _ in handles]
        try:
            await asyncio.gather(*(_gather(state, h, ts, sc, c) for h, ts, sc, c in zip(handles, streams, stops,
                                                                                        choices)))
        finally:
            watcher.cancel()
            cancel_all()
        return JSONResponse(full(choices, usage()))

    include_usage = req.include_usage

    async def events():
        tasks = []

        async def interleaved():
            """(stream index, item) as the streams' items come. A single stream, the usual request, is read
            directly; several are pumped by a task each into one queue."""
            if len(handles) == 1:
                async with contextlib.aclosing(generate(state, handles[0], streams[0], stops[0])) as stream:
                    async for item in stream:
                        yield 0, item
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    async for item in generate(state, handles[i], streams[i], stops[i]):
                        await queue.put((i, item, None))
                except APIError as e:
                    await queue.put((i, None, e))
                finally:
                    await queue.put((i, None, None))  # this stream is done

            tasks.extend(asyncio.ensure_future(pump(i)) for i in range(len(handles)))
            open_streams = len(tasks)
            while open_streams:
                i, item, error = await queue.get()
                if error is not None:
                    raise error
                if item is None:
                    open_streams -= 1
                    continue
                yield i, item

        items = interleaved()
        try:
            if first is not None:
                for i in range(len(handles)):
                    yield _sse(first(i))
            state.engine.submit(handles)
            async for i, (piece, reason, token_ids, entries) in items:
                if piece or reason or entries:
                    yield _sse(chunk(i, piece, reason, token_ids, entries))
            if include_usage:
                last = chunk(0, "", None, [], [])
                last["choices"] = []
                last["usage"] = usage()
                yield _sse(last)
        except APIError as e:
            yield _sse(e.body())
        finally:
            cancel_all()
            for t in tasks:
                t.cancel()
            await items.aclose()
        yield "data: [DONE]\n\n"

    return EventStreamResponse(events(), cancel_all)


async def read_request(state: ServerState, request: Request, schema):
    """Read, parse and check the body; a large one is parsed on the tokenizer threads."""
    check_available(state)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise _body_too_large()  # before reading it
    raw = await request.body()
    if len(raw) < PARSE_INLINE_BYTES:
        return parse_request(state, raw, schema)
    try:
        return await state.run_blocking(parse_request, state, raw, schema, True)
    finally:
        await state.run_blocking(release_freed_memory)


async def completions(state: ServerState, request: Request):
    received = time.perf_counter()
    req: CompletionRequest = await read_request(state, request, CompletionRequest)
    if isinstance(req.prompt, str):
        if state.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                           param="prompt")
        ids = await state.prompts.encode(req.prompt)
    else:
        ids = list(req.prompt)
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="prompt")
    params = await checked_params(state, req, ids, req.max_tokens, 16, "prompt", logprobs=req.logprobs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    tok = state.tokenizer
    offsets = [0] * params.n  # where each choice's next token starts in its text (logprobs' text_offset)

    def choice(i: int, text: str, reason: str | None, token_ids: list, entries: list) -> dict:
        lp = None
        if params.logprobs is not None:
            lp, offsets[i] = completion_logprobs(tok, token_ids, entries, offsets[i])
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

    def chunk(i: int, text: str, reason: str | None, token_ids: list, entries: list) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [choice(i, text, reason, token_ids, entries)]}

    def full(choices: list[Choice], usage: dict) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": [choice(i, c.text, c.reason, c.token_ids, c.logprobs) for i, c in enumerate(choices)],
                "usage": usage}

    return await respond(state, request, req, ids, params, chunk, full, received=received)


async def chat_completions(state: ServerState, request: Request):
    received = time.perf_counter()
    req: ChatCompletionRequest = await read_request(state, request, ChatCompletionRequest)
    tok = state.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    ids = await state.prompts.encode(await state.run_blocking(render_chat, tok, req))
    if req.max_completion_tokens is not None:
        max_tokens, max_param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    params = await checked_params(state, req, ids, max_tokens, None, "messages", max_param,
                                  logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def logprobs(token_ids: list, entries: list) -> dict | None:
        return None if params.logprobs is None else {"content": chat_logprobs(tok, token_ids, entries)}

    def chunk(i: int, text: str | None, reason: str | None, token_ids: list, entries: list,
              role: bool = False) -> dict:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs(token_ids, entries) if entries else None,
                             "finish_reason": reason}]}

    def full(choices: list[Choice], usage: dict) -> dict:
        return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                             "logprobs": logprobs(c.token_ids, c.logprobs), "finish_reason": c.reason}
                            for i, c in enumerate(choices)],
                "usage": usage}

    return await respond(state, request, req, ids, params, chunk, full,
                         first=lambda i: chunk(i, None, None, [], [], role=True), received=received)


def check_available(state: ServerState) -> None:
    """APIError(503) when the engine is gone (killed, crashed, frozen) or the server is shutting down: before
    any work, so a streaming request is refused with a status too, not with a 200 and an error event."""
    engine = state.engine
    if not engine.healthy or engine.fatal_error is not None:
        raise APIError(503, engine.fatal_error or "the engine is not running", "server_error",
                       code="engine_unavailable")
    if state.shutting_down or engine.refusing:
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")


def health(state: ServerState) -> dict:
    check_available(state)
    return {"status": "ok"}


def model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minisgl",
            "max_model_len": state.max_model_len}


# --- errors: every one in the OpenAI shape ---------------------------------------------------------------
def _state_of(request: Request) -> ServerState:
    return request.app.state.minisgl


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    if 400 <= exc.status < 500:
        _state_of(request).bad_requests += 1
    return JSONResponse(exc.body(), status_code=exc.status)


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _state_of(request).bad_requests += 1
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return JSONResponse(error_body(f"invalid value for '{param}': {first.get('msg', 'invalid request')}",
                                   param=param, code=first.get("type")), status_code=400)


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    return JSONResponse(error_body(message, kind, None, str(exc.status_code)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def on_client_disconnect(request: Request, exc: ClientDisconnect) -> Response:
    return Response(status_code=499)  # the client left while sending its body; nobody reads this


async def on_internal_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None,
                                   "internal_error"), status_code=500)


# --- the app ---------------------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        await state.engine.attach()
        yield
        state.shutting_down = True
        await state.engine.shutdown()
        state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan)
    app.state.minisgl = state
    for exc_type, handler in ((APIError, on_api_error), (RequestValidationError, on_validation_error),
                              (StarletteHTTPException, on_http_error), (ClientDisconnect, on_client_disconnect),
                              (Exception, on_internal_error)):
        app.add_exception_handler(exc_type, handler)

    @app.get("/health")
    async def _health():
        return health(state)

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def _model(model_id: str):
        check_model(state, model_id)
        return model_card(state)

    @app.get("/v1/internal/stats")
    async def _internal_stats(request: Request):
        """Debugging and tests only: KV page accounting and request counters, read in the engine process
        (`?check=1`: also check the prefix cache's invariants when idle)."""
        stats = await asyncio.wrap_future(state.engine.stats(check=request.query_params.get("check") == "1"))
        return {**stats, "bad_requests": state.bad_requests}

    @app.post("/v1/completions")
    async def _completions(request: Request):
        return await completions(state, request)

    @app.post("/v1/chat/completions")
    async def _chat_completions(request: Request):
        return await chat_completions(state, request)

    return app
