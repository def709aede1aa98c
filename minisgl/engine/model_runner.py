"""Owns the model, the KV pool and the attention backend; runs one Batch on the device.

The batch arrives as host lists from the scheduler. It is packed into one host tensor and copied to the
device in a single transfer, then split there: one copy per step instead of a dozen small ones.

Token ids travel on the device only. The input ids of a step are gathered from the pool's token-id table at
(request row, position), and the tokens a step samples are scattered into it at (row, the request's next
position) right after sampling. So the next step reads a token the previous one drew, whether or not the host
has seen it yet (the overlap loop), and the scheduler writes only what the device cannot know: prompts.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from minisgl.attention import AttentionMetadata, create_backend
from minisgl.config import EngineConfig
from minisgl.engine.graph_pieces import run_in_pieces
from minisgl.engine.logits_processing import LogitsProcessing, PenaltyTable, process_logits, token_logprobs
from minisgl.engine.prefill_graph import pad_extend_step
from minisgl.engine.runtimes import make_runtime
from minisgl.engine.sampler import SamplingTensors, sample
from minisgl.engine.sizing import auto_max_running_requests, graph_max_bs, row_bytes
from minisgl.engine.staged_graph import StagedCudaGraphRunner
from minisgl.environment import omp_threads_set
from minisgl.grammar import bitmask_words
from minisgl.kernels import sampling as fused_sampling
from minisgl.kernels import staging
from minisgl.kernels.elementwise import use_triton
from minisgl.kernels.options import use_options
from minisgl.kvcache import KVCache, ReqToTokenPool
from minisgl.loader import DTYPES, load_model
from minisgl.models.registry import runtime_name
from minisgl.scheduler import Batch

# what a step's host arrays become on the device (ModelRunner._upload)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


def cpu_threads(config: EngineConfig) -> int:
    """Torch threads for an engine on the CPU: `config.cpu_threads`, or for 0 (auto) one fewer than the cores
    this process may use, shared by the tensor-parallel ranks, at least 1. With every core busy, torch's
    threads wait at each op for one that a busy neighbour (another process, the tokenizer, a rank) holds: on 2
    cores beside one busy process that cost 3x (lab/checks/cpu_threads_bench.py). An explicit OMP_NUM_THREADS is
    the user's choice, which torch already applied: auto keeps it."""
    if config.cpu_threads > 0:
        return config.cpu_threads
    if omp_threads_set():
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - 1) // config.tp_size)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r}: torch sees no CUDA GPU here (a CPU-only build of torch, or no "
                           "driver); use device 'cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {name!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
    return device


def _freeze_heap() -> None:
    """Collect the garbage, then freeze what survives: later collections skip it (gc.unfreeze thaws it)."""
    gc.collect()
    gc.freeze()


@dataclass
class StepLogprobs:
    """Per sampling row of a step that asked for logprobs (`rows`, indices into the step's sampling rows), on
    the host once the step's `ready` fires: the sampled token's logprob and the top_n most likely tokens."""

    rows: list[int]
    packed: torch.Tensor  # [L, 1 + 2 * top_n] float32: the token's logprob, top_n logprobs, top_n ids (int32 bits)
    top_n: int

    @classmethod
    def pack(cls, rows: list[int], chosen: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor
             ) -> StepLogprobs:
        """From token_logprobs' three tensors (the torch path): one tensor, so one copy to the host."""
        ids = top_ids.to(torch.int32).contiguous().view(torch.float32)
        return cls(rows, torch.cat([chosen.view(-1, 1).float(), top_logprobs.float(), ids], dim=1),
                   top_ids.shape[1])

    def lists(self) -> tuple[list[float], list[list[int]], list[list[float]]]:
        """(each row's token logprob, its top_n ids, their logprobs), on the host."""
        p, n = self.packed, self.top_n
        return p[:, 0].tolist(), p[:, 1 + n:].contiguous().view(torch.int32).tolist(), p[:, 1:1 + n].tolist()


