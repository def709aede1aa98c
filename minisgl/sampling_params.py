"""Per-request sampling settings: the boundary type between a user and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    temperature == 0 means greedy. top_k <= 0 means no top-k cut; top_p == 1 means no nucleus cut;
    min_p == 0 means no min-p cut (else tokens less likely than min_p times the most likely one are dropped).
    A request without a seed gets one drawn from the engine's seeded generator, so a whole run is
    reproducible from the engine seed alone.
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
