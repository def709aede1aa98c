"""Typed errors of a bad request or a bad engine setting, so a front end (the HTTP server, LLM.generate, the
command line) can say which parameter is wrong without reading the message."""

from __future__ import annotations


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
    """An engine setting that is wrong whatever the machine or the model (out of range, an unknown name): the
    caller's mistake, so the command line answers it as a usage error (exit status 2). `field` is the
    EngineConfig field at fault; the message reads "<field> <problem>", so the command line can say the flag
    instead of the field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem

    def __reduce__(self):
        return type(self), (self.field, self.problem)
