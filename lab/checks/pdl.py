"""Check and time programmatic dependent launch (kernels/pdl.py) on a CUDA GPU (sm_90+; written for the H200).

A decode-like chain of minisgl's kernels at Qwen3-0.6B shapes (per layer: RMSNorm, the qkv GEMV, q/k norm + RoPE,
the K/V store (fused into decode attention on even layers, a store_kv launch first on odd ones), decode attention
with split merge, the o GEMV, fused add + RMSNorm, the gate_up GEMV, the down GEMV with SiLU-and-mul folded in,
and a torch op between layers; then the final norm, an LM-head GEMV, the fused sampler and a torch argmax) is
captured in one CUDA graph with PDL on and in another with PDL off (separate KV buffers, the same weights). Both
are replayed with fresh inputs each time, the new K/V slots poisoned with NaN before every replay, so a kernel
that read before its predecessor finished would see stale or NaN data: every output (final hidden state, logits,
sampled and greedy tokens, the stored K/V rows) must be bitwise equal between the two graphs, replay after replay.
The chain also runs eagerly both ways (outside a graph, PDL launches go straight to the stream) and is compared.
With PDL on, the GEMV runs with up to 3, with 1 and with no weight tiles loaded before its wait (the
gemv_pdl_early_tiles option).
Then the graphs are timed (interleaved rounds, CUDA events around each batch of replays).

    python -m lab.checks.pdl --out pdl_check.json [--replays 200] [--layers 8]

Exits non-zero if any comparison fails, or if PDL is not active on this GPU / Triton (nothing would be tested).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from lab.engines import kernel_options
from lab.timing import time_replay_us
from minisgl.kernels import elementwise as ew
from minisgl.kernels import gemv as gv
from minisgl.kernels import pdl
from minisgl.kernels.attention import decode_attention, decode_num_splits, decode_workspace_numel
from minisgl.kernels.options import current_options
from minisgl.kernels.sampling import fused_sample

DEV = torch.device("cuda")
BF = torch.bfloat16
HIDDEN, HQ, HKV, D, INTER, VOCAB = 1024, 16, 8, 128, 3072, 32768
MAX_CONTEXT = 4096
EPS = 1e-6


class Weights:
    def __init__(self, layers: int, gen: torch.Generator) -> None:
        def w(*shape, scale=None):
            scale = scale if scale is not None else shape[-1] ** -0.5
            return (torch.randn(*shape, generator=gen, device=DEV) * scale).to(BF)

        self.layers = [dict(ln1=1 + w(HIDDEN, scale=0.1), qkv=w((HQ + 2 * HKV) * D, HIDDEN), qn=1 + w(D, scale=0.1),
                            kn=1 + w(D, scale=0.1), o=w(HIDDEN, HQ * D), ln2=1 + w(HIDDEN, scale=0.1),
                            gate_up=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER)) for _ in range(layers)]
        self.final_norm = 1 + w(HIDDEN, scale=0.1)
        self.lm_head = w(VOCAB, HIDDEN)
        pos = torch.arange(MAX_CONTEXT, device=DEV, dtype=torch.float32)
        inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=DEV, dtype=torch.float32) / D))
        ang = pos[:, None] * inv[None, :]
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()


class State:
    """One graph's static inputs and buffers: input hidden state, positions, K/V pool, slot table, workspace."""

    def __init__(self, bs: int, layers: int, seq_lens: list[int], gen: torch.Generator) -> None:
        self.bs = bs
        num_slots = bs * MAX_CONTEXT + 16
        self.k = [torch.randn(num_slots, HKV, D, generator=gen, device=DEV).to(BF) for _ in range(layers)]
        self.v = [torch.randn(num_slots, HKV, D, generator=gen, device=DEV).to(BF) for _ in range(layers)]
        perm = torch.randperm(num_slots - 16, generator=gen, device=DEV)[: bs * MAX_CONTEXT] + 16
        self.req_to_token = perm.view(bs, MAX_CONTEXT).to(torch.int32)
        self.rows = torch.arange(bs, device=DEV)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        self.positions = (self.seq_lens - 1).long()
        self.loc = self.req_to_token[self.rows, self.positions].long()
        self.x = torch.zeros(bs, HIDDEN, dtype=BF, device=DEV)
        splits = decode_num_splits(bs, HKV, MAX_CONTEXT, torch.cuda.get_device_properties(DEV).multi_processor_count)
        self.splits = splits
        self.workspace = torch.zeros(max(1, decode_workspace_numel(bs, HQ, D, splits, HKV)), dtype=torch.float32,
                                     device=DEV)
        self.temps = torch.full((bs,), 0.8, device=DEV)
        self.top_ks = torch.full((bs,), 50, dtype=torch.int64, device=DEV)
        self.top_ps = torch.full((bs,), 0.9, device=DEV)
        self.seeds = torch.arange(bs, device=DEV) + 11
        self.steps = torch.zeros(bs, dtype=torch.int64, device=DEV)

    def poison_new_slots(self) -> None:
        for k, v in zip(self.k, self.v):
            k[self.loc] = float("nan")
            v[self.loc] = float("nan")

    def new_rows(self) -> list[torch.Tensor]:
        return [torch.cat([k[self.loc], v[self.loc]]) for k, v in zip(self.k, self.v)]


