"""Count the kernel launches of one model step on a CPU: a decode step at batch 1 and 8, and a one-request prefill.

A CUDA graph removes the host cost of a launch but not the GPU's ~2-3 us per kernel, so at batch 1 the step time
of a small model tracks its kernel count. This script estimates that count without a GPU:

- aten ops, through a TorchDispatchMode: every op that would launch a kernel on a GPU counts once. Views and
  metadata ops (`OpOverload.is_view`, sizes, strides) and bare allocations (empty, empty_strided) launch
  nothing and are skipped; `_local_scalar_dense` (.item() / .tolist(): a host sync on a GPU) is counted apart.
- Triton kernels: with `--triton` (the default) the Triton path runs under the interpreter
  (TRITON_INTERPRET=1, MINISGL_FORCE_TRITON=1, the Triton attention backend), and every kernel launch counts
  once; the aten ops the interpreter itself runs while executing a kernel are not counted.

Ops are attributed to the decoder layer running them (forward hooks), so the report gives counts per layer
type (Qwen3.5: Gated DeltaNet "linear_attention" and "full_attention"; Qwen3: "attention") and for the rest of
the model ("head": embedding, final norm, LM head). The model is the real config's shape with fewer layers
(`--layers`, default one period: 4 for Qwen3.5, 2 for Qwen3) and a small vocabulary (`--vocab`, default 1024);
neither changes the count per layer, and the total of the full model is extrapolated from them. The counts are
of one model forward (what a decode CUDA graph replays, less the sampler). aten ops are the CPU dispatch's:
close to, not exactly, the CUDA launches (e.g. a GEMM is one `mm`/`addmm` either way; cuBLAS may add a
split-K reduction kernel on the GPU). `--no-triton` counts the torch reference path (the CPU path).

    python scripts/count_step_ops.py [--model qwen3.5-0.8b|qwen3-0.6b|both] [--out counts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout: the package is not installed
CONFIGS = {"qwen3.5-0.8b": REPO / "assets/configs/qwen3.5-0.8b", "qwen3-0.6b": REPO / "assets/configs/qwen3-0.6b"}
# ops that launch nothing on a GPU: allocations and tensor metadata
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "detach", "lift_fresh", "resize_", "set_",
              "promote_types", "result_type", "resolve_conj", "resolve_neg"}


def _small_config(name: str, layers: int | None, vocab: int, tmp: str) -> tuple[str, dict]:
    """The config with fewer layers and a small vocabulary, written to tmp; returns (path, full-model layer
    counts by type)."""
    cfg = json.loads((CONFIGS[name] / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    types = text.get("layer_types") or ["attention"] * text["num_hidden_layers"]
    full = Counter(types)
    n = layers or (4 if "layer_types" in text else 2)
    text["num_hidden_layers"] = n
    if "layer_types" in text:
        text["layer_types"] = types[:n]
    text["vocab_size"] = vocab
    for key in ("eos_token_id", "bos_token_id"):
        if isinstance(text.get(key), int):
            text[key] = min(text[key], vocab - 1)
    if text is not cfg:
        for key in ("image_token_id", "video_token_id"):
            cfg.pop(key, None)
    cfg.pop("eos_token_id", None)
    text["eos_token_id"] = vocab - 1
    out = os.path.join(tmp, name)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out, dict(full)


def _copied(args, out) -> bool:
    import torch
    src = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if src is None or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


class _Counter:
    """Counts kernel launches by (scope, op name); `scope` is set by the layer hooks."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.syncs: Counter = Counter()
        self.scope = "head"
        self.in_triton = 0
        self.active = False

    def aten(self, func, args, out) -> None:
        if not self.active or self.in_triton:
            return
        name = func._schema.name.split("::")[-1]
        if name == "_local_scalar_dense":
            self.syncs[self.scope] += 1
        elif name in _NO_KERNEL:
            pass
        elif not func.is_view or _copied(args, out):
            # an op that may alias its input (to, reshape, contiguous) launches a kernel only when it copies
            self.counts[(self.scope, name)] += 1

    def triton(self, name: str) -> None:
        if self.active and not self.in_triton:
            self.counts[(self.scope, "triton:" + name)] += 1


def _install(counter: _Counter):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counter.aten(func, args, out)
            return out

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        InterpretedFunction = None
    if InterpretedFunction is not None:
        run = InterpretedFunction.run

        def counted_run(self, *args, **kwargs):
            counter.triton(self.fn.__name__)
            counter.in_triton += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_triton -= 1

        InterpretedFunction.run = counted_run
    del torch
    return Mode()


