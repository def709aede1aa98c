"""The one thread that owns the Engine, and the asyncio side's handle on a request.

The engine is not thread-safe, so exactly one thread touches it. That thread runs the loop: take every
command waiting in a thread-safe queue (add a request, abort one, report stats, stop), then `step()` while
there is work; with no work it blocks on the queue. After each step it hands each request's new tokens to
the request's asyncio queue through `loop.call_soon_threadsafe`, one call per step for all requests.

The asyncio side never waits on the engine: it puts commands on the queue and awaits its own queue.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from minisgl.errors import RequestError
from minisgl.sampling_params import SamplingParams

logger = logging.getLogger("minisgl.server")


@dataclass
class Delta:
    """New tokens of one request; the last Delta of a request carries its finish reason (or an error)."""

    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # set when the engine refused or failed the request
    error_kind: str | None = None  # "invalid" (add_request refused it) | "unavailable" | "internal"
    error_param: str | None = None  # for "invalid": the RequestError's parameter and code
    error_code: str | None = None
    logprobs: list | None = None  # with SamplingParams.logprobs: one entry per token of token_ids


class RequestHandle:
    """One request as the asyncio side sees it. Create, submit, then iterate `events()`."""

    def __init__(self, input_ids: list[int], params: SamplingParams,
                 stop_check: Callable | None = None) -> None:
        self.input_ids = list(input_ids)
        self.params = params
        self.stop_check = stop_check
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False  # the last Delta has been received (or the request was cancelled)
        self.cancelled = False
        self.worker: EngineWorker | None = None
        self.engine_finish_reason: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def events(self):
        """The request's Deltas, up to and including the one that ends it."""
        while not self.done:
            delta = await self.queue.get()
            if delta.finish_reason is not None or delta.error is not None:
                self.done = True
                self.engine_finish_reason = delta.finish_reason
            yield delta

    def cancel(self) -> None:
        """Abort the request (client gone, stop string seen, shutdown). Safe to call more than once."""
        if not self.done and not self.cancelled and self.worker is not None:
            self.cancelled = True
            self.worker.abort(self)


