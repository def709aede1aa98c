"""Qwen3.5 (dense): Qwen3-Next's hybrid decoder, and its loader.

Three layers in four mix tokens with a Gated DeltaNet, a linear attention whose per-request state has a fixed
size (a conv window and a [Dk, Dv] matrix per value head, held in `minisgl.kvcache.state_pool`); every fourth is
a full attention with an output gate over the paged KV pool. The other differences from Qwen3:

- every RMSNorm but the gated one is zero-centred: it scales by (1 + w), in fp32 at run time (w is stored as
  it is in the checkpoint, so a bf16 model rounds nothing more than Hugging Face's does);
- the full attention's q_proj also produces a per-head gate, and sigmoid(gate) scales the attention output;
- RoPE turns only the first quarter of each head (`partial_rotary_factor`). The checkpoint's mrope sections
  matter for images only: with text positions (the same in all three sections) mrope is plain rope.

Semantics follow transformers' `modeling_qwen3_5.py`; the tests check greedy tokens against it.

On a GPU every step runs few kernels (each costs the GPU ~2-3 us even inside a CUDA graph): the Gated
DeltaNet's four in-projections are one GEMM (qkv | z | b | a), the attention's q/k/v one GEMM; the norms are
the engine's Triton RMSNorm kernels with a (1 + w) scale, the residual add fused into them as in DecoderLM; the
gated norm times silu(z), the decay/beta gates (`gdn.gdn_gating`), the q/k norms with the partial RoPE and the
sigmoid output gate are one Triton launch each; the conv and the delta rule are `minisgl.kernels.gdn`'s. On a
CPU each of these runs its torch reference (the semantics).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from minisgl.attention.base import AttentionBackend
from minisgl.checkpoint import checkpoint_files
from minisgl.kernels import elementwise as ew
from minisgl.kernels import gdn
from minisgl.models.config import ModelConfig
from minisgl.models.family import ModelFamily
from minisgl.models.layers import MLP, RotaryEmbedding

MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Qwen35Config(ModelConfig):
    layer_types: tuple[str, ...] = ()  # "linear_attention" | "full_attention", per layer
    rotary_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: q, k and v of the linear attention, side by side."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def from_hf(cls, hf, eos_token_ids: tuple[int, ...] = ()) -> Qwen35Config:
        if getattr(hf, "model_type", "") in MOE_MODEL_TYPES:
            raise ValueError("Qwen3.5 MoE (qwen3_5_moe) is not supported: minisgl runs the dense Qwen3.5 only")
        text = getattr(hf, "text_config", None) or hf  # the multimodal wrapper keeps the decoder's settings here
        rope = dict(getattr(text, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3.5 rope type {rope['rope_type']!r} is not supported (default)")
        head_dim = text.head_dim
        if eos_token_ids == ():
            eos = getattr(text, "eos_token_id", None)
            eos_token_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        layer_types = tuple(text.layer_types)
        if set(layer_types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"unknown Qwen3.5 layer types {sorted(set(layer_types))}")
        return cls(
            arch="qwen3_5", vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size, num_layers=text.num_hidden_layers,
            num_q_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads, head_dim=head_dim,
            rms_norm_eps=text.rms_norm_eps, rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=None,
            max_position_embeddings=text.max_position_embeddings,
            # the wrapper's flag wins: it is the one transformers ties the LM head by
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False))),
            qkv_bias=bool(getattr(text, "attention_bias", False)), qk_norm=True,
            eos_token_ids=tuple(int(e) for e in eos_token_ids),
            layer_types=layer_types,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
            linear_num_key_heads=text.linear_num_key_heads, linear_num_value_heads=text.linear_num_value_heads,
            linear_key_head_dim=text.linear_key_head_dim, linear_value_head_dim=text.linear_value_head_dim,
            linear_conv_kernel=text.linear_conv_kernel_dim,
        )


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm that scales by (1 + w), all in fp32, cast back at the end (HF's Qwen3_5RMSNorm). With a residual,
    like the engine's RMSNorm: (norm(x + residual), x + residual), the sum rounded to the model dtype first (HF
    adds the residual in the model dtype)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ew.rms_norm(x, self.weight, self.eps, zero_centred=True)
        return ew.fused_add_rms_norm(x, residual, self.weight, self.eps, zero_centred=True)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm with a plain weight, then times silu(z): the Gated DeltaNet's output norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ew.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear attention with a gated delta rule. Its state lives in the pool at (state_layer, the request's slot)."""

    def __init__(self, cfg: Qwen35Config, state_layer: int) -> None:
        super().__init__()
        self.state_layer = state_layer
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_size, self.value_size = self.hk * self.dk, self.hv * self.dv
        channels = cfg.conv_channels
        # the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, fused into one matmul (rows in order)
        self.in_proj_sizes = [channels, self.value_size, self.hv, self.hv]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.in_proj_sizes), bias=False)
        # depthwise: one K-tap filter per channel, stored [C, 1, K] as in the checkpoint
        self.conv1d = nn.Conv1d(channels, channels, cfg.linear_conv_kernel, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, attn: AttentionBackend, state) -> torch.Tensor:
        t = x.shape[0]
        slots, cu_seqlens = attn.meta.state_slots, attn.meta.cu_seqlens
        # column slices of the fused projection: the kernels take their token stride, nothing is copied
        mixed, z, b, a = self.in_proj(x).split(self.in_proj_sizes, dim=-1)
        qkv = gdn.causal_conv1d(mixed, self.conv1d.weight[:, 0], None, state.conv[self.state_layer],
                                slots, cu_seqlens)
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        # decay g = -exp(A_log) * softplus(a + dt_bias) in fp32, beta = sigmoid(b) in the model dtype
        g, beta = gdn.gdn_gating(a, b, self.A_log, self.dt_bias)
        # the op L2-normalises q and k and scales q by Dk^-0.5 itself
        o = gdn.gated_delta_rule(q.view(t, self.hk, self.dk), k.view(t, self.hk, self.dk),
                                 v.view(t, self.hv, self.dv), g, beta, state.recurrent[self.state_layer],
                                 slots, cu_seqlens)
        o = self.norm(o, z.view(t, self.hv, self.dv))
        return self.out_proj(o.reshape(t, self.value_size))


