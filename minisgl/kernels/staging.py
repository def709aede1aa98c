"""A decode step's way in and out of the GPU without the copy engine (kernel option `zero_copy_io`).

A staged decode step (engine/staged_graph.py) writes its host arrays into a pinned block, and the GPU then ran a
copy of that block, a scatter of the table writes and a gather of the input ids; after the graph, a copy of the
tokens back into pinned memory. Copies go through the copy engine, kernels through the compute engine, and each
hand-over between the two waits for the other to finish and signal: on an H100 profile (reports/h100/run36) about
5 us of idle GPU at each of the three. Pinned host memory is mapped into the GPU's address space, so a kernel can
read it and write it directly over PCIe. Here one kernel reads the host block, fills the device block's first
`cols` columns, applies the table writes and gathers the input ids, and another writes the tokens into pinned
memory: every step boundary stays on the compute engine.

Each op has a torch version (the copy engine's, what the option off runs, and the CPU path); the Triton kernel
runs for CUDA tensors, or any under the option `triton_on_cpu` (the interpreter, in tests).
"""

from __future__ import annotations

import torch

from minisgl.kernels.elementwise import _jit, use_triton
from minisgl.kernels.options import current_options

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the torch versions
    triton = None
    tl = None

__all__ = ["copy_to_host", "stage_in"]

_BLOCK = 1024


# No integer argument is specialised (on 1 or multiples of 16): one variant whatever the step's sizes, which the
# engine's warm-up compiles at start (engine/warmup.py), not inside a first workload.
@_jit(do_not_specialize=["width", "cols", "num_copy", "at_row", "val_row", "num_writes", "src_row", "bs"])
def _stage_in_kernel(host_ptr, host32_ptr, block_ptr, width, cols, num_copy, at_row, val_row, num_writes, table_ptr,
                     src_row, token_table_ptr, input_ids_ptr, bs, BLOCK: tl.constexpr):
    # three independent jobs over one index range: no value written here is read here
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    copy = i < num_copy  # the first `cols` int64 words of every row of the block
    r = i // cols
    c = i % cols
    tl.store(block_ptr + r * width + c, tl.load(host_ptr + r * width + c, mask=copy), mask=copy)
    write = i < num_writes  # table[at] = val, both read from the host block (int64 flat index, int32 value)
    at = tl.load(host_ptr + at_row * width + i, mask=write, other=0)
    val = tl.load(host32_ptr + val_row * 2 * width + i, mask=write, other=0)
    tl.store(table_ptr + at, val.to(table_ptr.dtype.element_ty), mask=write)
    gather = i < bs  # input_ids[j] = token_table[src[j]]
    src = tl.load(host_ptr + src_row * width + i, mask=gather, other=0)
    tl.store(input_ids_ptr + i, tl.load(token_table_ptr + src, mask=gather, other=0), mask=gather)


@_jit(do_not_specialize=["n"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def stage_in(host: torch.Tensor, block: torch.Tensor, cols: int, writes: tuple[int, int, int],
             table: torch.Tensor, gather: tuple[int, torch.Tensor, torch.Tensor]) -> None:
    """One staged step's inputs onto the device. `host` (pinned) and `block`: int64 [rows, width]; the first
    `cols` columns of every row are copied. `writes` = (row of flat table indices, row of int32 values as the
    first half of its int64 row, count): `table.view(-1)[at] = val`. `gather` = (row of token-table indices,
    token table (flat), input ids [bs]): `input_ids = token_table[src[:bs]]`. Everything is read from `host`,
    so the three jobs do not depend on each other."""
    at_row, val_row, k = writes
    src_row, token_table, input_ids = gather
    bs = input_ids.shape[0]
    if not (use_triton(block) and current_options().zero_copy_io):  # the copy engine: the whole block, then two ops
        block.copy_(host, non_blocking=True)
        if k:
            table.view(-1)[block[at_row, :k]] = block[val_row].view(torch.int32)[:k]
        torch.index_select(token_table, 0, block[src_row, :bs], out=input_ids)
        return
    rows, width = host.shape
    assert block.shape == host.shape and host.is_contiguous() and block.is_contiguous() and cols <= width
    num_copy = rows * cols
    _stage_in_kernel[(triton.cdiv(max(num_copy, k, bs), _BLOCK),)](
        host, host.view(torch.int32), block, width, cols, num_copy, at_row, val_row, k, table, src_row, token_table,
        input_ids, bs, BLOCK=_BLOCK)


def copy_to_host(src: torch.Tensor) -> torch.Tensor:
    """A new host tensor (pinned, for a GPU's `src`) holding `src` (contiguous), once the stream gets there: written
    by a kernel with the option on, by a copy (the copy engine's, on a GPU) off.

    The caching host allocator knows of a copy's pending use of the tensor, not of a kernel's: the caller keeps the
    tensor alive until the stream has passed the kernel (an event), or a later owner of the memory could have its
    host writes overwritten by this kernel."""
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
    if use_triton(src) and current_options().zero_copy_io:
        n = src.numel()
        _copy_kernel[(max(1, triton.cdiv(n, _BLOCK)),)](src, host, n, BLOCK=_BLOCK)
    else:
        host.copy_(src, non_blocking=True)
    return host
