"""Start the server: the `serve` command line, a blocking `serve()`, and `ServerThread` for tests.

Shutdown: the first SIGINT or SIGTERM stops accepting connections and refuses new requests (503); requests
in flight get `shutdown_timeout` seconds to finish, then the engine aborts them (their streams end with
finish_reason "abort"). Then the engine thread aborts what is left, releases it and stops, and the process
exits with status 0. A second signal skips the grace period.

Clients are held to deadlines and a bound (`limits.py`, flags --header-timeout, --body-timeout,
--max-connections): a request's head and body must arrive in time, and connections past the bound are refused.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import threading
import time

from minisgl.config import add_engine_args, engine_kwargs_from_args, make_config
from minisgl.server.limits import ConnectionLimits

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
    return parser


def limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    """The --header-timeout, --body-timeout and --max-connections flags; a bad value is a ConfigError."""
    from minisgl.errors import ConfigError
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout),
                        ("--max-connections", args.max_connections)):
        if not value > 0:  # NaN too
            raise ConfigError(flag.removeprefix("--").replace("-", "_"), f"must be > 0, got {value}", flag)
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.max_connections)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down cleanly; returns the exit status."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError(_MISSING_DEPS) from None
    limits = limits_from_args(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = build_state(args.model, args.served_model_name, **engine_kwargs_from_args(args))
    return serve(state, args.host, args.port, args.shutdown_timeout, args.log_level, limits)


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
def build_state(model: str, served_model_name: str | None = None, **engine_kwargs):
    """Load the engine and tokenizer and start the engine thread; returns the app's ServerState."""
    from minisgl.engine import Engine
    from minisgl.llm import load_tokenizer
    from minisgl.server.app import ServerState
    from minisgl.server.worker import EngineWorker

    engine = Engine(make_config(model, **engine_kwargs))
    path = engine.runner.model_path
    tokenizer = load_tokenizer(path)
    stop_tokenizer = load_tokenizer(path) if tokenizer is not None else None  # one per thread
    name = served_model_name or model
    aliases = {model, os.path.normpath(model), path, os.path.basename(os.path.normpath(model))} - {name}
    worker = EngineWorker(engine)
    worker.start()
    return ServerState(worker=worker, tokenizer=tokenizer, stop_tokenizer=stop_tokenizer, model_name=name,
                       model_aliases=frozenset(aliases))


def _make_server(state, sock_or_host, port, log_level: str, shutdown_timeout: float,
                 limits: ConnectionLimits | None = None):
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools when installed, else h11

    from minisgl.server.app import create_app
    from minisgl.server.limits import guarded_protocol

    class Server(uvicorn.Server):
        """uvicorn with our own signal handling: a grace period, then abort; exit status 0."""

        grace_timer: threading.Timer | None = None

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
            if force:
                self.force_exit = True
                state.worker.abort_all()
            elif not self.should_exit:
                logger.info("shutting down: %.1fs for in-flight requests, then they are aborted",
                            shutdown_timeout)
                self.grace_timer = threading.Timer(shutdown_timeout, state.worker.abort_all)
                self.grace_timer.daemon = True
                self.grace_timer.start()
            self.should_exit = True

    config = uvicorn.Config(create_app(state), host=sock_or_host if isinstance(sock_or_host, str) else None,
                            port=port or 0, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5, lifespan="on",
                            http=guarded_protocol(AutoHTTPProtocol, limits or ConnectionLimits()))
    return Server(config)


def serve(state, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, shutdown_timeout: float = 5.0,
          log_level: str = "info", limits: ConnectionLimits | None = None) -> int:
    """Run the HTTP server in this (main) thread until a signal; returns 0 after a clean shutdown."""
    server = _make_server(state, host, port, log_level, shutdown_timeout, limits)
    try:
        server.run()
    finally:
        if server.grace_timer is not None:
            server.grace_timer.cancel()
        state.worker.stop()
    if not server.started and not server.should_exit:
        return 1  # could not bind, etc.
    return 0


class ServerThread:
    """The server in a background thread on a free loopback port (tests, notebooks).

        with ServerThread(build_state(path)) as srv:
            httpx.get(srv.url + "/health")
    """

    def __init__(self, state, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                 log_level: str = "warning", limits: ConnectionLimits | None = None) -> None:
        self.state = state
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = _make_server(state, self.sock, None, log_level, shutdown_timeout, limits)
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
        if self.server.grace_timer is not None:
            self.server.grace_timer.cancel()
        self.state.worker.stop()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
