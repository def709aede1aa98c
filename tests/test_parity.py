"""Token-for-token parity with Hugging Face `generate(do_sample=False)` in fp32, across architectures and
every engine switch that changes how the work is scheduled or stored (none may change a token)."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from helpers import MAX_NEW, PROMPTS, assert_all_pages_back, assert_parity, hf_greedy, hf_model

from minisgl import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def run_and_check(llm, path, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert_parity(outs, hf_greedy(path, prompts), prompts)
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_NEW for o in outs)
    assert_all_pages_back(llm)
    return outs


# --- every architecture -------------------------------------------------------------------------------------

ARCH_SWITCHES = {
    "default": {},
    "page4-chunk7": dict(page_size=4, chunked_prefill_size=7),
    "page16-no-overlap-no-radix-no-chunked": dict(page_size=16, overlap=False, radix_cache=False,
                                                  chunked_prefill_size=0),
}


@pytest.mark.parametrize("switches", list(ARCH_SWITCHES.values()), ids=list(ARCH_SWITCHES))
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_arch_parity(arch, switches, arch_paths, make_llm):
    path = arch_paths[arch]
    llm = make_llm(path, dtype="float32", **switches)
    assert llm.engine.model_config.arch == arch
    run_and_check(llm, path)


# --- the switch matrix, on Qwen3 ----------------------------------------------------------------------------

QWEN3_SWITCHES = {
    "page1": dict(page_size=1),
    "page4": dict(page_size=4),
    "page16": dict(page_size=16),
    "chunk7": dict(chunked_prefill_size=7),
    "chunk7-page4": dict(chunked_prefill_size=7, page_size=4),
    "chunk7-page16": dict(chunked_prefill_size=7, page_size=16),
    "chunk7-no-overlap": dict(chunked_prefill_size=7, overlap=False),
    "chunk3": dict(chunked_prefill_size=3, page_size=4),
    "no-overlap": dict(overlap=False),
    "no-overlap-page4": dict(overlap=False, page_size=4),
    "no-radix": dict(radix_cache=False),
    "no-radix-page4-chunk7": dict(radix_cache=False, page_size=4, chunked_prefill_size=7),
    "no-radix-no-overlap-page16": dict(radix_cache=False, overlap=False, page_size=16),
    "no-chunked": dict(chunked_prefill_size=0),
    "no-chunked-budget16-page4": dict(chunked_prefill_size=0, max_prefill_tokens=16, page_size=4),
    "chunk-size-0": dict(chunked_prefill_size=0),
    "max-running-3": dict(max_running_requests=3),
    "all-off": dict(radix_cache=False, chunked_prefill_size=0, overlap=False, cuda_graph=False),
}


@pytest.mark.parametrize("switches", list(QWEN3_SWITCHES.values()), ids=list(QWEN3_SWITCHES))
def test_qwen3_switch_matrix(switches, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, **switches)
    run_and_check(llm, qwen3_path)


def test_chunked_prefill_really_chunks(qwen3_path, make_llm):
    """With a budget of 7 no step computes more than 7 prompt tokens (the switch is not a no-op)."""
    llm = make_llm(qwen3_path, chunked_prefill_size=7, page_size=4)
    seen = []
    forward = llm.engine.runner.forward

    def spy(batch):
        seen.append(sum(n for n in batch.extend_lens if n > 1))
        return forward(batch)

    llm.engine.runner.forward = spy
    run_and_check(llm, qwen3_path)
    assert max(seen) <= 7
    assert llm.engine.stats["steps"] > len(PROMPTS)


# --- radix cache: a second pass reuses the first one's KV and still matches ---------------------------------

@pytest.mark.parametrize("page_size,overlap", [(1, True), (4, False), (16, True)],
                         ids=["page1-overlap", "page4-no-overlap", "page16-overlap"])
def test_radix_second_pass_hits_cache(page_size, overlap, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, page_size=page_size, overlap=overlap, chunked_prefill_size=7)
    first = run_and_check(llm, qwen3_path)
    # within the first pass, prompts sharing a prefix with an earlier one can already reuse it
    assert all(o.num_cached_prompt_tokens < len(o.prompt_token_ids) for o in first)
    assert llm.engine.cache.cached_pages > 0
    second = run_and_check(llm, qwen3_path)
    for o in second:
        n = len(o.prompt_token_ids)
        # the whole prompt but its last token (which must be computed for its logits), in whole pages
        expect = (n - 1) // page_size * page_size
        assert o.num_cached_prompt_tokens == expect, (n, o.num_cached_prompt_tokens, expect)
        assert o.num_cached_prompt_tokens < n
    hits = sum(o.num_cached_prompt_tokens > 0 for o in second)
    assert hits >= len(PROMPTS) // 2 if page_size < 16 else hits >= 6


def test_radix_shared_prefix_within_one_batch(qwen3_path, make_llm):
    """Prompts that share a prefix with an earlier one reuse its pages in the same batch once it is cached
    (max_running_requests=1 makes the order strict; it also runs the batch one request at a time)."""
    llm = make_llm(qwen3_path, page_size=4, max_running_requests=1, chunked_prefill_size=7)
    outs = run_and_check(llm, qwen3_path)
    # PROMPTS[8:12] share a 9-token prefix, [12:16] 24 tokens, [16:20] 37 tokens
    for group, prefix_len in ((range(9, 12), 9), (range(13, 16), 24), (range(17, 20), 37)):
        for i in group:
            assert outs[i].num_cached_prompt_tokens >= prefix_len // 4 * 4, (i, outs[i].num_cached_prompt_tokens)


def test_no_radix_never_caches(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, radix_cache=False, page_size=4)
    run_and_check(llm, qwen3_path)
    second = run_and_check(llm, qwen3_path)
    assert all(o.num_cached_prompt_tokens == 0 for o in second)
    assert llm.engine.allocator.num_free == llm.engine.allocator.capacity


# --- retraction: a KV pool too small for the batch ---------------------------------------------------------

RETRACT = {
    "page1": dict(page_size=1, kv_cache_tokens=100),
    "page4": dict(page_size=4, kv_cache_tokens=120),
    "page4-no-overlap": dict(page_size=4, kv_cache_tokens=120, overlap=False),
    "page4-no-radix": dict(page_size=4, kv_cache_tokens=120, radix_cache=False),
    "page16-chunk7": dict(page_size=16, kv_cache_tokens=128, chunked_prefill_size=7),
    "page4-no-radix-no-overlap-chunk7": dict(page_size=4, kv_cache_tokens=120, radix_cache=False,
                                             overlap=False, chunked_prefill_size=7),
    "page4-no-chunked": dict(page_size=4, kv_cache_tokens=120, chunked_prefill_size=0),
}


@pytest.mark.parametrize("switches", list(RETRACT.values()), ids=list(RETRACT))
def test_retraction_keeps_parity(switches, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, **switches)
    assert llm.engine.runner.kv_capacity_tokens < 200  # far less than the batch needs
    run_and_check(llm, qwen3_path)
    assert llm.engine.scheduler.num_retractions > 0
    # and the engine is still fine afterwards
    run_and_check(llm, qwen3_path, prompts=PROMPTS[:5])


def test_num_pages_switch(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, page_size=4, num_pages=31)
    assert llm.engine.allocator.capacity == 30
    run_and_check(llm, qwen3_path)
    assert llm.engine.scheduler.num_retractions > 0


# --- uneven lengths: requests finish at different steps ----------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_mixed_max_tokens(overlap, qwen3_path, make_llm):
    llm = make_llm(qwen3_path, page_size=4, overlap=overlap, chunked_prefill_size=7)
    params = [SamplingParams(temperature=0, max_tokens=1 + (7 * i) % MAX_NEW, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    refs = hf_greedy(qwen3_path, PROMPTS)
    for o, r, p in zip(outs, refs, params):
        assert o.token_ids == r[:p.max_tokens]
        assert o.finish_reason == "length"
    assert_all_pages_back(llm)


def test_single_prompt_and_repeated_calls(qwen3_path, make_llm):
    llm = make_llm(qwen3_path, page_size=4)
    refs = hf_greedy(qwen3_path, PROMPTS)
    for i in (1, 0, 5, 1):
        (out,) = llm.generate(PROMPTS[i], GREEDY)  # a bare list of ints is one prompt
        assert out.token_ids == refs[i]
        assert out.ttft is not None and out.latency >= out.ttft >= 0
        assert_all_pages_back(llm)


# --- checkpoint layouts ------------------------------------------------------------------------------------

def test_sharded_checkpoint(qwen2_sharded_path, make_llm):
    shards = glob.glob(os.path.join(qwen2_sharded_path, "*.safetensors"))
    assert len(shards) >= 3, shards
    with open(os.path.join(qwen2_sharded_path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    # the q/k/v slices of one fused parameter come from different shards at least once
    layer0 = {weight_map[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"}
    layer0 |= {weight_map[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up", "down")}
    assert len(layer0) > 1
    llm = make_llm(qwen2_sharded_path, page_size=4)
    run_and_check(llm, qwen2_sharded_path, prompts=PROMPTS[:16])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_and_untied_embeddings(tied, qwen3_path, qwen3_untied_path, make_llm):
    from safetensors import safe_open

    path = qwen3_path if tied else qwen3_untied_path
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tied
    llm = make_llm(path, page_size=4)
    model = llm.engine.runner.model
    assert llm.engine.model_config.tie_word_embeddings == tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    else:
        assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
        assert torch.equal(model.lm_head.weight, hf_model(path).lm_head.weight)
    run_and_check(llm, path, prompts=PROMPTS[:16])


# --- the tests bite: the features they cover really are in the checkpoints ---------------------------------

def test_llama3_rope_scaling_is_exercised(llama_path, make_llm):
    from minisgl.models.layers import rope_inv_freq

    llm = make_llm(llama_path)
    mc = llm.engine.model_config
    assert mc.rope_scaling is not None and mc.rope_scaling["rope_type"] == "llama3"
    ours = rope_inv_freq(mc.head_dim, mc.rope_theta, mc.rope_scaling)
    plain = rope_inv_freq(mc.head_dim, mc.rope_theta, None)
    hf_inv = hf_model(llama_path).model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(ours, hf_inv, rtol=1e-6, atol=0)
    changed = ~torch.isclose(ours, plain)
    assert changed.sum() >= 2  # several frequencies scaled ...
    assert (ours == plain).sum() >= 1  # ... and the high ones kept
    # and some are blended (neither kept nor divided by `factor`)
    assert (~torch.isclose(ours, plain) & ~torch.isclose(ours, plain / 8)).any()
    assert max(map(len, PROMPTS)) + MAX_NEW > mc.rope_scaling["original_max_position_embeddings"]


def test_qwen2_biases_are_loaded(qwen2_path, make_llm):
    llm = make_llm(qwen2_path)
    attn = llm.engine.runner.model.layers[1].self_attn
    hf_attn = hf_model(qwen2_path).model.layers[1].self_attn
    want = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert want.abs().min() > 0
    torch.testing.assert_close(attn.qkv_proj.bias, want, rtol=0, atol=0)
