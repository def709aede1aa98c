"""Hugging Face transformers beside minisgl on the same dummy weights: greedy parity and the W2 peer figures."""

from __future__ import annotations

import random
import statistics
import time

import torch

from lab.engines import build, free_gpu, log
from lab.models import model_path
from minisgl import SamplingParams


def hf_model_like(model, cfg, path: str, dtype: torch.dtype):
    """A transformers model holding exactly minisgl's (dummy) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minisgl.loader import to_hf_state_dict
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype,
                                              attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model, cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.generation_config.eos_token_id = None  # dummy weights: run every request to its length
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


PARITY_SWITCHES = (("default", {}), ("no_overlap", {"overlap": False}), ("no_cuda_graph", {"cuda_graph": False}))


def parity(dtypes=("float32", "bfloat16"), switches=PARITY_SWITCHES, model: str = "qwen3-0.6b") -> dict:
    """Greedy tokens of minisgl (each switch setting) against transformers on the same weights: 8 prompts x 64."""
    rng = random.Random(7)
    prompts = [[rng.randint(0, 150000) for _ in range(rng.randint(16, 200))] for _ in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    res = {}
    for dtype_name in dtypes:
        ref = None
        per_switch = {}
        for label, kw in switches:
            llm = build(model, kw, dtype=dtype_name, max_model_len=4096, kv_memory_fraction=0.3)
            if ref is None:  # the same seeded dummy weights in every engine: one HF reference per dtype
                r = llm.engine.runner
                hf = hf_model_like(r.model, r.model_config, r.model_path, getattr(torch, dtype_name))
                ref = [hf_greedy(hf, p, 64) for p in prompts]
                del hf
                free_gpu()
            outs = llm.generate(prompts, sp)
            prefix = [next((i for i, (a, b) in enumerate(zip(o.token_ids, rf)) if a != b), len(rf))
                      for o, rf in zip(outs, ref)]
            per_switch[label] = {"exact": sum(p == 64 for p in prefix), "of": len(prompts),
                                 "tokens_before_first_divergence": prefix,
                                 "token_ids": [o.token_ids for o in outs],
                                 "graph_hit_rate": llm.engine.stats["graph_steps"] /
                                 max(llm.engine.stats["decode_steps"], 1)}
            log(dtype_name, label, {k: v for k, v in per_switch[label].items() if k != "token_ids"})
            llm = None
            free_gpu()
        first = next(iter(per_switch.values()))["token_ids"]
        for v in per_switch.values():  # the switches must not change the tokens
            v["same_tokens_as_first_switch"] = v.pop("token_ids") == first
        res[dtype_name] = per_switch
    return res


def hf_peer(model: str, requests: int = 1, new_tokens: int = 128) -> dict:
    """transformers' generate (sdpa attention, dynamic cache) on W2's first prompts: TTFT (a 1-token generate)
    and TPOT ((a `new_tokens` generate - TTFT) / (new_tokens - 1)), medians. Fewer requests and tokens than W2
    (transformers takes ~30-90 ms a token here): the JSON says how many."""
    from minisgl.bench.workloads import w2_latency
    from minisgl.loader import load_model

    loaded = load_model(model_path(model), torch.bfloat16, torch.device("cuda"), "dummy", 0)
    hf = hf_model_like(loaded.model, loaded.config, loaded.path, torch.bfloat16)
    del loaded
    free_gpu()
    prompts = w2_latency().prompts[:requests]
    hf_greedy(hf, prompts[0][:64], 4)  # warm-up
    ttfts, tpots = [], []
    for p in prompts:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf_greedy(hf, p, 1)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        hf_greedy(hf, p, new_tokens)
        torch.cuda.synchronize()
        ttfts.append(ttft)
        tpots.append((time.perf_counter() - t0 - ttft) / (new_tokens - 1))
    del hf
    free_gpu()
    return {"engine": "transformers generate, sdpa, dynamic cache", "requests": requests,
            "output_tokens_each": new_tokens, "prompt_tokens_each": len(prompts[0]),
            "ttft_ms_median": 1e3 * statistics.median(ttfts), "tpot_ms_median": 1e3 * statistics.median(tpots)}
