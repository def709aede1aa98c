"""How a measurement builds an engine: settings (EngineConfig fields) and kernel options, applied in one place.

Settings are the engine's switches (`overlap=False`, `gemv=False`, ...); kernel options are the fields of its
`KernelOptions` (`decode_fused_store=False`, `gemv_pdl_early_tiles=1`, `sampler_launch={...}`, ...), which
`LLM` takes by name and applies to that engine's launches only, plus two conveniences of the lab: `gemv_table`
(some GEMV tile entries replaced: written as a table file for `gemv_configs`) and `fused_sampler`. The kernel
checks and tunes (lab.checks, lab.tune), which call kernels directly, run them under `kernel_options(...)`.
Every result records both, so a JSON says what ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from lab.models import model_path
from lab.timing import time_replay_us
from minisgl.config import KernelOptions
from minisgl.kernels.options import current_options, use_options

T = TypeVar("T")


def log(*args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *args, flush=True)


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def replaced(obj, name: str, value: Any) -> Iterator[None]:
    """obj.name is `value` inside the block, then what it was: the object's (or module's) own attribute back, or
    none again, so a method replaced on an instance is the class's method after, not a bound copy of it."""
    own = vars(obj)
    had, before = name in own, own.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, before)
        else:
            delattr(obj, name)


def _module_value(module: str, name: str, value: Any):
    return replaced(importlib.import_module(module), name, value)


_TABLES: list[Path] = []  # the folder of GEMV tables written for `gemv_configs` (made on first use)


def table_json(table) -> dict:
    """A GEMV tile table ({(N, K): tiles and rows, or None}) in the tuned tables' JSON form ({"N,K": [...] or
    None}), as lab.tune.gemv writes one and `gemv_configs` reads it."""
    return {f"{n},{k}": (list(v) if v is not None else None) for (n, k), v in table.items()}


def gemv_table_file(updates: dict) -> str:
    """A JSON tile table for the `gemv_configs` option: the GPU's tuned table with some shapes' entries replaced
    ({"N,K": [BLOCK_N, BLOCK_K, warps, rows] or None for cuBLAS}), written once per distinct table."""
    from minisgl.kernels import gemv
    table = table_json(gemv.device_table(torch.cuda.get_device_name()) if torch.cuda.is_available() else {})
    table.update({(k if isinstance(k, str) else ",".join(map(str, k))): (list(v) if v is not None else None)
                  for k, v in updates.items()})
    text = json.dumps(table, indent=1, sort_keys=True)
    if not _TABLES:
        _TABLES.append(Path(tempfile.mkdtemp(prefix="lab-gemv-tables-")))
    path = _TABLES[0] / f"gemv_{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    path.write_text(text)
    return str(path)


# the lab's own conveniences on top of KernelOptions' fields (minisgl/config.py), and what each does
LAB_OPTIONS = {
    "gemv_table": "entries of the decode GEMV's tuned table replaced ({'N,K': [tiles..., rows] or None})",
    "fused_sampler": "sampling with top-k/top-p/temperature in one Triton kernel (else torch, with a sort)",
}
KERNEL_OPTIONS = {**{f.name: (f.metadata.get("help") or f.name) for f in dataclasses.fields(KernelOptions)},
                  **LAB_OPTIONS}


