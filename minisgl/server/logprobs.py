"""Logprobs in the OpenAI response shapes, from the engine's per-token entries (`Req.output_logprobs`: the
token's logprob and its top-N alternatives, see SamplingParams.logprobs).

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A token's text is its own decode (special tokens spelled out); a model without a tokenizer names tokens
`token_id:N`. A logprob of -inf (a token the grammar forbids) is sent as -9999.0, as OpenAI does: JSON has no
infinity.
"""

from __future__ import annotations

import math

FLOOR = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else FLOOR


def token_text(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, token_ids: list[int], entries: list) -> list[dict]:
    """The `logprobs.content` items of these tokens."""
    out = []
    for t, (lp, top) in zip(token_ids, entries):
        text = token_text(tokenizer, t)
        out.append({"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [{"token": (s := token_text(tokenizer, i)), "logprob": _finite(v),
                                      "bytes": list(s.encode("utf-8"))} for i, v in top]})
    return out


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, offset: int) -> tuple[dict, int]:
    """The completions `logprobs` object of these tokens, whose text starts at character `offset` of the
    choice's text; and the offset after them."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, (lp, top) in zip(token_ids, entries):
        text = token_text(tokenizer, t)
        tokens.append(text)
        lps.append(_finite(lp))
        tops.append({token_text(tokenizer, i): _finite(v) for i, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def merge_completion_logprobs(parts: list[dict]) -> dict:
    """One completions `logprobs` object from several (a non-streamed response gathers its deltas')."""
    merged: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for p in parts:
        for k in merged:
            merged[k].extend(p[k])
    return merged
