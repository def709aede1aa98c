"""Check and time the Gated DeltaNet Triton kernels (minisgl/kernels/gdn.py) on a CUDA GPU (written for the H200).

Qwen3.5-0.8B's shapes: conv over 6144 channels with K = 4; 16 value heads, 16 key heads, Dk = Dv = 128; bf16
activations, fp32 delta-rule state. Each case compares the Triton op to its torch reference (run on the GPU in
fp32, TF32 off) -- outputs and the updated pool, including rows not in the batch -- and times the op with CUDA
events (median of repeated launches; in-place state updates are left to accumulate, which changes values,
not the work):

- conv decode (batches 1 / 64 / 256), conv prefill (1 x 2048, 8 x 512, a mixed batch with sequences shorter
  than K - 1);
- delta-rule decode (batches 1 / 64 / 256), eager and as a CUDA-graph replay (conv + delta rule of one layer
  captured together, replayed on fresh inputs and checked against the references);
- delta-rule prefill (1 x 2048, 8 x 512, mixed): the chunked kernel at each dot precision, and the recurrent
  kernel; a sweep of the chunked kernel's block / warps and of the decode kernel's block / warps (timings
  only, each config also checked).

    python -m lab.checks.gdn --out gdn.json [--quick]

Writes the JSON after every case (a crash keeps what ran). Exits 0 with a message (and a JSON saying so) on a
machine without CUDA; otherwise non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from lab.engines import kernel_options
from lab.timing import capture, time_replay_us, time_us
from minisgl.kernels import gdn
from minisgl.kernels.options import current_options

C, KW = 6144, 4  # conv channels (q, k, v: 2 * 16 * 128 + 16 * 128), kernel width
HK, HV, D = 16, 16, 128
DT = torch.bfloat16
DEFAULT_CONFIG = dataclasses.asdict(current_options().gdn)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any() or torch.isinf(out).any():
        return float("inf")
    return (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


def batch(lens: list[int], num_slots: int, gen: torch.Generator, dev: torch.device):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    cu[1:] = torch.cumsum(torch.tensor(lens, device=dev), 0)
    slots = (torch.randperm(num_slots - 1, generator=gen, device=dev)[: len(lens)] + 1).to(torch.int32)
    return cu, slots


def conv_inputs(lens, gen, dev):
    t = sum(lens)
    # x as the q/k/v slice of a bigger projection output (token stride > C), as the model produces it
    proj = torch.randn(t, C + 2 * HV, generator=gen, device=dev, dtype=DT)
    x = proj[:, :C]
    weight = (0.3 * torch.randn(C, KW, generator=gen, device=dev)).to(DT)
    num_slots = 2 * len(lens) + 2
    state = torch.randn(num_slots, C, KW - 1, generator=gen, device=dev, dtype=DT)
    cu, slots = batch(lens, num_slots, gen, dev)
    return x, weight, state, slots, cu


def gdr_inputs(lens, gen, dev):
    t = sum(lens)
    proj = torch.randn(t, (2 * HK + HV) * D + 64, generator=gen, device=dev, dtype=DT)
    q = proj[:, : HK * D].view(t, HK, D)
    k = proj[:, HK * D: 2 * HK * D].view(t, HK, D)
    v = proj[:, 2 * HK * D: (2 * HK + HV) * D].view(t, HV, D)
    g = -torch.nn.functional.softplus(torch.randn(t, HV, generator=gen, device=dev)) * 0.5  # fp32 log decays
    beta = torch.sigmoid(torch.randn(t, HV, generator=gen, device=dev)).to(DT)
    num_slots = 2 * len(lens) + 2
    state = 0.05 * torch.randn(num_slots, HV, D, D, generator=gen, device=dev)
    cu, slots = batch(lens, num_slots, gen, dev)
    return q, k, v, g, beta, state, slots, cu


def check_conv(name: str, lens: list[int], gen, dev, row: dict) -> None:
    x, weight, state, slots, cu = conv_inputs(lens, gen, dev)
    ref_state = state.clone()
    ref = gdn.causal_conv1d_ref(x, weight, None, ref_state, slots, cu)
    out = gdn.causal_conv1d(x, weight, None, state, slots, cu)
    torch.cuda.synchronize()
    row.update(out_rel_err=rel_err(out, ref), state_equal=bool(torch.equal(state, ref_state)))
    row["ok"] = row["out_rel_err"] < 2e-2 and row["state_equal"]
    us = time_us(lambda: gdn.causal_conv1d(x, weight, None, state, slots, cu))
    moved = 2 * x.numel() * 2 + 2 * len(lens) * C * (KW - 1) * 2
    row.update(us=us, gbps=moved / (us * 1e-6) / 1e9)


def check_gdr(name: str, lens: list[int], gen, dev, row: dict) -> None:
    q, k, v, g, beta, state, slots, cu = gdr_inputs(lens, gen, dev)
    ref_state = state.clone()
    ref = gdn.gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, cu)
    out = gdn.gated_delta_rule(q, k, v, g, beta, state, slots, cu)
    torch.cuda.synchronize()
    others = torch.ones(state.shape[0], dtype=torch.bool, device=dev)
    others[slots.long()] = False
    row.update(out_rel_err=rel_err(out, ref), state_rel_err=rel_err(state, ref_state),
               others_untouched=bool(torch.equal(state[others], ref_state[others])))
    row["ok"] = row["out_rel_err"] < 2e-2 and row["state_rel_err"] < 1e-2 and row["others_untouched"]
    us = time_us(lambda: gdn.gated_delta_rule(q, k, v, g, beta, state, slots, cu),
                 iters=20 if len(lens) < sum(lens) else 50)
    state_bytes = 2 * len(lens) * HV * D * D * 4
    row.update(us=us, state_gbps=state_bytes / (us * 1e-6) / 1e9, tokens_per_s=sum(lens) / (us * 1e-6))


def check_decode_graph(name: str, bs: int, gen, dev, row: dict) -> None:
    """One layer's decode step (conv, then the delta rule on its own inputs) captured in a CUDA graph; replayed
    three times on fresh inputs / slots written into the static buffers, each checked against the references."""
    lens = [1] * bs
    x, weight, conv_state, slots, cu = conv_inputs(lens, gen, dev)
    q, k, v, g, beta, state, _, _ = gdr_inputs(lens, gen, dev)
    num_slots = conv_state.shape[0]
    state = 0.05 * torch.randn(num_slots, HV, D, D, generator=gen, device=dev)

    def step():
        return gdn.causal_conv1d(x, weight, None, conv_state, slots, cu), \
            gdn.gated_delta_rule(q, k, v, g, beta, state, slots, cu)

    graph, outs = capture(step)  # compiled outside the capture
    worst_conv, worst_out, worst_state, ok = 0.0, 0.0, 0.0, True
    for _ in range(3):
        slots.copy_((torch.randperm(num_slots - 1, generator=gen, device=dev)[:bs] + 1).to(torch.int32))
        x.copy_(torch.randn(x.shape, generator=gen, device=dev, dtype=DT))
        for buf in (q, k, v):
            buf.copy_(torch.randn(buf.shape, generator=gen, device=dev, dtype=DT))
        ref_conv_state, ref_state = conv_state.clone(), state.clone()
        ref_conv = gdn.causal_conv1d_ref(x, weight, None, ref_conv_state, slots, cu)
        ref_out = gdn.gated_delta_rule_ref(q, k, v, g, beta, ref_state, slots, cu)
        graph.replay()
        torch.cuda.synchronize()
        worst_conv = max(worst_conv, rel_err(outs[0], ref_conv))
        worst_out = max(worst_out, rel_err(outs[1], ref_out))
        worst_state = max(worst_state, rel_err(state, ref_state))
        ok = ok and torch.equal(conv_state, ref_conv_state)
    row.update(conv_rel_err=worst_conv, out_rel_err=worst_out, state_rel_err=worst_state,
               conv_state_equal=bool(ok))
    row["ok"] = ok and worst_conv < 2e-2 and worst_out < 2e-2 and worst_state < 1e-2
    row["graph_us"] = time_replay_us(graph, per=10)  # conv + delta rule, one layer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="no config sweeps")
    args = ap.parse_args()
    out_path = Path(args.out)
    if not torch.cuda.is_available():
        msg = ("no CUDA device: gpu_gdn_check.py only runs on a GPU "
               "(the interpreter tests are tests/test_gdn_kernels.py)")
        print(f"SKIPPED: {msg}")
        out_path.write_text(json.dumps(dict(ok=None, skipped=msg), indent=1))
        return 0
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the references run in true fp32
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    results: list[dict] = []
    t0 = time.time()
    summary = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   default_config=DEFAULT_CONFIG, shapes=dict(C=C, K=KW, Hk=HK, Hv=HV, Dk=D, Dv=D, dtype=str(DT)),
                   results=results)

    def save():
        summary.update(ok=all(r.get("ok", False) for r in results), seconds=time.time() - t0)
        out_path.write_text(json.dumps(summary, indent=1))

    def case(fn, name, *a, config: dict | None = None):
        row = dict(case=name, kernel=fn.__name__.removeprefix("check_"))
        if config:
            row["config"] = config
        try:
            with kernel_options(gdn=config or {}):  # the launch settings for this case only
                fn(name, *a, gen, dev, row)
        except Exception as e:  # record and go on: one bad case should not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        results.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        save()

    mixed = [1, 2, 3, 700, 17, 64, 65, 1200]
    prefill_cases = [("prefill_1x2048", [2048]), ("prefill_8x512", [512] * 8), ("mixed_short_and_long", mixed)]
    for bs in (1, 64, 256):
        case(check_conv, f"conv_decode_bs{bs}", [1] * bs)
    for name, lens in prefill_cases:
        case(check_conv, f"conv_{name}", lens)
    for bs in (1, 64, 256):
        case(check_gdr, f"gdr_decode_bs{bs}", [1] * bs)
    for bs in (1, 64, 256):
        case(check_decode_graph, f"decode_graph_bs{bs}", bs)
    for name, lens in prefill_cases:
        for prec in ("tf32x3", "tf32", "ieee"):
            case(check_gdr, f"gdr_{name}_chunked_{prec}", lens, config=dict(prefill="chunked", dot_precision=prec))
        case(check_gdr, f"gdr_{name}_recurrent", lens, config=dict(prefill="recurrent"))
    if not args.quick:
        for name, lens in prefill_cases[:2]:
            for bv, warps, stages in ((16, 4, 1), (32, 4, 1), (32, 8, 1), (64, 8, 1), (16, 4, 2), (32, 4, 2)):
                case(check_gdr, f"sweep_chunked_{name}", lens,
                     config=dict(chunk_block_v=bv, chunk_warps=warps, chunk_stages=stages))
        for warps in (4, 8, 16):
            case(check_gdr, "sweep_prepare_prefill_8x512", [512] * 8, config=dict(prepare_warps=warps))
        for bs in (64, 256):
            for bv in (16, 32, 64):
                for warps in (2, 4, 8):
                    case(check_gdr, f"sweep_decode_bs{bs}", [1] * bs,
                         config=dict(decode_block_v=bv, decode_warps=warps))
        for bc, bt, warps in ((64, 32, 4), (128, 16, 4), (128, 32, 4), (256, 16, 4), (256, 32, 8)):
            case(check_conv, "sweep_conv_prefill_1x2048", [2048],
                 config=dict(conv_block_c=bc, conv_block_t=bt, conv_warps=warps))
        for bc, warps in ((128, 4), (256, 4), (512, 4), (1024, 8)):
            case(check_conv, "sweep_conv_decode_bs256", [1] * 256,
                 config=dict(conv_decode_block_c=bc, conv_decode_warps=warps))
    save()
    ok = summary["ok"]
    print(f"{'ALL OK' if ok else 'FAILURES'}: {sum(r.get('ok', False) for r in results)}/{len(results)} "
          f"in {summary['seconds']:.0f}s -> {out_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
