"""The OpenAI-compatible HTTP server (`python -m minisgl serve --model PATH`).

The command-line pieces (`main`, `add_serve_args`, `run_serve`) import nothing heavy, so `minisgl --help`
works without the `serve` extra; fastapi and uvicorn are imported when the server starts.
"""

from minisgl.server.launch import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ServerThread,
    add_engine_args,
    add_serve_args,
    build_parser,
    build_state,
    engine_kwargs_from_args,
    main,
    run_serve,
    serve,
)

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ServerThread", "add_engine_args", "add_serve_args", "build_parser",
           "build_state", "engine_kwargs_from_args", "main", "run_serve", "serve"]
