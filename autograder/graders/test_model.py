"""Notebook 01: rotary frequencies and logits equal to transformers for Qwen3, Llama-3 and Qwen2."""

from __future__ import annotations

import adapters
import pytest
import torch
import torch.nn.functional as F


class DenseCausalAttention:
    """One sequence, all tokens at once: the attention a model needs when there is no KV cache."""

    def forward(self, q, k, v, layer_id):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, enable_gqa=True)
        return o.transpose(0, 1)


def hf_inv_freq(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else dict(scaling, rope_theta=theta)
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_parameters=params,
                      max_position_embeddings=1 << 20)
    return LlamaRotaryEmbedding(cfg).inv_freq


@pytest.mark.parametrize("head_dim,theta", [(16, 10000.0), (64, 1e6), (128, 500000.0)])
@pytest.mark.parametrize("scaled", [False, True])
def test_rope_inv_freq_matches_transformers(head_dim, theta, scaled):
    scaling = ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64 * head_dim} if scaled else None)
    got = adapters.rope_inv_freq(head_dim, theta, scaling)
    assert got.shape == (head_dim // 2,) and got.dtype == torch.float32
    torch.testing.assert_close(got, hf_inv_freq(head_dim, theta, scaling), rtol=1e-6, atol=0)


def test_fused_slice_is_a_view(coursekit):
    cfg = adapters.model_config_from_hf(coursekit.tiny_hf_config("qwen3"))
    qkv = torch.arange(128.0)[:, None].repeat(1, 2)
    parts = [adapters.fused_slice(qkv, cfg, "qkv_proj", i) for i in range(3)]
    assert [p.shape[0] for p in parts] == [64, 32, 32]
    assert [p[0, 0].item() for p in parts] == [0, 64, 96]
    parts[1].fill_(-1)
    assert (qkv[64:96] == -1).all()


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_logits_match_transformers(arch, tiny_paths):
    from transformers import AutoModelForCausalLM

    path = tiny_paths[arch]
    model, _ = adapters.load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = adapters.model_forward(model, ids, torch.arange(150), DenseCausalAttention())
        theirs = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
