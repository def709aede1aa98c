"""Token ids to text, a few tokens at a time, for streaming.

Two layers:

* `IncrementalDetokenizer` turns a growing list of token ids into text pieces. A byte-level tokenizer can
  split one UTF-8 character over several tokens; decoding such a prefix gives U+FFFD (the replacement
  character) at the end. A piece is released when the decoded text does not end in U+FFFD, so no
  character is ever cut in two. Text that keeps ending in U+FFFD (invalid bytes) is released once the
  window grows long, all but the tokens that may still finish a character. Each decode covers a short
  window that starts one settled stretch back: tokenizers that drop a leading space when a slice starts at
  a word (SentencePiece) see the same left context in both decodes that are compared, so the pieces agree
  with a decode of everything. Special tokens the decode skips are left out of the window.
* `TextStream` adds stop strings on top (the cuts live in `minisgl.stop_strings`): text is emitted only up
  to the first stop string, and a tail that could still grow into a stop string is held back until the
  next token settles it. `finish()` returns the rest, so the concatenation of every piece equals
  `final_text()`: the full decode cut at the first stop string, the same text a non-streamed request
  returns.
"""

from __future__ import annotations

from collections.abc import Callable

from minisgl.stop_strings import first_stop, partial_stop_len, trim_at_stop

__all__ = ["IncrementalDetokenizer", "TextStream", "first_stop", "partial_stop_len", "trim_at_stop"]

REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 byte tokens: a window of this many tokens whose text
# still ends in U+FFFD holds a genuinely invalid sequence (U+FFFD in the full decode too). Releasing it then
# keeps every decode window short, so a stream never re-decodes a growing tail on the event loop.
MAX_HELD_TOKENS = 16
# An unfinished character lacks at least one of its at most 4 bytes, so it spans at most 3 tokens: only
# these are kept back when a long window is released.
MAX_OPEN_TOKENS = 3


