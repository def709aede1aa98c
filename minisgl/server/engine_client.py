"""The front's handle on the engine process: start it, talk to it from the event loop, notice when it is gone.

`EngineClient.start()` starts the engine process (`engine_process.engine_main`, a subprocess) and blocks until it
reports ready with its limits (`EngineInfo`). `attach()`, on the server's event loop, takes over the pipe with asyncio
streams: a reader task fans each step's news out to the open requests' handles (`step_outputs.fan_out`), and the
commands the handlers queue (add, abort) go out as one frame per turn of the event loop (or every FLUSH_AFTER_S
of a long turn). The event loop never blocks on the pipe: writes are buffered by the transport, reads are awaited.

The engine is declared gone, every open request failing with an error (a stream ends with an error event and
[DONE], a plain request gets a JSON error), when
- the pipe closes or the process exits (killed, crashed): kind "unavailable", a 503;
- a step raised (the engine sent "fatal" before exiting): kind "internal", a 500;
- nothing came for `watchdog_timeout` seconds although the engine sends at least every HEARTBEAT_S (a frozen
  process, SIGSTOP, or a step stuck in a collective with a frozen tensor-parallel rank): the engine's whole
  process group (its ranks too) is killed, kind "unavailable". The engine sends between steps, so the timeout
  must exceed the longest step: by default 10 s on a GPU (a step takes milliseconds, a kernel compile seconds)
  and 120 s on a CPU (a prefill chunk of a real model can take that long there).
Then /health answers 503, new requests get 503 at once, and `on_failure` (set by the server) is called.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from minisgl.config import EngineConfig
from minisgl.sampling_params import SamplingParams
from minisgl.server.engine_process import HEARTBEAT_S, EngineInfo
from minisgl.server.step_outputs import Finish, StepOutputs, fan_out

logger = logging.getLogger("minisgl.server")

WATCHDOG_TIMEOUT = {"cuda": 10.0, "cpu": 120.0}  # by the engine's device, when not given
FLUSH_AFTER_S = 0.005  # commands wait for the end of the event loop's turn, or this long at most


@dataclass
class Delta:
    """New tokens of one request; the last Delta of a request carries its Finish."""

    token_ids: list[int]
    finish: Finish | None = None
    extras: dict | None = None  # per-token fields (name -> list parallel to token_ids)

    @property
    def error(self) -> str | None:
        return self.finish.error if self.finish is not None and self.finish.reason == "error" else None


class RequestHandle:
    """One request as the front sees it. Create, `EngineClient.submit`, then iterate `events()`."""

    def __init__(self, input_ids: list[int], params: SamplingParams, received: float | None = None) -> None:
        self.input_ids = list(input_ids)
        self.params = params
        self.received = received  # when the front took the request (time.perf_counter), for the request log
        self.rid: int | None = None
        self.pending: Delta | None = None  # news that events() has not taken yet, merged into one Delta
        self._wakeup: asyncio.Future | None = None  # set while events() waits for news
        self.done = False  # the last Delta has been received
        self.cancelled = False
        self.client: EngineClient | None = None

    def deliver(self, tokens: list[int], finish: Finish | None, extras: dict | None) -> None:
        """Called for every step with news for this request (on the event loop). News waiting to be taken is
        merged with it rather than queued: at hundreds of streams this runs ~100,000 times a second, so it
        wakes the reader only when the reader is waiting."""
        old = self.pending
        if old is None:
            self.pending = Delta(tokens, finish, extras)
        elif old.finish is None:  # the front fell behind the engine: fewer, larger pieces, not a backlog
            if old.extras is not None and extras is not None:
                extras = {k: v + extras.get(k, []) for k, v in old.extras.items()}
            elif extras is None:  # an outcome without tokens (an error): the waiting tokens keep theirs
                extras = old.extras
            self.pending = Delta(old.token_ids + tokens, finish, extras)
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def events(self):
        """The request's Deltas up to and including the one that ends it; news that arrived while the
        consumer was busy comes as one Delta."""
        while not self.done:
            if self.pending is None:
                self._wakeup = asyncio.get_running_loop().create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None
            delta, self.pending = self.pending, None
            if delta.finish is not None:
                self.done = True
            yield delta

    def cancel(self, counted_as: str = "abort") -> None:
        """Stop the request in the engine (client gone: "abort"; a stop string seen: "stop"). Safe to repeat."""
        if not self.done and not self.cancelled and self.client is not None:
            self.cancelled = True
            self.client.abort(self, counted_as)


def _frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!i", len(data)) + data  # Connection.send_bytes's framing (frames under 2 GiB)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class EngineClient:
    """The engine process, seen from the front."""

    def __init__(self, config: EngineConfig, watchdog_timeout: float | None = None,
                 heartbeat_s: float = HEARTBEAT_S, log_level: str = "warning", request_log: str | None = None,
                 step_log: str | None = None) -> None:
        if watchdog_timeout is not None and watchdog_timeout <= heartbeat_s:
            raise ValueError(f"watchdog_timeout must be longer than the heartbeat ({heartbeat_s}s), "
                             f"got {watchdog_timeout}")
        self.config, self.watchdog_timeout, self.heartbeat_s = config, watchdog_timeout, heartbeat_s
        self.log_level, self.request_log, self.step_log = log_level, request_log, step_log
        self.info: EngineInfo | None = None
        self.proc: subprocess.Popen | None = None
        self.conn = None  # the blocking Connection, until attach() hands the socket to asyncio
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handles: dict[int, RequestHandle] = {}
        self._rids = itertools.count()
        self._outbox: list[tuple] = []
        self._outbox_since = 0.0  # when the first command in the outbox was queued
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: list[asyncio.Task] = []
        self._stats_waiters: dict[int, concurrent.futures.Future] = {}
        self.last_news = time.monotonic()
        self.healthy = False
        self.fatal_error: str | None = None  # why the engine is gone (None while it serves)
        self.refusing: str | None = None  # set when the server stops taking requests (a second signal)
        self.on_failure: Callable[[], None] | None = None
        self._stopping = False

    # --- start and stop (blocking; any thread) -----------------------------------------------------------
    def start(self, timeout: float | None = None) -> EngineInfo:
        self.start_process()
        return self.wait_ready(timeout)

    def start_process(self) -> None:
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        # a session of its own: no terminal signals, and one killpg reaches the engine and its ranks
        # (`-c`, not `-m`: run as __main__, the module's classes would pickle under the wrong name)
        code = f"from minisgl.server.engine_process import engine_main; engine_main({fd})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(fd,), start_new_session=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        # the engine ran in this process before it had one of its own: it keeps this process's torch threads
        import torch
        self.conn.send_bytes(pickle.dumps(("config", self.config, os.getpid(), self.heartbeat_s, self.log_level,
                                           torch.get_num_threads(), self.request_log, self.step_log)))

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Block until the engine is ready (model loaded, graphs captured); RuntimeError if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([self.conn], left)  # the pipe closes when the engine process exits
            if not ready:
                self.kill()
                raise RuntimeError(f"the engine process did not get ready within {timeout}s")
            if self.conn in ready:
                try:
                    msg = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    msg = ("died",)
                if msg[0] == "ready":
                    self.info, self.healthy, self.last_news = msg[1], True, time.monotonic()
                    if self.watchdog_timeout is None:
                        self.watchdog_timeout = WATCHDOG_TIMEOUT.get(self.info.device, WATCHDOG_TIMEOUT["cpu"])
                    return self.info
                if msg[0] == "error":  # ("error", traceback, the exception): re-raised here, as if in-process
                    self.kill()
                    logger.debug("the engine failed to start:\n%s", msg[1])
                    raise msg[2]
                if msg[0] != "died":
                    continue
            self._reap(5)
            self.kill()
            raise RuntimeError(f"the engine process (pid {self.proc.pid}) {_exit_reason(self.proc.returncode)} "
                               "while starting")

    def _reap(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        """SIGKILL the engine's process group (the engine and its tensor-parallel ranks) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine leads its own process group (new session)
        except (ProcessLookupError, PermissionError):
            pass
        self._reap(10)

    def close(self, timeout: float = 15.0) -> None:
        """Stop the engine (after the event loop has gone, or when it never started): ask it to stop, wait,
        then kill what is left. Safe to call more than once, from any thread but the event loop's."""
        if self.proc is None:
            return
        if self.proc.poll() is None and self.conn is not None and not self._stopping:
            try:
                self.conn.send_bytes(pickle.dumps([("stop",)]))
            except OSError:
                pass
        self._stopping = True
        self._reap(timeout if self.fatal_error is None else 1.0)
        self.kill()
        self.healthy = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.fatal_error is None

    # --- the event loop side -----------------------------------------------------------------------------
    async def attach(self) -> None:
        """Take the pipe over on the running event loop (the server's lifespan start)."""
        self.loop = asyncio.get_running_loop()
        sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self.conn.close()
        self.conn = None
        reader, self._writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
        self.last_news = time.monotonic()
        self._tasks = [asyncio.ensure_future(self._read(reader)), asyncio.ensure_future(self._watchdog())]

    async def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the engine in order: it aborts what is left, gives every page back and exits."""
        if self.loop is None:
            return
        self._stopping = True
        if self.fatal_error is None:
            self._send(("stop",))
        deadline = time.monotonic() + (timeout if self.fatal_error is None else 1.0)
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.kill)
        self._detach()
        self._fail_open("the server is shutting down", "unavailable")
        self.healthy = False

    def _detach(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._writer is not None:
            self._writer.close()

    def _in_loop(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the event loop: now when called on it, else as a callback (signal handlers,
        timers and other threads end up here)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            fn(*args)
        else:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed meanwhile
                pass

    def _send(self, cmd: tuple) -> None:
        now = time.monotonic()
        if not self._outbox:
            self.loop.call_soon(self._flush)
            self._outbox_since = now
        self._outbox.append(cmd)
        if now - self._outbox_since > FLUSH_AFTER_S:
            # a long turn of the event loop (hundreds of requests arriving at once): the engine starts on what
            # is here instead of waiting for the turn to end
            self._flush()

    def _flush(self) -> None:
        cmds, self._outbox = self._outbox, []
        if cmds and self._writer is not None and not self._writer.is_closing():
            self._writer.write(_frame(cmds))

    def submit(self, handle: RequestHandle | list[RequestHandle]) -> None:
        """Queue a request (on the event loop), or the `params.n` streams of one (handles of the same prompt and
        params: the engine prefills it once). Refused at once, with a 503-kind error, when the engine is gone or
        the server has stopped taking requests."""
        handles = handle if isinstance(handle, list) else [handle]
        for h in handles:
            h.client = self
        if self.fatal_error is not None or self.loop is None:
            refusal = Finish("error", self.fatal_error or "the engine is not running", "unavailable",
                             code="engine_unavailable")
        elif self.refusing is not None:
            refusal = Finish("error", self.refusing, "unavailable", code="shutting_down")
        else:
            refusal = None
        if refusal is not None:
            for h in handles:
                h.deliver([], refusal, None)
            return
        for h in handles:
            h.rid = next(self._rids)
            self.handles[h.rid] = h
        first = handles[0]
        self._send(("add", [h.rid for h in handles], first.input_ids, first.params, first.received))

    def abort(self, handle: RequestHandle, counted_as: str = "abort") -> None:
        if handle.rid is not None and handle.rid in self.handles and self.fatal_error is None:
            self._send(("abort", handle.rid, counted_as))

    def abort_all(self) -> None:
        """Abort every request in the engine (the end of a shutdown's grace period); thread-safe."""
        self._in_loop(lambda: self.fatal_error is None and self._send(("abort_all",)))

    def fail_all(self, message: str, code: str = "shutting_down") -> None:
        """End every open request now with a 503-kind error and refuse new ones (a second signal); thread-safe."""
        def run() -> None:
            self.refusing = message
            if self.fatal_error is None and self.handles:
                self._send(("abort_all",))
            self._fail_open(message, "unavailable", code)
        self._in_loop(run)

    def stats(self, check: bool = False) -> concurrent.futures.Future:
        """The engine's page and request accounting (asked in the engine process), with the front's own
        counts; a Future of a dict. `check`: also run the prefix cache's consistency check when idle."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def ask() -> None:
            if self.fatal_error is not None or self._writer is None:
                fut.set_result(self._front_stats())
                return
            tag = id(fut)
            self._stats_waiters[tag] = fut
            self._send(("stats", tag, check))
        if self.loop is None:
            fut.set_result(self._front_stats())
        else:
            self._in_loop(ask)
        return fut

    def _front_stats(self) -> dict:
        return {"healthy": self.healthy and self.fatal_error is None, "active_handles": len(self.handles),
                "has_work": False, "engine_pid": self.proc.pid if self.proc else None}

    # --- incoming ------------------------------------------------------------------------------------
    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (n,) = struct.unpack("!i", await reader.readexactly(4))
                if n == -1:  # Connection.send_bytes's header for a frame over 2 GiB
                    (n,) = struct.unpack("!Q", await reader.readexactly(8))
                msg = pickle.loads(await reader.readexactly(n))
                self.last_news = time.monotonic()
                kind = msg[0]
                if kind == "step":
                    self._on_step(msg[1])
                elif kind == "stats":
                    fut = self._stats_waiters.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        fut.set_result({**msg[2], **self._front_stats(), "has_work": msg[2]["has_work"]})
                elif kind == "fatal":
                    self._declare_gone(msg[1], "internal")
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if not self._stopping:
                self._declare_gone(self._death_message(), "unavailable")
        except asyncio.CancelledError:
            raise

    def _on_step(self, msg: StepOutputs) -> None:
        fan_out(msg, self.handles)

    def _death_message(self) -> str:
        if self.proc is None:  # a loop run in-process (tests)
            return "the engine's connection closed"
        self._reap(0.5)
        return f"the engine process (pid {self.proc.pid}) {_exit_reason(self.proc.returncode)}"

    async def _watchdog(self) -> None:
        if self.watchdog_timeout is None:  # a loop attached without wait_ready (tests)
            self.watchdog_timeout = WATCHDOG_TIMEOUT["cpu"]
        tick = min(0.5, self.watchdog_timeout / 4)
        last_tick = time.monotonic()
        while self.fatal_error is None:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_tick > 2 * tick + 0.5:
                # this loop itself was held up (a long handler): give the reader a turn before judging
                last_tick = now
                continue
            last_tick = now
            silent = now - self.last_news
            if silent > self.watchdog_timeout and not self._stopping:
                pid = getattr(self.proc, "pid", None)
                self._declare_gone(f"the engine process (pid {pid}) sent nothing for {silent:.1f}s "
                                   f"(--watchdog-timeout {self.watchdog_timeout:g}): it is frozen or stuck in a "
                                   "step; it was killed", "unavailable")
                await asyncio.to_thread(self.kill)
                return

    def _declare_gone(self, message: str, kind: str) -> None:
        if self.fatal_error is not None:
            return
        self.fatal_error = message
        self.healthy = False
        logger.error("%s", message)
        self._fail_open(message, kind)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_result(self._front_stats())
        self._stats_waiters.clear()
        threading.Thread(target=self.kill, name="minisgl-engine-reaper", daemon=True).start()
        if self.on_failure is not None:
            self.on_failure()

    def _fail_open(self, message: str, kind: str, code: str | None = None) -> None:
        code = code or ("engine_unavailable" if kind == "unavailable" else "internal_error")
        handles, self.handles = self.handles, {}
        for h in handles.values():
            h.deliver([], Finish("error", message, kind, code=code), None)
