"""How fast this host runs Python: a figure every result records, and the lease prints before a call's steps.

No torch import here: the lease's driver process asks for it before any step starts.
"""

from __future__ import annotations

import time


def host_probe_ms(rounds: int = 3) -> float:
    """Milliseconds of a fixed piece of pure-Python work (best of `rounds`): how fast this host runs the engine's
    loop today. Batch-1 decode and structured output are host-bound on a slow host (run17: one H200 machine's
    host ran every step phase about twice as long as another's), so a result records it beside the GPU's name."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)
