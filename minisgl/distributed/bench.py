"""Time an all-reduce between processes, on this machine: what one tensor-parallel sync costs here."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def _rank(rank: int, world: int, port: int, numels: list[int], iters: int, backend: str, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    times = []
    for n in numels:
        x = torch.ones(n, dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_seconds(nbytes: list[int], world: int = 2, iters: int = 20, backend: str = "gloo") -> list[float]:
    """Mean seconds of one all-reduce of each size (float32 tensors), over `world` spawned
    processes. Spawning costs a few seconds (each process imports torch)."""
    ctx = torch.multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    q = ctx.Queue()
    numels = [max(1, b // 4) for b in nbytes]
    procs = [ctx.Process(target=_rank, args=(r, world, store.port, numels, iters, backend, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        return q.get(timeout=600)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
