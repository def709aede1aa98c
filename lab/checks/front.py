"""The server's front alone: the real HTTP server, tokenizer and detokenizer against a fake engine process.

    python -m lab.checks.front OUT.json [--prompts 512] [--text] [--http h11] [--loop asyncio] [--repeat 2]

The engine process runs `EngineLoop` (the real step loop and pipe) over `FakeEngine`, which costs what a step
model says (a base, a per-decode-row and a per-prefilled-token time, by default roughly Qwen3-0.6B on an H200:
2 ms + 12 us a row + 1/350,000 s a token, 8,192-token chunks, at most 512 running) and emits one token per
running request per step, so the GPU is out of the picture and what is left is the front: how fast it takes
a burst of requests in, and how many streamed tokens a second it can deliver. minisgl.bench.serving's client
sends the all-at-once load (issue 24's shape by default: 1024 in / 512 out, lengths from a quarter up) as
token ids, or as text with --text, the way `sglang.bench_serving --dataset-name random-ids` does (decoded ids
the server tokenizes again).

Per run: the client's TTFT / TPOT / ITL / end-to-end figures and token rate, and the front's CPU seconds
(/proc) per output token. The client shares the machine with the front, so on a
small machine the figures move with the load: compare runs of one call, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

from lab import REPO

MODEL = str(REPO / "assets" / "tiny-qwen3")  # its 4k-token tokenizer is the serving runs' tokenizer too


class FakeEngine:
    """Just enough of `Engine` for `EngineLoop`, with a step time from a model instead of a GPU."""

    def __init__(self, base_s: float, per_row_s: float, prefill_tok_s: float, chunk: int, max_running: int,
                 tokens: list[int]):
        self.base_s, self.per_row_s, self.prefill_tok_s = base_s, per_row_s, prefill_tok_s
        self.tokens = tokens  # what it emits, in turn: ids that decode to whole words, so text is never held back
        self.chunk, self.max_running = chunk, max_running
        self.waiting: list = []
        self.running: list = []
        self.scheduler = SimpleNamespace(running=self.running, waiting=self.waiting)
        self.allocator = SimpleNamespace(capacity=1, num_free=1)
        self.cache = SimpleNamespace(evictable_pages=0)
        self.stats = {"steps": 0}
        self.added: list[float] = []  # when each request reached the engine (monotonic seconds)
        self.first_token: list[float] = []  # when each request's prefill ended (its first token)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add_requests(self, input_ids, params) -> list:
        req = SimpleNamespace(output_ids=[], output_logprobs=[], finished=False, finish_reason=None, error=None,
                              left=len(input_ids), max_tokens=params.max_tokens)
        self.waiting.append(req)
        self.added.append(time.monotonic())
        return [req]

    def abort(self, req) -> None:
        req.finished, req.finish_reason = True, "abort"
        for queue in (self.waiting, self.running):
            if req in queue:
                queue.remove(req)

    def step(self) -> list:
        """FCFS chunked prefill beside every running request's decode, one token each, then the step's time."""
        self.stats["steps"] += 1
        budget, prefilled, started = self.chunk, 0, []
        while self.waiting and budget and len(self.running) + len(started) < self.max_running:
            req = self.waiting[0]
            take = min(budget, req.left)
            req.left, budget, prefilled = req.left - take, budget - take, prefilled + take
            if req.left:
                break
            started.append(self.waiting.pop(0))
        time.sleep(self.base_s + self.per_row_s * len(self.running) + prefilled / self.prefill_tok_s)
        self.running.extend(started)
        self.first_token += [time.monotonic()] * len(started)
        for req in list(self.running):
            req.output_ids.append(self.tokens[len(req.output_ids) % len(self.tokens)])
            if len(req.output_ids) >= req.max_tokens:
                req.finished, req.finish_reason = True, "length"
                self.running.remove(req)
        return []


def word_tokens() -> list[int]:
    """The tokenizer's ids that decode to a space and an ASCII word. A stream of arbitrary ids would hold text
    back: ids 100-115 of this tokenizer are lone bytes of a multi-byte character, which the detokenizer keeps
    until a character completes, and the client times its first token at the first text it sees."""
    from minisgl.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(MODEL)
    return [i for i in range(len(tokenizer)) if (s := tokenizer.decode([i])).startswith(" ") and s[1:].isascii()
            and s[1:].isalpha()]


def engine_child(fd: int, model_json: str, trace: str) -> None:
    """The fake engine process: answer the front's start message, run the real step loop, and write when each
    request arrived and got its first token to `trace` when the front stops it."""
    from minisgl.server.engine_process import EngineInfo, EngineLoop
    conn = Connection(fd)
    _, config, *_ = pickle.loads(conn.recv_bytes())
    vocab = json.loads((Path(MODEL) / "config.json").read_text())["vocab_size"]
    conn.send_bytes(pickle.dumps(("ready", EngineInfo(MODEL, 1 << 20, 1 << 30, vocab, os.getpid(), config, "cuda"))))
    engine = FakeEngine(**json.loads(model_json), tokens=word_tokens())
    code = EngineLoop(engine, conn).run()
    Path(trace).write_text(json.dumps({"added": engine.added, "first_token": engine.first_token,
                                       "steps": engine.stats["steps"]}))
    os._exit(code)


def serve_front(port: int, http: str, loop: str, model_json: str, trace: str, gc_freeze: bool) -> None:
    """`minisgl serve`'s front on `port`, its engine process the fake one."""
    from minisgl.server.app import ServerState
    from minisgl.server.engine_client import EngineClient
    from minisgl.server.launch import make_config, serve
    from minisgl.tokenizer import load_tokenizer

    class FakeEngineClient(EngineClient):
        def start_process(self) -> None:
            ours, theirs = socket.socketpair()
            code = (f"from lab.checks.front import engine_child; "
                    f"engine_child({theirs.fileno()}, {model_json!r}, {trace!r})")
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),),
                                         start_new_session=True, cwd=REPO)
            theirs.close()
            self.conn = Connection(ours.detach())
            self.conn.send_bytes(pickle.dumps(("config", self.config, os.getpid(), self.heartbeat_s, "warning", 1)))

    client = FakeEngineClient(make_config(MODEL, gc_freeze=gc_freeze), watchdog_timeout=60.0)
    client.start_process()
    client.wait_ready(60)
    state = ServerState(engine=client, tokenizer=load_tokenizer(MODEL), model_name="front-check")
    import gc

    from minisgl.bench.profile import gc_pauses
    with gc_pauses() as pauses:  # the first full collection is serve()'s own, before it freezes the heap
        code = serve(state, port=port, http=http, loop=loop, log_level="warning")
    Path(trace).with_name("front_gc.json").write_text(json.dumps({
        **pauses.as_dict(), "full_collections": pauses.full_collections,
        "tracked_objects_at_exit": len(gc.get_objects()), "frozen": gc.get_freeze_count()}))
    sys.exit(code)


