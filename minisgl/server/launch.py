"""Start the server: the `serve` command line, a blocking `serve()`, and `ServerThread` for tests.

Two processes: this one (HTTP, tokenizer, detokenizer) and the engine's (`engine_process`), started by
`build_state` and stopped with the server; under tensor parallelism the engine's process starts the other ranks.

Shutdown: the first SIGINT or SIGTERM stops accepting connections and refuses new requests (503); requests
in flight get `shutdown_timeout` seconds to finish, then the engine aborts them (their streams end with
finish_reason "abort"). Then the engine aborts what is left, gives its pages back and exits, and so does the
server, with status 0. A second signal ends every open request at once with an error (a stream: an error event,
then [DONE]; a plain request: a 503 JSON error), then the server exits the same way.

When the engine dies or freezes (see `engine_client`), open requests end with an error, /health and new
requests answer 503 for `exit_after_engine_failure` seconds, then the server exits with status 1.

Clients are held to deadlines and a bound (`limits.py`, flags --header-timeout, --body-timeout,
--max-connections): a request's head and body must arrive in time, and connections past the bound are refused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import threading
import time

from minisgl.config import add_engine_args, engine_kwargs_from_args, make_config
from minisgl.server.limits import ConnectionLimits

DEFAULT_EXIT_AFTER_ENGINE_FAILURE = 5.0
FORCED_EXIT_S = 3.0  # after a second signal, how long open requests get to receive their error

logger = logging.getLogger("minisgl.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000

_MISSING_DEPS = ("the HTTP server needs fastapi and uvicorn: pip install 'minisgl[serve]' "
                 "(or pip install fastapi uvicorn)")


# --- command line ----------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `serve` flags (--host, --port, ...). The engine flags (--model and the rest) come from
    `minisgl.config.add_engine_args`, the one set every subcommand uses."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}; "
                       "use 0.0.0.0 to accept other machines)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send and /v1/models lists (default: --model as given)")
    group.add_argument("--shutdown-timeout", type=float, default=5.0,
                       help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they "
                            "are aborted (default 5)")
    group.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    limits = ConnectionLimits()
    group.add_argument("--header-timeout", type=float, default=limits.header_timeout,
                       help="seconds a client gets to send a request's head (request line and headers), from when "
                            "its connection opens or its previous response ends; then 408 and the connection "
                            f"closes (default {limits.header_timeout:g})")
    group.add_argument("--body-timeout", type=float, default=limits.body_timeout,
                       help="seconds a client gets to send a request's whole body once its head arrived; then 408 "
                            f"and the connection closes (default {limits.body_timeout:g})")
    group.add_argument("--max-connections", type=int, default=limits.max_connections,
                       help="open connections at most; a request on one more is answered 503 and its connection "
                            f"closed (default {limits.max_connections})")
    group.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                       help="uvicorn's HTTP parser (auto: httptools when installed, else h11)")
    group.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                       help="the front's event loop (auto: uvloop when installed, else asyncio)")
    group.add_argument("--watchdog-timeout", type=float, default=None,
                       help="seconds without a word from the engine process (it sends one at least every 0.5 s, "
                            "unless one step takes longer) before it is declared frozen and killed (default: 10 "
                            "with the engine on a GPU, 120 on a CPU, where a real model's prefill step can be long)")
    group.add_argument("--request-log", default=None, metavar="PATH",
                       help="append one JSON line per finished request to PATH, written by the engine process: when "
                            "the front took it, when it reached the engine, its first token and its end "
                            "(time.perf_counter's clock), its prompt, cached and output tokens; where a request's "
                            "time went (default: none)")
    group.add_argument("--step-log", default=None, metavar="PATH",
                       help="append one JSON line per engine step to PATH, written by the engine process: when its "
                            "loop turn began and how long its parts took (the front's commands, the step, the news), "
                            "the step's requests, decode rows and prompt tokens, and how it ran (CUDA graph or "
                            "eager); where a token gap came from (default: none)")
    group.add_argument("--exit-after-engine-failure", type=float, default=DEFAULT_EXIT_AFTER_ENGINE_FAILURE,
                       help="seconds the server keeps answering 503 after its engine died or froze, then it exits "
                            f"with status 1 (default {DEFAULT_EXIT_AFTER_ENGINE_FAILURE:g}; < 0: until signalled)")
    return parser


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The --header-timeout, --body-timeout and --max-connections flags; a bad value is a ConfigError."""
    from minisgl.errors import ConfigError
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--max-connections", args.max_connections)):
        if not value > 0:  # NaN too
            raise ConfigError(flag.removeprefix("--").replace("-", "_"), f"must be > 0, got {value}", flag)
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections)


