"""Stop strings, in one place: the engine-side check (does the decoded tail hold a stop string?) and the
text-side cuts (where the first one starts, how much of a tail could still grow into one).

Used by `LLM.generate` (check + trim), the HTTP server's front process (`StopStringScanner`: the same check on
the tokens as they arrive from the engine process) and the streaming detokenizer (`TextStream`: emit up to the
first stop string, hold back a partial one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest occurrence of any stop string in text[start:], or -1."""
    best = -1
    for s in stops:
        i = text.find(s, start)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def trim_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """text cut before its first stop string, and whether one was found."""
    cut = first_stop(text, stops)
    return (text, False) if cut < 0 else (text[:cut], True)


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def stop_window(stops: Sequence[str]) -> int:
    """Output tokens to decode to see any stop string whole: a byte-level token holds at least one byte and a
    character at most four, plus a few tokens of left context."""
    return 8 + 4 * max(len(s) for s in stops)


def make_stop_check(tokenizer, stops: Sequence[str]) -> Callable | None:
    """The engine's per-token check for `stops` (None when there are none): is a stop string in the decoded
    tail of the request's output? Runs on whatever thread steps the engine, so give it a tokenizer no other
    thread uses at the same time."""
    if not stops:
        return None
    if tokenizer is None:
        from minisgl.errors import RequestError
        raise RequestError("stop strings need a tokenizer; this model has none", "stop")
    stops = tuple(stops)
    window = stop_window(stops)

    def check(req) -> bool:
        tail = tokenizer.decode(req.output_ids[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)
    return check


class StopStringScanner:
    """`make_stop_check`'s test, run on a request's tokens as they arrive (the server's front process), so the
    output ends at the very token where `LLM.generate` would have stopped."""

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self._check = make_stop_check(tokenizer, stops)
        self.output_ids: list[int] = []  # the check reads `.output_ids`, as it does on a Req

    def feed(self, new_ids: Sequence[int]) -> int:
        """Add tokens; the index in `new_ids` of the first one after which a stop string shows, or -1."""
        for i, token in enumerate(new_ids):
            self.output_ids.append(token)
            if self._check(self):
                return i
        return -1
