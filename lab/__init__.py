"""The lab: the tooling that measures minisgl and writes its reports. Not part of the engine.

Run from the repository root, as modules (`python -m lab.run ...`): the package is not installed with minisgl
(students' `pip install -e .` does not get it) and is importable wherever the root is on the path, which
`python -m` from the root and pytest (pyproject's `pythonpath`) both arrange. On the GPU machine the checkout
travels without an install, and the same commands work there.

    lab.run          one device call's measurements: named sections (lab.sections), JSON under --out
    lab.lease        a lease as a few device calls (the plan, the calls, SGLang beside us through the kit)
    lab.sglang       SGLang on the same requests (run under the kit's wheels by lab.lease)
    lab.serve_client SGLang's serving client at several loads in one process (lab.lease serve-bench runs it)
    lab.timeline     where a batch-1 decode step's time goes (profiler timeline)
    lab.checks.*     GPU self-checks of the kernels, the sampler, prefill graphs, PDL, Gated DeltaNet, TP
    lab.tune.*       launch-shape tunes (the decode GEMV against cuBLAS, the fused sampler)
    lab.report       REPORT.md, BLOG.md, HISTORY.md and the charts, from a lease's JSON
    lab.tinymodel.*  the embedded model's corpus, training and install
    lab.course.*     the tour's recording and the course run on a GPU

Shared pieces: lab.models (the one model-name table), lab.timing (the one GPU timing helper), lab.engines (how
a measurement builds an engine, with kernel options applied in one place).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
