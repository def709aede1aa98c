"""Command line: `python -m minisgl {generate,bench,serve} ...`.

The engine flags are SGLang's names (--disable-overlap-schedule, --disable-cuda-graph, --disable-radix-cache,
--chunked-prefill-size, --page-size, --attention-backend, ...), generated once from EngineConfig's fields by
`minisgl.config.add_engine_args`, so every subcommand takes the same ones.

Errors are one line on stderr, never a traceback (`--traceback` shows it): exit status 2 when the command line
is wrong (argparse's errors, an engine setting out of range: `minisgl.errors.ConfigError`, a request the engine
refuses: `RequestError`, such as --max-tokens 0 or a prompt longer than the context), 1 when the command is right
but cannot run here (no GPU, a broken model folder, a missing package, the engine failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from minisgl.config import add_engine_args, engine_kwargs_from_args
from minisgl.errors import add_traceback_flag, run_command


def cmd_generate(a: argparse.Namespace) -> int:
    from minisgl import LLM, SamplingParams
    llm = LLM(a.model, **engine_kwargs_from_args(a))
    params = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                            max_tokens=a.max_tokens, ignore_eos=a.ignore_eos, stop=tuple(a.stop or ()))
    outs = llm.generate(a.prompt, params, progress=len(a.prompt) > 8)
    for prompt, out in zip(a.prompt, outs):
        if len(a.prompt) > 1:
            print(f"### {prompt}")
        print(prompt + (out.text if out.text is not None else str(out.token_ids)))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from minisgl import LLM
    from minisgl.bench.runner import environment, run_workload, write_json
    llm = LLM(a.model, **engine_kwargs_from_args(a), progress=not a.quiet)
    results = {}
    for name in a.workload:
        results[name] = run_workload(llm, name, scale=a.scale)
        print(name, json.dumps({k: v for k, v in results[name].items() if not isinstance(v, list)}, default=str))
    data = {"environment": environment(), "settings": {**dataclasses.asdict(llm.config), "scale": a.scale},
            "kv_pool_tokens": llm.engine.runner.kv_capacity_tokens, "results": results}
    if a.out:
        write_json(a.out, data)
        print(f"wrote {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minisgl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="run standard workloads W1-W4 and write JSON")
    add_engine_args(b)
    b.add_argument("--workload", action="append", choices=["w1", "w1_topkp", "w2", "w2_topkp", "w3", "w4"],
                   required=True)
    b.add_argument("--scale", type=float, default=1.0, help="shrink the workload (<1) for a CPU smoke run")
    b.add_argument("--out", default=None, help="JSON file to write")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=cmd_bench)

    from minisgl.server.launch import add_serve_args, run_serve  # imports nothing heavy
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(s)
    add_serve_args(s)
    s.set_defaults(func=run_serve)
    for p in (g, b, s):
        add_traceback_flag(p)

    args = parser.parse_args(argv)  # a malformed command line: argparse's message, exit status 2
    return run_command(f"minisgl {args.command}", args.func, args)


if __name__ == "__main__":
    sys.exit(main())