def require_serve_deps() -> None:
    """ImportError saying what to install when the HTTP server's packages are missing (not a bare
    ModuleNotFoundError from deep inside the app's imports)."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError(_MISSING_DEPS) from None


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down cleanly; returns the exit status."""
    limits = limits_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # missing server packages, or an engine that cannot start, raise here (one line from `run_command`)
    state = build_state(args.model, args.served_model_name, watchdog_timeout=args.watchdog_timeout,
                        log_level=args.log_level, request_log=args.request_log, step_log=args.step_log,
                        **engine_kwargs_from_args(args))
    return serve(state, args.host, args.port, args.shutdown_timeout, args.log_level, args.exit_after_engine_failure,
                 http=args.http, loop=args.loop, limits=limits)


def build_parser() -> argparse.ArgumentParser:
    """The `serve` parser: the engine flags plus the server's."""
    parser = argparse.ArgumentParser(prog="minisgl serve",
                                     description="Serve a model over an OpenAI-compatible HTTP API.")
    add_engine_args(parser)
    return add_serve_args(parser)


def main(argv: list[str] | None = None) -> int:
    """`python -m minisgl.server ...`: the same flags as `python -m minisgl serve ...`, the same errors."""
    from minisgl.errors import add_traceback_flag, run_command
    parser = build_parser()
    add_traceback_flag(parser)
    return run_command("minisgl serve", run_serve, parser.parse_args(argv))


# --- building and running --------------------------------------------------------------------------------
def build_state(model: str, served_model_name: str | None = None, watchdog_timeout: float | None = None,
                log_level: str = "warning", request_log: str | None = None, step_log: str | None = None,
                **engine_kwargs):
    """Start the engine process, wait until it is ready, then load the tokenizer of the folder it resolved;
    returns the app's ServerState. When the engine cannot start, the exception it raised in its process
    (traceback logged at debug level)."""
    require_serve_deps()
    from minisgl.server.app import ServerState
    from minisgl.server.engine_client import EngineClient
    from minisgl.tokenizer import load_tokenizer

    config = make_config(model, **engine_kwargs)
    config.validate()  # a bad switch is a ValueError here, not a traceback from the engine process
    engine = EngineClient(config, watchdog_timeout=watchdog_timeout, log_level=log_level, request_log=request_log,
                          step_log=step_log)
    engine.start_process()
    try:
        info = engine.wait_ready()
        tokenizer = load_tokenizer(info.model_path)
    except BaseException:
        engine.close()
        raise
    import minisgl.engine.engine  # noqa: F401  (EngineInfo.check_request uses it: imported now, not at the first request)
    name = served_model_name or model
    aliases = {model, os.path.normpath(model), info.model_path, os.path.basename(os.path.normpath(model))} - {name}
    return ServerState(engine=engine, tokenizer=tokenizer, model_name=name, model_aliases=frozenset(aliases))


def _http_protocol(name: str) -> type:
    """uvicorn's HTTP protocol class for --http (auto: httptools when installed, else h11)."""
    if name == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol
    if name == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    return AutoHTTPProtocol


