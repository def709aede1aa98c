"""A bounded soak of the HTTP server on loopback: rounds of normal, streaming, aborted and oversized requests
while a thread polls /health, with the server's RSS read after each round.

    python -m minisgl.server.soak --model assets/tiny-qwen3 --rounds 5

starts `python -m minisgl serve` as a subprocess (the real entry point), runs the rounds and prints a JSON
summary: requests served / aborted / refused, the worst /health latency, RSS after each round, and the
server's KV page accounting at the end. tests/test_server_soak.py runs it and checks the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from minisgl.environment import child_environment

BIG_TEXT_CHARS = 7_900_000  # the size of the prompt that stalled /health for 4.8 s (issue 15)
TOKENIZED_TEXT_CHARS = 100_000  # under the raw bound: tokenized (on the pool), then refused by token count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def poll_health(url: str, interval: float = 0.02) -> None:
    """GET /health every `interval` seconds until stdin closes, then print the latencies (JSON). Runs in its own
    process (`--poll URL`): a thread of the load generator would measure its own GIL waits, not the server."""
    latencies, failures, done = [], [], threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    with httpx.Client(timeout=30) as client:
        while not done.is_set():
            t0 = time.perf_counter()
            try:
                r = client.get(url + "/health")
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:100]}")
            except httpx.HTTPError as e:
                failures.append(repr(e))
            latencies.append(time.perf_counter() - t0)
            done.wait(interval)
    print(json.dumps({"latencies": latencies, "failures": failures}))


class HealthPoller:
    """poll_health in a subprocess for the duration of a `with` block."""

    def __enter__(self) -> HealthPoller:
        return self

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "minisgl.server.soak", "--poll", url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=Path(__file__).resolve().parents[2])
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate("", timeout=60)
        data = json.loads(out)
        self.latencies, self.failures = data["latencies"], data["failures"]


def _bodies(model: str) -> dict[str, tuple[str, bytes, int, str, str]]:
    """The oversized and malformed requests, encoded once: name -> (endpoint, raw body, the status, error code
    and param expected)."""
    big = "lorem ipsum dolor sit amet " * (BIG_TEXT_CHARS // 27)
    mid = "the engine batches requests " * (TOKENIZED_TEXT_CHARS // 28)
    enc = lambda d: json.dumps(d).encode()  # noqa: E731
    ctx = "context_length_exceeded"
    return {
        "big_text": ("/v1/completions", enc({"model": model, "prompt": big, "max_tokens": 4}), 400, ctx, "prompt"),
        "big_chat": ("/v1/chat/completions", enc({"model": model, "max_tokens": 4, "messages": [
            {"role": "user", "content": big}]}), 400, ctx, "messages"),
        "big_ids": ("/v1/completions", enc({"model": model, "prompt": [7] * 1_000_000, "max_tokens": 4}), 400, ctx,
                    "prompt"),
        "tokenized_text": ("/v1/completions", enc({"model": model, "prompt": mid, "max_tokens": 4}), 400, ctx,
                           "prompt"),
        "over_body_limit": ("/v1/completions", b'{"model": "' + b"x" * (9 << 20) + b'"}', 413, "request_too_large",
                            None),
        "bad_json": ("/v1/completions", b'{"model": ' + b"[" * 50_000, 400, "invalid_json", None),
    }


async def _normal(client: httpx.AsyncClient, model: str, i: int) -> str:
    r = await client.post("/v1/completions", json={"model": model, "prompt": f"Request {i}: the server",
                                                     "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    return "served"


async def _stream(client: httpx.AsyncClient, model: str, i: int, hang_up_after: int | None) -> str:
    # a stream the client hangs up on is long (256 tokens), so the engine is still generating it when the
    # disconnect arrives: with 24 tokens a busy CI host let some finish first (the engine counted them finished,
    # the client aborted)
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about stream {i}."}],
            "max_tokens": 24 if hang_up_after is None else 256, "temperature": 0.7, "seed": i, "stream": True,
            "ignore_eos": True}
    events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if hang_up_after is not None and events >= hang_up_after:
                return "aborted"  # leaving the block closes the connection mid-stream
            events += 1
            if line == "data: [DONE]":
                return "served"
            assert "error" not in json.loads(line[6:]), line
    raise AssertionError("the stream ended without [DONE]")


async def _oversized(client: httpx.AsyncClient, endpoint: str, raw: bytes, status: int, code: str,
                     param: str | None) -> str:
    r = await client.post(endpoint, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]  # an OpenAI error body, from our app
    assert set(err) == {"message", "type", "param", "code"}, err
    assert (err["code"], err["param"]) == (code, param), err
    return f"refused_{r.status_code}"


async def _round(url: str, model: str, bodies: dict, round_id: int) -> dict[str, int]:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        jobs = []
        for i in range(6):
            jobs.append(_normal(client, model, 100 * round_id + i))
            jobs.append(_stream(client, model, 100 * round_id + i, None))
        for i in range(4):
            jobs.append(_stream(client, model, 100 * round_id + 50 + i, hang_up_after=3))
        for name, spec in bodies.items():
            for _ in range(3 if name == "big_text" else 2 if name != "bad_json" else 1):
                jobs.append(_oversized(client, *spec))
        outcomes = await asyncio.gather(*jobs)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/internal/stats", timeout=30).json()


def _wait_idle(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(url)
        if not s["has_work"] and s["active_handles"] == 0:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine is still busy: {s}")
        time.sleep(0.05)


def _wait_started(proc: subprocess.Popen, url: str, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return False


def run_soak(model_path: str, rounds: int = 5, extra_args: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """Start the server, run the rounds, stop it; returns the figures (see the module docstring)."""
    env = child_environment(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    for _attempt in range(3):  # a free port can be taken by another process before the server binds it
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model_path, "--served-model-name", "tiny",
               "--port", str(port), "--log-level", "warning", "--kv-cache-tokens", "4096", *extra_args]
        proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parents[2])
        if _wait_started(proc, url):
            break
    else:
        raise RuntimeError(f"the server did not start (exit status {proc.poll()})")
    try:
        bodies = _bodies("tiny")
        result: dict = {"rss_mb_start": round(rss_mb(proc.pid), 1), "rss_mb_per_round": [], "rounds": [],
                        "worst_health_s_per_round": []}
        totals: dict[str, int] = {}
        for r in range(rounds):
            with HealthPoller(url) as poller:
                time.sleep(0.5)  # the poller's first requests go out before the round starts
                t0 = time.perf_counter()
                counts = asyncio.run(_round(url, "tiny", bodies, r))
                wall = time.perf_counter() - t0
            _wait_idle(url)
            result["rss_mb_per_round"].append(round(rss_mb(proc.pid), 1))
            result["worst_health_s_per_round"].append(round(max(poller.latencies), 3))
            result["rounds"].append({"wall_s": round(wall, 2), "outcomes": counts,
                                     "health_polls": len(poller.latencies), "health_failures": poller.failures})
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
        final = _wait_idle(url)
        result.update(
            totals=totals, served=totals.get("served", 0), aborted=totals.get("aborted", 0),
            refused=sum(v for k, v in totals.items() if k.startswith("refused")),
            worst_health_s=max(result["worst_health_s_per_round"]),
            engine={k: final[k] for k in ("finished", "aborted", "rejected", "errors", "bad_requests",
                                          "kv_pages_capacity", "kv_pages_free", "kv_pages_evictable",
                                          "kv_pages_leaked", "running", "waiting")})
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--poll", metavar="URL", help=argparse.SUPPRESS)  # the /health poller's process
    p.add_argument("--model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("server_args", nargs="*", help="extra `serve` flags (after --)")
    a = p.parse_args(argv)
    if a.poll:
        poll_health(a.poll)
        return 0
    if not a.model:
        p.error("--model is required")
    print(json.dumps(run_soak(a.model, a.rounds, tuple(a.server_args)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
