"""Request bodies of the OpenAI-compatible API, and the error shape every failure is answered with.

Parsing is strict: a wrong type is an error (no "5" for 5, no 1 for true), unknown fields are refused (a
typo such as `max_token` is named instead of silently ignored), and non-finite numbers are refused. Fields
the OpenAI API has but this server does not implement are accepted only at their neutral value, so a
client that sends `best_of: 1` works and one that asks for `best_of: 2` is told why not.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from minisgl.sampling_params import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # \ud800-\udfff spelled in JSON


class APIError(Exception):
    """An error with an HTTP status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _parse_int(text: str) -> int:
    return int(text)  # Python code, so a thread parsing a long list of numbers lets others run (the GIL)


def parse_json_object(raw: bytes, yield_gil: bool = False) -> dict:
    """The request body as a JSON object, or APIError(400). yield_gil: parse numbers through Python code, which
    is slower but lets other threads run while a worker thread parses a long list of token ids (the C decoder
    otherwise holds the GIL, and with it the event loop, for the whole parse)."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; send a JSON object", code="invalid_json")
    # Decoded here, strictly: json.loads(bytes) decodes with "surrogatepass", which turns the UTF-8 spelling of a
    # surrogate (b"\xed\xa0\x80", not UTF-8 at all) into a lone surrogate that no tokenizer takes (a 500).
    encoding = json.detect_encoding(raw)  # UTF-8 (with or without a BOM), or UTF-16/32 by their zero bytes
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        name = "UTF-8" if encoding.startswith("utf-8") else encoding.upper()
        raise APIError(400, f"the request body is not valid {name} text: byte {raw[e.start]:#04x} at offset "
                            f"{e.start} ({e.reason})", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_int=_parse_int if yield_gil else None)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    # JSON may spell unpaired UTF-16 surrogates (\ud800), which are not text and break tokenizers; and a body
    # nested deeper than json.dumps manages is refused too. Both checks re-encode the body, so they run only
    # when the raw bytes could hold such a thing (a cheap scan): an 8 MB list of token ids skips them.
    if _SURROGATE_ESCAPE.search(raw) is not None or raw.count(b"[") + raw.count(b"{") >= 64:
        _check_encodable(body)
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                       code="invalid_json")
    return body


def _check_encodable(body) -> None:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the request body holds an unpaired UTF-16 surrogate (such as \\ud800); "
                            "strings must be valid Unicode", code="invalid_json") from None
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None


def validation_error(err: ValidationError) -> APIError:
    """The first problem pydantic found, as an APIError naming the parameter."""
    first = err.errors(include_url=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    param = ".".join(loc) or None
    kind = first.get("type", "invalid")
    if kind == "missing":
        message = f"missing required parameter '{param}'"
    elif kind == "extra_forbidden":
        message = f"unrecognized request argument supplied: '{param}'"
    else:
        msg = first.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        message = f"invalid value for '{param}': {msg}" if param else msg
        if "input" in first and kind not in ("model_type", "dict_type"):
            try:
                shown = repr(first["input"])
            except RecursionError:
                shown = "a deeply nested value"
            message += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
    return APIError(400, message, param=param, code=kind)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,18}")  # a negative id gets SamplingParams' own "out of range" error


class _Sampling(_Strict):
    """Fields shared by both endpoints."""

    model: str
    # the sampling fields are typed here and range-checked once, by SamplingParams (a RequestError -> 400)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None  # extension, as in SGLang and vLLM
    top_k: int | None = None  # extension: -1 = off
    n: int | None = None  # streams of the prompt (SamplingParams range-checks it)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (Hugging Face's), as in SGLang and vLLM
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = False  # extension
    # json_object / json_schema (OpenAI's chat field), and the extensions regex / ebnf; completions take it too
    response_format: dict | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return ()
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("stop must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_LEN for s in v):
            raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters long")
        return tuple(v)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """OpenAI's map of token ids (as JSON keys: strings) to biases, with int keys; the ranges are
        SamplingParams' to check."""
        if not v:
            return None
        # ASCII digits only: int() alone would also take " 5", "+5", "1_000" and other scripts' digits
        if any(not _TOKEN_ID_KEY.fullmatch(k) for k in v):
            raise ValueError("logit_bias keys must be token ids (integers as strings, such as \"42\")")
        return {int(k): b for k, b in v.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: Any
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        """A string or a list of token ids (a one-element batch of either is unwrapped)."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]
        if isinstance(v, str):
            if v == "":
                raise ValueError("the prompt is empty")
            return v
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if set(map(type, v)) == {int}:  # ints, not bools (type(True) is bool); checked in C
                return v
            if len(v) > 1 and all(isinstance(t, str) or (isinstance(t, list) and t and all(
                    isinstance(i, int) and not isinstance(i, bool) for i in t)) for t in v):
                raise ValueError("batched prompts are not supported; send one prompt per request")
        raise ValueError("prompt must be a string or a list of token ids")

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError("only best_of=1 is supported")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Any] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        """Text, or a list of text parts (joined); other part types are refused."""
        if isinstance(v, list):
            texts = []
            for part in v:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"only text content parts are supported, got {kind!r}")
                texts.append(TextPart.model_validate(part).text)
            return "".join(texts)
        return v

    @model_validator(mode="after")
    def _needs_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("messages must hold at least one message")
        return v

    @field_validator("tools")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none"):
            raise ValueError("tool_choice is not supported")
        return v

    def conversation(self) -> list[dict]:
        """Messages as plain dicts for the chat template (developer is the newer name of system)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            msg = {"role": role, "content": m.content or ""}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out


def structured_output_of(response_format: dict | None) -> StructuredOutput | None:
    """`response_format` as the engine's StructuredOutput (None for text), or APIError(400) on response_format.

    {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name": ..., "schema":
    {...}, "strict": ..., "description": ...}} (OpenAI's), and the extensions {"type": "regex", "regex": "..."}
    and {"type": "ebnf", "ebnf": "..."} (a GBNF grammar whose start rule is `root`)."""
    if response_format is None:
        return None
    kind = response_format.get("type")

    def bad(message: str) -> APIError:
        return APIError(400, f"invalid response_format: {message}", param="response_format")

    allowed = {"text": set(), "json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"},
               "ebnf": {"ebnf"}}
    if kind not in allowed:
        raise bad(f"type must be one of {', '.join(allowed)}, got {kind!r}")
    extra = set(response_format) - {"type"} - allowed[kind]
    if extra:
        raise bad(f"unexpected field(s) {sorted(extra)} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("json_schema must be an object with a 'schema' object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise bad(f"unexpected field(s) {sorted(unknown)} in json_schema")
        return StructuredOutput("json_schema", json.dumps(spec.get("schema", {})))
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise bad(f"{kind} must be a non-empty string")
    return StructuredOutput(kind, text)
