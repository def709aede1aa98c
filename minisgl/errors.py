"""Typed errors of a bad request or a bad engine setting, so a front end (the HTTP server, LLM.generate, the
command line) can say which parameter is wrong without reading the message; and how the command line reports
any error: one line, an exit status."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable


class RequestError(ValueError):
    """A request the engine refuses: `param` names the request field at fault (engine terms: "prompt",
    "max_tokens", "temperature", ...), `code` is a machine-readable reason (OpenAI's codes where they exist,
    such as "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def prefixed(self, prefix: str) -> RequestError:
        """The same error with `prefix` before its message (e.g. which request of a batch)."""
        return type(self)(prefix + self.message, self.param, self.code)

    def __reduce__(self):  # picklable with its fields (ValueError's default would drop them)
        return type(self), (self.message, self.param, self.code)


class ConfigError(ValueError):
    """An engine or server setting that is wrong whatever the machine or the model (out of range, an unknown
    name): the caller's mistake, so the command line answers it as a usage error (exit status 2). `field` is the
    setting at fault, `flag` its command-line spelling; the message reads "<field> <problem>", the command line
    says "<flag> <problem>"."""

    def __init__(self, field: str, problem: str, flag: str | None = None) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem, self.flag = field, problem, flag

    def __reduce__(self):
        return type(self), (self.field, self.problem, self.flag)


# --- how the command line reports an error (python -m minisgl, python -m minisgl.server) ---------------------
USAGE_ERROR, RUNTIME_ERROR = 2, 1


def one_line(error: BaseException) -> str:
    """An exception as one line: its message with line breaks folded (a library's message may span several),
    prefixed by its type when the type says something the message does not (a KeyError's message is a key)."""
    message = " ".join(str(error).split())
    if isinstance(error, ConfigError) and error.flag:
        message = f"{error.flag} {' '.join(error.problem.split())}"
    elif not isinstance(error, (ValueError, OSError, ImportError, RuntimeError)) or not message:
        message = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return message


def add_traceback_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, print the whole traceback, not only its one-line message")


def run_command(prog: str, func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """func(args), its errors as one line on stderr (`prog: error: ...`) and an exit status: 2 for a setting
    out of range or a refused request (ConfigError, RequestError), 1 for anything else that went wrong; the
    traceback too with --traceback."""
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the command line's last word: every error becomes one line
        if getattr(args, "traceback", False):
            traceback.print_exc()
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
        return USAGE_ERROR if isinstance(e, (ConfigError, RequestError)) else RUNTIME_ERROR
