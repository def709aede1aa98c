"""Shared test helpers: tiny Hugging Face checkpoints, HF greedy references, and the page-accounting check.

Everything here runs on a CPU in fp32 with models of hidden size 64, two layers and a 512-token vocabulary,
so an engine run over a 20-prompt batch takes well under a second on one thread.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch

VOCAB = 512
MAX_NEW = 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trained tiny model with a real tokenizer (MINISGL_TINY_QWEN3 points the tests at another copy)
TINY_QWEN3_ASSET = os.environ.get("MINISGL_TINY_QWEN3", os.path.join(REPO, "assets", "tiny-qwen3"))

# transformers 5 keeps rope settings in `rope_parameters`. original_max_position_embeddings=64 with
# head_dim=16 puts some frequencies in each of the three llama3 bands (kept, blended, slowed by `factor`),
# and prompts + outputs run past position 64, so a wrong scaling changes the tokens.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_hf_config(arch: str, *, tie: bool | None = None, init_range: float = 0.15, eos_token_id=2,
                   max_position_embeddings: int = 512):
    """A tiny random config of `arch` (qwen3 | llama | qwen2)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                  initializer_range=init_range, eos_token_id=eos_token_id, bos_token_id=1)
    if arch == "qwen3":
        cfg = Qwen3Config(head_dim=16, tie_word_embeddings=True if tie is None else tie, **common)
    elif arch == "llama":
        common["max_position_embeddings"] = max(max_position_embeddings, 1024)
        cfg = LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=bool(tie), **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(tie_word_embeddings=bool(tie), **common)
    else:
        raise ValueError(arch)
    return cfg


def build_tiny_model(arch: str, path: str, *, tie: bool | None = None, seed: int = 0, init_range: float = 0.15,
                     max_shard_size: str | None = None, eos_token_id=2) -> str:
    """Build a random tiny model with transformers and `save_pretrained` it (safetensors) into `path`."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, tie=tie, init_range=init_range, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                # HF initialises biases to zero; a zero bias would let a loader that drops them pass.
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                # Non-trivial norm weights catch a norm applied to the wrong tensor (e.g. q_norm vs k_norm).
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return path


def save_word_tokenizer(path: str, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer: token i <-> the word `w{i}`, words joined by spaces when decoding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)


def copy_model(src: str, dst: str, generation_config: dict | None = None) -> str:
    shutil.copytree(src, dst)
    if generation_config is not None:
        with open(os.path.join(dst, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
    return dst


# Model folders broken the ways a download or a careless edit breaks them (issue 28), each with the words the
# error must contain: config.json cut short, empty, not UTF-8, of another architecture, without a size; the
# weights cut short, empty, random bytes, or absent.
BROKEN_MODELS = {
    "config_truncated": "is not valid JSON", "config_empty": "config.json is empty",
    "config_not_utf8": "is not UTF-8 text", "config_unknown_architecture": "unsupported architecture",
    "config_without_layers": "lacks num_hidden_layers", "weights_truncated": "is not a readable safetensors file",
    "weights_empty": "is not a readable safetensors file", "weights_random": "is not a readable safetensors file",
    "weights_missing": "no .safetensors weights",
}


def make_broken_model(src: str, dst: str, kind: str) -> str:
    """A copy of the model folder `src` in `dst`, broken as BROKEN_MODELS[kind] describes."""
    copy_model(src, dst)
    config, weights = os.path.join(dst, "config.json"), os.path.join(dst, "model.safetensors")
    with open(config, "rb") as f:
        raw = f.read()
    data = json.loads(raw)
    edits = {
        "config_truncated": lambda: raw[:len(raw) // 2], "config_empty": lambda: b"",
        "config_not_utf8": lambda: raw.replace(b'"qwen3"', b'"qwen3\xff\xfe"'),
        "config_unknown_architecture": lambda: json.dumps(
            {**data, "architectures": ["MambaForCausalLM"], "model_type": "mamba"}).encode(),
        "config_without_layers": lambda: json.dumps({k: v for k, v in data.items()
                                                     if k != "num_hidden_layers"}).encode(),
    }
    if kind in edits:
        with open(config, "wb") as f:
            f.write(edits[kind]())
    elif kind == "weights_missing":
        os.remove(weights)
    else:
        with open(weights, "rb") as f:
            blob = f.read()
        new = {"weights_truncated": blob[:len(blob) // 2], "weights_empty": b"",
               "weights_random": random.Random(0).randbytes(4096)}[kind]
        with open(weights, "wb") as f:
            f.write(new)
    return dst


def make_prompts(seed: int = 0) -> list[list[int]]:
    """20 prompts of 1..60 tokens: independent ones, groups sharing a prefix, an exact duplicate, and a
    prompt that is a prefix of another (the radix cache's edge cases)."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prompts = [toks(1), toks(60), toks(2), toks(17), toks(33), toks(5), toks(48), toks(11)]
    for prefix_len in (9, 24, 37):
        prefix = toks(prefix_len)
        for suffix_len in (0, 1, 6, 20):
            prompts.append(prefix + toks(suffix_len))
    prompts.append(list(prompts[4]))  # an exact duplicate
    prompts.append(prompts[1][:40])  # a prefix of another prompt
    assert len(prompts) == 22 and all(1 <= len(p) <= 60 for p in prompts)
    return prompts


PROMPTS = make_prompts()

_hf_models: dict[str, object] = {}
_hf_refs: dict[tuple, list[int]] = {}


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    if path not in _hf_models:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
        model.generation_config.pad_token_id = 0
        _hf_models[path] = model
    return _hf_models[path]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    """HF `generate(do_sample=False)` per prompt, unpadded. The mask is explicit: without one, transformers infers
    it from pad_token_id and would mask a prompt's own id-0 tokens."""
    model = hf_model(path)
    outs = []
    for p in prompts:
        key = (path, tuple(p), max_new_tokens)
        if key not in _hf_refs:
            with torch.no_grad():
                ids = torch.tensor([p])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)
            new = out[0, len(p):].tolist()
            assert len(new) == max_new_tokens
            _hf_refs[key] = new
        outs.append(_hf_refs[key])
    return outs