class EngineWorker:
    """Owns an Engine on a background thread."""

    def __init__(self, engine, name: str = "minisgl-engine") -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._active: dict[RequestHandle, list] = {}  # handle -> [req, tokens sent, loop]
        self.healthy = True
        self.fatal_error: str | None = None
        self.counters = {"submitted": 0, "rejected": 0, "finished": 0, "aborted": 0, "errors": 0}
        self._stopped = threading.Event()
        self._stop_requested = False

    # --- the asyncio side (any thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, handle: RequestHandle | list[RequestHandle]) -> None:
        """Queue a request (or the n streams of one, `params.n` handles of the same prompt and params: the
        engine prefills it once); must be called from the running event loop that will read its events."""
        handles = handle if isinstance(handle, list) else [handle]
        loop = asyncio.get_running_loop()
        for h in handles:
            h.worker, h._loop = self, loop
        if self._stopped.is_set() or not self.healthy:
            for h in handles:
                h.queue.put_nowait(Delta([], "error", self.fatal_error or "the engine is shutting down",
                                         "unavailable"))
            return
        self._cmds.put(("add", handles, loop))

    def abort(self, handle: RequestHandle) -> None:
        self._cmds.put(("abort", handle, None))

    def abort_all(self) -> None:
        """Abort every request in flight (shutdown after the grace period)."""
        self._cmds.put(("abort_all", None, None))

    def stats(self) -> concurrent.futures.Future:
        """Page and request accounting, read on the engine thread; a Future of a dict."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            fut.set_result(self._stats())  # the thread is gone, nothing else touches the engine
        else:
            self._cmds.put(("stats", fut, None))
        return fut

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is left, stop the thread and wait for it."""
        self._cmds.put(("stop", None, None))
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        runner = getattr(self.engine, "runner", None)
        if not self._thread.is_alive() and hasattr(runner, "close"):
            runner.close()  # the engine's other processes (tensor-parallel ranks)

    # --- the engine thread -----------------------------------------------------------------------------
    def _stats(self) -> dict:
        e = self.engine
        sched = e.scheduler
        return {
            "kv_pages_capacity": e.allocator.capacity,
            "kv_pages_free": e.allocator.num_free,
            "kv_pages_evictable": e.cache.evictable_pages,
            "kv_pages_leaked": e.allocator.capacity - e.allocator.num_free - e.cache.evictable_pages
            if not sched.running and not sched.waiting else None,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "active_handles": len(self._active),
            "has_work": e.has_work,
            "healthy": self.healthy,
            **self.counters,
            "engine_steps": e.stats.get("steps", 0),
        }

    def _answer_stats(self, fut: concurrent.futures.Future) -> None:
        try:
            fut.set_result(self._stats())
        except Exception as e:  # never leave the asker waiting
            fut.set_exception(e)

    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_work
                if not self._drain(block):
                    break
                if self.engine.has_work:
                    self.engine.step()
                    self._publish()
        except BaseException as exc:  # a bug in the engine: fail every request instead of hanging them
            self.healthy = False
            self.fatal_error = f"engine failure: {type(exc).__name__}: {exc}"
            logger.error("engine thread died:\n%s", traceback.format_exc())
            self._fail_all(self.fatal_error)
            self._stopped.set()
            # keep answering stats / stop so nothing waits forever (unless a stop is what failed)
            while not self._stop_requested:
                kind, obj, _ = self._cmds.get()
                if kind == "stats":
                    self._answer_stats(obj)
                elif kind == "add":
                    for h in obj:
                        self._send(h, Delta([], "error", self.fatal_error, "internal"))
                elif kind == "stop":
                    break
            return
        self._stopped.set()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        while True:
            try:
                kind, obj, loop = self._cmds.get() if block else self._cmds.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "add":
                self._add(obj, loop)
            elif kind == "abort":
                self._abort(obj)
            elif kind == "abort_all":
                for h in list(self._active):
                    self._abort(h)
            elif kind == "stats":
                self._answer_stats(obj)
            elif kind == "stop":
                self._stop_requested = True
                for h in list(self._active):
                    self._abort(h)
                while self.engine.has_work:  # let aborted requests release their pages
                    self.engine.step()
                return False

    def _add(self, handles: list[RequestHandle], loop) -> None:
        first = handles[0]
        if all(h.cancelled for h in handles):  # the client left before the engine saw the request
            for h in handles:
                self.counters["aborted"] += 1
                self._send(h, Delta([], "abort"))
            return
        try:
            reqs = self.engine.add_requests(first.input_ids, first.params, first.stop_check)
        except (ValueError, TypeError) as e:
            error = Delta([], "error", e.message, "invalid", e.param, e.code) if isinstance(e, RequestError) \
                else Delta([], "error", str(e), "invalid")
            for h in handles:
                self.counters["rejected"] += 1
                self._send(h, error)
            return
        for h, req in zip(handles, reqs):
            self.counters["submitted"] += 1
            self._active[h] = [req, 0]
            if h.cancelled:  # this stream's client left meanwhile
                self._abort(h)

    def _abort(self, handle: RequestHandle) -> None:
        entry = self._active.pop(handle, None)
        if entry is None:
            return
        req, sent = entry
        self.engine.abort(req)  # pages come back when the loop next releases it (the next step)
        self.counters["aborted"] += 1
        self._send(handle, Delta([], "abort"))

    def _publish(self) -> None:
        batches: dict[object, list] = {}
        for handle, entry in list(self._active.items()):
            req, sent = entry
            n = len(req.output_ids)
            if n == sent and not req.finished:
                continue
            delta = Delta(req.output_ids[sent:n],
                          logprobs=None if req.params.logprobs is None else req.output_logprobs[sent:n])
            entry[1] = n
            if req.finished:
                delta.finish_reason = req.finish_reason or "stop"
                if req.finish_reason == "error":
                    delta.error = req.error or "the request failed in the engine"
                    delta.error_kind = "internal"
                    self.counters["errors"] += 1
                elif req.finish_reason == "abort":
                    self.counters["aborted"] += 1
                else:
                    self.counters["finished"] += 1
                del self._active[handle]
            batches.setdefault(handle._loop, []).append((handle, delta))
        for loop, items in batches.items():
            self._post(loop, items)

    def _fail_all(self, message: str) -> None:
        for handle in list(self._active):
            self._send(handle, Delta([], "error", message, "internal"))
        self._active.clear()

    def _send(self, handle: RequestHandle, delta: Delta) -> None:
        self._post(handle._loop, [(handle, delta)])

    @staticmethod
    def _post(loop, items) -> None:
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _deliver(items) -> None:
    for handle, delta in items:
        handle.queue.put_nowait(delta)


def wait_idle(worker: EngineWorker, timeout: float = 30.0) -> dict:
    """Block until the engine has no request left (test helper); returns the final stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = worker.stats().result(timeout=timeout)
        if not s["has_work"] and s["active_handles"] == 0:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine still busy after {timeout}s: {s}")
        time.sleep(0.02)
