"""A model's batch-1 GEMV chain in one persistent kernel with grid barriers, against the engine's launches (issue 29).

run27's anatomy put 612 us of Qwen3-0.6B's 1,016 us batch-1 step (H100) in its GEMVs alone, chained as the
engine runs them: one launch per matmul under PDL, each loading its first weight tiles before it waits. The
four matmul kinds of a layer stream 30 MB, 10 us at 3 TB/s, yet the chain took ~18.6 us a layer. Is the rest
the kernel boundaries, and does one persistent kernel do better? Here the same chain runs both ways, on
stacked random weights at the model's shapes (every layer's qkv, o, gate_up, down with its SiLU-and-mul fold):

- `launches`: the engine's `gemv()` launches with the engine's tiles for this card, PDL on, one CUDA graph;
- `persistent`: one launch of `programs` resident programs running every matmul of every layer in turn, program
  p taking tiles p, p + programs, ... of each, a grid barrier between matmuls (the decode-layers kernel's
  helpers, minisgl/kernels/decode_layers.py: `_matmul`, `_barrier_loading`); with `prefetch`, each program loads
  its first weight tile of the next matmul *before* the barrier (weights are never written), as the GEMV's early
  tiles do before their PDL wait; each tile's first weight block is loaded while the tile before it computes
  (`_matmul`'s AHEAD, as the decode-layers kernel runs it in the engine).

With the engine's tiles both use the engine's GEMV tile arithmetic (`minisgl.kernels.gemv._gemv_tile`, same
tiles, same K order), so the final vector should match to the bit (`bit_equal`); the tile shapes are also swept
(twice and half the rows a tile: more bytes in flight a program, or fewer registers and more programs an SM),
with the prefetch on and off, at 1, 2 and the most programs an SM holds. The figures are us a layer and the
bandwidth reached. The stand-in for attention: the o matmul reads the q part of the qkv output, so no attention
kernel is timed.

    python -m lab.checks.persistent_gemv --out DIR [--models qwen3-0.6b,qwen3-8b]   # DIR/persistent_gemv.json

A grid barrier needs every program resident at once: the persistent arms run only at programs per SM that the
compiled kernel's registers and shared memory allow, and a spin that never ends gives up (the values then fail
the comparison) rather than hang.
"""

from __future__ import annotations

import torch

from lab.checks import per_model_main
from lab.models import text_config

ITERS = 20

try:
    import triton
    import triton.language as tl

    from minisgl.kernels.decode_layers import SPIN_LIMIT, _barrier_loading, _first_w, _matmul, resident_per_sm
except ImportError:  # a CPU install: main() says so
    triton = None


