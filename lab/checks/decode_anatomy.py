"""Where a batch-1 decode step's time goes, by taking parts out of it (issue 29: 0.6B at 0.86 ms against a 0.6 target).

Under PDL a profiler's kernel times overlap (a kernel's span includes its wait for the one before), so they do not
say what each part costs the step. Here the step's CUDA graph (bs 1, greedy: the forward, the argmax, the token
write) is captured again with one part replaced by nothing (no kernel at all: the norms and the RoPE hand back
their inputs, the attention its query, a matmul an uninitialised buffer of its output's shape), and replayed back to
back on the live request's buffers (a 1,024-token context). `full - no_X` is what part X costs the step.
More probes: the decode attention in one split (a program per kv head over the whole context, no merge
launch); kernel options a launch reads (each captured graph keeps its own): PDL off, the decode splits at one wave
of SMs, the splits merged in the first launch, the early keys and the early metadata off, the GEMV's early weight
tiles at 0 and 3; the layers as the norm fold runs them (the engine's default since run29; the parts above are
the unfolded layer's, the engine being built with the fold off), alone, with the merge in the first launch, and
with each norm's rstd taken from its row in the GEMV after, not from the sums of squares the GEMV before added up
(kernel option gemv_fold_sum_squares off; run31 measured it as `folded_sums` against `folded`), and with the
MLP's activation in every program of the down GEMV (kernel option gemv_act_epilogue off; run32 measured it as
`folded` against `folded_act`), and with the next weight tile loaded before the current one's products (kernel
option gemv_prefetch), and with the GEMV's K loop pipelined through shared memory, 2 and 3 stages (kernel option
gemv_stages), and with the o GEMV asking L2 for 8 and 24 MiB of the MLP's weights (kernel option gemv_mlp_prefetch_mb),
and with each decode program asking L2 for the next layer's first key tile (kernel option decode_prefetch_next_kv).
`option_us` gives each against `full` (negative: faster). (run27 also took the L2 prefetch of
commit 96611da, since removed.)

Then chains: each matmul kind's GEMVs (the model's own weights, every layer's in turn) replayed as one graph with
one input, so each weight comes from HBM once: per-launch time and the bandwidth it reaches (a kind whose K loop
runs twice or more also with that loop in 3 stages, `<kind>_stages3`); and a chain of
RMSNorms on one row (the bare cost of a kernel boundary under PDL).

Last, boundaries: a layer's four GEMVs over every layer in one graph, each program writing the global timer when it
began, when its PDL wait returned and when it ended (gemv(stamps=)). Per launch kind, against the launch before
it: how early its programs became resident, how long after that launch's end its wait returned, how long its last
programs trailed. Where a GEMV loses its 2-5 us a launch (run32, Qwen3-8B) says which fix could win it back.
And the step itself stamped (`step_stamps`): the engine's batch-1 graph at its defaults with every GEMV and
decode-attention program stamped, each launch against the one before it, the attention's stage 1 by split.

    python -m lab.checks.decode_anatomy --out DIR [--models qwen3-0.6b,qwen3-8b]   # writes DIR/decode_anatomy.json
                                                                                   # (default: Qwen3-0.6B alone)
        [--parts step,chains,boundaries,step_stamps]                               # (default: all four)

The outputs of a step with a part taken out are garbage; only the times are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from lab.checks import per_model_main
from lab.engines import decoding_request, gemv_kinds, step_graph, step_replay_us, with_engine
from lab.timing import capture, time_replay_us

PROMPT_LEN = 1024
# The parts are the unfolded layer's: with the norm fold (on by default since run29) each norm runs inside a GEMV
# and cannot be taken out alone. The engine is built unfolded; the probes in FOLDED wrap its layers as the fold does
# (GemvNormLayer, linked) for their capture only.
UNFOLDED = {"gemv_norm_fold": False}
FOLDED = ("folded", "folded_fused_merge", "folded_row_rstd", "folded_down_act", "folded_prefetch", "folded_stages2",
          "folded_stages3", "folded_mlp_prefetch8", "folded_mlp_prefetch24", "folded_prefetch_next_kv")
ITERS = 15
PER = 10  # replays between a pair of events


def _variants() -> dict:
    """name -> (patches, kernel option changes)."""
    from minisgl.kernels.gemv import GemvLinear, GemvMLP
    from minisgl.models.layers import RMSNorm, RotaryEmbedding

    def empty(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(rows, cols, dtype=like.dtype, device=like.device)  # no kernel

    def no_norm(self, x, residual=None):
        return x if residual is None else (x, residual)

    def no_rope(self, q, k, positions, q_norm=None, k_norm=None):
        return q, k

    def no_linear(self, x):
        return empty(x.shape[0], self.out_features, x)

    def no_mlp(self, x):
        return empty(x.shape[0], x.shape[1], x)

    def no_lm_head(self, x):
        if self.out_features > 100_000:
            return empty(x.shape[0], self.out_features, x)
        return real_linear(self, x)

    real_linear = GemvLinear.forward
    norm, rope = [(RMSNorm, "forward", no_norm)], [(RotaryEmbedding, "forward", no_rope)]
    attention = [("attn", "forward", lambda q, k, v, layer_id: q)]
    gemv = [(GemvLinear, "forward", no_linear), (GemvMLP, "forward", no_mlp)]
    return {
        "full": ([], {}),
        "no_norm": (norm, {}),
        "no_rope": (rope, {}),
        "no_attention": (attention, {}),
        "no_norm_rope": (norm + rope, {}),
        "no_gemv": (gemv, {}),
        "no_lm_head": ([(GemvLinear, "forward", no_lm_head)], {}),
        "gemv_only": (norm + rope + attention, {}),
        "one_split": ([("attn", "num_splits_for", lambda bs: 1)], {}),  # one program per kv head, no merge launch
        "no_pdl": ([], {"pdl": False}),
        # kernel options a launch reads (so each captured graph keeps its own): the step with each lever moved
        "waves1": ([], {"decode_split_waves": 1}),
        "fused_merge": ([], {"decode_fused_merge": True}),
        "no_early_kv": ([], {"early_kv": False}),
        "no_early_metadata": ([], {"early_metadata": False}),
        "gemv_early_tiles0": ([], {"gemv_pdl_early_tiles": 0}),
        "gemv_early_tiles3": ([], {"gemv_pdl_early_tiles": 3}),
        # the engine's default layers (the norm fold), and the one launch a layer that could go next (the merge)
        "folded": ([], {}),
        "folded_fused_merge": ([], {"decode_fused_merge": True}),
        # folded, each norm's rstd from its row, read by every program of the GEMV after (the default till run31)
        "folded_row_rstd": ([], {"gemv_fold_sum_squares": False}),
        # folded, the MLP's activation in every program of the down GEMV (the default till run32), not in the gate_up
        # GEMV's epilogue
        "folded_down_act": ([], {"gemv_act_epilogue": False}),
        # folded, each GEMV program's next weight tile loaded before the current tile's products (kernel option
        # gemv_prefetch: only GEMVs whose K loop runs twice or more, e.g. Qwen3-8B's down projection)
        "folded_prefetch": ([], {"gemv_prefetch": True}),
        # folded, the same loops pipelined by Triton through shared memory instead (kernel option gemv_stages)
        "folded_stages2": ([], {"gemv_stages": 2}),
        "folded_stages3": ([], {"gemv_stages": 3}),
        # folded, the o GEMV asking L2 for the MLP's weights while the attention runs (gemv_mlp_prefetch_mb)
        "folded_mlp_prefetch8": ([], {"gemv_mlp_prefetch_mb": 8}),
        "folded_mlp_prefetch24": ([], {"gemv_mlp_prefetch_mb": 24}),
        # folded, each decode program asking L2 for the next layer's keys at its first tile (decode_prefetch_next_kv)
        "folded_prefetch_next_kv": ([], {"decode_prefetch_next_kv": True}),
    }


@contextlib.contextmanager
def _folded(model, on: bool) -> Iterator[None]:
    """The model's decoder layers as the norm fold runs them (GemvNormLayer around each, sharing its modules, linked
    as use_gemv links them), for the block; the layers themselves come back after it."""
    if not on:
        yield
        return
    from torch import nn

    from minisgl.kernels.gemv import GemvNormLayer, link_norm_layers
    layers = model.layers
    model.layers = nn.ModuleList(GemvNormLayer(layer) for layer in layers)
    link_norm_layers(list(model.layers))
    try:
        yield
    finally:
        model.layers = layers


@contextlib.contextmanager
def _patched(patches: list, attn) -> Iterator[None]:
    saved = []
    try:
        for owner, name, fn in patches:
            target = attn if owner == "attn" else owner
            saved.append((target, name, target.__dict__.get(name, None), name in target.__dict__))
            setattr(target, name, fn)
        yield
    finally:
        for target, name, old, had in reversed(saved):
            if had:
                setattr(target, name, old)
            else:
                delattr(target, name)


def step_anatomy(llm) -> dict:
    """The batch-1 graph's replay time at the defaults and with each part taken out, on a live request."""
    from minisgl.kernels.options import use_options
    from minisgl.models.decoder import DecoderLayer

    runner = llm.engine.runner
    req = decoding_request(llm, PROMPT_LEN)
    out: dict = {"context_tokens": PROMPT_LEN + len(req.output_ids), "replay_us": {}}
    variants = _variants()
    if not all(type(layer) is DecoderLayer for layer in runner.model.layers):  # a hybrid model: no fold
        variants = {name: v for name, v in variants.items() if name not in FOLDED}
    for round_ in range(2):
        for name, (patches, kernel) in variants.items():
            options = dataclasses.replace(llm.config.kernels, **kernel)
            with _patched(patches, runner.attn), _folded(runner.model, name in FOLDED), use_options(options):
                us = step_replay_us(llm, iters=ITERS, per=PER)
            out["replay_us"].setdefault(name, []).append(round(us, 2))
            print(f"round {round_} {name}: {us:.1f} us", flush=True)
    best = {name: min(v) for name, v in out["replay_us"].items()}
    # a part taken out (no kernel option moved): what it costs; every other probe but the baselines: its change
    removed = {name for name, (_, kernel) in variants.items() if name.startswith("no_") and not kernel}
    out["cost_us"] = {name[3:]: round(best["full"] - best[name], 2) for name in removed}
    out["option_us"] = {name: round(us - best["full"], 2) for name, us in best.items()
                        if name not in removed and name not in ("full", "gemv_only")}
    return out


