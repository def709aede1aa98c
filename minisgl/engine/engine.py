# generated from notebooks/07_overlap.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/07_overlap.ipynb, cell 3 (id c07-003) ---
"""The engine loop: schedule, run, sample, resolve.

Two loops behind one switch. The plain loop runs a step and waits for its tokens before scheduling the
next. The overlap loop launches step N+1 before it reads step N's tokens: the host's scheduling work hides
behind the device's compute, and a request's newest token reaches the next step on the device (the model
runner scatters sampled tokens into the token-id table and gathers each step's inputs from it). Tokens are
identical either way; only the timing differs. On a CPU every launch finishes before it returns, so the
overlap loop runs the same code with nothing to hide.
"""

from __future__ import annotations

import numbers
import random
import time
from collections.abc import Callable

from minisgl.config import EngineConfig
from minisgl.engine.model_runner import ModelRunner, StepOutput
from minisgl.errors import RequestError
from minisgl.grammar import grammar_stop_check
from minisgl.kvcache import PageAllocator
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import NEED_SYNC, Req, ReqStatus


# --- notebooks/07_overlap.ipynb, cell 6 (id c07-006) ---
class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.runner = ModelRunner(config)
        # the runner's config: max_running_requests 0/None (auto) is resolved there, from the memory it measured
        self.config = config = self.runner.config
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        self.allocator = PageAllocator(self.runner.num_pages)
        # the prefix cache (RadixCache, or NaiveCache with the radix_cache switch off) and your Scheduler, built by
        # the model's runtime (engine/runtime.py), which knows what else the model needs (a hybrid: notebook 10)
        self.cache, self.scheduler = self.runner.runtime.make_scheduler(config, self.allocator, self.runner.req_pool)
        self.eos_ids = frozenset(self.model_config.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._next_rid = 0
        self._inflight: StepOutput | None = None
        self._forks: list[tuple[Req, list[Req]]] = []  # (first stream, the streams waiting for its prefill)
        self._grammars = None  # minisgl/grammar.py, made at the first structured request
        # graph_split_steps: decode steps above the largest graph, replayed in graph-sized pieces
        self.stats = {"steps": 0, "decode_steps": 0, "graph_steps": 0, "graph_split_steps": 0, "max_decode_batch": 0}

    # --- requests ------------------------------------------------------------------------------------
    def check_request(self, input_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError (a ValueError) naming what is wrong with a request and which parameter."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if len(input_ids) == 0:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        # A list of Python ints, the usual prompt, is checked in C (a loop over a 1k-token prompt costs ~1 ms
        # of the server's event loop per request). Anything else takes the loop, which also finds the entry to
        # name: the index, not the token, so a None token cannot read as "nothing bad found". Integral admits
        # numpy integers (a tokenizer's arrays), not bools.
        if not (set(map(type, input_ids)) == {int} and min(input_ids) >= 0 and max(input_ids) < vocab):
            bad = next((i for i, t in enumerate(input_ids)
                        if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"token id {input_ids[bad]!r} is out of the vocabulary [0, {vocab})", "prompt")
        # the params themselves were checked when they were built (SamplingParams.__post_init__), but for the
        # vocabulary, which only the engine knows: a biased token past it would index past the logits
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by token id
            raise RequestError(f"logit_bias names token {params.logit_bias[-1][0]}, out of the vocabulary "
                               f"[0, {vocab})", "logit_bias")
        if params.processes_logits and self.config.tp_size > 1:  # ranks 1..N-1 see no request's tokens
            raise RequestError("penalties, logit bias, logprobs and structured output are not supported with "
                               "tensor parallelism (tp_size > 1) yet", "logprobs" if params.logprobs is not None
                               else "response_format" if params.structured_output else
                               "logit_bias" if params.logit_bias else "repetition_penalty")
        if params.structured_output is not None:  # compiled (and cached) now: a bad grammar is refused here
            self.grammars().compile(params.structured_output)
        n, ctx = len(input_ids), self.max_model_len
        if n >= ctx:
            raise RequestError(f"the prompt has {n} tokens, longer than the context of {ctx} tokens", "prompt",
                               "context_length_exceeded")
        if n + params.max_tokens > ctx:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                               f"of {ctx} tokens", "max_tokens", "context_length_exceeded")
        cap = self.runner.kv_capacity_tokens
        if n + params.max_tokens > cap:
            raise RequestError(f"the request needs up to {n + params.max_tokens} KV slots but the whole KV pool "
                               f"holds {cap}; it cannot run even alone", "max_tokens", "context_length_exceeded")

    def add_request(self, input_ids: list[int], params: SamplingParams,
                    stop_check: Callable[[Req], bool] | None = None, seed: int | None = None,
                    queue: bool = True) -> Req:
        """One request (one stream: `add_requests` makes the n of `params.n`). `seed` overrides the params'
        (a stream's); `queue=False` leaves it to the caller to queue."""
        input_ids = list(input_ids)
        self.check_request(input_ids, params)
        # numpy integers become plain ints once, here; a list of ints (a server's prompt) is kept as it is (the
        # loop cost 29 us of the engine loop for each 740-token prompt of a burst, on the 2-core CPU machine)
        if set(map(type, input_ids)) != {int}:
            input_ids = [int(t) for t in input_ids]
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(31)
        req = Req(self._next_rid, input_ids, params, seed, stop_check=stop_check)
        self._next_rid += 1
        if params.structured_output is not None:  # its matcher; the request ends when the grammar does
            req.grammar = self.grammars().matcher(params.structured_output)
            req.stop_check = grammar_stop_check(stop_check)
        if queue:
            self.scheduler.add(req)
        return req

    def add_requests(self, input_ids: list[int], params: SamplingParams,
                     stop_check: Callable[[Req], bool] | None = None) -> list[Req]:
        """The `params.n` streams of one prompt (`add_request` for each), prefilled once: stream 0 is queued now,
        the others wait (`_forks`) until its prompt has been scheduled, and so put in the prefix cache, then
        reuse its KV pages and compute only the prompt's last token. Stream i draws with seed + i, so it is
        the run of that seed alone."""
        self.check_request(input_ids, params)
        seeds = [params.seed + i if params.seed is not None else self._rng.getrandbits(31) for i in range(params.n)]
        reqs = [self.add_request(input_ids, params, stop_check, seed=s, queue=i == 0) for i, s in enumerate(seeds)]
        if len(reqs) > 1:
            self._forks.append((reqs[0], reqs[1:]))
        return reqs

    def _release_forks(self) -> None:
        """Queue the waiting streams whose first stream has its prompt scheduled (or has ended, or when there is
        no cache to share through)."""
        keep = []
        for first, rest in self._forks:
            if first.kv_len >= len(first.input_ids) or first.finished or not self.cache.keeps_pages:
                for r in rest:
                    if not r.finished:  # aborted while it waited: already released
                        self.scheduler.add(r)
            else:
                keep.append((first, rest))
        self._forks = keep

    def abort(self, req: Req) -> None:
        """Stop a request now; its pages come back as soon as no launched step uses them."""
        if any(req in rest for _, rest in self._forks):  # a stream not queued yet holds nothing
            req.status, req.finish_reason, req.finish_time = ReqStatus.RELEASED, "abort", time.perf_counter()
            return
        self.scheduler.abort(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None or bool(self._forks)

    # --- the loop ------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """One iteration of the loop; returns the requests released (finished) by it.

        If anything in it raises (a request's stop check, the device), every request ends with finish_reason
        "error" and gives its KV back before the exception propagates, so the engine serves the next ones."""
        try:
            return self._step()
        except Exception:
            self._inflight = None  # its tokens will never be read
            self.scheduler.fail_all()
            for _, rest in self._forks:  # streams not queued yet: they hold nothing
                for r in rest:
                    if not r.finished:
                        r.status, r.finish_reason, r.finish_time = ReqStatus.RELEASED, "error", time.perf_counter()
            self._forks = []
            raise

    def _step(self) -> list[Req]:
        if self._forks:
            self._release_forks()
        batch = self.scheduler.schedule()
        if batch is NEED_SYNC:  # a retraction needs the tokens of the step in flight
            self._resolve(self._inflight)
            self._inflight = None
            return self.scheduler.release_finished(set())
        launched = self._launch(batch) if batch is not None else None
        if self.config.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._resolve(previous)
        elif launched is not None:
            self._resolve(launched)
        if launched is not None and launched.unsampled is not None:  # grammar masks (overlap: now, see above)
            self._sample_launched(launched)
        in_flight = {id(r) for r in self._inflight.batch.reqs} if self._inflight else set()
        released = self.scheduler.release_finished(in_flight)
        if batch is None and self._inflight is None and not released and self.scheduler.has_work:
            raise RuntimeError("scheduler stalled: no request can make progress")
        return released

    def _launch(self, batch) -> StepOutput:
        self.stats["steps"] += 1
        if batch.is_decode:
            self.stats["decode_steps"] += 1
            self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], batch.size)
        out = self.runner.forward(batch)
        if out.unsampled is not None or out.logprobs is not None:  # processed logits (notebook 12)
            out.on_ready = self._on_ready
        if out.unsampled is not None:  # grammar masks: sampled once the tokens before it are known
            out.sample = lambda: self._sample_launched(out)
        graphs = self.runner.graph_runner
        if graphs is not None and graphs.last_run_used_graph:
            self.stats["graph_steps"] += 1
            self.stats["graph_split_steps"] += batch.size > graphs.max_bs
        return out

    def _resolve(self, out: StepOutput) -> None:
        tokens = out.wait()
        now = time.perf_counter()
        for token, row in zip(tokens, out.batch.sample_rows):
            req = out.batch.reqs[row]
            req.num_pending -= 1
            if req.finished:
                continue  # finished (or aborted) while this step was in flight: its token is dropped
            req.output_ids.append(token)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.status = ReqStatus.FINISHED
                req.finish_reason = reason
                req.finish_time = now

    @staticmethod
    def _on_ready(out: StepOutput) -> None:
        """Once a processed step's results are on the host (`StepOutput.wait` calls this before `_resolve` reads
        the tokens): hand its logprobs to their requests, and advance their grammars by their tokens. A request
        takes them when `_resolve` will take the token: when it has not finished."""
        lp = out.logprobs
        if lp is not None:
            chosen, top_ids, top_lps = lp.lists()
            for j, k in enumerate(lp.rows):
                req = out.batch.reqs[out.batch.sample_rows[k]]
                if not req.finished:
                    n = req.params.logprobs
                    req.output_logprobs.append(chosen[j], top_ids[j][:n], top_lps[j][:n])
        if out.grammar_rows:
            tokens = out.tokens_host.tolist()
            for k in out.grammar_rows:
                req = out.batch.reqs[out.batch.sample_rows[k]]
                if not req.finished and not req.grammar.accept_token(tokens[k]):
                    raise RuntimeError(f"request {req.rid}: the grammar refused token {tokens[k]}, which its mask "
                                       "allowed")

    def _sample_launched(self, out: StepOutput) -> None:
        """Sample a launched step that waited for grammar masks: every token before it has reached the host
        (and its request's matcher), so the masks are built now, while the device may still run its forward."""
        reqs = [out.batch.reqs[out.batch.sample_rows[k]] for k in out.grammar_rows]
        mask = self.runner.mask_buffer(len(reqs))  # pinned, reused: the step before has read it (its tokens came)
        self.grammars().fill([r.grammar for r in reqs], mask)
        self.runner.sample_processed(out, mask)

    def grammars(self):
        """The grammar compiler of this model's tokenizer (minisgl/grammar.py), made when first needed."""
        if self._grammars is None:  # (two threads may both build one: the last wins, nothing is shared yet)
            from minisgl.grammar import Grammars
            from minisgl.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(self.runner.model_path)
            if tokenizer is None:
                raise RequestError("structured output needs a tokenizer; this model has none", "response_format")
            self._grammars = Grammars(tokenizer, self.model_config.vocab_size, sorted(self.eos_ids))
        return self._grammars

    def _finish_reason(self, req: Req, token: int) -> str | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if req.stop_check is not None and req.stop_check(req):
            return "stop"
        # resolved tokens only: under overlap, num_tokens also counts a token still in flight, which would end
        # the request one token early
        if len(req.output_ids) >= p.max_tokens or len(req.input_ids) + len(req.output_ids) >= self.max_model_len:
            return "length"
        return None

    def run(self, reqs: list[Req] | None = None, progress: Callable[[int], None] | None = None) -> None:
        """Step until every given request (default: all work) has finished and been released."""
        while self.has_work:
            released = self.step()
            if progress and released:
                progress(len(released))
            if reqs is not None and all(r.released for r in reqs):
                break
