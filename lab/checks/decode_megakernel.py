"""The decode-layers kernel (minisgl/kernels/decode_layers.py, kernel option `decode_megakernel`) on a live request.

On a live Qwen3-0.6B request (a 1,024-token prompt decoded a few steps): first the kernel over the first n layers,
n = 1, 2, ..., until its output differs, and that layer's buffers phase by phase (qkv, attention, o, gate_up, down,
both residuals) against the engine's ops (`engine_layers` below, the same ops as the model's eager forward, which it
is checked against). Then, for each set of GEMV tiles (the H200's tuned table; `wide`, ~16 KB a tile, sized for one
persistent program rather than many launched ones; `share`, one tile a program, its whole share of each matmul
loaded across the barrier before it), the engine's ops with those tiles timed as a graph, and the kernel with the
same tiles: its hidden state and residual after the last layer against those ops' (the same bits?), the layers
alone and a whole step (embedding, the kernel, the final norm, the lm_head GEMV, the argmax) timed, and each phase's
time from the kernel's own stamps; at two programs an SM: the engine's choices (merge_last), the splits merged in a
phase of their own, that with the attention's first key tiles read across the barrier before it (early_kv), and
that with every load across a barrier issued after the program's arrival (arrive_first).
Each arm is a cooperative launch (the driver refuses a grid that cannot all be resident) and is timed only if its
output is within 5% of its reference. (run28, H100: with every tile set the kernel was slower than the engine's ops
(906-1,111 us against 827-909), its barriers ~7.5 us a layer; layers 0-13 equal to the bit, layer 14's attention
one element off: reports/h100/run28.)

    python -m lab.checks.decode_megakernel --out DIR      # DIR/decode_megakernel.json (a CUDA GPU, sm_90+)
"""

from __future__ import annotations

import dataclasses

import torch

from lab.checks import per_model_main
from minisgl.kernels.decode_layers import DecodeLayersKernel, DecodeStep, LayerStack, resident_per_sm

LAYER_WEIGHTS = ("ln1", "qkv", "q_norm", "k_norm", "o", "ln2", "gate_up", "down")
PROMPT_LEN = 1024
ITERS = 15
PER = 10

try:
    import triton
except ImportError:  # a CPU install without Triton: main() says so
    triton = None


