"""Tensor parallelism, the maths: which slice of each weight a rank keeps, and where the ranks talk.

Megatron-style, two collectives per layer:

- qkv_proj (column parallel): a rank keeps the rows of its query heads and of their K/V heads, so its
  attention runs on whole heads with no communication. With fewer K/V heads than ranks, each K/V head is
  replicated on the ranks whose query heads read it.
- o_proj (row parallel): a rank keeps the input columns of its heads and computes a partial output;
  an all-reduce sums the partials. Same pair in the MLP: gate_up_proj split by output columns (gate and up
  alike), down_proj by input rows + one all-reduce.
- embed_tokens (vocab parallel): a rank holds a range of the vocabulary; ids outside it give zeros, an
  all-reduce sums the one non-zero row. lm_head: each rank computes the logits of its vocabulary range; an
  all-gather concatenates them, so every rank sees the full logits (and samples the same tokens).

The model code of notebook 01 is untouched: `shard_model` swaps modules and slices loaded weights in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minisgl.models.config import ModelConfig


@dataclass(frozen=True)
class HeadSplit:
    """A rank's share of the attention heads: query heads [q_start, q_start + num_q), K/V likewise."""

    num_q: int
    q_start: int
    num_kv: int
    kv_start: int


def check_tp_size(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError when `tp` ranks cannot split this model."""
    if tp < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp}")
    if cfg.num_q_heads % tp:
        raise ValueError(f"tp_size {tp} must divide the model's {cfg.num_q_heads} query heads")
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"tp_size {tp} and the model's {kv} K/V heads: one must divide the other "
                         "(K/V heads are split across ranks, or replicated when there are fewer than ranks)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tp_size {tp} must divide the MLP's intermediate size {cfg.intermediate_size}")


def check_tp_model(hf_config, tp: int) -> None:
    """Raise ValueError when `tp` ranks cannot run this checkpoint (its transformers config): only notebook 01's
    decoder is sharded (a family of models/registry.py, such as the hybrid Qwen3.5, is not yet), and it must
    split evenly (check_tp_size)."""
    from minisgl.models.registry import model_family
    family = model_family(hf_config)
    if family is not None:
        raise ValueError(f"tensor parallelism does not run {family.runtime} models (such as {family.name}) yet: "
                         f"use tp_size=1, not {tp}")
    check_tp_size(ModelConfig.from_hf(hf_config), tp)


def head_split(cfg: ModelConfig, rank: int, tp: int) -> HeadSplit:
    q = cfg.num_q_heads // tp
    if cfg.num_kv_heads >= tp:
        kv = cfg.num_kv_heads // tp
        return HeadSplit(q, rank * q, kv, rank * kv)
    # fewer K/V heads than ranks: tp / kv_heads consecutive ranks share (replicate) one K/V head
    return HeadSplit(q, rank * q, 1, rank // (tp // cfg.num_kv_heads))


def vocab_range(vocab: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(start, end, shard rows): every rank holds ceil(vocab / tp) rows, the last one zero-padded."""
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    return start, min(start + per, vocab), per


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T: the rank holds the input columns matching its slice of x."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, end: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.end = start, end

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)  # exact: one rank adds its row, the others add zeros
        dist.all_reduce(x)
        return x


class VocabParallelLMHead(nn.Module):
    def __init__(self, weight: nn.Parameter, vocab: int, tp: int) -> None:
        super().__init__()
        self.weight = weight  # may be the embedding's (tied) parameter
        self.vocab, self.tp = vocab, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight)  # [n, vocab shard]
        n, shard = part.shape
        if n == 0:  # a step of mid-prompt chunks only: no row needs logits, on any rank (they run the same batch)
            return part.new_empty((0, self.vocab))
        gathered = part.new_empty((self.tp * n, shard))  # rank r's block in rows r*n..(r+1)*n-1
        _all_gather(gathered, part.contiguous())
        return gathered.view(self.tp, n, shard).permute(1, 0, 2).reshape(n, self.tp * shard)[:, :self.vocab]


# torch >= 2.13 renames all_gather_into_tensor (the GPU machines run 2.11)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows(w: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in ranges], dim=0).contiguous()


def _vocab_shard(w: torch.Tensor, start: int, end: int, rows: int) -> torch.Tensor:
    shard = w.new_zeros((rows, w.shape[1]))
    shard[:end - start] = w[start:end]
    return shard


@torch.no_grad()
def shard_model(model: nn.Module, cfg: ModelConfig, rank: int, tp: int) -> HeadSplit:
    """Keep rank `rank`'s slice of a loaded DecoderLM (in place); returns its share of the heads."""
    check_tp_size(cfg, tp)
    split = head_split(cfg, rank, tp)
    hd, q_size, kv_size = cfg.head_dim, cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    q_rows = (split.q_start * hd, (split.q_start + split.num_q) * hd)
    kv_rows = (split.kv_start * hd, (split.kv_start + split.num_kv) * hd)
    qkv_ranges = [q_rows, (q_size + kv_rows[0], q_size + kv_rows[1]),
                  (q_size + kv_size + kv_rows[0], q_size + kv_size + kv_rows[1])]
    inter = cfg.intermediate_size // tp
    mlp_cols = (rank * inter, (rank + 1) * inter)
    for layer in model.layers:
        attn = layer.self_attn
        qkv = attn.qkv_proj
        qkv.weight = nn.Parameter(_rows(qkv.weight, qkv_ranges), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = nn.Parameter(_rows(qkv.bias, qkv_ranges), requires_grad=False)
        qkv.out_features = qkv.weight.shape[0]
        attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, q_rows[0]:q_rows[1]].contiguous())
        attn.num_q_heads, attn.num_kv_heads = split.num_q, split.num_kv
        attn.q_size, attn.kv_size = split.num_q * hd, split.num_kv * hd
        mlp = layer.mlp
        gate_up = mlp.gate_up_proj
        full = cfg.intermediate_size
        gate_up.weight = nn.Parameter(_rows(gate_up.weight, [mlp_cols, (full + mlp_cols[0], full + mlp_cols[1])]),
                                      requires_grad=False)
        gate_up.out_features = gate_up.weight.shape[0]
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, mlp_cols[0]:mlp_cols[1]].contiguous())
    start, end, rows = vocab_range(cfg.vocab_size, rank, tp)
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.embed_tokens = VocabParallelEmbedding(_vocab_shard(model.embed_tokens.weight, start, end, rows),
                                                start, end)
    head_weight = (model.embed_tokens.weight if tied else
                   nn.Parameter(_vocab_shard(model.lm_head.weight, start, end, rows), requires_grad=False))
    model.lm_head = VocabParallelLMHead(head_weight, cfg.vocab_size, tp)
    return split
