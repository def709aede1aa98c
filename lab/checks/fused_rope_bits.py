"""Where the decode kernel's fused RoPE (kernel option decode_fused_rope) parts from the RoPE kernel on a GPU.

The CPU tests (tests/test_triton_kernels.py, the Triton interpreter, fp32 and fp16) have the fused path equal to
norm_and_rope-then-decode to the bit, but engines on an H200 (run25) and an H100 (run26) gave different tokens
with it on, after the q/k norm sums were made exact (0483a49). This check runs the test's comparison on the GPU in
bf16 at Qwen3's head shapes, one decode launch each way, and says which tensor differs and by how much:

- `q`: the rotated queries (the fused kernel's own q tile is not visible; `q` compares the RoPE kernel's output
  with norm_and_rope_ref's, the torch reference, to see whether the RoPE kernel itself rounds as specified);
- `k_stored`: the new key each path wrote into the cache (the fused kernel normalises and rotates it itself);
- `out`: the attention output;
- `out_identity_rope`: the fused path given the RoPE kernel's q and k and a rotation that changes nothing, against
  the unfused output: equal means the fused path's difference is in its q values, unequal that it is elsewhere;
- `out_unfused_again`, `out_store_first`: the unfused launch repeated (determinism), and with the new K/V stored
  by its own launch first (the fused store's part), each against the unfused output.

Shapes: Qwen3-0.6B (16 q heads, 8 kv heads, d 128) and Qwen3-8B (32, 8, 128), batch 1 and 8, 1 and 4 splits,
early keys on and off.

    python -m lab.checks.fused_rope_bits --out DIR        # writes DIR/fused_rope_bits.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    unequal = (a != b)
    return {"equal": bool(not unequal.any()), "elements_differing": int(unequal.sum()),
            "max_abs": float((a - b).abs().max()) if a.numel() else 0.0}


def compare(hq: int, hkv: int, d: int, bs: int, num_splits: int, early_kv: bool, seed: int,
            dev: str = "cuda", dtype: torch.dtype = torch.bfloat16, max_len: int = 2048) -> dict:
    """One decode launch each way on the same inputs (`dev`/`dtype` other than CUDA/bf16: a CPU smoke run under
    the Triton interpreter, with the kernel option triton_on_cpu in force)."""
    from lab.engines import kernel_options
    from minisgl.kernels import attention as ak
    from minisgl.kernels import elementwise as ew

    gen = torch.Generator(device=dev).manual_seed(seed)
    seq_lens = torch.randint(2, max_len, (bs,), generator=gen, device=dev, dtype=torch.int32)
    slots = bs * max_len + 1
    k0 = torch.randn(slots, hkv, d, generator=gen, device=dev).to(dtype)
    v0 = torch.randn(slots, hkv, d, generator=gen, device=dev).to(dtype)
    r2t = (1 + torch.randperm(slots - 1, generator=gen, device=dev)[: bs * max_len]).view(bs, max_len).int()
    rows = torch.arange(bs, device=dev)
    loc = r2t[rows, seq_lens.long() - 1].long()
    positions = (seq_lens - 1).long()
    qkv = torch.randn(bs, (hq + 2 * hkv) * d, generator=gen, device=dev).to(dtype)
    q, k, v = (qkv[:, : hq * d].view(bs, hq, d), qkv[:, hq * d: (hq + hkv) * d].view(bs, hkv, d),
               qkv[:, (hq + hkv) * d:].view(bs, hkv, d))
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    freqs = torch.arange(max_len, device=dev).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    qw = (1 + 0.1 * torch.randn(d, generator=gen, device=dev)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=gen, device=dev)).to(dtype)
    scale = d ** -0.5
    res = {"hq": hq, "hkv": hkv, "d": d, "bs": bs, "num_splits": num_splits, "early_kv": early_kv}

    def attend(qx, new_kv, rope=None):
        """One decode launch on fresh copies of the cache: (its output, the cache's keys after it)."""
        k_buf, v_buf = k0.clone(), v0.clone()
        if new_kv is None:  # the new K/V stored by a launch of its own first (no fused store)
            ew.store_kv(k_buf, v_buf, loc, kc, v)
        out = torch.empty(bs, hq, d, device=dev, dtype=dtype)
        ak.decode_attention(qx, k_buf, v_buf, r2t, rows, seq_lens, out, scale, max_seq_len=max_len,
                            num_splits=num_splits, new_kv=new_kv, rope=rope)
        return out, k_buf

    with kernel_options(early_kv=early_kv):
        out_fused, k_fused = attend(q, (k, v, loc), ak.DecodeRope(positions, cos_sin, qw, kw, 1e-6))
        qc, kc = q.clone(), k.clone()
        ew.norm_and_rope(qc, kc, positions, cos_sin, qw, kw, 1e-6)
        qr, kr = ew.norm_and_rope_ref(q.clone(), k.clone(), positions, cos_sin, qw, kw, 1e-6)
        res["q_kernel_vs_ref"] = diff(qc, qr)
        res["k_kernel_vs_ref"] = diff(kc, kr)
        out_unfused, k_unfused = attend(qc, (kc, v, loc))
        # the fused path fed the RoPE kernel's own q and k with a rotation that changes nothing (cos 1, sin 0, no
        # norm): the same q values reach the kernel's dots, so a difference here is the kernel's, not q's
        identity = torch.cat([torch.ones_like(cos_sin[:, : d // 2]), torch.zeros_like(cos_sin[:, : d // 2])], -1)
        res["out_identity_rope"] = diff(attend(qc, (kc, v, loc), ak.DecodeRope(positions, identity, None, None,
                                                                               1e-6))[0], out_unfused)
        # the unfused call once more (is one launch deterministic?), and with the new K/V stored first
        res["out_unfused_again"] = diff(attend(qc, (kc, v, loc))[0], out_unfused)
        res["out_store_first"] = diff(attend(qc, None)[0], out_unfused)
    res["k_stored"] = diff(k_fused[loc], k_unfused[loc])
    res["out"] = diff(out_fused, out_unfused)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("fused_rope_bits: no CUDA device, nothing to compare")
        return
    from minisgl.bench.runner import environment

    cases = []
    for (model, (hq, hkv, d)), bs, splits, early in itertools.product(SHAPES.items(), (1, 8), (1, 4), (False, True)):
        r = compare(hq, hkv, d, bs, splits, early, seed=len(cases))
        r["model"] = model
        cases.append(r)
        print(model, bs, splits, early, {k: r[k]["elements_differing"] for k in ("k_stored", "out", "out_identity_rope",
                                                                "out_unfused_again", "out_store_first")}, flush=True)
    res = {"environment": environment(), "command": "python -m lab.checks.fused_rope_bits", "cases": cases,
           "all_equal": all(c["out"]["equal"] and c["k_stored"]["equal"] for c in cases)}
    path = Path(a.out) / "fused_rope_bits.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
