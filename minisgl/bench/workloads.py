"""The standard workloads W1-W4 (DESIGN.md), shared by the benchmarks and the tests.

Each builder returns plain data, the same on every machine for the same arguments. `scale` < 1 shrinks a
workload for a CPU smoke run (fewer requests, shorter prompts and outputs); scale=1 is the standard one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from minisgl.sampling_params import SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    late_prompts: list[list[int]] = field(default_factory=list)  # W4: arrive once the others decode
    late_params: list[SamplingParams] = field(default_factory=list)

    @property
    def total_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params + self.late_params)


def _s(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def w1_offline(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """256 requests, prompts of 100-1024 random ids, 100-1024 output tokens, temperature 0.6, all at once."""
    random.seed(0)
    n = 256
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(n)]
    max_tokens = [random.randint(100, 1024) for _ in range(n)]
    if scale != 1.0:
        keep = _s(n, scale)
        prompts = [[t % vocab for t in p[:_s(len(p), scale)]] for p in prompts[:keep]]
        max_tokens = [_s(m, scale) for m in max_tokens[:keep]]
    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return Workload("W1", prompts, params)


def w2_latency(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """8 requests of 512 random ids, 256 greedy output tokens, run one after another."""
    random.seed(1)
    prompts = [[random.randint(0, 9999) for _ in range(512)] for _ in range(8)]
    out = 256
    if scale != 1.0:
        prompts = [[t % vocab for t in p[:_s(512, scale)]] for p in prompts]
        out = max(2, _s(256, scale))
    return Workload("W2", prompts, [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)] * 8)


def w3_shared_prefix(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """8 system prompts of 1024 ids; 256 requests = a system prompt + 32-256 ids, 64-256 output tokens.

    Draw order per request: the system prompt, the suffix length, the suffix ids, the output length.
    """
    random.seed(2)
    systems = [[random.randint(0, 9999) for _ in range(1024)] for _ in range(8)]
    prompts, params = [], []
    for _ in range(256):
        system = random.choice(systems)
        suffix = [random.randint(0, 9999) for _ in range(random.randint(32, 256))]
        prompts.append(system + suffix)
        params.append(SamplingParams(temperature=0.6, max_tokens=random.randint(64, 256), ignore_eos=True))
    if scale != 1.0:
        keep = _s(256, scale)
        sys_len = _s(1024, scale)
        prompts = [[t % vocab for t in p[:sys_len] + p[1024:1024 + _s(len(p) - 1024, scale)]]
                   for p in prompts[:keep]]
        params = [SamplingParams(temperature=0.6, max_tokens=_s(p.max_tokens, scale), ignore_eos=True)
                  for p in params[:keep]]
    return Workload("W3", prompts, params)


def w4_interference(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """128 decoding requests (256 ids, 512 greedy tokens); then 8 prompts of 32768 ids (16 tokens) arrive."""
    random.seed(3)
    short = [[random.randint(0, 9999) for _ in range(256)] for _ in range(128)]
    long = [[random.randint(0, 9999) for _ in range(32768)] for _ in range(8)]
    n_short, short_out, long_len = 128, 512, 32768
    if scale != 1.0:
        n_short, short_out, long_len = _s(128, scale), max(4, _s(512, scale)), _s(32768, scale)
        short = [[t % vocab for t in p[:_s(256, scale)]] for p in short[:n_short]]
        long = [[t % vocab for t in p[:long_len]] for p in long]
    return Workload(
        "W4", short, [SamplingParams(temperature=0, max_tokens=short_out, ignore_eos=True)] * n_short,
        late_prompts=long, late_params=[SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 8)


TOP_K_P = {"temperature": 0.6, "top_k": 50, "top_p": 0.95}  # the sampling settings of W1's top-k/top-p variant


def w1_top_k_p(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """W1's requests sampled with top_k=50 and top_p=0.95 (temperature 0.6): what users of a chat API send."""
    w = w1_offline(scale, vocab)
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, **TOP_K_P) for p in w.params]
    return Workload("W1-topkp", w.prompts, params)


def w2_top_k_p(scale: float = 1.0, vocab: int = 10000) -> Workload:
    """W2's requests sampled with top_k=50 and top_p=0.95 (temperature 0.6): a chat user's latency at batch 1,
    where the sampler's launches are a share of every step that greedy decoding does not pay."""
    w = w2_latency(scale, vocab)
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, seed=i, **TOP_K_P)
              for i, p in enumerate(w.params)]
    return Workload("W2-topkp", w.prompts, params)


@dataclass(frozen=True)
class SweepCell:
    """One request mix of the sweep: `requests` prompts of [prompt_lo, prompt_hi] random ids, outputs of
    [out_lo, out_hi] tokens, all submitted at once, sampled greedily or with top-k/top-p."""

    requests: int
    prompt_lo: int
    prompt_hi: int
    out_lo: int
    out_hi: int
    sampling: str  # "greedy" | "topkp"

    @property
    def name(self) -> str:
        return f"n{self.requests}_in{self.prompt_lo}-{self.prompt_hi}_out{self.out_lo}-{self.out_hi}_{self.sampling}"


