"""The engine's own process: the step loop, alone on its core, talking to the front over one pipe.

The front process (`minisgl serve`: HTTP, tokenization, detokenization, stop strings) starts this process as
`python -c "...engine_main(FD)"` in a new session, so the step loop never shares a GIL with the
event loop that writes every token of every stream. Under tensor parallelism this process is rank 0 and starts
ranks 1..N-1 itself (`minisgl.distributed`). (A plain subprocess rather than multiprocessing's spawn: spawn
re-imports the parent's main script, which a script without a `__main__` guard cannot survive.)

The pipe is one end of a socketpair, inherited as file descriptor FD, carrying pickled frames, 4-byte length
first (the framing of `multiprocessing.connection.Connection`, which the front's asyncio side writes too):

- front -> engine: first ("config", EngineConfig, front pid, heartbeat_s, log level, torch threads, request log
  path or None, step log path or None); then a list of commands per frame, all those the front queued since
  its last flush:
  ("add", rid, input_ids, params, received) | ("abort", rid, counted_as) | ("abort_all",) | ("stats", tag) | ("stop",)
- engine -> front: ("ready", EngineInfo) once; then ("step", StepOutputs) after each step that has news, or
  at least every `heartbeat_s` seconds (an empty one when idle: the front's watchdog counts on it);
  ("stats", tag, dict) answers; ("fatal", message) when a step raised (every open request fails with it, and
  the process exits); ("error", traceback, exception) when the engine could not start.

Being in a session of its own, the engine gets no Ctrl-C from a terminal (the front gets it and stops the engine
in order), and the front can kill the engine and all its ranks with one `killpg`. The engine exits when the
front goes away (its end of the pipe closes, or its pid changes).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace

from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine  # here, not in check_request: a first request must not wait for it
from minisgl.errors import RequestError
from minisgl.sampling_params import SamplingParams
from minisgl.server.step_outputs import Finish, StepOutputs, collect_outputs

logger = logging.getLogger("minisgl.server")

_FRONT_GRAMMARS: dict = {}  # model path -> minisgl.grammar.Grammars, the front's (EngineInfo.grammars)
PER_TOKEN = ("output_logprobs",)  # Req lists parallel to output_ids sent with the tokens (empty without logprobs)
LONG_GAP_S = 0.01  # --request-log: a token gap longer than this is logged with its time
HEARTBEAT_S = 0.5  # the engine sends something at least this often, idle or not (unless a step takes longer)
# With work to do, a turn applies the front's commands for at most this share of the last turn's time (and at
# least DRAIN_MIN_S), then steps again, so a flood of commands (thousands of adds at once) never stalls the
# running streams for longer than a step. The step in flight lasts about as long as the last turn, so the share
# is read while the device works. On run23's 512-request burst it changed nothing measurable: the front hands the
# adds over no faster than a turn reads them (reports/h100/run23).
DRAIN_SHARE = 0.5
DRAIN_MIN_S = 0.001


@dataclass(frozen=True)
class EngineInfo:
    """What the front needs to know about the engine to check requests without it (sent once, at ready)."""

    model_path: str
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int
    pid: int
    config: EngineConfig  # as the engine resolved it (max_running_requests auto -> a number)
    device: str = "cpu"  # the engine's device type: "cuda" or "cpu"

    @classmethod
    def of(cls, engine) -> EngineInfo:
        return cls(engine.runner.model_path, engine.max_model_len, engine.runner.kv_capacity_tokens,
                   engine.model_config.vocab_size, os.getpid(), engine.config,
                   getattr(getattr(engine.runner, "device", None), "type", "cpu"))

    def check_request(self, input_ids: list[int], params: SamplingParams) -> None:
        """`Engine.check_request` against these limits (all it reads), so a bad request is refused in the front
        before its stream starts; RequestError names the parameter."""
        view = SimpleNamespace(model_config=SimpleNamespace(vocab_size=self.vocab_size),
                               max_model_len=self.max_model_len, config=self.config, grammars=self.grammars,
                               runner=SimpleNamespace(kv_capacity_tokens=self.kv_capacity_tokens))
        Engine.check_request(view, input_ids, params)

    def grammars(self):
        """A grammar compiler of the model's tokenizer in this process, so a constraint xgrammar cannot compile
        is refused before its stream starts (the engine compiles its own: compiled grammars stay per process)."""
        cached = _FRONT_GRAMMARS.get(self.model_path)
        if cached is None:
            from minisgl.errors import RequestError
            from minisgl.grammar import Grammars
            from minisgl.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(self.model_path)
            if tokenizer is None:
                raise RequestError("structured output needs a tokenizer; this model has none", "response_format")
            # a check only (this process never samples): any stop token makes the same grammar valid or not
            stop = [tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0]
            cached = _FRONT_GRAMMARS[self.model_path] = Grammars(tokenizer, self.vocab_size, stop)
        return cached


def send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


class EngineLoop:
    """The step loop over one connection: apply the front's commands, step, send the step's news."""

    def __init__(self, engine, conn, heartbeat_s: float = HEARTBEAT_S, per_token: tuple[str, ...] = (),
                 request_log=None, step_log=None) -> None:
        self.engine, self.conn, self.heartbeat_s, self.per_token = engine, conn, heartbeat_s, per_token
        self.request_log = request_log  # a text file: one JSON line per request that ends (`log_requests`)
        self.step_log = step_log  # a text file: one JSON line per step (`log_step`)
        self.live: dict[int, object] = {}  # rid -> Req, until its outcome has been sent
        self.sent: dict[int, int] = {}  # rid -> output tokens sent
        self.stopped_by_front: set[int] = set()  # aborted because the front saw a stop string: counted finished
        self.pending: list[tuple[int, Finish]] = []  # outcomes decided outside a step (refused adds)
        self.received: dict[int, float] = {}  # rid -> when the front took it, until its request log line
        self.counters = {"submitted": 0, "rejected": 0, "finished": 0, "aborted": 0, "errors": 0}
        self.last_sent = 0.0

    # --- commands ------------------------------------------------------------------------------------
    def apply(self, cmd: tuple) -> bool:
        """Run one command; False once asked to stop."""
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            self._abort(cmd[1], cmd[2])
        elif kind == "abort_all":
            for rid in list(self.live):
                self._abort(rid, "abort")
        elif kind == "stats":
            send(self.conn, ("stats", cmd[1], self.stats(check=len(cmd) > 2 and cmd[2])))
        elif kind == "stop":
            return False
        return True

    def _add(self, rids: int | list[int], input_ids: list[int], params: SamplingParams,
             received: float | None = None) -> None:
        """A request, or the `params.n` streams of one (a rid each, in stream order); `received`: when the front
        took it (kept for the request log)."""
        rids = [rids] if isinstance(rids, int) else list(rids)
        try:
            reqs = self.engine.add_requests(input_ids, params)
        except (ValueError, TypeError) as e:
            finish = Finish("error", e.message, "invalid", e.param, e.code) if isinstance(e, RequestError) \
                else Finish("error", str(e), "invalid")
            for rid in rids:
                self.counters["rejected"] += 1
                self.pending.append((rid, finish))
            return
        for rid, req in zip(rids, reqs):
            self.counters["submitted"] += 1
            self.live[rid] = req
            self.sent[rid] = 0
            if self.request_log is not None and received is not None:
                self.received[rid] = received

    def _abort(self, rid: int, counted_as: str) -> None:
        req = self.live.get(rid)
        if req is None or req.finished:
            return  # finished already: its outcome is (or was) on its way
        if counted_as == "stop":
            self.stopped_by_front.add(rid)
        self.engine.abort(req)  # pages come back when the loop next releases it (the next step)

    def stats(self, check: bool = False) -> dict:
        e = self.engine
        sched = e.scheduler
        idle = not sched.running and not sched.waiting
        out = {
            "kv_pages_capacity": e.allocator.capacity,
            "kv_pages_free": e.allocator.num_free,
            "kv_pages_evictable": e.cache.evictable_pages,
            "kv_pages_leaked": e.allocator.capacity - e.allocator.num_free - e.cache.evictable_pages
            if idle else None,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "engine_open_requests": len(self.live),
            "has_work": e.has_work,
            **self.counters,
            "engine_steps": e.stats.get("steps", 0),
            "engine_pid": os.getpid(),
        }
        if check and idle and hasattr(e.cache, "check"):
            try:
                e.cache.check()
                out["cache_check"] = "ok"
            except AssertionError as err:
                out["cache_check"] = f"failed: {err}"
        return out

    # --- the loop ------------------------------------------------------------------------------------
    def log_requests(self) -> None:
        """One JSON line per request that has ended, before its outcome leaves `live`: when it reached the engine,
        its first token and its end, on the clock of `time.perf_counter` (CLOCK_MONOTONIC on Linux, so a client on
        the same machine can put its own times beside them). Where a request's time went: the client and the
        HTTP server before `received` (when the front's handler began), the front's parsing and tokenization until
        `arrival`, the engine's queue and prefill until `first_token`."""
        for rid, req in self.live.items():
            if req.finished:
                t = req.token_times
                self.request_log.write(json.dumps({
                    "rid": rid, "received": self.received.pop(rid, None), "arrival": req.arrival_time,
                    "first_token": req.first_token_time,
                    "finish": req.finish_time, "prompt_tokens": len(req.input_ids),
                    "cached_tokens": req.num_cached_prompt_tokens, "output_tokens": len(req.output_ids),
                    "reason": req.finish_reason, "gaps": max(0, len(t) - 1),
                    # the gaps between its tokens longer than LONG_GAP_S, each with when it ended: a client's P99
                    # token gap, seen from the engine (the rest are shorter)
                    "long_gaps": [[b, b - a] for a, b in zip(t, t[1:]) if b - a > LONG_GAP_S]}) + "\n")

    def log_step(self, t0: float, drained: float, stepped: float, sent: float, launched: bool) -> None:
        """One JSON line for the loop's last turn: when it began (time.perf_counter's clock, as the request log),
        its parts in ms (the front's commands, the engine's step, the news to the front), the step the engine
        launched in it (its requests, decode rows, prompt tokens, how it ran) and the queue after it. A turn that
        began idle counts its wait for the first command as `drain_ms`. With overlap the step's own GPU time
        hides in the next turn's wait; a turn that takes long says where a gap came from."""
        runner, sched = self.engine.runner, self.engine.scheduler
        line = {"t": t0, "drain_ms": 1e3 * (drained - t0), "step_ms": 1e3 * (stepped - drained),
                "news_ms": 1e3 * (sent - stepped), "running": len(sched.running), "waiting": len(sched.waiting)}
        if launched:  # a turn that launched nothing (it only resolved the step in flight) has no batch of its own
            batch = runner.last_batch
            decodes = sum(1 for n in batch.extend_lens if n == 1)
            line.update(reqs=batch.size, decode_rows=decodes, prompt_tokens=sum(batch.extend_lens) - decodes,
                        kind=runner.last_step_kind)
        self.step_log.write(json.dumps(line) + "\n")

    def _news(self) -> StepOutputs:
        if self.request_log is not None:
            self.log_requests()
        msg = collect_outputs(self.engine.stats.get("steps", 0), self.live, self.sent, self.per_token)
        for i, finish in enumerate(msg.finishes):
            if finish is None:
                continue
            if finish.reason == "error":
                self.counters["errors"] += 1
            elif finish.reason == "abort" and msg.rids[i] not in self.stopped_by_front:
                self.counters["aborted"] += 1
            else:
                self.counters["finished"] += 1
            self.stopped_by_front.discard(msg.rids[i])
        for rid, finish in self.pending:
            msg.append(rid, [], finish)
        self.pending.clear()
        return msg

    def _send_news(self, force: bool = False) -> None:
        msg = self._news()
        now = time.monotonic()
        if msg.rids or force or now - self.last_sent >= self.heartbeat_s:
            send(self.conn, ("step", msg))
            self.last_sent = now

    def _drain(self, timeout: float, budget_s: float = float("inf")) -> bool:
        """Apply the commands waiting (after waiting up to `timeout` for the first), frame by frame, until none is
        left or `budget_s` has passed since the first; False on stop or when the front has gone (its end of the
        pipe closed)."""
        try:
            if not self.conn.poll(timeout):
                return True
            deadline = time.perf_counter() + budget_s
            while True:
                for cmd in pickle.loads(self.conn.recv_bytes()):
                    if not self.apply(cmd):
                        return False
                if not self.conn.poll(0) or time.perf_counter() > deadline:
                    return True
        except (EOFError, OSError):
            return False

    def run(self) -> int:
        """Serve until told to stop; returns the exit status (1 after a failed step)."""
        engine = self.engine
        clock = time.perf_counter
        last_turn_s = 0.0  # the last turn that stepped, from its start to the next turn's
        try:
            while True:
                t0 = clock()
                busy = engine.has_work
                budget = max(DRAIN_MIN_S, DRAIN_SHARE * last_turn_s) if busy else DRAIN_MIN_S
                if not self._drain(0.0 if busy else self.heartbeat_s, budget):
                    break
                drained, working = clock(), engine.has_work
                steps = engine.stats.get("steps", 0)  # the engine counts the steps it launches
                if working:
                    engine.step()
                stepped = clock()
                self._send_news()
                if working and self.step_log is not None:
                    self.log_step(t0, drained, stepped, clock(), launched=engine.stats.get("steps", 0) != steps)
                last_turn_s = clock() - t0 if working else 0.0
            # stopping: abort what is left and step until every page is back, then report the aborts
            for rid in list(self.live):
                self._abort(rid, "abort")
            while engine.has_work:
                engine.step()
            self._send_news(force=True)
            return 0
        except (BrokenPipeError, ConnectionResetError):
            return 0  # the front has gone: nobody to report to
        except Exception as exc:  # a bug in a step: every open request fails, the front learns why, we exit
            message = f"engine failure: {type(exc).__name__}: {exc}"
            logger.error("the engine step failed:\n%s", traceback.format_exc())
            try:
                send(self.conn, ("fatal", message))
            except OSError:
                pass
            return 1


def _watch_parent(parent_pid: int) -> None:
    # a step that never ends would not see the pipe close; the parent's pid changing says the front is gone
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def engine_main(fd: int) -> None:
    """Entry point of the engine process: read the config, build the Engine, report ready, run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front handles Ctrl-C and stops us in order
    conn = Connection(fd)
    try:
        _, config, parent_pid, heartbeat_s, log_level, threads, request_log, step_log = pickle.loads(
            conn.recv_bytes())
    except (EOFError, OSError):
        os._exit(1)  # the front went away before it said anything
    import torch
    torch.set_num_threads(threads)  # as many as the front's process uses (the engine used to run inside it)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="minisgl-parent-watch").start()
    engine = None
    try:
        engine = Engine(config)
        send(conn, ("ready", EngineInfo.of(engine)))
    except BaseException as e:
        # the exception itself when it pickles (the front re-raises it: `serve` prints one line for it), and the
        # traceback for the log
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            e = RuntimeError(f"{type(e).__name__}: {e}")
        try:
            send(conn, ("error", traceback.format_exc(), e))
        except OSError:
            pass
        if engine is not None:
            engine.runner.close()
        os._exit(1)
    log = open(request_log, "a", buffering=1 << 16) if request_log else None
    steps = open(step_log, "a", buffering=1 << 16) if step_log else None
    code = EngineLoop(engine, conn, heartbeat_s, per_token=PER_TOKEN, request_log=log, step_log=steps).run()
    for f in (log, steps):
        if f is not None:
            f.close()
    engine.runner.close()  # the tensor-parallel ranks, in order
    conn.close()
    os._exit(code)  # skip interpreter teardown: nothing is left to flush, and the front is waiting for us

