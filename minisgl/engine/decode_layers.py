"""The decode-layers kernel in the engine (the kernel option `decode_megakernel`; kernels/decode_layers.py).

A model's decoder layers are a list its forward walks (`for layer in self.layers`, models/decoder.py). The
model runner puts one `DecodeLayers` in place of that list: a one-row decode step (a batch-1 decode graph, or an
eager one) runs every layer in the kernel's one launch; any other step (a prefill, a mixed step, several decode
rows) runs the layers one by one as before. The layers' weights were stacked when the model was loaded
(`LayerStack.of`, before the KV pool took the free memory), their parameters becoming views of the stacks, so
both paths read the same memory.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernels.decode_layers import DecodeLayersKernel, DecodeStep, LayerStack
from minisgl.kernels.gemv import GemvNormLayer, gemv_config, table_for
from minisgl.kernels.options import current_options
from minisgl.models.decoder import DecoderLayer, DecoderLM

__all__ = ["DecodeLayers", "decode_layers_unfit", "use_decode_layers"]

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None


def decode_layers_unfit(model: nn.Module) -> str | None:
    """Why the kernel cannot run this model's layers; None when it can."""
    if triton is None:
        return "Triton is not installed"
    if not isinstance(model, DecoderLM) or not all(isinstance(m, (DecoderLayer, GemvNormLayer)) for m in model.layers):
        return "it runs the dense decoder's layers only (models/decoder.py)"
    first = model.layers[0]
    a, mlp = first.self_attn, first.mlp
    if getattr(a, "q_norm", None) is None:
        return "its attention has no per-head q/k norms (Qwen3's)"
    if a.qkv_proj.bias is not None or a.o_proj.bias is not None or getattr(mlp.gate_up_proj, "bias", None) is not None:
        return "its projections have biases"
    d = a.head_dim
    if d & (d - 1) or model.rotary.cos_sin.shape[-1] != d or model.rotary.cos_sin.dtype != torch.float32:
        return "its rotary is not a whole-head rotary of a power-of-2 head dim"
    if len({p.dtype for p in model.layers.parameters()}) != 1:
        return "its weights do not share one dtype"
    return None


class DecodeLayers(nn.Module):
    """Stands in for a model's list of decoder layers (DecoderLM.forward runs `for layer in self.layers`): a
    one-row decode step through the decode-layers kernel, any other step through the layers one by one. Holds the
    layers under `layers`, their weights stacked (`LayerStack.of`, which made the layers' parameters views of the
    stacks), and the attention backend whose metadata and KV pool a step reads."""

    def __init__(self, layers: nn.ModuleList, stack: LayerStack, backend, tiles: dict) -> None:
        super().__init__()
        self.layers = layers
        self.stack = stack
        self.backend = backend  # not a module: held as a plain attribute
        self.tiles = tiles
        self.kernel: DecodeLayersKernel | None = None  # built on the first one-row decode step (outside a capture)

    def _step_inputs(self, positions: torch.Tensor, cos_sin: torch.Tensor) -> DecodeStep:
        b, meta = self.backend, self.backend.meta
        return DecodeStep(k_buffers=list(b.kv_cache.k_buffers), v_buffers=list(b.kv_cache.v_buffers),
                          req_to_token=b.req_to_token, req_pool_indices=meta.req_pool_indices,
                          seq_lens=meta.seq_lens, out_cache_loc=meta.out_cache_loc, positions=positions,
                          cos_sin=cos_sin, scale=b.scale, num_splits=b.num_splits_for(1))

    def forward(self, x, residual, positions, rotary, attn):
        meta = getattr(attn, "meta", None)
        if (residual is not None or x.dim() != 2 or x.shape[0] != 1 or meta is None or not meta.is_decode
                or attn is not self.backend):
            for layer in self.layers:
                x, residual = layer(x, residual, positions, rotary, attn)
            return x, residual
        step = self._step_inputs(positions, rotary.cos_sin)
        if self.kernel is None:
            regs = current_options().decode_megakernel_regs  # the engine's options are in force in its steps
            self.kernel = DecodeLayersKernel(self.stack, step, self.tiles, maxnreg=regs or None)
        else:  # this step's tensors: a captured graph's static buffers, or an eager step's own
            self.kernel.step = step
        h, residual = self.kernel.run(x)
        return h[None], residual[None]


def use_decode_layers(model: nn.Module, stack: LayerStack, backend) -> str | None:
    """Put a DecodeLayers in place of the model's layer list (the kernel option `decode_megakernel`; `stack` is
    `LayerStack.of(model.layers)`, taken before the KV pool was sized); returns why it cannot (the model keeps its
    layers), or None once done. The GEMV tiles are those the GEMV swap resolved (kernels/gemv.py), else the GEMV's
    rule for the card."""
    # what the kernel reads from its backend: the Triton backend's split count, token table and pool
    if not all(hasattr(backend, n) for n in ("num_splits_for", "req_to_token", "kv_cache", "scale")):
        return "it needs the Triton attention backend"
    if backend.kv_cache.k_buffers[0].dtype != stack.qkv.dtype:
        return "the KV cache's dtype is not the weights'"
    first = model.layers[0]
    mods = {"qkv": first.self_attn.qkv_proj, "o": first.self_attn.o_proj, "gate_up": first.mlp.gate_up_proj,
            "down": first.mlp.down_proj}
    table = table_for(stack.qkv.device)
    tiles = {k: tuple(getattr(m, "tiles", None) or gemv_config(*m.weight.shape, table)) for k, m in mods.items()}
    model.layers = nn.ModuleList([DecodeLayers(model.layers, stack, backend, tiles)])
    return None
