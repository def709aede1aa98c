"""Physical floors: the bytes a workload must move (or the FLOPs it must do) over the card's measured rate.

Weights come from the model's own config: transformers builds the model on the meta device (no memory) and we
count its parameters, so the figure holds for any architecture it knows. A decode step reads every weight once,
the LM head included; an untied embedding table is read only row by row, so it does not count. KV: two vectors
(K and V) per token per full-attention layer. A hybrid model (Qwen3.5) also reads and writes each request's
recurrent state (fp32) and convolution state every step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lab.models import model_path, text_config
from minisgl.bench.workloads import w1_offline, w2_latency

BF16 = 2


@dataclass(frozen=True)
class Shape:
    weight_bytes: int  # read once per decode step
    params_matmul: int  # parameters in matmuls per token (prefill FLOPs = 2 x this x tokens)
    kv_bytes_per_token: int
    state_bytes_per_request: int  # read and written once per step


@functools.cache
def shape(name: str) -> Shape:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(model_path(name))
    hf = getattr(hf, "text_config", hf)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    params = dict(net.named_parameters())
    total = sum(p.numel() for p in params.values())
    embed = sum(p.numel() for n, p in params.items() if "embed_tokens" in n)
    tied = getattr(hf, "tie_word_embeddings", False)
    read = total if tied else total - embed
    c = text_config(name)
    kinds = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    full = sum(k == "full_attention" for k in kinds)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv = full * 2 * c["num_key_value_heads"] * head_dim * BF16
    state = 0
    if "linear_attention" in kinds:
        from minisgl.kvcache.state_pool import StatePool
        conv = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + c["linear_num_value_heads"] * c[
            "linear_value_head_dim"]
        state = StatePool.bytes_per_slot(len(kinds) - full, conv, c["linear_conv_kernel_dim"],
                                         c["linear_num_value_heads"], c["linear_key_head_dim"],
                                         c["linear_value_head_dim"], torch.bfloat16)
    return Shape(read * BF16, total - embed, kv, state)


def w2_tpot_floor_ms(name: str, bandwidth: float) -> float:
    """One W2 request's decode step: every weight, the request's KV at its mean context, its state (twice)."""
    s, w = shape(name), w2_latency()
    ctx = len(w.prompts[0]) + w.params[0].max_tokens // 2
    return 1e3 * (s.weight_bytes + ctx * s.kv_bytes_per_token + 2 * s.state_bytes_per_request) / bandwidth


def w2_ttft_floor_ms(name: str, bandwidth: float, flops: float) -> float:
    """A 512-token prefill: the weights read once, or its matmul FLOPs at the measured bf16 rate, the larger."""
    s, w = shape(name), w2_latency()
    return 1e3 * max(s.weight_bytes / bandwidth, 2 * s.params_matmul * len(w.prompts[0]) / flops)


def w1_floor_tok_per_s(name: str, bandwidth: float) -> float:
    """W1 cannot finish faster than its decode steps reading, each, the weights once and every running request's KV
    (and state): all requests at once, so a step per output position of the longest request."""
    s, w = shape(name), w1_offline()
    kv = sum(sum(len(p) + t for t in range(sp.max_tokens)) for p, sp in zip(w.prompts, w.params))
    state = sum(sp.max_tokens for sp in w.params) * 2 * s.state_bytes_per_request
    steps = max(sp.max_tokens for sp in w.params)
    seconds = (kv * s.kv_bytes_per_token + state + steps * s.weight_bytes) / bandwidth
    return w.total_output_tokens / seconds