def sweep_cells() -> list[SweepCell]:
    """The batch-mix sweep: request counts 64..1024 with W1-like prompts, and 64/256 requests with 1k-4k prompts;
    each greedy and with top-k/top-p. Outputs are shorter than W1's so the whole sweep stays a few minutes."""
    mixes = [(n, 100, 1024, 64, 512) for n in (64, 256, 512, 1024)] + [(n, 1024, 4096, 64, 256) for n in (64, 256)]
    return [SweepCell(*mix, sampling) for mix in mixes for sampling in ("greedy", "topkp")]


def sweep_workload(cell: SweepCell, vocab: int = 10000) -> Workload:
    """The requests of one sweep cell; the same ids on every machine and for every engine (seeded per mix, so
    the greedy and top-k/top-p cells of one mix share their prompts)."""
    rng = random.Random(f"{cell.requests}:{cell.prompt_lo}:{cell.prompt_hi}:{cell.out_lo}:{cell.out_hi}")
    hi = min(vocab, 10000) - 1
    prompts = [[rng.randint(0, hi) for _ in range(rng.randint(cell.prompt_lo, cell.prompt_hi))]
               for _ in range(cell.requests)]
    outs = [rng.randint(cell.out_lo, cell.out_hi) for _ in range(cell.requests)]
    extra = TOP_K_P if cell.sampling == "topkp" else {"temperature": 0.0}
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **extra) for m in outs]
    return Workload(cell.name, prompts, params)


@dataclass(frozen=True)
class PrefixGroupCell:
    """`requests` prompts in `groups` equal groups: a group's prompts share a prefix of [prefix_lo, prefix_hi]
    random ids, each followed by a suffix of [suffix_lo, suffix_hi] ids of its own; outputs of [out_lo, out_hi]
    tokens; all submitted at once, the groups interleaved (a seeded shuffle). Sampling is mixed, by position in
    the submitted order: greedy, temperature 0.6, and top-k/top-p (TOP_K_P) in turn."""

    requests: int
    groups: int
    prefix_lo: int
    prefix_hi: int
    suffix_lo: int
    suffix_hi: int
    out_lo: int
    out_hi: int

    @property
    def name(self) -> str:
        return (f"n{self.requests}_g{self.groups}_prefix{self.prefix_lo}-{self.prefix_hi}"
                f"_suffix{self.suffix_lo}-{self.suffix_hi}_out{self.out_lo}-{self.out_hi}_mixed")


MIXED_SAMPLING = ({"temperature": 0.0}, {"temperature": 0.6}, TOP_K_P)


def prefix_group_workload(cell: PrefixGroupCell, vocab: int = 10000) -> Workload:
    """The requests of a prefix-group mix; the same ids on every machine and for every engine."""
    rng = random.Random(cell.name)
    hi = min(vocab, 10000) - 1
    prefixes = [[rng.randint(0, hi) for _ in range(rng.randint(cell.prefix_lo, cell.prefix_hi))]
                for _ in range(cell.groups)]
    prompts = [prefixes[i % cell.groups] + [rng.randint(0, hi) for _ in range(rng.randint(cell.suffix_lo,
                                                                                           cell.suffix_hi))]
               for i in range(cell.requests)]
    rng.shuffle(prompts)
    outs = [rng.randint(cell.out_lo, cell.out_hi) for _ in range(cell.requests)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **MIXED_SAMPLING[i % len(MIXED_SAMPLING)])
              for i, m in enumerate(outs)]
    return Workload(cell.name, prompts, params)


# Issue 29's request mixes, where Qwen3.5 trailed SGLang: 512 requests of 16-2,048 prompt tokens and 16-512
# greedy outputs, and 384 requests in 24 groups sharing 512-1,536-token prefixes with mixed sampling.
MIXES: dict[str, SweepCell | PrefixGroupCell] = {
    "mix512": SweepCell(512, 16, 2048, 16, 512, "greedy"),
    "prefix384": PrefixGroupCell(384, 24, 512, 1536, 32, 256, 16, 512),
}


def mix_workload(name: str, vocab: int = 10000) -> Workload:
    """The requests of the mix `name` (MIXES), all submitted at once."""
    cell = MIXES[name]
    return sweep_workload(cell, vocab) if isinstance(cell, SweepCell) else prefix_group_workload(cell, vocab)


WORKLOADS = {"w1": w1_offline, "w1_topkp": w1_top_k_p, "w2": w2_latency, "w2_topkp": w2_top_k_p,
             "w3": w3_shared_prefix, "w4": w4_interference}
