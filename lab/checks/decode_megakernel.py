"""Every decoder layer of a batch-1 decode step in one persistent kernel (issue 29's route to 0.6 ms, a prototype).

A batch-1 step of Qwen3-0.6B is ~260 dependent launches; run27's anatomy put ~60% of its 1,016 us (H100) in
links rather than bytes. Here the 28 layers run in one launch of resident programs, six phases a layer with a
grid barrier after each (lab.checks.persistent_gemv's `_grid_barrier`):

1. input RMSNorm + qkv projection (the GEMV with the norm folded in: every program computes the row's rstd from
   its exact sum of squares; program 0 writes the new residual);
2. attention, one work item per (kv head, split): Qwen3's q/k norms and the RoPE on q and the new k (the fused
   RoPE's `norm_rope_full`), the new K/V stored, the split's keys read through the token table (the decode
   kernel's online softmax, its helpers), partial outputs and log-sum-exps written;
3. the splits merged, one item per q head (the decode kernel's `_merge_head`);
4. o projection;
5. post-attention RMSNorm + gate_up projection (folded as in 1);
6. down projection with the SiLU-and-mul folded in.

Before each GEMV phase's barrier every program loads its first weight block of that phase (weights are never
written). The engine's helpers do the arithmetic, with the engine's tiles and split count, so the layers' output
and the residual should equal the engine's own forward to the bit; the check says whether they do.

    python -m lab.checks.decode_megakernel --out DIR      # DIR/decode_megakernel.json (a CUDA GPU, sm_90+)

On a live Qwen3-0.6B request (1,024-token prompt) it compares the kernel's hidden state and residual after the
last layer with the engine's eager forward of the same step, then times, as CUDA graphs on the same buffers, the
engine's batch-1 step (its live decode graph) against a step made of the embedding, this kernel, the final norm,
the lm_head GEMV and the argmax, at 1 and 2 programs an SM where they fit. A prototype to decide on: the engine
does not call it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPT_LEN = 1024
ITERS = 15
PER = 10

try:
    import triton
    import triton.language as tl

    from lab.checks.persistent_gemv import SPIN_LIMIT, _first_w, _grid_barrier, _matmul, resident_per_sm
    from minisgl.kernels.attention import (
        _LOG2E,
        _decode_block_n,
        _decode_tile,
        _merge_head,
        _rope_cos_sin,
        _rope_heads_tile,
    )
except ImportError:  # a CPU install without Triton: main() says so
    triton = None


if triton is not None:
    @triton.jit
    def _attend(QKV, KL, VL, PartO, PartLse, WQN, WKN, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin,
                kvh, split, row0, qk_scale, eps, stride_cs, stride_kn, stride_kh, stride_r2t,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, IEEE_DOT: tl.constexpr):
        """One (kv head, split) of the decode kernel's stage 1 for request row 0, with the fused store and the fused
        RoPE (kernels/attention.py's `_decode_stage1_kernel`, ROPE and FUSED_STORE on, no PDL)."""
        GROUP: tl.constexpr = HQ // HKV
        seq_len = tl.load(SeqLens).to(tl.int32)
        split_len = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = tl.minimum(start + split_len, seq_len)
        offs_d = tl.arange(0, D)
        dmask = offs_d < D
        offs_g = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_g
        hmask = offs_g < GROUP
        if start < end:
            cos, sin, sign = _rope_cos_sin(Pos, CosSin, row0, stride_cs, D)
            if end == seq_len:  # this split holds the new token: store its K/V before reading any key
                slot = tl.load(OutLoc).to(tl.int64)
                kn = tl.reshape(_rope_heads_tile(QKV + (HQ + kvh) * D, 0, WKN, cos, sin, sign, eps, 1, 1, D, True),
                                (D,))
                tl.store(KL + slot * stride_kn + kvh * stride_kh + offs_d, kn.to(KL.dtype.element_ty))
                vn = tl.load(QKV + (HQ + HKV + kvh) * D + offs_d)
                tl.store(VL + slot * stride_kn + kvh * stride_kh + offs_d, vn.to(VL.dtype.element_ty))
                tl.debug_barrier()  # every thread's store before any thread's key loads (the decode kernel's reason)
            row = tl.load(ReqPoolIdx).to(tl.int64)
            q = _rope_heads_tile(QKV + kvh * GROUP * D, D, WQN, cos, sin, sign, eps, GROUP, BLOCK_H, D, True)
            q = q.to(KL.dtype.element_ty)
            m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
            for n0 in range(start, end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                nmask = offs_n < end
                slots = tl.load(ReqToToken + row * stride_r2t + offs_n, mask=nmask, other=0).to(tl.int64)
                m_i, l_i, acc = _decode_tile(q, m_i, l_i, acc, KL, VL, slots, nmask, kvh, stride_kn, stride_kh,
                                             stride_kn, stride_kh, offs_d, dmask, qk_scale, IEEE_DOT)
            o = acc / l_i[:, None]
            tl.store(PartO + heads[:, None] * (SPLITS * D) + split * D + offs_d[None, :], o,
                     mask=hmask[:, None] & dmask[None, :])
            tl.store(PartLse + heads * SPLITS + split, m_i + tl.log2(l_i), mask=hmask)

    @triton.jit
    def _layers_kernel(
        X, R0, R1, QKV, ATT, OUT_O, GU, PartO, PartLse, Counter,
        WLN1, WQKV, WQN, WKN, WO, WLN2, WGU, WD,
        KBuf, VBuf, layer_kv, ReqToToken, ReqPoolIdx, SeqLens, OutLoc, Pos, CosSin,
        layers, eps, qk_eps, qk_scale, stride_cs, stride_kn, stride_kh, stride_r2t, HIDDEN, INTER,
        HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, IEEE_DOT: tl.constexpr,
        BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
        BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
        PREFETCH: tl.constexpr, SPIN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        row0 = pid * 0  # request row 0, as a tensor: the decode helpers index with it
        N_QKV: tl.constexpr = (HQ + 2 * HKV) * D
        Q_SIZE: tl.constexpr = HQ * D
        hidden64 = tl.cast(HIDDEN, tl.int64)
        s_qkv = hidden64 * N_QKV
        s_o = hidden64 * Q_SIZE
        s_gu = hidden64 * 2 * INTER
        s_d = hidden64 * INTER
        # The residual stream alternates between R0 and R1 (a norm's programs read one while program 0 writes the
        # other): the input norm reads R0 (zeros before layer 0: x + 0 is x) and writes R1, the post-attention
        # norm reads R1 and writes R0. X holds the layer's input, then the down projection's output.
        w = _first_w(WQKV, pid, N_QKV, HIDDEN, BN_QKV, BK_QKV)
        done = 0  # barriers passed
        for layer in range(layers):
            lay = tl.cast(layer, tl.int64)
            # 1. input norm + qkv
            _matmul(WQKV + lay * s_qkv, X, QKV, N_QKV, HIDDEN, pid, P, w, BN_QKV, BK_QKV, False, PREFETCH,
                    R0, WLN1 + lay * HIDDEN, R1, eps, True)
            done += 1
            _grid_barrier(Counter, done * P, SPIN)
            # 2. attention, one (kv head, split) an item
            KL = KBuf + lay * layer_kv
            VL = VBuf + lay * layer_kv
            for item in range(pid, HKV * SPLITS, P):
                _attend(QKV, KL, VL, PartO, PartLse, WQN + lay * D, WKN + lay * D, ReqToToken, ReqPoolIdx, SeqLens,
                        OutLoc, Pos, CosSin, item // SPLITS, item % SPLITS, row0, qk_scale, qk_eps, stride_cs,
                        stride_kn, stride_kh, stride_r2t, HQ, HKV, D, SPLITS, BLOCK_N, BLOCK_H, IEEE_DOT)
            done += 1
            _grid_barrier(Counter, done * P, SPIN)
            # 3. the splits merged, one q head an item
            seq_len = tl.load(SeqLens).to(tl.int32)
            split_len = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
            n_valid = tl.cdiv(seq_len, tl.maximum(split_len, 1))
            for h in range(pid, HQ, P):
                _merge_head(PartO, PartLse, ATT, row0, h, n_valid, 0, SPLITS * D, D, 0, SPLITS, 0, D,
                            BLOCK_S=BLOCK_S, BLOCK_D=D, HEAD_DIM=D)
            w_o = _first_w(WO + lay * s_o, pid, HIDDEN, Q_SIZE, BN_O, BK_O) if PREFETCH else w
            done += 1
            _grid_barrier(Counter, done * P, SPIN)
            # 4. o projection
            _matmul(WO + lay * s_o, ATT, OUT_O, HIDDEN, Q_SIZE, pid, P, w_o, BN_O, BK_O, False, PREFETCH)
            w_gu = _first_w(WGU + lay * s_gu, pid, 2 * INTER, HIDDEN, BN_GU, BK_GU) if PREFETCH else w
            done += 1
            _grid_barrier(Counter, done * P, SPIN)
            # 5. post-attention norm + gate_up
            _matmul(WGU + lay * s_gu, OUT_O, GU, 2 * INTER, HIDDEN, pid, P, w_gu, BN_GU, BK_GU, False, PREFETCH,
                    R1, WLN2 + lay * HIDDEN, R0, eps, True)
            w_d = _first_w(WD + lay * s_d, pid, HIDDEN, INTER, BN_D, BK_D) if PREFETCH else w
            done += 1
            _grid_barrier(Counter, done * P, SPIN)
            # 6. down projection, SiLU-and-mul folded in
            _matmul(WD + lay * s_d, GU, X, HIDDEN, INTER, pid, P, w_d, BN_D, BK_D, True, PREFETCH)
            if PREFETCH:
                nxt = tl.cast(tl.minimum(layer + 1, layers - 1), tl.int64)
                w = _first_w(WQKV + nxt * s_qkv, pid, N_QKV, HIDDEN, BN_QKV, BK_QKV)
            done += 1
            _grid_barrier(Counter, done * P, SPIN)


@dataclass(frozen=True)
class StackedLayers:
    """A Qwen3 model's decoder-layer weights stacked by layer (copies), and the shapes the kernel needs."""

    ln1: torch.Tensor  # [L, hidden]
    qkv: torch.Tensor  # [L, (Hq + 2 Hkv) D, hidden]
    q_norm: torch.Tensor  # [L, D]
    k_norm: torch.Tensor
    o: torch.Tensor  # [L, hidden, Hq D]
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [L, 2 inter, hidden]
    down: torch.Tensor  # [L, hidden, inter]
    eps: float
    qk_eps: float
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, layers) -> StackedLayers:
        """From a model's DecoderLayers (models/decoder.py), whatever the GEMV swap made of their modules."""
        def stack(get):
            return torch.stack([get(layer).detach() for layer in layers]).contiguous()

        a = layers[0].self_attn
        return cls(ln1=stack(lambda m: m.input_layernorm.weight), qkv=stack(lambda m: m.self_attn.qkv_proj.weight),
                   q_norm=stack(lambda m: m.self_attn.q_norm.weight), k_norm=stack(lambda m: m.self_attn.k_norm.weight),
                   o=stack(lambda m: m.self_attn.o_proj.weight), ln2=stack(lambda m: m.post_attention_layernorm.weight),
                   gate_up=stack(lambda m: m.mlp.gate_up_proj.weight), down=stack(lambda m: m.mlp.down_proj.weight),
                   eps=layers[0].input_layernorm.eps, qk_eps=a.q_norm.eps, num_q_heads=a.num_q_heads,
                   num_kv_heads=a.num_kv_heads, head_dim=a.head_dim)


@dataclass
class StepInputs:
    """What the attention phase reads for request row 0: the pool's K and V buffers of every layer ([slots, Hkv, D]
    each, equally spaced in memory, as the pool's one tensor holds them), the token table, and the step's metadata
    tensors (one element each)."""

    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor  # [max_pos, D] fp32
    scale: float
    num_splits: int


def layer_spacing(buffers: list[torch.Tensor]) -> int:
    """Elements from one layer's buffer to the next's, the same for every layer (else an error)."""
    if len(buffers) < 2:
        return 0
    size = buffers[0].element_size()
    gaps = {(b.data_ptr() - a.data_ptr()) // size for a, b in zip(buffers, buffers[1:])}
    if len(gaps) != 1:
        raise ValueError("the layers' buffers are not equally spaced in memory")
    return gaps.pop()


def engine_layers(w: StackedLayers, step: StepInputs, x: torch.Tensor,
                  tiles: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layers through the engine's kernels, one launch each, in the order a decoder layer runs them with
    the Triton backend (models/decoder.py: norm, qkv GEMV, q/k norm + RoPE, decode attention with the fused store,
    o GEMV, norm, gate_up GEMV, down GEMV with the SiLU folded in): (hidden state, residual) after the last."""
    from minisgl.kernels import elementwise as ew
    from minisgl.kernels.attention import decode_attention
    from minisgl.kernels.gemv import gemv

    hq, hkv, d = w.num_q_heads, w.num_kv_heads, w.head_dim
    x, residual = x.reshape(1, -1), None
    for layer in range(w.ln1.shape[0]):
        if residual is None:
            residual, h = x, ew.rms_norm(x, w.ln1[layer], w.eps)
        else:
            h, residual = ew.fused_add_rms_norm(x, residual, w.ln1[layer], w.eps)
        q, k, v = gemv(h, w.qkv[layer], tiles=tiles["qkv"]).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d)
        q, k = ew.norm_and_rope(q, k, step.positions, step.cos_sin, w.q_norm[layer], w.k_norm[layer], w.qk_eps)
        out = torch.empty_like(q)
        decode_attention(q, step.k_buffers[layer], step.v_buffers[layer], step.req_to_token, step.req_pool_indices,
                         step.seq_lens, out, step.scale, num_splits=step.num_splits,
                         new_kv=(k, v, step.out_cache_loc))
        o = gemv(out.reshape(1, hq * d), w.o[layer], tiles=tiles["o"])
        h, residual = ew.fused_add_rms_norm(o, residual, w.ln2[layer], w.eps)
        x = gemv(gemv(h, w.gate_up[layer], tiles=tiles["gate_up"]), w.down[layer], silu_mul=True,
                 tiles=tiles["down"])
    return x[0], residual[0]


class Megakernel:
    """The kernel's buffers and launch: `run(x)` takes the embedding row x [hidden] and returns (hidden state,
    residual) after the last layer, what the model's final norm receives."""

    def __init__(self, w: StackedLayers, step: StepInputs, tiles: dict, programs: int, prefetch: bool = True,
                 maxnreg: int | None = None) -> None:
        """`maxnreg`: a cap on registers a thread (Triton's option), so more programs fit an SM (spilling the rest);
        4 warps always: the decode helpers' dots must keep the engine's operand layout (the same bits)."""
        self.w, self.step, self.tiles, self.programs, self.prefetch = w, step, tiles, programs, prefetch
        # a cooperative launch: the driver refuses a grid whose programs cannot all be resident at once, where a
        # plain launch would leave the barrier waiting for programs that never start
        self.options = {"num_warps": 4, "launch_cooperative_grid": True} | ({"maxnreg": maxnreg} if maxnreg else {})
        hidden, dev, dt = w.ln1.shape[1], w.ln1.device, w.ln1.dtype
        inter = w.down.shape[2]
        hq, d, splits = w.num_q_heads, w.head_dim, step.num_splits
        self.x, self.r0, self.r1 = (torch.zeros(hidden, dtype=dt, device=dev) for _ in range(3))
        self.qkv = torch.zeros(w.qkv.shape[1], dtype=dt, device=dev)
        self.att = torch.zeros(hq * d, dtype=dt, device=dev)
        self.o = torch.zeros(hidden, dtype=dt, device=dev)
        self.gu = torch.zeros(2 * inter, dtype=dt, device=dev)
        self.part_o = torch.zeros(hq * splits * d, dtype=torch.float32, device=dev)
        self.part_lse = torch.zeros(hq * splits, dtype=torch.float32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)

    def _launch(self, warmup: bool = False):
        w, s, t = self.w, self.step, self.tiles
        group = w.num_q_heads // w.num_kv_heads
        k0, v0 = s.k_buffers[0], s.v_buffers[0]
        layer_stride = layer_spacing(s.k_buffers)
        if layer_spacing(s.v_buffers) != layer_stride or v0.stride() != k0.stride():
            raise ValueError("the K and V buffers must share one layout")
        args = (self.x, self.r0, self.r1, self.qkv, self.att, self.o, self.gu, self.part_o, self.part_lse,
                self.counter, w.ln1, w.qkv, w.q_norm, w.k_norm, w.o, w.ln2, w.gate_up, w.down,
                k0, v0, layer_stride, s.req_to_token, s.req_pool_indices, s.seq_lens, s.out_cache_loc,
                s.positions, s.cos_sin, w.ln1.shape[0], w.eps, w.qk_eps, s.scale * _LOG2E, s.cos_sin.stride(0),
                k0.stride(0), k0.stride(1), s.req_to_token.stride(0), w.ln1.shape[1], w.down.shape[2])
        kw = dict(HQ=w.num_q_heads, HKV=w.num_kv_heads, D=w.head_dim, SPLITS=s.num_splits,
                  BLOCK_N=_decode_block_n(w.head_dim), BLOCK_H=max(16, triton.next_power_of_2(group)),
                  BLOCK_S=max(2, triton.next_power_of_2(s.num_splits)), IEEE_DOT=k0.dtype == torch.float32,
                  BN_QKV=t["qkv"][0], BK_QKV=t["qkv"][1], BN_O=t["o"][0], BK_O=t["o"][1],
                  BN_GU=t["gate_up"][0], BK_GU=t["gate_up"][1], BN_D=t["down"][0], BK_D=t["down"][1],
                  PREFETCH=self.prefetch, SPIN=SPIN_LIMIT, **self.options)
        if warmup:
            return _layers_kernel.warmup(*args, grid=(self.programs,), **kw)
        return _layers_kernel[(self.programs,)](*args, **kw)

    def compile(self):
        """The compiled kernel, loaded but not launched (its registers say how many programs fit an SM)."""
        kernel = self._launch(warmup=True)
        kernel._init_handles()
        return kernel

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x.reshape(-1))
        self.r0.zero_()
        self.counter.zero_()
        self._launch()
        return self.x, self.r0


def live_request(llm) -> tuple[StepInputs, object]:
    """A 1,024-token request decoded a few steps; the inputs of its last step, as the batch-1 graph holds them."""
    from minisgl import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    prompt = [(31 * j + 7) % 10000 for j in range(PROMPT_LEN)]
    req = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    while len(req.output_ids) < 8:
        engine.step()
    torch.cuda.synchronize()
    live, attn = runner.graph_runner, runner.attn
    step = StepInputs(k_buffers=list(attn.kv_cache.k_buffers), v_buffers=list(attn.kv_cache.v_buffers),
                      req_to_token=attn.req_to_token, req_pool_indices=live.req_pool_indices[:1],
                      seq_lens=live.seq_lens[:1], out_cache_loc=live.out_cache_loc[:1], positions=live.positions[:1],
                      cos_sin=runner.model.rotary.cos_sin, scale=attn.scale, num_splits=attn._num_splits(1))
    return step, live


def layer_tiles(model) -> dict:
    """The GEMV tiles the engine resolved for each projection (gemv_config's rule where it kept cuBLAS)."""
    from minisgl.kernels.gemv import gemv_config

    a, mlp = model.layers[0].self_attn, model.layers[0].mlp
    mods = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    return {k: tuple(getattr(m, "tiles", None) or gemv_config(*m.weight.shape)) for k, m in mods.items()}


def measure(llm) -> dict:
    from lab.timing import capture, time_graph_or_eager, time_replay_us
    from minisgl.kernels.options import use_options

    runner = llm.engine.runner
    model, attn = runner.model, runner.attn
    step, live = live_request(llm)
    tiles = layer_tiles(model)
    stacked = StackedLayers.of(model.layers)
    n_layers = len(model.layers)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out: dict = {"context_tokens": int(step.seq_lens.item()), "num_splits": step.num_splits, "tiles": tiles,
                 "gemv_warps": sorted({t[2] for t in tiles.values()}), "kernels": {}, "arms": {}}

    with use_options(llm.config.kernels):
        attn.prepare_for_replay(live._meta(1))
        x0 = model.embed_tokens(live.input_ids[:1]).clone()

        def layers():
            h, residual = x0, None
            for layer in model.layers:
                h, residual = layer(h, residual, live.positions[:1], model.rotary, attn)
            return h[0], residual[0]

        want_h, want_r = (t.clone() for t in layers())
        got_h, got_r = engine_layers(stacked, step, x0, tiles)
        out["reference_is_the_model"] = bool(torch.equal(got_h, want_h) and torch.equal(got_r, want_r))
        graph, _ = capture(layers)
        out["engine_layers_us"] = round(time_replay_us(graph, iters=ITERS, per=PER), 2)
        out["engine_step_us"] = round(time_replay_us(live.graphs[1, "greedy"], iters=ITERS, per=PER), 2)
        live.graphs[1, "greedy"].replay()
        want_token = live.outputs[1, "greedy"][:1].clone()
        print("engine: layers", out["engine_layers_us"], "us, step", out["engine_step_us"],
              "us; reference is the model:", out["reference_is_the_model"], flush=True)

        def time_arm(mega: Megakernel) -> dict:
            """The kernel's output against the engine's forward, then (when close) its times."""
            got_h, got_r = (t.clone() for t in mega.run(x0))
            torch.cuda.synchronize()
            err = float((got_h.float() - want_h.float()).norm() / want_h.float().norm())
            arm = {"bit_equal": bool(torch.equal(got_h, want_h) and torch.equal(got_r, want_r)),
                   "relative_error": err}
            if err >= 0.05:  # a barrier let a program read too early: nothing to time
                return arm
            us, arm["timed_as"] = time_graph_or_eager(lambda: mega.run(x0), iters=ITERS, per=PER)
            arm["layers_us"] = round(us, 2)
            arm["us_per_layer"] = round(us / n_layers, 3)

            def mega_step():
                h, residual = mega.run(model.embed_tokens(live.input_ids[:1]))
                h, _ = model.norm(h[None], residual[None])
                return model.lm_head(h).argmax(dim=-1)

            arm["same_token"] = bool(torch.equal(mega_step(), want_token))
            arm["step_us"] = round(time_graph_or_eager(mega_step, iters=ITERS, per=PER)[0], 2)
            return arm

        # the prefetch on and off; registers as the compiler takes them (255: two programs an SM), or capped
        for prefetch, maxnreg in ((True, None), (True, 168), (True, 128), (False, None)):
            key = f"{'prefetch' if prefetch else 'no_prefetch'}_{maxnreg or 'any'}_regs"
            kernel = Megakernel(stacked, step, tiles, sms, prefetch, maxnreg).compile()
            limit = resident_per_sm(kernel)
            out["kernels"][key] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                   "shared": kernel.metadata.shared, "resident_per_sm": limit}
            for per_sm in sorted({1, 2, min(limit, 4)} & set(range(1, min(limit, 4) + 1))):
                arm = {"programs": sms * per_sm, "prefetch": prefetch, "maxnreg": maxnreg}
                try:  # a launch the driver refuses is this arm's result, not the end of the check
                    arm.update(time_arm(Megakernel(stacked, step, tiles, sms * per_sm, prefetch, maxnreg)))
                except RuntimeError as e:
                    arm["error"] = str(e)[:300]
                label = f"{key}_{per_sm}_per_sm"
                out["arms"][label] = arm
                print(label, arm, flush=True)
        attn.prepare_for_replay(live._meta(1))
    out["engine_layers_us_per_layer"] = round(out["engine_layers_us"] / n_layers, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-0.6b", help="comma-separated Qwen3 models from lab.models")
    a = ap.parse_args()
    if triton is None or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("decode_megakernel: needs a CUDA GPU of sm_90 or newer, nothing to measure")
        return
    from lab.engines import with_engine
    from minisgl.bench.runner import environment

    res: dict = {"environment": environment(),
                 "command": f"python -m lab.checks.decode_megakernel --models {a.models}", "models": {}}
    path = Path(a.out) / "decode_megakernel.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        res["models"][name] = with_engine(name, measure, max_model_len=4096, kv_memory_fraction=0.3)
        path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
