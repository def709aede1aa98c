# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 3 (id c05-003) ---
"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from minisgl.sampling_params import SamplingParams


# --- notebooks/05_scheduler.ipynb, cell 8 (id c05-008) ---
class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted): holds no KV
    RUNNING = "running"  # admitted: holds a row of the request→token table and KV pages
    FINISHED = "finished"  # the outcome is decided; it may still hold KV that a launched step uses
    RELEASED = "released"  # finished and everything given back: the engine holds nothing of it


class TokenLogprobs(Sequence):
    """A request's logprobs, one entry per output token: `(its logprob, [(token id, logprob), ...])`, the top
    `n` most likely first. Stored in flat arrays of float32 and int32 (what the step computed, so nothing is
    rounded); an entry is a tuple built when it is read."""

    __slots__ = ("_chosen", "_ids", "_values")

    def __init__(self) -> None:
        self._chosen, self._ids, self._values = array("f"), array("i"), array("f")

    def append(self, logprob: float, top_ids: list[int], top_logprobs: list[float]) -> None:
        """One token's entry; every token of a request has as many top entries (the request's `logprobs`)."""
        self._chosen.append(logprob)
        self._ids.extend(top_ids)
        self._values.extend(top_logprobs)

    def __len__(self) -> int:
        return len(self._chosen)

    def __getitem__(self, i: int | slice):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and an IndexError past the end
        n = len(self._ids) // len(self._chosen)  # top entries per token
        a, b = i * n, (i + 1) * n
        return self._chosen[i], list(zip(self._ids[a:b], self._values[a:b]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"


# --- notebooks/05_scheduler.ipynb, cell 9 (id c05-009) ---
@dataclass(eq=False)
class Req:
    """One generation request and its KV bookkeeping.

    The tokens are `input_ids + output_ids` followed by `num_pending` tokens already sampled on the device
    whose values the host has not read yet. `kv_len` of them have their K/V written (or being written by a
    launched step); the next step computes the rest. A decode step is simply the case "one token left to
    compute".
    """

    rid: int
    input_ids: list[int]
    params: SamplingParams
    seed: int
    output_ids: list[int] = field(default_factory=list)
    num_pending: int = 0
    status: ReqStatus = ReqStatus.WAITING
    # KV bookkeeping
    kv_len: int = 0
    pages: list[int] = field(default_factory=list)
    row: int | None = None  # row in the request→token table (None while it holds none)
    cached_len: int = 0  # leading tokens whose pages the prefix cache owns (locked for us via cache_node)
    cache_node: object = None
    # outcome and metrics
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    error: str | None = None
    num_cached_prompt_tokens: int = 0
    num_retractions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    stop_check: object = None  # callable(req) -> bool, for stop strings (needs a tokenizer)
    # per output token, with params.logprobs: (its logprob, [(token id, logprob) of the most likely ones])
    output_logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)
    grammar: object = None  # with params.structured_output: its grammar matcher (minisgl/grammar.py)

    @property
    def num_tokens(self) -> int:
        """All tokens, including pending ones."""
        return len(self.input_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_outputs_scheduled(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def finished(self) -> bool:
        """The outcome is decided (its KV may not be back yet: see `released`)."""
        return self.status in (ReqStatus.FINISHED, ReqStatus.RELEASED)

    @property
    def released(self) -> bool:
        """Finished, and its row and pages are back: nothing of it is left in the engine."""
        return self.status is ReqStatus.RELEASED

    def ids_between(self, start: int, end: int) -> list[int]:
        """Token ids start..end-1 (resolved ones), without building the whole sequence."""
        n_in = len(self.input_ids)
        if end <= n_in:
            return self.input_ids[start:end]
        if start >= n_in:
            return self.output_ids[start - n_in:end - n_in]
        return self.input_ids[start:] + self.output_ids[:end - n_in]

    def known_ids(self, end: int) -> list[int]:
        """The first `end` token ids; all must be resolved."""
        n_in = len(self.input_ids)
        if end <= n_in:
            return self.input_ids[:end]
        return self.input_ids + self.output_ids[:end - n_in]
