"""Structured output: a grammar per request (xgrammar), a token mask per step, built on the host.

Why xgrammar: `lab/checks/grammar_mask_bench.py` (reports/cpu/grammar/) timed the three libraries made for this on
the embedded model's vocabulary and on one of Qwen3's size (151,936 tokens): xgrammar fills a JSON-schema mask
in a median of ~4-9 us per token at 151k tokens with compiles of ~0.1 s; llguidance's median was ~90 us with
spikes of tens of ms; outlines-core took 33 s to compile the free JSON-object grammar.

A request's `GrammarMatcher` follows its output: the engine advances it with each token as the token reaches
the host, and asks it for the next mask (a bitmask over the model's vocabulary: bit t of word t // 32 says token
t may come next) while the device runs the step's forward (Engine._sample_launched). A matcher that has
accepted the grammar's end (xgrammar: a stop token after a complete document) ends its request ("stop").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from minisgl.errors import RequestError
from minisgl.sampling_params import StructuredOutput


def bitmask_words(vocab: int) -> int:
    return (vocab + 31) // 32


class Grammars:
    """Compiles the grammars of one model's tokenizer (cached by spec) and builds matchers and masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            import xgrammar as xgr
        except ImportError:
            raise RequestError("structured output needs the xgrammar package (pip install xgrammar)",
                               "response_format") from None
        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[StructuredOutput, object] = {}
        # the server checks (compiles) a request's grammar on a tokenizer thread while the engine thread makes
        # matchers: one compile per spec
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput):
        """The compiled grammar of `so`; a spec xgrammar refuses is a RequestError on `response_format`."""
        with self._lock:
            return self._compile(so)

    def _compile(self, so: StructuredOutput):
        hit = self._compiled.get(so)
        if hit is not None:
            return hit
        try:
            if so.kind == "json_object":
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif so.kind == "json_schema":
                json.loads(so.spec)
                compiled = self.compiler.compile_json_schema(so.spec, any_whitespace=False)
            elif so.kind == "regex":
                compiled = self.compiler.compile_regex(so.spec)
            else:
                compiled = self.compiler.compile_grammar(so.spec)
        except Exception as e:  # json.JSONDecodeError, xgrammar's errors (RuntimeError, ValueError, ...)
            raise RequestError(f"the {so.kind} constraint cannot be compiled: {e}", "response_format") from None
        self._compiled[so] = compiled
        return compiled

    def matcher(self, so: StructuredOutput):
        return self.xgr.GrammarMatcher(self.compile(so))

    def fill(self, matchers: list, mask) -> None:
        """Write the next-token bitmask of each matcher into `mask` (a torch int32 tensor `[G, words]`, words =
        bitmask_words(vocab_size)); a terminated matcher (its request has finished: the token of a step still in
        flight is dropped) allows everything."""
        mask.fill_(-1)
        for i, m in enumerate(matchers):
            if not m.is_terminated():
                m.fill_next_token_bitmask(mask, i)


def grammar_stop_check(stop_check: Callable | None) -> Callable:
    """A request's stop check that also ends it when its grammar has ended (after the `stop_check` it had)."""
    def check(req) -> bool:
        return req.grammar.is_terminated() or (stop_check is not None and stop_check(req))
    return check