def chain(w: Weights, s: State) -> dict[str, torch.Tensor]:
    """The decode-like chain on s's static buffers; its outputs."""
    x, residual = s.x, None
    for i, lw in enumerate(w.layers):
        if residual is None:
            h, residual = ew.rms_norm(x, lw["ln1"], EPS), x
        else:
            h, residual = ew.fused_add_rms_norm(x, residual, lw["ln1"], EPS)
        qkv = gv.gemv(h, lw["qkv"])
        q = qkv[:, : HQ * D].view(s.bs, HQ, D)
        k = qkv[:, HQ * D: (HQ + HKV) * D].view(s.bs, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(s.bs, HKV, D)
        q, k = ew.norm_and_rope(q, k, s.positions, w.cos_sin, lw["qn"], lw["kn"], EPS,
                                q_out=torch.empty(s.bs, HQ, D, dtype=BF, device=DEV))
        out = torch.empty(s.bs, HQ, D, dtype=BF, device=DEV)
        if i % 2 == 0:  # the decode kernel stores the new K/V itself
            decode_attention(q, s.k[i], s.v[i], s.req_to_token, s.rows, s.seq_lens, out, D ** -0.5,
                             max_seq_len=MAX_CONTEXT, workspace=s.workspace, new_kv=(k, v, s.loc))
        else:  # a store_kv launch, then attention reads the slot it just wrote
            ew.store_kv(s.k[i], s.v[i], s.loc, k, v)
            decode_attention(q, s.k[i], s.v[i], s.req_to_token, s.rows, s.seq_lens, out, D ** -0.5,
                             max_seq_len=MAX_CONTEXT, workspace=s.workspace)
        o = gv.gemv(out.view(s.bs, HQ * D), lw["o"])
        h, residual = ew.fused_add_rms_norm(o, residual, lw["ln2"], EPS)
        x = gv.gemv(gv.gemv(h, lw["gate_up"]), lw["down"], silu_mul=True)
        x = x * 1.0 if i % 3 == 2 else x  # now and then a torch kernel between two PDL launches
    h, _ = ew.fused_add_rms_norm(x, residual, w.final_norm, EPS)
    logits = gv.gemv(h, w.lm_head)
    tokens = fused_sample(logits, s.temps, s.top_ks, s.top_ps, None, s.seeds, s.steps, cuts=True)
    return {"hidden": h, "logits": logits, "tokens": tokens, "greedy": logits.argmax(-1)}


def capture(fn, dot_path: str | None = None):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if dot_path:
        graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    if dot_path:
        graph.debug_dump(dot_path)
    return graph, out


def programmatic_edges(dot_path: str) -> dict:
    """What the graph's DOT dump says about edge types (informational: the dump format is CUDA's, not ours)."""
    try:
        text = Path(dot_path).read_text()
    except OSError as exc:
        return {"error": repr(exc)}
    lower = text.lower()
    return {"kernel_nodes": lower.count("kernel_node") or lower.count("kernel"),
            "mentions_programmatic": lower.count("programmatic"), "bytes": len(text)}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8) if a.dtype == BF else a,
                                                   b.view(torch.uint8) if b.dtype == BF else b))


