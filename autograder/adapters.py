"""Adapters: the one place that knows where each exercise lives in the student's package.

The graders in `autograder/graders/` call only these functions, never `minisgl` directly, so a course that
moves a function changes one line here (CS336 style). `EXERCISES` maps each nbgrader exercise (the
`grade_id` of its solution cell) to the object the student writes; `tests/test_course.py` checks that every
exercise of an export cell is listed and that every listed name exists.
"""

from __future__ import annotations

import importlib

# grade_id of the solution cell -> "module:qualified.name" of what the student writes in the package.
# Notebook-only exercises (no package object) are graded in the notebook only and are not listed here.
EXERCISES: dict[str, list[str]] = {
    "nb01-rope": ["minisgl.models.layers:rope_inv_freq"],
    "nb01-attention": ["minisgl.models.decoder:Attention.forward"],
    "nb01-layer": ["minisgl.models.decoder:DecoderLayer.forward"],
    "nb01-slice": ["minisgl.loader:_fused_slice"],
    "nb02-bytes": ["minisgl.kvcache.pool:KVCache.bytes_per_token"],
    "nb02-alloc": ["minisgl.kvcache.pool:PageAllocator.alloc", "minisgl.kvcache.pool:PageAllocator.free"],
    "nb02-table": ["minisgl.kvcache.pool:ReqToTokenPool.write"],
    "nb03-torch": ["minisgl.attention.torch_backend:TorchAttentionBackend.forward"],
    "nb04-radix": ["minisgl.kvcache.radix_cache:RadixCache._walk", "minisgl.kvcache.radix_cache:RadixCache.insert",
                   "minisgl.kvcache.radix_cache:RadixCache.lock", "minisgl.kvcache.radix_cache:RadixCache.unlock",
                   "minisgl.kvcache.radix_cache:RadixCache.evict"],
    "nb05-req": ["minisgl.scheduler.req:Req.ids_between"],
    "nb05-topkp": ["minisgl.engine.sampler:apply_top_k_top_p"],
    "nb05-sample": ["minisgl.engine.sampler:sample"],
    "nb05-pages": ["minisgl.scheduler.scheduler:SchedulerPages._pages_for"],
    "nb05-retract": ["minisgl.scheduler.scheduler:SchedulerQueue._retract"],
    "nb05-prefill": ["minisgl.scheduler.scheduler:SchedulerAdmission._prefill_len"],
    "nb05-scheduler": ["minisgl.scheduler.scheduler:Scheduler.schedule"],
    "nb06-sizes": ["minisgl.engine.cuda_graph:default_batch_sizes"],
    "nb06-size-for": ["minisgl.engine.cuda_graph:padded_size"],
    "nb06-padding": ["minisgl.engine.cuda_graph:fill_padding"],
    "nb06-runner": ["minisgl.engine.cuda_graph:CudaGraphRunner.run"],
    "nb07-engine": ["minisgl.engine.engine:Engine.step", "minisgl.engine.engine:Engine._resolve",
                    "minisgl.engine.engine:Engine._finish_reason"],
    "nb10-delta": ["minisgl.kernels.gdn_ref:gated_delta_rule_ref"],
    "nb10-conv": ["minisgl.kernels.gdn_ref:causal_conv1d_ref"],
    "nb10-pool": ["minisgl.kvcache.state_pool:StatePool.bytes_per_slot",
                  "minisgl.kvcache.state_pool:StatePool.alloc_snapshot",
                  "minisgl.kvcache.state_pool:StatePool.free_snapshot",
                  "minisgl.kvcache.state_pool:StatePool.start", "minisgl.kvcache.state_pool:StatePool.save"],
    "nb11-collect": ["minisgl.server.step_outputs:collect_outputs"],
    "nb11-fanout": ["minisgl.server.step_outputs:fan_out"],
    "nb12-penalties": ["minisgl.engine.logits_processing:apply_penalties"],
    "nb12-entries": ["minisgl.engine.logits_processing:penalty_row_entries"],
    "nb12-logprobs": ["minisgl.engine.logits_processing:token_logprobs"],
}


def resolve(target: str):
    """'pkg.module:Class.attr' -> the object."""
    module, _, qual = target.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


# --- 01 model -----------------------------------------------------------------------------------------------

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None):
    from minisgl.models.layers import rope_inv_freq as f

    return f(head_dim, theta, scaling)


def fused_slice(param, model_config, fused: str, part: int):
    from minisgl.loader import _fused_slice

    return _fused_slice(param, model_config, fused, part)


def model_config_from_hf(hf_config):
    from minisgl.models.config import ModelConfig

    return ModelConfig.from_hf(hf_config)


