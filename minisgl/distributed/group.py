"""Tensor parallelism, the processes: one per rank, started by rank 0, stopped together.

Rank 0 is the engine's own process: it runs the scheduler, the radix cache and its own slice of the model. It starts
ranks 1..N-1 with torch.multiprocessing (spawn), each building a model runner of the class rank 0's runner passes in
(`worker`: this module never imports the engine) and running its `loop`. Each step rank 0 sends them the batch it is
about to run (a slim, pickled copy of the host lists `ModelRunner.prepare` reads, plus the request-table writes as
`ReqToTokenPool.take_writes` packs them) through one pipe per rank; every rank then runs the same forward, meeting
the others in the all-reduces of torch.distributed (NCCL on GPUs, gloo on a CPU). Every rank sees the full logits
and samples the same tokens (the sampler is a pure function of logits and seeds), so the overlap loop's on-device
tokens exist on every rank without more traffic.

Pipes carry the control messages: they need no timeout while a server idles, and a closed pipe tells a
rank at once that its peer is gone. Failure handling, so no process is ever left behind:
- a rank that fails sends its traceback to rank 0 and exits; a monitor thread on rank 0 sees any rank exit,
  stops the others and marks the engine dead; the step in progress and every later one raise a RuntimeError
  that names the rank;
- ranks 1..N-1 exit when rank 0's process goes away (pipe closed, or parent pid changed);
- `close()` (LLM.close, __del__, atexit) stops them in order, then kills whatever did not stop.
"""

from __future__ import annotations

import atexit
import os
import pickle
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import wait
from typing import NamedTuple

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.environment import keep_nvlink_multicast_off
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import Batch

_LIVE: weakref.WeakSet = weakref.WeakSet()
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # ranks meet in collectives only inside a step or at start-up


class ReqView(NamedTuple):
    """The fields of a Req that ModelRunner.prepare reads: what ranks 1..N-1 need to run a step. (A field that
    prepare starts to read must be added here, or ranks 1..N-1 fail with an AttributeError naming it.)"""

    row: int
    seed: int
    num_outputs_scheduled: int
    params: SamplingParams