def compare(outs_a: dict, outs_b: dict, rows_a: list, rows_b: list) -> list[str]:
    bad = [k for k in outs_a if not same(outs_a[k], outs_b[k])]
    bad += [f"kv_rows_layer{i}" for i, (a, b) in enumerate(zip(rows_a, rows_b)) if not same(a, b)]
    nan = [k for k, t in outs_a.items() if t.is_floating_point() and bool(torch.isnan(t).any())]
    return bad + [f"nan_in_{k}" for k in nan]


def run_case(w: Weights, bs: int, layers: int, seq_lens: list[int], replays: int, early: int) -> dict:
    with kernel_options(gemv_pdl_early_tiles=early):
        return _run_case(w, bs, layers, seq_lens, replays, early)


def _run_case(w: Weights, bs: int, layers: int, seq_lens: list[int], replays: int, early: int) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(bs)
    states, graphs, dots = {}, {}, {}
    for label, on in (("pdl", True), ("no_pdl", False)):
        gen.manual_seed(bs)  # the same pool contents, slot tables and inputs in both
        states[label] = State(bs, layers, seq_lens, gen)
        dot = f"/tmp/pdl_check_bs{bs}_{label}.dot" if early else None
        with kernel_options(pdl=on):  # the graph keeps the launches made under it
            graphs[label] = capture(lambda s=states[label]: chain(w, s), dot)
        if dot:
            dots[label] = programmatic_edges(dot)
    active = bool(pdl.pdl_launch(states["pdl"].x))
    mismatches = []
    in_gen = torch.Generator(device=DEV).manual_seed(1000 + bs)
    for r in range(replays):
        x = torch.randn(bs, HIDDEN, generator=in_gen, device=DEV).to(BF)
        for label in graphs:
            s = states[label]
            s.x.copy_(x)
            s.steps.fill_(r)
            s.poison_new_slots()
            graphs[label][1]["hidden"].fill_(float("nan"))
            graphs[label][0].replay()
        torch.cuda.synchronize()
        bad = compare(graphs["pdl"][1], graphs["no_pdl"][1], states["pdl"].new_rows(), states["no_pdl"].new_rows())
        if bad:
            mismatches.append({"replay": r, "outputs": bad})
    # eager, both ways, on the last replay's input
    eager = {}
    for label, on in (("pdl", True), ("no_pdl", False)):
        states[label].poison_new_slots()
        with kernel_options(pdl=on):
            eager[label] = (chain(w, states[label]), states[label].new_rows())
    torch.cuda.synchronize()
    eager_bad = compare(eager["pdl"][0], eager["no_pdl"][0], eager["pdl"][1], eager["no_pdl"][1])
    # timing: interleaved rounds of `iters` replays each
    times = {label: [] for label in graphs}
    for _ in range(7):
        for label, (g, _) in graphs.items():
            times[label].append(time_replay_us(g, iters=1, warmups=0, per=100))
    us = {label: statistics.median(t) for label, t in times.items()}
    return {"bs": bs, "layers": layers, "seq_lens": seq_lens, "splits": states["pdl"].splits, "early_weights": early,
            "pdl_active": active, "replays": replays, "graph_mismatches": mismatches[:20],
            "graph_replays_mismatched": len(mismatches), "eager_mismatches": eager_bad,
            "us_per_replay": us, "graph_dot": dots, "us_saved_per_replay": us["no_pdl"] - us["pdl"],
            "ok": active and not mismatches and not eager_bad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    cap = torch.cuda.get_device_capability(DEV)
    res = {"device": torch.cuda.get_device_name(DEV), "capability": list(cap),
           "triton_supports_pdl": pdl.triton_supports_pdl(), "default_pdl": current_options().pdl, "cases": []}
    gen = torch.Generator(device=DEV).manual_seed(0)
    w = Weights(a.layers, gen)
    res["gemv_table"] = {f"{n},{k}": v for (n, k), v in gv.device_table(torch.cuda.get_device_name(DEV)).items()}
    for bs, seq_lens in ((1, [700]), (4, [300, 1100, 2500, 4000])):
        for early in (gv.MAX_EARLY_TILES, 1, 0):
            case = run_case(w, bs, a.layers, seq_lens, a.replays, early)
            res["cases"].append(case)
            print({k: v for k, v in case.items() if k != "graph_mismatches"}, flush=True)
            torch.cuda.empty_cache()
    res["ok"] = all(c["ok"] for c in res["cases"])
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("ok" if res["ok"] else "FAILED", flush=True)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
