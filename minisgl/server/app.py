"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health.

Every request is checked on the asyncio side before the engine sees it (JSON, schema, model name, context
length, sampling ranges), so a bad request is a 4xx with an OpenAI-style error body and never reaches the
engine thread. A request the engine accepts is streamed back as its tokens resolve; a client that goes
away has its request aborted at once, which frees its KV pages on the engine's next loop iteration.
"""

from __future__ import annotations

import asyncio
import json
import logging
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

from minisgl.sampling_params import SamplingParams
from minisgl.server.detokenizer import TextStream
from minisgl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    parse_json_object,
    validation_error,
)
from minisgl.server.worker import Delta, EngineWorker, RequestHandle

logger = logging.getLogger("minisgl.server")

MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerState:
    worker: EngineWorker
    tokenizer: Any  # used on the asyncio side (encode, chat template, detokenize); None: token ids only
    stop_tokenizer: Any  # a second copy, used on the engine thread for stop strings
    model_name: str
    model_aliases: frozenset = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    bad_requests: int = 0

    @property
    def engine(self):
        return self.worker.engine  # read-only use on this side: limits and check_request (pure)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


# --- helpers ---------------------------------------------------------------------------------------------
def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def make_stop_check(tokenizer, stops: tuple[str, ...]):
    """A stop check for the engine thread: is a stop string in the decoded tail of the output?"""
    if not stops or tokenizer is None:
        return None
    window = 8 + 4 * max(len(s) for s in stops)  # a byte-level token holds at least one byte

    def check(req) -> bool:
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)
    return check


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


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def _engine_error(delta: Delta) -> APIError:
    if delta.error_kind == "invalid":
        return APIError(400, delta.error)
    if delta.error_kind == "unavailable":
        return APIError(503, delta.error, type="server_error", code="unavailable")
    return APIError(500, delta.error or "internal error", type="server_error", code="internal_error")


async def _generate(state: ServerState, handle: RequestHandle, ts: TextStream):
    """Run one request: yields (text piece, None) as text settles, then (tail, finish_reason) once."""
    state.worker.submit(handle)
    reason = None
    try:
        async for delta in handle.events():
            if delta.error is not None:
                raise _engine_error(delta)
            piece = ts.push(delta.token_ids)
            if piece:
                yield piece, None
            if ts.stopped:  # a stop string: end here (and stop the engine if its own check has not yet)
                handle.cancel()
                reason = "stop"
                break
            if delta.finish_reason is not None:
                reason = delta.finish_reason
                break
        tail = ts.finish()
        if ts.stopped:
            reason = "stop"
        yield tail, reason or "abort"
    finally:
        handle.cancel()  # no-op once the request has finished


# --- the app ---------------------------------------------------------------------------------------------
def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        state.shutting_down = True
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan)
    app.state.minisgl = state

    # -- errors: every one in the OpenAI shape --
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if 400 <= exc.status < 500:
            state.bad_requests += 1
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        state.bad_requests += 1
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return JSONResponse(error_body(f"invalid value for '{param}': {first.get('msg', 'invalid request')}",
                                       param=param, code=first.get("type")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(error_body(message, kind, None, str(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=499)  # the client left while sending its body; nobody reads this

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error", None,
                                       "internal_error"), status_code=500)

    # -- plain routes --
    @app.get("/health")
    async def health():
        if not state.worker.alive or not state.worker.healthy:
            raise APIError(503, state.worker.fatal_error or "the engine is not running", "server_error",
                           code="engine_unavailable")
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        return {"status": "ok"}

    def _model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minisgl",
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id)
        return _model_card()

    @app.get("/v1/internal/stats")
    async def internal_stats():
        """Debugging and tests only: KV page accounting and request counters, read on the engine thread."""
        stats = await asyncio.wrap_future(state.worker.stats())
        return {**stats, "bad_requests": state.bad_requests}

    # -- request checking --
    def _check_model(name: str) -> None:
        if name != state.model_name and name not in state.model_aliases:
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{state.model_name}'", param="model", code="model_not_found")

    async def _parse(request: Request, schema):
        if state.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes",
                           code="request_too_large")
        body = parse_json_object(raw)
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        _check_model(req.model)
        return req

    def _params(req, ids: list[int], max_tokens: int | None, default_max: int | None, param: str
                ) -> SamplingParams:
        n, ctx = len(ids), state.max_model_len
        if n >= ctx:
            raise APIError(400, f"this model's maximum context length is {ctx} tokens, but the prompt has "
                                f"{n} tokens", param=param, code="context_length_exceeded")
        room = min(ctx, state.engine.runner.kv_capacity_tokens) - n
        if max_tokens is None:
            max_tokens = room if default_max is None else max(1, min(default_max, room))
        elif max_tokens > ctx - n:
            raise APIError(400, f"max_tokens={max_tokens} is too large: the prompt has {n} tokens and the "
                                f"context holds {ctx}, so at most {ctx - n} new tokens fit",
                           param="max_tokens", code="context_length_exceeded")
        vocab = state.engine.model_config.vocab_size
        top_k = req.top_k
        if top_k is None or top_k in (0, -1) or top_k >= vocab:
            top_k = -1
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p), top_k=top_k, max_tokens=max_tokens,
            min_p=0.0 if req.min_p is None else float(req.min_p),
            ignore_eos=bool(req.ignore_eos), stop=tuple(req.stop or ()), seed=req.seed)
        if params.stop and state.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
        try:
            state.engine.check_request(ids, params)
        except (ValueError, TypeError) as e:
            msg = str(e)
            code = "context_length_exceeded" if "context" in msg or "KV" in msg else None
            raise APIError(400, msg, param=param if "token id" in msg or "prompt" in msg else None,
                           code=code) from None
        return params

    def _encode(text: str) -> list[int]:
        return list(state.tokenizer.encode(text, add_special_tokens=False))

    # -- the two generation endpoints --
    @app.post("/v1/completions")
    async def completions(request: Request):
        req: CompletionRequest = await _parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            if state.tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send the prompt as a list of token ids",
                               param="prompt")
            ids = _encode(req.prompt)
        else:
            ids = list(req.prompt)
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        params = _params(req, ids, req.max_tokens, 16, "prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str, reason: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

        return await _respond(request, req, ids, params, chunk, lambda text, reason, usage: {
            **chunk(text, reason), "usage": usage})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        tok = state.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        try:
            prompt = tok.apply_chat_template(req.conversation(), tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template rejects the conversation (e.g. roles out of order)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        ids = _encode(prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _params(req, ids, max_tokens, None, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str | None, reason: str | None, role: bool = False) -> dict:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

        def full(text: str, reason: str, usage: dict) -> dict:
            return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "logprobs": None, "finish_reason": reason}],
                    "usage": usage}

        return await _respond(request, req, ids, params, chunk, full, first=chunk(None, None, role=True))

    async def _respond(request: Request, req, ids: list[int], params: SamplingParams, chunk, full,
                       first: dict | None = None):
        handle = RequestHandle(ids, params, make_stop_check(state.stop_tokenizer, params.stop))
        ts = TextStream(state.tokenizer, params.stop) if state.tokenizer is not None else None
        if ts is None:
            ts = _NoTokenizerStream()
        if not req.stream:
            watcher = asyncio.ensure_future(_watch_disconnect(request, handle))
            try:
                parts, reason = [], None
                async for piece, finish in _generate(state, handle, ts):
                    parts.append(piece)
                    reason = finish or reason
            finally:
                watcher.cancel()
            return JSONResponse(full("".join(parts), reason, _usage(len(ids), ts.num_tokens)))

        include_usage = req.include_usage

        async def events():
            try:
                if first is not None:
                    yield _sse(first)
                async for piece, reason in _generate(state, handle, ts):
                    if piece or reason:
                        yield _sse(chunk(piece, reason))
                if include_usage:
                    last = chunk("", None)
                    last["choices"] = []
                    last["usage"] = _usage(len(ids), ts.num_tokens)
                    yield _sse(last)
            except APIError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return EventStreamResponse(events(), handle.cancel)

    return app


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