def one_run(args, model_json: str, prompts: list, repeat_index: int) -> dict:
    import statistics
    import tempfile

    from minisgl.bench.serving import _free_port, cpu_seconds, engine_pid, run_rate, stop_server, wait_healthy
    port = _free_port()
    trace = Path(tempfile.mkdtemp(prefix="front-check-")) / "engine_trace.json"
    cmd = [sys.executable, "-m", "lab.checks.front", "--serve-port", str(port), "--http", args.http,
           "--loop", args.loop, "--step-model", model_json, "--trace", str(trace)]
    cmd += ["--disable-gc-freeze"] if args.disable_gc_freeze else []
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, cmd, 120)
        engine = engine_pid(url)
        # a warm-up, as sglang.bench_serving and minisgl.bench.serving send: what a server does once (its first
        # request's imports, for one) is not what a burst costs
        asyncio.run(run_rate(url, "front-check", prompts[:2], math.inf, args.seed))
        cpu0, engine_cpu0 = cpu_seconds(proc.pid), cpu_seconds(engine)
        sent = time.monotonic()  # the machine's monotonic clock, the one the engine process reads too
        result = asyncio.run(run_rate(url, "front-check", prompts, math.inf, args.seed))
        cpu, engine_cpu = cpu_seconds(proc.pid) - cpu0, cpu_seconds(engine) - engine_cpu0
    finally:
        stop_server(proc)  # the front stops its engine, which writes the trace
    tokens = max(1, result["output_tokens"])
    result["front_cpu_s"] = round(cpu, 3)
    result["front_cpu_us_per_token"] = round(1e6 * cpu / tokens, 1)
    # the engine process's own work (EngineLoop: commands, collecting and pickling each step's news, and the fake
    # engine's bookkeeping; its steps sleep): what a real engine's loop adds to its host time
    result["engine_loop_cpu_s"] = round(engine_cpu, 3)
    gc_file = trace.with_name("front_gc.json")
    if gc_file.exists():  # the front's garbage collections while it served (the whole run)
        result["front_gc"] = json.loads(gc_file.read_text())
    if trace.exists():  # where the client's TTFT went: reaching the engine, waiting for prefill, coming back
        seen = json.loads(trace.read_text())
        added = [t for t in seen["added"] if t >= sent]  # the burst's, not the warm-up's
        first_token = [t for t in seen["first_token"] if t >= sent]
        ms = lambda xs: round(1e3 * (statistics.median(xs) - sent), 1) if xs else None  # noqa: E731
        result["engine_side"] = {
            "requests_added": len(added),
            "first_added_ms": round(1e3 * (min(added) - sent), 1) if added else None,
            "median_added_ms": ms(added),
            "last_added_ms": round(1e3 * (max(added) - sent), 1) if added else None,
            "median_first_token_ms": ms(first_token),
            "steps": seen["steps"],
            "loop_cpu_ms_per_step": round(1e3 * engine_cpu / max(1, seen["steps"]), 3),
        }
    result["repeat"] = repeat_index
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--range-ratio", type=float, default=0.25)
    ap.add_argument("--text", action="store_true", help="send prompts as text (the server tokenizes them)")
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"])
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--disable-gc-freeze", action="store_true", help="the front leaves its start-up heap to the "
                    "collector (the engine option of that name)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--base-ms", type=float, default=2.0)
    ap.add_argument("--per-row-us", type=float, default=12.0)
    ap.add_argument("--prefill-tok-s", type=float, default=350e3)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--max-running", type=int, default=512)
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)  # the front's own process
    ap.add_argument("--step-model", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_port is not None:
        serve_front(args.serve_port, args.http, args.loop, args.step_model, args.trace, not args.disable_gc_freeze)
        return 0
    if not args.out:
        ap.error("OUT.json is required")
    step_model = {"base_s": args.base_ms / 1e3, "per_row_s": args.per_row_us / 1e6,
                  "prefill_tok_s": args.prefill_tok_s, "chunk": args.chunk, "max_running": args.max_running}
    model_json = json.dumps(step_model)

    from minisgl.bench.runner import environment
    from minisgl.bench.serving import Shape, make_requests
    vocab = json.loads((Path(MODEL) / "config.json").read_text())["vocab_size"]
    shape = Shape(args.prompts, args.input_len, args.output_len, args.range_ratio)
    prompts = make_requests(shape, vocab, args.seed)
    if args.text:
        from minisgl.tokenizer import load_tokenizer
        tok = load_tokenizer(MODEL)
        prompts = [(tok.decode(ids), n) for ids, n in prompts]
    runs = []
    for i in range(args.repeat):
        runs.append(one_run(args, model_json, prompts, i))
        r = runs[-1]
        print(json.dumps({k: r.get(k) for k in ("output_tok_s", "ttft", "itl", "front_cpu_us_per_token",
                                                "engine_side", "front_gc")}), flush=True)
    out = {"environment": environment(), "command": "python -m lab.checks.front " + " ".join(sys.argv[1:]),
           "settings": {**vars(args), "step_model": step_model, "model": MODEL}, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
