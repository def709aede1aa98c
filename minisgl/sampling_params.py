"""Per-request sampling settings: the boundary type between a user and the scheduler.

A `SamplingParams` is checked once, when it is built: a value out of range (or of the wrong type: `True` is
not a temperature) raises `RequestError` naming the field, so every front end (`LLM.generate`, the HTTP
server, the CLI) refuses the same requests with the same words, and nothing past the constructor checks again.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

from minisgl.errors import RequestError

TOP_K_OFF = -1  # the one way to say "no top-k cut"
MAX_TEMPERATURE = 100.0  # far past any useful value; bounds 1/T's dynamic range, not the user's taste
MAX_SEED = 2**63 - 1  # a seed lives in an int64 tensor


def _real(value: object) -> bool:
    """A real number that is not a bool (True is an int to Python, not a temperature to a user)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    temperature == 0 means greedy. top_k == -1 (`TOP_K_OFF`) means no top-k cut, else it is a positive count;
    top_p == 1 means no nucleus cut; min_p == 0 means no min-p cut (else tokens less likely than min_p times the
    most likely one are dropped). A request without a seed gets one drawn from the engine's seeded generator,
    so a whole run is reproducible from the engine seed alone.
    """

    temperature: float = 1.0
    top_k: int = TOP_K_OFF
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        # `stop` may be a string or a list, `stop_token_ids` a list: stored as tuples (the dataclass is frozen)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                               "stop_token_ids")
        self._set(stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids))
        self._check()
        # one type per field from here on: 1 and 1.0 are the same temperature
        self._set(temperature=float(self.temperature), top_p=float(self.top_p), min_p=float(self.min_p),
                  top_k=int(self.top_k), max_tokens=int(self.max_tokens),
                  stop_token_ids=tuple(int(i) for i in self.stop_token_ids),
                  seed=None if self.seed is None else int(self.seed))

    def _set(self, **values: object) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _check(self) -> None:
        """Raise RequestError (a ValueError) naming the first bad field in its message and `param`."""
        t = self.temperature
        if not _real(t) or not 0 <= t <= MAX_TEMPERATURE:  # NaN fails both comparisons
            raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {t!r}", "temperature")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", "top_p")
        if not _real(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be a number in [0, 1], got {self.min_p!r}", "min_p")
        k = self.top_k
        if not _integer(k) or not (k >= 1 or k == TOP_K_OFF):
            raise RequestError(f"top_k must be a positive integer, or {TOP_K_OFF} for no top-k cut, got {k!r}",
                               "top_k")
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}", "ignore_eos")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise RequestError(f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if any(not _integer(i) or i < 0 for i in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def top_k_within(self, vocab: int) -> int:
        """The k of the top-k cut over a vocabulary of `vocab` tokens: `vocab` (keep all) when there is none."""
        return vocab if self.top_k == TOP_K_OFF else min(self.top_k, vocab)

    def cuts(self, vocab: int) -> bool:
        """Whether this request drops any token before drawing (top-k below the vocabulary, top-p, min-p)."""
        return self.top_k_within(vocab) < vocab or self.top_p < 1 or self.min_p > 0
