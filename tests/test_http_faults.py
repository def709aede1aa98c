"""Careless and hostile HTTP clients against the real `python -m minisgl serve` (issue 28), through sockets and
httpx as any client would: raw surrogate bytes in a body, a head or a body that never finishes, more connections
than the server allows. Each case checks what the client gets (status, the OpenAI error shape), then that the
server still answers a completion and that every KV page is back.

The server runs with short limits (--header-timeout 1, --body-timeout 2, --max-connections 8) so the deadlines
show in seconds. The limits themselves are also checked on a bare ASGI app under both of uvicorn's HTTP
protocols (h11 and, when installed, httptools), independent of minisgl's app.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minisgl.server.limits import ConnectionLimits, guarded_protocol
from minisgl.server.testing import tiny_model_path

REPO = Path(__file__).resolve().parents[1]
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 1.0, 2.0, 8
SLACK = 3.0  # seconds a deadline may fire late on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))


def start_server(tmp: Path, *flags: str, context: int = 256) -> Server:
    model = tiny_model_path(tmp / "server-tests")
    port, log = free_port(), tmp / "server.log"
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model, "--served-model-name", "tiny",
           "--port", str(port), "--kv-cache-tokens", "4096", "--context-length", str(context), "--log-level", "warning",
           *flags]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), cwd=REPO, env=env)
    server = Server(proc, port, log)
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, f"the server exited: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "the server did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        time.sleep(0.5)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("http-faults"), "--header-timeout", str(HEADER_TIMEOUT),
                       "--body-timeout", str(BODY_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS), context=2048)
    yield srv
    stop_server(srv)


def all_pages_back(url: str, timeout: float = 30.0) -> dict:
    """Poll the engine's accounting until nothing runs or waits; then no page may be unaccounted for."""
    deadline = time.monotonic() + timeout
    while True:
        s = httpx.get(url + "/v1/internal/stats", timeout=30).json()
        if s["running"] == s["waiting"] == 0 and s["kv_pages_leaked"] is not None:
            break
        assert time.monotonic() < deadline, f"requests still in the engine: {s}"
        time.sleep(0.1)
    assert s["kv_pages_leaked"] == 0 and s["kv_pages_free"] + s["kv_pages_evictable"] == s["kv_pages_capacity"], s
    return s


def still_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "tiny", "prompt": "The function returns", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    all_pages_back(url)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# --- 1. raw surrogate bytes ------------------------------------------------------------------------------------
SURROGATE = b"\xed\xa0\x80"  # the UTF-8 spelling of U+D800, which is not UTF-8 (a lone surrogate)
RAW_BODIES = {
    "prompt": b'{"model":"tiny","prompt":"a' + SURROGATE + b'b","max_tokens":4}',
    "chat_content": b'{"model":"tiny","messages":[{"role":"user","content":"a' + SURROGATE + b'b"}],"max_tokens":4}',
    "chat_text_part": b'{"model":"tiny","messages":[{"role":"user","content":[{"type":"text","text":"' + SURROGATE
                      + b'"}]}],"max_tokens":4}',
    "stop_string": b'{"model":"tiny","prompt":"ab","max_tokens":4,"stop":"x' + SURROGATE + b'"}',
    "stop_list": b'{"model":"tiny","prompt":"ab","max_tokens":4,"stop":["ok","' + SURROGATE + b'"]}',
    "stop_escaped": b'{"model":"tiny","prompt":"ab","max_tokens":4,"stop":"\\ud800"}',
    "model_name": b'{"model":"' + SURROGATE + b'","prompt":"ab","max_tokens":4}',
    "low_surrogate_pair_reversed": b'{"model":"tiny","prompt":"\xed\xb0\x80\xed\xa0\x80","max_tokens":4}',
}


