"""Per-request sampling settings: the boundary type between a user and the scheduler.

A `SamplingParams` is checked once, when it is built: a value out of range (or of the wrong type: `True` is
not a temperature) raises `RequestError` naming the field, so every front end (`LLM.generate`, the HTTP
server, the CLI) refuses the same requests with the same words, and nothing past the constructor checks again.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from functools import cached_property

from minisgl.errors import RequestError

TOP_K_OFF = -1  # the one way to say "no top-k cut"
MAX_TEMPERATURE = 100.0  # far past any useful value; bounds 1/T's dynamic range, not the user's taste
MAX_SEED = 2**63 - 1  # a seed lives in an int64 tensor
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_N = 64  # streams of one request
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a token's bias: [-100, 100]
MAX_BIASED_TOKENS = 1024  # entries of one request's logit_bias: each step uploads them


def _real(value: object) -> bool:
    """A real number that is not a bool (True is an int to Python, not a temperature to a user)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must follow (minisgl/grammar.py): any JSON object, a JSON schema (JSON text), a
    regular expression, or an EBNF grammar (GBNF, the llama.cpp dialect xgrammar reads, rule `root`)."""

    kind: str  # one of GRAMMAR_KINDS
    spec: str = ""  # the schema, the regex or the grammar; "" for json_object

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise RequestError(f"structured output must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}",
                               "response_format")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise RequestError(f"a {self.kind} constraint needs its text", "response_format")


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens and when it stops.

    temperature == 0 means greedy. top_k == -1 (`TOP_K_OFF`) means no top-k cut, else it is a positive count;
    top_p == 1 means no nucleus cut; min_p == 0 means no min-p cut (else tokens less likely than min_p times the
    most likely one are dropped). A request without a seed gets one drawn from the engine's seeded generator,
    so a whole run is reproducible from the engine seed alone.

    Penalties act on the logits before temperature: `repetition_penalty` r (Hugging Face's semantics) divides
    a positive logit by r and multiplies a negative one by r for every token seen in the prompt or the output
    (1 = off); then, with c the number of times a token was generated so far, `frequency_penalty` f and
    `presence_penalty` p subtract c * f + (c > 0) * p (OpenAI's formula; 0 = off).

    `logprobs` N (None = off) returns, for every output token, its log-probability and the N most likely
    tokens' (N = 0: the sampled token's only), from the log-softmax of the logits the sampler drew from before
    temperature and the top-k/top-p/min-p cuts: after the penalties, the logit bias and the grammar mask.

    `logit_bias` maps token ids to a number in [-100, 100] added to their logits before sampling (OpenAI's field;
    -100 in effect bans a token, +100 all but forces it), after the penalties and before the grammar mask.

    `structured_output` constrains the output to a grammar (JSON, a JSON schema, a regex, EBNF).

    `n` streams share the prompt's prefill; stream i draws with seed + i (or a seed of its own from the engine
    when `seed` is None), so each stream is the run of that seed alone.
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
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = 1
    structured_output: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)  # a dict is taken too

    def __post_init__(self) -> None:
        # `stop` may be a string or a list, `stop_token_ids` a list: stored as tuples (the dataclass is frozen)
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise RequestError(f"stop must be a string or a list of strings, got {self.stop!r}", "stop")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                               "stop_token_ids")
        bias = list(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else self.logit_bias
        if not isinstance(bias, (list, tuple)) or any(
                not isinstance(e, (list, tuple)) or len(e) != 2 for e in bias):
            raise RequestError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias")
        self._set(stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids), logit_bias=tuple(map(tuple, bias)))
        self._check()
        # one type per field from here on: 1 and 1.0 are the same temperature
        self._set(temperature=float(self.temperature), top_p=float(self.top_p), min_p=float(self.min_p),
                  top_k=int(self.top_k), max_tokens=int(self.max_tokens),
                  stop_token_ids=tuple(int(i) for i in self.stop_token_ids),
                  seed=None if self.seed is None else int(self.seed),
                  frequency_penalty=float(self.frequency_penalty), presence_penalty=float(self.presence_penalty),
                  repetition_penalty=float(self.repetition_penalty), n=int(self.n),
                  logprobs=None if self.logprobs is None else int(self.logprobs),
                  logit_bias=tuple(sorted((int(t), float(b)) for t, b in self.logit_bias)))

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
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}", name)
        r = self.repetition_penalty
        if not _real(r) or not 0 < r <= 10:
            raise RequestError(f"repetition_penalty must be a number in (0, 10], got {r!r}", "repetition_penalty")
        lp = self.logprobs
        if lp is not None and (not _integer(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {lp!r}",
                               "logprobs")
        if not _integer(self.n) or not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        if len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise RequestError(f"logit_bias may name at most {MAX_BIASED_TOKENS} tokens, got {len(self.logit_bias)}",
                               "logit_bias")
        for t, b in self.logit_bias:
            if not _integer(t) or t < 0:
                raise RequestError(f"logit_bias keys must be non-negative token ids, got {t!r}", "logit_bias")
            if not _real(b) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise RequestError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                   f"got {b!r} for token {t}", "logit_bias")
        if len({int(t) for t, _ in self.logit_bias}) < len(self.logit_bias):
            raise RequestError("logit_bias names a token twice", "logit_bias")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise RequestError("structured_output must be a StructuredOutput", "response_format")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1

    @cached_property
    def processes_logits(self) -> bool:
        """Whether a step must process this request's logits before sampling (penalties, a logit bias, logprobs, a
        grammar): read for every request of every step, so computed once."""
        return (self.has_penalties or bool(self.logit_bias) or self.logprobs is not None
                or self.structured_output is not None)

    def top_k_within(self, vocab: int) -> int:
        """The k of the top-k cut over a vocabulary of `vocab` tokens: `vocab` (keep all) when there is none."""
        return vocab if self.top_k == TOP_K_OFF else min(self.top_k, vocab)

    def cuts(self, vocab: int) -> bool:
        """Whether this request drops any token before drawing (top-k below the vocabulary, top-p, min-p)."""
        return self.top_k_within(vocab) < vocab or self.top_p < 1 or self.min_p > 0
