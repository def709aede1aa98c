"""Command line: `python -m minisgl {generate,bench,serve} ...` with SGLang-like engine flags."""

from __future__ import annotations

import argparse
import json
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=True, help="model folder (HF layout) or hub id")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--page-size", type=int, default=1)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--mem-fraction", type=float, default=0.85, help="share of free GPU memory for the KV pool")
    g.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool size on a CPU")
    g.add_argument("--max-running-requests", type=int, default=256)
    g.add_argument("--chunked-prefill-size", type=int, default=8192, help="prefill tokens per step; <=0: off")
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--disable-overlap-schedule", action="store_true")
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--cuda-graph-max-bs", type=int, default=256)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flashinfer"])
    g.add_argument("--tp-size", type=int, default=1, help="tensor parallelism: ranks (one GPU each)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(dtype=a.dtype, device=a.device, load_format=a.load_format, seed=a.seed,
                max_model_len=a.max_model_len, page_size=a.page_size, num_pages=a.num_pages,
                kv_memory_fraction=a.mem_fraction, kv_cache_tokens=a.kv_cache_tokens,
                max_running_requests=a.max_running_requests, chunked_prefill_size=a.chunked_prefill_size,
                chunked_prefill=a.chunked_prefill_size > 0, radix_cache=not a.disable_radix_cache,
                overlap=not a.disable_overlap_schedule, cuda_graph=not a.disable_cuda_graph,
                cuda_graph_max_bs=a.cuda_graph_max_bs, attention_backend=a.attention_backend,
                tp_size=a.tp_size)


def cmd_generate(a: argparse.Namespace) -> int:
    from minisgl import LLM, SamplingParams
    llm = LLM(a.model, **engine_kwargs(a))
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, max_tokens=a.max_tokens,
                            ignore_eos=a.ignore_eos, stop=tuple(a.stop or ()))
    outs = llm.generate(a.prompt, params, progress=len(a.prompt) > 8)
    for prompt, out in zip(a.prompt, outs):
        if len(a.prompt) > 1:
            print(f"### {prompt}")
        print(prompt + (out.text if out.text is not None else str(out.token_ids)))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from minisgl import LLM
    from minisgl.bench.runner import environment, run_workload, write_json
    llm = LLM(a.model, **engine_kwargs(a), progress=not a.quiet)
    results = {}
    for name in a.workload:
        results[name] = run_workload(llm, name, scale=a.scale)
        print(name, json.dumps({k: v for k, v in results[name].items() if not isinstance(v, list)}, default=str))
    data = {"environment": environment(), "settings": {**engine_kwargs(a), "model": a.model, "scale": a.scale},
            "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens, "results": results}
    if a.out:
        write_json(a.out, data)
        print(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minisgl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="run standard workloads W1-W4 and write JSON")
    add_engine_args(b)
    b.add_argument("--workload", action="append", choices=["w1", "w2", "w3", "w4"], required=True)
    b.add_argument("--scale", type=float, default=1.0, help="shrink the workload (<1) for a CPU smoke run")
    b.add_argument("--out", default=None, help="JSON file to write")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=cmd_bench)

    try:
        from minisgl.server import add_serve_args, run_serve
    except ImportError:
        add_serve_args = run_serve = None
    if add_serve_args is not None:
        s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        add_engine_args(s)
        add_serve_args(s)
        s.set_defaults(func=lambda a: run_serve(a, engine_kwargs(a)))

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
