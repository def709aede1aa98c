# generated from notebooks/01_model.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/01_model.ipynb, cell 5 (id c01-005) ---
"""One decoder-only transformer that covers Llama-3, Qwen2 and Qwen3.

The three differ in two switches: Qwen2 has a bias on q/k/v, Qwen3 normalises q and k per head
before the rotary embedding. Llama-3's rope scaling lives in the rotary table (layers.py).

The forward runs over a flat batch: T tokens from any number of requests, each with its position.
Which token belongs to which request, and where its K/V live, is the attention backend's business.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import AttentionBackend
from minisgl.models.config import ModelConfig
from minisgl.models.layers import MLP, RMSNorm, RotaryEmbedding


# --- notebooks/01_model.ipynb, cell 23 (id c01-022) ---
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_q_heads, self.num_kv_heads, self.head_dim = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_q_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # q, k and v fused into one matmul
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Views into the qkv output, not copies: the norm, rope and attention kernels all take a token stride.
        q = q.view(t, self.num_q_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = rotary(q, k, positions, self.q_norm, self.k_norm)  # Qwen3's q/k norms run inside, first
        o = attn.forward(q, k, v, self.layer_id)
        return self.o_proj(o.reshape(t, self.q_size))


# --- notebooks/01_model.ipynb, cell 24 (id c01-023) ---
class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, residual, positions, rotary, attn):
        # The residual stream is carried separately so each norm can fuse the add in front of it.
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, attn)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


# --- notebooks/01_model.ipynb, cell 26 (id c01-025) ---
class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[len(logit_indices), vocab]` for the chosen token rows (all when None), in the model's dtype:
        the sampler widens them to float32 itself, so a bf16 model hands it half the bytes to read."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary, attn)
        # residual None: the layers handed back the whole stream (kernels/gemv.py folds the adds that way)
        x = self.norm(x) if residual is None else self.norm(x, residual)[0]
        if logit_indices is not None:
            x = x[logit_indices]  # only the last token of each request needs the costly LM head
        return self.lm_head(x)