if triton is not None:
    @triton.jit
    def _chain_kernel(Wqkv, Wo, Wgu, Wd, H, QKV, OUT_O, GU, Counter, layers,
                      N_QKV, K_QKV, N_O, K_O, N_GU, K_GU, N_D, K_D,
                      BN_QKV: tl.constexpr, BK_QKV: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
                      BN_GU: tl.constexpr, BK_GU: tl.constexpr, BN_D: tl.constexpr, BK_D: tl.constexpr,
                      PREFETCH: tl.constexpr, SPIN: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        s_qkv = tl.cast(N_QKV, tl.int64) * K_QKV
        s_o = tl.cast(N_O, tl.int64) * K_O
        s_gu = tl.cast(N_GU, tl.int64) * K_GU
        s_d = tl.cast(N_D, tl.int64) * K_D
        # the first weight block of each program's first tile of the next matmul, loaded before the barrier
        # (PREFETCH); without it nothing is loaded early and the tile reads all its blocks after the barrier
        w = _first_w(Wqkv, pid, N_QKV, K_QKV, BN_QKV, BK_QKV)
        done = 0  # barriers passed
        for layer in range(layers):
            off = tl.cast(layer, tl.int64)
            _matmul(Wqkv + off * s_qkv, H, QKV, N_QKV, K_QKV, pid, P, w, BN_QKV, BK_QKV, False, PREFETCH, AHEAD=True)
            done += 1
            w_o = _barrier_loading(Counter, done * P, SPIN, None, 0, False, Wo + off * s_o, pid, N_O, K_O, w,
                                   BN_O, BK_O, PREFETCH, False)
            _matmul(Wo + off * s_o, QKV, OUT_O, N_O, K_O, pid, P, w_o, BN_O, BK_O, False, PREFETCH, AHEAD=True)
            done += 1
            w_gu = _barrier_loading(Counter, done * P, SPIN, None, 0, False, Wgu + off * s_gu, pid, N_GU, K_GU, w,
                                    BN_GU, BK_GU, PREFETCH, False)
            _matmul(Wgu + off * s_gu, OUT_O, GU, N_GU, K_GU, pid, P, w_gu, BN_GU, BK_GU, False, PREFETCH, AHEAD=True)
            done += 1
            w_d = _barrier_loading(Counter, done * P, SPIN, None, 0, False, Wd + off * s_d, pid, N_D, K_D, w,
                                   BN_D, BK_D, PREFETCH, False)
            _matmul(Wd + off * s_d, GU, H, N_D, K_D, pid, P, w_d, BN_D, BK_D, True, PREFETCH, AHEAD=True)
            nxt = tl.cast(tl.minimum(layer + 1, layers - 1), tl.int64)
            done += 1
            w = _barrier_loading(Counter, done * P, SPIN, None, 0, False, Wqkv + nxt * s_qkv, pid, N_QKV, K_QKV, w,
                                 BN_QKV, BK_QKV, PREFETCH, False)

def shapes(name: str) -> dict:
    """The layer's matmuls (N, K) and the layer count of a model in lab.models."""
    c = text_config(name)
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q = heads * head_dim
    return {"layers": c["num_hidden_layers"],
            "qkv": (q + 2 * kv_heads * head_dim, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def make_weights(sh: dict, seed: int = 0, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Stacked random bf16 weights [layers, N, K], scaled by 1/sqrt(K) so the vector keeps its size along the chain."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for kind in ("qkv", "o", "gate_up", "down"):
        n, k = sh[kind]
        w = torch.empty(sh["layers"], n, k, dtype=torch.bfloat16, device=device)
        out[kind] = w.normal_(0.0, k ** -0.5, generator=g)
    return out


def gemv_chain(ws: dict, h0: torch.Tensor, tiles: dict) -> torch.Tensor:
    """The engine's path: one gemv() launch per matmul (PDL as the kernel options say); the final vector."""
    from minisgl.kernels.gemv import gemv

    k_o = ws["o"].shape[2]
    h = h0[None]
    for layer in range(ws["qkv"].shape[0]):
        qkv = gemv(h, ws["qkv"][layer], tiles=tiles["qkv"])
        o = gemv(qkv[:, :k_o], ws["o"][layer], tiles=tiles["o"])
        gu = gemv(o, ws["gate_up"][layer], tiles=tiles["gate_up"])
        h = gemv(gu, ws["down"][layer], silu_mul=True, tiles=tiles["down"])
    return h[0]


class PersistentChain:
    """The persistent kernel and its buffers: `run()` resets them and launches it once (the final vector, H)."""

    def __init__(self, ws: dict, h0: torch.Tensor, tiles: dict, programs: int, prefetch: bool) -> None:
        self.ws, self.h0, self.tiles, self.programs, self.prefetch = ws, h0, tiles, programs, prefetch
        self.h = torch.empty_like(h0)
        self.bufs = [torch.empty(ws[k].shape[1], dtype=h0.dtype, device=h0.device) for k in ("qkv", "o", "gate_up")]
        self.counter = torch.zeros(1, dtype=torch.int32, device=h0.device)

    def _launch(self, warmup: bool = False):
        ws, t = self.ws, self.tiles
        dims = [d for k in ("qkv", "o", "gate_up", "down") for d in ws[k].shape[1:]]
        args = (ws["qkv"], ws["o"], ws["gate_up"], ws["down"], self.h, *self.bufs, self.counter, ws["qkv"].shape[0],
                *dims)
        kw = dict(BN_QKV=t["qkv"][0], BK_QKV=t["qkv"][1], BN_O=t["o"][0], BK_O=t["o"][1],
                  BN_GU=t["gate_up"][0], BK_GU=t["gate_up"][1], BN_D=t["down"][0], BK_D=t["down"][1],
                  PREFETCH=self.prefetch, SPIN=SPIN_LIMIT, launch_cooperative_grid=True,  # all resident, or an error
                  num_warps=t["qkv"][2])  # one kernel runs every matmul: one warp count (measure() records it)
        if warmup:
            return _chain_kernel.warmup(*args, grid=(self.programs,), **kw)
        return _chain_kernel[(self.programs,)](*args, **kw)

    def compile(self):
        """The compiled kernel, loaded but not launched (its registers say how many programs fit an SM)."""
        kernel = self._launch(warmup=True)
        kernel._init_handles()
        return kernel

    def run(self) -> torch.Tensor:
        self.h.copy_(self.h0)
        self.counter.zero_()
        self._launch()
        return self.h


def measure(name: str) -> dict:
    from lab.timing import capture, time_graph_or_eager, time_replay_us
    from minisgl.kernels.gemv import gemv_config, table_for

    sh = shapes(name)
    ws = make_weights(sh)
    dev = torch.device("cuda")
    tiles = {k: gemv_config(*sh[k], table_for(dev)) for k in ("qkv", "o", "gate_up", "down")}
    nbytes = sum(w.numel() * w.element_size() for w in ws.values())
    h0 = torch.randn(sh["qkv"][1], dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def figures(us: float) -> dict:
        return {"us_per_layer": round(us / sh["layers"], 3), "tb_per_s": round(nbytes / us / 1e6, 3)}

    graph, ref = capture(lambda: gemv_chain(ws, h0, tiles))
    row = {"shapes": sh, "tiles": tiles, "num_warps": tiles["qkv"][2], "weight_bytes": nbytes,
           "launches": figures(time_replay_us(graph, iters=ITERS)), "persistent": {}, "kernels": {}}
    ref = ref.clone()
    print(name, "launches", row["launches"], flush=True)
    # the engine's tiles, twice and half the rows a tile: a resident program keeps more bytes in flight, or
    # needs fewer registers and more programs fit an SM
    variants = {"engine": tiles, "wide": {k: (bn * 2, bk, w) for k, (bn, bk, w) in tiles.items()},
                "narrow": {k: (max(1, bn // 2), bk, w) for k, (bn, bk, w) in tiles.items()}}
    for variant, prefetch in [(v, p) for v in variants for p in (True, False)]:
        key = f"{variant}{'' if prefetch else '_no_prefetch'}"
        kernel = PersistentChain(ws, h0, variants[variant], sms, prefetch).compile()
        limit = resident_per_sm(kernel)  # a grid barrier hangs unless every program is resident
        row["kernels"][key] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                               "shared": kernel.metadata.shared, "resident_per_sm": limit}
        for per_sm in sorted({1, 2, min(limit, 4)} & set(range(1, min(limit, 4) + 1))):
            label = f"{key}_{per_sm}_per_sm"
            arm = {"tiles": variant, "programs": sms * per_sm, "prefetch": prefetch}
            try:  # a launch the driver refuses is this arm's result, not the end of the check
                chain = PersistentChain(ws, h0, variants[variant], sms * per_sm, prefetch)
                out = chain.run().clone()
                torch.cuda.synchronize()
                err = float((out.float() - ref.float()).norm() / ref.float().norm())
                arm.update(bit_equal=bool(torch.equal(out, ref)), relative_error=err)
                if err < 0.05:  # else a barrier let a program read before its inputs were written: no time to take
                    us, arm["timed_as"] = time_graph_or_eager(chain.run, iters=ITERS)
                    arm.update(figures(us))
            except RuntimeError as e:
                arm["error"] = str(e)[:300]
            row["persistent"][label] = arm
            print(name, label, arm, flush=True)
    return row


def main() -> None:
    if triton is None:
        print("persistent_gemv: needs Triton, nothing to measure")
        return
    per_model_main("persistent_gemv", __doc__, measure, min_capability=9, extra={"spin_limit": SPIN_LIMIT})


if __name__ == "__main__":
    main()
