"""Typed errors of a bad request, so a front end (the HTTP server, LLM.generate) can say which parameter
is wrong without reading the message."""

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
