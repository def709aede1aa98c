"""Token ids to text, a few tokens at a time, for streaming.

Two layers:

* `IncrementalDetokenizer` turns a growing list of token ids into text pieces. A byte-level tokenizer can
  split one UTF-8 character over several tokens; decoding such a prefix gives U+FFFD (the replacement
  character) at the end. A piece is released only when the decoded text does not end in U+FFFD, so no
  character is ever cut in two. Each decode covers a short window that starts one settled stretch back:
  tokenizers that drop a leading space when a slice starts at a word (SentencePiece) see the same
  left context in both decodes that are compared, so the pieces agree with a decode of everything.
* `TextStream` adds stop strings on top (the cuts live in `minisgl.stop_strings`): text is emitted only up
  to the first stop string, and a tail that could still grow into a stop string is held back until the
  next token settles it. `finish()` returns the rest, so the concatenation of every piece equals
  `final_text()`: the full decode cut at the first stop string, the same text a non-streamed request
  returns.
"""

from __future__ import annotations

from minisgl.stop_strings import first_stop, partial_stop_len, trim_at_stop

__all__ = ["IncrementalDetokenizer", "TextStream", "first_stop", "partial_stop_len", "trim_at_stop"]

REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so at most 4 byte tokens: text still unsettled after this many
# tokens is a genuinely invalid sequence (U+FFFD in the full decode too). Releasing it then keeps every
# decode window short, so a stream never re-decodes a growing tail on the event loop.
MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # first token of the decode window
        self._released = 0  # tokens whose text has been handed out
        self._window_text = ""  # decode(ids[_window_start:_released])
        self.text = ""  # every piece handed out, concatenated

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids) -> str:
        """Add tokens; return the newly settled text ('' while a character is still incomplete)."""
        self.ids.extend(int(t) for t in new_ids)
        if len(self.ids) == self._released:
            return ""
        window = self._decode(self.ids[self._window_start:])
        unsettled = window.endswith(REPLACEMENT) or not window.startswith(self._window_text)
        if unsettled and len(self.ids) - self._released < MAX_HELD_TOKENS:
            return ""  # an unfinished character (or a decode that still rewrites its left context)
        if not window.startswith(self._window_text):  # held too long: restart the window here
            self._window_start = self._released = len(self.ids)
            self._window_text = ""
            return ""
        end = len(self.ids)
        if window.endswith(REPLACEMENT):  # many tokens at once, the last character still open: keep it back
            for k in range(1, 4):
                head = self._decode(self.ids[self._window_start:end - k])
                if not head.endswith(REPLACEMENT) and head.startswith(self._window_text):
                    window, end = head, end - k
                    break
        piece = window[len(self._window_text):]
        self._window_start, self._released = self._released, end
        self._window_text = self._decode(self.ids[self._window_start:self._released])
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
