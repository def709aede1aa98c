"""The whole engine on the CPU: greedy tokens equal to Hugging Face `generate`, with every switch.

The engine runs the student's model, pool, attention and cache (and the rest of the package)."""

from __future__ import annotations

import random

import adapters
import pytest
import torch

MAX_NEW = 24


def prompts(seed=0, vocab=512):
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    ps = [toks(1), toks(40), toks(7), toks(23)]
    prefix = toks(19)
    ps += [prefix + toks(k) for k in (0, 3, 11)]  # shared prefixes: the radix cache's case
    ps.append(list(ps[1]))  # an exact duplicate
    return ps


_refs: dict = {}


def hf_greedy(path, ps, max_new=MAX_NEW):
    from transformers import AutoModelForCausalLM

    if path not in _refs:
        _refs[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, out = _refs[path], []
    for p in ps:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def assert_same(outs, refs):
    bad = [(i, o.token_ids, r) for i, (o, r) in enumerate(zip(outs, refs)) if o.token_ids != r]
    assert not bad, "tokens differ from transformers for prompts " + ", ".join(
        f"{i} (first diff at {next(j for j, (a, b) in enumerate(zip(o, r)) if a != b) if o[:len(r)] != r else len(r)})"
        for i, o, r in bad)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_greedy_tokens_equal_hf(arch, tiny_paths):
    ps = prompts()
    engine = adapters.llm(tiny_paths[arch], attention_backend="torch")
    assert_same(engine.generate(ps, adapters.greedy(MAX_NEW)), hf_greedy(tiny_paths[arch], ps))


@pytest.mark.parametrize("switches", [
    dict(radix_cache=False), dict(page_size=4), dict(chunked_prefill_size=16), dict(overlap=False),
    dict(page_size=2, chunked_prefill_size=8, max_running_requests=3),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_switches_do_not_change_tokens(switches, tiny_paths):
    ps = prompts(seed=1)
    engine = adapters.llm(tiny_paths["qwen3"], attention_backend="torch", **switches)
    assert_same(engine.generate(ps, adapters.greedy(MAX_NEW)), hf_greedy(tiny_paths["qwen3"], ps))


def test_embedded_model_equals_hf(embedded_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model)
    ps = [tok.encode(t, add_special_tokens=False) for t in ("The function returns", "This module provides")]
    engine = adapters.llm(embedded_model, attention_backend="torch")
    assert_same(engine.generate(ps, adapters.greedy(16)), hf_greedy(embedded_model, ps, 16))
