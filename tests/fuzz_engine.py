"""Randomized differential testing of the engine on the CPU: minisgl's greedy tokens against Hugging Face's.

Each case picks a tiny fp32 model (Qwen3 dense, Qwen3.5 hybrid, now and then Llama-3 with llama3 rope scaling), a
random combination of the engine's switches (overlap, radix cache, page size 1/4/16, chunked prefill sizes from 1
up and 0, max_prefill_tokens, mixed_prefill_tokens, 1..8 running requests, KV pools small enough to force eviction
and retraction, hybrid snapshot slots, torch / torch_loop attention) and, installed on the CPU as the unit tests
do, the padded prefill-graph path (engine/prefill_graph.py with capture=False) and the decode-graph path
(engine/cuda_graph.py with replay stand-ins, pieces included). It then sends a random request set in one or
several waves, either arriving between engine steps or through successive `LLM.generate` calls: shared prefixes,
duplicates, prompts that are prefixes or continuations (prompt + generated tokens) of others, n > 1 streams, EOS
and stop tokens, logprobs (the processed-logits path), and a few seeded sampled requests (compared with the same
request run alone on a plain engine: a stream's draws depend on its seed only).

Checked: every greedy stream's tokens and finish reason against `generate(do_sample=False)` of transformers
(references cached per prompt on disk; a mismatch at a near-tie of HF's own logits is recorded as such, not as a
bug); after every step the engine's bookkeeping (every KV page free, cached, or held by exactly one request; the
request table and token table of each running request; the radix tree's and the snapshot slots' own `check()`;
no allocation of a negative page count); at the end every page and row back (tests/helpers.py's
assert_all_pages_back). Each failure is written with its full case (switches, graphs, waves with prompts and
parameters), which `--case FILE` replays and `--minimize FILE` shrinks.

    python tests/fuzz_engine.py OUT --seconds 1200 [--seed 0] [--workers 2]   # OUT/fuzz_engine.json
    python tests/fuzz_engine.py OUT --case OUT/failures/xxx.json             # replay one case
    python tests/fuzz_engine.py OUT --minimize OUT/failures/xxx.json         # shrink it (OUT/minimized/)

`main(out_dir, seconds, seed)` runs the same from Python. It lives beside tests/helpers.py, whose Hugging Face
references and page accounting it uses; the bugs it found each have their own unit test (test_cuda_graph.py,
test_qwen35.py).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import multiprocessing
import random
import re
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
MAX_NEW = 32  # every HF reference is this long; a request's max_tokens is at most this
MODEL_WEIGHTS = {"qwen3": 4, "qwen35": 4, "llama": 1}
EOS = 2
NO_PENALTY = (1.0, 0.0, 0.0)
REFS_VERSION = 3  # the reference cache files' version (2: generate with an explicit attention mask, 3: penalties)


# --- models and Hugging Face references ----------------------------------------------------------------------

def build_models(models_dir: str | Path) -> dict[str, str]:
    """The tiny checkpoints of the unit tests (tests/conftest.py, tests/test_qwen35.py), built once into
    `models_dir`."""
    import torch
    from helpers import build_tiny_model

    models_dir = Path(models_dir)
    paths = {name: str(models_dir / name) for name in MODEL_WEIGHTS}
    if not (Path(paths["qwen3"]) / "config.json").exists():
        build_tiny_model("qwen3", paths["qwen3"], tie=True, seed=0)
    if not (Path(paths["llama"]) / "config.json").exists():
        build_tiny_model("llama", paths["llama"], tie=False, seed=1)
    if not (Path(paths["qwen35"]) / "config.json").exists():
        from test_qwen35 import make_state_sensitive, tiny_text_config
        from transformers import Qwen3_5ForCausalLM

        torch.manual_seed(0)
        model = Qwen3_5ForCausalLM(tiny_text_config()).eval()
        make_state_sensitive(model, seed=1)
        model.save_pretrained(paths["qwen35"])
    return paths


class References:
    """HF greedy continuations (MAX_NEW tokens) per (model, prompt), kept in memory and appended to a JSONL file
    per writer in `cache_dir` (read back, all writers', at start)."""

    def __init__(self, paths: dict[str, str], cache_dir: str | Path | None, writer: str = "main") -> None:
        self.paths = paths
        self.refs: dict[tuple[str, tuple[int, ...]], list[int]] = {}
        self.file = None
        if cache_dir is not None:
            cache_dir = Path(cache_dir)
            cache_dir.mkdir(parents=True, exist_ok=True)
            for f in sorted(cache_dir.glob(f"refs{REFS_VERSION}-*.jsonl")):
                for line in f.read_text().splitlines():
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue  # a line cut short by a killed writer
                    self.refs[row["model"], tuple(row["prompt"]), tuple(row.get("pen", NO_PENALTY))] = row["ref"]
            self.file = cache_dir / f"refs{REFS_VERSION}-{writer}.jsonl"
        self.computed = 0

    def get(self, model: str, prompt: list[int], pen: tuple[float, float, float] = NO_PENALTY) -> list[int]:
        """`pen`: (repetition, frequency, presence) penalties, applied as the engine does (HF's repetition
        penalty over prompt and output, then OpenAI's frequency and presence over the output)."""
        key = (model, tuple(prompt), tuple(pen))
        if key not in self.refs:
            import torch
            from helpers import hf_model

            # an explicit mask: without one, generate masks every prompt token equal to pad_token_id (0), which
            # a continuation prompt (a prompt plus generated tokens) may hold
            ids = torch.tensor([prompt])
            with torch.no_grad():
                kw = {}
                if tuple(pen) != NO_PENALTY:
                    from transformers import LogitsProcessorList
                    kw = dict(repetition_penalty=pen[0],
                              logits_processor=LogitsProcessorList([_OutputPenalty(len(prompt), pen[1], pen[2])]))
                out = hf_model(self.paths[model]).generate(ids, attention_mask=torch.ones_like(ids),
                                                           max_new_tokens=MAX_NEW, do_sample=False,
                                                           eos_token_id=None, pad_token_id=0, **kw)
            ref = out[0, len(prompt):].tolist()
            assert len(ref) == MAX_NEW
            self.refs[key] = ref
            self.computed += 1
            if self.file is not None:
                with open(self.file, "a") as f:
                    f.write(json.dumps({"model": model, "prompt": list(prompt), "pen": list(pen), "ref": ref}) + "\n")
        return self.refs[key]

    def bank(self, model: str) -> list[list[int]]:
        return [list(p) for m, p, pen in self.refs if m == model and pen == NO_PENALTY]


def _penalize(scores, ids, n_prompt: int, pen: tuple[float, float, float]):
    """The engine's penalties on HF scores `[1, V]` after the tokens `ids` `[1, L]` (prompt of `n_prompt`)."""
    import torch

    r, f, p = pen
    if r != 1:
        seen = scores.gather(1, ids)
        scores = scores.scatter(1, ids, torch.where(seen < 0, seen * r, seen / r))
    gen = ids[:, n_prompt:]
    counts = torch.zeros_like(scores).scatter_add_(1, gen, torch.ones_like(gen, dtype=scores.dtype))
    return scores - counts * f - (counts > 0).to(scores.dtype) * p


class _OutputPenalty:
    """HF logits processor: OpenAI's frequency and presence penalties over the generated tokens."""

    def __init__(self, n_prompt: int, frequency: float, presence: float) -> None:
        self.n_prompt, self.pen = n_prompt, (1.0, frequency, presence)

    def __call__(self, input_ids, scores):
        return _penalize(scores, input_ids, self.n_prompt, self.pen)


def hf_margin(path: str, ids: list[int], want: int, got: int, n_prompt: int = 0,
              pen: tuple[float, float, float] = NO_PENALTY) -> float:
    """HF's (penalised) logit of `want` minus that of `got` after `ids`: how far from a tie the first mismatch is."""
    import torch
    from helpers import hf_next_logits

    logits = hf_next_logits(path, ids)[None]
    if tuple(pen) != NO_PENALTY:
        logits = _penalize(logits, torch.tensor([ids]), n_prompt, pen)
    return float(logits[0, want] - logits[0, got])


# --- cases -----------------------------------------------------------------------------------------------------

def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _length(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.25:
        return rng.randint(1, 8)
    if r < 0.85:
        return rng.randint(9, 64)
    return rng.randint(65, 160)


def _cut(rng: random.Random, n: int, page: int) -> int:
    """A cut point in 1..n, often on a page boundary or next to one (the radix cache's edge cases)."""
    if n <= 1:
        return 1
    if rng.random() < 0.5 and n > page:
        k = rng.randint(1, n // page) * page + rng.choice([-1, 0, 0, 1])
        return min(max(k, 1), n)
    return rng.randint(1, n)


def _prompt(rng: random.Random, made: list[list[int]], bank: list[list[int]], refs: References, model: str,
            page: int) -> list[int]:
    kinds = ["fresh", "fresh", "bank", "dup", "prefix_of", "extend", "shared", "continue"]
    kind = rng.choice(kinds)
    pool = made or bank
    if kind == "bank" and bank:
        return list(rng.choice(bank))
    if not pool or kind in ("fresh", "bank"):
        return _tokens(rng, _length(rng))
    other = rng.choice(pool)
    if kind == "dup":
        return list(other)
    if kind == "prefix_of":
        return other[:_cut(rng, len(other), page)]
    if kind == "extend":
        return other + _tokens(rng, rng.randint(1, 24))
    if kind == "shared":
        return other[:_cut(rng, len(other), page)] + _tokens(rng, rng.randint(1, 30))
    # continue: the other prompt plus part of its greedy output (the KV of generated tokens gets reused)
    ref = refs.get(model, other)
    cont = other + ref[:rng.randint(1, MAX_NEW)]
    return cont + (_tokens(rng, rng.randint(1, 6)) if rng.random() < 0.5 else [])


def make_case(seed: int, refs: References, bank: dict[str, list[list[int]]] | None = None) -> dict:
    """A random case (JSON-able): model, switches, graphs and waves of requests. `bank`: prompts with references
    already known per model, to reuse (cheap, and radix hits across waves)."""
    rng = random.Random(seed)
    model = rng.choices(list(MODEL_WEIGHTS), weights=list(MODEL_WEIGHTS.values()))[0]
    page = rng.choice([1, 4, 16])
    chunk = rng.choice([0, 0, 1, 2, 3, 5, 7, 8, 13, 16, 32, 64, 8192])
    sw: dict = dict(dtype="float32", page_size=page, chunked_prefill_size=chunk, overlap=rng.random() < 0.5,
                    radix_cache=rng.random() < 0.75, max_running_requests=rng.randint(1, 8),
                    attention_backend=rng.choice(["torch", "torch", "torch_loop"]))
    if rng.random() < 0.25:
        sw["max_prefill_tokens"] = rng.choice([1, 2, 4, 8, 16, 33, 64])
    if chunk > 0 and rng.random() < 0.4:
        sw["mixed_prefill_tokens"] = rng.randint(1, max(1, min(chunk, 64)))
    if model == "qwen35" and rng.random() < 0.5:
        sw["state_snapshots"] = rng.choice([0, 1, 2, 3, 8, 32])
    graphs: dict = {}
    if rng.random() < 0.4:
        g = dict(max_tokens=rng.choice([16, 32, 64, 128, 256]), max_reqs=rng.choice([1, 2, 4, 8, 16]))
        if rng.random() < 0.3:  # odd buckets: shapes that pad little, or not at all
            g["token_buckets"] = sorted(set(rng.sample([2, 3, 5, 8, 12, 16, 24, 40, 64, 100], 3)))
        graphs["prefill"] = g
    if rng.random() < 0.3:
        graphs["decode"] = dict(max_bs=rng.choice([1, 2, 3, 4, 8]))
        if rng.random() < 0.3:
            sw["cuda_graph_split"] = False
    # requests
    bank_list = (bank or {}).get(model, [])
    made: list[list[int]] = []
    reqs = []
    for _ in range(rng.choice([1, 2, 3, 5, 8, 12, 16])):
        prompt = _prompt(rng, made, bank_list, refs, model, page)
        made.append(prompt)
        ref = refs.get(model, prompt)
        r = dict(prompt=prompt, max_tokens=rng.choice([1, 2, 5, rng.randint(1, MAX_NEW), MAX_NEW, MAX_NEW]),
                 ignore_eos=rng.random() < 0.8, stop_token_ids=[], n=1, logprobs=None, temperature=0.0, seed=None)
        if rng.random() < 0.15:  # a stop token the greedy stream really produces
            r["stop_token_ids"] = [ref[rng.randrange(MAX_NEW)]]
        if rng.random() < 0.15:
            r["n"] = rng.randint(2, 3)
        if rng.random() < 0.1:
            r["logprobs"] = rng.choice([0, 1, 5])
        if rng.random() < 0.08:
            r.update(temperature=rng.choice([0.7, 1.0]), seed=rng.randrange(1 << 20))
        if rng.random() < 0.12:  # penalties: the count table (rows reused, retraction, forks)
            r["penalty"] = [rng.choice([1.0, 0.7, 1.5, 3.0]), rng.choice([0.0, 0.5, -0.5, 2.0]),
                            rng.choice([0.0, 1.0, -1.0])]
            if r["temperature"] == 0:
                refs.get(model, prompt, tuple(r["penalty"]))
        reqs.append(r)
    num_waves = min(rng.choice([1, 1, 2, 3, 4]), len(reqs))
    cuts = sorted(rng.sample(range(1, len(reqs)), num_waves - 1)) if num_waves > 1 else []
    bounds = [0] + cuts + [len(reqs)]
    steps = sorted(rng.randint(0, 40) for _ in range(num_waves))
    waves = [dict(at_step=0 if i == 0 else steps[i], requests=reqs[bounds[i]:bounds[i + 1]])
             for i in range(num_waves)]
    # the KV pool: tight (a request or two at a time: eviction, retraction), medium, or the default (ample)
    need = [len(r["prompt"]) + r["max_tokens"] for r in reqs]
    pool = rng.choice(["tight", "tight", "medium", "ample"])
    if pool == "tight":
        sw["num_pages"] = -(-max(need) // page) + 1 + rng.randint(0, 3)
    elif pool == "medium":
        sw["num_pages"] = -(-max(need) // page) + 1 + -(-sum(need) // (2 * page))
    mode = "generate" if rng.random() < 0.25 else "steps"
    case = dict(seed=seed, model=model, switches=sw, graphs=graphs, waves=waves, mode=mode)
    if mode == "steps" and rng.random() < 0.15:  # abort some streams at some steps (by request index, stream)
        case["aborts"] = sorted([rng.randint(0, 60), rng.randrange(len(reqs)), 0] for _ in range(rng.randint(1, 3)))
    if mode == "steps" and rng.random() < 0.07:  # a forward that raises: every request ends, the engine goes on
        case["fail_at_step"] = rng.randint(1, 30)
    return case


def combo(case: dict) -> tuple:
    """The discrete switch combination a case covers (for the coverage count)."""
    sw, g = case["switches"], case["graphs"]
    chunk = sw["chunked_prefill_size"]
    reqs = [r for w in case["waves"] for r in w["requests"]]
    return (case["model"], sw["overlap"], sw["radix_cache"], sw["page_size"],
            "off" if chunk <= 0 else "small" if chunk <= 8 else "mid" if chunk <= 64 else "large",
            sw["max_running_requests"], "default" if "num_pages" not in sw else "pool",
            "prefill" in g, "decode" in g, sw["attention_backend"],
            bool(sw.get("mixed_prefill_tokens")), any(r["n"] > 1 for r in reqs), len(case["waves"]) > 1,
            case["mode"])


COMBO_FIELDS = ("model", "overlap", "radix", "page", "chunk", "max_running", "pool", "prefill_graph",
                "decode_graph", "backend", "mixed", "n>1", "waves>1", "mode")


# --- running a case ------------------------------------------------------------------------------------------

class CaseFailure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def install_graphs(llm, graphs: dict) -> None:
    """The graph paths on a CPU: prefill graphs run their padded fixed-buffer forward eagerly (capture=False);
    decode graphs are the real runner with replay stand-ins for CUDA graphs (as tests/test_cuda_graph.py)."""
    from helpers import capture_replay_graphs, capture_staged_replay_graphs, graph_runner_view

    from minisgl.engine import prefill_graph as pg
    from minisgl.engine.cuda_graph import CudaGraphRunner
    from minisgl.engine.hybrid import StagedStateCudaGraphRunner, StateCudaGraphRunner
    from minisgl.engine.staged_graph import StagedCudaGraphRunner

    runner = llm.engine.runner
    if "prefill" in graphs:
        g = graphs["prefill"]
        max_reqs = min(g["max_reqs"], runner.config.max_running_requests)
        runner.prefill_graph = pg.PrefillGraphRunner(runner, g["max_tokens"], max_reqs, capture=False,
                                                     token_buckets=g.get("token_buckets"))
    if "decode" in graphs:
        view = graph_runner_view(runner)
        max_bs = graphs["decode"]["max_bs"]
        # the engine's own runner class (staged inputs by default: the engine switch graph_staged_inputs)
        staged = runner.config.graph_staged_inputs
        capture = {"_capture_all": capture_staged_replay_graphs if staged else capture_replay_graphs}
        if runner.state_pool is not None:
            from minisgl.engine.cuda_graph import default_batch_sizes
            base = StagedStateCudaGraphRunner if staged else StateCudaGraphRunner
            cls = type("CpuStateGraphs", (base,), capture)
            rows = default_batch_sizes(max_bs)[-1]
            runner.graph_runner = cls(view, max_bs, runner.runtime.graph_inputs(rows, runner.device, decode=True))
        else:
            cls = type("CpuGraphs", (StagedCudaGraphRunner if staged else CudaGraphRunner,), capture)
            runner.graph_runner = cls(view, max_bs)


def check_live(engine) -> None:
    """The engine's bookkeeping between steps (raises CaseFailure('invariant', ...))."""
    import torch

    sched, alloc, cache, pool = engine.scheduler, engine.allocator, engine.cache, engine.runner.req_pool
    p = sched.page_size

    def fail(msg):
        raise CaseFailure("invariant", msg)

    try:
        if hasattr(cache, "check"):
            cache.check()
    except AssertionError as e:
        fail(f"cache.check: {e}")
    free = list(alloc._free)
    if len(set(free)) != len(free):
        fail("a page is on the free list twice")
    cached = [pg for n in cache._nodes() for pg in n.pages] if hasattr(cache, "_nodes") else []
    owners: dict[int, str] = {pg: "free" for pg in free}
    for pg in cached:
        if pg in owners:
            fail(f"page {pg} is cached and {owners[pg]}")
        owners[pg] = "cached"
    for req in sched.running:
        if req.row is None:
            if req.pages:
                fail(f"request {req.rid} holds pages without a row")
            continue
        if len(req.pages) * p < req.kv_len:
            fail(f"request {req.rid}: {len(req.pages)} pages for {req.kv_len} tokens")
        if len(req.pages) > -(-req.num_tokens // p):
            fail(f"request {req.rid}: {len(req.pages)} pages, more than its {req.num_tokens} tokens need")
        if req.cached_len % p or req.cached_len > req.kv_len:
            fail(f"request {req.rid}: cached_len {req.cached_len} (kv_len {req.kv_len}, page {p})")
        for pg in req.pages[:req.cached_len // p]:
            if owners.get(pg) != "cached":
                fail(f"request {req.rid}: its cached prefix page {pg} is {owners.get(pg, 'nobody')}'s")
        for pg in req.pages[req.cached_len // p:]:
            if pg in owners:
                fail(f"request {req.rid}: its page {pg} is also {owners[pg]}")
            owners[pg] = f"request {req.rid}"
    for req in sched.waiting:
        if req.pages or req.row is not None:
            fail(f"waiting request {req.rid} holds pages or a row")
    missing = set(range(1, alloc.num_pages)) - set(owners)
    if missing:
        fail(f"pages {sorted(missing)[:8]} are neither free, cached nor held")
    if 0 in owners:
        fail("the reserved page 0 is in use")
    # the tables on the device, for the running requests (every queued write has been applied by the step)
    if pool._rows or pool._token_runs:
        return
    for req in sched.running:
        if req.row is None or req.kv_len == 0:
            continue
        want = sched._slots(req, 0, req.kv_len)
        got = pool.table[req.row, :req.kv_len].tolist()
        if got != want:
            k = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            fail(f"request {req.rid}: table row {req.row} position {k} points at slot {got[k]}, not {want[k]}")
        # the ids the next steps read: positions kv_len.. of the known tokens (a cache hit's prefix is never
        # written there, and a token sampled but not resolved is the device's business)
        known = req.input_ids + req.output_ids
        ids = pool.token_ids[req.row, req.kv_len:len(known)].tolist()
        if not req.finished and ids != known[req.kv_len:]:
            k = next(i for i, (a, b) in enumerate(zip(ids, known[req.kv_len:])) if a != b) + req.kv_len
            fail(f"request {req.rid}: token table position {k} holds {ids[k - req.kv_len]}, not {known[k]}")
    del torch


def expected_tokens(ref: list[int], r: dict) -> tuple[list[int], str]:
    """A greedy stream's tokens and finish reason, from HF's MAX_NEW-token continuation."""
    stops = set(r["stop_token_ids"]) | (set() if r["ignore_eos"] else {EOS})
    out = []
    for t in ref[:r["max_tokens"]]:
        out.append(t)
        if t in stops:
            return out, "stop"
    return out, "length"


def compare_logprobs(path: str, prompt: list[int], ids: list[int], lps: list, pen=NO_PENALTY,
                     atol: float = 1e-3) -> str | None:
    """The engine's logprobs of a greedy stream against HF's log-softmax of its (penalised) logits, from one HF
    forward over the prompt and the stream: each token's logprob, and the values of the top ones. None: equal."""
    import torch
    from helpers import hf_model

    if not lps:  # aborted before its first token
        return None
    seq = prompt + ids
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([seq[:-1]])).logits[0].float()
    for j, (chosen, top) in enumerate(lps):
        at = len(prompt) - 1 + j
        row = logits[at][None]
        if tuple(pen) != NO_PENALTY:
            row = _penalize(row, torch.tensor([seq[:at + 1]]), len(prompt), pen)
        lsm = torch.log_softmax(row[0], dim=-1)
        if abs(chosen - float(lsm[ids[j]])) > atol:
            return f"token {j}: logprob {chosen} vs HF {float(lsm[ids[j]])}"
        want = lsm.topk(len(top)).values.tolist() if top else []
        if any(abs(a - b) > atol for (_, a), b in zip(top, want)):
            return f"token {j}: top logprobs {[round(a, 4) for _, a in top]} vs HF {[round(b, 4) for b in want]}"
    return None


class SoloReference:
    """Sampled requests run alone on a plain engine (no radix cache, no overlap): the tokens a seeded stream must
    give whatever else runs beside it."""

    def __init__(self, paths: dict[str, str]) -> None:
        self.paths, self.llms, self.outs = paths, {}, {}

    def get(self, model: str, r: dict) -> list[list[int]]:
        key = (model, json.dumps(r, sort_keys=True))
        if key not in self.outs:
            from minisgl import LLM
            if model not in self.llms:
                self.llms[model] = LLM(self.paths[model], dtype="float32", overlap=False, radix_cache=False)
            outs = self.llms[model].generate([r["prompt"]], params_of(r))
            self.outs[key] = [o.token_ids for o in outs]
        return self.outs[key]


def params_of(r: dict):
    from minisgl import SamplingParams

    rep, freq, pres = r.get("penalty", NO_PENALTY)
    return SamplingParams(temperature=r["temperature"], max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"],
                          stop_token_ids=r["stop_token_ids"], n=r["n"], logprobs=r["logprobs"], seed=r["seed"],
                          repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)


class InjectedFailure(RuntimeError):
    """The forward that `fail_at_step` makes raise."""


def run_case(case: dict, paths: dict[str, str], refs: References, solo: SoloReference | None = None,
             near_tie: float = 1e-3) -> dict:
    """Run one case; returns {"ok", "failures": [{"kind", "message"}], "stats"}. Never raises for an engine
    failure (it is recorded)."""
    import torch
    from helpers import assert_all_pages_back

    from minisgl import LLM

    model, path = case["model"], paths[case["model"]]
    failures: list[dict] = []
    stats: dict = {}
    llm = None
    t0 = time.perf_counter()
    try:
        llm = LLM(path, **case["switches"])
        engine = llm.engine
        install_graphs(llm, case["graphs"])
        real_alloc = engine.allocator.alloc

        def alloc(n):
            if n < 0:
                raise CaseFailure("invariant", f"PageAllocator.alloc({n}): a negative page count")
            return real_alloc(n)

        engine.allocator.alloc = alloc
        groups: list[tuple[dict, list]] = []  # (request spec, its streams' Req objects)
        waves = list(case["waves"])
        if case["mode"] == "generate":
            for w in waves:
                outs = llm.generate([r["prompt"] for r in w["requests"]], [params_of(r) for r in w["requests"]])
                it = iter(outs)
                for r in w["requests"]:
                    groups.append((r, [next(it) for _ in range(r["n"])]))
                check_live(engine)
        else:
            step, limit = 0, 400 + 8 * sum(len(r["prompt"]) + r["max_tokens"] * r["n"]
                                           for w in waves for r in w["requests"])
            aborts = [list(a) for a in case.get("aborts", [])]  # [step, request index, stream], sorted
            fail_at = case.get("fail_at_step")
            forward = engine.runner.forward

            def failing(batch):
                engine.runner.forward = forward  # once
                raise InjectedFailure("injected")

            while waves or engine.has_work:
                while waves and (waves[0]["at_step"] <= step or not engine.has_work):
                    for r in waves.pop(0)["requests"]:
                        groups.append((r, engine.add_requests(r["prompt"], params_of(r))))
                while aborts and aborts[0][0] <= step:
                    _, ri, si = aborts.pop(0)
                    if ri < len(groups) and si < len(groups[ri][1]):
                        engine.abort(groups[ri][1][si])
                if fail_at is not None and step >= fail_at:
                    engine.runner.forward, fail_at = failing, None
                try:
                    engine.step()
                except InjectedFailure:
                    stats["injected_failure"] = step
                step += 1
                check_live(engine)
                if step > limit:
                    raise CaseFailure("stall", f"no end after {step} steps")
        stats.update(steps=engine.stats["steps"], retractions=engine.scheduler.num_retractions,
                     cached_tokens=0, prefill_graph_replays=getattr(engine.runner.prefill_graph, "replays", 0),
                     decode_graph_steps=engine.stats["graph_steps"],
                     penalties=sum("penalty" in r for w in case["waves"] for r in w["requests"]),
                     aborts=len(case.get("aborts", [])))
        for r, outs in groups:
            for i, o in enumerate(outs):
                ids = o.token_ids if hasattr(o, "token_ids") else list(o.output_ids)
                reason = o.finish_reason
                lps = o.logprobs if hasattr(o, "logprobs") else (list(o.output_logprobs) if r["logprobs"] is not None
                                                                 else None)
                cached = o.num_cached_prompt_tokens
                stats["cached_tokens"] += cached
                where = f"request {r['prompt'][:6]}... (len {len(r['prompt'])}) stream {i}"
                if cached > len(r["prompt"]) - 1 or (not case["switches"]["radix_cache"] and cached):
                    failures.append(dict(kind="cached_count", message=f"{where}: {cached} cached prompt tokens"))
                cut = reason in ("abort", "error")  # aborted, or ended by the failed step: a prefix
                if reason == "error" and "injected_failure" not in stats:
                    failures.append(dict(kind="error_finish", message=f"{where}: finish_reason error"))
                if r["temperature"] > 0:
                    if solo is not None:
                        want = solo.get(model, r)[i]
                        if ids != (want[:len(ids)] if cut else want):
                            failures.append(dict(kind="sampled_divergence",
                                                 message=f"{where}: {ids[:8]} ({reason}) vs alone {want[:8]}"))
                    continue
                pen = tuple(r.get("penalty", NO_PENALTY))
                want, want_reason = expected_tokens(refs.get(model, r["prompt"], pen), r)
                if cut and len(ids) <= len(want):
                    want, want_reason = want[:len(ids)], reason
                if ids != want or reason != want_reason:
                    k = next((j for j, (a, b) in enumerate(zip(ids, want)) if a != b), None)
                    msg = f"{where}: engine {ids} ({reason}) vs HF {want} ({want_reason})"
                    if k is not None:
                        margin = hf_margin(path, r["prompt"] + want[:k], want[k], ids[k], len(r["prompt"]), pen)
                        msg += f"; first mismatch at {k}, HF margin {margin:.3g}"
                        # |margin| small: a near-tie, fp32 noise may pick either; negative: HF's own forward
                        # prefers the engine's token (the reference is suspect, not the engine)
                        kind = ("near_tie" if abs(margin) < near_tie else "mismatch" if margin > 0
                                else "hf_disagrees")
                    else:
                        kind = "length_or_reason"
                    failures.append(dict(kind=kind, message=msg))
                if r["logprobs"] is not None:
                    if lps is None or len(lps) != len(ids):
                        failures.append(dict(kind="logprobs", message=f"{where}: {0 if lps is None else len(lps)} "
                                                                      f"logprob entries for {len(ids)} tokens"))
                    else:
                        bad = compare_logprobs(path, r["prompt"], ids, lps, pen)
                        if bad:
                            failures.append(dict(kind="logprobs", message=f"{where}: {bad}"))
        try:
            assert_all_pages_back(llm)
        except AssertionError as e:
            failures.append(dict(kind="pages_back", message=str(e)))
    except CaseFailure as e:
        failures.append(dict(kind=e.kind, message=str(e)))
    except Exception as e:  # the engine raised
        tb = traceback.format_exc().strip().splitlines()
        failures.append(dict(kind="exception", message=f"{type(e).__name__}: {e}", traceback=tb[-40:]))
    finally:
        if llm is not None:
            llm.close()
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    del torch
    real = [f for f in failures if f["kind"] != "near_tie"]
    return dict(ok=not real, failures=failures, stats=stats)


def signature(failure: dict, case: dict) -> str:
    """What makes two failures the same bug, as far as a machine can tell: the kind, the message with its numbers
    and lists taken out, and for an exception where it was raised."""
    msg = re.sub(r"\[[^\]]*\]", "[]", failure["message"])
    msg = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", msg)
    if failure["kind"] in ("mismatch", "length_or_reason", "sampled_divergence"):
        msg = case["model"]
    where = ""
    if failure.get("traceback"):
        frames = [ln.strip() for ln in failure["traceback"] if ln.strip().startswith("File ")]
        ours = [f for f in frames if "/minisgl/" in f or "/lab/" in f]  # where it left our code, if it did
        frames = ours or frames
        where = " @ " + (re.sub(r", line \d+", "", frames[-1]) if frames else "")
    return f"{failure['kind']}: {msg[:160]}{where}"


# --- the fuzz loop -------------------------------------------------------------------------------------------

def _worker(out_dir: str, seconds: float, seed: int, index: int, paths: dict[str, str]) -> None:
    import torch

    torch.set_num_threads(1)
    out = Path(out_dir)
    refs = References(paths, out / "cache", writer=f"w{index}")
    solo = SoloReference(paths)
    rng = random.Random(f"{seed}-{index}")
    deadline = time.time() + seconds
    log = out / f"cases-w{index}.jsonl"
    while time.time() < deadline:
        case_seed = rng.getrandbits(48)
        bank = {m: refs.bank(m) for m in MODEL_WEIGHTS}
        try:
            case = make_case(case_seed, refs, bank)
        except Exception as e:  # HF itself failed on a prompt: not the engine's
            with open(log, "a") as f:
                f.write(json.dumps(dict(seed=case_seed, generator_error=repr(e))) + "\n")
            continue
        result = run_case(case, paths, refs, solo)
        row = dict(seed=case_seed, combo=combo(case), **result)
        if result["failures"]:
            row["case"] = case
        with open(log, "a") as f:
            f.write(json.dumps(row) + "\n")


def summarize(out_dir: Path) -> dict:
    rows = []
    for f in sorted(out_dir.glob("cases-w*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    cases = [r for r in rows if "combo" in r]
    combos = {tuple(r["combo"]) for r in cases}
    per_field = {name: sorted({str(c[i]) for c in combos}) for i, name in enumerate(COMBO_FIELDS)}
    distinct: dict[str, dict] = {}
    near_ties = 0
    (out_dir / "failures").mkdir(exist_ok=True)
    for r in cases:
        for f in r["failures"]:
            if f["kind"] == "near_tie":
                near_ties += 1
                continue
            sig = signature(f, r["case"])
            d = distinct.setdefault(sig, dict(signature=sig, count=0, seeds=[], example=f, case_file=None))
            d["count"] += 1
            if len(d["seeds"]) < 20:
                d["seeds"].append(r["seed"])
            if d["case_file"] is None:
                name = hashlib.sha1(sig.encode()).hexdigest()[:10]
                path = out_dir / "failures" / f"{name}.json"
                path.write_text(json.dumps(dict(signature=sig, failure=f, case=r["case"]), indent=1))
                d["case_file"] = str(path)
    stats = [r["stats"] for r in cases]
    return dict(
        cases=len(cases), failing_cases=sum(not r["ok"] for r in cases), distinct_failures=list(distinct.values()),
        near_ties=near_ties, combinations=len(combos), values_covered=per_field,
        generator_errors=sum("generator_error" in r for r in rows),
        with_retraction=sum(s.get("retractions", 0) > 0 for s in stats),
        with_cache_hits=sum(s.get("cached_tokens", 0) > 0 for s in stats),
        with_prefill_graph_steps=sum(s.get("prefill_graph_replays", 0) > 0 for s in stats),
        with_decode_graph_steps=sum(s.get("decode_graph_steps", 0) > 0 for s in stats),
        with_penalties=sum(s.get("penalties", 0) > 0 for s in stats),
        with_aborts=sum(s.get("aborts", 0) > 0 for s in stats),
        with_injected_failure=sum("injected_failure" in s for s in stats),
        engine_seconds=round(sum(s.get("seconds", 0) for s in stats), 1))


def main(out_dir: str | Path = "fuzz-out", seconds: float = 1200, seed: int = 0, workers: int = 2) -> dict:
    """Fuzz for `seconds` on `workers` processes; writes OUT/fuzz_engine.json (and OUT/failures/*.json, one per
    distinct failure, each replayable with --case) and returns its content."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("cases-w*.jsonl"):  # an earlier run's cases (the reference cache stays): not this run's
        old.unlink()
    paths = build_models(out / "models")
    start = time.time()
    exit_codes = [0]
    if workers <= 1:
        _worker(str(out), seconds, seed, 0, paths)
    else:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(str(out), seconds, seed, i, paths)) for i in range(workers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        exit_codes = [p.exitcode for p in procs]  # a worker that died (e.g. minisgl not importable) ran nothing
    summary = dict(seed=seed, seconds=seconds, workers=workers, wall_seconds=round(time.time() - start, 1),
                   worker_exit_codes=exit_codes, **summarize(out))
    (out / "fuzz_engine.json").write_text(json.dumps(summary, indent=1))
    return summary


# --- replay and shrink -----------------------------------------------------------------------------------------

def load_case(file: str | Path) -> dict:
    data = json.loads(Path(file).read_text())
    return data.get("case", data)


def _fails_like(case: dict, paths, refs, sig: str | None, tries: int = 1) -> bool:
    for _ in range(tries):
        res = run_case(case, paths, refs)
        sigs = {signature(f, case) for f in res["failures"] if f["kind"] != "near_tie"}
        if (sig in sigs) if sig is not None else bool(sigs):
            return True
    return False


def minimize(case: dict, paths: dict[str, str], refs: References, sig: str | None = None, tries: int = 1,
             log=print) -> dict:
    """Shrink a failing case while it fails the same way (`sig`; default: the first failure's): fewer waves
    and requests, switches back to their defaults, graphs off, shorter outputs and prompts."""
    if sig is None:
        res = run_case(case, paths, refs)
        real = [f for f in res["failures"] if f["kind"] != "near_tie"]
        if not real:
            raise SystemExit("the case passes: nothing to minimise")
        sig = signature(real[0], case)
    log(f"minimising: {sig}")
    case = copy.deepcopy(case)

    def attempt(candidate: dict, what: str) -> bool:
        nonlocal case
        if _fails_like(candidate, paths, refs, sig, tries):
            case = candidate
            log(f"  kept: {what}")
            return True
        return False

    changed = True
    while changed:
        changed = False
        # one wave, at step 0, in step mode
        if len(case["waves"]) > 1:
            c = copy.deepcopy(case)
            c["waves"] = [dict(at_step=0, requests=[r for w in case["waves"] for r in w["requests"]])]
            changed |= attempt(c, "one wave")
        for i in range(len(case["waves"]) - 1, -1, -1):
            if len(case["waves"]) > 1 and i < len(case["waves"]):
                c = copy.deepcopy(case)
                del c["waves"][i]
                c["waves"][0]["at_step"] = 0
                changed |= attempt(c, f"drop wave {i}")
        for wi in range(len(case["waves"])):
            i = len(case["waves"][wi]["requests"]) - 1
            while i >= 0:
                if sum(len(w["requests"]) for w in case["waves"]) > 1 and len(case["waves"][wi]["requests"]) > 1:
                    c = copy.deepcopy(case)
                    del c["waves"][wi]["requests"][i]
                    changed |= attempt(c, f"drop request {wi}.{i}")
                i -= 1
        for key in ("aborts", "fail_at_step"):
            if key in case:
                c = copy.deepcopy(case)
                del c[key]
                changed |= attempt(c, f"no {key}")
        if case["mode"] != "steps":
            c = copy.deepcopy(case)
            c["mode"] = "steps"
            changed |= attempt(c, "step mode")
        for name in ("decode", "prefill"):
            if name in case["graphs"]:
                c = copy.deepcopy(case)
                del c["graphs"][name]
                changed |= attempt(c, f"no {name} graphs")
        defaults = dict(overlap=True, radix_cache=True, attention_backend="torch", chunked_prefill_size=8192,
                        page_size=1)
        for key in list(case["switches"]):
            if key == "dtype":
                continue
            c = copy.deepcopy(case)
            if key in defaults:
                if c["switches"][key] == defaults[key]:
                    continue
                c["switches"][key] = defaults[key]
            else:
                del c["switches"][key]
            changed |= attempt(c, f"switch {key} -> default")
        for wi, w in enumerate(case["waves"]):
            for ri, r in enumerate(w["requests"]):
                for field, simple in (("n", 1), ("logprobs", None), ("stop_token_ids", []), ("ignore_eos", True),
                                      ("penalty", list(NO_PENALTY))):
                    if r.get(field, simple) != simple:
                        c = copy.deepcopy(case)
                        c["waves"][wi]["requests"][ri][field] = simple
                        changed |= attempt(c, f"request {wi}.{ri} {field}={simple}")
                for mt in sorted({1, 2, r["max_tokens"] // 2}):
                    if mt < case["waves"][wi]["requests"][ri]["max_tokens"]:
                        c = copy.deepcopy(case)
                        c["waves"][wi]["requests"][ri]["max_tokens"] = mt
                        if attempt(c, f"request {wi}.{ri} max_tokens={mt}"):
                            changed = True
                            break
                plen = len(case["waves"][wi]["requests"][ri]["prompt"])
                for keep in sorted({1, plen // 4, plen // 2, plen - 1} - {0}):
                    if keep < plen:
                        c = copy.deepcopy(case)
                        c["waves"][wi]["requests"][ri]["prompt"] = c["waves"][wi]["requests"][ri]["prompt"][:keep]
                        if attempt(c, f"request {wi}.{ri} prompt[:{keep}]"):
                            changed = True
                            break
    return case


def cli(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="output folder (models, reference cache, cases, fuzz_engine.json)")
    ap.add_argument("--seconds", type=float, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--case", help="replay the case in this JSON file (a failures/*.json or a bare case)")
    ap.add_argument("--minimize", help="shrink the failing case in this JSON file")
    ap.add_argument("--tries", type=int, default=1, help="--minimize: runs per candidate (flaky failures)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.case or args.minimize:
        import torch
        torch.set_num_threads(1)
        paths = build_models(out / "models")
        refs = References(paths, out / "cache", writer="replay")
        case = load_case(args.case or args.minimize)
        if args.case:
            res = run_case(case, paths, refs, SoloReference(paths))
            print(json.dumps(res, indent=1))
            return 0 if res["ok"] else 1
        small = minimize(case, paths, refs, tries=args.tries)
        (out / "minimized").mkdir(parents=True, exist_ok=True)
        dst = out / "minimized" / Path(args.minimize).name
        dst.write_text(json.dumps(dict(case=small, result=run_case(small, paths, refs)), indent=1))
        print(f"minimised case: {dst}")
        return 0
    summary = main(out, args.seconds, args.seed, args.workers)
    print(json.dumps({k: v for k, v in summary.items() if k != "values_covered"}, indent=1))
    return 0 if not summary["distinct_failures"] and not any(summary["worker_exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(cli())
