"""The offline API: `LLM(model, **switches).generate(prompts, SamplingParams)`."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.config import make_config
from minisgl.engine import Engine
from minisgl.errors import RequestError
from minisgl.sampling_params import SamplingParams
from minisgl.stop_strings import make_stop_check, trim_at_stop
from minisgl.tokenizer import load_tokenizer  # noqa: F401  (LLM's tokenizer; callers import it from here too)


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_prompt_tokens: int
    ttft: float | None  # seconds from submission to the first token
    latency: float  # seconds from submission to the last token
    # with SamplingParams.logprobs: per output token, (its logprob, [(token id, logprob) of the most likely]);
    # a read-only sequence (scheduler.req.TokenLogprobs) whose entries are built when read
    logprobs: Sequence[tuple[float, list[tuple[int, float]]]] | None = None
    index: int = 0  # which of the prompt's SamplingParams.n streams


class LLM:
    def __init__(self, model: str, **switches) -> None:
        """switches: EngineConfig's fields (overlap=False, chunked_prefill_size=0, ...). The old
        `chunked_prefill=False` is refused with a TypeError that names its new spelling."""
        self.engine = Engine(make_config(model, **switches))
        self.config = self.engine.config  # the engine's, with max_running_requests resolved (0/None = auto)
        self.tokenizer = load_tokenizer(self.engine.runner.model_path)

    def close(self) -> None:
        """Release the engine's processes (tensor-parallel ranks); also done by `with`, __del__ and at exit."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the atexit hook of minisgl.distributed has done it
            pass

    # --- helpers -------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; pass token ids instead of text", "prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _text(self, ids: list[int], params: SamplingParams) -> str | None:
        text = self.decode(ids)
        return text if text is None or not params.stop else trim_at_stop(text, params.stop)[0]

    # --- the API -------------------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for one prompt or many (a prompt is text or a list of token ids): `n` outputs each
        (SamplingParams.n, default 1), in prompt order, a prompt's streams next to each other (`index`).

        Every request is checked before any runs: a bad one raises ValueError naming it, and the engine
        stays ready for the next call.
        """
        # one prompt: text, or a flat list of token ids (Python or numpy integers)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], numbers.Integral))
        prompt_list = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompt_list)
        if len(params) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params)} sampling params")
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            try:
                ids = self.encode(prompt)
                self.engine.check_request(ids, p)
                stop_check = make_stop_check(self.tokenizer, p.stop)
            except RequestError as e:
                raise e.prefixed(f"request {i}: ") from None
            except (ValueError, TypeError) as e:
                raise type(e)(f"request {i}: {e}") from None
            encoded.append((ids, p, stop_check))
        groups = [self.engine.add_requests(ids, p, stop_check) for ids, p, stop_check in encoded]
        reqs = [r for group in groups for r in group]
        show = self.config.progress if progress is None else progress
        bar = None
        if show:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        self.engine.run(reqs, progress=bar.update if bar else None)
        if bar:
            bar.close()
        outs = []
        for group, (_, p, _) in zip(groups, encoded):
            outs.extend(RequestOutput(
                prompt_token_ids=r.input_ids, token_ids=list(r.output_ids),
                text=self._text(r.output_ids, p), finish_reason=r.finish_reason,
                num_cached_prompt_tokens=r.num_cached_prompt_tokens,
                ttft=None if r.first_token_time is None else r.first_token_time - r.arrival_time,
                latency=(r.finish_time or r.arrival_time) - r.arrival_time,
                logprobs=None if p.logprobs is None else r.output_logprobs, index=i)
                for i, r in enumerate(group))
        return outs