def slim_batch(batch: Batch) -> Batch:
    reqs = [ReqView(r.row, r.seed, r.num_outputs_scheduled, r.params) for r in batch.reqs]
    return Batch(batch.step_id, reqs, batch.prefix_lens, batch.extend_lens, batch.out_cache_loc, batch.sample_rows)


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        import signal
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TensorParallel:
    """This process's place in the tensor-parallel group; rank 0's instance also owns ranks 1..N-1."""

    def __init__(self, config: EngineConfig, rank: int, device: torch.device, link: tuple | None = None,
                 worker: type | None = None) -> None:
        """Rank 0: start ranks 1..N-1 and the group, each rank running `worker(config, rank=r, tp_link=...).loop()`
        (the model runner's class). Rank r > 0: `link` = (pipe to rank 0, store port)."""
        self.config, self.rank, self.world = config, rank, config.tp_size
        self.worker = worker
        self.procs: list = []  # rank 0: the processes of ranks 1..N-1
        self.conns: list = []  # rank 0: a pipe to each; rank r > 0: [the pipe to rank 0]
        self.error: str | None = None  # rank 0: why the group is dead
        self.closed = False
        self._monitor: threading.Thread | None = None
        self._lock = threading.Lock()
        keep_nvlink_multicast_off()  # ranks 1.. inherit it
        if device.type == "cuda":
            if torch.cuda.device_count() < self.world:
                raise ValueError(f"tp_size {self.world} needs {self.world} GPUs; {torch.cuda.device_count()} visible")
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = device
        if rank == 0:
            try:
                self._start_group()
            except BaseException:
                self._stop_procs(graceful=False)
                _LIVE.discard(self)
                raise
        else:
            conn, port = link
            self.conns = [conn]
            self._join_group(port)

    # --- start-up ------------------------------------------------------------------------------------
    def _start_group(self) -> None:
        from minisgl.distributed.shard import check_tp_model
        from minisgl.loader import read_hf_config, resolve_model_path
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process; "
                               "one tensor-parallel engine per process")
        # fail before starting anything when the model cannot be split this way (or its config.json is broken)
        check_tp_model(read_hf_config(resolve_model_path(self.config.model)), self.world)
        store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, timeout=_COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        _LIVE.add(self)
        for r in range(1, self.world):
            ours, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_rank_main, args=(self.worker, self.config, r, store.port, theirs, os.getpid()),
                            name=f"minisgl-tp-rank{r}", daemon=True)
            p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(ours)
        self._expect("joining")
        self._init_backend(store)

    def _join_group(self, port: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, self.world, is_master=False, timeout=_COLLECTIVE_TIMEOUT)
        self.conns[0].send(("joining",))
        self._init_backend(store)

    def _init_backend(self, store) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=_COLLECTIVE_TIMEOUT)

    def _expect(self, tag: str) -> None:
        """Rank 0: wait until every rank reports `tag`; raise naming the rank that failed or died instead."""
        for r, (p, c) in enumerate(zip(self.procs, self.conns), start=1):
            while True:
                ready = wait([c, p.sentinel])
                if c in ready:
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        msg = ("died",)
                    if msg[0] == tag:
                        break
                    if msg[0] == "error":
                        self._fail(f"tensor-parallel rank {r} failed while starting:\n{msg[1]}")
                        raise RuntimeError(self.error)
                    if msg[0] != "died":
                        continue
                p.join(5)
                self._fail(f"tensor-parallel rank {r} (pid {p.pid}) {_exit_reason(p.exitcode)} while starting")
                raise RuntimeError(self.error)

    # --- what ModelRunner calls ------------------------------------------------------------------------
    def shard(self, model, cfg):
        from minisgl.distributed.shard import shard_model
        if self.rank == 0:
            self._expect("loaded")  # every rank has its weights: a load error surfaces here, not as a hang
        else:
            self.conns[0].send(("loaded",))
        return shard_model(model, cfg, self.rank, self.world)

    def agree_num_pages(self, num_pages: int) -> int:
        """Rank 0 hands out page numbers for every rank: each pool gets the smallest size of them all."""
        return self.agree_min(num_pages)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (sizes each rank measured from its own free memory)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except Exception as e:  # the first collective: a rank that died loading shows up here
            if self.rank == 0:
                raise RuntimeError(self._diagnose(e)) from e
            raise
        return int(t.item())

    def ready(self) -> None:
        if self.rank == 0:
            self._expect("ready")
            self._monitor = threading.Thread(target=self._watch, name="minisgl-tp-monitor", daemon=True)
            self._monitor.start()
        else:
            self.conns[0].send(("ready",))

    def run_step(self, batch: Batch, writes: tuple, step: Callable[[], object]):
        """Rank 0: send the batch and its request-table writes to the other ranks, then run our part of it
        (`step`); a dead rank -> RuntimeError naming it."""
        if self.error is not None:
            raise RuntimeError(self.error)
        msg = pickle.dumps(("step", slim_batch(batch), writes), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns:
                c.send_bytes(msg)
            return step()
        except BaseException as e:  # Ctrl-C too: the other ranks may wait in a collective we never reach
            message = self._diagnose(e)
            if isinstance(e, Exception):
                raise RuntimeError(message) from e
            raise

    def steps(self) -> Iterator[tuple[Batch, tuple]]:
        """Rank r > 0: the (batch, request-table writes) of each step rank 0 sends, until it says stop or goes
        away."""
        conn = self.conns[0]
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return  # rank 0 is gone
            if msg[0] == "stop":
                return
            _, batch, writes = msg
            yield batch, writes

    def _diagnose(self, e: Exception) -> str:
        """After a failed step: name the rank that died (its exit shows a moment after its sockets close).
        Any failure ends the group: the other ranks may be waiting in a collective this rank never reached."""
        wait([p.sentinel for p in self.procs], timeout=0.5)
        with self._lock:
            if self.error is None:
                dead = [(r, p) for r, p in enumerate(self.procs, start=1) if not p.is_alive()]
                self._fail_locked(self._death_message(*dead[0]) if dead else
                                  f"tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the engine "
                                  "has stopped (every rank was shut down)")
        return self.error

    # --- failure and shutdown ---------------------------------------------------------------------------
    def _death_message(self, r: int, p) -> str:
        p.join(1)
        detail = ""
        c = self.conns[r - 1]
        try:
            if c.poll(0):
                msg = c.recv()
                if msg and msg[0] == "error":
                    detail = ":\n" + msg[1]
        except (EOFError, OSError):
            pass
        return (f"tensor-parallel rank {r} (pid {p.pid}) {_exit_reason(p.exitcode)}{detail}; the engine has "
                "stopped (every rank was shut down)")

    def _watch(self) -> None:
        """Rank 0's monitor thread: the first rank to exit unasked ends the group."""
        sentinels = {p.sentinel: (r, p) for r, p in enumerate(self.procs, start=1)}
        while sentinels and not self.closed:
            for s in wait(list(sentinels), timeout=1.0):
                r, p = sentinels.pop(s)
                with self._lock:
                    if self.closed or self.error is not None:
                        return
                    self._fail_locked(self._death_message(r, p))
                return

    def _fail(self, message: str) -> None:
        with self._lock:
            self._fail_locked(message)

    def _fail_locked(self, message: str) -> None:
        if self.error is None:
            self.error = message
        self._stop_procs(graceful=False)
        self._abort_collectives()

    def _abort_collectives(self) -> None:
        # NCCL would block a collective with a dead peer until its timeout; abort it (gloo notices by itself)
        if self.device.type == "cuda" and dist.is_initialized():
            try:
                dist.distributed_c10d._get_default_group()._get_backend(self.device).abort()
            except Exception:
                pass

    def _stop_procs(self, graceful: bool) -> None:
        if graceful:
            for c in self.conns:
                try:
                    c.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    pass
            deadline = time.monotonic() + 10
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def close(self) -> None:
        """Stop every rank and leave the process group; safe to call more than once."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.rank == 0:
                self._stop_procs(graceful=self.error is None)
                for c in self.conns:
                    c.close()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:
                    pass
        _LIVE.discard(self)


@atexit.register
def _close_all() -> None:
    for tp in list(_LIVE):
        tp.close()


def _watch_parent(parent_pid: int) -> None:
    # A rank blocked in a collective would not see its pipe close; the parent's pid changing says it all.
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _rank_main(worker: type, config: EngineConfig, rank: int, port: int, conn, parent_pid: int) -> None:
    """Entry point of ranks 1..N-1: build this rank's model runner (`worker`), then run its loop."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    keep_nvlink_multicast_off()
    runner = None
    try:
        if config.device != "cuda" and not (config.device == "auto" and torch.cuda.is_available()):
            # the ranks share the CPU cores; oversubscribing threads makes every rank slower
            torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // config.tp_size)))
        runner = worker(config, rank=rank, tp_link=(conn, port))
        runner.loop()
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    if runner is not None and runner.tp is not None:
        runner.tp.close()
    os._exit(0)
