"""Qwen3.5 (the hybrid model): greedy parity with Hugging Face in fp32 across the engine's switches, the
per-request state carried through chunks, retraction and the prefix cache, and mutations that must break it.

The tiny checkpoints are built to make the state matter: slow decay (A = U(0.01, 0.3), so a token's effect
lasts), random norm weights (a norm on the wrong tensor shows), 2 key heads shared by 4 value heads, and two
full-attention layers (so the KV pool's layer index differs from the model's).
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import MAX_NEW, PROMPTS, VOCAB, assert_all_pages_back, assert_parity, hf_greedy

from minisgl import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# a subset keeps the file fast: short and long prompts, shared prefixes, a duplicate, a prefix of another
SUBSET = [PROMPTS[i] for i in (0, 1, 3, 4, 6, 8, 11, 12, 15, 16, 19, 20, 21)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_text_config(**overrides):
    from transformers import Qwen3_5TextConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
              pad_token_id=0,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    kw.update(overrides)
    return Qwen3_5TextConfig(**kw)


@torch.no_grad()
def make_state_sensitive(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):  # slow decay: the state remembers
            p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif "norm" in name:  # zero-centred norms around 0, the gated norm's plain weight around 1
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if "linear_attn.norm" in name else 0.0))
        elif p.ndim >= 2:
            p.copy_(0.15 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module")
def qwen35_path(models_dir):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(tiny_text_config()).eval()
    make_state_sensitive(model, seed=1)
    path = str(models_dir / "qwen3.5")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen35_mm_path(models_dir, qwen35_path):
    """The same decoder saved as the multimodal class (weights under model.language_model.*, a vision tower
    to skip, untied embeddings here): its tokens must equal the text model's."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    text = Qwen3_5ForCausalLM.from_pretrained(qwen35_path, dtype=torch.float32)
    cfg = Qwen3_5Config(text_config=tiny_text_config(tie_word_embeddings=False).to_dict(),
                        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                           out_hidden_size=64, patch_size=4, spatial_merge_size=2,
                                           temporal_patch_size=2, num_position_embeddings=16),
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    with torch.no_grad():
        model.lm_head.weight.copy_(text.lm_head.weight)
    path = str(models_dir / "qwen3.5-mm")
    model.save_pretrained(path)
    return path


