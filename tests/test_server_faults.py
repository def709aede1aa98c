"""Faults of the two-process server, each checked by what its clients receive (issue 24).

The real `python -m minisgl serve` runs as a subprocess; its engine runs in a process of its own (its pid comes
from /v1/internal/stats). Cases:
- the engine process is killed (SIGKILL): every open stream gets an error event then [DONE], every open plain
  request a 503 JSON error; /health and new requests, streaming ones too, answer 503; the server exits by itself
  (status 1) with no traceback and nothing left running;
- the engine is frozen (SIGSTOP), or one of its tensor-parallel ranks is (the engine then waits in an all-reduce
  forever): the watchdog notices within its timeout, kills the engine's process group, then the same as above;
- two SIGTERMs: the first drains (streams keep getting tokens), the second ends every stream with an error event
  and [DONE] and every plain request with a JSON error; the server exits 0, no traceback, nothing left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minisgl.server.testing import tiny_model_path

REPO = Path(__file__).resolve().parents[1]
LONG = 1500  # tokens a request asks for: enough to still be running when the fault comes


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m minisgl serve` in a session of its own, its output collected."""

    def __init__(self, model: str, *flags: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        for _attempt in range(3):  # a free port can be taken before the server binds it
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model, "--port", str(self.port),
                   "--served-model-name", "tiny", "--kv-cache-tokens", "8192", "--log-level", "warning",
                   "--disable-overlap-schedule", *flags]
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT)
            self.lines: list[str] = []
            threading.Thread(target=self._collect, daemon=True).start()
            if self._wait_up():
                break
            if "address already in use" not in self.output:
                raise AssertionError(f"the server did not start:\n{self.output}")
        self.engine_pid = httpx.get(self.url + "/v1/internal/stats", timeout=30).json()["engine_pid"]

    def _collect(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _wait_up(self, timeout: float = 180) -> bool:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.proc.poll() is None and self.proc.kill()
        self.proc.wait()
        time.sleep(0.2)
        return False

    def wait_exit(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        time.sleep(0.2)  # the output thread drains the pipe
        return code

    def assert_nothing_left(self) -> None:
        for pgid in (self.proc.pid, self.engine_pid):  # the server's group, and the engine's (its ranks too)
            with pytest.raises(ProcessLookupError):
                os.killpg(pgid, 0)
        with pytest.raises(ProcessLookupError):
            os.kill(self.engine_pid, 0)

    def cleanup(self) -> None:
        for pgid in (self.proc.pid, self.engine_pid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, AttributeError):
                pass
        self.proc.poll() is None and self.proc.wait()


class Stream(threading.Thread):
    """A streaming completion read on a thread: its `data:` payloads, in order."""

    def __init__(self, url: str, max_tokens: int = LONG) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[str] = []
        self.status: int | None = None
        self.failure: str | None = None
        self.start()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "The function returns", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
        except httpx.HTTPError as e:
            self.failure = repr(e)

    def wait_events(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < n:
            assert self.is_alive() and time.monotonic() < deadline, (self.status, self.failure, self.events[-3:])
            time.sleep(0.02)

    def assert_error_then_done(self) -> dict:
        """The stream ended with an OpenAI error event and then [DONE]."""
        self.join(30)
        assert not self.is_alive() and self.failure is None, self.failure
        assert self.status == 200
        assert self.events[-1] == "[DONE]", self.events[-3:]
        last = json.loads(self.events[-2])
        assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}, last
        return last["error"]


class Plain(threading.Thread):
    """A non-streamed completion on a thread."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.response, self.failure = url, None, None
        self.start()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "A server streams tokens", "max_tokens": LONG, "ignore_eos": True}
        try:
            self.response = httpx.post(self.url + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as e:  # the front itself was killed: no answer at all
            self.failure = repr(e)

    def assert_json_error(self, status: int) -> dict:
        self.join(30)
        assert self.response is not None and self.response.status_code == status, (self.response, self.failure)
        err = self.response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        return err


def _assert_refused_503(url: str) -> None:
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    for stream in (False, True):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                      "stream": stream}, timeout=10)
        assert r.status_code == 503, (stream, r.status_code, r.text)  # a status, not a 200 with an error event
        assert r.json()["error"]["code"] == "engine_unavailable"


def _open_requests(url: str) -> tuple[list[Stream], list[Plain]]:
    streams = [Stream(url) for _ in range(3)]
    plains = [Plain(url) for _ in range(2)]
    for s in streams:
        s.wait_events(3)
    return streams, plains


def _tp_rank_pids(engine_pid: int) -> list[int]:
    """The engine's tensor-parallel ranks: its children started by multiprocessing's spawn (not its helpers)."""
    with open(f"/proc/{engine_pid}/task/{engine_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    ranks = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            ranks.append(pid)
    return ranks


@pytest.mark.parametrize("fault", ["killed", "frozen", "tp_rank_frozen"])
def test_engine_killed_or_frozen(model_path, fault):
    tp = ("--tp-size", "2") if fault == "tp_rank_frozen" else ()
    srv = Server(model_path, "--watchdog-timeout", "2", "--exit-after-engine-failure", "8", *tp)
    try:
        streams, plains = _open_requests(srv.url)
        if fault == "tp_rank_frozen":  # rank 0 then waits in an all-reduce that never completes
            (victim,) = _tp_rank_pids(srv.engine_pid)
        else:
            victim = srv.engine_pid
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        for s in streams:
            err = s.assert_error_then_done()
            assert err["code"] == "engine_unavailable" and str(srv.engine_pid) in err["message"], err
        noticed = time.monotonic() - t0
        for p in plains:
            assert p.assert_json_error(503)["code"] == "engine_unavailable"
        if fault != "killed":
            assert "frozen" in err["message"], err
            assert 1.5 < noticed < 6, noticed  # the 2 s watchdog, not a hang
        else:
            assert "SIGKILL" in err["message"] and noticed < 3, (err, noticed)
        _assert_refused_503(srv.url)
        code = srv.wait_exit(timeout=30)  # by itself, --exit-after-engine-failure later
        assert code == 1, srv.output
        assert "Traceback" not in srv.output, srv.output
        srv.assert_nothing_left()
        if fault == "tp_rank_frozen":
            with pytest.raises(ProcessLookupError):
                os.kill(victim, 0)  # the stopped rank too: killed with the engine's process group
    finally:
        srv.cleanup()


def test_two_sigterms_end_every_request_with_an_error(model_path):
    srv = Server(model_path, "--shutdown-timeout", "60")
    try:
        streams, plains = _open_requests(srv.url)
        srv.proc.send_signal(signal.SIGTERM)
        # the first signal drains: open requests keep going
        counts = [len(s.events) for s in streams]
        for s, n in zip(streams, counts):
            s.wait_events(n + 3, timeout=20)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for s in streams:
            assert s.assert_error_then_done()["code"] == "shutting_down"
        for p in plains:
            assert p.assert_json_error(503)["code"] == "shutting_down"
        code = srv.wait_exit(timeout=20)
        assert code == 0, srv.output
        assert time.monotonic() - t0 < 10
        assert "Traceback" not in srv.output and "CancelledError" not in srv.output, srv.output
        srv.assert_nothing_left()
    finally:
        srv.cleanup()


def test_front_killed_the_engine_exits(model_path):
    """The front process dies without a word (SIGKILL): the engine sees its pipe close and exits by itself."""
    srv = Server(model_path)
    try:
        streams, _ = _open_requests(srv.url)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.wait_exit(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                os.kill(srv.engine_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        srv.assert_nothing_left()
    finally:
        srv.cleanup()
