"""Tensor parallelism: `shard.py` splits the weights, `group.py` runs one process per rank."""

from minisgl.distributed.group import TensorParallel
from minisgl.distributed.shard import check_tp_size, head_split, shard_model

__all__ = ["TensorParallel", "check_tp_size", "head_split", "shard_model"]