@pytest.mark.parametrize("where", sorted(RAW_BODIES))
def test_lone_surrogate_is_a_400(server, where):
    """Issue 28: raw surrogate bytes gave a 500 (TypeError from the tokenizer), in `stop` a 200."""
    path = "/v1/chat/completions" if where.startswith("chat") else "/v1/completions"
    r = httpx.post(server.url + path, content=RAW_BODIES[where], headers={"content-type": "application/json"},
                   timeout=60)
    err = assert_openai_error(r, 400, "invalid_json")
    assert "UTF-8" in err["message"] or "surrogate" in err["message"]
    still_serves(server.url)


# --- 5. slow heads, stalled bodies, too many connections ------------------------------------------------------
def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sends until it closes the connection (True) or `timeout` passes (False)."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except TimeoutError:
        return out, False
    except ConnectionResetError:
        pass
    return out, True


def parse_response(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def dribble(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> None:
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:  # the server closed the connection
            return
        time.sleep(every)


def test_slow_head_gets_a_408_and_is_closed(server):
    sock = socket.create_connection(("127.0.0.1", server.port))
    stop = threading.Event()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: a\r\n" * 50
    threading.Thread(target=dribble, args=(sock, head, 0.05, stop), daemon=True).start()
    t0 = time.monotonic()
    raw, closed = read_response(sock, HEADER_TIMEOUT + SLACK + 5)
    elapsed = time.monotonic() - t0
    stop.set()
    sock.close()
    assert closed and HEADER_TIMEOUT - 0.2 <= elapsed <= HEADER_TIMEOUT + SLACK, elapsed
    status, headers, body = parse_response(raw)
    assert status == 408 and headers["connection"] == "close" and body["error"]["code"] == "head_timeout"
    still_serves(server.url)


def test_stalled_body_gets_a_408_and_nothing_reaches_the_engine(server):
    before = all_pages_back(server.url)
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = b'{"model":"tiny","prompt":"The function returns","max_tokens":4}'
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:20])
    t0 = time.monotonic()
    raw, closed = read_response(sock, BODY_TIMEOUT + SLACK + 5)
    elapsed = time.monotonic() - t0
    sock.close()
    assert closed and BODY_TIMEOUT - 0.2 <= elapsed <= BODY_TIMEOUT + SLACK, elapsed
    status, headers, err = parse_response(raw)
    assert status == 408 and err["error"]["code"] == "body_timeout" and set(err["error"]) == {
        "message", "type", "param", "code"}
    after = all_pages_back(server.url)
    assert after["engine_steps"] == before["engine_steps"]  # the half request never reached the engine
    still_serves(server.url)


def test_slowloris_crowd_is_closed_and_its_descriptors_freed(server):
    """40 connections (five times --max-connections) dribbling headers and 10 stalled half-bodies: each gets a
    408 or a 503 and is closed within the deadlines; the server's open file descriptors come back down."""
    fds_before = server.open_fds()
    stop = threading.Event()
    socks = []
    try:
        for i in range(50):
            s = socket.create_connection(("127.0.0.1", server.port))
            socks.append(s)
            if i < 40:
                threading.Thread(target=dribble, args=(s, b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 40,
                                                       0.1, stop), daemon=True).start()
            else:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        # The server holds the dribblers until their head deadline; on a busy machine the first ones may already
        # have had their 408 by the time the last is accepted, so look for the peak, not for all 40 at once.
        peak, until = 0, time.monotonic() + HEADER_TIMEOUT
        while time.monotonic() < until:
            peak = max(peak, server.open_fds())
            time.sleep(0.02)
        assert peak > fds_before + MAX_CONNECTIONS, (fds_before, peak)  # more than the bound's worth, held open
        statuses = []
        for s in socks:
            raw, closed = read_response(s, BODY_TIMEOUT + SLACK + 10)
            assert closed
            if raw:
                statuses.append(parse_response(raw)[0])
        assert set(statuses) <= {408, 503} and statuses.count(408) >= 10, statuses
    finally:
        stop.set()
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while server.open_fds() > fds_before + 2:
        assert time.monotonic() < deadline, f"descriptors not freed: {fds_before} -> {server.open_fds()}"
        time.sleep(0.1)
    still_serves(server.url)


