"""Check and time the decode GEMV (minisgl/kernels/gemv.py) against cuBLAS on a CUDA GPU, and pick its tiles.

    python -m lab.tune.gemv --out DIR

For every linear-layer weight shape of Qwen3-0.6B, Qwen3-8B and Qwen3.5-0.8B (bf16), at 1, 2 and 4 rows:
cuBLAS (`F.linear`) and the GEMV under each candidate (BLOCK_N, BLOCK_K, warps). A decoder MLP's down projection
is timed as the engine runs it (`GemvMLP`): the GEMV with the SiLU-and-mul folded in, which reads the [gate | up]
input and computes the activation in every program (more of both with narrower BLOCK_N tiles), against the
activation kernel then cuBLAS. Each time is the median replay
of a CUDA graph that calls the op on enough distinct weight copies to stream past the L2 cache, as a decode step
streams its layers, divided by the calls. Correctness: every shape's pick against F.linear in fp32 on the same
bf16 inputs. Writes DIR/gpu_gemv_tune.json (everything) and DIR/gemv_configs.json: per shape the tiles and the
row counts where the GEMV beat cuBLAS (`pick`), else null (the engine keeps cuBLAS there). Give that file to an
engine (`--gemv-configs FILE`, the kernel option `gemv_configs`), or copy it to
minisgl/kernels/gemv_tuned/<device name>.json, to use it;
`--repick` redoes the picks from a tune's JSON on any machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.models import MODELS, model_path
from lab.timing import time_graph

ROWS = (1, 2, 4)
STREAM_BYTES = 256 << 20  # weight copies per graph: well past the H200's 50 MB L2
DEVICE = "cuda"


def linear_shapes(config_dir: str) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]]]:
    """Weight shape -> how many linears of that shape the model has, and the shapes of its MLPs' down projections
    (which the engine runs with the activation folded in: `use_gemv(model, fold=(MLP,))`). Built on the meta
    device: no memory."""
    from collections import Counter

    from torch import nn
    from transformers import AutoConfig

    from minisgl.models import qwen3_5 as hybrid
    from minisgl.models.config import ModelConfig
    from minisgl.models.decoder import DecoderLM
    from minisgl.models.layers import MLP

    hf = AutoConfig.from_pretrained(config_dir)
    config_cls, model_cls = ((hybrid.Qwen35Config, hybrid.Qwen35LM) if hf.model_type.startswith("qwen3_5")
                             else (ModelConfig, DecoderLM))
    with torch.device("meta"):
        net = model_cls(config_cls.from_hf(hf, (0,)), 4096)
    counts = Counter(tuple(m.weight.shape) for m in net.modules() if type(m) is nn.Linear)
    folded = {tuple(m.down_proj.weight.shape) for m in net.modules() if type(m) is MLP}
    return dict(counts), folded


def ops(folded: bool):
    """(the matmul's input from x, the GEMV with `tiles`) as the engine runs one weight: a plain linear (the input
    is x), or an MLP's down projection whose x is [gate | up] (`folded`: the input is silu_and_mul(x), which cuBLAS
    gets from the activation kernel and the GEMV computes itself)."""
    from minisgl.kernels import elementwise as ew
    from minisgl.kernels import gemv as gv

    if folded:
        return ew.silu_and_mul, lambda tiles: partial(gv.gemv, silu_mul=True, tiles=tiles)
    return (lambda x: x), lambda tiles: partial(gv.gemv, tiles=tiles)


def cublas(matmul_input, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the engine runs without the GEMV: the matmul's input (the activation kernel, when folded), then cuBLAS."""
    return F.linear(matmul_input(x), weight)


