"""Online serving benchmark: an open-loop client against `minisgl serve` (or any OpenAI-compatible server).

    python -m minisgl.bench.serving --model assets/tiny-qwen3 --out serving.json [-- SERVE FLAGS]
    python -m minisgl.bench.serving --url http://127.0.0.1:30000 --model DIR --out sglang.json

Without `--url` it starts `python -m minisgl serve --model MODEL [SERVE FLAGS]` on a free port, waits for /health,
drives it, and stops it (SIGTERM). With `--url` it drives that server (SGLang's, vLLM's: streaming
`/v1/completions` with token-id prompts, the way `sglang.bench_serving --backend vllm --dataset-name random-ids`
does; `--model` then only names the model and gives the vocabulary size, from its config.json).

Each rate in `--rates` (requests per second; `inf` = all at once) sends its own set of random-ids requests: input
lengths uniform in [input_len * range_ratio, input_len], output lengths likewise (`ignore_eos`, so each runs to
its length), token ids uniform over the vocabulary, arrival gaps exponential (a Poisson process), all from
`--seed`. The all-at-once run has its own shape (`--burst-*`, by default the issue's 512 x 1024 in / 512 out).
Per rate: TTFT, TPOT, ITL and end-to-end latency (median, P99, mean), output tokens per second, failures; for a
server it started, also the CPU seconds its two processes spent (the front's per output token says how close
the HTTP/detokenizing side is to being the bottleneck).
`--offline` then runs the same all-at-once requests through `minisgl.LLM` in this process (after the server has
exited, so it has the device to itself) and reports the server's share of the offline engine's token rate.

The client is a minimal HTTP/1.1 client on asyncio streams (one connection per request, chunked transfer
decoding, server-sent events): at thousands of events per second a pure-Python HTTP library costs enough CPU to
distort the latencies it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Shape:
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_requests(shape: Shape, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) for each request, from the seed alone."""
    rng = random.Random(seed)
    lo_in, lo_out = max(1, int(shape.input_len * shape.range_ratio)), max(1, int(shape.output_len * shape.range_ratio))
    reqs = []
    for _ in range(shape.num_prompts):
        n_in, n_out = rng.randint(lo_in, shape.input_len), rng.randint(lo_out, shape.output_len)
        reqs.append(([rng.randrange(vocab) for _ in range(n_in)], n_out))
    return reqs


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: a Poisson process of `rate` per second (inf: all at 0)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- the client ------------------------------------------------------------------------------------------
async def _read_chunked(reader: asyncio.StreamReader):
    """The body of a `Transfer-Encoding: chunked` response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def stream_completion(url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    """One streaming /v1/completions request; times the first token, every later one, and the end."""
    parts = urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    res = Result()
    t0 = time.perf_counter()
    writer = None
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80, limit=1 << 22)
        writer.write(head + body)
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        chunks = _read_chunked(reader) if headers.get("transfer-encoding") == "chunked" else None
        if status != 200 or chunks is None:
            rest = b"".join([c async for c in chunks]) if chunks else await reader.read()
            res.error = f"HTTP {status}: {rest[:200].decode(errors='replace')}"
            return res
        buf, last, counted = b"", None, 0
        async for data in chunks:
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    continue
                msg = json.loads(payload)
                if "error" in msg:
                    res.error = str(msg["error"].get("message"))[:200]
                    return res
                if msg.get("usage"):
                    res.output_tokens = msg["usage"]["completion_tokens"]
                choices = msg.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last, counted = now, counted + 1
        res.latency = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or counted
        res.ok = last is not None
        if not res.ok:
            res.error = "no token came back"
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return res


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: {"median_ms": _ms(statistics.median(xs) if xs else None), "p99_ms": _ms(_pct(xs, 99)),  # noqa: E731
                     "mean_ms": _ms(statistics.fmean(xs) if xs else None)}
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failures": len(results) - len(ok),
        "failure_samples": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(duration, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / duration, 1) if duration > 0 else None,
        "request_throughput": round(len(ok) / duration, 3) if duration > 0 else None,
        "ttft": ms([r.ttft for r in ok]), "tpot": ms(tpot), "itl": ms([x for r in ok for x in r.itl]),
        "e2e": ms([r.latency for r in ok]),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 3)


async def run_rate(url: str, model: str, reqs: list[tuple[list[int], int]], rate: float, seed: int) -> dict:
    """Send every request at its arrival time (open loop: never waiting for earlier ones); their figures."""
    times = arrival_times(len(reqs), rate, seed)
    start = time.perf_counter()

    async def one(at: float, prompt: list[int], n_out: int) -> Result:
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await stream_completion(url, model, prompt, n_out)
    results = await asyncio.gather(*(one(t, p, n) for t, (p, n) in zip(times, reqs)))
    return summarize(list(results), time.perf_counter() - start)


# --- the server under test -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, serve_args: list[str], timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """`python -m minisgl serve` on a free loopback port, once /health answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model, "--port", str(port),
           "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, cmd, timeout)
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, cmd: list[str], timeout: float) -> None:
    """Return once the server `proc` (started with `cmd`) answers /health at `url`; RuntimeError (and the server
    stopped) when it exits first or does not answer within `timeout` seconds."""
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} while starting: {cmd}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout}s")