def load_model(path: str, dtype=None, device: str = "cpu", load_format: str = "auto"):
    """-> (model, ModelConfig) loaded by the student's loader."""
    import torch

    from minisgl.loader import load_model as f

    loaded = f(path, dtype or torch.float32, torch.device(device), load_format=load_format)
    return loaded.model, loaded.config


def model_forward(model, input_ids, positions, attn, logit_indices=None):
    return model(input_ids, positions, attn, logit_indices)


# --- 02 KV pool ---------------------------------------------------------------------------------------------

def kv_cache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device="cpu"):
    from minisgl.kvcache.pool import KVCache

    return KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)


def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype) -> int:
    from minisgl.kvcache.pool import KVCache

    return KVCache.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def page_allocator(num_pages: int):
    from minisgl.kvcache.pool import PageAllocator

    return PageAllocator(num_pages)


def req_to_token_pool(max_reqs: int, max_context_len: int, device: str = "cpu"):
    from minisgl.kvcache.pool import ReqToTokenPool

    return ReqToTokenPool(max_reqs, max_context_len, device)


# --- 03 attention -------------------------------------------------------------------------------------------

def attention_metadata(**fields):
    from minisgl.attention.base import AttentionMetadata

    return AttentionMetadata(**fields)


def torch_attention_backend(kv_cache, req_to_token, num_q_heads, num_kv_heads, head_dim, scale):
    from minisgl.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_cache, req_to_token, num_q_heads, num_kv_heads, head_dim, scale)


# --- 04 radix cache -----------------------------------------------------------------------------------------

def radix_cache(allocator, page_size: int):
    from minisgl.kvcache.radix_cache import RadixCache

    return RadixCache(allocator, page_size)


def naive_cache(allocator, page_size: int):
    from minisgl.kvcache.prefix_cache import NaiveCache

    return NaiveCache(allocator, page_size)


# --- 10 hybrid state ---------------------------------------------------------------------------------------

def gated_delta_rule_ref(q, k, v, g, beta, state, slots, cu_seqlens):
    from minisgl.kernels.gdn_ref import gated_delta_rule_ref as f

    return f(q, k, v, g, beta, state, slots, cu_seqlens)


def causal_conv1d_ref(x, weight, bias, conv_state, slots, cu_seqlens):
    from minisgl.kernels.gdn_ref import causal_conv1d_ref as f

    return f(x, weight, bias, conv_state, slots, cu_seqlens)


def state_pool(num_layers, num_rows, num_snapshots, conv_channels, conv_kernel, num_heads, key_dim, value_dim,
               dtype, device="cpu"):
    from minisgl.kvcache.state_pool import StatePool

    return StatePool(num_layers, num_rows, num_snapshots, conv_channels, conv_kernel, num_heads, key_dim,
                     value_dim, dtype, device)


def state_bytes_per_slot(num_layers, conv_channels, conv_kernel, num_heads, key_dim, value_dim, dtype) -> int:
    from minisgl.kvcache.state_pool import StatePool

    return StatePool.bytes_per_slot(num_layers, conv_channels, conv_kernel, num_heads, key_dim, value_dim, dtype)


# --- 11 serving ---------------------------------------------------------------------------------------------

def step_outputs(step: int):
    """An empty per-step message (StepOutputs) and the Finish class."""
    from minisgl.server.step_outputs import Finish, StepOutputs

    return StepOutputs(step), Finish


def collect_outputs(step: int, live: dict, sent: dict, per_token: tuple = ()):
    from minisgl.server.step_outputs import collect_outputs as f

    return f(step, live, sent, per_token)


def fan_out(msg, handles: dict) -> int:
    from minisgl.server.step_outputs import fan_out as f

    return f(msg, handles)


# --- the whole engine ---------------------------------------------------------------------------------------

def llm(model_path: str, **switches):
    from minisgl import LLM

    return LLM(model_path, **switches)


def greedy(max_tokens: int, **kw):
    from minisgl import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_workload(engine_llm, name: str, scale: float = 1.0) -> dict:
    from minisgl.bench.runner import run_workload as f

    return f(engine_llm, name, scale=scale)


# --- 12 API features -----------------------------------------------------------------------------------------

def apply_penalties(logits, rows, counts, frequency, presence, repetition):
    from minisgl.engine.logits_processing import apply_penalties as f

    return f(logits, rows, counts, frequency, presence, repetition)


def penalty_row_entries(prompt, outputs):
    from minisgl.engine.logits_processing import penalty_row_entries as f

    return f(prompt, outputs)


def token_logprobs(logits, tokens, top_n):
    from minisgl.engine.logits_processing import token_logprobs as f

    return f(logits, tokens, top_n)


def prompt_bit() -> int:
    from minisgl.engine.logits_processing import PROMPT_BIT

    return PROMPT_BIT
