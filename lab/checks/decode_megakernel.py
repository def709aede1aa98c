"""The decode-layers kernel (minisgl/kernels/decode_layers.py, kernel option `decode_megakernel`) on a live request.

On a live Qwen3-0.6B request (a 1,024-token prompt decoded a few steps) the kernel's hidden state and residual
after the last layer are compared with the engine's eager forward of the same step (the layers one launch per
op; also `engine_layers` below, the same ops spelled out, against that forward), then timed: the layers alone
and a whole step (embedding, the kernel, the final norm, the lm_head GEMV, the argmax) against the engine's own
(its layers captured as a graph, and its live batch-1 decode graph), at 1, 2 and the most programs an SM holds:
the engine's choices, then one change each: registers capped at 168 and 128 (more programs an SM), no weights
loaded before each barrier, none a tile ahead, the splits merged in a phase of their own; on a card with a tuned
GEMV table, also the GEMV rule's narrower tiles (fewer registers, other bits). Each arm is a cooperative launch
(the driver refuses a grid that cannot all be resident) and is timed only if its output is within 5% of the
engine's.

    python -m lab.checks.decode_megakernel --out DIR      # DIR/decode_megakernel.json (a CUDA GPU, sm_90+)
"""

from __future__ import annotations

import torch

from lab.checks import per_model_main
from minisgl.kernels.decode_layers import DecodeLayersKernel, DecodeStep, LayerStack, resident_per_sm

PROMPT_LEN = 1024
ITERS = 15
PER = 10

try:
    import triton
except ImportError:  # a CPU install without Triton: main() says so
    triton = None


def engine_layers(w: LayerStack, step: DecodeStep, x: torch.Tensor,
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


def layer_tiles(model) -> dict:
    """The GEMV tiles the engine resolved for each projection (gemv_config's rule where it kept cuBLAS)."""
    from minisgl.kernels.gemv import gemv_config

    a, mlp = model.layers[0].self_attn, model.layers[0].mlp
    mods = {"qkv": a.qkv_proj, "o": a.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    return {k: tuple(getattr(m, "tiles", None) or gemv_config(*m.weight.shape)) for k, m in mods.items()}


def measure(llm) -> dict:
    from lab.timing import capture, time_graph_or_eager, time_replay_us
    from minisgl.kernels.gemv import gemv_config
    from minisgl.kernels.options import use_options

    runner = llm.engine.runner
    model, attn = runner.model, runner.attn
    step, live = live_request(llm)
    tiles = layer_tiles(model)
    stacked = LayerStack.of(model.layers, share=False)  # the live graphs read the weights where they are
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

        def time_arm(mega: DecodeLayersKernel) -> dict:
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

        # registers as the compiler takes them (255: two programs an SM) or capped (more programs an SM); the
        # weights loaded before each barrier (prefetch) and a tile ahead (ahead), each also off; and, where the
        # card has a tuned GEMV table, the GEMV rule's narrower tiles (fewer registers; other bits than the engine's)
        rule = {k: gemv_config(*m.shape[1:]) for k, m in (("qkv", stacked.qkv), ("o", stacked.o),
                                                            ("gate_up", stacked.gate_up), ("down", stacked.down))}
        # (prefetch, maxnreg, ahead, merge_last, tiles): the engine's choices first, then one change each
        variants = [(True, None, True, True, "engine"), (True, 168, True, True, "engine"),
                    (True, 128, True, True, "engine"), (False, None, True, True, "engine"),
                    (True, None, False, True, "engine"), (True, None, True, False, "engine")]
        if rule != tiles:
            variants += [(True, None, True, True, "rule"), (True, 168, True, True, "rule")]
        out["rule_tiles"] = rule
        for prefetch, maxnreg, ahead, merge_last, tile_set in variants:
            these = tiles if tile_set == "engine" else rule
            key = (f"{'prefetch' if prefetch else 'no_prefetch'}_{'ahead' if ahead else 'no_ahead'}_"
                   f"{'merge_last' if merge_last else 'merge_phase'}_{maxnreg or 'any'}_regs"
                   f"{'' if tile_set == 'engine' else '_rule_tiles'}")
            options = dict(prefetch=prefetch, maxnreg=maxnreg, ahead=ahead, merge_last=merge_last)
            kernel = DecodeLayersKernel(stacked, step, these, sms, **options).compile()
            limit = resident_per_sm(kernel)
            out["kernels"][key] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
                                   "shared": kernel.metadata.shared, "resident_per_sm": limit}
            for per_sm in sorted({1, 2, min(limit, 4)} & set(range(1, min(limit, 4) + 1))):
                arm = {"programs": sms * per_sm, **options, "tiles": tile_set}
                try:  # a launch the driver refuses is this arm's result, not the end of the check
                    arm.update(time_arm(DecodeLayersKernel(stacked, step, these, sms * per_sm, cooperative=True,
                                                           **options)))
                except RuntimeError as e:
                    arm["error"] = str(e)[:300]
                label = f"{key}_{per_sm}_per_sm"
                out["arms"][label] = arm
                print(label, arm, flush=True)
        attn.prepare_for_replay(live._meta(1))
    out["engine_layers_us_per_layer"] = round(out["engine_layers_us"] / n_layers, 3)
    return out


def main() -> None:
    if triton is None:
        print("decode_megakernel: needs Triton, nothing to measure")
        return
    from lab.engines import with_engine

    per_model_main("decode_megakernel", __doc__, lambda name: with_engine(name, measure, max_model_len=4096,
                                                                           kv_memory_fraction=0.3), min_capability=9)


if __name__ == "__main__":
    main()
