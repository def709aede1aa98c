"""SGLang's own serving client at several loads in one process (issue 24).

`python -m sglang.bench_serving ARGS` runs `sglang.benchmark.serving.cli_main` once; started once per load, its
imports cost ~25 s each time on the device (run16: ~28 s between one load's last request and the next one's
first), more than the loads themselves. This module imports it once and runs `cli_main` for each load in turn,
with the very arguments the command line would get, so the figures are the client's own. It also keeps the
requests the client generated for one load (`--keep`: random-ids prompts are the ids decoded to text, which each
server tokenizes): the offline engine then runs the very same requests (the server's share of the offline rate).

lab.lease serve-bench starts it under the kit's wheels:

    python -m lab.serve_client --runs RUNS.json --status STATUS.json [--keep burst --keep-out REQUESTS.json]
                               [--details PREFIX]

RUNS.json: [{"load": name, "argv": [bench_serving's arguments]}, ...]; STATUS.json gets [{"load", "returncode"}]
after each run (0: the run finished; what `sys.exit` passed when the client gave up; 1 and a traceback in the log
when it raised).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import traceback


def recording(get_dataset, into: list):
    """`get_dataset` that also keeps what it returns (prompt ids, output length) in `into`."""

    def get_and_keep(*args, **kwargs):
        rows = get_dataset(*args, **kwargs)
        into.append([{"prompt": r.prompt if isinstance(r.prompt, str) else [int(t) for t in r.prompt],
                      "output_len": int(r.output_len)} for r in rows])
        return rows

    return get_and_keep


def per_request(benchmark, into: list):
    """`benchmark` (the client's coroutine) that also keeps each request's TTFT and lengths, in the order the
    requests were sent (the JSONL line has only percentiles), when the run started and ended, and when each
    request's clock started (`starts`: the client takes it in the request's task, just before the POST, after its
    warm-up request and a one-second pause; on the server's clock), in the order the requests finished: where a
    burst's first tokens went, the client's own share included."""

    async def benchmark_and_keep(*args, **kwargs):
        started = time.perf_counter()  # the server's --request-log clock (CLOCK_MONOTONIC, one machine)
        starts: list[list[float]] = []
        with request_clocks(starts):
            result = await benchmark(*args, **kwargs)
        into.append({**{k: result.get(k) for k in ("ttfts", "input_lens", "output_lens")}, "started": started,
                     "ended": time.perf_counter(), "starts": starts})
        return result

    return benchmark_and_keep


@contextlib.contextmanager
def request_clocks(into: list):
    """While open, every request function of the client also appends [its start, its TTFT] to `into` (the
    output's own `start_time` and `ttft`; the warm-up request's included, first)."""
    from sglang.benchmark import serving

    real = dict(serving.ASYNC_REQUEST_FUNCS)

    def keeping(fn):
        @functools.wraps(fn)
        async def run(*args, **kwargs):
            out = await fn(*args, **kwargs)
            if getattr(out, "start_time", None) is not None:
                into.append([out.start_time, out.ttft])
            return out
        return run

    serving.ASYNC_REQUEST_FUNCS.update({k: keeping(fn) for k, fn in real.items()})
    try:
        yield
    finally:
        serving.ASYNC_REQUEST_FUNCS.update(real)


def run_loads(runs: list[dict], status_path: str, keep: str | None = None, keep_out: str | None = None,
              details: str | None = None) -> int:
    from sglang.benchmark import serving  # the module `python -m sglang.bench_serving` runs

    status, real_get_dataset, real_benchmark = [], serving.get_dataset, serving.benchmark
    for run in runs:
        kept: list = []
        if run["load"] == keep:  # the module calls get_dataset by its global name
            serving.get_dataset = recording(real_get_dataset, kept)
        measured: list = []
        serving.benchmark = per_request(real_benchmark, measured)
        sys.argv = ["sglang.bench_serving", *run["argv"]]
        try:
            serving.cli_main()
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:
            traceback.print_exc()
            rc = 1
        finally:
            serving.get_dataset, serving.benchmark = real_get_dataset, real_benchmark
        if kept and keep_out:
            with open(keep_out, "w") as f:
                json.dump(kept[-1], f)
        if measured and details:
            with open(f"{details}_{run['load']}.json", "w") as f:
                json.dump(measured[-1], f)
        status.append({"load": run["load"], "returncode": rc})
        with open(status_path, "w") as f:
            json.dump(status, f)
        print(f"serve_client: {run['load']} rc {rc}", flush=True)
    return 0 if all(s["returncode"] == 0 for s in status) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", required=True, help="a JSON file: [{load, argv}, ...]")
    ap.add_argument("--status", required=True, help="where each run's return code goes (JSON)")
    ap.add_argument("--keep", help="the load whose generated requests are kept")
    ap.add_argument("--keep-out", help="where they go (JSON: [{prompt: text or ids, output_len}, ...])")
    ap.add_argument("--details", help="each load's TTFTs and lengths, request by request, go to DETAILS_<load>.json")
    a = ap.parse_args(argv)
    with open(a.runs) as f:
        runs = json.load(f)
    return run_loads(runs, a.status, a.keep, a.keep_out, a.details)


if __name__ == "__main__":
    sys.exit(main())