def engine_layers(w: LayerStack, step: DecodeStep, x: torch.Tensor, tiles: dict,
                  parts: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layers through the engine's kernels, one launch each, in the order a decoder layer runs them with
    the Triton backend (models/decoder.py: norm, qkv GEMV, q/k norm + RoPE, decode attention with the fused store,
    o GEMV, norm, gate_up GEMV, down GEMV with the SiLU folded in): (hidden state, residual) after the last. With
    `parts`, the last layer's intermediates go in it under the names of the kernel's buffers."""
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
        qkv = gemv(h, w.qkv[layer], tiles=tiles["qkv"])
        qkv_out = qkv.clone() if parts is not None else None  # the RoPE below rotates q and k in place
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d)
        q, k = ew.norm_and_rope(q, k, step.positions, step.cos_sin, w.q_norm[layer], w.k_norm[layer], w.qk_eps)
        out = torch.empty_like(q)
        decode_attention(q, step.k_buffers[layer], step.v_buffers[layer], step.req_to_token, step.req_pool_indices,
                         step.seq_lens, out, step.scale, num_splits=step.num_splits,
                         new_kv=(k, v, step.out_cache_loc))
        o = gemv(out.reshape(1, hq * d), w.o[layer], tiles=tiles["o"])
        r_attn = residual
        h, residual = ew.fused_add_rms_norm(o, residual, w.ln2[layer], w.eps)
        gu = gemv(h, w.gate_up[layer], tiles=tiles["gate_up"])
        x = gemv(gu, w.down[layer], silu_mul=True, tiles=tiles["down"])
        if parts is not None:  # the kernel's buffers: qkv before the q/k norm and RoPE, r1 the attention's residual
            parts.update(qkv=qkv_out[0], att=out.reshape(-1), o=o[0], gu=gu[0], x=x[0], r1=r_attn[0], r0=residual[0])
    return x[0], residual[0]


def live_request(llm) -> tuple[DecodeStep, object]:
    """A 1,024-token request decoded a few steps; the inputs of its last step, as the batch-1 graph holds them."""
    from lab.engines import decoding_request

    runner = llm.engine.runner
    decoding_request(llm, PROMPT_LEN)
    live, attn = runner.graph_runner, runner.attn
    step = DecodeStep(k_buffers=list(attn.kv_cache.k_buffers), v_buffers=list(attn.kv_cache.v_buffers),
                      req_to_token=attn.req_to_token, req_pool_indices=live.req_pool_indices[:1],
                      seq_lens=live.seq_lens[:1], out_cache_loc=live.out_cache_loc[:1], positions=live.positions[:1],
                      cos_sin=runner.model.rotary.cos_sin, scale=attn.scale, num_splits=attn.num_splits_for(1))
    return step, live


def wide_tiles(n: int, k: int) -> tuple[int, int, int]:
    """Tiles of ~16 KB of bf16 weights (the whole row up to 4,096 wide): what one persistent program streams a
    step, where the GEMV rule sizes tiles for many programs an SM."""
    block_k = min(triton.next_power_of_2(k), 4096)
    return max(1, min(8, 8192 // block_k)), block_k, 4


def share_tiles(n: int, k: int, programs: int, max_weights: int = 16384) -> tuple[int, int, int]:
    """Tiles that give each of `programs` programs one tile, its whole share of the matmul (the whole row wide),
    so PREFETCH has all of it in flight across the barrier before; at most `max_weights` a tile (32 KB of bf16),
    beyond which a program takes several (ptxas for sm_90 at Qwen3-0.6B's shapes: 255 registers and no spills;
    64 KB tiles spilled 300-760 bytes)."""
    block_k = triton.next_power_of_2(k)
    block_n = triton.next_power_of_2(-(-n // programs))
    while block_n > 1 and block_n * block_k > max_weights:
        block_n //= 2
    return block_n, block_k, 4


def layer_tiles(model) -> dict:
    """The GEMV tiles the engine resolved for each projection (gemv_config's rule where it kept cuBLAS)."""
    from minisgl.kernels.gemv import gemv_config

    a, mlp = model.layers[0].self_attn, model.layers[0].mlp
    mods = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    return {k: tuple(getattr(m, "tiles", None) or gemv_config(*m.weight.shape)) for k, m in mods.items()}


def prefix(w: LayerStack, n: int) -> LayerStack:
    """The first n layers of a stack."""
    return dataclasses.replace(w, **{name: getattr(w, name)[:n] for name in LAYER_WEIGHTS})


def first_difference(w: LayerStack, step: DecodeStep, x: torch.Tensor, tiles: dict, programs: int) -> dict:
    """The kernel over the first n layers against the engine's ops, n = 1, 2, ...: the first layer after which the
    hidden state or residual differs, how many elements do, and that layer's buffers phase by phase (qkv before
    its RoPE, attention, o, gate_up, down, the two residuals). The layer count is an argument of the kernel, not
    a constant: one compile."""
    for n in range(1, w.ln1.shape[0] + 1):
        parts: dict = {}
        ref_h, ref_r = engine_layers(prefix(w, n), step, x, tiles, parts)
        try:  # a launch the driver refuses is this part's result, not the end of the check
            mega = DecodeLayersKernel(prefix(w, n), step, tiles, programs, cooperative=True)
            got_h, got_r = mega.run(x)
            if x.is_cuda:
                torch.cuda.synchronize()
        except RuntimeError as e:
            return {"error": str(e)[:300]}
        if torch.equal(got_h, ref_h) and torch.equal(got_r, ref_r):
            continue
        mine = {"qkv": mega.qkv, "att": mega.att, "o": mega.o, "gu": mega.gu, "x": mega.x, "r1": mega.r1,
                "r0": mega.r0}
        return {"layer": n - 1, "phases": {name: {"elements_differ": int((mine[name] != ref).sum()),
                                                  "of": ref.numel(),
                                                  "max_abs_diff": float((mine[name].float() - ref.float()).abs().max())}
                                           for name, ref in parts.items()}}
    return {"layer": None}


def phase_profile(mega: DecodeLayersKernel, x: torch.Tensor, runs: int = 5) -> dict:
    """Where a run's time goes, from the kernel's own timestamps (`times`): for each phase of a layer, the median
    over layers (of the last of `runs` runs) of its critical path (last arrival at its barrier less the earliest
    departure from the one before), the barrier's wait after the last arrival, and the spread of departures; us."""
    for _ in range(runs):
        mega.run(x)
    torch.cuda.synchronize()
    t = mega.phase_times().view(mega.w.ln1.shape[0], -1, 3) / 1000  # [layer, phase, 3] us
    names = ["qkv", "attention", "o", "gate_up", "down"] if mega.merge_last else ["qkv", "attention", "merge", "o",
                                                                                   "gate_up", "down"]
    med = t.median(0).values
    return {"us_per_layer": round(float(t[..., :2].sum((1, 2)).mean()), 3),
            **{n: {"phase": round(float(med[i, 0]), 3), "barrier_wait": round(float(med[i, 1]), 3),
                   "departure_spread": round(float(med[i, 2]), 3)} for i, n in enumerate(names)}}


def measure(llm) -> dict:
    from lab.timing import capture, time_graph_or_eager, time_replay_us
    from minisgl.kernels.gemv import device_table, gemv_config
    from minisgl.kernels.options import use_options

    runner = llm.engine.runner
    model, attn = runner.model, runner.attn
    step, live = live_request(llm)
    tiles = layer_tiles(model)
    stacked = LayerStack.of(model.layers, share=False)  # the live graphs read the weights where they are
    n_layers = len(model.layers)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out: dict = {"context_tokens": int(step.seq_lens.item()), "num_splits": step.num_splits, "tiles": tiles,
                 "gemv_warps": sorted({t[2] for t in tiles.values()})}

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

        def time_arm(mega: DecodeLayersKernel, ref_h: torch.Tensor, ref_r: torch.Tensor) -> dict:
            """The kernel's output against the engine's ops with the same tiles, then (when close) its times."""
            got_h, got_r = (t.clone() for t in mega.run(x0))
            torch.cuda.synchronize()
            err = float((got_h.float() - ref_h.float()).norm() / ref_h.float().norm())
            arm = {"bit_equal": bool(torch.equal(got_h, ref_h) and torch.equal(got_r, ref_r)),
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

        # The first layer whose output differs, then its buffers phase by phase against the engine's ops
        out["first_difference"] = first_difference(stacked, step, x0, tiles, sms * 2)
        print("first difference:", out["first_difference"], flush=True)

        # Tile sets (the engine's own, on an H100 the GEMV's rule, ran in run28: slower than the H200 table's): the
        # H200's tuned table (wider K tiles); `wide`, ~16 KB a tile (a persistent program holds one or two tiles in
        # flight, where a launched GEMV has many programs an SM); `share`, one tile a program at two programs an SM
        # (its whole share in flight across the barrier). Each set's reference is the engine's ops with those tiles
        # (its bits), timed as a graph beside the kernel's arms.
        shapes = {k: tuple(m.shape[1:]) for k, m in (("qkv", stacked.qkv), ("o", stacked.o),
                                                       ("gate_up", stacked.gate_up), ("down", stacked.down))}
        h200 = device_table("NVIDIA H200")
        tile_sets = {"h200_table": {k: gemv_config(*nk, h200) for k, nk in shapes.items()},
                     "wide": {k: wide_tiles(*nk) for k, nk in shapes.items()},
                     "share": {k: share_tiles(*nk, 2 * sms) for k, nk in shapes.items()}}
        out["tile_sets"] = {}
        seen: list[dict] = []
        for set_name, these in tile_sets.items():
            if these in seen:
                continue
            seen.append(these)
            ref_h, ref_r = (t.clone() for t in engine_layers(stacked, step, x0, these))
            graph, _ = capture(lambda these=these: engine_layers(stacked, step, x0, these))
            record = {"tiles": these, "engine_layers_us": round(time_replay_us(graph, iters=ITERS, per=PER), 2),
                      "kernels": {}, "arms": {}}
            out["tile_sets"][set_name] = record
            print(set_name, these, "engine layers", record["engine_layers_us"], "us", flush=True)
            # (merge_last, arrive_first, early_kv) at two programs an SM: the engine's choices; the merge phase (run28:
            # faster than merge_last with every tile set); with the attention's first key tiles read across the
            # barrier before it; and with every load across a barrier issued after the arrival (a release waits for
            # the loads before it). (run28 at 32bf0a8: two tiles' weights ahead, and 168 registers with three
            # programs an SM, were slower with every tile set.)
            for merge_last, arrive_first, early_kv in ((True, False, False), (False, False, False),
                                                       (False, False, True), (False, True, True)):
                per_sm = 2
                key = (f"{'merge_last' if merge_last else 'merge_phase'}{'_early_kv' if early_kv else ''}"
                       f"{'_arrive_first' if arrive_first else ''}")
                options = dict(merge_last=merge_last, arrive_first=arrive_first, early_kv=early_kv)
                kernel = DecodeLayersKernel(stacked, step, these, sms, **options).compile()
                limit = resident_per_sm(kernel)
                record["kernels"][key] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                          "shared": kernel.metadata.shared, "resident_per_sm": limit}
                per_sm = min(per_sm, limit)
                arm = {"programs": sms * per_sm, **options}
                try:  # a launch the driver refuses is this arm's result, not the end of the check
                    arm.update(time_arm(DecodeLayersKernel(stacked, step, these, sms * per_sm, cooperative=True,
                                                           **options), ref_h, ref_r))
                except RuntimeError as e:
                    arm["error"] = str(e)[:300]
                if "layers_us" in arm:
                    arm["phases"] = phase_profile(DecodeLayersKernel(stacked, step, these, sms * per_sm,
                                                                     cooperative=True, times=True, **options), x0)
                record["arms"][f"{key}_{per_sm}_per_sm"] = arm
                print(set_name, key, per_sm, arm, flush=True)
        attn.prepare_for_replay(live._meta(1))
    out["engine_layers_us_per_layer"] = round(out["engine_layers_us"] / n_layers, 3)
    return out


def main() -> None:
    if triton is None:
        print("decode_megakernel: needs Triton, nothing to measure")
        return
    from lab.engines import with_engine

    # the layers it stands for are the unfolded ones (engine_layers): the engine's norms in launches of their own
    per_model_main("decode_megakernel", __doc__, lambda name: with_engine(name, measure,
                                                                           kernel={"gemv_norm_fold": False},
                                                                           max_model_len=4096,
                                                                           kv_memory_fraction=0.3), min_capability=9)


if __name__ == "__main__":
    main()