@dataclass
class HostArrays:
    """A step's inputs on the host (`ModelRunner.host_arrays`): per token, per request, per sampling request."""

    token_src: np.ndarray  # [tokens] flat token-table index of each input id (row * width + position)
    positions: np.ndarray  # [tokens]
    out_cache_loc: np.ndarray  # [tokens] the KV slot each token's K/V goes to
    rows: np.ndarray  # [requests] each request's row of the tables
    prefix: np.ndarray  # [requests] tokens already in the KV cache
    extend: np.ndarray  # [requests] tokens this step adds
    start: np.ndarray  # [requests] the request's first token in the step
    logit_idx: np.ndarray  # [sampling] the token whose logits each sampling request samples from
    token_dst: np.ndarray  # [sampling] flat token-table index of each sampled token
    seeds: np.ndarray  # [sampling] and the sampler's settings below
    steps: np.ndarray
    top_ks: np.ndarray
    temperatures: list[float]
    top_ps: list[float]
    min_ps: list[float]
    all_greedy: bool
    any_top_k_p: bool


@dataclass
class StepOutput:
    """What a launched step hands back: next tokens on the device and, once `ready` fires, on the host.

    A step whose logits are processed (logits_processing.py) may still have to be sampled when it is launched
    (`unsampled`: the forward runs, its grammar masks are not built yet): the engine calls
    `ModelRunner.sample_processed` with them once they are (`sample`, which `wait` calls if it has not been)."""

    batch: Batch
    tokens_device: torch.Tensor | None  # after a decode graph: its output buffer, which the next replay overwrites
    tokens_host: torch.Tensor | None
    ready: torch.cuda.Event | None
    logprobs: StepLogprobs | None = None
    unsampled: tuple | None = None  # (logits, sampling, processing, token_dst) until sampled
    grammar_rows: list[int] | None = None  # sampling rows (indices) of requests with a grammar
    sample: Callable[[], None] | None = None  # the engine's: samples an `unsampled` step
    on_ready: Callable[[StepOutput], None] | None = None  # the engine's: called once the results are on the host

    def wait(self) -> list[int]:
        if self.unsampled is not None:
            self.sample()
        if self.ready is not None:
            self.ready.synchronize()
        if self.on_ready is not None:
            self.on_ready(self)
        return self.tokens_host.tolist()


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_link: tuple | None = None) -> None:
        # --- tensor parallelism (minisgl/distributed): rank 0 starts ranks 1..N-1, stopped again on failure ---
        self.tp = None
        self._tokens_in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []  # see _to_host
        try:
            with use_options(config.kernels):  # the GEMV swap, warm-ups and graph captures run under them
                self._setup(config, rank, tp_link)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank); safe to call more than once."""
        if self.tp is not None:
            self.tp.close()
        if getattr(self, "gc_frozen", False):  # a closed engine's cycles must be collectable again
            gc.unfreeze()
            self.gc_frozen = False
        # ---

    def _setup(self, config: EngineConfig, rank: int, tp_link: tuple | None) -> None:
        self.config = config
        self.startup: dict[str, float] = {}  # host seconds of each start-up phase, in order (issue 29's start time)
        clock = [time.perf_counter()]

        def lap(phase: str) -> None:
            now = time.perf_counter()
            self.startup[phase] = round(now - clock[0], 3)
            clock[0] = now

        self.device = resolve_device(config.device)
        if self.device.type == "cpu":  # before the weights load: their conversion runs on these threads too
            torch.set_num_threads(cpu_threads(config))
        if config.tp_size > 1:  # --- tensor parallelism: join (rank 0: start) the group; a GPU per rank ---
            from minisgl.distributed import TensorParallel
            # ranks 1..N-1 run a runner of this class each (`loop`); the group never imports the engine
            self.tp = TensorParallel(config, rank, self.device, tp_link, worker=type(self))
            self.device = self.tp.device
        if self.device.type == "cuda":  # the CUDA context, so "load" times the weights alone
            torch.zeros(1, device=self.device)
        lap("device")
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = DTYPES[config.dtype]
        loaded = load_model(config.model, self.dtype, self.device, config.load_format, config.seed,
                            config.max_model_len)
        self.model, self.model_config, self.hf_config, self.model_path = (
            loaded.model, loaded.config, loaded.hf_config, loaded.path)
        mc = self.model_config
        # what the model needs beyond a KV cache, as its family declares it (engine/runtime.py)
        self.runtime = make_runtime(runtime_name(loaded.hf_config), mc)
        if self.tp is not None and not self.runtime.supports_tensor_parallel:
            raise ValueError(f"tensor parallelism does not run {self.runtime.name} models (such as {mc.arch}) yet: "
                             "use tp_size=1")
        self.num_kv_layers = self.runtime.kv_layers
        # this rank's heads: all of them, or its slice under tensor parallelism (which shards the weights here)
        self.num_q_heads, self.num_kv_heads = mc.num_q_heads, mc.num_kv_heads
        if self.tp is not None:
            split = self.tp.shard(self.model, mc)
            self.num_q_heads, self.num_kv_heads = split.num_q, split.num_kv
        self.gemv_linears = 0
        if config.gemv and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16):
            from minisgl.kernels.gemv import use_gemv
            from minisgl.models.decoder import DecoderLayer
            from minisgl.models.layers import MLP
            # few-row matmuls stream the weights (kernels/gemv.py); more rows stay cuBLAS
            norm_fold = (DecoderLayer,) if config.kernels.gemv_norm_fold and self.tp is None else ()
            self.gemv_linears = use_gemv(self.model, fold=(MLP,), norm_fold=norm_fold)
        # the decode-layers kernel (kernels/decode_layers.py) reads each kind of layer weight as one stacked tensor:
        # stacked here, before the KV pool is sized from the free memory, the layers' parameters becoming views
        layer_stack, self.decode_megakernel = None, ""  # "": off; else "on" or why it does not apply
        if config.kernels.decode_megakernel:
            from minisgl.engine.decode_layers import decode_layers_unfit
            from minisgl.kernels.decode_layers import LayerStack
            why = ("tensor parallelism" if self.tp is not None
                   else "no GPU" if self.device.type != "cuda" and not config.kernels.triton_on_cpu
                   else decode_layers_unfit(self.model))
            if why is None:
                layer_stack = LayerStack.of(self.model.layers)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()  # the unstacked weights' blocks
            self.decode_megakernel = why or "on"
        lap("load")
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.page_size = config.page_size
        # max_running_requests 0/None: sized from memory here, and the rest of the engine sees the resolved count
        self.config = config = self._resolve_max_running(config)
        self.max_reqs = config.max_running_requests + 8  # finished requests hold a row until released
        # per-request state beyond the KV cache (none, or a hybrid's), before the KV pool is sized, so the free
        # memory it measures excludes it
        self.runtime.allocate(self, config)
        self.state_pool = self.runtime.state_pool
        # the request table before the KV pool, so the free memory the pool is sized from excludes it
        self.req_pool = ReqToTokenPool(self.max_reqs, self.max_model_len + self.page_size, self.device)
        self.num_pages = config.num_pages or self._auto_num_pages()
        if self.tp is not None:  # rank 0 hands out pages for every rank: each pool takes the smallest size
            self.num_pages = self.tp.agree_num_pages(self.num_pages)
        self.kv_cache = KVCache(self.num_kv_layers, self.num_pages, self.page_size, self.num_kv_heads, mc.head_dim,
                                self.dtype, self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.attn = create_backend(backend, kv_cache=self.kv_cache, req_to_token=self.req_pool.table,
                                   num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
                                   head_dim=mc.head_dim, scale=mc.head_dim ** -0.5,
                                   max_context_len=self.max_model_len)
        self.fused_rope = 0  # rotary embeddings that let the backend apply them (attention/fused_rope.py)
        if config.kernels.decode_fused_rope and hasattr(self.attn, "defer_rope"):
            from minisgl.attention.fused_rope import use_fused_rope
            from minisgl.models.layers import RotaryEmbedding
            self.fused_rope = use_fused_rope(self.model, RotaryEmbedding, self.attn)
        if layer_stack is not None:
            from minisgl.engine.decode_layers import use_decode_layers
            self.decode_megakernel = use_decode_layers(self.model, layer_stack, self.attn) or "on"
        lap("pools")
        # The heap built so far (modules, the model, the pools) frozen before the warm-up and the captures: the
        # collections their own objects trigger (Triton's kernels, graphs, step tensors) then skip it, instead of
        # walking it again each time (vLLM and SGLang freeze the collector for their captures). Thawed by close().
        self.gc_frozen = config.gc_freeze and self.device.type == "cuda"
        if self.gc_frozen:
            _freeze_heap()
        lap("gc_freeze")
        graphs = config.cuda_graph and self.device.type == "cuda" and self.attn.supports_cuda_graph
        max_bs = graph_max_bs(config.cuda_graph_max_bs, config.max_running_requests) if graphs else 0
        prefill_graphs = (graphs and config.prefill_graph_max_tokens > 0
                          and getattr(self.attn, "supports_extend_cuda_graph", False))
        # --- kernel warm-up (engine/warmup.py): every Triton variant compiled before the captures and requests ---
        self.warmup = None  # what it did, or None (off, a CPU, or it failed: it never stops the engine)
        if config.kernel_warmup:
            from minisgl.engine.warmup import warm_up_kernels
            self.warmup = warm_up_kernels(self, max_bs, prefill_graphs)
        # --- end kernel warm-up ---
        lap("kernel_warmup")
        self.graph_runner = None
        if graphs:
            self.graph_runner = self.runtime.decode_graphs(self, max_bs)
        lap("decode_graphs")
        # --- prefill graphs (engine/prefill_graph.py): extend steps replayed per token bucket ---
        self.prefill_graph = None
        if self.graph_runner is not None and prefill_graphs:
            from minisgl.engine.prefill_graph import build_prefill_graphs, graph_pool_of
            self.prefill_graph = build_prefill_graphs(self, config.prefill_graph_max_tokens,
                                                      config.prefill_graph_max_reqs,
                                                      pool=graph_pool_of(self.graph_runner))
        # --- end prefill graphs ---
        lap("prefill_graphs")
        # the last step's batch and how it ran: "graph", "graph_pieces", "prefill_graph" or "eager" (read by a
        # server's --step-log)
        self.last_batch: Batch | None = None
        self.last_step_kind = ""
        # the count table of penalised requests (engine/logits_processing.py): no memory until one arrives
        self.penalties = PenaltyTable(mc.vocab_size, self.device)
        self._mask_host: torch.Tensor | None = None  # mask_buffer's
        # Start-up leaves many Python objects (Triton's compiled kernels, graph captures) that the first workload's
        # collections would walk (run16: 0.22-0.26 s of the first W1). Collected once here, the survivors frozen
        # too: later collections skip them. GPU only (CPU tests build hundreds of engines per process), and
        # close() thaws.
        if self.gc_frozen:
            _freeze_heap()
        lap("gc")
        if self.tp is not None:
            self.tp.ready()

    def _pool_budget(self) -> int | None:
        """Device memory the pools (request rows, hybrid state, KV) may use now: what is free less a reserve for
        activations; None on a CPU, where the KV pool is sized by kv_cache_tokens."""
        if self.device.type != "cuda":
            return None
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        reserve = 4 << 30  # activations of a full prefill chunk, CUDA Graph pools, the sampler's buffers
        return max(free - reserve, 0)

    def _kv_tokens(self, budget: int | None) -> int:
        """KV pool tokens from a pool budget (`_pool_budget`), or kv_cache_tokens on a CPU."""
        mc, cfg = self.model_config, self.config
        if budget is None:
            return cfg.kv_cache_tokens
        per_token = KVCache.bytes_per_token(self.num_kv_layers, self.num_kv_heads, mc.head_dim, self.dtype)
        return int(budget * cfg.kv_memory_fraction) // per_token

    def _auto_num_pages(self) -> int:
        return max(self._kv_tokens(self._pool_budget()) // self.page_size, 2)

    def _resolve_max_running(self, config: EngineConfig) -> EngineConfig:
        """The config with max_running_requests resolved: an explicit count wins; 0/None is sized from the KV
        pool the memory can hold (before either is allocated), the memory a request row costs and the rows' share
        of the memory, less what the runtime sizes before the rows (a hybrid's snapshots; engine/sizing.py)."""
        if config.max_running_requests:
            return config
        budget = self._pool_budget()
        kv_tokens = config.num_pages * self.page_size if config.num_pages else self._kv_tokens(budget)
        rt = self.runtime
        per_row = row_bytes(self.max_model_len + self.page_size, *rt.row_state_bytes(config, self.dtype, self.device))
        reserved = rt.reserved_state_bytes(config, self.dtype, self.device) if budget is not None else 0
        rows = auto_max_running_requests(kv_tokens, per_row, budget, max_rows=rt.max_rows,
                                         memory_share=rt.row_memory_share, reserved=reserved)
        if self.tp is not None:  # every rank's request table must hold the rows rank 0 schedules
            rows = self.tp.agree_min(rows)
        return config.with_(max_running_requests=rows)

    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    # --- one step --------------------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _upload(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """The arrays (int64, int32 or float32, any shape) on the device in one copy, as views of one buffer in
        their own dtypes and shapes. Each starts on a 16-byte boundary: Triton compiles a kernel variant per
        pointer alignment, and unaligned views would make the variant depend on the batch's sizes."""
        offsets, end = [], 0
        for p in parts:
            offsets.append(end)
            end += p.nbytes + (-p.nbytes) % 16
        host = np.zeros(end, dtype=np.uint8)
        for p, off in zip(parts, offsets):
            host[off:off + p.nbytes] = p.reshape(-1).view(np.uint8)  # reshape copies a strided array
        dev = self._to_device(host)
        typed = {dt: dev.view(tt) for dt, tt in _TORCH_DTYPES.items()}  # the whole buffer in each dtype, once
        out = []
        for p, off in zip(parts, offsets):
            start = off // p.itemsize
            view = typed[p.dtype][start:start + p.size]
            out.append(view if p.ndim == 1 else view.view(p.shape))
        return out

    def host_arrays(self, batch: Batch) -> HostArrays:
        """A step's inputs as host arrays, before any upload (`prepare`; a staged decode graph's `run_staged`)."""
        b, t = batch.size, batch.num_tokens
        prefix = np.asarray(batch.prefix_lens, dtype=np.int64)
        extend = np.asarray(batch.extend_lens, dtype=np.int64)
        start = np.zeros(b, dtype=np.int64)
        np.cumsum(extend[:-1], out=start[1:])
        positions = np.repeat(prefix - start, extend) + np.arange(t, dtype=np.int64)
        sample_rows = np.asarray(batch.sample_rows, dtype=np.int64)
        rows = np.asarray([r.row for r in batch.reqs], dtype=np.int64)
        # flat indices into the token table (row * width + position): where the step reads its input ids, and
        # where its sampled tokens go (position prefix + extend: each sampling request's next token)
        width = self.req_pool.max_context_len
        reqs = [batch.reqs[i] for i in batch.sample_rows]
        vocab = self.model_config.vocab_size
        temps = [r.params.temperature for r in reqs]
        return HostArrays(
            token_src=np.repeat(rows * width, extend) + positions, positions=positions,
            out_cache_loc=np.asarray(batch.out_cache_loc, np.int64), rows=rows, prefix=prefix, extend=extend,
            start=start, logit_idx=start[sample_rows] + extend[sample_rows] - 1,
            token_dst=rows[sample_rows] * width + (prefix + extend)[sample_rows],
            seeds=np.asarray([r.seed for r in reqs], dtype=np.int64),
            steps=np.asarray([r.num_outputs_scheduled for r in reqs], dtype=np.int64),
            top_ks=np.asarray([r.params.top_k_within(vocab) for r in reqs], dtype=np.int64),
            temperatures=temps, top_ps=[r.params.top_p for r in reqs], min_ps=[r.params.min_p for r in reqs],
            all_greedy=all(x == 0 for x in temps), any_top_k_p=any(r.params.cuts(vocab) for r in reqs))

    def prepare(self, batch: Batch, pad_to: tuple[int, int] | None = None,
                writes: tuple[np.ndarray, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, SamplingTensors, torch.Tensor]:
        """Device inputs of a step: (input ids, positions, attention metadata, logit indices, sampling settings,
        token_dst). The table writes the scheduler queued (`writes`, as `ReqToTokenPool.take_writes` gives them;
        by default taken from the pool here) travel in the same copy and are applied first, since the input ids
        are read from the token table; `token_dst` is where the step's sampled tokens go in it (`store_tokens`, or
        inside the decode graph's replay). `pad_to` = (tokens, requests) pads the step to a prefill graph's
        shape."""
        writes, n_slot_writes = writes if writes is not None else self.req_pool.take_writes()
        a = self.host_arrays(batch)
        token_src, positions, loc, rows = a.token_src, a.positions, a.out_cache_loc, a.rows
        prefix, extend, start, logit_idx = a.prefix, a.extend, a.start, a.logit_idx
        s, t = len(a.temperatures), batch.num_tokens
        extra = self.runtime.step_arrays(rows, start, t, pad_to)  # e.g. a hybrid's state slots and bounds
        if pad_to is not None:  # prefill graph: padded on the host, so the one upload has the graph's shapes
            token_src, positions, loc, rows, prefix, extend, start, logit_idx = pad_extend_step(
                pad_to, token_src, positions, loc, rows, prefix, extend, start, logit_idx)
        floats = np.zeros((3, s + (-s) % 4), dtype=np.float32)  # rows on 16-byte boundaries too
        floats[0, :s], floats[1, :s], floats[2, :s] = a.temperatures, a.top_ps, a.min_ps
        # the attention metadata's int32 arrays travel as int32: no conversion kernels on the device
        lens32 = [x.astype(np.int32) for x in (prefix + extend, prefix, extend, start)]
        (src_d, pos, out_loc, rows_d, logit_d, dst_d, seeds_d, steps_d, topk_d, writes_d, floats_d, seq_lens,
         prefix_d, extend_d, start_d, *extra_d) = self._upload(
            [token_src, positions, loc, rows, logit_idx, a.token_dst, a.seeds, a.steps, a.top_ks, writes, floats,
             *lens32, *extra])
        self.req_pool.apply_writes(writes_d, n_slot_writes)
        input_ids = self.req_pool.token_ids.view(-1)[src_d]
        meta = self.runtime.metadata_cls(
            is_decode=batch.is_decode, req_pool_indices=rows_d, seq_lens=seq_lens,
            prefix_lens=prefix_d, extend_lens=extend_d, extend_start=start_d,
            out_cache_loc=out_loc, max_seq_len=int((prefix + extend).max()), max_extend_len=int(extend.max()),
            seq_lens_cpu=(prefix + extend).tolist(), prefix_lens_cpu=prefix.tolist(),
            extend_lens_cpu=extend.tolist())
        self.runtime.attach(meta, extra_d)
        sampling = SamplingTensors(
            temperatures=floats_d[0, :s], top_ps=floats_d[1, :s], top_ks=topk_d, seeds=seeds_d, steps=steps_d,
            all_greedy=a.all_greedy, min_ps=floats_d[2, :s], any_top_k_p=a.any_top_k_p)
        return input_ids, pos, meta, logit_d, sampling, dst_d

    def store_tokens(self, token_dst: torch.Tensor, tokens: torch.Tensor) -> None:
        """Put a step's sampled tokens in the token table (see `prepare`), on the device: no host round trip."""
        self.req_pool.token_ids.view(-1)[token_dst] = tokens.long()

    @torch.inference_mode()
    def forward(self, batch: Batch) -> StepOutput:
        with use_options(self.config.kernels):  # this engine's kernel options, whatever another engine uses
            if self.tp is None:
                return self._forward(batch)
            # tensor parallelism: rank 0 sends the batch and its table writes to ranks 1..N-1 (`loop`), all run it
            writes = self.req_pool.take_writes()
            return self.tp.run_step(batch, writes, lambda: self._forward(batch, writes))

    @torch.inference_mode()
    def loop(self) -> None:
        """Ranks 1..N-1 of tensor parallelism: run every step rank 0 sends, until it stops or goes away (the shape
        of nano-vllm's ModelRunner.loop)."""
        with use_options(self.config.kernels):
            for batch, writes in self.tp.steps():
                self._forward(batch, writes)

    def _forward(self, batch: Batch, writes: tuple[np.ndarray, int] | None = None) -> StepOutput:
        self.last_batch = batch
        if (isinstance(self.graph_runner, StagedCudaGraphRunner) and self.graph_runner.can_run(batch)
                and not any(batch.reqs[i].params.processes_logits for i in batch.sample_rows)):
            return self._forward_staged(batch, writes)
        shape = self.prefill_graph.shape_for(batch) if self.prefill_graph is not None else None
        input_ids, positions, meta, logit_idx, sampling, token_dst = self.prepare(batch, pad_to=shape, writes=writes)
        self.runtime.before_step(batch)  # e.g. a hybrid's admitted requests start from zeros or a snapshot
        processing = self.processing(batch)
        if processing is not None:  # the logits, then processing and sampling (sample_processed)
            return self._forward_processed(batch, shape, input_ids, positions, meta, logit_idx, sampling, token_dst,
                                           processing)
        in_graph = self.graph_runner is not None and self.graph_runner.can_run(batch)
        if in_graph:  # one replay: forward, sampler and token-table write (`tokens` is a view, copied below)
            self.last_step_kind = "graph"
            tokens = self.graph_runner.run(input_ids, positions, meta, sampling, token_dst=token_dst)
        elif (self.graph_runner is not None and batch.is_decode and len(batch.sample_rows) == batch.size
              and self.config.cuda_graph_split):  # every row samples (see CudaGraphRunner.can_run)
            self.last_step_kind = "graph_pieces"
            tokens = run_in_pieces(self.graph_runner, input_ids, positions, meta, sampling)  # engine/graph_pieces.py
        elif shape is not None:  # prefill graph (engine/prefill_graph.py)
            self.last_step_kind = "prefill_graph"
            logits = self.prefill_graph.run(shape, input_ids, positions, meta, logit_idx, len(batch.sample_rows))
            tokens = sample(logits, sampling)
        else:
            self.last_step_kind = "eager"
            self.attn.prepare(meta)
            tokens = sample(self.model(input_ids, positions, self.attn, logit_idx), sampling)
        self.runtime.after_step(batch)  # e.g. a hybrid's snapshots of the state after this step
        if not in_graph:
            self.store_tokens(token_dst, tokens)
        return self._to_host(StepOutput(batch, tokens, None, None), copy=in_graph)

    def _forward_staged(self, batch: Batch, writes: tuple[np.ndarray, int] | None) -> StepOutput:
        """A decode step through a staged graph (engine/staged_graph.py): its inputs and its table writes in
        one copy. Token ids to write (a prompt's, never a decode step's) or more writes than the block holds
        take the usual upload first."""
        packed, n_slot = writes if writes is not None else self.req_pool.take_writes()
        graphs = self.graph_runner
        table_writes = None
        if packed.shape[1] == n_slot and n_slot <= graphs.write_capacity:
            table_writes = np.stack([packed[0, :n_slot] * self.req_pool.max_context_len + packed[1, :n_slot],
                                     packed[2, :n_slot]])
        elif packed.shape[1]:
            self.req_pool.apply_writes(self._upload([packed])[0], n_slot)
        arrays = self.host_arrays(batch)
        self.runtime.before_step(batch)
        self.last_step_kind = "graph"
        tokens = graphs.run_staged(arrays, table_writes, self.req_pool.table)
        self.runtime.after_step(batch)
        return self._to_host(StepOutput(batch, tokens, None, None), copy=True)

    def _to_host(self, out: StepOutput, copy: bool) -> StepOutput:
        """The step's tokens (and logprobs) on their way to the host; `copy`: the tokens are a graph's output
        buffer, which the next replay rewrites."""
        tokens = out.tokens_device
        lp = out.logprobs
        if self.device.type == "cuda":
            def pinned(t: torch.Tensor) -> torch.Tensor:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                return host
            # the tokens by a kernel writing pinned memory (kernel option zero_copy_io) or by a copy
            out.tokens_host = staging.copy_to_host(tokens.contiguous())
            if lp is not None:
                lp.packed = pinned(lp.packed)
            out.ready = torch.cuda.Event()
            out.ready.record()
            # a kernel's write is not a use the host allocator knows of: hold each tensor until the stream has
            # passed it, whatever becomes of the step's output (kernels/staging.py, copy_to_host)
            self._tokens_in_flight = [(e, t) for e, t in self._tokens_in_flight if not e.query()]
            self._tokens_in_flight.append((out.ready, out.tokens_host))
        else:
            out.tokens_host = tokens.clone() if copy else tokens
        return out

    # --- steps whose logits are processed: penalties, grammar masks, logprobs (logits_processing.py) ---------
    def processing(self, batch: Batch) -> LogitsProcessing | None:
        """The step's logits processing on the device, or None when no sampling request asks for any."""
        reqs = [batch.reqs[i] for i in batch.sample_rows]
        if not any(r.params.processes_logits for r in reqs):
            return None
        pen = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        lp = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        gram = [i for i, r in enumerate(reqs) if r.grammar is not None]
        proc = LogitsProcessing()

        def ints(values) -> torch.Tensor:
            return self._to_device(np.asarray(values, dtype=np.int64))

        if pen:
            pen_reqs = [reqs[i] for i in pen]
            self.penalties.load(pen_reqs)
            # rows on 16-byte boundaries (as in `prepare`): the penalty kernel is one Triton variant for any count
            p = len(pen_reqs)
            host = np.zeros((3, p + (-p) % 4), dtype=np.float32)
            host[:, :p] = [[r.params.frequency_penalty for r in pen_reqs],
                           [r.params.presence_penalty for r in pen_reqs],
                           [r.params.repetition_penalty for r in pen_reqs]]
            floats = self._to_device(host)
            proc.penalty_rows, proc.penalty_slots = ints(pen), ints([r.row for r in pen_reqs])
            proc.frequency, proc.presence, proc.repetition = floats[0, :p], floats[1, :p], floats[2, :p]
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:  # one entry per (row, token); a request's tokens are distinct (SamplingParams)
            proc.bias_rows = ints([i for i, bias in biased for _ in bias])
            proc.bias_tokens = ints([t for _, bias in biased for t, _ in bias])
            proc.bias = self._to_device(np.asarray([b for _, bias in biased for _, b in bias], dtype=np.float32))
        if lp:
            proc.logprob_rows = ints(lp)
            proc.top_n = max(reqs[i].params.logprobs for i in lp)
            proc.logprob_rows_host = lp
        if gram:
            proc.mask_rows, proc.mask_rows_host = ints(gram), gram
        return proc

    def _forward_processed(self, batch: Batch, shape, input_ids, positions, meta, logit_idx, sampling, token_dst,
                           processing: LogitsProcessing) -> StepOutput:
        if self.graph_runner is not None and self.graph_runner.can_run(batch):  # the forward alone, replayed
            self.last_step_kind = "graph"
            logits = self.graph_runner.run(input_ids, positions, meta, replace(sampling, processed=True))
        elif shape is not None:
            self.last_step_kind = "prefill_graph"
            logits = self.prefill_graph.run(shape, input_ids, positions, meta, logit_idx, len(batch.sample_rows))
        else:
            self.last_step_kind = "eager"
            if self.graph_runner is not None:
                self.graph_runner.last_run_used_graph = False
            self.attn.prepare(meta)
            logits = self.model(input_ids, positions, self.attn, logit_idx)
        self.runtime.after_step(batch)
        out = StepOutput(batch, None, None, None, unsampled=(logits, sampling, processing, token_dst),
                         grammar_rows=processing.mask_rows_host)
        if processing.mask_rows is None:
            self.sample_processed(out)
        return out

    def mask_buffer(self, rows: int) -> torch.Tensor:
        """Host memory for a step's grammar masks, `[rows, words]` int32, pinned on a GPU and the same from step to
        step (grown when a step has more rows): the host writes it after the step before was sampled, whose copy of
        it the stream had ordered before that step's tokens, which the host has by then."""
        words = bitmask_words(self.model_config.vocab_size)
        if self._mask_host is None or self._mask_host.shape[0] < rows:
            self._mask_host = torch.empty((max(rows, 8), words), dtype=torch.int32,
                                          pin_memory=self.device.type == "cuda")
        return self._mask_host[:rows]

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, proc: LogitsProcessing) -> StepLogprobs:
        rows, host_rows = proc.logprob_rows, proc.logprob_rows_host
        if use_triton(logits):  # one read of each asking row (kernels/sampling.py)
            return StepLogprobs(host_rows, fused_sampling.token_logprobs_packed(logits, rows, tokens, proc.top_n),
                                proc.top_n)
        if len(host_rows) == tokens.numel():  # every row asks: no gathered copy of the logits
            return StepLogprobs.pack(host_rows, *token_logprobs(logits, tokens, proc.top_n))
        return StepLogprobs.pack(host_rows, *token_logprobs(logits[rows], tokens[rows], proc.top_n))

    @torch.inference_mode()
    def sample_processed(self, out: StepOutput, bitmask: torch.Tensor | None = None) -> None:
        """Process a launched step's logits, sample, write the tokens to the token table and start their copy to
        the host (with the logprobs asked for). The logits are a graph's shared buffer or the step's own: either
        way nothing else writes them before this, which the stream orders after the forward."""
        logits, sampling, proc, token_dst = out.unsampled
        out.unsampled = None
        if bitmask is not None:  # built on the host while the forward ran (Engine._sample_launched)
            proc.bitmask = bitmask.to(self.device, non_blocking=True)  # from pinned memory: no staging copy
        with use_options(self.config.kernels):  # the fused sampler's switches, as in `forward`
            process_logits(logits, proc, self.penalties)
            tokens = sample(logits, sampling)
            if proc.logprob_rows is not None:
                out.logprobs = self._logprobs(logits, tokens, proc)
        self.store_tokens(token_dst, tokens)
        if proc.penalty_rows is not None:
            self.penalties.count(proc.penalty_slots, tokens[proc.penalty_rows])
        out.tokens_device = tokens
        self._to_host(out, copy=False)