def hf_next_logits(path: str, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0, -1].float()


def assert_parity(outs, refs, prompts) -> None:
    assert len(outs) == len(refs) == len(prompts)
    bad = []
    for i, (o, r, p) in enumerate(zip(outs, refs, prompts)):
        assert o.prompt_token_ids == list(p)
        if o.token_ids != r:
            k = next((j for j, (a, b) in enumerate(zip(o.token_ids, r)) if a != b), min(len(o.token_ids), len(r)))
            bad.append(f"prompt {i} (len {len(p)}): first mismatch at output {k}: "
                       f"engine {o.token_ids[k:k + 4]} vs HF {r[k:k + 4]}")
    assert not bad, "HF parity broken:\n" + "\n".join(bad)


def assert_all_pages_back(llm_or_engine) -> None:
    """Every KV page is free or held (unlocked) by the prefix cache, no request holds a row or sits in a queue,
    and the radix tree's own invariants hold."""
    from minisgl.kvcache import RadixCache

    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    sched, alloc, cache, pool = engine.scheduler, engine.allocator, engine.cache, engine.runner.req_pool
    assert not sched.running, f"{len(sched.running)} requests still running"
    assert not sched.waiting, f"{len(sched.waiting)} requests still waiting"
    assert engine._inflight is None, "a launched step was never resolved"
    assert pool.num_free == pool.max_reqs, f"{pool.max_reqs - pool.num_free} request rows leaked"
    assert len(set(pool._free_rows)) == len(pool._free_rows), "a request row was freed twice"
    assert alloc.num_free + cache.evictable_pages == alloc.capacity, (
        f"pages leaked: free {alloc.num_free} + evictable {cache.evictable_pages} != capacity {alloc.capacity}")
    free = list(alloc._free)
    assert len(set(free)) == len(free), "a page is on the free list twice"
    assert 0 not in free, "the reserved page 0 was handed to the free list"
    if isinstance(cache, RadixCache):
        cache.check()
        assert cache.evictable_pages == cache.cached_pages, "a cache node is still locked"
        cached = [pg for n in cache._nodes() for pg in n.pages]
        assert not set(cached) & set(free), "a page is both cached and free"
        assert set(cached) | set(free) == set(range(1, alloc.num_pages)), "a page is neither cached nor free"
    else:
        assert cache.cached_pages == 0 and alloc.num_free == alloc.capacity
    state = getattr(engine.runner, "state_pool", None)
    if state is not None:  # a hybrid model: a request's state slot is its row (checked above); snapshots
        held = getattr(cache, "snapshots", {})  # belong to cache nodes (HybridRadixCache.check: all in the tree)
        free = state._free_snapshots
        assert len(set(free)) == len(free), "a snapshot slot is on the free list twice"
        assert len(free) + len(held) == state.num_snapshots, (
            f"snapshot slots leaked: free {len(free)} + cached {len(held)} != {state.num_snapshots}")