def candidates(k: int | None = None, wide: bool = False) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps) to try. `wide` adds K tiles of 2048-16384 (no wider than K needs) and 16 warps:
    a program's loop step is one load then a reduction across its warps, so with K = 4096 or 12288 a 1024-wide
    tile leaves each program a chain of 4-12 load-and-reduce steps (run10's tune: 2.4-3.0 TB/s on Qwen3-8B's
    4096-output projections, against 4.2 for its 151,936-output head, whose programs are many more)."""
    tiles_k = (256, 512, 1024) + ((2048, 4096, 8192, 16384) if wide else ())
    warps = (4, 8, 16) if wide else (4, 8)
    limit = 32768 if wide else 16384
    return [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8, 16), tiles_k, warps)
            if 512 <= bn * bk <= limit and (k is None or bk <= max(1024, 1 << (k - 1).bit_length()))
            and (w < 16 or bk >= 2048)]


def time_op(op, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    def calls():
        for w in weights:
            op(x, w)
    return time_graph(calls, iters=15) / len(weights)


MARGIN = 0.98  # the GEMV must beat cuBLAS by 2% for a row count to count as won (the timings' noise)


def pick(row: dict) -> list[int] | None:
    """[BLOCK_N, BLOCK_K, warps, max_rows] for one shape, or None. For each finalist tile (timed at 1, 2 and 4
    rows), max_rows is the largest row count up to which the GEMV beat cuBLAS at every count; the pick saves the
    most time summed over those counts (ties: the faster single row)."""
    cublas = {int(r): t for r, t in row["cublas_us"].items()}
    best, best_key = None, None
    for cfg, times in row["gemv_us"].items():
        times = {int(r): t for r, t in times.items()}
        max_rows = 0
        for r in sorted(times):
            if times[r] >= MARGIN * cublas[r]:
                break
            max_rows = r
        if max_rows:
            key = (sum(cublas[r] - times[r] for r in times if r <= max_rows), -times[1])
            if best_key is None or key > best_key:
                best, best_key = [*map(int, cfg.split(",")), max_rows], key
    return best


def repick(out_dir: str | Path) -> dict:
    """Rewrite DIR/gemv_configs.json from DIR/gpu_gemv_tune.json with `pick` (no GPU needed)."""
    out_dir = Path(out_dir)
    res = json.loads((out_dir / "gpu_gemv_tune.json").read_text())
    picks = {f"{r['n']},{r['k']}": pick(r) for r in res["shapes"]}
    (out_dir / "gemv_configs.json").write_text(json.dumps(picks, indent=1))
    return picks


def main(out_dir: str | Path = ".", models: tuple[str, ...] = tuple(MODELS), wide: bool = False) -> dict:
    """Tune every linear shape of `models`; `wide` tries the wide candidates too (see `candidates`)."""
    from minisgl.kernels import gemv as gv

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                 "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "rows": ROWS, "models": list(models), "wide": wide, "candidates": candidates(wide=wide),
                 "shapes": []}
    shapes: dict[tuple[int, int], list[str]] = {}
    folded: set[tuple[int, int]] = set()
    for model in models:
        counts, downs = linear_shapes(model_path(model))
        for shape, count in counts.items():
            shapes.setdefault(shape, []).append(f"{model} x{count}")
        folded |= downs
    picks: dict[str, list[int] | None] = {}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for (n, k), used_by in sorted(shapes.items()):
        t0 = time.time()
        # a shape that is a down projection in any model is timed folded: that is how the engine runs it
        fold = (n, k) in folded
        matmul_input, gemv_with = ops(fold)
        copies = max(1, min(48, STREAM_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, generator=gen, device=DEVICE).bfloat16() * 0.05 for _ in range(copies)]
        width = 2 * k if fold else k
        xs = {r: torch.randn(r, width, generator=gen, device=DEVICE).bfloat16() for r in ROWS}
        row: dict = {"n": n, "k": k, "used_by": used_by, "silu_mul": fold, "copies": copies, "cublas_us": {},
                     "gemv_us": {}}
        for r in ROWS:
            row["cublas_us"][r] = round(time_op(partial(cublas, matmul_input), xs[r], weights), 2)
        # every candidate at one row, the best four also at two and four rows
        one: dict[tuple, float] = {}
        for cfg in candidates(k, wide):
            try:
                one[cfg] = time_op(gemv_with(cfg), xs[1], weights)
            except Exception as exc:  # noqa: BLE001 - a tile that fails to compile just drops out
                row.setdefault("errors", []).append(f"{cfg}: {exc!r}"[:300])
                one[cfg] = float("inf")
        row["gemv_us_1_row"] = {",".join(map(str, c)): round(t, 2) for c, t in one.items()}
        finalists = sorted(one, key=one.get)[:4]
        totals = {}
        for cfg in finalists:
            ts = {r: (one[cfg] if r == 1 else time_op(gemv_with(cfg), xs[r], weights)) for r in ROWS}
            row["gemv_us"][",".join(map(str, cfg))] = {r: round(t, 2) for r, t in ts.items()}
            totals[cfg] = sum(ts.values())
        best = min(totals, key=totals.get)
        default = gv.gemv_config(n, k)  # the kernel's own choice for a shape no table names
        row["default"], row["default_us_1_row"] = list(default), one.get(default)
        row["best"], row["best_total_us"] = list(best), round(totals[best], 2)
        row["cublas_total_us"] = round(sum(row["cublas_us"].values()), 2)
        row["best_1_row_tb_s"] = round(n * k * 2 / (one[best] * 1e-6) / 1e12, 2)
        row["cublas_1_row_tb_s"] = round(n * k * 2 / (row["cublas_us"][1] * 1e-6) / 1e12, 2)
        # correctness of the pick: against F.linear in fp32 on the same bf16 inputs (folded: on the activation the
        # unfused kernel computes, which the fold rounds the same way)
        errs = []
        for r in (1, 2, 3, 4):
            x = torch.randn(r, width, generator=gen, device=DEVICE).bfloat16()
            ref = F.linear(matmul_input(x).float(), weights[0].float())
            got = gemv_with(best)(x, weights[0]).float()
            errs.append(((got - ref).abs().max() / ref.abs().max()).item())
        row["max_rel_err"] = max(errs)
        row["ok"] = row["max_rel_err"] < 1e-2
        row["seconds"] = round(time.time() - t0, 1)
        picks[f"{n},{k}"] = pick(row)
        res["shapes"].append(row)
        print(f"{n}x{k}: cuBLAS {row['cublas_us']} us, GEMV {best} {row['gemv_us'][','.join(map(str, best))]} us, "
              f"err {row['max_rel_err']:.1e}", flush=True)
        del weights
        (out_dir / "gpu_gemv_tune.json").write_text(json.dumps(res, indent=1))
    res["picks"] = picks
    res["all_ok"] = all(r["ok"] for r in res["shapes"])
    (out_dir / "gpu_gemv_tune.json").write_text(json.dumps(res, indent=1))
    (out_dir / "gemv_configs.json").write_text(json.dumps(picks, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--repick", action="store_true", help="only rewrite gemv_configs.json from the tune's JSON")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--wide", action="store_true", help="also the wide K tiles and 16 warps (see candidates)")
    args = ap.parse_args()
    if args.repick:
        print(json.dumps(repick(args.out)))
        sys.exit(0)
    sys.exit(0 if main(args.out, tuple(args.models.split(",")), args.wide)["all_ok"] else 1)