def chains(llm) -> dict:
    """Each GEMV kind's launches over every layer's weight as one graph (one input row): time a launch and the
    bandwidth it reaches; and 256 RMSNorms of one row chained (a kernel boundary's bare cost under PDL)."""
    from minisgl.kernels import elementwise as ew
    from minisgl.kernels.gemv import gemv, loop_tiles
    from minisgl.kernels.options import use_options

    model = llm.engine.runner.model
    out: dict = {}
    with use_options(llm.config.kernels):
        for kind, mods in gemv_kinds(model).items():
            k = mods[0].in_features
            x = torch.randn(1, k, dtype=mods[0].weight.dtype, device=mods[0].weight.device)

            def run(mods=mods, x=x):
                return [gemv(x, m.weight, m.bias, tiles=m.tiles) for m in mods]

            nbytes = mods[0].weight.numel() * mods[0].weight.element_size()
            arms = [(kind, llm.config.kernels)]
            if loop_tiles(k, mods[0].tiles[1], llm.config.kernels.gemv_pdl_early_tiles) >= 2:  # under PDL
                arms.append((f"{kind}_stages3", dataclasses.replace(llm.config.kernels, gemv_stages=3)))
            for name, options in arms:
                with use_options(options):
                    graph, _ = capture(run)
                    us = time_replay_us(graph, iters=ITERS, warmups=3) / len(mods)
                out[name] = {"launches": len(mods), "shape": list(mods[0].weight.shape), "tiles": list(mods[0].tiles),
                             "us_per_launch": round(us, 2), "tb_per_s": round(nbytes / us / 1e6, 3)}
                print("chain", name, out[name], flush=True)
        w = torch.ones(model.cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        x0 = torch.randn(1, model.cfg.hidden_size, dtype=torch.bfloat16, device="cuda")

        def norms():
            x = x0
            for _ in range(256):
                x = ew.rms_norm(x, w, 1e-6)
            return x

        graph, _ = capture(norms)
        out["rms_norm_1row"] = {"launches": 256, "us_per_launch": round(time_replay_us(graph, iters=ITERS) / 256, 3)}
        print("chain rms_norm", out["rms_norm_1row"], flush=True)
    return out


def _boundary(prev, cur) -> dict:
    """One launch against the launch before it in a stamped chain: [programs, STAMP_FIELDS] int64 (ns) each."""
    prev_end = int(prev[:, 2].max())
    begin, wait, end = cur[:, 0], cur[:, 1], cur[:, 2]
    per_sm = torch.bincount(cur[:, 3]).max()
    return {
        # how long before the launch before it ended its first program began (negative: after)
        "first_begin_lead_us": (prev_end - int(begin.min())) / 1e3,
        "median_begin_lead_us": (prev_end - float(begin.double().quantile(0.5))) / 1e3,
        "began_before_prev_end": float((begin < prev_end).float().mean()),  # share of its programs
        # from the launch before's last program ending to this launch's first wait returning, and its median's
        "release_us": (int(wait.min()) - prev_end) / 1e3,
        "median_release_us": (float(wait.double().quantile(0.5)) - prev_end) / 1e3,
        "span_us": (int(end.max()) - prev_end) / 1e3,  # this launch's share of the chain
        "tail_us": (int(end.max()) - float(end.double().quantile(0.9))) / 1e3,  # its last tenth of programs
        "most_programs_an_sm": int(per_sm),
        # a program's own work after its wait: the slowest program's and the median program's
        "work_max_us": int((end - wait).max()) / 1e3,
        "work_median_us": float((end - wait).double().quantile(0.5)) / 1e3,
    }


def boundaries(llm, samples: int = 5) -> dict:
    """A layer's GEMVs as the engine launches them (qkv, o, gate_up with the activation in its epilogue, down; the
    norm fold and attention left out), over every layer, in one graph with every program stamped (gemv(stamps=)):
    when each launch's programs began before the one before it ended, when their PDL wait returned, how long its
    last programs trailed. By launch kind: the median over layers and `samples` replays. The stamped graph is timed
    against the same graph unstamped (what the stamps cost)."""
    from minisgl.kernels.gemv import STAMP_FIELDS, gemv, gemv_programs
    from minisgl.kernels.options import use_options

    model = llm.engine.runner.model
    kinds = gemv_kinds(model)
    order = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    if not all(kind in kinds for kind in order):
        return {"skipped": f"not every layer GEMV takes the GEMV: {sorted(kinds)}"}
    with use_options(llm.config.kernels):
        act_out = llm.config.kernels.gemv_act_epilogue and kinds["gate_up_proj"][0].max_rows >= 1  # as GemvMLP's
        layers = list(zip(*(kinds[kind] for kind in order)))
        dev, dt = layers[0][0].weight.device, layers[0][0].weight.dtype
        x_h = torch.randn(1, layers[0][0].in_features, dtype=dt, device=dev)
        x_o = torch.randn(1, layers[0][1].in_features, dtype=dt, device=dev)
        launches = []  # (kind, module, silu_mul_out, stamps)
        for layer in layers:
            for kind, m in zip(order, layer):
                out = act_out and kind == "gate_up_proj"
                programs = gemv_programs(m.out_features, m.tiles, out)
                stamps = torch.zeros(programs, STAMP_FIELDS, dtype=torch.int64, device=dev)
                launches.append((kind, m, out, stamps))

        def run(stamped: bool):
            act = None
            for kind, m, out, stamps in launches:
                x = {"o_proj": x_o, "down_proj": act}.get(kind, x_h)  # down reads gate_up's output
                y = gemv(x, m.weight, m.bias, tiles=m.tiles, silu_mul_out=out,
                         silu_mul=kind == "down_proj" and not act_out, stamps=stamps if stamped else None)
                act = y if kind == "gate_up_proj" else act

        result: dict = {"layers": len(layers), "act_epilogue": act_out, "replay_us": {}}
        for stamped in (False, True):
            graph, _ = capture(lambda stamped=stamped: run(stamped))
            result["replay_us"]["stamped" if stamped else "plain"] = round(time_replay_us(graph, iters=ITERS), 2)
        rows: dict = {}
        steps = []
        for _ in range(samples):
            graph.replay()
            torch.cuda.synchronize()
            stamps = [s.cpu() for *_, s in launches]
            steps.extend(torch.diff(torch.cat([s[:, :3].flatten() for s in stamps]).unique()).tolist())
            _add_boundaries(rows, [kind for kind, *_ in launches], stamps)
    result["timer_step_ns"] = min(steps) if steps else None  # the global timer's resolution, as seen
    result["by_kind"] = {}
    for kind, m, _, stamps in launches[:len(order)]:
        result["by_kind"][kind] = {"programs": stamps.shape[0], "tiles": list(m.tiles),
                                   "weight_mb": round(m.weight.numel() * m.weight.element_size() / 1e6, 2),
                                   **_medians(rows[kind])}
    print("boundaries", result, flush=True)
    return result


def _add_boundaries(rows: dict, kinds: list[str], stamps: list[torch.Tensor]) -> None:
    """One replay's stamped launches, each against the one before it (`_boundary`): its values appended to
    rows[its kind][key]."""
    for j in range(1, len(stamps)):
        for key, value in _boundary(stamps[j - 1], stamps[j]).items():
            rows.setdefault(kinds[j], {}).setdefault(key, []).append(value)


def _medians(values: dict) -> dict:
    """key -> the median of its values (3 decimals)."""
    return {key: round(float(torch.tensor(v, dtype=torch.float64).quantile(0.5)), 3) for key, v in values.items()}


def step_stamps(llm, samples: int = 5) -> dict:
    """The engine's batch-1 step as it runs at its defaults (the layers folded), captured with every GEMV and
    decode-attention program stamped (gemv(stamps=), decode_attention(stamps=)): by launch kind, the median over
    layers and `samples` replays of each launch against the stamped launch before it (`_boundary`: how early its
    programs began, how long after that launch's end its wait returned, its share of the chain, its programs' own
    work after the wait); stage 1 of the attention by split too (the split holding the new token stores its key and
    value before its products; splits past the context hold no key). The stamped step's replay against the same
    step unstamped says what the stamps cost."""
    import minisgl.attention.triton_backend as backend
    import minisgl.kernels.gemv as gv
    from minisgl.engine.cuda_graph import CudaGraphRunner  # its _record, patched to see which graph is captured
    from minisgl.kernels.attention import STAGE1_STAMP_FIELDS, decode_programs
    from minisgl.kernels.options import current_options, use_options

    runner = llm.engine.runner
    names = {tuple(m.weight.shape): kind for kind, mods in gemv_kinds(runner.model).items() for m in mods}
    launches: list = []  # (kind, stamps, splits) of the greedy batch-1 graph's capture, in launch order
    recording: list = [None]  # the key of the graph being captured
    real_launch, real_attention, real_record = gv._launch, backend.decode_attention, CudaGraphRunner._record

    def stamps_for(kind: str, programs: int, device, splits: int = 0) -> torch.Tensor:
        fields = STAGE1_STAMP_FIELDS if kind == "attention_stage1" else gv.STAMP_FIELDS
        stamps = torch.empty(programs, fields, dtype=torch.int64, device=device)  # every row is written
        if recording[0] == (1, "greedy"):
            launches.append((kind, stamps, splits))
        return stamps

    def launch(x, weight, bias, tiles, **kw):
        n, k = weight.shape
        programs = gv.gemv_programs(n, tiles or gv.gemv_config(n, k, gv.table_for(x.device)),
                                    kw.get("silu_mul_out", False))
        kw["stamps"] = stamps_for(names.get((n, k), f"{n}x{k}"), programs, x.device)
        return real_launch(x, weight, bias, tiles, **kw)

    def attention(q, k_buf, *args, num_splits, **kw):
        fused = kw.get("fused_merge")
        fused = current_options().decode_fused_merge if fused is None else fused
        p1, p2 = decode_programs(q.shape[0], q.shape[1], k_buf.shape[1], num_splits, fused)
        s1 = stamps_for("attention_stage1", p1, q.device, num_splits)
        s2 = stamps_for("attention_stage2", p2, q.device) if p2 else None
        return real_attention(q, k_buf, *args, num_splits=num_splits, **kw, stamps=(s1, s2))

    def record(self, key, *args):
        recording[0] = key
        try:
            return real_record(self, key, *args)
        finally:
            recording[0] = None

    live = runner.graph_runner
    if int(live.seq_lens[0]) <= PROMPT_LEN:  # no request decoding at PROMPT_LEN yet (this part run alone): one
        decoding_request(llm, PROMPT_LEN)
    patches = [(gv, "_launch", launch), (backend, "decode_attention", attention), (CudaGraphRunner, "_record", record)]
    result: dict = {"context_tokens": int(live.seq_lens[0]), "replay_us": {}}
    rows: dict = {}
    by_split: dict = {}
    with _folded(runner.model, True), use_options(llm.config.kernels), contextlib.ExitStack() as stack:
        result["replay_us"]["plain"] = round(step_replay_us(llm, iters=ITERS, per=PER), 2)
        with _patched(patches, None):  # only the capture is stamped
            step = stack.enter_context(step_graph(llm))
        result["replay_us"]["stamped"] = round(time_replay_us(step, iters=ITERS, warmups=3, per=PER), 2)
        for _ in range(samples):
            step.replay()
            torch.cuda.synchronize()
            stamps = [s.cpu() for _, s, _ in launches]
            _add_boundaries(rows, [kind for kind, _, _ in launches], stamps)
            for (kind, _, splits), s in zip(launches, stamps):
                if kind == "attention_stage1":  # [kv heads, splits] programs of one request
                    for name, phase in _stage1_phases(s).items():
                        median = phase.view(-1, splits).double().quantile(0.5, dim=0) / 1e3
                        by_split.setdefault(name, []).append(median)
    result["launches"] = [kind for kind, _, _ in launches]
    result["by_kind"] = {kind: _medians(values) for kind, values in rows.items()}
    # stage 1 by split: the median over kv heads, layers and replays of each phase (_stage1_phases)
    result["stage1_us_by_split"] = {name: [round(v, 3) for v in torch.stack(medians).quantile(0.5, dim=0).tolist()]
                                    for name, medians in by_split.items()}
    print("step_stamps", result, flush=True)
    return result


def _stage1_phases(s: torch.Tensor) -> dict:
    """A stage-1 launch's stamps (decode_attention's STAGE1_STAMP_FIELDS a program) as each program's phases (ns):
    how long before its wait it began, then from the wait to its q ready, to its early key tile in registers (0 if
    it was there first), to the tile's softmax done, to its products with the values done, to its end; and its work
    from the wait to its end."""
    begin, wait, end, _, q, kv, soft, out = s.unbind(1)
    return {"lead": wait - begin, "work": end - wait, "q": q - wait, "early_tile": (kv - q).clamp(min=0),
            "softmax": soft - torch.maximum(q, kv), "values": out - soft, "store": end - out}


def _recorded(probe, llm) -> dict:
    """A new probe's result, or the error it raised, in the JSON (the older probes' results are kept either way)."""
    try:
        return probe(llm)
    except Exception as e:  # noqa: BLE001 - recorded, not hidden
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


PARTS = {"step": step_anatomy, "chains": chains, "boundaries": boundaries, "step_stamps": step_stamps}


def main() -> None:
    per_model_main("decode_anatomy", __doc__, lambda name, parts: with_engine(
        name, lambda llm: {part: PARTS[part](llm) if part in ("step", "chains") else _recorded(PARTS[part], llm)
                           for part in parts},
        kernel=UNFOLDED, max_model_len=4096, kv_memory_fraction=0.3), parts=tuple(PARTS))


if __name__ == "__main__":
    main()