def use_triton_interpreter(*kernel_modules: str) -> None:
    """Run Triton kernels on the CPU: call after setting TRITON_INTERPRET=1 and importing triton. Patches the
    interpreter for numpy >= 2.4 (it refuses int() on a 1-element array, which the interpreter uses for scalar
    tensors in `range(start, end)` loops with runtime bounds) and re-imports the named modules that another test
    may have imported, and so decorated, without the interpreter."""
    import importlib
    import sys

    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor
    if not getattr(original, "_minisgl_patched", False):
        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        patched._minisgl_patched = True
        interp._patch_lang_tensor = patched
    for name in kernel_modules:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def kernel_options(**changes):
    """A `with` block whose kernel launches run under the options in force with `changes` (KernelOptions fields);
    e.g. `kernel_options(triton_on_cpu=True)` sends CPU tensors through the Triton kernels (the interpreter)."""
    from dataclasses import replace

    from minisgl.kernels.options import current_options, use_options

    return use_options(replace(current_options(), **changes))


class ReplayGraph:
    """A stand-in for torch.cuda.CUDAGraph on a CPU (as in notebook 06): "capture" calls the step once and keeps
    its output tensor; `replay()` calls it again on the captured views of the static buffers and writes the result
    into that same tensor. Counts its replays."""

    def __init__(self, fn):
        self.fn = fn
        self.output = fn()
        self.replays = 0

    def replay(self):
        self.output.copy_(self.fn())
        self.replays += 1


class GraphHooks:
    """The torch attention backend plus the three CUDA Graph hooks (on a CPU they only point it at the meta)."""

    supports_cuda_graph = True

    def __init__(self, backend):
        self.backend = backend

    def init_cuda_graph_state(self, max_bs):
        pass

    def prepare_for_capture(self, meta):
        self.backend.prepare(meta)

    def prepare_for_replay(self, meta):
        self.backend.prepare(meta)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def capture_replay_graphs(graph_runner) -> None:
    """A decode graph runner's `_capture_all` on a CPU: a ReplayGraph per (batch size, sampler), like the GPU's."""
    from minisgl.engine.cuda_graph import SAMPLERS

    for bs in reversed(graph_runner.batch_sizes):
        graph_runner.attn.prepare_for_capture(graph_runner._meta(bs))
        ids, pos = graph_runner.input_ids[:bs], graph_runner.positions[:bs]
        for s in SAMPLERS:
            graph = ReplayGraph(lambda ids=ids, pos=pos, bs=bs, s=s: graph_runner._step(ids, pos, bs, s))
            graph_runner.graphs[bs, s], graph_runner.outputs[bs, s] = graph, graph.output


def capture_staged_replay_graphs(graph_runner) -> None:
    """The same for a staged runner (engine/staged_graph.py): its fixed buffers become the block's rows first, as
    its own `_capture_all` does on a GPU."""
    graph_runner._stage_buffers()
    capture_replay_graphs(graph_runner)


def graph_runner_view(runner):
    """What a decode graph runner reads of the model runner, with the attention backend behind GraphHooks."""
    from types import SimpleNamespace

    return SimpleNamespace(model=runner.model, attn=GraphHooks(runner.attn), device=runner.device,
                           max_model_len=runner.max_model_len, req_pool=runner.req_pool, config=runner.config)
