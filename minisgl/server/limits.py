"""Limits on what a client may hold open: a deadline for a request's head, one for its body, and a bound on open
connections. Without them a client that sends its headers a byte at a time (slowloris), or half a body and then
nothing, holds a socket and a file descriptor for ever (issue 28: 216 such sockets stayed open).

uvicorn times out only idle keep-alive connections, and cancels that timer at the first byte of a request. So
the HTTP protocol uvicorn would pick (httptools when installed, else h11) is subclassed here, and after every
event the connection's deadline is set from where the request stands:

- waiting for a request's head (a new connection, or a response just finished): `header_timeout` seconds for
  the whole head, however it trickles in (an idle keep-alive connection is closed earlier by uvicorn's
  `timeout_keep_alive`, 5 s);
- head read, body still coming: `body_timeout` seconds for the whole body;
- the whole request read: no deadline (a long generation streams for as long as it needs).

A deadline that passes gets a 408 in the OpenAI error shape, and the connection closes (with no byte of a
request received, it closes without a word: a client's idle pooled connection must not read a stale 408 as the
answer to its next request). A body cut short this way looks to the app like a client that went away, so
nothing of it reaches the engine. A
connection opened while `max_connections` are open gets, once its head arrives, a 503 in the same shape (and
`Retry-After`), and is closed: the bound holds however the excess connections behave, since each one either
sends its head or meets its head deadline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_HEADER_TIMEOUT = 30.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_MAX_CONNECTIONS = 2048


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds for a request's head (request line and headers)
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # seconds for its body, from the end of its head
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open connections at most

    def __post_init__(self) -> None:
        if not self.header_timeout > 0 or not self.body_timeout > 0:
            raise ValueError(f"header and body timeouts must be > 0 seconds, got {self.header_timeout} and "
                             f"{self.body_timeout}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")


def error_response(status: int, reason: str, message: str, code: str, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-style error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra_headers}\r\n")
    return head.encode("latin-1") + body


def _over_capacity_app(max_connections: int):
    """The ASGI app a connection opened past the bound gets instead of the real one: a 503, body unread."""
    body = json.dumps({"error": {
        "message": f"the server has {max_connections} connections open, its limit; retry shortly",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})
    return app


def guarded_protocol(base: type, limits: ConnectionLimits) -> type:
    """`base` (one of uvicorn's HTTP protocol classes) with the deadlines and the connection bound above. It
    relies on what both of uvicorn's protocols have: `cycle` (the request in progress, its `more_body`,
    `response_started`, `response_complete`, `disconnected` and `message_event`), `transport`, `connections`,
    `app`, and the hooks connection_made / data_received / on_response_complete / connection_lost."""
    refuse = _over_capacity_app(limits.max_connections)

    class GuardedHTTPProtocol(base):
        _deadline = None  # the asyncio TimerHandle of the current deadline
        _waiting_for = None  # ("head" | "body", the cycle it belongs to): changes when the request moves on
        _request_started = False  # a byte of the next request arrived since the last response (or the connect)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self.app = refuse  # uvicorn reads self.app for each request of this connection
            self._set_deadline()

        def data_received(self, data: bytes) -> None:
            self._request_started = True
            super().data_received(data)
            self._set_deadline()

        def on_response_complete(self) -> None:
            self._request_started = False
            super().on_response_complete()
            self._set_deadline()

        def connection_lost(self, exc) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _set_deadline(self) -> None:
            if self.transport is None or self.transport.is_closing():
                return self._cancel_deadline()
            cycle = self.cycle
            if cycle is None or cycle.response_complete:
                waiting_for = ("head", cycle)  # the next request's head: a new wait after every response
            elif cycle.more_body and not cycle.disconnected and not cycle.response_started:
                waiting_for = ("body", cycle)
            else:
                waiting_for = None  # the app has the whole request (or answered without it)
            if waiting_for == self._waiting_for:
                return  # the same wait: its deadline stands, however many bytes trickled in
            self._cancel_deadline()
            self._waiting_for = waiting_for
            if waiting_for is not None:
                seconds = limits.header_timeout if waiting_for[0] == "head" else limits.body_timeout
                self._deadline = self.loop.call_later(seconds, self._expire, waiting_for[0], seconds)

        def _expire(self, part: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if part == "body" or self._request_started:
                self.transport.write(error_response(
                    408, "Request Timeout", f"the request's {part} did not arrive within {seconds:g} s",
                    f"{part}_timeout"))
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:  # the app, waiting for the body, sees a disconnect
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

    GuardedHTTPProtocol.__name__ = GuardedHTTPProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedHTTPProtocol
