"""The decode GEMV's tiles picked inside the batch-1 decode step they run in (issue 29).

`lab.tune.gemv` times each weight shape standalone, in a chain of launches of its own kind. Inside a decode step
the same tile can do worse: on an H200 (reports/h200/run32, `wide_ab8`) the chain's fastest tiles made Qwen3-8B's
W2 8% slower than the repo's table. A GEMV there runs between other kernels under PDL, folded with a norm, an add or
the MLP's activation, and what it can overlap depends on its neighbours.

Here each GEMV kind of the model (down_proj, qkv_proj, o_proj, gate_up_proj, lm_head: every layer's module of that kind
at once; in the order of what run32's chains lost against the card's bandwidth on Qwen3-8B, most first) takes candidate
tiles in turn, nearest the tile it starts from first, for an equal share of what is left of the budget; for each, the
engine's batch-1 decode graph is captured again and replayed on a live request (a 1,024-token context;
lab.checks.decode_anatomy's method), and the fastest step keeps it. The kinds go one after another, each starting from
the picks before it (one pass of coordinate descent). Last, the tiles it started from and the picks are replayed
interleaved, `ROUNDS` times. Only one row is timed (the bs-1 graph): a pick also serves 2-4 rows, where the table allows
the GEMV that many.

    python -m lab.tune.gemv_step --out DIR [--model qwen3-8b]

Writes DIR/gemv_step_tune.json: every replay, the picks, the start against the picks, and `table`, the card's
table (the kernel option gemv_configs, else kernels/gemv_tuned/) with the picks in it, in the tuned tables' format
(give it to an engine as `--gemv-configs FILE`; lab.sections' `step_tiles06` / `step_tiles8` run W2 with it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lab.engines import decoding_request, gemv_kinds, step_replay_us, table_json, with_engine

KINDS = ("down_proj", "qkv_proj", "o_proj", "gate_up_proj", "lm_head")  # the order they are tuned in
ROUNDS = 3  # the start against the picks, interleaved
ITERS, PER = 10, 10  # each candidate's replays: the median of ITERS timings of PER replays


def candidates(k: int, pairs: bool) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps) to try on a weight of K inputs: 1-16 rows a program (16: fewer, longer programs,
    all resident at once, so more of them load their weights before their PDL wait), K tiles of 512 up to K (a
    power of 2 at least K at most), 4 warps and, from 2,048-wide tiles, 8; 1,024 to 32,768 weights a tile.
    `pairs`: gate_up with the activation in its epilogue, whose programs hold (gate, up) row pairs (no 1-row
    tiles)."""
    widest = max(1024, 1 << (k - 1).bit_length())
    return [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (512, 1024, 2048, 4096) for w in (4, 8)
            if bk <= widest and 1024 <= bn * bk <= 32768 and (w == 4 or bk >= 2048) and not (pairs and bn == 1)]


def nearest_first(tiles: list[tuple[int, int, int]], start: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    """`start`, then `tiles` by their distance from it (doublings of rows and of K tile apart, plus 1 for other warps):
    a kind cut short by the budget has tried the tiles around its start, not one corner of the grid."""
    def distance(t: tuple[int, int, int]) -> tuple[int, tuple[int, int, int]]:
        return (abs(t[0].bit_length() - start[0].bit_length()) + abs(t[1].bit_length() - start[1].bit_length())
                + (t[2] != start[2]), t)
    return list(dict.fromkeys([tuple(start), *sorted(tiles, key=distance)]))


def set_tiles(modules: list, tiles: tuple[int, int, int]) -> None:
    for m in modules:
        m.tiles = tuple(tiles)


def tune_in_step(llm, budget_s: float = 600.0) -> dict:
    """The coordinate descent on a live engine (see the module docstring). Past `budget_s` seconds no new candidate
    is tried, and each kind may spend an equal share of what is left when it begins (each kind still times its
    current tile): what was skipped is listed under `skipped`."""
    from minisgl.kernels import gemv as gv
    from minisgl.kernels.options import use_options

    runner = llm.engine.runner
    decoding_request(llm)
    kinds = gemv_kinds(runner.model)
    start = {kind: tuple(mods[0].tiles) for kind, mods in kinds.items()}
    out: dict = {"start": {k: list(v) for k, v in start.items()}, "kinds": {}}
    picks = dict(start)
    began = time.time()
    with use_options(llm.config.kernels):
        act = llm.config.kernels.gemv_act_epilogue
        todo = [kind for kind in KINDS if kind in kinds]
        for i, kind in enumerate(todo):
            mods = kinds[kind]
            n, k = mods[0].weight.shape
            t0 = time.time()
            share = (budget_s - (t0 - began)) / (len(todo) - i)
            times: dict[str, float] = {}
            for tiles in nearest_first(candidates(k, act and kind == "gate_up_proj"), picks[kind]):
                if times and time.time() - t0 > share:
                    out.setdefault("skipped", []).append(f"{kind} {tiles}")
                    continue
                set_tiles(mods, tiles)
                try:
                    times[",".join(map(str, tiles))] = round(step_replay_us(llm, iters=ITERS, per=PER), 2)
                except Exception as exc:  # noqa: BLE001 - a tile that fails to compile drops out
                    out.setdefault("errors", []).append(f"{kind} {tiles}: {exc!r}"[:300])
            best = min(times, key=times.get)
            picks[kind] = tuple(int(v) for v in best.split(","))
            set_tiles(mods, picks[kind])
            out["kinds"][kind] = {"shape": [n, k], "modules": len(mods), "step_us": times, "pick": list(picks[kind]),
                                  "seconds": round(time.time() - t0, 1)}
            print(f"{kind} {n}x{k}: {best} {times[best]} us (start {start[kind]}: "
                  f"{times[','.join(map(str, start[kind]))]} us)", flush=True)
        rounds: dict[str, list[float]] = {"start": [], "picks": []}
        for _ in range(ROUNDS):
            for label, tiles in (("start", start), ("picks", picks)):
                for kind, mods in kinds.items():
                    set_tiles(mods, tiles[kind])
                rounds[label].append(round(step_replay_us(llm), 2))
        table = gv.table_for(next(runner.model.parameters()).device)  # the engine's gemv_configs, if it has one
    out["step_us"] = rounds
    out["picks"] = {kind: list(t) for kind, t in picks.items()}
    out["gain_us"] = round(statistics.median(rounds["start"]) - statistics.median(rounds["picks"]), 2)
    out["table"] = table_json(table)
    for kind, mods in kinds.items():
        n, k = mods[0].weight.shape
        rows = gv.gemv_max_rows(n, k, table)
        out["table"][f"{n},{k}"] = [*picks[kind], rows]
    return out


def tune(model: str, budget_s: float = 600.0) -> dict:
    """`tune_in_step` on a fresh engine of `model` (dummy bf16 weights, the default options)."""
    return with_engine(model, lambda llm: tune_in_step(llm, budget_s), max_model_len=4096, kv_memory_fraction=0.3)


def main(out_dir: str | Path, model: str = "qwen3-8b", budget_s: float = 600.0) -> dict:
    """Tune `model`'s decode GEMV tiles in its batch-1 step; DIR/gemv_step_tune.json."""
    from minisgl.bench.runner import environment

    res = {"environment": environment(), "model": model, "result": tune(model, budget_s)}
    path = Path(out_dir) / "gemv_step_tune.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--budget-s", type=float, default=600.0, help="no new candidate after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gemv_step: needs a CUDA GPU, nothing to measure")
    else:
        main(args.out, args.model, args.budget_s)
