"""Which grammar library builds a token mask fastest: xgrammar, llguidance, outlines-core (CPU).

For each library and vocabulary (the embedded model's 4,096 tokens, and a 151,936-token one the size of Qwen3's:
the embedded tokens plus seeded concatenations of two of them), a JSON schema and the free JSON object grammar
are compiled once (compile time reported), then a valid document is walked token by token: per token, the time
to fill the next-token bitmask (what the engine waits for), and to advance the matcher. Writes JSON.

    python -m lab.checks.grammar_mask_bench OUT_DIR
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

import numpy as np

from lab import REPO

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}}, "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engine", "notes"],
            "address": {"city": "London", "zip": "W1"}, "active": True}


def vocabularies() -> dict[str, tuple[list[bytes], int]]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(str(REPO), "assets", "tiny-qwen3"))
    small = [tok.convert_tokens_to_string([t]).encode("utf-8", "surrogatepass")
             for t in tok.convert_ids_to_tokens(list(range(tok.vocab_size)))]
    eos = tok.eos_token_id if tok.eos_token_id is not None else 0
    rng = random.Random(0)
    seen = set(small)
    large = list(small)
    while len(large) < 151936:
        t = rng.choice(small) + rng.choice(small)
        if t and t not in seen:
            seen.add(t)
            large.append(t)
    return {"tiny_4096": (small, eos), "large_151936": (large, eos)}


def tokenize(text: bytes, vocab: list[bytes]) -> list[int]:
    """Greedy longest match (any tokenization the grammar accepts will do for timing)."""
    index = {t: i for i, t in enumerate(vocab) if t}
    longest = max(len(t) for t in index)
    out, pos = [], 0
    while pos < len(text):
        for n in range(min(longest, len(text) - pos), 0, -1):
            i = index.get(text[pos:pos + n])
            if i is not None:
                out.append(i)
                pos += n
                break
        else:
            raise ValueError(f"byte {text[pos:pos + 1]!r} is in no token")
    return out


def run_xgrammar(vocab, eos, grammars, tokens):
    import xgrammar as xgr
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    out = {}
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_builtin_json_grammar() if schema is None else compiler.compile_json_schema(
            json.dumps(schema))
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, len(vocab))
        fill = lambda m=matcher, b=bitmask: m.fill_next_token_bitmask(b, 0)
        out[name] = walk(fill, matcher.accept_token, tokens, compile_s)
    return out


def run_llguidance(vocab, eos, grammars, tokens):
    import llguidance
    import llguidance.numpy as lln

    class Tok:
        eos_token_id, bos_token_id, tokens = eos, None, vocab

        def __call__(self, s):
            return tokenize(s if isinstance(s, bytes) else s.encode(), vocab)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tok()))
    out = {}
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        grammar = llguidance.grammar_from("json_schema", json.dumps(schema or {"type": "object"}))
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        bitmask = lln.allocate_token_bitmask(1, lltok.vocab_size)
        fill = lambda m=matcher, b=bitmask: lln.fill_next_token_bitmask(m, b, 0)
        out[name] = walk(fill, matcher.consume_token, tokens,
                         compile_s)
    return out


def run_outlines(vocab, eos, grammars, tokens):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    mapping: dict = {}
    for i, t in enumerate(vocab):
        if i != eos and t:
            mapping.setdefault(t, []).append(i)
    vocabulary = Vocabulary(eos, mapping)
    out = {}
    for name, schema in grammars.items():
        t0 = time.perf_counter()
        regex = build_regex_from_schema(json.dumps(schema or {"type": "object"}))
        index = Index(regex, vocabulary)
        compile_s = time.perf_counter() - t0
        guide = Guide(index)
        mask = np.zeros((len(vocab) + 31) // 32, dtype=np.int32)
        out[name] = walk(lambda g=guide, k=mask: g.write_mask_into(k.ctypes.data, k.size, 4), guide.advance, tokens,
                         compile_s)
    return out


def walk(fill, advance, tokens, compile_s) -> dict:
    mask_us, advance_us = [], []
    for t in tokens:
        t0 = time.perf_counter()
        fill()
        t1 = time.perf_counter()
        advance(t)
        t2 = time.perf_counter()
        mask_us.append((t1 - t0) * 1e6)
        advance_us.append((t2 - t1) * 1e6)
    return {"compile_s": round(compile_s, 4), "tokens": len(tokens),
            "mask_us_median": round(statistics.median(mask_us), 2), "mask_us_mean": round(statistics.mean(mask_us), 2),
            "mask_us_max": round(max(mask_us), 2), "advance_us_median": round(statistics.median(advance_us), 2)}


def main(out_dir: str) -> None:
    import importlib.metadata as md
    results: dict = {"versions": {}, "results": {}}
    text = json.dumps(DOCUMENT).encode()
    grammars = {"json_schema": SCHEMA, "json_object": None}
    for lib in ("xgrammar", "llguidance", "outlines_core"):
        try:
            results["versions"][lib] = md.version(lib)
        except md.PackageNotFoundError:
            results["versions"][lib] = None
    for vname, (vocab, eos) in vocabularies().items():
        tokens = tokenize(text, vocab)
        for lib, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance), ("outlines_core", run_outlines)):
            if results["versions"][lib] is None:
                continue
            try:
                results["results"].setdefault(vname, {})[lib] = fn(vocab, eos, grammars, tokens)
            except Exception as e:  # a library that cannot do this: say so in the JSON
                results["results"].setdefault(vname, {})[lib] = {"error": f"{type(e).__name__}: {e}"[:300]}
            print(vname, lib, json.dumps(results["results"][vname][lib]), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "grammar_mask_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