def _layer_kind(model, i: int) -> str:
    types = getattr(model.cfg, "layer_types", ())
    return types[i] if types else "attention"


def _run(path: str, bs: int, args, counter: _Counter, mode) -> tuple[list, Counter]:
    """Prefill bs requests, then one decode step; the counts of each model forward, and the layer kinds."""
    import torch

    from minisgl import LLM, SamplingParams

    llm = LLM(path, load_format="dummy", dtype=args.dtype, device="cpu", max_model_len=256,
              max_running_requests=8, kv_cache_tokens=2048, overlap=False, radix_cache=False,
              attention_backend="triton" if args.triton else "torch")
    model = llm.engine.runner.model
    layer_of = {}

    def pre(mod, _inputs):
        counter.scope = layer_of[id(mod)]

    def post(mod, _inputs, _out):
        counter.scope = "head"

    for i, layer in enumerate(model.layers):
        layer_of[id(layer)] = _layer_kind(model, i)
        layer.register_forward_pre_hook(pre)
        layer.register_forward_hook(post)
    forward = model.forward
    steps = []

    def counted(input_ids, *a, **kw):
        counter.counts.clear()
        counter.syncs.clear()
        counter.scope, counter.active = "head", True
        try:
            with mode:
                return forward(input_ids, *a, **kw)
        finally:
            counter.active = False
            steps.append((int(input_ids.shape[0]), Counter(counter.counts), Counter(counter.syncs)))

    model.forward = counted
    engine = llm.engine
    gen = torch.Generator().manual_seed(bs)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for _ in range(bs):
        engine.add_request(torch.randint(3, args.vocab - 2, (args.prompt,), generator=gen).tolist(), sp)
    engine.step()  # the prefill of all bs requests
    engine.step()  # a decode step
    engine.run()
    return steps, Counter(layer_of.values())


def measure(name: str, args) -> dict:
    counter = _Counter()
    mode = _install(counter)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        path, full_layers = _small_config(name, args.layers, args.vocab, tmp)
        for bs in (1, 8):
            steps, kinds = _run(path, bs, args, counter, mode)
            if bs == 1:
                result[f"prefill_1x{args.prompt}"] = _summary(*steps[0], kinds, full_layers)
            result[f"decode_bs{bs}"] = _summary(*steps[1], kinds, full_layers)
    return result


def _summary(tokens: int, counts: Counter, syncs: Counter, kinds: Counter, full_layers: dict) -> dict:
    per_scope: Counter = Counter()
    ops: dict[str, Counter] = {}
    for (scope, op), n in counts.items():
        per_scope[scope] += n
        ops.setdefault(scope, Counter())[op] += n
    per_layer = {k: per_scope[k] / kinds[k] for k in kinds}
    total = per_scope["head"] + sum(per_layer[k] * full_layers.get(k, 0) for k in kinds)
    return {
        "tokens": tokens,
        "head": per_scope["head"],
        "per_layer": per_layer,
        "measured_total": sum(per_scope.values()),
        "full_model_total": total,
        "host_syncs": dict(syncs),
        "ops_per_layer": {k: {op: n / (kinds[k] if k in kinds else 1) for op, n in sorted(c.items())}
                          for k, c in ops.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="both", choices=["both", *CONFIGS])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers built (default: one period)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length of the prefill step")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-triton", dest="triton", action="store_false", help="count the torch (CPU) path")
    ap.add_argument("--out", default=None, help="write the counts as JSON here")
    ap.add_argument("--verbose", action="store_true", help="print the ops of each layer type")
    args = ap.parse_args()
    if args.triton:
        # before triton is imported: kernels become interpreted functions that run on CPU tensors
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["MINISGL_FORCE_TRITON"] = "1"
        sys.path.insert(0, str(REPO / "tests"))
        from helpers import use_triton_interpreter
        use_triton_interpreter()
    names = list(CONFIGS) if args.model == "both" else [args.model]
    out = {"triton": args.triton, "dtype": args.dtype, "vocab": args.vocab, "layers": args.layers,
           "models": {n: measure(n, args) for n in names}}
    for name, res in out["models"].items():
        print(f"== {name} ({'Triton path' if args.triton else 'torch path'})")
        for step, r in res.items():
            layers = ", ".join(f"{k} {v:.0f}" for k, v in r["per_layer"].items())
            print(f"  {step:14s} full model ~{r['full_model_total']:.0f} kernels; per layer: {layers}; "
                  f"head {r['head']}; host syncs {sum(r['host_syncs'].values())}")
            if args.verbose:
                for scope, ops in r["ops_per_layer"].items():
                    print(f"    {scope}: " + ", ".join(f"{op} {n:g}" for op, n in ops.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