def kernel_fields(options: dict) -> dict:
    """Lab kernel options -> KernelOptions fields: `gemv_table` becomes a `gemv_configs` file; `sampler_launch`
    and `gdn` may be dicts of some of their fields (the rest: the defaults in force); `fused_sampler` has no
    field (it is applied by `kernel_options` / `with_engine`)."""
    unknown = set(options) - set(KERNEL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown kernel options {sorted(unknown)}; known: {sorted(KERNEL_OPTIONS)}")
    defaults = current_options()
    out = {}
    for name, value in options.items():
        if name == "gemv_table":
            out["gemv_configs"] = gemv_table_file(value)
        elif name in ("sampler_launch", "gdn") and isinstance(value, dict):
            out[name] = dataclasses.replace(getattr(defaults, name), **value)
        elif name != "fused_sampler":
            out[name] = value
    return out


def _fused_sampler(options: dict):
    """`fused_sampler=False`: the sampler takes its torch path (a sort per row for top-k/top-p), as it does where
    the fused kernel is missing (the sampler checks `minisgl.kernels.sampling.triton`). No engine option says so
    yet: this is the lab's one patch of a module value, for that arm's engine only."""
    if options.get("fused_sampler", True):
        return contextlib.nullcontext()
    return _module_value("minisgl.kernels.sampling", "triton", None)


@contextlib.contextmanager
def kernel_options(**options: Any) -> Iterator[KernelOptions]:
    """Kernel launches inside the block run under the options in force with these replaced (for the checks and
    tunes that call kernels directly; an engine applies its own options, given to `build`)."""
    fields = kernel_fields(options)
    with _fused_sampler(options), use_options(dataclasses.replace(current_options(), **fields)) as opts:
        yield opts


def build(model: str, settings: dict | None = None, kernel: dict | None = None, **fixed: Any):
    """An engine on `model`'s dummy bf16 weights: `fixed` are the caller's own LLM arguments (e.g. a smaller
    KV pool for a check), `settings` the engine switches and `kernel` the kernel options a result records."""
    from minisgl import LLM
    kw = {"load_format": "dummy", "dtype": "bfloat16", **fixed, **(settings or {}), **kernel_fields(kernel or {})}
    return LLM(model_path(model), **kw)


def with_engine(model: str, body: Callable[[Any], T], settings: dict | None = None, kernel: dict | None = None,
                **fixed: Any) -> T:
    """Build an engine, run body(llm), drop the engine and give its GPU memory back before returning: nothing
    keeps a reference to it, so the next engine of the section starts on the same free memory."""
    kernel = kernel or {}
    with _fused_sampler(kernel):
        llm = build(model, settings, kernel, **fixed)
        try:
            return body(llm)
        finally:
            llm.close()
            del llm
            free_gpu()


def gemv_kinds(model) -> dict[str, list]:
    """A model's GemvLinear modules by kind, the last part of each module's name (qkv_proj, o_proj, ...,
    lm_head), in the model's order."""
    from minisgl.kernels.gemv import GemvLinear

    kinds: dict[str, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, GemvLinear):
            kinds.setdefault(name.rsplit(".", 1)[-1], []).append(module)
    return kinds


STEP_BUFFERS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "token_dst")


@contextlib.contextmanager
def step_graph(llm):
    """The engine's batch-1 decode graph (the forward, the argmax, the token write) captured again under whatever
    the caller has in force (kernel options, patched modules, changed tiles), on the live request's buffers
    (`decoding_request` first): the greedy graph, to replay in the block. The live graph's metadata is back after."""
    from minisgl.engine.cuda_graph import CudaGraphRunner

    runner = llm.engine.runner
    live = runner.graph_runner
    graph = CudaGraphRunner(runner, 1, batch_sizes=[1])
    for buf in STEP_BUFFERS:
        getattr(graph, buf)[:1].copy_(getattr(live, buf)[:1])
    runner.attn.prepare_for_replay(graph._meta(1))
    try:
        yield graph.graphs[1, "greedy"]
    finally:
        del graph
        runner.attn.prepare_for_replay(live._meta(1))


def step_replay_us(llm, iters: int = 15, per: int = 10) -> float:
    """`step_graph` replayed back to back: microseconds a step."""
    with step_graph(llm) as step:
        return time_replay_us(step, iters=iters, warmups=3, per=per)


def decoding_request(llm, prompt_len: int = 1024, steps: int = 8):
    """One greedy request of prompt_len made-up token ids, decoded `steps` tokens: the engine's batch-1 decode
    graph then holds its step's inputs (what lab.checks' step probes replay). Returns the request."""
    import torch

    from minisgl import SamplingParams

    prompt = [(31 * j + 7) % 10000 for j in range(prompt_len)]
    req = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    while len(req.output_ids) < steps:
        llm.engine.step()
    torch.cuda.synchronize()
    return req