def decoder_of(tokenizer) -> Callable[[list[int], bool], str]:
    """decode(ids, skip_special_tokens) for streaming: the Rust tokenizer's own decode when transformers' wrapper
    around it would add nothing (no clean-up of spaces, no subclass overriding the decode), else the wrapper.

    Why: the wrapper converts the ids one by one and checks its arguments before it calls the same Rust decode,
    which makes each call ~4x slower; a stream decodes twice a step, and at 500 streams that is ~15% of the
    server's event loop."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: keep its decode
        TokenizersBackend = PreTrainedTokenizerBase = None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (TokenizersBackend is not None and backend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode
            and not tokenizer.clean_up_tokenization_spaces):
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = decoder_of(tokenizer)
        self.ids: list[int] = []  # every token pushed
        # The tokens that make text: special tokens the decode skips are left out, so they neither count
        # towards a hold nor sit between the bytes of one character in a decode window.
        self._text_ids: list[int] = []
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else frozenset()
        self._silent: dict[int, bool] = {}
        self._window_start = 0  # first text token of the decode window
        self._released = 0  # text tokens whose text has been handed out
        self._window_text = ""  # decode(_text_ids[_window_start:_released])
        self.text = ""  # every piece handed out, concatenated

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, self.skip_special_tokens)

    def _makes_text(self, token: int) -> bool:
        if token not in self._special:
            return True
        if token not in self._silent:  # only drop a special token the decode really skips
            self._silent[token] = self._decode([token]) == ""
        return not self._silent[token]

    def push(self, new_ids) -> str:
        """Add tokens; return the newly settled text ('' while a character is still incomplete)."""
        new = [int(t) for t in new_ids]
        self.ids.extend(new)
        self._text_ids.extend(t for t in new if self._makes_text(t))
        ids = self._text_ids
        if len(ids) == self._released:
            return ""
        window = self._decode(ids[self._window_start:])
        if not window.startswith(self._window_text):  # a decode that still rewrites its left context
            if len(ids) - self._released < MAX_HELD_TOKENS:
                return ""
            self._window_start = self._released = len(ids)  # held too long: restart the window here
            self._window_text = ""
            return ""
        if not window.endswith(REPLACEMENT):
            return self._release(window, len(ids))
        if len(ids) - self._window_start < MAX_HELD_TOKENS:
            return ""  # the last character may still be unfinished
        # The window has grown long and its text still ends in U+FFFD: release all that no later token can
        # change and keep back only what may be an unfinished character.
        return self._release(*self._settled_head(window))

    def _settled_head(self, window: str) -> tuple[str, int]:
        """(text, end): the decode of the window's tokens up to `end` that no later token can change, with
        every token that may hold part of an unfinished character left out."""
        ids, start = self._text_ids, self._window_start
        ends = range(len(ids) - 1, max(self._released, len(ids) - MAX_OPEN_TOKENS) - 1, -1)
        heads = []
        for end in ends:
            head = self._decode(ids[start:end])
            if not head.startswith(self._window_text):
                continue
            # A head that ends in a whole character is final for any decoder (SentencePiece's byte
            # fallback included, which shows an unfinished run of byte tokens as one U+FFFD per byte).
            if not head.endswith(REPLACEMENT):
                return head, end
            heads.append((head, end))
        # Every nearby cut ends in U+FFFD too: invalid bytes come just before the open one. Byte-level BPE
        # decodes with a lossy UTF-8 decode, where only the last U+FFFD can still change: it may be a lead
        # byte whose character is not complete yet, while every earlier one is an invalid byte (a lone
        # continuation byte, or a lead byte cut off by what followed) that no later byte turns into a
        # character. So the text that leaves out just the last U+FFFD is settled.
        for head, end in heads:
            if len(head) < len(window) and window.startswith(head):
                return head, end
        return window, len(ids)  # no cut keeps the decode consistent: release all (the bounded hold)

    def _release(self, text: str, end: int) -> str:
        piece = text[len(self._window_text):]
        self._window_start, self._released = self._released, end
        self._window_text = self._decode(self._text_ids[self._window_start:self._released])
        self.text += piece
        return piece

    def full_text(self) -> str:
        """The decode of every token at once (what a non-streamed request returns, before stop strings)."""
        return self._decode(self.ids)


class TextStream:
    """Streaming text of one request: pieces that are final, cut at the first stop string."""

    def __init__(self, tokenizer, stop=(), skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = tuple(stop)
        self.emitted = 0  # characters of detok.text handed out
        self.stopped = False  # a stop string was found; nothing more is emitted
        self._final: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.detok.ids)

    def push(self, new_ids) -> str:
        if self.stopped or self._final is not None:
            self.detok.ids.extend(int(t) for t in new_ids)
            return ""
        self.detok.push(new_ids)
        text = self.detok.text
        safe = len(text)
        if self.stops:
            # Everything emitted so far holds no stop string and no tail that could begin one, so every
            # occurrence, complete or not yet, starts at or after `emitted`. Emit up to the earliest one.
            cut = first_stop(text, self.stops, self.emitted)
            safe -= partial_stop_len(text[self.emitted:], self.stops)
            if cut >= 0:
                safe, self.stopped = min(safe, cut), True
        piece, self.emitted = text[self.emitted:safe], max(self.emitted, safe)
        return piece

    def final_text(self) -> str:
        """The whole response text: the full decode, cut at the first stop string."""
        if self._final is None:
            text, found = trim_at_stop(self.detok.full_text(), self.stops)
            self.stopped = self.stopped or found
            self._final = text
        return self._final

    def finish(self) -> str:
        """The text not yet emitted; after it, the pieces add up to final_text()."""
        emitted_text = self.detok.text[:self.emitted]
        final = self.final_text()
        self.emitted = len(self.detok.text)
        if final.startswith(emitted_text):
            return final[len(emitted_text):]
        # Only a tokenizer whose decode rewrites earlier text could get here; send what is new.
        common = 0
        while common < min(len(final), len(emitted_text)) and final[common] == emitted_text[common]:
            common += 1
        return final[max(common, len(emitted_text)):]