class GatedAttention(nn.Module):
    """Full attention over the paged KV pool (at its own index `kv_layer`), with a sigmoid gate on the output."""

    def __init__(self, cfg: Qwen35Config, kv_layer: int) -> None:
        super().__init__()
        self.kv_layer = kv_layer
        self.num_q_heads, self.num_kv_heads, self.head_dim = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_q_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        # the checkpoint's q_proj, k_proj and v_proj fused into one matmul; per head, q_proj's part of the output
        # is [q (head_dim) | gate (head_dim)]
        self.qkv_sizes = [2 * self.q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.qkv_bias)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                attn: AttentionBackend) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        q_gate = q_gate.view(t, self.num_q_heads, 2 * d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        # zero-centred q/k norms, then rope over the table's rotary_dim (the rest of each head is not turned), in
        # one launch on a GPU: q goes to a packed tensor (the attention kernels want one), k is turned in place
        q = torch.empty(t, self.num_q_heads, d, dtype=x.dtype, device=x.device)
        q, k = ew.norm_and_rope(q_gate[..., :d], k, positions, rotary.cos_sin, self.q_norm.weight,
                                self.k_norm.weight, self.q_norm.eps, zero_centred=True, q_out=q)
        o = attn.forward(q, k, v, self.kv_layer).reshape(t, self.q_size)
        return self.o_proj(ew.sigmoid_mul(o, q_gate[..., d:]))


class HybridLayer(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer_id: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.linear_attention_layers.index(layer_id))
        else:
            self.self_attn = GatedAttention(cfg, cfg.full_attention_layers.index(layer_id))
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, stream, positions, rotary, attn, state):
        # `x` is the previous layer's MLP output, not yet added to the residual `stream` (None before the first
        # layer): each norm adds it in front of itself, the sum rounded to the model dtype as HF's add rounds it.
        if stream is None:
            stream, normed = x, self.input_layernorm(x)
        else:
            normed, stream = self.input_layernorm(x, stream)
        if self.is_linear:
            mixed = self.linear_attn(normed, attn, state)
        else:
            mixed = self.self_attn(normed, positions, rotary, attn)
        normed, stream = self.post_attention_layernorm(mixed, stream)
        return self.mlp(normed), stream