def run_and_check(llm, path, prompts=SUBSET, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert_parity(outs, hf_greedy(path, prompts), prompts)
    assert_all_pages_back(llm)
    return outs


# --- loading -------------------------------------------------------------------------------------------------

def test_loads_text_and_multimodal_checkpoints(qwen35_path, qwen35_mm_path, make_llm):
    from safetensors import safe_open

    with safe_open(os.path.join(qwen35_mm_path, "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    llm = make_llm(qwen35_mm_path, page_size=4)
    cfg = llm.engine.model_config
    assert cfg.arch == "qwen3_5" and cfg.rotary_dim == 4 and cfg.full_attention_layers == [1, 3]
    assert llm.engine.runner.kv_cache.num_layers == 2  # the KV pool holds the full-attention layers only
    # the multimodal checkpoint's tokens are the text checkpoint's (same decoder weights)
    outs = llm.generate(SUBSET[:6], GREEDY)
    assert_parity(outs, hf_greedy(qwen35_path, SUBSET[:6]), SUBSET[:6])
    assert_all_pages_back(llm)


def test_real_config_shapes():
    """The 0.8B config (multimodal wrapper) reads into the right shapes; built on the meta device (no memory)."""
    from transformers import AutoConfig

    from minisgl.kvcache.state_pool import StatePool
    from minisgl.models.qwen3_5 import Qwen35Config, Qwen35LM

    cfg = Qwen35Config.from_hf(AutoConfig.from_pretrained(os.path.join(REPO, "assets/configs/qwen3.5-0.8b")))
    assert (cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.rotary_dim) == (1024, 24, 256, 64)
    assert cfg.full_attention_layers == [3, 7, 11, 15, 19, 23] and cfg.conv_channels == 6144
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (248044,)
    with torch.device("meta"):
        model = Qwen35LM(cfg)
    n = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    assert 0.7e9 < n < 0.8e9, n
    per_slot = StatePool.bytes_per_slot(18, cfg.conv_channels, 4, 16, 128, 128, torch.bfloat16)
    assert per_slot == 18 * (6144 * 3 * 2 + 16 * 128 * 128 * 4)  # ~19 MB, almost all of it the fp32 state


def test_moe_variant_is_refused(tmp_path):
    from transformers import Qwen3_5MoeTextConfig

    from minisgl import LLM

    Qwen3_5MoeTextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MoE"):
        LLM(str(tmp_path), load_format="dummy")


def test_dummy_weights_bf16_stay_finite(qwen35_path, make_llm):
    llm = make_llm(qwen35_path, load_format="dummy", dtype="bfloat16", page_size=4)
    model = llm.engine.runner.model
    a = model.layers[0].linear_attn.A_log.float().exp()
    assert 0.009 < a.min() and a.max() < 16.1  # HF's A = U(0.01, 16)
    assert (model.layers[0].linear_attn.dt_bias == 1).all()
    outs = llm.generate(SUBSET[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    state = llm.engine.runner.state_pool
    assert torch.isfinite(state.recurrent).all() and torch.isfinite(state.conv).all()
    assert state.recurrent.abs().sum() > 0  # the state was really written


# --- parity across the switches ----------------------------------------------------------------------------

SWITCHES = {
    "page1": dict(page_size=1),
    "page4-chunk7": dict(page_size=4, chunked_prefill_size=7),
    "page16-chunk3": dict(page_size=16, chunked_prefill_size=3),
    "page4-chunk3-no-overlap": dict(page_size=4, chunked_prefill_size=3, overlap=False),
    "page1-chunk7-no-overlap": dict(page_size=1, chunked_prefill_size=7, overlap=False),
    "no-radix-page4-chunk7": dict(page_size=4, chunked_prefill_size=7, radix_cache=False),
    "no-chunked-page16": dict(page_size=16, chunked_prefill_size=0),
    "max-running-3-page4": dict(page_size=4, max_running_requests=3),
}


@pytest.mark.parametrize("switches", list(SWITCHES.values()), ids=list(SWITCHES))
def test_qwen35_parity(switches, qwen35_path, make_llm):
    llm = make_llm(qwen35_path, dtype="float32", **switches)
    assert llm.engine.model_config.arch == "qwen3_5"
    run_and_check(llm, qwen35_path)


@pytest.mark.parametrize("page_size,chunk", [(1, 7), (4, 3), (16, 7)])
def test_radix_second_pass_hits_and_matches(page_size, chunk, qwen35_path, make_llm):
    llm = make_llm(qwen35_path, page_size=page_size, chunked_prefill_size=chunk)
    run_and_check(llm, qwen35_path)
    assert llm.engine.cache.snapshots, "no state snapshot was cached"
    second = run_and_check(llm, qwen35_path)
    cached = [o.num_cached_prompt_tokens for o in second]
    assert sum(cached) > 0, cached
    # a hit starts from a snapshot, taken at page boundaries only
    assert all(c % page_size == 0 and c < len(o.prompt_token_ids) for c, o in zip(cached, second))


def test_radix_hit_restores_state_at_the_prompt_boundary(qwen35_path, make_llm):
    """One request at a time (and a snapshot slot for each prompt; on a CPU the default is one per running request): the
    second pass resumes each prompt from its last page boundary below its end."""
    llm = make_llm(qwen35_path, page_size=4, max_running_requests=1, state_snapshots=32)
    run_and_check(llm, qwen35_path)
    second = run_and_check(llm, qwen35_path)
    for o in second:
        assert o.num_cached_prompt_tokens == (len(o.prompt_token_ids) - 1) // 4 * 4


RETRACT = {
    "page1": dict(page_size=1, kv_cache_tokens=100),
    "page4-chunk7": dict(page_size=4, kv_cache_tokens=120, chunked_prefill_size=7),
    "page4-no-radix-no-overlap": dict(page_size=4, kv_cache_tokens=120, radix_cache=False, overlap=False),
}


@pytest.mark.parametrize("switches", list(RETRACT.values()), ids=list(RETRACT))
def test_retraction_keeps_parity(switches, qwen35_path, make_llm):
    llm = make_llm(qwen35_path, **switches)
    run_and_check(llm, qwen35_path)
    assert llm.engine.scheduler.num_retractions > 0


@pytest.mark.parametrize("page_size", [1, 3])
def test_kv_match_len_is_the_radix_match_depth(page_size):
    """The branch-point lookup: the depth RadixCache.match reaches (snapshots ignored), without splitting."""
    import random

    from minisgl.kvcache import PageAllocator, RadixCache
    from minisgl.kvcache.state_pool import StatePool
    from minisgl.scheduler.hybrid import HybridRadixCache

    rng = random.Random(page_size)
    p = page_size
    alloc = PageAllocator(400)
    cache = HybridRadixCache(alloc, p, StatePool(1, 2, 2, 4, 4, 1, 2, 2, torch.float32, "cpu"))
    base = [rng.randrange(5) for _ in range(30)]
    seqs = [base[:rng.randrange(0, 30)] + [rng.randrange(5) for _ in range(rng.randrange(3, 20))] for _ in range(12)]
    for seq in seqs:
        n = len(seq) // p
        cache.insert(seq[:n * p], alloc.alloc(n))
    for _ in range(40):
        query = rng.choice(seqs)[:rng.randrange(0, 40)] + [rng.randrange(5) for _ in range(rng.randrange(0, 4))]
        nodes = len(list(cache._nodes()))
        depth = cache.kv_match_len(query)
        assert len(list(cache._nodes())) == nodes  # read only: no split
        assert depth == len(RadixCache.match(cache, query).pages) * p


def test_snapshot_slots_sized_from_memory(monkeypatch):
    from minisgl.kvcache.state_pool import StatePool

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10_000, 20_000))
    assert StatePool.num_snapshots_for(7, 0.1, 100, cuda, fallback=3) == 7  # given: taken as it is
    assert StatePool.num_snapshots_for(None, 0.1, 100, cuda, fallback=3) == 10  # 10% of the free 10 000 bytes
    assert StatePool.num_snapshots_for(None, 0.001, 100, cuda, fallback=3) == 1  # at least one
    assert StatePool.num_snapshots_for(None, 0.1, 100, cpu, fallback=3) == 3  # a CPU: one per running request
    from minisgl.config import EngineConfig
    assert EngineConfig("m").state_snapshot_memory_fraction == 0.05
    with pytest.raises(ValueError, match="state_snapshot_memory_fraction"):
        EngineConfig("m", state_snapshot_memory_fraction=1.5).validate()


def test_few_snapshot_slots_still_match(qwen35_path, make_llm):
    """Two snapshot slots for 13 prompts: snapshots are dropped LRU and reused, tokens never change."""
    llm = make_llm(qwen35_path, page_size=4, chunked_prefill_size=7, state_snapshots=2)
    run_and_check(llm, qwen35_path)
    second = run_and_check(llm, qwen35_path)
    assert len(llm.engine.cache.snapshots) <= 2
    assert any(o.num_cached_prompt_tokens for o in second)


def test_abort_and_failed_step_return_slots(qwen35_path, make_llm):
    llm = make_llm(qwen35_path, page_size=4, chunked_prefill_size=7)
    engine = llm.engine
    reqs = [engine.add_request(p, GREEDY) for p in SUBSET[:4]]
    for _ in range(3):
        engine.step()
    engine.abort(reqs[1])
    engine.run()
    assert reqs[1].finish_reason == "abort"
    # a step that raises ends every request and gives everything back, snapshots included
    reqs = [engine.add_request(p, GREEDY) for p in SUBSET[:4]]
    forward = engine.runner.forward
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return forward(batch)

    engine.runner.forward = failing
    with pytest.raises(RuntimeError, match="boom"):
        engine.run()
    engine.runner.forward = forward
    assert all(r.finish_reason in ("error", "length") for r in reqs)
    assert not engine.cache.snapshots
    run_and_check(llm, qwen35_path, prompts=SUBSET[:5])


# --- mutations: dropping the state anywhere must change the tokens ------------------------------------------

def _outputs(llm, prompts=SUBSET):
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def test_mutation_no_conv_state_across_chunks(qwen35_path, make_llm, monkeypatch):
    from minisgl.models import qwen3_5

    real = qwen3_5.gdn.causal_conv1d

    def forgetful(x, weight, bias, conv_state, slots, cu_seqlens):
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        conv_state[slots[lens > 1]] = 0  # every prefill chunk starts with an empty conv window
        return real(x, weight, bias, conv_state, slots, cu_seqlens)

    monkeypatch.setattr(qwen3_5.gdn, "causal_conv1d", forgetful)
    llm = make_llm(qwen35_path, page_size=4, chunked_prefill_size=3)
    assert _outputs(llm) != hf_greedy(qwen35_path, SUBSET)


def test_mutation_recurrent_state_reset_per_chunk(qwen35_path, make_llm, monkeypatch):
    from minisgl.models import qwen3_5

    real = qwen3_5.gdn.gated_delta_rule

    def forgetful(q, k, v, g, beta, state, slots, cu_seqlens):
        lens = cu_seqlens[1:] - cu_seqlens[:-1]
        state[slots[lens > 1]] = 0  # every prefill chunk starts from a zero state
        return real(q, k, v, g, beta, state, slots, cu_seqlens)

    monkeypatch.setattr(qwen3_5.gdn, "gated_delta_rule", forgetful)
    llm = make_llm(qwen35_path, page_size=4, chunked_prefill_size=3)
    assert _outputs(llm) != hf_greedy(qwen35_path, SUBSET)


def test_mutation_prefix_kv_with_zero_state(qwen35_path, make_llm, monkeypatch):
    """A radix hit that reuses the KV pages but starts the linear layers from zeros is wrong."""
    from minisgl.kvcache import RadixCache
    from minisgl.scheduler.hybrid import HybridRadixCache

    llm = make_llm(qwen35_path, page_size=4, chunked_prefill_size=7)
    run_and_check(llm, qwen35_path)  # fills the cache, correctly
    monkeypatch.setattr(HybridRadixCache, "match", RadixCache.match)  # any node, snapshot or not ...
    monkeypatch.setattr(HybridRadixCache, "snapshot_of", lambda self, node: None)  # ... and a zero state
    assert _outputs(llm) != hf_greedy(qwen35_path, SUBSET)


# --- shared prefixes (DESIGN.md W3 in miniature): the cache must hit at the branch point ---------------------

def _w3_like(prefixes: list[list[int]], seed: int, num_reqs: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 20))]
            for _ in range(num_reqs)]


