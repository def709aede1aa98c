"""kernels/staging.py under the Triton interpreter: the one kernel that stages a decode step's inputs does what
the copy, the scatter and the gather did, and the tokens' kernel copy is a copy."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and any kernel module) is imported

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed (the GPU kernels are optional)")

from helpers import kernel_options, use_triton_interpreter  # noqa: E402

use_triton_interpreter("minisgl.kernels.elementwise", "minisgl.kernels.staging")

from minisgl.kernels import staging  # noqa: E402


def _step(gen: torch.Generator, rows: int, width: int, k: int, bs: int):
    """A host block as a staged step fills it: random rows, k table writes (distinct flat indices) and bs
    token-table indices; the device block holds stale values from an earlier step."""
    host = torch.randint(-2**40, 2**40, (rows, width), generator=gen)
    table = torch.randint(0, 1000, (6, 50), generator=gen, dtype=torch.int32)
    host[1, :k] = torch.randperm(table.numel(), generator=gen)[:k]
    host[2].view(torch.int32)[:k] = torch.randint(0, 10**6, (k,), generator=gen, dtype=torch.int32)
    token_table = torch.randint(0, 150000, (400,), generator=gen)
    host[3, :bs] = torch.randint(0, 400, (bs,), generator=gen)
    block = torch.randint(-5, 5, (rows, width), generator=gen)
    return host, block, table, token_table


@pytest.mark.parametrize("k,bs", [(0, 1), (3, 1), (1, 8), (12, 5), (40, 40)])
def test_stage_in_kernel_does_what_the_copies_did(k, bs):
    gen = torch.Generator().manual_seed(k * 100 + bs)
    rows, width = 5, 40
    host, block, table, token_table = _step(gen, rows, width, k, bs)
    results = {}
    for on in (False, True):
        b, t, ids = block.clone(), table.clone(), torch.full((bs,), -1)
        with kernel_options(zero_copy_io=on, triton_on_cpu=True):
            staging.stage_in(host, b, max(bs, k), (1, 2, k), t, (3, token_table, ids))
        results[on] = b, t, ids
    (b_off, t_off, ids_off), (b_on, t_on, ids_on) = results[False], results[True]
    cols = max(bs, k)
    assert torch.equal(b_on[:, :cols], host[:, :cols]) and torch.equal(b_off, host)
    assert torch.equal(b_on[:, cols:], block[:, cols:])  # only the step's columns travel
    assert torch.equal(t_on, t_off) and torch.equal(ids_on, ids_off)
    assert torch.equal(ids_on, token_table[host[3, :bs]])
    assert (t_on != table).sum() <= k and torch.equal(t_on.view(-1)[host[1, :k]], host[2].view(torch.int32)[:k])


@pytest.mark.parametrize("n", [1, 7, 1500])
def test_copy_to_host_copies(n):
    src = torch.randint(0, 150000, (n,))
    for on in (False, True):
        with kernel_options(zero_copy_io=on, triton_on_cpu=True):
            out = staging.copy_to_host(src)
        assert out.dtype == src.dtype and torch.equal(out, src) and out.data_ptr() != src.data_ptr()