class Qwen35LM(nn.Module):
    """Same interface as DecoderLM; `state_pool` (a StatePool) is set by the model runner before the first step."""

    def __init__(self, cfg: Qwen35Config, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.state_pool = None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.rotary_dim, max_positions or cfg.max_position_embeddings,
                                      cfg.rope_theta, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                logit_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in the model's dtype, as DecoderLM's: the sampler widens them to float32 itself."""
        x = self.embed_tokens(input_ids)
        stream = None
        for layer in self.layers:
            x, stream = layer(x, stream, positions, self.rotary, attn, self.state_pool)
        x, _ = self.norm(x, stream)
        if logit_indices is not None:
            x = x[logit_indices]
        return self.lm_head(x)


# --- loading ---------------------------------------------------------------------------------------------
# Our fused matmuls, by the checkpoint's module name: (our module, which part). A part's rows in the fused weight
# (and bias) follow the module's list of part sizes.
_FUSED = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "in_proj_qkv": ("in_proj", 0), "in_proj_z": ("in_proj", 1), "in_proj_b": ("in_proj", 2),
    "in_proj_a": ("in_proj", 3),
}


def _part_sizes(owner: nn.Module, fused: str) -> list[int]:
    if fused == "gate_up_proj":
        half = owner.gate_up_proj.weight.shape[0] // 2
        return [half, half]
    return owner.qkv_sizes if fused == "qkv_proj" else owner.in_proj_sizes


def _our_name(hf_name: str) -> str | None:
    """The parameter a checkpoint tensor goes to, or None for tensors we do not run (vision tower, MTP head)."""
    if hf_name.startswith(("model.visual.", "mtp.", "visual.")) or "rotary_emb" in hf_name:
        return None
    for prefix in ("model.language_model.", "model."):  # multimodal wrapper, text-only class
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    return hf_name  # lm_head.weight


def load_safetensors(model: Qwen35LM, cfg: Qwen35Config, path: str) -> None:
    files = checkpoint_files(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = cfg.tie_word_embeddings
    loaded: set[str] = set()
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = _our_name(hf_name)
                if name is None or (tied and name == "lm_head.weight"):
                    continue
                module, leaf = name.rsplit(".", 1)
                parent, _, child = module.rpartition(".")
                if child in _FUSED and f"{parent}.{_FUSED[child][0]}.{leaf}" in params:
                    fused, part = _FUSED[child]
                    sizes = _part_sizes(model.get_submodule(parent), fused)
                    full = params[f"{parent}.{fused}.{leaf}"].data
                    target = full.narrow(0, sum(sizes[:part]), sizes[part])
                    key = f"{parent}.{fused}.{leaf}#{part}"
                elif name in params:
                    target, key = params[name].data, name
                else:
                    raise KeyError(f"checkpoint tensor {hf_name} has no place in the Qwen3.5 model")
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(key)
    missing = []
    for name, _ in model.named_parameters():
        module, _, _ = name.rpartition(".")
        parent, _, child = module.rpartition(".")
        fused = {f for f, _ in _FUSED.values()}
        keys = ([f"{name}#{i}" for i in range(len(_part_sizes(model.get_submodule(parent), child)))]
                if child in fused else [name])
        missing += [k for k in keys if k not in loaded]
    if missing:
        raise ValueError(f"checkpoint in {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


@torch.no_grad()
def init_dummy(model: Qwen35LM, seed: int) -> None:
    """Seeded random weights, with HF's initialisation of the decay parameters: A = U(0.01, 16), dt_bias = 1,
    so exp(A_log) * softplus(...) and the recurrent state stay finite in bf16."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(0.01, 16, generator=gen).log())
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)  # the gated norm's weight is plain
        elif "norm" in name:
            p.zero_()  # zero-centred: (1 + 0) = identity scale
        elif p.ndim == 1:
            p.zero_()
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        else:
            std = 0.02 if "embed" in name else 1.0 / max(p.shape[1], 1) ** 0.5
            p.normal_(0.0, std, generator=gen)


# the registry's entry (models/registry.py): per-request linear-attention state beside the KV pool (engine/hybrid.py)
FAMILY = ModelFamily("qwen3_5", Qwen35Config, Qwen35LM, init_dummy, load_safetensors, runtime="linear_state")