def _make_server(state, sock_or_host, port, log_level: str, shutdown_timeout: float,
                 exit_after_engine_failure: float = DEFAULT_EXIT_AFTER_ENGINE_FAILURE, http: str = "auto",
                 loop: str = "auto", limits: ConnectionLimits | None = None):
    import uvicorn

    from minisgl.server.app import create_app
    from minisgl.server.limits import guarded_protocol

    class Server(uvicorn.Server):
        """uvicorn with our own signal handling: a grace period, then abort; exit status 0."""

        grace_timer: threading.Timer | None = None
        force_timer: threading.Timer | None = None
        forced = False

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame) -> None:
            self.begin_shutdown(force=self.should_exit)

        def begin_shutdown(self, force: bool = False) -> None:
            state.shutting_down = True
            if force and not self.forced:
                # every open request ends now with an error its client can read; the connections then close
                # by themselves, and uvicorn's graceful wait ends (FORCED_EXIT_S later at the latest)
                self.forced = True
                logger.info("second signal: ending every open request now")
                state.engine.fail_all("the server was stopped (a second signal) before the request finished")
                self.force_timer = threading.Timer(FORCED_EXIT_S, setattr, (self, "force_exit", True))
                self.force_timer.daemon = True
                self.force_timer.start()
            elif not self.should_exit:
                logger.info("shutting down: %.1fs for in-flight requests, then they are aborted",
                            shutdown_timeout)
                self.grace_timer = threading.Timer(shutdown_timeout, state.engine.abort_all)
                self.grace_timer.daemon = True
                self.grace_timer.start()
            self.should_exit = True

        def cancel_timers(self) -> None:
            for t in (self.grace_timer, self.force_timer):
                if t is not None:
                    t.cancel()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            loop = asyncio.get_running_loop()

            def on_engine_failure() -> None:  # on the event loop
                if exit_after_engine_failure >= 0:
                    loop.call_later(exit_after_engine_failure, self.begin_shutdown)
            state.engine.on_failure = on_engine_failure

    config = uvicorn.Config(create_app(state), host=sock_or_host if isinstance(sock_or_host, str) else None,
                            port=port or 0, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5, lifespan="on",
                            http=guarded_protocol(_http_protocol(http), limits or ConnectionLimits()), loop=loop)
    return Server(config)


def serve(state, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, shutdown_timeout: float = 5.0,
          log_level: str = "info", exit_after_engine_failure: float = DEFAULT_EXIT_AFTER_ENGINE_FAILURE,
          http: str = "auto", loop: str = "auto", limits: ConnectionLimits | None = None) -> int:
    """Run the HTTP server in this (main) thread until a signal; returns 0 after a clean shutdown, 1 when the
    server could not start or its engine failed."""
    server = _make_server(state, host, port, log_level, shutdown_timeout, exit_after_engine_failure, http, loop,
                          limits)
    if getattr(getattr(state.engine, "config", None), "gc_freeze", False):
        # The start-up's objects (torch, transformers, FastAPI, ~250k of them) are frozen, so the collections that
        # streaming triggers skip them: a full one walked them all, 0.16 s of a stalled event loop with 512
        # streams open (lab.checks.front). The engine process freezes its own heap (ModelRunner).
        gc.collect()
        gc.freeze()
    try:
        server.run()
    finally:
        server.cancel_timers()
        state.engine.close()
    if not server.started and not server.should_exit:
        return 1  # could not bind, etc.
    if state.engine.fatal_error is not None:
        logger.error("exiting: %s", state.engine.fatal_error)
        return 1
    return 0


class ServerThread:
    """The server in a background thread on a free loopback port (tests, notebooks).

        with ServerThread(build_state(path)) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 log_level: str = "warning", exit_after_engine_failure: float = -1.0,
                 limits: ConnectionLimits | None = None) -> None:
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = _make_server(state, self.sock, None, log_level, shutdown_timeout, exit_after_engine_failure,
                                   limits=limits)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="minisgl-http", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.begin_shutdown()
        self.thread.join(timeout)
        self.server.cancel_timers()
        self.state.engine.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