def stop_server(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def served_model(url: str) -> str:
    import httpx
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def vocab_size(model: str) -> int:
    from transformers import AutoConfig

    from minisgl.loader import resolve_model_path
    cfg = AutoConfig.from_pretrained(resolve_model_path(model))
    return getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size


def run_offline(model: str, serve_args: list[str], reqs: list[tuple[list[int], int]]) -> dict:
    """The same requests through `minisgl.LLM`, all at once, with the server's engine flags; its token rate."""
    from minisgl.bench.runner import _sync, warm_up
    from minisgl.config import add_engine_args, engine_kwargs_from_args
    from minisgl.llm import LLM
    from minisgl.sampling_params import SamplingParams
    parser = argparse.ArgumentParser()
    add_engine_args(parser)  # the engine's flags among the server's (the server's own are left aside)
    kwargs = engine_kwargs_from_args(parser.parse_known_args(["--model", model, *serve_args])[0])
    llm = LLM(model, **kwargs)
    try:
        warm_up(llm)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in reqs], params, progress=False)
        _sync()
        duration = time.perf_counter() - t0
    finally:
        llm.close()
    tokens = sum(len(o.token_ids) for o in outs)
    # the last first token: when every prompt had been prefilled, so prompt tokens / it is the prefill rate with
    # the decodes of the requests already streaming mixed in
    last = max(o.ttft for o in outs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"requests": len(reqs), "output_tokens": tokens, "duration_s": round(duration, 3),
            "output_tok_s": round(tokens / duration, 1), "ttft_median_ms": _ms(statistics.median(o.ttft for o in outs)),
            "ttft_max_ms": _ms(last), "prompt_tokens": prompt_tokens,
            "prompt_tok_s_until_last_first_token": round(prompt_tokens / last, 1)}


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return None


def engine_pid(url: str) -> int | None:
    import httpx
    try:
        return httpx.get(url + "/v1/internal/stats", timeout=30).json().get("engine_pid")
    except (httpx.HTTPError, ValueError):
        return None


def rate_label(rate: float) -> str:
    return "all_at_once" if math.isinf(rate) else f"rate_{rate:g}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m minisgl.bench.serving", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model folder or id (the server's, or the one --url serves)")
    p.add_argument("--url", default=None, help="drive this OpenAI-compatible server instead of starting minisgl's")
    p.add_argument("--rates", default="8,24,48,inf", help="requests per second, comma-separated; inf = all at once")
    p.add_argument("--num-prompts", type=int, default=300, help="requests per rate")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in [len * ratio, len]")
    p.add_argument("--burst-prompts", type=int, default=512, help="requests of the all-at-once run")
    p.add_argument("--burst-input-len", type=int, default=1024)
    p.add_argument("--burst-output-len", type=int, default=512)
    p.add_argument("--burst-range-ratio", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup", type=int, default=8, help="requests sent (and not counted) before the first rate")
    p.add_argument("--offline", action="store_true", help="also run the all-at-once requests through minisgl.LLM")
    p.add_argument("--label", default=None, help="a name for this run in the JSON")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    vocab = vocab_size(a.model)
    shape = Shape(a.num_prompts, a.input_len, a.output_len, a.range_ratio)
    burst = Shape(a.burst_prompts, a.burst_input_len, a.burst_output_len, a.burst_range_ratio)

    from minisgl.bench.runner import environment, write_json
    proc, url = (None, a.url) if a.url else start_server(a.model, serve_args)
    data = {"environment": environment(), "label": a.label,
            "settings": {"model": a.model, "url": a.url, "server": "external" if a.url else "minisgl serve",
                         "serve_args": serve_args, "rates": a.rates, "shape": asdict(shape), "burst": asdict(burst),
                         "seed": a.seed, "vocab_size": vocab, "client": "minisgl.bench.serving"},
            "results": {}}
    try:
        model = served_model(url)
        pids = {"front": proc.pid, "engine": engine_pid(url)} if proc is not None else {}
        warm = make_requests(Shape(a.warmup, min(a.input_len, 256), 16, 1.0), vocab, a.seed + 99)
        if warm:
            asyncio.run(run_rate(url, model, warm, math.inf, a.seed))
        for i, rate in enumerate(rates):
            reqs = make_requests(burst if math.isinf(rate) else shape, vocab, a.seed + 10 * i)
            cpu0 = {k: cpu_seconds(pid) for k, pid in pids.items()}
            result = asyncio.run(run_rate(url, model, reqs, rate, a.seed + 10 * i))
            for k, pid in pids.items():
                used = cpu_seconds(pid)
                if used is not None and cpu0[k] is not None:
                    result[f"{k}_cpu_s"] = round(used - cpu0[k], 3)
                    result[f"{k}_cpu_us_per_token"] = round(1e6 * (used - cpu0[k]) / max(1, result["output_tokens"]), 1)
            data["results"][rate_label(rate)] = {"rate": a.rates.split(",")[i], **result}
            print(rate_label(rate), json.dumps({k: result[k] for k in ("completed", "failures", "output_tok_s")}),
                  "TTFT", result["ttft"]["median_ms"], "TPOT", result["tpot"]["median_ms"],
                  "ITL", result["itl"]["median_ms"], "/", result["itl"]["p99_ms"], flush=True)
            write_json(a.out, data)
    finally:
        if proc is not None:
            data["server_exit_status"] = stop_server(proc)
    if a.offline:
        i = next((i for i, r in enumerate(rates) if math.isinf(r)), None)
        reqs = make_requests(burst, vocab, a.seed + 10 * (i if i is not None else len(rates)))
        data["offline"] = run_offline(a.model, serve_args, reqs)
        online = data["results"].get("all_at_once", {}).get("output_tok_s")
        if online:
            data["server_over_offline"] = round(online / data["offline"]["output_tok_s"], 3)
        print("offline", json.dumps(data["offline"]), "server/offline", data.get("server_over_offline"))
    write_json(a.out, data)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
