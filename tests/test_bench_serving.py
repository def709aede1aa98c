"""The serving benchmark (minisgl.bench.serving) on the CPU with the tiny model, at a small scale: it starts
`minisgl serve`, drives it at a Poisson rate and all at once, and writes JSON with every figure and the commit."""

from __future__ import annotations

import json
import math
import statistics

from minisgl.bench.serving import Shape, arrival_times, main, make_requests
from minisgl.server.testing import tiny_model_path


def test_requests_and_arrivals_come_from_the_seed():
    shape = Shape(50, 100, 20, 0.5)
    a, b = make_requests(shape, 4096, seed=3), make_requests(shape, 4096, seed=3)
    assert a == b and a != make_requests(shape, 4096, seed=4)
    assert all(50 <= len(p) <= 100 and 10 <= n <= 20 and all(0 <= t < 4096 for t in p) for p, n in a)
    times = arrival_times(2000, 20.0, seed=1)
    assert times == sorted(times) and times == arrival_times(2000, 20.0, seed=1)
    gaps = [y - x for x, y in zip(times, times[1:])]
    assert abs(statistics.fmean(gaps) - 1 / 20) < 0.005  # exponential gaps of mean 1/rate
    assert arrival_times(5, math.inf, seed=1) == [0.0] * 5


def test_serving_benchmark_smoke(tmp_path_factory, tmp_path):
    model = tiny_model_path(tmp_path_factory.getbasetemp() / "server-tests")
    out = tmp_path / "serving.json"
    assert main(["--model", model, "--rates", "20,inf", "--num-prompts", "6", "--input-len", "40",
                 "--output-len", "8", "--burst-prompts", "8", "--burst-input-len", "40", "--burst-output-len", "8",
                 "--warmup", "2", "--offline", "--out", str(out), "--", "--kv-cache-tokens", "4096",
                 "--disable-overlap-schedule"]) == 0
    data = json.loads(out.read_text())
    assert data["environment"]["git_commit"] and data["settings"]["serve_args"][-1] == "--disable-overlap-schedule"
    assert data["server_exit_status"] == 0
    for label, n in (("rate_20", 6), ("all_at_once", 8)):
        r = data["results"][label]
        assert (r["requests"], r["completed"], r["failures"]) == (n, n, 0), r
        assert 4 * n <= r["output_tokens"] <= 8 * n  # ignore_eos: every request runs to its length (4..8)
        for metric in ("ttft", "tpot", "itl", "e2e"):
            assert 0 < r[metric]["median_ms"] <= r[metric]["p99_ms"], (metric, r[metric])
        assert r["e2e"]["median_ms"] >= r["ttft"]["median_ms"]
        # /proc counts CPU time in clock ticks (10 ms): the front's share of a handful of tiny requests can
        # round to zero, the engine's model steps cannot.
        assert r["front_cpu_s"] >= 0 and r["engine_cpu_s"] > 0
    assert data["offline"]["output_tokens"] == data["results"]["all_at_once"]["output_tokens"]
    assert data["server_over_offline"] > 0
