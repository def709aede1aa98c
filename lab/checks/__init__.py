"""GPU checks the lease runs (`python -m lab.checks.<name> --out DIR`), each writing JSON with the commit."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path


def per_model_main(module: str, doc: str, measure: Callable[..., dict], default_models: str = "qwen3-0.6b",
                   min_capability: int = 0, extra: dict | None = None, parts: tuple[str, ...] = ()) -> None:
    """The command line of a check that measures each of `--models` in turn: `measure(name)`'s dict under
    `models` in DIR/<module>.json, written after each model, with the environment and the command (and `extra`).
    A check of several `parts` also takes `--parts` (a comma-separated subset, all by default) and gets the chosen
    ones: `measure(name, parts)`. Without a CUDA GPU of compute capability `min_capability` or more it says so and
    writes nothing."""
    import torch

    ap = argparse.ArgumentParser(prog=f"python -m lab.checks.{module}", description=doc.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--models", default=default_models, help="comma-separated names from lab.models")
    if parts:
        ap.add_argument("--parts", default=",".join(parts), help=f"comma-separated, of {', '.join(parts)}")
    a = ap.parse_args()
    chosen = tuple(a.parts.split(",")) if parts else ()
    if set(chosen) - set(parts):
        ap.error(f"--parts: not among {', '.join(parts)}: {', '.join(sorted(set(chosen) - set(parts)))}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < min_capability:
        print(f"{module}: needs a CUDA GPU (compute capability {min_capability}+), nothing to measure")
        return
    from minisgl.bench.runner import environment

    command = f"python -m lab.checks.{module} --models {a.models}" + (f" --parts {a.parts}" if parts else "")
    res: dict = {"environment": environment(), "command": command,
                 **(extra or {}), "models": {}}
    path = Path(a.out) / f"{module}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        res["models"][name] = measure(name, chosen) if parts else measure(name)
        torch.cuda.empty_cache()  # what the model held goes with measure()'s frame
        path.write_text(json.dumps(res, indent=1))