def test_connection_past_the_limit_gets_a_503(server):
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw, closed = read_response(extra, 10)
        status, headers, body = parse_response(raw)
        assert closed and status == 503 and headers["retry-after"] == "1"
        assert body["error"]["code"] == "too_many_connections" and set(body["error"]) == {
            "message", "type", "param", "code"}
    finally:
        for s in idle:
            s.close()
    still_serves(server.url)


def test_long_generation_outlives_the_deadlines(server):
    """The deadlines cover a request's head and body, not its answer: a stream keeps sending well past both (the
    client then leaves, and the engine gives the request's pages back)."""
    past = HEADER_TIMEOUT + BODY_TIMEOUT + 0.5
    late = 0
    with httpx.Client(base_url=server.url, timeout=300) as http:
        t0 = time.monotonic()
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 2000,
                                                          "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                assert line != "data: [DONE]", "the stream ended before the deadlines passed; raise max_tokens"
                if line.startswith("data: ") and time.monotonic() - t0 > past:
                    assert "choices" in json.loads(line[6:]), line
                    late += 1
                    if late == 5:
                        break
        assert late == 5
        assert http.get("/health").status_code == 200
    all_pages_back(server.url)


def test_bad_limit_flags_are_usage_errors(tmp_path):
    run = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--model", "m", "--header-timeout", "0"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip() == "minisgl serve: error: --header-timeout must be > 0, got 0.0"


# --- the limits on a bare ASGI app, under each of uvicorn's HTTP protocols --------------------------------------
def _protocols() -> list:
    from uvicorn.protocols.http.h11_impl import H11Protocol

    out = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        out.append(pytest.param(HttpToolsProtocol, id="httptools"))
    except ImportError:
        out.append(pytest.param(None, id="httptools", marks=pytest.mark.skip(reason="httptools is not installed")))
    return out


@contextlib.contextmanager
def bare_server(protocol, limits: ConnectionLimits):
    """uvicorn in a thread serving an app that echoes the body's length after `?sleep=` seconds."""
    import uvicorn

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body, more = body + message.get("body", b""), message.get("more_body", False)
        await asyncio.sleep(float(scope["query_string"].decode().partition("=")[2] or 0))
        out = str(len(body)).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", http=guarded_protocol(protocol, limits))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("protocol", _protocols())
def test_limits_under_each_protocol(protocol):
    limits = ConnectionLimits(header_timeout=0.5, body_timeout=0.8, max_connections=3)
    with bare_server(protocol, limits) as port:
        url = f"http://127.0.0.1:{port}"
        # a slow answer (longer than both deadlines) on a kept-alive connection, then a second request on it
        with httpx.Client(base_url=url, timeout=10) as http:
            assert http.post("/?sleep=1.5", content=b"x" * 10).text == "10"
            assert http.post("/", content=b"y" * 3).text == "3"
        # a head that trickles: 408 at the head deadline, not later
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
            t0 = time.monotonic()
            raw, closed = read_response(s, 5)
            assert closed and 0.3 < time.monotonic() - t0 < 0.5 + SLACK
            assert parse_response(raw)[2]["error"]["code"] == "head_timeout"
        # a body that stops: 408 at the body deadline
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\nabc")
            raw, closed = read_response(s, 5)
            assert closed and parse_response(raw)[2]["error"]["code"] == "body_timeout"
        # a connection that never sends a byte: closed at the head deadline without a word
        with socket.create_connection(("127.0.0.1", port)) as s:
            raw, closed = read_response(s, 5)
            assert closed and raw == b""
        # the fourth open connection is refused once its head arrives; the three others are served
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        time.sleep(0.05)
        for s in socks:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = [parse_response(read_response(s, 5)[0])[0] for s in socks]
        for s in socks:
            s.close()
        assert answers == [200, 200, 200, 503], answers
