"""Owns the model, the KV pool and the attention backend; runs one Batch on the device.

The batch arrives as host lists from the scheduler. It is packed into one host tensor and copied to the
device in a single transfer, then split there: one copy per step instead of a dozen small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.attention import AttentionMetadata, create_backend
from minisgl.config import EngineConfig
from minisgl.engine.sampler import SamplingTensors, sample
from minisgl.kvcache import KVCache, ReqToTokenPool
from minisgl.loader import DTYPES, load_model
from minisgl.scheduler import Batch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class StepOutput:
    """What a launched step hands back: next tokens on the device and, once `ready` fires, on the host."""

    batch: Batch
    tokens_device: torch.Tensor
    tokens_host: torch.Tensor
    ready: torch.cuda.Event | None

    def wait(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens_host.tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_link: tuple | None = None) -> None:
        # --- tensor parallelism (minisgl/distributed): rank 0 starts ranks 1..N-1, stopped again on failure ---
        self.tp = None
        try:
            self._setup(config, rank, tp_link)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank); safe to call more than once."""
        if self.tp is not None:
            self.tp.close()
        # ---

    def _setup(self, config: EngineConfig, rank: int, tp_link: tuple | None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if config.tp_size > 1:  # --- tensor parallelism: join (rank 0: start) the group; a GPU per rank ---
            from minisgl.distributed import TensorParallel
            self.tp = TensorParallel(config, rank, self.device, tp_link)
            self.device = self.tp.device
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = DTYPES[config.dtype]
        loaded = load_model(config.model, self.dtype, self.device, config.load_format, config.seed,
                            config.max_model_len)
        self.model, self.model_config, self.hf_config, self.model_path = (
            loaded.model, loaded.config, loaded.hf_config, loaded.path)
        mc = self.model_config
        # this rank's heads: all of them, or its slice under tensor parallelism (which shards the weights here)
        self.num_q_heads, self.num_kv_heads = mc.num_q_heads, mc.num_kv_heads
        if self.tp is not None:
            split = self.tp.shard(self.model, mc)
            self.num_q_heads, self.num_kv_heads = split.num_q, split.num_kv
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.page_size = config.page_size
        self.num_pages = config.num_pages or self._auto_num_pages()
        if self.tp is not None:  # rank 0 hands out pages for every rank: each pool takes the smallest size
            self.num_pages = self.tp.agree_num_pages(self.num_pages)
        self.kv_cache = KVCache(mc.num_layers, self.num_pages, self.page_size, self.num_kv_heads, mc.head_dim,
                                self.dtype, self.device)
        self.max_reqs = config.max_running_requests + 8  # finished requests hold a row until released
        self.req_pool = ReqToTokenPool(self.max_reqs, self.max_model_len + self.page_size, self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.attn = create_backend(backend, kv_cache=self.kv_cache, req_to_token=self.req_pool.table,
                                   num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=mc.head_dim, scale=mc.head_dim ** -0.5,
                                   max_context_len=self.max_model_len)
        self.last_tokens: torch.Tensor | None = None  # previous step's sampled tokens, on the device
        self.graph_runner = None
        if config.cuda_graph and self.device.type == "cuda" and self.attn.supports_cuda_graph:
            from minisgl.engine.cuda_graph import CudaGraphRunner
            self.graph_runner = CudaGraphRunner(self, config.cuda_graph_max_bs)
        if self.tp is not None:
            self.tp.ready()

    def _auto_num_pages(self) -> int:
        mc, cfg = self.model_config, self.config
        per_token = KVCache.bytes_per_token(mc.num_layers, self.num_kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(self.device)
            reserve = 4 << 30  # activations of a full prefill chunk, CUDA Graph pools, the sampler's buffers
            tokens = int((free - reserve) * cfg.kv_memory_fraction) // per_token
        else:
            tokens = cfg.kv_cache_tokens
        return max(tokens // self.page_size, 2)

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    # --- one step --------------------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                                              SamplingTensors]:
        b, t = batch.size, batch.num_tokens
        prefix = np.asarray(batch.prefix_lens, dtype=np.int64)
        extend = np.asarray(batch.extend_lens, dtype=np.int64)
        start = np.zeros(b, dtype=np.int64)
        np.cumsum(extend[:-1], out=start[1:])
        positions = np.repeat(prefix - start, extend) + np.arange(t, dtype=np.int64)
        sample_rows = np.asarray(batch.sample_rows, dtype=np.int64)
        logit_idx = start[sample_rows] + extend[sample_rows] - 1
        reqs = [batch.reqs[i] for i in batch.sample_rows]
        s = len(reqs)
        vocab = self.model_config.vocab_size
        seeds = np.asarray([r.seed for r in reqs], dtype=np.int64)
        steps = np.asarray([r.num_outputs_scheduled for r in reqs], dtype=np.int64)
        top_ks = np.asarray([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], dtype=np.int64)
        parts = [
            np.asarray(batch.input_ids, dtype=np.int64), positions, np.asarray(batch.out_cache_loc, np.int64),
            np.asarray([r.row for r in batch.reqs], dtype=np.int64), prefix + extend, prefix, extend, start,
            logit_idx, np.asarray(batch.pending_dst, np.int64), np.asarray(batch.pending_src, np.int64),
            seeds, steps, top_ks]
        # Each part starts on a 16-byte boundary: Triton compiles a kernel variant per pointer alignment, and
        # unaligned views would make the variant depend on the batch's token count.
        padded = [n + n % 2 for n in map(len, parts)]
        ints = np.zeros(sum(padded), dtype=np.int64)
        offsets = np.cumsum([0] + padded[:-1])
        for part, off in zip(parts, offsets):
            ints[off:off + len(part)] = part
        temps = [r.params.temperature for r in reqs]
        floats = np.zeros((2, s + (-s) % 4), dtype=np.float32)  # rows on 16-byte boundaries too
        floats[0, :s], floats[1, :s] = temps, [r.params.top_p for r in reqs]
        dev_ints, dev_floats = self._to_device(ints), self._to_device(floats)
        (input_ids, pos, out_loc, rows, seq_lens, prefix_d, extend_d, start_d, logit_d, pdst, psrc, seeds_d,
         steps_d, topk_d) = (chunk[:len(part)] for chunk, part in zip(dev_ints.split(padded), parts))
        if len(batch.pending_dst):
            input_ids = input_ids.clone()
            input_ids[pdst] = self.last_tokens[psrc]
        meta = AttentionMetadata(
            is_decode=batch.is_decode, req_pool_indices=rows, seq_lens=seq_lens.int(),
            prefix_lens=prefix_d.int(), extend_lens=extend_d.int(), extend_start=start_d.int(),
            out_cache_loc=out_loc, max_seq_len=int((prefix + extend).max()), max_extend_len=int(extend.max()),
            seq_lens_cpu=(prefix + extend).tolist(), prefix_lens_cpu=batch.prefix_lens,
            extend_lens_cpu=batch.extend_lens)
        sampling = SamplingTensors(
            temperatures=dev_floats[0, :s], top_ps=dev_floats[1, :s], top_ks=topk_d, seeds=seeds_d, steps=steps_d,
            all_greedy=all(x == 0 for x in temps),
            any_top_k_p=any(r.params.top_k > 0 or r.params.top_p < 1 for r in reqs))
        return input_ids, pos, meta, logit_d, sampling

    @torch.inference_mode()
    def forward(self, batch: Batch) -> StepOutput:
        if self.tp is not None:  # tensor parallelism: rank 0 sends the batch to ranks 1..N-1, all run it
            return self.tp.forward(self, batch)
        return self._forward(batch)

    def _forward(self, batch: Batch) -> StepOutput:
        input_ids, positions, meta, logit_idx, sampling = self.prepare(batch)
        self.req_pool.flush()
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits = self.graph_runner.run(input_ids, positions, meta, len(batch.sample_rows))
        else:
            self.attn.prepare(meta)
            logits = self.model(input_ids, positions, self.attn, logit_idx)
        tokens = sample(logits, sampling)
        self.last_tokens = tokens
        if self.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return StepOutput(batch, tokens, host, ready)
        return StepOutput(batch, tokens, tokens, None)