def _cached_share(outs) -> float:
    return sum(o.num_cached_prompt_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefixes_hit_like_a_kv_only_cache(page_size, qwen35_path, qwen3_path, make_llm, monkeypatch):
    """Many suffixes on a few shared prefixes, all at once, a few requests per step: the first request of a
    prefix that matches its KV but no snapshot snapshots the branch point, and later ones hit there. The cached
    prompt share comes within a few points of the KV-only cache's (Qwen3, same scheduling), well above what
    chunk-end and prompt-end snapshots alone give, and the tokens stay HF's, on a second workload over the same
    prefixes too (which then hits at the branch points from its first request on)."""
    import random

    from minisgl.scheduler.hybrid import HybridRadixCache

    rng = random.Random(3)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(48)] for _ in range(3)]
    first, second = _w3_like(prefixes, seed=3, num_reqs=40), _w3_like(prefixes, seed=4, num_reqs=12)
    # a handful of requests per step; snapshot slots as on a GPU (sized from memory there, not max_running)
    kw = dict(chunked_prefill_size=96, max_running_requests=6, page_size=page_size, state_snapshots=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    kv_only = _cached_share(make_llm(qwen3_path, **kw).generate(first, params))
    llm = make_llm(qwen35_path, **kw)
    outs = llm.generate(first, params)
    share = _cached_share(outs)
    assert_parity(outs, hf_greedy(qwen35_path, first, 4), first)
    assert share >= kv_only - 0.08, (share, kv_only)
    outs = llm.generate(second, params)
    assert_parity(outs, hf_greedy(qwen35_path, second, 4), second)
    assert all(o.num_cached_prompt_tokens >= 48 for o in outs)  # every prompt resumes at least at its prefix
    assert_all_pages_back(llm)
    # without the branch-point snapshots: only chunk ends and prompt ends are snapshotted, fewer hits
    monkeypatch.setattr(HybridRadixCache, "kv_match_len", lambda self, ids: 0)
    without = _cached_share(make_llm(qwen35_path, **kw).generate(first, params))
    assert without < share - 0.1, (without, share, kv_only)


def test_w3_schedule_cache_share_near_kv_only(qwen35_path, qwen3_path, make_llm):
    """DESIGN.md W3 at full size (256 requests on 8 system prompts of 1024 ids, ids folded into the tiny vocab),
    scheduling only: the forward is replaced by one that samples a constant token, so this measures what the
    prefix caches serve, not the tokens (the test above checks those). Before branch-point snapshots Qwen3.5
    served 46.5% of the prompt tokens from the cache against Qwen3's 84.1%, on the H200 and here alike."""
    from minisgl.bench.workloads import w3_shared_prefix
    from minisgl.engine.model_runner import StepOutput

    w = w3_shared_prefix()
    prompts = [[t % VOCAB for t in p] for p in w.prompts]

    def share(path):
        llm = make_llm(path, max_model_len=2048, kv_cache_tokens=500_000)
        runner = llm.engine.runner

        def forward(batch):
            runner.req_pool.take_writes()
            tokens = torch.full((len(batch.sample_rows),), 5, dtype=torch.int64)
            return StepOutput(batch, tokens, tokens, None)

        runner.forward = forward
        return _cached_share(llm.generate(prompts, w.params))

    kv_only, hybrid = share(qwen3_path), share(qwen35_path)
    assert kv_only > 0.8  # the KV-only cache: every request after the first few of a system prompt hits
    assert hybrid >= kv_only - 0.1, (hybrid, kv_only)


def test_chunk_cut_at_a_branch_point_keeps_its_pages_without_taking_more(qwen35_path, make_llm):
    """A prompt admitted with a large chunk that HybridScheduler cuts at its branch point keeps the pages taken for
    the rest; when its next chunk is smaller (a step that also decodes gets mixed_prefill_tokens), the pages it
    needs are fewer than it holds. Before, `_pages_for` went negative there and PageAllocator.alloc(-16) handed it
    all but 16 free pages: one request held the whole KV pool. Found by tests/fuzz_engine.py."""
    import random

    rng = random.Random(5)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefix = toks(20)
    first, branching, short = prefix + toks(9), prefix + toks(20), toks(3)
    llm = make_llm(qwen35_path, dtype="float32", page_size=1, chunked_prefill_size=64, mixed_prefill_tokens=4)
    engine = llm.engine
    counts, held = [], []
    alloc = engine.allocator.alloc
    engine.allocator.alloc = lambda n: counts.append(n) or alloc(n)
    forward = engine.runner.forward

    def spy(batch):
        held.extend((len(r.pages), r.num_tokens) for r in batch.reqs)
        return forward(batch)

    engine.runner.forward = spy
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 10)]
    one = llm.generate([first], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert_parity(one, hf_greedy(qwen35_path, [first], 1), [first])
    # `branching` matches first's KV (20 tokens, no snapshot there): admitted with its whole prompt beside `short`,
    # cut at 20; then `short` decodes and `branching` goes on 4 tokens a step
    outs = llm.generate([branching, short], params)
    assert [o.token_ids for o in outs] == [r[:m.max_tokens] for r, m in
                                           zip(hf_greedy(qwen35_path, [branching, short]), params)]
    assert min(counts) >= 0, counts
    assert all(pages <= tokens + 1 for pages, tokens in held), max(held)  # page size 1: a page per token at most
    assert_all_pages_back(llm)


@pytest.mark.parametrize("staged", [False, True], ids=["copies", "staged"])
def test_decode_graphs_equal_eager(staged, qwen35_path, make_llm):
    """The hybrid's decode graphs (engine/hybrid.py) read each row's state slot too; staged (the engine switch
    graph_staged_inputs), the slots are a row of the block. On a CPU with replay stand-ins for the captures (as
    tests/test_cuda_graph.py): the eager engine's tokens, greedy and seeded sampling, each decode step one replay."""
    from helpers import capture_replay_graphs, capture_staged_replay_graphs, graph_runner_view

    from minisgl.engine.cuda_graph import default_batch_sizes
    from minisgl.engine.hybrid import StagedStateCudaGraphRunner, StateCudaGraphRunner

    prompts = SUBSET[:5]
    all_params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 0.9,
                                 top_k=-1 if i % 3 else 20) for i in range(len(prompts))]
    eager = [o.token_ids for o in make_llm(qwen35_path).generate(prompts, all_params)]
    llm = make_llm(qwen35_path)
    runner = llm.engine.runner
    base = StagedStateCudaGraphRunner if staged else StateCudaGraphRunner
    capture = capture_staged_replay_graphs if staged else capture_replay_graphs
    cls = type("CpuStateGraphs", (base,), {"_capture_all": capture})
    inputs = runner.runtime.graph_inputs(default_batch_sizes(8)[-1], runner.device, decode=True)
    graphs = runner.graph_runner = cls(graph_runner_view(runner), 8, inputs)
    assert [o.token_ids for o in llm.generate(prompts, all_params)] == eager
    assert sum(g.replays for g in graphs.graphs.values()) == llm.engine.stats["graph_steps"] > 0
    assert_all_pages_back(llm)
