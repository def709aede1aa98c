"""Per-request sampling settings: the boundary type between a user and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from minisgl.errors import RequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 64


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    temperature == 0 means greedy. top_k <= 0 means no top-k cut; top_p == 1 means no nucleus cut;
    min_p == 0 means no min-p cut (else tokens less likely than min_p times the most likely one are dropped).
    A request without a seed gets one drawn from the engine's seeded generator, so a whole run is
    reproducible from the engine seed alone.

    Penalties act on the logits before temperature: `repetition_penalty` r (Hugging Face's semantics) divides
    a positive logit by r and multiplies a negative one by r for every token seen in the prompt or the output
    (1 = off); then, with c the number of times a token was generated so far, `frequency_penalty` f and
    `presence_penalty` p subtract c * f + (c > 0) * p (OpenAI's formula; 0 = off).

    `logprobs` N (None = off) returns, for every output token, its log-probability and the N most likely
    tokens' (N = 0: the sampled token's only), from the log-softmax of the logits the sampler drew from before
    temperature and the top-k/top-p/min-p cuts: after the penalties and the grammar mask.

    `n` streams share the prompt's prefill; stream i draws with seed + i (or a seed of its own from the engine
    when `seed` is None), so each stream is the run of that seed alone.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Accept a list or a single string for `stop` without making the dataclass mutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def processes_logits(self) -> bool:
        """Whether a step must process this request's logits before sampling (penalties, logprobs, a grammar):
        read for every request of every step, so computed once."""
        return self.has_penalties or self.logprobs is not None

    def validate(self, max_tokens_limit: int | None = None) -> None:
        """Raise RequestError (a ValueError) naming the first bad field in its message and `param`."""
        t = self.temperature
        if not isinstance(t, (int, float)) or t != t or t < 0 or t > 100:
            raise RequestError(f"temperature must be a number in [0, 100], got {t!r}", "temperature")
        if not isinstance(self.top_p, (int, float)) or not (0 < self.top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        mp = self.min_p
        if not isinstance(mp, (int, float)) or isinstance(mp, bool) or not (0 <= mp <= 1):
            raise RequestError(f"min_p must be in [0, 1], got {mp!r}", "min_p")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k == 0:
            raise RequestError(f"top_k must be a positive integer or -1 (off), got {self.top_k!r}", "top_k")
        if self.top_k < -1:
            raise RequestError(f"top_k must be a positive integer or -1 (off), got {self.top_k!r}", "top_k")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if max_tokens_limit is not None and self.max_tokens > max_tokens_limit:
            raise RequestError(f"max_tokens={self.max_tokens} exceeds the limit {max_tokens_limit}", "max_tokens")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer, got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise RequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}", name)
        r = self.repetition_penalty
        if not _is_number(r) or not 0 < r <= 10:
            raise RequestError(f"repetition_penalty must be a number in (0, 10], got {r!r}", "repetition_penalty")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {lp!r}",
                               "logprobs")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
